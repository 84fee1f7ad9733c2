"""What sharding buys and costs: memory per rank by formula for every model size and world size,
and the measured memory of a run's strategies beside their formulas.

The formula is the strategy's ``Sharding`` (``ddp.strategies.base``): bytes a parameter per rank
for fp32 weights, gradients and AdamW state, before activations, communication buffers and the
gathered FSDP unit. Whether a model fits is read against a device's memory (an H100's 80 GB by
default), so "fits" here is necessary, not sufficient: activations come on top (on one H100 an xl
step at batch 2 x seq 128 peaked 6 GiB above its 32 GB of state in the first H100 run).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp.bench.config.workloads import meta_module
from ddp.bench.results.records import StepRecord
from ddp.model import MODEL_SIZES, num_parameters
from ddp.strategies.declarations import Sharding, sharding_of
from ddp.strategies.registry import STRATEGIES

H100_BYTES = 80 * 10**9  # an H100 SXM's 80 GB (the GPU the suite's GPU evidence comes from)
# Each level of sharding the registered strategies declare, by its name.
LEVELS: dict[str, Sharding] = {
    sharding.level: sharding
    for sharding in sorted({sharding_of(cls) for cls in STRATEGIES.values()} - {None},
                           key=lambda s: (s.parameters, s.gradients, s.optimizer_state))
}
FIT_WORLD_SIZES = (1, 2, 8, 64, 512)


def model_parameters(size: str) -> int:
    """Trainable parameters of a named LM size, counted on the meta device (nothing allocated)."""
    return num_parameters(meta_module(size, 1, 1))


@dataclass(frozen=True)
class FitRow:
    model: str
    num_parameters: int
    level: str
    formula: str
    bytes_per_rank: dict[int, float]
    """World size -> bytes of state per rank by the formula."""

    def smallest_world_that_fits(self, device_bytes: float) -> int | None:
        return next((n for n, size in sorted(self.bytes_per_rank.items()) if size <= device_bytes), None)


def fit_rows(models: tuple[str, ...] = tuple(MODEL_SIZES), world_sizes: tuple[int, ...] = FIT_WORLD_SIZES) -> list[FitRow]:
    """For each model size and level of sharding, the state a rank holds at each world size."""
    rows = []
    for model in models:
        parameters = model_parameters(model)
        for level, sharding in LEVELS.items():
            per_rank = {n: sharding.bytes_per_parameter(n)["total"] * parameters for n in world_sizes}
            rows.append(FitRow(model, parameters, level, sharding.formula, per_rank))
    return rows


def measured_memory_rows(steps: list[StepRecord]) -> list[list[str]]:
    """One row per step record that counted memory: the largest rank's figures (MiB) and the formula's."""
    mib = 2**20
    rows = []
    for step in steps:
        memory = step.memory
        if memory is None:
            continue
        largest = max(range(step.world_size), key=memory.rank_total)
        measured = [memory.parameters_bytes[largest], memory.gradients_bytes[largest], memory.optimizer_state_bytes[largest]]
        formula = memory.formula_bytes(step.num_parameters, step.world_size) or {}
        peak = (step.peak_memory_bytes or [None] * step.world_size)[largest]
        rows.append([
            step.label, step.world_size,
            *(f"{value / mib:.2f}" for value in measured), f"{sum(measured) / mib:.2f}",
            memory.formula or "not stated",
            f"{formula['total'] / mib:.2f}" if formula else "",
            "" if peak is None else f"{peak / mib:.1f}",
        ])  # fmt: skip
    return rows


PEAK_CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "communication")
# MemTracker's categories as the report shows them (ddp.bench.memory.state.TRACKER_CATEGORIES, in the order above)
TRACKER_COLUMNS = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


def peak_memory_rows(steps: list[StepRecord]) -> list[list[str]]:
    """One row per step record with a predicted peak: the prediction by category and moment, its
    total, the measured peak (CUDA's allocator, else MemTracker's total on CPU) and their ratio,
    and on CPU MemTracker's categories at its peak (MiB)."""
    mib = 2**20
    rows = []
    for step in steps:
        predicted = step.predicted_memory
        if predicted is None:
            continue
        categories = predicted.categories()
        measured = step.measured_peak_bytes
        tracked = step.memory.tracked_peak_bytes if step.memory is not None else None
        tracker = ""
        if tracked:
            largest = max(tracked, key=lambda peak: peak["Total"])
            tracker = ", ".join(f"{name} {largest[name] / mib:.1f}" for name in TRACKER_COLUMNS if largest.get(name))
        rows.append([
            step.label, step.group.group_label(False), predicted.moment,
            *(f"{categories[name] / mib:.1f}" for name in PEAK_CATEGORIES),
            f"{predicted.total_bytes / mib:.1f}", "" if measured is None else f"{measured / mib:.1f}",
            "" if not measured else f"{predicted.total_bytes / measured:.3f}", tracker,
        ])  # fmt: skip
    return rows


PEAK_HEADERS = [
    "strategy", "config", "peak at", "params", "buffers", "grads", "optimizer", "activations", "temporaries", "comm",
    "predicted (MiB)", "measured (MiB)", "predicted / measured", "MemTracker at its peak (MiB)",
]  # fmt: skip


MEASURED_HEADERS = [
    "strategy", "ranks", "parameters (MiB)", "gradients (MiB)", "optimizer state (MiB)", "total (MiB)",
    "formula (B/param)", "formula total (MiB)", "CUDA peak (MiB)",
]  # fmt: skip
