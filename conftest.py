"""Fixtures and command-line options shared by correctness_tests/, tests/ and perf_tests/.

Options are not declared here: ``ddp.bench.config.options`` declares the launch (``--backend``,
``--world-size``, ``--device``, ``--rank-timeout``) and the grid (``--strategies``, ``--model``,
``--batch-sizes``, ...) once, for pytest and every ``python -m ddp`` command alike, and validates
them here, in the parent, before any rank starts: a bad value is a usage error.

The rank group is started once per session (a spawn per test is too slow) and replaced
automatically after a test in which a rank failed or hung. Saved benchmark runs go to
``.benchmarks/<backend>-<device>/`` (pytest-benchmark's machine id cannot tell gloo on CPU from
NCCL on GPUs), and the machine info saved with each run names torch, CUDA, NCCL and the GPU.
"""

from __future__ import annotations

import pytest

from ddp.bench.config.options import (
    LAUNCH_OPTIONS,
    GridOptions,
    OptionError,
    ResolvedLaunch,
    add_grid_options,
    add_launch_options,
    grid_options,
    launch_options,
)
from ddp.bench.results.machine import software_info
from ddp.launcher import RankGroup

LAUNCH = pytest.StashKey[ResolvedLaunch]()
GRID = pytest.StashKey[GridOptions]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_launch_options(parser.getgroup("ddp-bench", "ddp-bench: the group of ranks").addoption)
    add_grid_options(
        parser.getgroup("ddp-bench-grid", "ddp-bench: what is tested and benchmarked (comma-separated lists)").addoption
    )


def launch(config: pytest.Config) -> ResolvedLaunch:
    """The session's backend and device, resolved once (``pytest_configure``)."""
    return config.stash[LAUNCH]


def benchmark_grid(config: pytest.Config) -> GridOptions:
    """The session's grid: its configurations, rounds and budget, built and checked once
    (``pytest_configure``), for every conftest, fixture and test that asks."""
    return config.stash[GRID]


DEFAULT_BENCHMARK_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default


WORLD_SIZE, DEVICE = (next(o.flag for o in LAUNCH_OPTIONS if o.dest == dest) for dest in ("world_size", "device"))
MARKERS = (
    f"ranks(n, why): needs n ranks or more in the rank group; with fewer it is skipped, saying why and to run with {WORLD_SIZE} n",
    f"cuda: needs the ranks on CUDA ({DEVICE} cuda on a machine with a GPU); skipped elsewhere",
    "slow: takes a minute or more on 2 CPU cores; left out of the default run (pyproject's addopts), run with -m slow",
)


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    try:
        resolved = launch_options(config.getoption).resolve()
        config.stash[LAUNCH] = resolved
        config.stash[GRID] = grid_options(config.getoption, resolved.backend, resolved.device)  # checked now
    except OptionError as error:
        raise pytest.UsageError(str(error)) from None
    # Keep runs of each backend and device apart, unless the user chose a storage: comparing an
    # NCCL run against a gloo baseline would report every benchmark as a regression.
    if getattr(config.option, "benchmark_storage", None) == DEFAULT_BENCHMARK_STORAGE:
        folder = config.rootpath / ".benchmarks" / f"{resolved.backend}-{resolved.device}"
        config.option.benchmark_storage = f"file://{folder}"


def pytest_report_header(config: pytest.Config) -> str:
    return f"ddp-bench: {launch(config).describe()}"


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    resolved = launch(config)
    machine_info["ddp_bench"] = software_info(resolved.backend, resolved.device, resolved.world_size, resolved.why)


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up: a skipped test starts no ranks
def pytest_runtest_setup(item: pytest.Item) -> None:
    """What a test declares it needs (``MARKERS``), against the session's launch: skipped with a
    line saying what would run it."""
    resolved = launch(item.config)
    needs = item.get_closest_marker("ranks")
    if needs is not None and resolved.world_size < needs.args[0]:
        count = needs.args[0]
        pytest.skip(f"needs {count} ranks: {needs.kwargs.get('why', needs.args[1] if len(needs.args) > 1 else '')} "
                    f"(run with {WORLD_SIZE} {count} or more)")
    if item.get_closest_marker("cuda") is not None and resolved.device != "cuda":
        pytest.skip(f"needs CUDA: run on a machine with a GPU, with {DEVICE} cuda")


@pytest.fixture(scope="session")
def rank_group(pytestconfig: pytest.Config):
    """A group of ranks shared by every test in the session; see ddp.launcher.RankGroup."""
    resolved = launch(pytestconfig)
    group = RankGroup(resolved.world_size, resolved.backend, resolved.device, timeout_seconds=resolved.timeout_seconds,
                      label="the session's ranks")
    yield group
    group.close()
