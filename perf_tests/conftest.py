"""The benchmark grid of perf_tests/ (``ddp.bench.config.options.GridOptions``: defaults per backend,
overridden by the command line), its parametrization, the rank groups of other world sizes, and the
run's closing summary of the precision each benchmark reached."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import pytest

from conftest import benchmark_grid, launch  # the root conftest's: resolved and built once a session
from ddp.analysis.compare import DEFAULT_THRESHOLD, AimAtDecision, gate
from ddp.bench.config.options import GridOptions
from ddp.bench.config.parsing import percent_type
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.state import TRACKED_STEPS
from ddp.bench.results import timing
from ddp.bench.results.records import RUN_KEY, Run, RunFileError, StepRecord, load_run, run_from_data, to_extra_info
from ddp.bench.results.stats import smallest_rounds
from ddp.bench.rounds.ledger import PARTS, ROUNDS, STARTUP, Ledger, SavedRun, estimated_length, minutes_text, time_left
from ddp.launcher import RankGroup, started_seconds, unavailable_reason
from ddp.strategies.registry import steps_to_settle

PRECISION = pytest.StashKey[dict]()
AIMED = pytest.StashKey[list]()
MEASURED = pytest.StashKey[list]()
"""This session's benchmarks as pytest-benchmark saves them (name, group, extra_info, stats), for the gate."""
SESSION = pytest.StashKey[pytest.Session]()
LEDGER = pytest.StashKey[Ledger]()
"""Where the run's time went, by part (``ddp.bench.rounds.ledger``)."""
STARTED = pytest.StashKey[tuple[float, float]]()
"""The session's start: ``time.perf_counter()`` and ``started_seconds()`` then."""
COMPARED = pytest.StashKey[list]()
"""Each run ``--benchmark-compare`` loaded, as pytest-benchmark read it, with this session's machine info."""
PROGRESS = pytest.StashKey[dict]()
"""The step benchmarks selected, those done, the estimate, and when the first began."""
BEGAN = pytest.StashKey[float]()
"""When a test began (``time.perf_counter()``): a benchmark's seconds, where no ledger counts them."""


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SESSION] = session  # the gate sets its exit status
    session.config.stash[LEDGER] = Ledger()
    session.config.stash[STARTED] = (time.perf_counter(), started_seconds())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before any rank starts: refuse a comparison that cannot be made (``check_compared``), and
    print the run's estimated length (``ddp.bench.rounds.ledger.estimated_length``): what the last
    saved run of the same benchmarks took, or the ceiling the options set."""
    benchmarks = [item for item in session.items if is_benchmark(item)]
    if not benchmarks:
        return
    problem = check_compared(session.config, {item.name: item.callspec.params["step_config"] if is_step_benchmark(item)
                                              else None for item in benchmarks})
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.INTERRUPTED)  # 2, as every command's usage error
    grid = benchmark_grid(session.config)
    steps = [item for item in benchmarks if is_step_benchmark(item)]
    untimed = grid.rank_groups * (max(steps_to_settle(s) for s in grid.strategies) + 1) + TRACKED_STEPS + grid.rounds.traced_steps
    estimate = estimated_length([item.name for item in benchmarks], saved_runs(session.config), saved_rounds(grid),
                                len(steps), untimed)
    session.config.stash[PROGRESS] = {"selected": {item.name: item.callspec.params["step_config"] for item in steps},
                                      "finished": set(), "estimate": estimate}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(estimate.line)


def check_compared(config: pytest.Config, selected: dict[str, StepConfig | None]) -> str | None:
    """Why ``--benchmark-compare`` cannot compare this run, in one line naming the runs saved here,
    or None: no saved run matches what it names, or the one it loaded holds none of the
    ``selected`` step benchmarks (by name and configuration: test ids leave the model and the
    options at their defaults out; the other benchmarks where no step is selected), a run of
    another grid. Checked after
    collection, before any rank starts, instead of after every benchmark has run."""
    asked = config.getoption("benchmark_compare", None)
    if not asked:
        return None
    storage = getattr(getattr(config, "_benchmarksession", None), "storage", None)
    saved = [path.stem for path in storage.query("[0-9][0-9][0-9][0-9]_")] if storage is not None else []
    where = f"in {getattr(storage, 'path', 'the benchmark storage')}"
    existing = f"runs saved {where}: {', '.join(saved)}" if saved else f"no run is saved {where}: save one first with --benchmark-save=NAME"
    compared = config.stash.get(COMPARED, [])
    if not compared:
        named = "the last saved run" if asked is True else f"a saved run {asked!r}"
        return f"--benchmark-compare: no {named[2:] if named.startswith('a ') else named}; {existing}"
    try:
        saved_runs_ = [run for _, run in compared_runs(config)]
    except RunFileError:
        return None  # the gate says what is wrong with the file at the end
    held = {bench.name: getattr(bench.record, "config", None) for run in saved_runs_ for bench in run.benchmarks}
    # The step benchmarks decide where there are any: an all-reduce of the same name is no reason
    # to run a grid of another model against this one.
    judged = {name: step for name, step in selected.items() if step is not None} or selected
    if not any(name in held and (step is None or held[name] in (None, step)) for name, step in judged.items()):
        steps = {c.group_label(True) for c in held.values() if isinstance(c, StepConfig)}
        holds = f"its steps are {'; '.join(sorted(steps))}" if steps else f"it holds {', '.join(sorted(held)[:3])}"
        what = f"{len(judged)} step benchmarks" if judged is not selected else f"{len(selected)} benchmarks"
        return (f"--benchmark-compare: the run it loaded holds none of these {what} ({holds}): a run of another grid; "
                f"compare with a run of the same options, {existing}")
    return None


def saved_rounds(grid: GridOptions) -> dict:
    """The rounds a run of ``grid`` is asked for, as a saved run records them (``pytest_benchmark_update_machine_info``)."""
    return json.loads(json.dumps(dataclasses.asdict(grid.round_options())))  # as it reads back: inf as JSON writes it


def saved_runs(config: pytest.Config):
    """The runs saved in pytest-benchmark's storage, newest first, as ``ddp.bench.rounds.ledger.SavedRun``
    (read one by one, as the estimate asks; a file that is not a run is passed over)."""
    session = getattr(config, "_benchmarksession", None)
    storage = getattr(session, "storage", None)
    if storage is None or not hasattr(storage, "query"):
        return
    for path in reversed(storage.query("[0-9][0-9][0-9][0-9]_")):
        try:
            run = load_run(path)
        except RunFileError:
            continue
        yield SavedRun(f"{path.name}, {run.datetime or 'undated'}", {b.name: b.seconds for b in run.benchmarks},
                       run.run_info.get("run_seconds"), run.run_info.get("rounds"))


def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    """A saved run records its length and the rounds it was asked for (``RUN_KEY``), which the
    next run's estimate reads (``saved_runs``); not in its machine info, which pytest-benchmark
    compares between runs."""
    if STARTED in config.stash:
        output_json[RUN_KEY] = {"run_seconds": time.perf_counter() - config.stash[STARTED][0],
                                "rounds": saved_rounds(benchmark_grid(config))}


def is_benchmark(item: pytest.Item) -> bool:
    """A test of perf_tests/ that pytest-benchmark times and saves."""
    return item.path.is_relative_to(Path(__file__).parent) and "benchmark" in getattr(item, "fixturenames", ())


def is_step_benchmark(item: pytest.Item) -> bool:
    return hasattr(item, "callspec") and "step_config" in item.callspec.params


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[BEGAN] = time.perf_counter()
    progress = item.config.stash.get(PROGRESS, None)
    if progress is None or not is_step_benchmark(item):
        return (yield)
    before = run_parts(item.config)
    progress.setdefault("began", before[0])
    done = yield
    progress_line(item, progress, before)  # here, outside the test's output capture
    return done


def progress_line(item: pytest.Item, progress: dict, before: tuple[float, dict[str, float]]) -> None:
    """After each step benchmark, a line of progress: how many of the run's are measured (a group
    measured together counts at once), in how long since the first began, the time left at that
    rate, and what this one cost by part (on a GPU
    a benchmark takes minutes, and a run cut short still says where its time went). A benchmark
    measured with others of its group carries their parts: the first of a group costs what the
    group does, the others nothing more."""
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    wall, parts = run_parts(item.config)
    progress["finished"].add(item.name)
    ledger = item.config.stash[LEDGER]
    done = sum(name in progress["finished"] or ledger.count(config, ROUNDS) > 0 for name, config in progress["selected"].items())
    shown = ", ".join(f"{part} {minutes_text(parts[part] - before[1][part])}" for part in PARTS
                      if parts[part] - before[1][part] >= 0.5)
    left = time_left(done, len(progress["selected"]), wall - progress["began"])
    reporter.ensure_newline()
    if reporter._tw.width_of_current_line:  # after -q's dots, which ensure_newline does not see
        reporter._tw.line()
    reporter.write_line(
        f"ddp-bench: {done} of {len(progress['selected'])} step benchmarks measured in {minutes_text(wall - progress['began'])}"
        + (f", about {minutes_text(left)} left at this rate" if left else "")
        + f"; {item.name} {minutes_text(wall - before[0])}" + (f": {shown}" if shown else ""))


@pytest.fixture(scope="session")
def run_ledger(pytestconfig: pytest.Config) -> Ledger:
    """The run's ledger: every grid's builds, warm-ups, memory counts, rounds, traced steps and
    predictions (``ddp.bench.rounds.grid_measurer.GridMeasurer``), printed by part at the end."""
    return pytestconfig.stash[LEDGER]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ddp-bench-grid").addoption(
        "--ddp-fail-slower", default=None, nargs="?", const=DEFAULT_THRESHOLD, metavar="PERCENT",
        type=percent_type("--ddp-fail-slower"),
        help="with --benchmark-compare: fail when a benchmark is slower than the compared run by more than this, its "
        f"interval above 1, e.g. 10%% (alone: {DEFAULT_THRESHOLD * 100:g}%%); see `python -m ddp compare`",
    )


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(config: pytest.Config, benchmarksession, machine_info: dict,
                                          compared_benchmark: dict) -> None:
    """pytest-benchmark's public hook hands over every run ``--benchmark-compare`` loads (this
    conftest is loaded before it loads them: pytest reads the conftest of the paths it is given
    first); the regression gate and the rounds aimed at it read them here."""
    config.stash.setdefault(COMPARED, []).append((compared_benchmark, machine_info))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    grid = benchmark_grid(metafunc.config)
    if "step_config" in metafunc.fixturenames:
        configs = grid.configs()
        metafunc.parametrize("step_config", configs, ids=[c.test_id for c in configs])
    if "allreduce_world_size" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_world_size", grid.allreduce_world_sizes, ids=lambda n: f"n{n}")
    if "allreduce_size_mb" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_size_mb", grid.allreduce_sizes_mb, ids=lambda mb: f"{mb:g}mb")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every benchmark times its rounds with ddp-bench's round clock and records the grid's round
    policy as its options (``ddp.bench.results.timing.benchmark_marker``, pytest-benchmark's own marker)."""
    marker = timing.benchmark_marker(benchmark_grid(config).round_options())
    for item in items:
        if "benchmark" in getattr(item, "fixturenames", ()):
            item.add_marker(marker, append=False)


@pytest.fixture(scope="session")
def grid(pytestconfig: pytest.Config) -> GridOptions:
    return benchmark_grid(pytestconfig)


@pytest.fixture
def record_rounds(benchmark, request: pytest.FixtureRequest):
    """Call with the measured rounds (seconds) and the record (or a plain dict of figures): hands
    them to pytest-benchmark (``ddp.bench.results.timing.record_rounds``, ``extra_info``) and keeps them for
    the regression gate at the end of the session."""

    def record(round_seconds: list[float], figures) -> None:
        if isinstance(figures, StepRecord):
            pass  # its seconds are its configuration's own parts (``seconds_by_part``)
        elif isinstance(figures, dict):
            figures = {**figures, "benchmark_seconds": time.perf_counter() - request.node.stash[BEGAN]}
        else:
            figures = dataclasses.replace(figures, benchmark_seconds=time.perf_counter() - request.node.stash[BEGAN])
        info = figures if isinstance(figures, dict) else to_extra_info(figures)
        timing.record_rounds(benchmark, round_seconds)
        benchmark.extra_info.update(info)
        request.config.stash.setdefault(MEASURED, []).append({
            "name": request.node.name, "group": benchmark.group, "extra_info": info,
            "stats": {"median": statistics.median(round_seconds), "data": list(round_seconds)},
        })

    return record


@pytest.fixture(scope="session")
def extra_rank_groups(pytestconfig: pytest.Config):
    """Rank groups of other sizes than the session's, each started once, all closed at the end.

    Call it with a world size (and which of the groups of that size, from 0); it skips, saying
    what to do, where the hardware cannot run it.
    """
    resolved = launch(pytestconfig)
    groups: dict[tuple[int, int], RankGroup] = {}

    def group_of(world_size: int, index: int = 0) -> RankGroup:
        reason = unavailable_reason(resolved.backend, world_size, resolved.device)
        if reason:
            pytest.skip(reason)
        if (world_size, index) not in groups:
            groups[world_size, index] = RankGroup(world_size, resolved.backend, resolved.device, resolved.timeout_seconds,
                                                  label=f"extra group {index} of {world_size} ranks")
        return groups[world_size, index]

    yield group_of
    for group in groups.values():
        group.close()


@pytest.fixture(scope="session")
def more_rank_groups(pytestconfig: pytest.Config, grid: GridOptions):
    """The groups of ranks beside the session's own that every benchmark's rounds are spread over
    (``--rank-groups``, ``ddp.bench.rounds.spread.measure_in_rank_groups``): each of the session's size,
    backend and device, started apart on first use, closed at the end of the session."""
    resolved = launch(pytestconfig)
    groups = [RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds,
                        label=f"rank group {index + 2} of --rank-groups {grid.rank_groups}")
              for index in range(grid.rank_groups - 1)]
    yield groups
    for group in groups:
        group.close()


@pytest.fixture(scope="session")
def tracing_group(pytestconfig: pytest.Config):
    """Ranks of the session's size, backend and device that run every benchmark's traced steps and
    time nothing (``ddp.bench.rounds.grid_measurer.GridMeasurer``'s tracer: on CUDA the profiler leaves CUPTI
    attached to a process); started on the first trace, closed at the end of the session."""
    resolved = launch(pytestconfig)
    group = RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds,
                      label="the tracing ranks")
    yield group
    group.close()


@pytest.fixture
def allreduce_groups(request: pytest.FixtureRequest, allreduce_world_size: int, extra_rank_groups,
                     grid: GridOptions) -> list[RankGroup]:
    """The ``--rank-groups`` groups of ranks an all-reduce world size's rounds are spread over: the
    session's own and ``more_rank_groups`` when the sizes match (no other spawn), else extras of
    that size."""
    if allreduce_world_size == launch(request.config).world_size:
        return [request.getfixturevalue("rank_group"), *request.getfixturevalue("more_rank_groups")]
    return [extra_rank_groups(allreduce_world_size, index) for index in range(grid.rank_groups)]


@pytest.fixture
def record_precision(request: pytest.FixtureRequest):
    """Call with (reached, target) relative half-widths: the closing summary lists them."""
    table = request.config.stash.setdefault(PRECISION, {})

    def record(reached: float | None, target: float) -> None:
        if reached is not None:
            table[request.node.name] = (reached, target)

    return record


def compared_runs(config: pytest.Config) -> list[tuple[str, Run]]:
    """(label, run) of each saved run ``--benchmark-compare`` loaded (handed over by pytest-benchmark's
    ``pytest_benchmark_compare_machine_info`` hook, below); raises ``RunFileError``."""
    runs = []
    for data, _ in config.stash.get(COMPARED, []):
        commit = (data.get("commit_info") or {}).get("id") or "?"
        label = f"the run saved {data.get('datetime') or '?'} (commit {commit[:12]})"
        runs.append((label, run_from_data(Path(label), data)))
    return runs


@pytest.fixture(scope="session")
def aim_at_decision(pytestconfig: pytest.Config) -> AimAtDecision | None:
    """With ``--benchmark-compare``: the stop criterion that adds rounds until each step's comparison
    with the saved run is settled (``ddp.analysis.compare.AimAtDecision``), at ``--ddp-fail-slower``
    (default: the gate's, ``ddp.analysis.compare.DEFAULT_THRESHOLD``). None without a saved run
    (the precision target decides)."""
    try:
        runs = compared_runs(pytestconfig)
    except RunFileError:
        return None  # the gate reports it at the end
    if not runs:
        return None
    threshold = pytestconfig.getoption("ddp_fail_slower") or DEFAULT_THRESHOLD
    criterion = AimAtDecision(runs[-1][1], threshold, lambda config: f"test_step[{config.test_id}]")
    pytestconfig.stash.setdefault(AIMED, []).append((runs[-1][0], criterion))
    return criterion


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if exitstatus == pytest.ExitCode.INTERRUPTED and not config.stash.get(MEASURED, []):
        return  # stopped before anything ran (``check_compared``, Ctrl-C): its own line says why
    time_by_part(terminalreporter, config)
    precision_summary(terminalreporter, config)
    unpaired_summary(terminalreporter, config)
    aimed_summary(terminalreporter, config)
    threshold = config.getoption("ddp_fail_slower")
    if threshold is not None:
        regression_gate(terminalreporter, config, threshold)


def regression_gate(terminalreporter, config: pytest.Config, threshold: float) -> None:
    """``--ddp-fail-slower``: this run's benchmarks (``record_rounds`` keeps them) against the run
    ``--benchmark-compare`` loaded, through ``ddp.analysis.compare``; a slowdown by its rule fails the session."""
    terminalreporter.section("ddp-bench regression gate")
    compared = config.stash.get(COMPARED, [])
    if not compared:
        terminalreporter.write_line("--ddp-fail-slower needs --benchmark-compare and a saved run to compare with")
        config.stash[SESSION].exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    try:
        new = run_from_data(Path("this run"), {"machine_info": compared[0][1], "benchmarks": config.stash.get(MEASURED, [])})
        olds = compared_runs(config)
    except RunFileError as error:
        terminalreporter.write_line(f"--ddp-fail-slower: {error}")
        config.stash[SESSION].exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    for label, old in olds:
        judged = gate(old, new, threshold)  # the one gate, as `ddp compare` judges
        terminalreporter.write_line(f"against {label}:")
        for line in [*judged.warnings, *judged.lines]:
            terminalreporter.write_line(line)
        if judged.failed:
            config.stash[SESSION].exitstatus = pytest.ExitCode.TESTS_FAILED


def time_by_part(terminalreporter, config: pytest.Config) -> None:
    """Where the run's time went: the ledger's parts, the groups' start-up, and the rest (pytest,
    the all-reduce benchmark's and the races' own work, freeing and moving results)."""
    ledger = config.stash.get(LEDGER, None)
    if ledger is None or not ledger.seconds:
        return
    wall, parts = run_parts(config)
    terminalreporter.section("ddp-bench time by part")
    shown = ", ".join(f"{part} {minutes_text(parts[part])}" for part in PARTS)
    rest = wall - sum(parts.values())
    terminalreporter.write_line(f"run {minutes_text(wall)}: {shown}, other {minutes_text(max(0.0, rest))}")
    estimate = config.stash.get(PROGRESS, {}).get("estimate")
    if estimate is not None and estimate.seconds is not None:
        terminalreporter.write_line(f"estimated {minutes_text(estimate.seconds)} before it started, from the last saved run "
                                    "of these benchmarks")


def run_parts(config: pytest.Config) -> tuple[float, dict[str, float]]:
    """The session's seconds so far, and by part: the ledger's, with the groups' start-up."""
    started, starts_before = config.stash[STARTED]
    parts = config.stash[LEDGER].by_part()
    parts[STARTUP] += started_seconds() - starts_before
    return time.perf_counter() - started, parts


def unpaired_summary(terminalreporter, config: pytest.Config) -> None:
    """The steps that ran without their ``local`` twin where the grid pairs them, and why: their
    rows have no overhead over ``local``."""
    unpaired = [(bench["name"], bench["extra_info"]["unpaired_reason"]) for bench in config.stash.get(MEASURED, [])
                if bench["extra_info"].get("unpaired_reason")]
    if not unpaired:
        return
    terminalreporter.section("ddp-bench steps without their local twin")
    for name, reason in unpaired:
        terminalreporter.write_line(f"  {name}: {reason}")


def precision_summary(terminalreporter, config: pytest.Config) -> None:
    table: dict[str, tuple[float, float]] = config.stash.get(PRECISION, {})
    if not table:
        return
    reached = [r for r, _ in table.values()]
    missed = {name: (r, t) for name, (r, t) in table.items() if r > t}
    terminalreporter.section("ddp-bench precision")
    terminalreporter.write_line(
        f"95% interval of each median, as +- a share of it, over {len(table)} benchmarks: "
        f"median +-{statistics.median(reached):.1%}, widest +-{max(reached):.1%}"
    )
    short = [(bench["name"], bench["extra_info"]["step_seconds_ci_coverage"]) for bench in config.stash.get(MEASURED, [])
             if (bench["extra_info"].get("step_seconds_ci_coverage") or 1.0) < 0.95]
    if short:
        terminalreporter.write_line(
            f"{len(short)} interval(s) from fewer than {smallest_rounds()} rounds cover less than 95%: "
            + ", ".join(f"{name} {coverage:.1%}" for name, coverage in short) + f"; take --rounds {smallest_rounds()} or more")
    if missed:
        terminalreporter.write_line(f"{len(missed)} did not reach their target within the round budget:")
        for name, (r, t) in sorted(missed.items(), key=lambda item: -item[1][0]):
            terminalreporter.write_line(f"  {name}: +-{r:.1%} (target +-{t:.1%})")
        terminalreporter.write_line("raise --round-budget or --max-rounds, or run on a quieter machine; where a benchmark's "
                                    "groups of ranks disagree (its interval is two-level), more --rank-groups narrow it")


def aimed_summary(terminalreporter, config: pytest.Config) -> None:
    """How the rounds aimed at the comparison with the saved run ended: settled, or budget spent."""
    for label, criterion in config.stash.get(AIMED, []):
        if not criterion.outcomes:
            continue
        terminalreporter.section("ddp-bench rounds aimed at the decision")
        outcomes = criterion.outcomes
        open_ = {name: o for name, o in outcomes.items() if not o.settled}
        terminalreporter.write_line(
            f"against {label} at {criterion.threshold:.0%}: {len(outcomes) - len(open_)} of {len(outcomes)} "
            "step benchmarks settled before the budget"
        )
        for name, outcome in outcomes.items():
            how = f"settled after {outcome.rounds} rounds" if outcome.settled else \
                f"budget spent, not settled at {outcome.rounds} rounds"
            terminalreporter.write_line(f"  {name}: {outcome.decision.verdict} ({outcome.decision.basis}); {how}")
        if open_:
            terminalreporter.write_line("raise --round-budget or --max-rounds to settle the others")
