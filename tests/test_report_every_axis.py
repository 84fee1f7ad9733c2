"""``ddp report`` and every plot render for runs that hold every value of every axis.

The runs are synthetic (``tests.synthetic``: records made by the suite's own summary and writer)
and generated from the declarations themselves (``ddp.bench.config.step_config.AXES``): each value of every
option and member axis (each precision, each AdamW, bf16 gradient communication, ...; the options'
values met pair by pair, 6 of their 24 combinations, which renders in a quarter of the time), every
registered strategy, the sharded ones included, and a user's class; with memory counted; once on
CPU and once on a GPU whose name gives an MFU; with a race, all-reduces, a comparison, the
profile timelines and the scaling plot. An axis added later is covered without an edit here. This
is the check that a ``NameError`` on a code path only some runs take (every multi-precision or
MFU report, once) cannot come back unseen.
"""

from __future__ import annotations

import itertools

import pytest

from ddp.analysis import plots, timeline
from ddp.analysis.costmodel import Compute, Link, predict_grid
from ddp.analysis.markdown import write_report
from ddp.bench.config.step_config import AXES, expand
from ddp.bench.memory.state import StateMemory
from ddp.bench.results.records import load_run
from ddp.strategies.registry import FLOOR, STRATEGIES, takes_bucket_size, traits
from tests import synthetic

pytestmark = pytest.mark.slow  # a minute or more on 2 cores: CI runs it with -m slow

USER_CLASS = "examples.toy:AveragingDDP"
GPU = "NVIDIA H100 80GB HBM3"  # in ddp.bench.results.flops.PEAK_TFLOPS: MFU is given


def covering_rows(axes: dict[str, tuple]) -> list[dict]:
    """Rows of one value per axis in which every value of every axis, and every pair of values of
    two axes, appears at least once: each row the one of the full product that covers the most
    not yet covered (greedy). 6 rows cover the option axes' 24 combinations pair by pair."""
    names = list(axes)

    def covers(row: dict) -> set:
        return {((a, row[a]),) for a in names} | {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    candidates = [dict(zip(names, values)) for values in itertools.product(*axes.values())]
    uncovered = set().union(*map(covers, candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: len(covers(row) & uncovered))
        rows.append(best)
        uncovered -= covers(best)
    return rows


def every_configuration() -> list:
    """Every value of every option and member axis (the options' values pair by pair,
    ``covering_rows``; the members' every combination), every registered strategy and a user's
    class."""
    options = {name: axis.choices or axis.cpu for name, axis in AXES.items() if axis.role == "option"}
    members = {name: axis.choices or axis.cpu for name, axis in AXES.items() if axis.role == "member"}
    # two batch sizes: two groups a figure, each its own colour and floor
    members.update(strategy=(*STRATEGIES, USER_CLASS), model=("tiny",), batch_size=(2, 4), seq_len=(32,), bucket_size_mb=(1.0, 10.0))
    configs = [config for row in covering_rows(options) for config in expand({**members, **{k: (v,) for k, v in row.items()}})]
    return list(dict.fromkeys(configs))


def benchmarks(device: str) -> list[dict]:
    steps = []
    for index, config in enumerate(every_configuration()):
        seconds = 0.1 if config.strategy == FLOOR else 0.12 + 0.001 * index
        memory = [StateMemory(4 * 2**20, 4 * 2**20, 8 * 2**20 + rank) for rank in range(2)]
        peak = 20 * 2**20 if device != "cpu" else None
        record = synthetic.step(config, [seconds * f for f in (0.98, 1.0, 1.03)], exposed=0.0 if config.strategy == FLOOR else 0.01,
                                local_rounds=None if config.strategy == FLOOR else [0.1] * 3, device=device,
                                bucket_sizes=[2**20, 2**19] if config.bucket_size_mb is not None else None,
                                memory=memory, peak_bytes=peak)
        steps.append(synthetic.step_benchmark(record))
    rounds = {FLOOR: [0.1] * 3, "bucketed": [0.12] * 3, "torch": [0.15] * 3}
    race = synthetic.race_benchmark(["bucketed", "torch"], rounds, bucket_size_mb=25.0)
    return [*steps, race, synthetic.allreduce_benchmark(2, 1, 0.01), synthetic.allreduce_benchmark(2, 10, 0.05)]


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_every_axis_value_renders_in_the_report_and_its_plots(tmp_path, device):
    facts = {"backend": "gloo", "device": "cpu"} if device == "cpu" else {"backend": "nccl", "device": "cuda", "gpu": device}
    old = synthetic.write(tmp_path / "old.json", synthetic.run_json(benchmarks(device), **facts))
    new = synthetic.write(tmp_path / "new.json", synthetic.run_json(benchmarks(device), **facts))
    report = write_report([old, new], tmp_path / "report").read_text()
    run = load_run(new)
    configs = every_configuration()
    assert len(run.steps) == len(configs) and len(run.races) == 1 and len(run.allreduces) == 2

    for title in ("## Machine", "## Commentary", "## Comparison", "## Time per step", "## By precision and options",
                  "## Achieved TFLOP/s and MFU", "## Overhead over `local`", "## Memory per rank", "## Sharding",
                  "## By bucket size", "## Races", "## All-reduce", "## Plots"):
        assert title in report, title
    for config in configs:  # every strategy with its members, and every variant, is named
        assert f"| {config.label} " in report, config.label
        assert config.variant in report, config.variant
    if device == GPU:
        mfus = [s.mfu for s in run.steps]
        assert all(m is not None and m > 0 for m in mfus) and "MFU -" not in report
        paired = [s for s in run.steps if s.local_round_seconds is not None]
        assert paired and all(s.local_mfu is not None and s.mfu_lost_points_ci95 for s in paired)
        assert "points lost to synchronization [95%]" in report
    else:
        assert all(s.mfu is None for s in run.steps)
    assert "not stated" in report  # the user's class says nothing of what it shards
    images = sorted((tmp_path / "report").glob("*.png"))
    variants = {c.variant.replace(" ", "_") for c in configs}  # a figure of step against bucket cap for each
    assert {p.name for p in images} == {"report_allreduce.png", "report_compute_vs_comm.png",
                                        *(f"report_step_vs_bucket_seq32_{v}.png" for v in variants)}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in images)


def test_the_profile_timelines_and_the_scaling_plot_render(tmp_path):
    def step(start: float, exposed: float) -> dict:
        collective = {"name": "all_reduce", "size_bytes": 4 * 2**20, "launch_seconds": start + 0.5, "done_seconds": start + 1.2 + exposed}
        return {"forward": [start, start + 0.3], "backward": [start + 0.3, start + 1.0], "backward_compute_end": start + 1.0,
                "gradient_sync": [start + 1.0, start + 1.2 + exposed], "optimizer": [start + 1.2 + exposed, start + 1.4 + exposed],
                "collectives": [collective]}

    records = [
        {"strategy": name, "comm_seconds": 0.7, "overlap_fraction": 0.7, "exposed_comm_seconds": 0.2, "slowest_rank": 0,
         "comm_source": "collective_records", "ranks": [{"rank": r, "steps": [step(0.0, 0.1 * r), step(2.0, 0.0)]} for r in range(2)]}
        for name in ("naive", "bucketed", USER_CLASS)
    ]
    drawn = [timeline.plot_timeline(record, tmp_path / f"timeline_{index}.png") for index, record in enumerate(records)]
    drawn.append(timeline.plot_timelines(records, tmp_path / "timeline_combined.png"))
    strategies = [(name, 25.0 if takes_bucket_size(name) else None) for name in STRATEGIES if traits(name).communicates]
    predictions = predict_grid("tiny", {(2, 32): Compute(0.1)}, strategies, [2, 8, 64], Link("l", 1e-5, 1e9), 0.0)
    assert {p.strategy for p in predictions} == {name for name, _ in strategies}  # sharded ones too
    plots.plot_scaling(predictions, tmp_path / "scaling.png", "every strategy")
    for path in [*drawn, tmp_path / "scaling.png"]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
