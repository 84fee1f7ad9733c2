"""``python -m ddp report``: the figures it derives from saved runs, the files it writes, its errors.

The runs are small pytest-benchmark JSON files written here with known round times
(``tests.synthetic``: through the suite's own summary and writer), so every figure the report
states (overheads, ratios, the winner, bucket counts) is checked against a value worked out by
hand in the comments. Unless a test says otherwise a benchmark's rounds are all equal, so each 95%
interval is [t, t] and distinct medians are resolved.
"""

from __future__ import annotations

import json
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
from ddp.bench.config.shape import RecordedStep
from ddp.bench.memory.state import StateMemory
from ddp.bench.results.records import SCHEMA_VERSION, RunFileError, load_run
from ddp.cli import main as ddp_main
from tests import synthetic
from tests.synthetic import MIB, allreduce_benchmark, config, race_benchmark, run_json, write

TOTAL_BYTES = 5 * MIB // 2  # 2.5 MiB of gradients


def traced(step_ms: float, comm_ms: float) -> RecordedStep:
    """A traced step of ``step_ms`` whose one collective runs alone for ``comm_ms`` once backward's
    computation is done (none where ``comm_ms`` is 0), times in seconds."""
    step, comm = step_ms / 1e3, comm_ms / 1e3
    end = step - comm - 0.01  # backward's last gradient; the optimizer takes the last 10 ms
    collectives = [{"label": "bucket0", "size_bytes": MIB, "ready_seconds": end, "launch_seconds": end,
                    "done_seconds": end + comm}] if comm_ms else []
    return RecordedStep({"forward": [0.0, end / 2], "backward": [end / 2, end], "gradient_sync": [end, end + comm],
                         "optimizer": [end + comm, step]}, end, collectives)


def step_bench(strategy, step_ms, comm_ms, *, bucket_mb=None, sizes=None, batch=2, seq=32, rounds_ms=None, local_ms=None,
               memory=None, num_parameters=TOTAL_BYTES // 4):  # fmt: skip
    """A step benchmark as perf_tests/test_step.py saves it: ``rounds_ms`` defaults to three rounds
    of ``step_ms``; with ``local_ms`` the step is paired with three rounds of ``local`` at that time."""
    rounds = [ms / 1e3 for ms in (rounds_ms or [step_ms] * 3)]
    local = None if local_ms is None else [local_ms / 1e3] * len(rounds)
    record = synthetic.step(config(strategy, batch_size=batch, seq_len=seq, bucket_size_mb=bucket_mb), rounds,
                            exposed=comm_ms / 1e3, local_rounds=local, bucket_sizes=sizes, memory=memory,
                            num_parameters=num_parameters, traces=[[traced(step_ms, comm_ms)] * 3] * 2)
    assert record.step_seconds == pytest.approx(step_ms / 1e3), "rounds_ms must have median step_ms"
    return synthetic.step_benchmark(record)


def allreduce_bench(world_size, size_mb, ms):
    return allreduce_benchmark(world_size, size_mb, ms / 1e3)


def baseline_benchmarks():
    # every data-parallel step paired with local rounds of 100 ms, as perf_tests/test_step.py does by default
    return [
        step_bench("local", 100.0, 0.1),
        step_bench("naive", 200.0, 80.0, local_ms=100.0),
        step_bench("flat", 150.0, 40.0, local_ms=100.0),
        step_bench("overlap", 130.0, 20.0, local_ms=100.0),
        # cap 1 MiB: a 2 MiB tensor alone, then 0.5 MiB: 2 buckets where total / cap = ceil(2.5) = 3
        step_bench("bucketed", 120.0, 10.0, bucket_mb=1, sizes=[2 * MIB, MIB // 2], local_ms=100.0),
        step_bench("bucketed", 110.0, 5.0, bucket_mb=100, sizes=[TOTAL_BYTES], local_ms=100.0),
        step_bench("torch", 125.0, 12.0, bucket_mb=1, local_ms=100.0),  # its plan not recorded
        step_bench("torch", 115.0, 8.0, bucket_mb=100, local_ms=100.0),
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


@pytest.fixture
def baseline(tmp_path) -> Path:
    return write(tmp_path / "0001_base.json", run_json(baseline_benchmarks()))


def test_overheads_over_local_are_ratio_and_difference(baseline):
    overheads = {o.step.label: o for o in overheads_over_local(load_run(baseline).steps)}
    assert set(overheads) == {"naive", "flat", "overlap", "bucketed 1 MiB", "bucketed 100 MiB", "torch 1 MiB", "torch 100 MiB"}
    assert overheads["naive"].ratio == pytest.approx(2.0)  # 200 / 100 in every round
    assert overheads["naive"].extra_seconds == pytest.approx(0.100)  # 200 - 100 ms in every round
    assert overheads["naive"].interval == pytest.approx([0.100, 0.100]) and overheads["naive"].resolved
    assert overheads["bucketed 100 MiB"].ratio == pytest.approx(1.1)
    assert overheads["bucketed 100 MiB"].extra_seconds == pytest.approx(0.010)


def test_winner_is_fastest_strategy_with_margins_against_torch_and_naive(baseline):
    (win,) = winners(load_run(baseline).steps)
    assert win.winner.label == "bucketed 100 MiB"
    naive, torch = win.references  # the strategies that say they are references, in registry order
    assert torch.label == "torch 100 MiB"  # torch at its best cap
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
    assert ("torch", 1.0) not in plans  # not recorded: no plan, no guess


def test_benchmarks_are_told_apart_by_extra_info_not_by_name(tmp_path):
    odd = {**step_bench("naive", 200.0, 80.0), "name": "test_allreduce_lookalike"}
    other = {"name": "test_step[versus]", "group": "versus", "extra_info": {"ratio": 1.0},
             "stats": {"median": 0.5, "iqr": 0.0}}
    run = load_run(write(tmp_path / "run.json", run_json([odd, other, allreduce_bench(2, 1, 10.0)])))
    assert [b.name for b in run.benchmarks if b.record is not None and b.record.kind == "step"] == ["test_allreduce_lookalike"]
    assert [s.strategy for s in run.steps] == ["naive"]
    assert [a.size_bytes for a in run.allreduces] == [MIB]
    assert [o.name for o in run.others] == ["test_step[versus]"]


@pytest.mark.parametrize("version, what", [(5, "rerun the perf tests to save it again"), (10, "upgrade ddp-bench")])
def test_a_run_of_another_schema_is_refused_in_one_line_naming_its_version(tmp_path, version, what):
    bench = step_bench("naive", 200.0, 80.0)
    bench["extra_info"]["schema_version"] = version
    with pytest.raises(RunFileError) as error:
        load_run(write(tmp_path / "old.json", run_json([bench])))
    message = str(error.value)
    assert "\n" not in message and f"saved in ddp-bench's schema {version}" in message
    assert f"this ddp-bench reads schema {SCHEMA_VERSION}" in message and what in message


def test_a_run_of_schema_6_is_migrated_its_timed_wait_not_read_as_exposed_communication(tmp_path):
    bench = step_bench("naive", 200.0, 80.0)
    info = bench["extra_info"]
    info["exposed_comm_fraction"], info["exposed_comm_fraction_ci95"] = info.pop("sync_wait_fraction"), info.pop("sync_wait_fraction_ci95")
    for key in ("sync_wait_seconds", "exposed_comm_seconds", "bound_by", "migrated_from"):
        info.pop(key)
    info.update(schema_version=6, exposed_comm_seconds=0.08)  # schema 6 saved the timed wait under this name
    (step,) = load_run(write(tmp_path / "old.json", run_json([bench]))).steps
    assert step.migrated_from == 6 and step.schema_version == SCHEMA_VERSION
    assert step.sync_wait_seconds == 0.08 and step.sync_wait_fraction == pytest.approx(0.4)
    assert step.exposed_comm_seconds is None and step.bound_by is None and step.collectives is None


def test_report_states_the_hand_computed_figures_and_writes_the_plots(baseline, tmp_path):
    out = tmp_path / "report"
    report = write_report([baseline], out).read_text()
    assert "bucketed 100 MiB is fastest at 110.00 ms" in report
    assert "1.05x faster than torch 100 MiB (115.00 ms, 5.00 ms less per step)" in report
    assert "1.82x faster than naive (200.00 ms, 90.00 ms less per step)" in report
    assert "not resolved" not in report.split("## Commentary")[1].split("\n## ")[0]
    assert "naive at batch 2, seq len 32 communicates 80.00 ms per step with no compute beside it (40.0% of its traced steps)" in report
    assert "**2 bucket(s)** for 2.5 MiB of gradients (total / cap = 3)" in report
    assert "1 bucket(s) hold a single tensor larger than the cap" in report
    assert "Fewer than total / cap: some buckets hold more than the cap" in report
    # the step table: naive's median 200 ms with its interval [200, 200] (three rounds of 200 ms),
    # which covers only 1 - 2/2^3 = 75%: flagged, and said below the table
    assert table_row(report, "naive")[:2] == ["naive", "200.00 [200.00, 200.00] (75%)"]
    assert "fewer rounds than a 95% interval of a median needs (6)" in report
    # the overhead table row for naive: local 100 ms, step 200 ms, +100 ms in every round (interval
    # [100, 100], which excludes 0: resolved), x2
    assert table_row(report, "batch 2, seq len 32", "naive") == [
        "batch 2, seq len 32", "naive", "100.00", "200.00", "100.00 [100.00, 100.00]", "2.000", "yes"
    ]  # fmt: skip
    # the all-reduce row for 10 MiB in 50 ms: algbw = 10 * 2^20 / 0.05 / 1e9 = 0.210 GB/s; 2 ranks: busbw = algbw
    assert table_row(report, "gloo", "2", "10") == ["gloo", "2", "10", "50.000", "0.210", "0.210", "0"]
    assert "Noise warning" not in report
    images = sorted(p.name for p in out.glob("*.png"))
    assert images == ["report_allreduce.png", "report_collective_timeline.png", "report_compute_vs_comm.png",
                      "report_step_vs_bucket_seq32.png"]  # the traced steps give the collectives' timeline
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in report


def test_overlapping_intervals_are_not_resolved(tmp_path):
    # Three rounds each: the 95% interval of a median of 3 is (min, max). bucketed 100 MiB [105, 118] ms
    # and torch 100 MiB [108, 120] ms overlap; naive [200, 200] ms is apart from both.
    steps = [
        step_bench("local", 100.0, 0.1),
        step_bench("naive", 200.0, 80.0),
        step_bench("bucketed", 110.0, 5.0, bucket_mb=100, rounds_ms=[105.0, 110.0, 118.0]),
        step_bench("torch", 115.0, 8.0, bucket_mb=100, rounds_ms=[108.0, 115.0, 120.0]),
    ]
    run = load_run(write(tmp_path / "overlap.json", run_json(steps)))
    (win,) = winners(run.steps)
    assert win.winner.step_seconds_ci95 == pytest.approx([0.105, 0.118])
    assert not resolved_apart(win.winner, win.references[-1])
    report = render_markdown([run], images=[])
    assert (
        "bucketed 100 MiB is fastest at 110.00 ms: not resolved against torch 100 MiB (115.00 ms: the 95% intervals "
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
    assert table_row(report, "batch 2, seq len 32", "flat") == [
        "batch 2, seq len 32", "flat", "100.00", "101.00", "1.00 [-1.00, 3.00]", "1.010", "not resolved"
    ]  # fmt: skip
    assert table_row(report, "batch 2, seq len 32", "naive") == ["batch 2, seq len 32", "naive", "100.00", "200.00", "100.00", "2.000", "unpaired"]


def test_comparison_matches_by_name_and_warns_when_machines_differ(baseline, tmp_path):
    faster = [step_bench("local", 50.0, 0.1), step_bench("naive", 150.0, 60.0), step_bench("torch", 100.0, 1.0, bucket_mb=5)]
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
    # the new run's naive has no local twin: compared raw; every round at the median, so the interval is
    # a point; 3 rounds a run are too few to judge (ddp.analysis.compare.MIN_ROUNDS_TO_JUDGE)
    assert table_row(report, "test_step[naive-b2-s32]") == [
        "test_step[naive-b2-s32]", "200.00", "150.00", "0.750", "[0.750, 0.750]", "not resolved", "raw",
        "no rounds paired with local in both runs",
    ]  # fmt: skip
    assert table_row(report, "test_step[flat-b2-s32]") == ["test_step[flat-b2-s32]", "150.00", "absent", "", "", "only in old", "raw", ""]
    # geometric mean of 0.5 and 0.75 = sqrt(0.375) = 0.612
    assert "2 benchmarks in both runs, geometric mean of new / old 0.612; 8 only in the old run, 1 only in the new one." in report


def test_no_warning_for_runs_from_one_machine(baseline, tmp_path):
    again = write(tmp_path / "0002_again.json", run_json(baseline_benchmarks()))
    assert machine_differences(load_run(baseline), load_run(again)) == {}
    assert "WARNING" not in render_markdown([load_run(baseline), load_run(again)], images=[])


def test_race_gets_its_own_table(tmp_path):
    # local 100 ms, bucketed 120 ms, torch 150 ms in every round: bucketed / torch = 0.8 in each round
    rounds = {"local": [0.1] * 3, "bucketed": [0.12] * 3, "torch": [0.15] * 3}
    race = race_benchmark(["bucketed", "torch"], rounds, model="mlp", batch_size=16, seq_len=1, bucket_size_mb=25.0)
    run = load_run(write(tmp_path / "run.json", run_json([race])))
    assert [r.ratio_over_reference for r in run.races] == [{"bucketed": pytest.approx(0.8)}] and not run.others and not run.steps
    assert run.benchmarks[0].round_seconds == rounds["bucketed"]  # the benchmark stands for the first contender
    (record,) = run.races
    assert (record.model, record.bucket_size_mb, [c.strategy for c in record.configs]) == ("mlp", 25.0, ["local", "bucketed", "torch"])
    report = render_markdown([run], images=[])
    # [0.8, 0.8] lies below 1: bucketed resolved faster
    assert table_row(report, "bucketed") == ["bucketed", "120.00", "[120.00, 120.00]", "0.800 [0.800, 0.800]", "yes"]
    assert table_row(report, "torch", "150.00") == ["torch", "150.00", "[150.00, 150.00]", "reference", ""]


def test_torch_plan_explains_its_first_bucket(tmp_path):
    # 0.5 MiB of gradients under a 0.1 MiB cap: total / cap = 5, but PyTorch's first bucket takes up to 1 MiB
    bench = step_bench("torch", 100.0, 1.0, bucket_mb=0.1, sizes=[MIB // 2], num_parameters=MIB // 8)
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
    with pytest.raises(RunFileError, match=r"step benchmark 'test_step\[naive-b2-s32\]' lacks extra_info bytes_per_step;.*rerun them"):
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
    assert "bucketed 100 MiB is fastest at 110.00 ms" in (tmp_path / "out" / "report.md").read_text()


def test_memory_per_rank_and_what_sharding_fits_are_reported(tmp_path):
    """A run whose steps counted memory gets a memory table (the most loaded rank, beside the
    formula of the strategy's ``Sharding``) and, with a sharded strategy, the sharding section with
    its hand-checkable figures."""

    def state(params, grads, states):  # per rank, in MiB
        return [StateMemory(p * MIB, g * MIB, s * MIB) for p, g, s in zip(params, grads, states)]

    benches = [
        step_bench("local", 100.0, 0.1, memory=state([4, 4], [4, 4], [8, 8])),
        step_bench("bucketed", 120.0, 10.0, bucket_mb=1.0, memory=state([4, 4], [4, 4], [8, 8])),
        step_bench("fsdp", 180.0, 60.0, memory=state([2, 2], [2, 2], [4, 5])),
    ]
    report = render_markdown([load_run(write(tmp_path / "run.json", run_json(benches)))], images=[])
    # 655,360 parameters (2.5 MiB of fp32): replicated 16 B each = 10 MiB a rank, fully sharded on 2 ranks 8 B = 5 MiB
    assert table_row(report, "fsdp", "2")[2:8] == ["2.00", "2.00", "5.00", "9.00", "16/N", "5.00"]  # rank 1 holds more
    assert table_row(report, "bucketed 1 MiB", "2")[5:8] == ["16.00", "4 + 4 + 8", "10.00"]
    assert "## Sharding: what fits, and what it costs" in report
    # 80 GB / 16 B a parameter = 5.0 B parameters replicated at any N; fully sharded on 8 ranks, 40.0 B
    assert table_row(report, "replicated (DDP)")[1:] == ["5.0"] * 5
    assert table_row(report, "full sharding (FSDP)")[1:4] == ["5.0", "10.0", "40.0"]
    # measured: fsdp against bucketed, 180 / 120 ms and (2+2+4 + 2+2+5) / (16 + 16) MiB of state
    assert table_row(report, "batch 2, seq len 32", "fsdp", "bucketed 1 MiB")[3:] == ["1.50", "0.53"]
