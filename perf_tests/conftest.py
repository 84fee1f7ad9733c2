"""The benchmark grid of perf_tests/ (``ddp.bench.options.GridOptions``: defaults per backend,
overridden by the command line), its parametrization, the rank groups of other world sizes, and the
run's closing summary of the precision each benchmark reached."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from ddp.analysis.compare import AimAtDecision, gate
from ddp.bench.options import GridOptions, ResolvedLaunch, grid_options, launch_options
from ddp.bench.parsing import percent_type
from ddp.bench.records import RunFileError, load_run, run_from_data
from ddp.launcher import RankGroup, unavailable_reason

PRECISION = pytest.StashKey[dict]()
AIMED = pytest.StashKey[list]()
DEFAULT_DECISION_THRESHOLD = 0.10  # what --benchmark-compare aims its rounds at without --ddp-fail-slower
SESSION = pytest.StashKey[pytest.Session]()


def launch(config: pytest.Config) -> ResolvedLaunch:
    """The session's backend and device (validated by the root conftest before collection)."""
    return launch_options(config.getoption).resolve()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SESSION] = session  # the gate sets its exit status


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ddp-bench-grid").addoption(
        "--ddp-fail-slower", default=None, metavar="PERCENT", type=percent_type("--ddp-fail-slower"),
        help="with --benchmark-compare: fail when a benchmark is resolved slower than the compared run by more than "
        "this, e.g. 10%% (its 95%% interval of new / old entirely above 1.10); see `python -m ddp compare`",
    )


def benchmark_grid(config: pytest.Config) -> GridOptions:
    resolved = launch(config)
    return grid_options(config.getoption, resolved.backend, resolved.device)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    grid = benchmark_grid(metafunc.config)
    if "step_config" in metafunc.fixturenames:
        configs = grid.configs()
        metafunc.parametrize("step_config", configs, ids=[c.test_id for c in configs])
    if "allreduce_world_size" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_world_size", grid.allreduce_world_sizes, ids=lambda n: f"n{n}")
    if "allreduce_size_mb" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_size_mb", grid.allreduce_sizes_mb, ids=lambda mb: f"{mb:g}mb")


@pytest.fixture(scope="session")
def grid(pytestconfig: pytest.Config) -> GridOptions:
    return benchmark_grid(pytestconfig)


@pytest.fixture(scope="session")
def extra_rank_groups(pytestconfig: pytest.Config):
    """Rank groups of other sizes than the session's, each started once, all closed at the end.

    Call it with a world size; it skips, saying what to do, where the hardware cannot run it.
    """
    resolved = launch(pytestconfig)
    groups: dict[int, RankGroup] = {}

    def group_of(world_size: int) -> RankGroup:
        reason = unavailable_reason(resolved.backend, world_size, resolved.device)
        if reason:
            pytest.skip(reason)
        if world_size not in groups:
            groups[world_size] = RankGroup(world_size, resolved.backend, resolved.device, resolved.timeout_seconds)
        return groups[world_size]

    yield group_of
    for group in groups.values():
        group.close()


@pytest.fixture
def allreduce_group(request: pytest.FixtureRequest, allreduce_world_size: int, extra_rank_groups) -> RankGroup:
    """The session's rank group when the sizes match (no second spawn), else one of the extras."""
    if allreduce_world_size == launch(request.config).world_size:
        return request.getfixturevalue("rank_group")
    return extra_rank_groups(allreduce_world_size)


@pytest.fixture
def record_precision(request: pytest.FixtureRequest):
    """Call with (reached, target) relative half-widths: the closing summary lists them."""
    table = request.config.stash.setdefault(PRECISION, {})

    def record(reached: float | None, target: float) -> None:
        if reached is not None:
            table[request.node.name] = (reached, target)

    return record


def compared_runs(config: pytest.Config) -> list[tuple[str, object]]:
    """(path, run) of each saved run ``--benchmark-compare`` loaded; raises ``RunFileError``."""
    # pytest-benchmark offers no public way to the runs --benchmark-compare loaded: its session is the one
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.compared_mapping:
        return []
    # pytest-benchmark names compared runs relative to its storage folder
    return [(path, load_run(Path(session.storage.path) / path)) for path in session.compared_mapping]


@pytest.fixture(scope="session")
def aim_at_decision(pytestconfig: pytest.Config) -> AimAtDecision | None:
    """With ``--benchmark-compare``: the stop criterion that adds rounds until each step's comparison
    with the saved run is settled (``ddp.analysis.compare.AimAtDecision``), at ``--ddp-fail-slower``
    (default 10%). None without a saved run (the precision target decides)."""
    try:
        runs = compared_runs(pytestconfig)
    except RunFileError:
        return None  # the gate reports it at the end
    if not runs:
        return None
    threshold = pytestconfig.getoption("ddp_fail_slower") or DEFAULT_DECISION_THRESHOLD
    criterion = AimAtDecision(runs[-1][1], threshold, lambda config: f"test_step[{config.test_id}]")
    pytestconfig.stash.setdefault(AIMED, []).append((runs[-1][0], criterion))
    return criterion


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    precision_summary(terminalreporter, config)
    aimed_summary(terminalreporter, config)
    threshold = config.getoption("ddp_fail_slower")
    if threshold is not None:
        regression_gate(terminalreporter, config, threshold)


def regression_gate(terminalreporter, config: pytest.Config, threshold: float) -> None:
    """``--ddp-fail-slower``: this run against the one ``--benchmark-compare`` loaded, through
    ``ddp.analysis.compare``; a resolved slowdown fails the session."""
    # pytest-benchmark offers no public way to the runs --benchmark-compare loaded: its session is the one
    session = getattr(config, "_benchmarksession", None)
    terminalreporter.section("ddp-bench regression gate")
    if session is None or not session.compared_mapping:
        terminalreporter.write_line("--ddp-fail-slower needs --benchmark-compare and a saved run to compare with")
        config.stash[SESSION].exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    try:
        new = run_from_data(Path("this run"), {
            "machine_info": session.get_machine_info(),
            "benchmarks": [bench.as_dict(include_data=False) for bench in session.benchmarks if not bench.has_error],
        })
        olds = compared_runs(config)
    except RunFileError as error:
        terminalreporter.write_line(f"--ddp-fail-slower: {error}")
        config.stash[SESSION].exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    for path, old in olds:
        judged = gate(old, new, threshold)  # the one gate, as `ddp compare` judges
        terminalreporter.write_line(f"against {path}:")
        for line in [*judged.warnings, *judged.lines]:
            terminalreporter.write_line(line)
        if judged.failed:
            config.stash[SESSION].exitstatus = pytest.ExitCode.TESTS_FAILED


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
    if missed:
        terminalreporter.write_line(f"{len(missed)} did not reach their target within the round budget:")
        for name, (r, t) in sorted(missed.items(), key=lambda item: -item[1][0]):
            terminalreporter.write_line(f"  {name}: +-{r:.1%} (target +-{t:.1%})")
        terminalreporter.write_line("raise --round-budget or --max-rounds, or run on a quieter machine")


def aimed_summary(terminalreporter, config: pytest.Config) -> None:
    """How the rounds aimed at the comparison with the saved run ended: settled, or budget spent."""
    for path, criterion in config.stash.get(AIMED, []):
        if not criterion.outcomes:
            continue
        terminalreporter.section("ddp-bench rounds aimed at the decision")
        outcomes = criterion.outcomes
        open_ = {name: o for name, o in outcomes.items() if not o.settled}
        terminalreporter.write_line(
            f"against {path} at {criterion.threshold:.0%}: {len(outcomes) - len(open_)} of {len(outcomes)} "
            "step benchmarks settled before the budget"
        )
        for name, outcome in outcomes.items():
            how = f"settled after {outcome.rounds} rounds" if outcome.settled else \
                f"budget spent, not settled at {outcome.rounds} rounds"
            terminalreporter.write_line(f"  {name}: {outcome.decision.verdict} ({outcome.decision.basis}); {how}")
        if open_:
            terminalreporter.write_line("raise --round-budget or --max-rounds to settle the others")
