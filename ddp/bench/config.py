"""What is benchmarked: one configuration of the grid (``StepConfig``) and the grid's expansion
into configurations, in the order the suite runs them. Pure data: nothing here builds a model."""

from __future__ import annotations

from dataclasses import dataclass

from ddp.strategies.registry import takes_bucket_size


@dataclass(frozen=True)
class StepConfig:
    """One benchmarked configuration; equal configs share the state kept on the ranks."""

    strategy: str
    """A registered name or ``package.module:ClassName``."""
    model: str
    """A workload name (``ddp.bench.workloads``): an LM size, a named model or ``package.module:build``."""
    batch_size: int
    """Samples (sequences) per rank per step."""
    seq_len: int
    """Tokens per sequence."""
    bucket_size_mb: float | None = None
    """Bucket cap in MiB for strategies that take ``bucket_size_mb``; None for every other one."""
    seed: int = 0
    """Seeds the model's weights and the global batch."""

    def __post_init__(self) -> None:
        bucketed = takes_bucket_size(self.strategy)
        if bucketed and self.bucket_size_mb is None:
            raise ValueError(f"strategy {self.strategy!r} needs bucket_size_mb (MiB), e.g. 25.0")
        if not bucketed and self.bucket_size_mb is not None:
            raise ValueError(
                f"strategy {self.strategy!r} takes no bucket size; pass bucket_size_mb=None "
                "(only strategies whose constructor has a bucket_size_mb option bucket)"
            )
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {self.batch_size} and {self.seq_len}")

    @property
    def test_id(self) -> str:
        """Stable id, e.g. ``bucketed-b2-s128-bucket25mb``: comparisons match on it."""
        bucket = f"-bucket{self.bucket_size_mb:g}mb" if self.bucket_size_mb is not None else ""
        return f"{self.strategy}-b{self.batch_size}-s{self.seq_len}{bucket}"

    @property
    def group_name(self) -> str:
        """The benchmark group: strategies of one model, batch and sequence length side by side."""
        return f"step: model {self.model}, batch {self.batch_size}, seq len {self.seq_len}"

    def describe(self) -> str:
        """Human-readable, e.g. ``bucketed (bucket 25 MB), model xl, batch 4 per rank, seq len 512``."""
        bucket = f" (bucket {self.bucket_size_mb:g} MB)" if self.bucket_size_mb is not None else ""
        return f"{self.strategy}{bucket}, model {self.model}, batch {self.batch_size} per rank, seq len {self.seq_len}"

    def local_twin(self) -> StepConfig:
        """The same model and data with no communication: the floor this configuration is paired with."""
        return StepConfig("local", self.model, self.batch_size, self.seq_len, None, self.seed)


def grid_configs(grid) -> list[StepConfig]:
    """Every configuration of a ``GridOptions``, in the order the suite runs them (bucket sizes
    apply to the strategies that take them)."""
    return [
        StepConfig(strategy, grid.model, batch_size, seq_len, bucket_size_mb)
        for batch_size in grid.batch_sizes
        for seq_len in grid.seq_lens
        for strategy in grid.strategies
        for bucket_size_mb in grid.buckets_for(strategy)
    ]
