"""Fixtures and command-line options shared by correctness_tests/ and perf_tests/.

The rank group is started once per session (a spawn per test is too slow) and replaced
automatically after a test in which a rank failed or hung.
"""

from __future__ import annotations

import pytest

from ddp.launcher import RankGroup, resolve_backend, unavailable_reason


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddp-bench", "ddp-bench: the group of ranks")
    group.addoption(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="process-group backend; auto = nccl with one GPU per rank, else gloo (default: auto)",
    )
    group.addoption("--world-size", type=int, default=2, help="number of ranks (default: 2)")
    group.addoption(
        "--device",
        default=None,
        choices=("cpu", "cuda"),
        help="where tensors live; default: cuda for nccl, cpu for gloo (gloo also runs over cuda)",
    )
    group.addoption(
        "--rank-timeout",
        type=float,
        default=600.0,
        help="seconds a test may run on the ranks before it fails with every rank's stack (default: 600)",
    )


@pytest.fixture(scope="session")
def rank_group(request: pytest.FixtureRequest):
    """A group of ranks shared by every test in the session; see ddp.launcher.RankGroup."""
    config = request.config
    world_size = config.getoption("--world-size")
    backend = resolve_backend(config.getoption("--backend"), world_size)
    device = config.getoption("--device") or ("cuda" if backend == "nccl" else "cpu")
    reason = unavailable_reason(backend, world_size, device)
    if reason:
        pytest.skip(reason)
    group = RankGroup(world_size, backend, device, timeout_seconds=config.getoption("--rank-timeout"))
    yield group
    group.close()
