"""The length a benchmark run prints before it starts (``estimated length: ...``,
``ddp.bench.rounds.estimate``) against the length it then takes, printed at its end with its time
by part (``ddp.bench.rounds.ledger``): within 20% on this CPU, for a run laid out as the default
one is (two timing groups, each strategy with its ``local`` twin, traced where timed)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp.bench.config.options import ResolvedLaunch, grid_defaults
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds import estimate

ROOT = Path(__file__).parents[1]
SECONDS = r"(?:(\d+) min )?(\d+) s"


def _seconds(match: re.Match) -> float:
    minutes, seconds = match.groups()
    return 60 * int(minutes or 0) + int(seconds)


@pytest.mark.slow
def test_the_estimate_printed_before_a_run_is_within_20_percent_of_its_length(tmp_path):
    command = [sys.executable, "-m", "pytest", "perf_tests/test_step.py", "-q", "-p", "no:cacheprovider",
               "--model", "mini", "--strategies", "local,bucketed,torch", "--batch-sizes", "4", "--seq-lens", "64",
               "--bucket-sizes", "10", "--rounds", "6", "--max-rounds", "6",
               "--benchmark-storage", f"file://{tmp_path}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    estimated = re.search(rf"estimated length: {SECONDS} for 3 step benchmarks", done.stdout)
    ran = re.search(rf"run {SECONDS}: start-up", done.stdout)
    assert estimated and ran, done.stdout[-3000:]
    # every part of the run is named in its time by part
    parts = done.stdout[ran.start():].splitlines()[0]
    for part in ("start-up", "builds", "warm-up", "memory counts", "rounds", "traced steps", "predictions", "other"):
        assert part in parts, parts
    assert abs(_seconds(estimated) - _seconds(ran)) <= 0.2 * _seconds(ran), (estimated.group(0), parts)
    # a line after each benchmark: how many are done in how long, and what this one took
    progress = [re.match(rf"ddp-bench: (\d) of 3 step benchmarks in {SECONDS} \(estimated {SECONDS} for all\); "
                         rf"test_step\[(\S+)\] {SECONDS}", line) for line in done.stdout.splitlines()
                if line.startswith("ddp-bench: ")]
    assert all(progress) and [int(m.group(1)) for m in progress] == [1, 2, 3], done.stdout[-3000:]
    assert [m.group(6) for m in progress] == ["local-b4-s64", "bucketed-b4-s64-bucket10mb", "torch-b4-s64-bucket10mb"]
    assert all(m.group(4, 5) == estimated.groups() for m in progress)
    so_far = [_seconds(re.match(SECONDS, m.group(0).split(" in ")[1])) for m in progress]
    each = [60 * int(m.group(7) or 0) + int(m.group(8)) for m in progress]
    assert so_far == sorted(so_far) and so_far[-1] <= _seconds(ran) and abs(sum(each) - so_far[-1]) <= 3, progress
    for m, own in zip(progress, each, strict=True):  # a benchmark's parts are within its own time
        line = m.string
        spent = sum(int(seconds) for seconds in re.findall(r"(\d+) s(?:,|$)", line.split(f"{m.group(6)}] ")[1]))
        assert spent <= own + 3, line


def test_what_is_predicted_not_to_fit_the_host_is_neither_timed_in_the_parent_nor_counted(monkeypatch):
    """The host's speed is timed on the grid's smallest step in pytest's own process, and the grid
    skips unbuilt what is predicted not to fit a rank's share of the host: xl on a 24 GB machine
    needs 37 GiB a rank, and building it in the parent would end the run before any rank started.
    Such a configuration is neither built for the timing nor priced, and the line says so."""
    monkeypatch.setattr(estimate, "host_memory_bytes", lambda ranks: 2**20)  # a host of 1 MiB

    def built(*_):
        raise AssertionError("the estimate built a model predicted not to fit")

    monkeypatch.setattr(estimate, "host_flops_per_second", built)
    configs = [StepConfig("local", "mini", 1, 32), StepConfig("torch", "mini", 1, 32, 25.0)]
    launch = ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for")
    run = estimate.estimate_run(configs, grid_defaults("gloo", "cpu"), launch)
    assert run.line().endswith("; 2 predicted not to fit, skipped unbuilt") and run.total_seconds <= 10
    assert not estimate.fits_one_process(configs[0])
    monkeypatch.undo()
    assert estimate.fits_one_process(configs[0])


def test_what_the_strategy_cannot_run_is_neither_counted_nor_priced(monkeypatch):
    """The grid skips unbuilt a shape its strategy cannot run (``cannot_run``: here fsdp, whose
    backward always reduce-scatters, asked to accumulate two micro-batches): the estimate prices
    only what will run, whatever the device, and its line says how many it left out."""
    monkeypatch.setattr(estimate, "host_flops_per_second", lambda *_: 1e10)
    launch = ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for")
    grid = grid_defaults("gloo", "cpu")
    runs = [StepConfig("local", "tiny", 2, 32, grad_accum=2), StepConfig("torch", "tiny", 2, 32, 25.0, grad_accum=2)]
    refused = StepConfig("fsdp", "tiny", 2, 32, grad_accum=2)
    assert estimate.cannot_run(refused) and not any(estimate.cannot_run(c) for c in runs)
    alone = estimate.estimate_run(runs, grid, launch)
    asked = estimate.estimate_run([*runs, refused], grid, launch)
    assert asked.benchmarks == 3 and asked.refused == 1 and asked.skipped == 0
    assert asked.seconds == alone.seconds
    assert asked.line().endswith("; 1 cannot run as asked, skipped unbuilt")


def test_a_group_start_up_is_charged_once_and_a_trace_pair_once_per_key():
    """On CUDA (no host timing, no fit decision here): a process's first group pays the fork
    server's start-up and each later one a little; the memory prediction traces a step once per
    ``fake_step_key``, which a strategy and its ``local`` twin share, and fsdp in bf16 (its
    parameters in bf16) does not."""
    costs = estimate.MEASURED["cuda"]
    launch = ResolvedLaunch("nccl", "cuda", 2, 60.0, "asked for")
    grid = grid_defaults("nccl", "cuda")  # two timing groups, and the tracer since it traces steps
    assert grid.rank_groups == 2 and grid.round_options().traced_steps > 0
    shared = [StepConfig("local", "mini", 2, 64, precision="bf16"), StepConfig("bucketed", "mini", 2, 64, 25.0, precision="bf16")]
    one = estimate.estimate_run(shared, grid, launch)
    assert one.seconds["start-up"] == pytest.approx(costs.startup_seconds + 2 * costs.later_startup_seconds)
    pair = costs.trace_seconds + costs.trace_seconds_per_gparam * estimate.parameters(shared[0]) / 1e9
    assert one.seconds["predictions"] == pytest.approx(pair)
    two = estimate.estimate_run([*shared, StepConfig("fsdp", "mini", 2, 64, precision="bf16")], grid, launch)
    assert two.seconds["predictions"] == pytest.approx(2 * pair)


def test_steps_that_never_vary_cost_their_minimum_rounds_and_noisy_ones_their_budget():
    """The rounds are the run's own loop on simulated rounds. Against arithmetic: a step whose time
    never varies reaches any precision in its minimum rounds (on each group of ranks its share:
    ``group_share``); one that varies by a third a round never reaches +-1%, and stops the first
    round its budget is spent, which the ceiling assumes of every step."""
    grid = grid_defaults("nccl", "cuda")
    policy = grid.round_options()
    shares = [estimate.group_share(policy, 2, index) for index in range(2)]
    steady, noisy = (1.0,), (0.6, 1.0, 1.4)
    pair = (0.5, 0.6)
    assert sum(estimate.expected_round_seconds(pair, share, steady) for share in shares) == pytest.approx(
        policy.min_rounds * sum(pair))
    for share in shares:  # the first round at or past the budget is the last
        rounds = math.ceil(share.budget_seconds / sum(pair))
        assert estimate.expected_round_seconds(pair, share, noisy) == pytest.approx(rounds * sum(pair), rel=0.1)
    # a group of three strategies timed together has three benchmarks' budget
    assert estimate.expected_round_seconds(pair, shares[0], noisy, 3) == pytest.approx(
        3 * estimate.expected_round_seconds(pair, shares[0], noisy), rel=0.1)


def test_the_estimate_line_gives_the_ceiling_where_the_budget_could_add_a_tenth():
    """On the H200's measured rounds the default GPU grid's steps settle in their minimum rounds;
    had they varied more, each would take its budget: the line says how long that run would be."""
    launch = ResolvedLaunch("nccl", "cuda", 2, 60.0, "asked for")
    grid = grid_defaults("nccl", "cuda")
    run = estimate.estimate_run(grid.configs(), grid, launch)
    budget = grid.round_options().budget_seconds * len(grid.configs())
    assert run.seconds["rounds"] < 0.5 * budget <= run.rounds_ceiling_seconds
    assert run.ceiling_seconds == pytest.approx(run.total_seconds - run.seconds["rounds"] + run.rounds_ceiling_seconds)
    assert f"up to {estimate.minutes_text(run.ceiling_seconds)} if the steps vary more" in run.line()
