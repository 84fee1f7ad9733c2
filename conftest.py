"""Fixtures and command-line options shared by correctness_tests/, tests/ and perf_tests/.

Options are not declared here: ``ddp.bench.options`` declares the launch (``--backend``,
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

from ddp.bench.machine import software_info
from ddp.bench.options import OptionError, ResolvedLaunch, add_grid_options, add_launch_options, grid_options, launch_options
from ddp.launcher import RankGroup

LAUNCH = pytest.StashKey[ResolvedLaunch]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_launch_options(parser.getgroup("ddp-bench", "ddp-bench: the group of ranks").addoption)
    add_grid_options(
        parser.getgroup("ddp-bench-grid", "ddp-bench: what is tested and benchmarked (comma-separated lists)").addoption
    )


def launch(config: pytest.Config) -> ResolvedLaunch:
    """The session's backend and device, resolved once."""
    return config.stash[LAUNCH]


DEFAULT_BENCHMARK_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default


def pytest_configure(config: pytest.Config) -> None:
    try:
        resolved = launch_options(config.getoption).resolve()
        config.stash[LAUNCH] = resolved
        grid_options(config.getoption, resolved.backend, resolved.device)  # validate the grid now
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


@pytest.fixture(scope="session")
def rank_group(pytestconfig: pytest.Config):
    """A group of ranks shared by every test in the session; see ddp.launcher.RankGroup."""
    resolved = launch(pytestconfig)
    group = RankGroup(resolved.world_size, resolved.backend, resolved.device, timeout_seconds=resolved.timeout_seconds)
    yield group
    group.close()
