"""``python -m ddp report``: the figures it derives from saved runs, the files it writes, its errors.

The runs are small pytest-benchmark JSON files written here with known numbers, each benchmark's
``extra_info`` a schema-2 record of ``ddp.bench.records`` (one test keeps a first-release,
schema-1 entry), so every figure the report states (overheads, ratios, the winner, bucket counts)
is checked against a value worked out by hand in the comments. Unless a test says otherwise a
benchmark's rounds are all equal, so each 95% interval is [t, t] and distinct medians are resolved.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ddp.analysis.commentary import plan_sentence
from ddp.analysis.compare import compare
from ddp.analysis.figures import (
    bucket_plans,
    machine_differences,
    overheads_over_local,
    resolved_apart,
    winners,
)
from ddp.analysis.markdown import render_markdown, write_report
from ddp.bench.records import SCHEMA_VERSION, AllReduceRecord, RaceRecord, RunFileError, StepRecord, load_run, to_extra_info
from ddp.bench.stats import median_ci, paired_difference_ci, paired_ratio_ci
from ddp.cli import main as ddp_main

MIB = 2**20
TOTAL_BYTES = 5 * MIB // 2  # 2.5 MiB of gradients


def _stats(rounds: list[float]) -> dict:
    return {"median": statistics.median(rounds), "mean": statistics.mean(rounds), "min": min(rounds),
            "max": max(rounds), "stddev": statistics.pstdev(rounds), "iqr": 0.0, "rounds": len(rounds)}  # fmt: skip


def step_bench(
    strategy, step_ms, comm_ms, *, bucket_mb=None, buckets=None, sizes=None, batch=2, seq=32, name=None,
    rounds_ms=None, local_ms=None,
):  # fmt: skip
    """A step benchmark as perf_tests/test_step.py saves it: a ``StepRecord`` in ``extra_info``.

    ``rounds_ms`` defaults to three rounds of ``step_ms``; with ``local_ms`` the step is paired with
    three rounds of ``local`` at that time, its overhead figures computed as ``step_record`` does.
    """
    rounds = [ms / 1e3 for ms in (rounds_ms or [step_ms] * 3)]
    assert statistics.median(rounds) == pytest.approx(step_ms / 1e3), "rounds_ms must have median step_ms"
    paired = {}
    if local_ms is not None:
        local = [local_ms / 1e3] * len(rounds)
        difference, *difference_ci = paired_difference_ci(rounds, local)
        ratio, *ratio_ci = paired_ratio_ci(rounds, local)
        paired = dict(local_round_seconds=local, overhead_seconds=difference, overhead_seconds_ci95=difference_ci,
                      overhead_ratio=ratio, overhead_ratio_ci95=ratio_ci)  # fmt: skip
    record = StepRecord(
        strategy=strategy, backend="gloo", device="cpu", world_size=2, model="tiny", num_parameters=TOTAL_BYTES // 4,
        batch_size=batch, seq_len=seq, bucket_size_mb=bucket_mb, num_parameter_tensors=9, num_buckets=buckets,
        bucket_sizes_bytes=sizes, allreduce_calls_per_step=0 if strategy == "local" else (buckets or 1),
        bytes_per_step=0 if strategy == "local" else TOTAL_BYTES,
        step_seconds=step_ms / 1e3, step_seconds_ci95=list(median_ci(rounds)), round_seconds=rounds,
        comm_wait_seconds=comm_ms / 1e3, comm_fraction=comm_ms / step_ms,
        comm_fraction_ci95=[comm_ms / step_ms, comm_ms / step_ms],
        tokens_per_second=2 * batch * seq / (step_ms / 1e3), peak_memory_bytes=None,
        rank_step_seconds=[step_ms / 1e3, step_ms / 1e3], target_precision=0.02,
        reached_precision=(max(rounds) - min(rounds)) / 2 / (step_ms / 1e3), **paired,
    )  # fmt: skip
    bucket = f"-bucket{bucket_mb:g}mb" if bucket_mb is not None else ""
    return {
        "name": name or f"test_step[{strategy}-b{batch}-s{seq}{bucket}]",
        "group": f"step: model tiny, batch {batch}, seq len {seq}",
        "params": {},
        "extra_info": to_extra_info(record),
        "stats": _stats(rounds),
    }


def allreduce_bench(world_size, size_mb, ms):
    size = size_mb * MIB
    seconds = ms / 1e3
    algbw = size / seconds / 1e9
    record = AllReduceRecord(
        backend="gloo", world_size=world_size, size_bytes=size, seconds=seconds, seconds_ci95=[seconds, seconds],
        round_seconds=[seconds] * 3, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world_size - 1) / world_size, wrong=0,
    )  # fmt: skip
    return {
        "name": f"test_allreduce[n{world_size}-{size_mb}mb]",
        "group": f"all_reduce: gloo, {world_size} ranks",
        "params": {},
        "extra_info": to_extra_info(record),
        "stats": _stats([seconds] * 3),
    }


def run_json(benchmarks, node="bench-a", torch_version="2.13.0+cpu"):
    return {
        "machine_info": {"node": node, "system": "Linux", "release": "6.1", "python_version": "3.11.7",
                         "cpu": {"brand_raw": "AMD EPYC", "count": 2},
                         "ddp_bench": {"torch": torch_version, "backend": "gloo", "device": "cpu", "world_size": 2}},
        "commit_info": {"id": "0123456789abcdef", "dirty": False, "branch": "main"},
        "datetime": "2026-11-21T12:00:00",
        "version": "5.1.0",
        "benchmarks": benchmarks,
    }


def baseline_benchmarks():
    # every data-parallel step paired with local rounds of 100 ms, as perf_tests/test_step.py does by default
    return [
        step_bench("local", 100.0, 0.1),
        step_bench("naive", 200.0, 80.0, local_ms=100.0),
        step_bench("flat", 150.0, 40.0, local_ms=100.0),
        step_bench("overlap", 130.0, 20.0, local_ms=100.0),
        # cap 1 MiB: a 2 MiB tensor alone, then 0.5 MiB: 2 buckets where total / cap = ceil(2.5) = 3
        step_bench("bucketed", 120.0, 10.0, bucket_mb=1, buckets=2, sizes=[2 * MIB, MIB // 2], local_ms=100.0),
        step_bench("bucketed", 110.0, 5.0, bucket_mb=100, buckets=1, sizes=[TOTAL_BYTES], local_ms=100.0),
        step_bench("torch", 125.0, 12.0, bucket_mb=1, buckets=2, local_ms=100.0),
        step_bench("torch", 115.0, 8.0, bucket_mb=100, buckets=1, local_ms=100.0),
        allreduce_bench(2, 1, 10.0),
        allreduce_bench(2, 10, 50.0),
    ]


def table_row(report: str, *first_cells: str) -> list[str]:
    """The cells of the first markdown table row that starts with ``first_cells``."""
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[: len(first_cells)] == list(first_cells):
            return cells
    raise AssertionError(f"no table row starts with {first_cells}")


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def baseline(tmp_path) -> Path:
    return write(tmp_path / "0001_base.json", run_json(baseline_benchmarks()))


def test_overheads_over_local_are_ratio_and_difference(baseline):
    overheads = {o.step.label: o for o in overheads_over_local(load_run(baseline).steps)}
    assert set(overheads) == {"naive", "flat", "overlap", "bucketed 1 MB", "bucketed 100 MB", "torch 1 MB", "torch 100 MB"}
    assert overheads["naive"].ratio == pytest.approx(2.0)  # 200 / 100 in every round
    assert overheads["naive"].extra_seconds == pytest.approx(0.100)  # 200 - 100 ms in every round
    assert overheads["naive"].interval == pytest.approx([0.100, 0.100]) and overheads["naive"].resolved
    assert overheads["bucketed 100 MB"].ratio == pytest.approx(1.1)
    assert overheads["bucketed 100 MB"].extra_seconds == pytest.approx(0.010)


def test_winner_is_fastest_strategy_with_margins_against_torch_and_naive(baseline):
    (win,) = winners(load_run(baseline).steps)
    assert win.winner.label == "bucketed 100 MB"
    naive, torch = win.references  # the strategies that say they are references, in registry order
    assert torch.label == "torch 100 MB"  # torch at its best cap
    assert naive.label == "naive"
    assert torch.step_seconds / win.winner.step_seconds == pytest.approx(115 / 110)
    assert naive.step_seconds / win.winner.step_seconds == pytest.approx(200 / 110)
    # [110, 110] ms against [115, 115] ms: zero-width intervals at distinct medians are apart
    assert resolved_apart(win.winner, torch)


def test_bucket_plan_counts_are_not_total_over_cap(baseline):
    plans = {(p.strategy, p.bucket_size_mb): p for p in bucket_plans(load_run(baseline).steps)}
    one_mb = plans[("bucketed", 1.0)]
    assert (one_mb.num_buckets, one_mb.total_over_cap, one_mb.oversized_buckets) == (2, 3, 1)
    assert plans[("bucketed", 100.0)].total_over_cap == 1
    assert plans[("torch", 1.0)].bucket_sizes_bytes is None  # not recorded: no sizes, no guess
    assert plans[("torch", 1.0)].oversized_buckets is None


def test_benchmarks_are_told_apart_by_extra_info_not_by_name(tmp_path):
    odd = step_bench("naive", 200.0, 80.0, name="test_allreduce_lookalike")
    other = {"name": "test_step[versus]", "group": "versus", "extra_info": {"ratio": 1.0},
             "stats": {"median": 0.5, "iqr": 0.0}}
    run = load_run(write(tmp_path / "run.json", run_json([odd, other, allreduce_bench(2, 1, 10.0)])))
    assert [b.name for b in run.benchmarks if b.record is not None and b.record.kind == "step"] == ["test_allreduce_lookalike"]
    assert [s.strategy for s in run.steps] == ["naive"]
    assert [a.size_bytes for a in run.allreduces] == [MIB]
    assert [o.name for o in run.others] == ["test_step[versus]"]


def test_first_release_step_entry_still_loads(tmp_path):
    """A schema-1 step entry (no ``kind``, ``model_size`` for the model, no rounds in extra_info)."""

    def first_release(strategy, step_ms, comm_ms, data_ms=None):
        extra = {
            "strategy": strategy, "backend": "gloo", "device": "cpu", "world_size": 2, "model_size": "tiny",
            "num_parameters": TOTAL_BYTES // 4, "batch_size": 2, "seq_len": 32, "bucket_size_mb": None,
            "num_parameter_tensors": 9, "num_buckets": None, "bucket_sizes_bytes": None,
            "allreduce_calls_per_step": 0 if strategy == "local" else 9,
            "bytes_per_step": 0 if strategy == "local" else TOTAL_BYTES, "step_seconds": step_ms / 1e3,
            "comm_wait_seconds": comm_ms / 1e3, "comm_fraction": comm_ms / step_ms,
            "tokens_per_second": 2 * 2 * 32 / (step_ms / 1e3), "peak_memory_bytes": None,
            "rank_step_seconds": [step_ms / 1e3, step_ms / 1e3],
        }  # fmt: skip
        stats = {"median": step_ms / 1e3, "min": step_ms / 1e3, "iqr": 0.0, "rounds": 3}
        if data_ms is not None:  # saved with --benchmark-save-data
            stats["data"] = [ms / 1e3 for ms in data_ms]
        return {"name": f"test_step[{strategy}-b2-s32]", "group": "step", "extra_info": extra, "stats": stats}

    benches = [first_release("local", 100.0, 0.1), first_release("naive", 200.0, 80.0, data_ms=[190.0, 200.0, 230.0])]
    run = load_run(write(tmp_path / "first.json", run_json(benches)))
    local, naive = run.steps
    assert (local.model, local.kind, local.schema_version) == ("tiny", "step", SCHEMA_VERSION)
    # before schema 4 every step was fp32 with torch's default AdamW (on CPU its for-loop), and the run says so
    assert (local.precision, local.optimizer, local.grad_comm) == ("fp32", "for-loop", "fp32")
    assert len(run.notes) == 1 and "read as fp32 with fp32 gradient communication" in run.notes[0]
    assert local.step_seconds == pytest.approx(0.100)
    assert local.round_seconds is None and local.step_seconds_ci95 is None  # rounds not saved: no interval
    assert naive.round_seconds == pytest.approx([0.190, 0.200, 0.230])
    assert naive.step_seconds_ci95 == pytest.approx([0.190, 0.230])  # 3 rounds: (min, max)
    (overhead,) = overheads_over_local(run.steps)
    assert (overhead.ratio, overhead.extra_seconds) == (pytest.approx(2.0), pytest.approx(0.100))  # unpaired: medians
    report = render_markdown([run], images=[])
    assert table_row(report, "model") == ["model", "tiny"]
    # a CPU run of then used torch's per-tensor AdamW loop, not the foreach of runs today: its configs say so
    label = "batch 2, seq 32, fp32 for-loop"
    assert table_row(report, label, "naive") == [label, "naive", "100.00", "200.00", "100.00", "2.000", "unpaired"]


def test_report_states_the_hand_computed_figures_and_writes_the_plots(baseline, tmp_path):
    out = tmp_path / "report"
    report = write_report([baseline], out).read_text()
    assert "bucketed 100 MB is fastest at 110.00 ms" in report
    assert "1.05x faster than torch 100 MB (115.00 ms, 5.00 ms less per step)" in report
    assert "1.82x faster than naive (200.00 ms, 90.00 ms less per step)" in report
    assert "not resolved" not in report.split("## Commentary")[1].split("\n## ")[0]
    assert "naive at batch 2, seq 32 waits 80.00 ms per step for its gradients (40.0% of the step)" in report
    assert "**2 bucket(s)** for 2.5 MiB of gradients (total / cap = 3)" in report
    assert "1 bucket(s) hold a single tensor larger than the cap" in report
    assert "Fewer than total / cap: some buckets hold more than the cap" in report
    # the step table: naive's median 200 ms with its interval [200, 200] (three rounds of 200 ms)
    assert table_row(report, "naive")[:2] == ["naive", "200.00 [200.00, 200.00]"]
    # the overhead table row for naive: local 100 ms, step 200 ms, +100 ms in every round (interval
    # [100, 100], which excludes 0: resolved), x2
    assert table_row(report, "batch 2, seq 32", "naive") == [
        "batch 2, seq 32", "naive", "100.00", "200.00", "100.00 [100.00, 100.00]", "2.000", "yes"
    ]  # fmt: skip
    # the all-reduce row for 10 MiB in 50 ms: algbw = 10 * 2^20 / 0.05 / 1e9 = 0.210 GB/s; 2 ranks: busbw = algbw
    assert table_row(report, "gloo", "2", "10") == ["gloo", "2", "10", "50.000", "0.210", "0.210", "0"]
    assert "Noise warning" not in report
    images = sorted(p.name for p in out.glob("*.png"))
    assert images == ["report_allreduce.png", "report_compute_vs_comm.png", "report_step_vs_bucket_seq32.png"]
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in report


def test_overlapping_intervals_are_not_resolved(tmp_path):
    # Three rounds each: the 95% interval of a median of 3 is (min, max). bucketed 100 MB [105, 118] ms
    # and torch 100 MB [108, 120] ms overlap; naive [200, 200] ms is apart from both.
    steps = [
        step_bench("local", 100.0, 0.1),
        step_bench("naive", 200.0, 80.0),
        step_bench("bucketed", 110.0, 5.0, bucket_mb=100, buckets=1, rounds_ms=[105.0, 110.0, 118.0]),
        step_bench("torch", 115.0, 8.0, bucket_mb=100, buckets=1, rounds_ms=[108.0, 115.0, 120.0]),
    ]
    run = load_run(write(tmp_path / "overlap.json", run_json(steps)))
    (win,) = winners(run.steps)
    assert win.winner.step_seconds_ci95 == pytest.approx([0.105, 0.118])
    assert not resolved_apart(win.winner, win.references[-1])
    report = render_markdown([run], images=[])
    assert (
        "bucketed 100 MB is fastest at 110.00 ms: not resolved against torch 100 MB (115.00 ms: the 95% intervals "
        "overlap); 1.82x faster than naive (200.00 ms, 90.00 ms less per step)."
    ) in report
    # relative half-widths: local 0, naive 0, bucketed 6.5 / 110 = 5.9%, torch 6 / 115 = 5.2%; the
    # report takes the upper middle of the four, 5.2%
    assert "the 95% intervals of the medians are +-5.2% wide (median over benchmarks)" in report


def test_overhead_resolved_only_when_its_interval_excludes_zero(tmp_path):
    # flat paired with local rounds of 100 ms: per-round differences 1, -1, 3 ms, median 1 ms; the
    # bootstrap resamples three of them, so the interval runs from -1 to 3 ms: 0 inside, not resolved.
    # naive is unpaired: the difference of medians, 200 - 100 ms, without an interval.
    steps = [
        step_bench("local", 100.0, 0.1),
        step_bench("naive", 200.0, 80.0),
        step_bench("flat", 101.0, 1.0, rounds_ms=[101.0, 99.0, 103.0], local_ms=100.0),
    ]
    run = load_run(write(tmp_path / "paired.json", run_json(steps)))
    overheads = {o.step.label: o for o in overheads_over_local(run.steps)}
    assert overheads["flat"].extra_seconds == pytest.approx(0.001)
    assert overheads["flat"].interval == pytest.approx([-0.001, 0.003])
    assert overheads["flat"].resolved is False
    assert (overheads["naive"].extra_seconds, overheads["naive"].resolved) == (pytest.approx(0.100), None)
    report = render_markdown([run], images=[])
    # median of per-round ratios 1.01, 0.99, 1.03 = 1.010
    assert table_row(report, "batch 2, seq 32", "flat") == [
        "batch 2, seq 32", "flat", "100.00", "101.00", "1.00 [-1.00, 3.00]", "1.010", "not resolved"
    ]  # fmt: skip
    assert table_row(report, "batch 2, seq 32", "naive") == ["batch 2, seq 32", "naive", "100.00", "200.00", "100.00", "2.000", "unpaired"]


def test_comparison_matches_by_name_and_warns_when_machines_differ(baseline, tmp_path):
    faster = [step_bench("local", 50.0, 0.1), step_bench("naive", 150.0, 60.0), step_bench("torch", 100.0, 1.0, bucket_mb=5, buckets=1)]
    new = load_run(write(tmp_path / "0002_new.json", run_json(faster, node="bench-b", torch_version="2.12.0")))
    old = load_run(baseline)
    ratios = {c.name: c.ratio for c in compare(old, new, 0.10)}
    assert ratios["test_step[local-b2-s32]"] == pytest.approx(0.5)  # 50 / 100
    assert ratios["test_step[naive-b2-s32]"] == pytest.approx(0.75)  # 150 / 200
    assert ratios["test_step[torch-b2-s32-bucket5mb]"] is None  # only in the new run
    assert ratios["test_step[flat-b2-s32]"] is None  # only in the old run
    assert machine_differences(old, new) == {"node": ("bench-a", "bench-b"), "torch": ("2.13.0+cpu", "2.12.0")}
    report = render_markdown([old, new], images=[])
    assert "WARNING: the runs come from different machines or setups** (node: bench-a vs bench-b; torch: 2.13.0+cpu vs 2.12.0)" in report
    # the new run's naive has no local twin: compared raw; every round at the median, so the interval is a point
    assert table_row(report, "test_step[naive-b2-s32]") == [
        "test_step[naive-b2-s32]", "200.00", "150.00", "0.750", "[0.750, 0.750]", "faster", "raw",
        "no rounds paired with local in both runs",
    ]  # fmt: skip
    assert table_row(report, "test_step[flat-b2-s32]") == ["test_step[flat-b2-s32]", "150.00", "absent", "", "", "only in old", "raw", ""]
    # geometric mean of 0.5 and 0.75 = sqrt(0.375) = 0.612
    assert "2 benchmarks in both runs, geometric mean of new / old 0.612; 8 only in the old run, 1 only in the new one." in report


def test_no_warning_for_runs_from_one_machine(baseline, tmp_path):
    again = write(tmp_path / "0002_again.json", run_json(baseline_benchmarks()))
    assert machine_differences(load_run(baseline), load_run(again)) == {}
    assert "WARNING" not in render_markdown([load_run(baseline), load_run(again)], images=[])


def race_record_of(rounds: dict[str, list[float]]) -> RaceRecord:
    return RaceRecord(
        model="mlp", parameters=10, bucket_size_mb=25.0, world_size=2, backend="gloo", contenders=list(rounds),
        reference="torch", round_seconds=rounds,
        median_step_seconds={name: r[0] for name, r in rounds.items()},
        median_step_seconds_ci95={name: [r[0], r[0]] for name, r in rounds.items()},
        ratio_over_reference={"bucketed": 0.8}, ratio_over_reference_ci95={"bucketed": [0.8, 0.8]},
        overhead_over_local_seconds={"bucketed": 0.02, "torch": 0.05},
        overhead_over_local_seconds_ci95={"bucketed": [0.02, 0.02], "torch": [0.05, 0.05]},
    )  # fmt: skip


def test_race_gets_its_own_table(tmp_path):
    # local 100 ms, bucketed 120 ms, torch 150 ms in every round: bucketed / torch = 0.8 in each round
    rounds = {"local": [0.1] * 3, "bucketed": [0.12] * 3, "torch": [0.15] * 3}
    race = {"name": "test_versus_torch[mlp]", "group": "versus", "stats": _stats([0.3] * 3),
            "extra_info": to_extra_info(race_record_of(rounds))}
    run = load_run(write(tmp_path / "run.json", run_json([race])))
    assert [r.ratio_over_reference for r in run.races] == [{"bucketed": 0.8}] and not run.others and not run.steps
    assert run.benchmarks[0].round_seconds == rounds["bucketed"]  # the benchmark stands for the first contender
    report = render_markdown([run], images=[])
    # [0.8, 0.8] lies below 1: bucketed resolved faster
    assert table_row(report, "bucketed") == ["bucketed", "120.00", "[120.00, 120.00]", "0.800 [0.800, 0.800]", "yes"]
    assert table_row(report, "torch", "150.00") == ["torch", "150.00", "[150.00, 150.00]", "reference", ""]


def test_a_schema_2_race_loads_as_bucketed_against_torch(tmp_path):
    rounds = {"local": [0.1] * 3, "bucketed": [0.12] * 3, "torch": [0.15] * 3}
    info = to_extra_info(race_record_of(rounds))
    for key in ("contenders", "reference", "ratio_over_reference", "ratio_over_reference_ci95"):
        del info[key]
    info.update(schema_version=2, ratio_bucketed_over_torch=0.8, ratio_bucketed_over_torch_ci95=[0.8, 0.8])
    race = {"name": "test_versus_torch[mlp]", "group": "versus", "stats": _stats([0.3] * 3), "extra_info": info}
    (record,) = load_run(write(tmp_path / "run.json", run_json([race]))).races
    assert (record.contenders, record.reference) == (["local", "bucketed", "torch"], "torch")
    assert (record.ratio_over_reference, record.ratio_over_reference_ci95) == ({"bucketed": 0.8}, {"bucketed": [0.8, 0.8]})
    assert record.schema_version == SCHEMA_VERSION


def test_torch_plan_explains_its_first_bucket(tmp_path):
    # 0.5 MiB of gradients under a 0.1 MiB cap: total / cap = 5, but PyTorch's first bucket takes up to 1 MiB
    bench = step_bench("torch", 100.0, 1.0, bucket_mb=0.1, buckets=1)
    bench["extra_info"]["bytes_per_step"] = MIB // 2
    (plan,) = bucket_plans(load_run(write(tmp_path / "run.json", run_json([bench]))).steps)
    assert (plan.num_buckets, plan.total_over_cap) == (1, 5)
    assert "every gradient fits in torch's first bucket, which it fills up to 1 MiB" in plan_sentence(plan)


def test_noise_warning_when_a_strategy_beats_local(tmp_path):
    noisy = [step_bench("local", 100.0, 0.1), step_bench("naive", 90.0, 30.0), step_bench("flat", 120.0, 10.0)]
    report = render_markdown([load_run(write(tmp_path / "noisy.json", run_json(noisy)))], images=[])
    assert "1 of 2 data-parallel steps ran faster than `local`" in report


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json at all", "is not JSON (Expecting value at line 1, column 1); pass a file written by `pytest perf_tests --benchmark-json PATH`"),
        ('{"comm_seconds": 0.1}', "is JSON but not a pytest-benchmark run (it has no 'benchmarks' list)"),
        (json.dumps(run_json([])), "holds no benchmarks; run `pytest perf_tests --benchmark-json PATH`"),
        (json.dumps(run_json([{"name": "test_x", "extra_info": {}}])), "benchmark 'test_x' has no stats.median (was it run with --benchmark-disable?)"),
    ],
    ids=["not-json", "not-pytest-benchmark", "no-benchmarks", "no-stats"],
)
def test_unusable_files_are_refused_saying_what_to_do(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(RunFileError) as error:
        load_run(path)
    assert message in str(error.value)


def test_step_benchmark_missing_a_field_names_it(tmp_path):
    bench = step_bench("naive", 200.0, 80.0)
    del bench["extra_info"]["bytes_per_step"]
    with pytest.raises(RunFileError, match=r"step benchmark 'test_step\[naive-b2-s32\]' lacks extra_info bytes_per_step;.*rerun the perf tests"):
        load_run(write(tmp_path / "old.json", run_json([bench])))


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err


def test_command_line_errors_exit_2_with_the_message(tmp_path, capsys, baseline):
    with pytest.raises(SystemExit) as exit_:
        ddp_main(["report", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = _error_line(capsys)
    assert err.startswith("ddp-bench report: error: ") and "missing.json: no such file" in err
    not_a_dir = write(tmp_path / "file.txt", "x")
    with pytest.raises(SystemExit) as exit_:
        ddp_main(["report", str(baseline), "--out", str(not_a_dir)])
    assert exit_.value.code == 2
    err = _error_line(capsys)
    assert err.startswith("ddp-bench report: error: ") and "is a file; give a directory" in err


def test_command_line_writes_the_report(tmp_path, capsys, baseline):
    assert ddp_main(["report", str(baseline), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "report.md")
    assert "bucketed 100 MB is fastest at 110.00 ms" in (tmp_path / "out" / "report.md").read_text()


def test_memory_per_rank_and_what_sharding_fits_are_reported(tmp_path):
    """A run whose steps counted memory gets a memory table (the most loaded rank, beside the
    formula) and, with a sharded strategy, the sharding section with its hand-checkable figures."""
    mib = 2**20
    benches = [step_bench("local", 100.0, 0.1), step_bench("bucketed", 120.0, 10.0, bucket_mb=1.0), step_bench("fsdp", 180.0, 60.0)]
    memory = {  # per rank: parameters, gradients, optimizer state (MiB); formula; formula total (MiB)
        "local": ([4, 4], [4, 4], [8, 8], "4 + 4 + 8", 16),
        "bucketed": ([4, 4], [4, 4], [8, 8], "4 + 4 + 8", 16),
        "fsdp": ([2, 2], [2, 2], [4, 5], "16/N", 8),
    }
    for bench in benches:
        params, grads, state, formula, total = memory[bench["extra_info"]["strategy"]]
        bench["extra_info"].update(
            parameters_bytes=[p * mib for p in params], gradients_bytes=[g * mib for g in grads],
            optimizer_state_bytes=[s * mib for s in state], memory_peak_bytes=[None, None],
            memory_formula=formula, formula_bytes={"total": total * mib},
        )  # fmt: skip
    report = render_markdown([load_run(write(tmp_path / "run.json", run_json(benches)))], images=[])
    assert table_row(report, "fsdp", "2")[2:8] == ["2.00", "2.00", "5.00", "9.00", "16/N", "8.00"]  # rank 1 holds more
    assert table_row(report, "bucketed 1 MB", "2")[5:8] == ["16.00", "4 + 4 + 8", "16.00"]
    assert "## Sharding: what fits, and what it costs" in report
    # 80 GB / 16 B a parameter = 5.0 B parameters replicated at any N; fully sharded on 8 ranks, 40.0 B
    assert table_row(report, "replicated (DDP)")[1:] == ["5.0"] * 5
    assert table_row(report, "full sharding (FSDP)")[1:4] == ["5.0", "10.0", "40.0"]
    # measured: fsdp against bucketed, 180 / 120 ms and (2+2+4 + 2+2+5) / (16 + 16) MiB of state
    assert table_row(report, "batch 2, seq 32", "fsdp", "bucketed 1 MB")[3:] == ["1.50", "0.53"]
