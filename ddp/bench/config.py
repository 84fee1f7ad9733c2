"""What is benchmarked: one configuration of the grid (``StepConfig``) and the grid's expansion
into configurations, in the order the suite runs them. Pure data: nothing here builds a model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddp.strategies.registry import takes_bucket_size, takes_comm_dtype

# The step's numerics; what each means is defined where the step is (``ddp.bench.trainer``).
PRECISIONS = ("fp32", "tf32", "bf16")
OPTIMIZERS = ("foreach", "fused")
GRAD_COMMS = ("fp32", "bf16")


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
    precision: str = "fp32"
    """``fp32``, ``tf32`` or ``bf16``: what the step computes in (``ddp.bench.trainer``)."""
    optimizer: str = "foreach"
    """AdamW's implementation: ``foreach`` or ``fused``."""
    grad_comm: str = "fp32"
    """``bf16``: gradients all-reduced in bf16 (strategies that take ``comm_dtype``); ``fp32``: as they are."""

    def __post_init__(self) -> None:
        for value, choices, what in (
            (self.precision, PRECISIONS, "precision"), (self.optimizer, OPTIMIZERS, "optimizer"),
            (self.grad_comm, GRAD_COMMS, "grad_comm"),
        ):
            if value not in choices:
                raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
        if self.grad_comm != "fp32" and not takes_comm_dtype(self.strategy):
            raise ValueError(
                f"strategy {self.strategy!r} cannot communicate gradients in {self.grad_comm}: only strategies "
                "whose constructor has a comm_dtype option can; use grad_comm='fp32'"
            )
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
    def numerics_suffix(self) -> str:
        """``-bf16-fused-bf16comm``: what differs from the defaults (fp32, foreach, fp32
        communication), which names leave out so that runs saved before these options existed,
        all of them at the defaults, keep matching by name."""
        parts = [self.precision if self.precision != "fp32" else "", self.optimizer if self.optimizer != "foreach" else "",
                 f"{self.grad_comm}comm" if self.grad_comm != "fp32" else ""]
        return "".join(f"-{part}" for part in parts if part)

    @property
    def test_id(self) -> str:
        """Stable id, e.g. ``bucketed-b2-s128-bucket25mb`` or ``torch-b4-s512-bucket25mb-bf16-fused``:
        comparisons match on it."""
        bucket = f"-bucket{self.bucket_size_mb:g}mb" if self.bucket_size_mb is not None else ""
        return f"{self.strategy}-b{self.batch_size}-s{self.seq_len}{bucket}{self.numerics_suffix}"

    @property
    def group_name(self) -> str:
        """The benchmark group: strategies of one model, batch, sequence length, precision and
        optimizer side by side."""
        optimizer = f", {self.optimizer} AdamW" if self.optimizer != "foreach" else ""
        return f"step: model {self.model}, batch {self.batch_size}, seq len {self.seq_len}, {self.precision}{optimizer}"

    def describe(self) -> str:
        """Human-readable, e.g. ``bucketed (bucket 25 MB), model xl, batch 4 per rank, seq len 512, bf16``
        (numerics named where they are not the defaults, as in ``test_id``)."""
        bucket = f" (bucket {self.bucket_size_mb:g} MB)" if self.bucket_size_mb is not None else ""
        precision = f", {self.precision}" if self.precision != "fp32" else ""
        optimizer = f", {self.optimizer} AdamW" if self.optimizer != "foreach" else ""
        comm = f", {self.grad_comm} gradient all-reduce" if self.grad_comm != "fp32" else ""
        return (f"{self.strategy}{bucket}, model {self.model}, batch {self.batch_size} per rank, seq len {self.seq_len}"
                f"{precision}{optimizer}{comm}")

    def local_twin(self) -> StepConfig:
        """The same model, data, precision and optimizer with no communication: the floor this
        configuration is paired with."""
        return replace(self, strategy="local", bucket_size_mb=None, grad_comm="fp32")


def grid_configs(grid) -> list[StepConfig]:
    """Every configuration of a ``GridOptions``, in the order the suite runs them (bucket sizes
    apply to the strategies that take them)."""
    return [
        StepConfig(strategy, grid.model, batch_size, seq_len, bucket_size_mb, precision=precision,
                   optimizer=optimizer, grad_comm=grad_comm)
        for precision in grid.precisions
        for optimizer in grid.optimizers
        for batch_size in grid.batch_sizes
        for seq_len in grid.seq_lens
        for strategy in grid.strategies
        for bucket_size_mb in grid.buckets_for(strategy)
        for grad_comm in grid.grad_comms_for(strategy)
    ]
