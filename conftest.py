"""Fixtures and command-line options shared by correctness_tests/ and perf_tests/.

The rank group is started once per session (a spawn per test is too slow) and replaced
automatically after a test in which a rank failed or hung.

The perf options (the benchmark grid) are declared here, where pytest reads options; the grid's
defaults and the benchmark fixtures live in perf_tests/conftest.py. Saved benchmark runs go to
``.benchmarks/<backend>-<device>/`` (pytest-benchmark's machine id cannot tell gloo on CPU from
NCCL on GPUs), and the machine info saved with each run names torch, CUDA, NCCL and the GPU.
"""

from __future__ import annotations

import pytest

from ddp.benchmark import software_info
from ddp.launcher import RankGroup, default_device, resolve_backend, unavailable_reason


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

    perf = parser.getgroup("ddp-bench-perf", "ddp-bench: the benchmark grid of perf_tests/ (comma-separated lists)")
    perf.addoption(
        "--model-size",
        default=None,
        help="a size from ddp.model.MODEL_SIZES (default: xl with nccl, mini on CPU)",
    )
    perf.addoption(
        "--strategies",
        default=None,
        help="strategies to benchmark, e.g. naive,bucketed (default: all of ddp.STRATEGIES)",
    )
    perf.addoption("--batch-sizes", default=None, help="sequences per rank (default: 2,4 with nccl; 4,8 on CPU)")
    perf.addoption("--seq-lens", default=None, help="tokens per sequence (default: 128,256,512 with nccl; 64,128 on CPU)")
    perf.addoption(
        "--bucket-sizes",
        default=None,
        help="bucket caps in MB for bucketed and torch (default: 1,10,100,1000 with nccl; 1,10,100 on CPU)",
    )
    perf.addoption("--rounds", type=int, default=None, help="timed rounds per benchmark (default: 10 with nccl, 5 on CPU)")
    perf.addoption("--warmup-rounds", type=int, default=None, help="untimed rounds before them (default: 2 with nccl, 1 on CPU)")
    perf.addoption(
        "--allreduce-sizes-mb",
        default=None,
        help="float32 all-reduce sizes in MB (default: 1,10,100,1024 with nccl; 1,10,100 on CPU)",
    )
    perf.addoption(
        "--allreduce-world-sizes",
        default=None,
        help="ranks for the all-reduce benchmark (default: 2,4,6 where there are GPUs for them, else 2,4,6 "
        "gloo ranks sharing the CPU cores)",
    )


def backend_and_device(config: pytest.Config) -> tuple[str, str]:
    """The session's backend and device, as the rank_group fixture resolves them."""
    world_size = config.getoption("--world-size")
    backend = resolve_backend(config.getoption("--backend"), world_size)
    return backend, config.getoption("--device") or default_device(backend)


DEFAULT_BENCHMARK_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default


def pytest_configure(config: pytest.Config) -> None:
    # Keep runs of each backend and device apart, unless the user chose a storage: comparing an
    # NCCL run against a gloo baseline would report every benchmark as a regression.
    if getattr(config.option, "benchmark_storage", None) == DEFAULT_BENCHMARK_STORAGE:
        backend, device = backend_and_device(config)
        config.option.benchmark_storage = f"file://{config.rootpath / '.benchmarks' / f'{backend}-{device}'}"


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    backend, device = backend_and_device(config)
    info = software_info(backend, device, config.getoption("--world-size"))
    machine_info["ddp_bench"] = info


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
