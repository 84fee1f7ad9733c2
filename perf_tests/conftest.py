"""The benchmark grid of perf_tests/ (defaults per backend), its parametrization, and fixtures.

Defaults with NCCL follow the seeds (model xl, batch 2 and 4, sequence 128 to 512, buckets 1 to
1000 MB, all-reduce of 1 MB to 1 GiB on 2, 4 and 6 ranks). Without GPUs they shrink to a grid
that runs in under 10 minutes on a 2-core machine; the command-line options of the root
conftest.py override either.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest

import ddp
from ddp.benchmark import grid_configs
from ddp.launcher import RankGroup, unavailable_reason
from conftest import backend_and_device


@dataclass(frozen=True)
class Grid:
    """What perf_tests/ benchmarks in this session."""

    model_size: str
    """A name from ddp.model.MODEL_SIZES."""
    strategies: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    """Sequences per rank."""
    seq_lens: tuple[int, ...]
    """Tokens per sequence."""
    bucket_sizes_mb: tuple[float, ...]
    """Bucket caps in MB, for ddp.BUCKETED_STRATEGIES only."""
    rounds: int
    """Timed rounds per benchmark."""
    warmup_rounds: int
    """Untimed rounds before the timed ones (a fresh build also gets one warm-up step of its own)."""
    allreduce_sizes_mb: tuple[float, ...]
    """float32 all-reduce sizes in MB."""
    allreduce_world_sizes: tuple[int, ...]


GPU_DEFAULTS = Grid(
    model_size="xl",
    strategies=tuple(ddp.STRATEGIES),
    batch_sizes=(2, 4),
    seq_lens=(128, 256, 512),
    bucket_sizes_mb=(1, 10, 100, 1000),
    rounds=10,
    warmup_rounds=2,
    allreduce_sizes_mb=(1, 10, 100, 1024),
    allreduce_world_sizes=(2, 4, 6),
)

# Sized for a 2-core CPU machine, where the whole default run takes under 10 minutes: "mini"
# (9.3M parameters, 37 MB of gradients, its largest tensors 10 MB) takes a few hundred ms a step,
# and buckets of 1, 10 and 100 MB give many, a few and one bucket.
CPU_DEFAULTS = Grid(
    model_size="mini",
    strategies=tuple(ddp.STRATEGIES),
    batch_sizes=(4, 8),
    seq_lens=(64, 128),
    bucket_sizes_mb=(1, 10, 100),
    rounds=5,
    warmup_rounds=1,
    allreduce_sizes_mb=(1, 10, 100),
    allreduce_world_sizes=(2, 4, 6),
)


def _csv(text: str, kind, option: str) -> tuple:
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise pytest.UsageError(f"{option} takes a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not values:
        raise pytest.UsageError(f"{option} needs at least one value, got {text!r}")
    return values


def benchmark_grid(config: pytest.Config) -> Grid:
    """The defaults for this session's backend, with the command-line options applied."""
    backend, _ = backend_and_device(config)
    defaults = GPU_DEFAULTS if backend == "nccl" else CPU_DEFAULTS

    def option(name: str, kind, default):
        value = config.getoption(name)
        return default if value is None else _csv(value, kind, name)

    strategies = option("--strategies", str, defaults.strategies)
    unknown = [name for name in strategies if name not in ddp.STRATEGIES and ":" not in name]
    if unknown:
        raise pytest.UsageError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(ddp.STRATEGIES)}")
    rounds = config.getoption("--rounds")
    warmup_rounds = config.getoption("--warmup-rounds")
    return Grid(
        model_size=config.getoption("--model-size") or defaults.model_size,
        strategies=strategies,
        batch_sizes=option("--batch-sizes", int, defaults.batch_sizes),
        seq_lens=option("--seq-lens", int, defaults.seq_lens),
        bucket_sizes_mb=option("--bucket-sizes", float, defaults.bucket_sizes_mb),
        rounds=defaults.rounds if rounds is None else rounds,
        warmup_rounds=defaults.warmup_rounds if warmup_rounds is None else warmup_rounds,
        allreduce_sizes_mb=option("--allreduce-sizes-mb", float, defaults.allreduce_sizes_mb),
        allreduce_world_sizes=option("--allreduce-world-sizes", int, defaults.allreduce_world_sizes),
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    grid = benchmark_grid(metafunc.config)
    if "step_config" in metafunc.fixturenames:
        configs = grid_configs(grid.model_size, grid.strategies, grid.batch_sizes, grid.seq_lens, grid.bucket_sizes_mb)
        metafunc.parametrize("step_config", configs, ids=[c.test_id for c in configs])
    if "allreduce_world_size" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_world_size", grid.allreduce_world_sizes, ids=lambda n: f"n{n}")
    if "allreduce_size_mb" in metafunc.fixturenames:
        metafunc.parametrize("allreduce_size_mb", grid.allreduce_sizes_mb, ids=lambda mb: f"{mb:g}mb")


@pytest.fixture(scope="session")
def grid(pytestconfig: pytest.Config) -> Grid:
    return benchmark_grid(pytestconfig)


@pytest.fixture(scope="session")
def extra_rank_groups(pytestconfig: pytest.Config):
    """Rank groups of other sizes than the session's, each started once, all closed at the end.

    Call it with a world size; it skips, saying what to do, where the hardware cannot run it.
    """
    backend, device = backend_and_device(pytestconfig)
    groups: dict[int, RankGroup] = {}

    def group_of(world_size: int) -> RankGroup:
        reason = unavailable_reason(backend, world_size, device)
        if reason:
            pytest.skip(reason)
        if world_size not in groups:
            groups[world_size] = RankGroup(
                world_size, backend, device, timeout_seconds=pytestconfig.getoption("--rank-timeout")
            )
        return groups[world_size]

    yield group_of
    for group in groups.values():
        group.close()


@pytest.fixture
def allreduce_group(request: pytest.FixtureRequest, allreduce_world_size: int, extra_rank_groups) -> RankGroup:
    """The session's rank group when the sizes match (no second spawn), else one of the extras."""
    if allreduce_world_size == request.config.getoption("--world-size"):
        return request.getfixturevalue("rank_group")
    return extra_rank_groups(allreduce_world_size)


@dataclass(frozen=True)
class HarnessOverhead:
    """What timing a step through ``RankGroup.run`` adds to the slowest rank's own step time."""

    step_id: str
    overhead_seconds: list[float]
    """Per timed round: the benchmark's round time minus the slowest rank's step time."""
    step_seconds: float
    """Median of the slowest rank's step time."""


HARNESS_OVERHEADS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def harness_overheads(pytestconfig: pytest.Config) -> list[HarnessOverhead]:
    return pytestconfig.stash.setdefault(HARNESS_OVERHEADS, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    overheads: list[HarnessOverhead] = config.stash.get(HARNESS_OVERHEADS, [])
    if not overheads:
        return
    every_round = [s for o in overheads for s in o.overhead_seconds]
    smallest = min(overheads, key=lambda o: o.step_seconds)
    median = statistics.median(every_round)
    terminalreporter.section("ddp-bench harness overhead")
    terminalreporter.write_line(
        f"benchmark round time minus slowest rank's step time, over {len(every_round)} rounds: "
        f"median {median * 1e3:.3f} ms, max {max(every_round) * 1e3:.3f} ms; the median is "
        f"{median / smallest.step_seconds:.2%} of the smallest step "
        f"({smallest.step_id}, {smallest.step_seconds * 1e3:.1f} ms)"
    )
