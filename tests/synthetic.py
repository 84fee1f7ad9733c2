"""Saved runs made by hand, for the tests of what reads them (report, compare, simulate, the gate).

Records are built through the suite's own path: a ``Measurement`` of known round times (every rank
at the round's time, unless told) is summarised by ``ddp.bench.rounds.summary`` and written as
pytest-benchmark JSON by ``ddp.bench.results.benchmark_json``, exactly as a run would write them; so a
figure a test checks (an overhead, a ratio, an interval) is the suite's arithmetic on numbers the
test chose.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ddp.bench.collectives.timeline import cpu_partition
from ddp.bench.config.options import RoundOptions
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.state import StateMemory
from ddp.bench.results.benchmark_json import allreduce_entry, race_entry, run_document, step_entry
from ddp.bench.results.records import AllReduceRecord, StepRecord
from ddp.bench.rounds.loop import Measurement
from ddp.bench.rounds.summary import race_record, step_record
from ddp.bench.rounds.trainer import StepSetup, StepTiming
from ddp.strategies.registry import FLOOR, traits

ROUNDS = RoundOptions(min_rounds=3, max_rounds=3, warmup_rounds=1, target_precision=0.02, budget_seconds=10.0)
MIB = 2**20


def config(strategy: str, model: str = "tiny", batch_size: int = 2, seq_len: int = 32, **values) -> StepConfig:
    """A configuration; members (``bucket_size_mb``, ...) apply only where the strategy takes them."""
    return StepConfig.of(strategy, {"model": model, "batch_size": batch_size, "seq_len": seq_len, **values})


def _setup(config: StepConfig, rank: int, num_parameters: int, bucket_sizes: list[int] | None,
           memory: StateMemory | None) -> StepSetup:
    communicates = traits(config.strategy).communicates
    calls = len(bucket_sizes) if bucket_sizes else (1 if communicates else 0)
    return StepSetup(rank, num_parameters, 9, bucket_sizes, calls, 4 * num_parameters if communicates else 0, memory)


def step(config: StepConfig, rounds: list[float], *, exposed: float | list[float] = 0.0, local_rounds: list[float] | None = None,
         backend: str = "gloo", device: str = "cpu", world_size: int = 2, num_parameters: int = 655_360,
         bucket_sizes: list[int] | None = None, memory: list[StateMemory] | None = None,
         peak_bytes: int | None = None, traces: list[list[RecordedStep]] | None = None,
         groups: int | list[int] = 1) -> StepRecord:
    """A step record of ``config`` with these rounds (seconds, the slowest rank's), each with
    ``exposed`` seconds of timed wait for gradients (``sync_wait_seconds``); paired with ``local_rounds`` when given;
    ``traces``: each rank's traced steps (``ddp.bench.collectives.recording``); ``groups``: each round's group
    of ranks, or their number (the rounds in that many blocks in order, as the suite spreads them)."""
    if isinstance(groups, int):
        groups = [index * groups // len(rounds) for index in range(len(rounds))]
    exposed = exposed if isinstance(exposed, list) else [exposed] * len(rounds)
    configs = [config] + ([config.local_twin()] if local_rounds is not None else [])
    per_config = [rounds] + ([local_rounds] if local_rounds is not None else [])
    waits = [exposed] + ([[0.0] * len(local_rounds)] if local_rounds is not None else [])
    timings = [
        [[StepTiming(rank, seconds[index], wait[index], peak_bytes) for rank in range(world_size)]
         for seconds, wait in zip(per_config, waits)]
        for index in range(len(rounds))
    ]
    setups = [[_setup(c, rank, num_parameters, bucket_sizes, None if memory is None else memory[rank])
               for rank in range(world_size)] for c in configs]
    if traces is not None:  # each traced step with the partition the suite gives it on CPU
        traces = [[step if step.timeline else replace(step, timeline=cpu_partition(step)) for step in steps] for steps in traces]
    traced = None if traces is None else [traces] + [[[] for _ in range(world_size)]] * (len(configs) - 1)
    measurement = Measurement(configs, setups, timings, 0.0, ROUNDS.target_precision, traced, round_groups=list(groups))
    return step_record(measurement, backend, device, 0, 1 if local_rounds is not None else None)


def step_benchmark(record: StepRecord) -> dict:
    """The record as perf_tests/test_step.py saves it."""
    return step_entry(record.config, record, ROUNDS)


def race_benchmark(contenders: list[str], rounds: dict[str, list[float]], **values) -> dict:
    """A race of ``local`` and ``contenders`` (the last the reference) with these rounds per strategy."""
    names = [FLOOR, *contenders]
    configs = [config(name, **values) for name in names]
    timings = [[[StepTiming(rank, rounds[name][index], 0.0, None) for rank in range(2)] for name in names]
               for index in range(len(rounds[FLOOR]))]
    setups = [[_setup(c, rank, 655_360, None, None) for rank in range(2)] for c in configs]
    record = race_record(Measurement(configs, setups, timings, 0.0, 1.0), "gloo", contenders[-1])
    return race_entry(record, ROUNDS)


def allreduce_benchmark(world_size: int, size_mb: float, seconds: float, backend: str = "gloo") -> dict:
    size = int(size_mb * MIB)
    algbw = size / seconds / 1e9
    record = AllReduceRecord(
        backend=backend, world_size=world_size, size_bytes=size, seconds=seconds, seconds_ci95=[seconds, seconds],
        round_seconds=[seconds] * 3, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world_size - 1) / world_size, wrong=0,
    )
    return allreduce_entry(record, size_mb, ROUNDS)


def machine(node: str = "bench-a", torch_version: str = "2.13.0+cpu", backend: str = "gloo", device: str = "cpu",
            gpu: str | None = None) -> dict:
    """A run's machine info, as pytest-benchmark and ``ddp.bench.results.machine.software_info`` write it."""
    bench = {"torch": torch_version, "backend": backend, "device": device, "world_size": 2}
    if gpu is not None:
        bench.update(gpu=gpu, gpu_count=1, cuda="13.0", nccl="2.27.3")
    return {"node": node, "system": "Linux", "release": "6.1", "python_version": "3.11.7",
            "cpu": {"brand_raw": "AMD EPYC", "count": 2}, "ddp_bench": bench}


def run_json(benchmarks: list[dict], **machine_facts) -> dict:
    """A whole run, as ``--benchmark-json`` writes it."""
    document = run_document(machine(**machine_facts), benchmarks)
    document.update(commit_info={"id": "0123456789abcdef", "dirty": False, "branch": "main"}, datetime="2026-11-21T12:00:00")
    return document


def write(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def strategy_benchmark(name: str, rounds: list[float], local: list[float] | None = None, groups: int | list[int] = 2) -> dict:
    """A step benchmark of strategy ``name`` (not checked: a saved run may name any) with these rounds,
    paired with ``local``'s when given, spread over ``groups`` groups of ranks (in blocks) or as given."""
    config = StepConfig.from_dict({"strategy": name, "model": "mini", "batch_size": 4, "seq_len": 64})
    return step_benchmark(step(config, rounds, local_rounds=local, groups=groups))
