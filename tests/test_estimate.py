"""The length a benchmark run prints before it starts (``estimated length: ...``,
``ddp.bench.rounds.estimate``) against the length it then takes, printed at its end with its time
by part (``ddp.bench.rounds.ledger``): within 20% on this CPU, for a run laid out as the default
one is (two timing groups, each strategy with its ``local`` twin, traced where timed)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp.bench.config.options import ResolvedLaunch, grid_defaults
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds import estimate

ROOT = Path(__file__).parents[1]
SECONDS = r"(?:(\d+) min )?(\d+) s"
TABLE = estimate.MEASURED["cpu"]
TABLE_SPEED = estimate.HostSpeed(TABLE.flops_per_second, TABLE.optimizer_seconds_per_gparam, TABLE.reference_step_seconds)
"""A host as fast as the one the CPU's table was measured on: nothing scaled."""


def _seconds(match: re.Match, first: int = 1) -> float:
    """The length ``SECONDS`` matched, its groups from ``first`` on."""
    minutes, seconds = match.group(first, first + 1)
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
    # The estimate at the speed the ranks had (the host may slow down under a run, as a shared CI
    # machine's did by 1.6x), then the estimate made before the run: within 20% beyond what the
    # host's change of speed, which the run measures in its own local steps, accounts for.
    again = re.search(rf"estimated {SECONDS} before it started; its local steps then took ([\d.]+)x the time "
                      rf"priced: {SECONDS} with every step at that speed", done.stdout)
    assert again and _seconds(again) == _seconds(estimated), parts
    at_speed = _seconds(again, 4)
    length = _seconds(ran)
    assert abs(at_speed - length) <= 0.2 * length, (again.group(0), parts)
    assert abs(_seconds(estimated) - length) <= 0.2 * length + abs(at_speed - _seconds(estimated)), (
        estimated.group(0), again.group(0), parts)
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

    monkeypatch.setattr(estimate, "host_speed", built)
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
    monkeypatch.setattr(estimate, "host_speed", lambda *_: TABLE_SPEED)
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
    ``group_share``); one that varies by up to half a round never reaches +-1%, and stops the first
    round its budget is spent, which the ceiling assumes of every step."""
    grid = grid_defaults("nccl", "cuda")
    policy = grid.round_options()
    shares = [estimate.group_share(policy, grid.rank_groups, index) for index in range(grid.rank_groups)]
    steady, noisy = (1.0,), tuple(0.5 + 0.05 * i for i in range(21))
    pair = (0.5, 0.6)
    assert sum(estimate.expected_round_seconds(pair, share, steady) for share in shares) == pytest.approx(
        policy.min_rounds * sum(pair))
    for share in shares:  # the first round at or past the budget is the last
        rounds = math.ceil(share.budget_seconds / sum(pair))
        assert estimate.expected_round_seconds(pair, share, noisy) == pytest.approx(rounds * sum(pair), rel=0.1)
    # a budget spent before the minimum rounds does not cut them
    slow = (10.0, 12.0)
    assert estimate.expected_round_seconds(slow, shares[0], noisy) == pytest.approx(shares[0].min_rounds * sum(slow), rel=0.1)
    # past the simulated rounds, rounds that have not settled go on until the budget is spent
    tiny_steps = (0.005, 0.005)
    assert estimate.expected_round_seconds(tiny_steps, shares[0], noisy) == pytest.approx(shares[0].budget_seconds, rel=0.02)
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


def test_what_a_run_holds_besides_its_step_benchmarks_is_priced_and_counted():
    """Each all-reduce world size: its fixed part and its rounds on each group (every size of the
    grid in every round, whichever of its tests were selected, with the budget of as many
    benchmarks as sizes); each race: its contenders built once on the
    first group, then timed together; every other test at its measured average. Against arithmetic,
    with rounds that never vary (their minimum)."""
    costs = dataclasses.replace(estimate.MEASURED["cuda"], round_spread=(1.0,), allreduce_spread=(1.0,))
    launch = ResolvedLaunch("nccl", "cuda", 2, 60.0, "asked for")
    grid = grid_defaults("nccl", "cuda")
    policy = grid.round_options()
    contenders = tuple(StepConfig(s, "tiny", 2, 32, 25.0 if s != "local" else None) for s in ("local", "bucketed", "torch"))
    grid = dataclasses.replace(grid, allreduce_sizes_mb=(1.0, 100.0))
    besides = estimate.Besides((2, 4), 3, (contenders,), 3)  # 3 of the 4 all-reduce tests selected
    alone = estimate.estimate_run([], grid, launch)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(estimate.MEASURED, "cuda", costs)
        run = estimate.estimate_run([], grid, launch, besides)
    assert run.besides == 3 + 1 + 3 and run.line().startswith("estimated length: ") and " for 7 tests (" in run.line()

    def allreduce(n: int, mb: float) -> float:
        return costs.allreduce_latency_seconds + mb * 2**20 * 2 * (n - 1) / n / costs.allreduce_bus_bytes_per_second
    rounds = policy.min_rounds  # over both groups
    assert run.seconds["all-reduces"] == pytest.approx(
        2 * costs.allreduce_seconds + rounds * (allreduce(2, 1.0) + allreduce(2, 100.0) + allreduce(4, 1.0)
                                                + allreduce(4, 100.0)), rel=1e-3)
    step = costs.step_seconds + sum(estimate.step_flops(c) for c in contenders) / 3 / costs.flops_per_second
    assert run.seconds["races"] == pytest.approx(policy.min_rounds * 3 * step + costs.benchmark_seconds, rel=1e-3)
    built = costs.first_build_seconds + 3 * (costs.build_seconds + costs.build_seconds_per_gparam
                                             * estimate.parameters(contenders[0]) / 1e9)  # on the first group
    assert run.seconds["builds"] == pytest.approx(built)
    assert run.seconds["other tests"] == 3 * costs.check_seconds
    assert run.step_benchmark_seconds == pytest.approx(alone.total_seconds + built + run.seconds["warm-up"]
                                                       + run.seconds["memory counts"] + run.seconds["predictions"])


def test_the_line_counts_every_test_perf_tests_selected():
    """The estimate printed before a run covers what it selected: the step benchmarks, and the
    all-reduces, the race and the harness's checks besides them."""
    done = subprocess.run([sys.executable, "-m", "pytest", "perf_tests", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--model", "tiny", "--batch-sizes", "2", "--seq-lens", "32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if line.startswith("perf_tests/")]
    steps = sum("::test_step[" in line for line in ids)
    assert steps and len(ids) > steps
    assert f"for {steps} step benchmarks and {len(ids) - steps} other tests (" in done.stdout, done.stdout[-3000:]


def test_a_build_is_priced_restored_where_the_run_restores_it(monkeypatch):
    """On CPU each timing group keeps its ``local`` twin built and releases every other strategy
    before the next build, which then starts from the released module and the kept copy
    (``ddp.bench.rounds.reuse``): the twin and the first other strategy of a workload are fresh
    builds, the next restored; a sharding strategy, which the copy cannot serve, is always fresh.
    On CUDA every build is priced fresh."""
    monkeypatch.setattr(estimate, "host_speed", lambda *_: TABLE_SPEED)
    grid = grid_defaults("gloo", "cpu")
    configs = [StepConfig("local", "mini", 2, 32), StepConfig("bucketed", "mini", 2, 32, 10.0),
               StepConfig("torch", "mini", 2, 32, 10.0), StepConfig("zero", "mini", 2, 32, 10.0)]
    costs = estimate.MEASURED["cpu"]
    fresh = costs.build_seconds + costs.build_seconds_per_gparam * estimate.parameters(configs[0]) / 1e9
    cpu = estimate.estimate_run(configs, grid, ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for"))
    assert cpu.seconds["builds"] == pytest.approx(grid.rank_groups * (costs.first_build_seconds + 3 * fresh
                                                                      + costs.restore_seconds))
    gpu_costs = estimate.MEASURED["cuda"]
    gpu_grid = grid_defaults("nccl", "cuda")
    gpu = estimate.estimate_run(configs, gpu_grid, ResolvedLaunch("nccl", "cuda", 2, 60.0, "asked for"))
    gpu_fresh = gpu_costs.build_seconds + gpu_costs.build_seconds_per_gparam * estimate.parameters(configs[0]) / 1e9
    assert gpu.seconds["builds"] == pytest.approx((gpu_grid.rank_groups + 1) * 4 * gpu_fresh)  # and the tracer's
    # A build keeps only the copies of the workloads it builds: after another workload's, a race on
    # the first one builds all three contenders fresh, on the first group of ranks.
    other = [StepConfig("local", "mini", 2, 64), StepConfig("bucketed", "mini", 2, 64, 10.0)]
    other_fresh = costs.build_seconds + costs.build_seconds_per_gparam * estimate.parameters(other[0]) / 1e9
    race = estimate.Besides(races=(tuple(configs[:3]),))
    later = estimate.estimate_run([*configs, *other], grid, ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for"), race)
    assert later.seconds["builds"] == pytest.approx(
        grid.rank_groups * (costs.first_build_seconds + 3 * fresh + costs.restore_seconds + 2 * other_fresh) + 3 * fresh)


def test_a_run_whose_steps_took_twice_the_time_priced_is_estimated_again_with_every_step_twice(monkeypatch):
    """At the end of a run the estimate is made again with its steps at the speed the run's own
    ``local`` steps had (``observed_slowdown``, ``at_run_speed``): every part priced in steps
    (warm-up, memory counts, traced steps, the race's) doubles when they took twice the time
    priced, the rounds grow less (their budget cuts them), and what is not a step is as it was."""
    monkeypatch.setattr(estimate, "host_speed", lambda *_: pytest.fail("given costs are not timed"))
    grid = grid_defaults("gloo", "cpu")
    configs = [StepConfig("local", "mini", 2, 32), StepConfig("bucketed", "mini", 2, 32, 10.0)]
    launch = ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for")
    race = estimate.Besides(races=(tuple(configs),), checks=1)
    fast = estimate.estimate_run(configs, grid, launch, race, costs=TABLE)
    slow = estimate.estimate_run(configs, grid, launch, race, costs=estimate.at_run_speed(TABLE, 2.0))
    assert fast.costs == TABLE and slow.costs.flops_per_second == TABLE.flops_per_second / 2
    assert estimate.on_this_host(TABLE, TABLE_SPEED, TABLE_SPEED) == TABLE  # the table's own speed: unscaled
    for part, seconds in fast.seconds.items():
        if part in ("warm-up", "memory counts", "traced steps"):
            assert slow.seconds[part] == pytest.approx(2 * seconds), part
        elif part in ("rounds", "races"):  # longer steps reach the budget of rounds in fewer of them
            assert seconds < slow.seconds[part] <= 2 * seconds, part
        else:
            assert slow.seconds[part] == pytest.approx(seconds), part
    priced = estimate.priced_step_seconds(slow.costs, configs[0])
    assert priced == pytest.approx(2 * estimate.priced_step_seconds(fast.costs, configs[0]))
    rounds = [(configs[1], [1.4 * priced, 1.5 * priced, 1.7 * priced]), (configs[0], [1.6 * priced])]
    assert estimate.observed_slowdown(slow.costs, rounds) == pytest.approx(1.55)
    assert estimate.observed_slowdown(slow.costs, [(configs[0], [])]) is None


def test_the_host_is_timed_with_as_many_copies_at_once_as_its_ranks_run(monkeypatch):
    """Two ranks on two cores step slower than one alone: the host's rate is timed on one copy of
    the step per rank the cores hold, all at once (their steps overlap in time), each on a rank's
    threads; ranks past the cores take turns, so the step is counted that many times slower."""
    cores = 2
    monkeypatch.setattr(estimate.os, "cpu_count", lambda: cores)
    assert estimate._timing_layout(1) == (2, 1, 1.0)
    assert estimate._timing_layout(2) == (1, 2, 1.0)
    assert estimate._timing_layout(4) == (1, 2, 2.0)
    config = StepConfig("local", "tiny", 2, 32)
    spans = []
    real = estimate.build_workload

    def build(*args):
        workload = real(*args)
        forward = workload.module.forward

        def timed_forward(*inputs):
            start = time.perf_counter()
            out = forward(*inputs)
            spans.append((start, time.perf_counter(), torch.get_num_threads()))
            time.sleep(0.05)  # a step long enough for the copies' steps to meet
            return out

        workload.module.forward = timed_forward
        return workload

    monkeypatch.setattr(estimate, "build_workload", build)
    two = estimate.host_speed(config, 2)
    assert len(spans) == 2 * (1 + estimate.TIMED_STEPS) and all(threads == 1 for *_, threads in spans)
    first, second = sorted(spans)[:2]
    assert second[0] < first[1] + 0.05  # the second copy's first step began before the first copy's ended
    four = estimate.host_speed(config, 4)
    # four ranks on two cores: each step counted twice as long
    assert four.flops_per_second < two.flops_per_second and two.optimizer_seconds_per_gparam > 0


def test_a_small_models_low_rate_prices_its_steps_not_the_hosts_other_work(monkeypatch):
    """tiny's step is bound by the host's per-operator overhead: its FLOPs rate reads a fifth of
    mini's on the same host. The host's speed for everything else (builds, start-up, traces) is
    read from the table's own step (``REFERENCE``) timed here, so a tiny grid is not priced five
    times too long (the CI smoke run, tiny at 2 x 32, was estimated at 5 min 7 s and took 36 s);
    a host whose reference step takes twice the table's takes twice as long at everything else."""
    tiny = estimate.HostSpeed(4.7e9, 16.0, 0.018)
    timed: list[StepConfig] = []

    def speed(config, world_size, reference=TABLE_SPEED):
        timed.append(config)
        return reference if config == estimate.REFERENCE else tiny

    monkeypatch.setattr(estimate, "host_speed", speed)
    grid = grid_defaults("gloo", "cpu")
    configs = [StepConfig("local", "tiny", 2, 32), StepConfig("bucketed", "tiny", 2, 32, 1.0)]
    launch = ResolvedLaunch("gloo", "cpu", 2, 60.0, "asked for")
    run = estimate.estimate_run(configs, grid, launch)
    assert timed == [configs[0], estimate.REFERENCE]
    assert run.costs.startup_seconds == TABLE.startup_seconds and run.costs.build_seconds == TABLE.build_seconds
    # its steps at its own rate and optimizer
    assert (run.costs.flops_per_second, run.costs.optimizer_seconds_per_gparam) == (4.7e9, 16.0)
    twice = dataclasses.replace(TABLE_SPEED, step_seconds=2 * TABLE.reference_step_seconds)
    monkeypatch.setattr(estimate, "host_speed", lambda config, world_size: speed(config, world_size, twice))
    slower = estimate.estimate_run(configs, grid, launch)
    assert slower.costs.startup_seconds == 2 * TABLE.startup_seconds and slower.costs.flops_per_second == tiny.flops_per_second
