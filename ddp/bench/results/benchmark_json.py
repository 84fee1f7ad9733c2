"""Runs measured outside pytest (``ddp run`` under torchrun, ``ddp versus --json``), written as
pytest-benchmark writes ``--benchmark-json``: benchmarks under perf_tests' names and groups, their
stats computed by pytest-benchmark's own ``Stats`` from the measured rounds, their options those
ddp-bench gives pytest-benchmark's marker in a pytest run (``ddp.bench.results.timing.benchmark_options``:
the round clock, the rounds and budget they were measured under), the record in ``extra_info``.
So ``ddp compare``, ``ddp report`` and ``ddp simulate`` read such a run like a pytest one."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from pytest_benchmark import __version__ as pytest_benchmark_version
from pytest_benchmark.stats import Stats
from pytest_benchmark.utils import funcname, get_commit_info

from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.records import AllReduceRecord, RaceRecord, RunFileError, StepRecord, to_extra_info
from ddp.bench.results.timing import benchmark_options

# The test file and function whose results step and all-reduce rows stand for: comparisons match
# benchmarks on their names, the same for a pytest run and a torchrun run.
STEP_TEST = "perf_tests/test_step.py::test_step"
ALLREDUCE_TEST = "perf_tests/test_allreduce.py::test_allreduce"
RACE_TEST = "perf_tests/test_versus_torch.py::test_versus"


def benchmark_entry(name: str, fullname: str, group: str, param: str, params: dict, record, round_seconds: list[float],
                    rounds) -> dict:
    """One benchmark as pytest-benchmark saves it; ``rounds``: the ``RoundOptions`` it was measured under."""
    stats = Stats()
    for seconds in round_seconds:
        stats.update(seconds)
    options = {key: funcname(value) if callable(value) else value for key, value in benchmark_options(rounds).items()}
    return {
        "group": group, "name": name, "fullname": fullname, "params": params, "param": param,
        "extra_info": to_extra_info(record), "options": options,
        "stats": {**stats.as_dict(), "data": list(round_seconds), "iterations": 1},
    }


def step_entry(config: StepConfig, record: StepRecord, rounds) -> dict:
    """A step benchmark under perf_tests/test_step.py's names."""
    return benchmark_entry(
        f"test_step[{config.test_id}]", f"{STEP_TEST}[{config.test_id}]", config.group_name, config.test_id,
        {"step_config": f"UNSERIALIZABLE[{config!r}]"}, record, record.round_seconds, rounds,
    )


def allreduce_group_name(backend: str, world_size: int) -> str:
    """The benchmark group of the all-reduces of one backend and world size."""
    return f"all_reduce: {backend}, {world_size} ranks"


def allreduce_entry(record: AllReduceRecord, size_mb: float, rounds) -> dict:
    """An all-reduce benchmark under perf_tests/test_allreduce.py's names."""
    param = f"n{record.world_size}-{size_mb:g}mb"
    return benchmark_entry(
        f"test_allreduce[{param}]", f"{ALLREDUCE_TEST}[{param}]", allreduce_group_name(record.backend, record.world_size), param,
        {"allreduce_world_size": record.world_size, "allreduce_size_mb": size_mb}, record, record.round_seconds, rounds,
    )


def race_id(configs: list[StepConfig]) -> str:
    """``bucketed-torch-b16-s1-bucket25mb``: the contenders (``local``, first, left out), then what
    they share as test ids name it (the last contender's configuration, without its strategy)."""
    reference = configs[-1]
    return "-".join([*(c.strategy for c in configs[1:]), reference.test_id[len(reference.strategy) + 1:]])


def race_group_name(configs: list[StepConfig]) -> str:
    """The benchmark group of a race: ``versus: model mlp, batch 16, seq len 1``."""
    return f"versus: {configs[-1].group_label()}"


def race_entry(record: RaceRecord, rounds) -> dict:
    """A race under perf_tests/test_versus_torch.py's names (``ddp versus --json``)."""
    param = race_id(record.configs)
    return benchmark_entry(f"test_versus[{param}]", f"{RACE_TEST}[{param}]", race_group_name(record.configs), param,
                           {"race_configs": param}, record, record.round_seconds[record.primary], rounds)


def run_document(machine_info: dict, benchmarks: list[dict]) -> dict:
    """A whole saved run in pytest-benchmark's format, as ``--benchmark-json`` writes it."""
    return {
        "machine_info": machine_info, "commit_info": get_commit_info(), "benchmarks": benchmarks,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": pytest_benchmark_version,
    }


def write_new(path: Path, document: dict) -> None:
    """Write a run to ``path``, which must not exist: nothing a user saved is overwritten."""
    if path.exists():
        raise RunFileError(f"{path} exists: give a new path (nothing saved is overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=4))
