"""The benchmarked training step, run on every rank: what ``perf_tests/`` and ``ddp run`` time.

One timed step is what a user's training loop does: forward, backward,
``finish_gradient_synchronization()``, ``AdamW.step()`` (then ``torch.cuda.synchronize()`` on
CUDA, so that the step has really finished when its clock stops). The model, strategy, optimizer
and batch stay alive on the rank between calls, keyed by ``StepConfig``, so a benchmark can time
one step per round without rebuilding anything; asking for another configuration frees the old
one first (an xl model and its AdamW state take tens of GB).

The parent drives it through any launcher that runs a function on every rank:

    setups = group.run(prepare_step, config, warmup_steps=1)   # build, warm up; StepSetup per rank
    timings = group.run(timed_step, config)                     # StepTiming per rank, one step
    group.run(release_step)                                     # free the memory

Out of memory is not an error here: a rank that runs out frees what it held and returns an
``OutOfMemory`` marker instead of raising, so the group of ranks survives and the caller decides
(the perf tests skip with ``oom_reason``). Ranks of one configuration hold the same shapes, so
they run out together; a rank that ran out alone would leave the others waiting in a collective
until the launcher's timeout replaces the group.

``comm_wait_seconds`` is the time from the moment backward produces its last parameter gradient
until the gradients are synchronized (``finish_gradient_synchronization()`` returned and, on
CUDA, the collectives completed on the compute stream). It is taken from a post-accumulate-grad
hook rather than from the return of ``loss.backward()`` because PyTorch's DDP waits for its
buckets inside backward (its reducer's final callback): measured from the return of backward,
``torch`` would show no waiting at all. With the hook every strategy is measured the same way;
for ``local`` it is the autograd engine's tail, the floor of the measurement.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed
from torch import nn

import ddp
from ddp.base import trainable_parameters
from ddp.launcher import rank_info
from ddp.model import build_model, language_model_loss, num_parameters, random_batch

FRESH_BUILD_WARMUP_STEPS = 3  # see prepare_step
LEARNING_RATE = 1e-4  # the value does not change the time of a step; any small one trains sanely


@dataclass(frozen=True)
class StepConfig:
    """One benchmarked configuration; equal configs share the state kept on the ranks."""

    strategy: str
    """A name from ``ddp.STRATEGIES`` (or ``package.module:ClassName``)."""
    model_size: str
    """A name from ``ddp.model.MODEL_SIZES``."""
    batch_size: int
    """Sequences per rank per step."""
    seq_len: int
    """Tokens per sequence."""
    bucket_size_mb: float | None = None
    """Bucket cap in MiB for ``ddp.BUCKETED_STRATEGIES``; None for every other strategy."""
    seed: int = 0
    """Seeds the model's weights and the batch (the same on every rank)."""

    def __post_init__(self) -> None:
        bucketed = self.strategy in ddp.BUCKETED_STRATEGIES
        if bucketed and self.bucket_size_mb is None:
            raise ValueError(f"strategy {self.strategy!r} needs bucket_size_mb (MiB), e.g. 25.0")
        if not bucketed and self.bucket_size_mb is not None:
            raise ValueError(
                f"strategy {self.strategy!r} takes no bucket size; pass bucket_size_mb=None "
                f"(only {', '.join(ddp.BUCKETED_STRATEGIES)} bucket)"
            )
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {self.batch_size} and {self.seq_len}")

    @property
    def test_id(self) -> str:
        """Stable id, e.g. ``bucketed-b2-s128-bucket25mb``: ``--benchmark-compare`` matches on it."""
        bucket = f"-bucket{self.bucket_size_mb:g}mb" if self.bucket_size_mb is not None else ""
        return f"{self.strategy}-b{self.batch_size}-s{self.seq_len}{bucket}"

    @property
    def group_name(self) -> str:
        """The benchmark group: strategies of one model, batch and sequence length side by side."""
        return f"step: model {self.model_size}, batch {self.batch_size}, seq len {self.seq_len}"

    def describe(self) -> str:
        """Human-readable, e.g. ``bucketed (bucket 25 MB), model xl, batch 4 per rank, seq len 512``."""
        bucket = f" (bucket {self.bucket_size_mb:g} MB)" if self.bucket_size_mb is not None else ""
        return f"{self.strategy}{bucket}, model {self.model_size}, batch {self.batch_size} per rank, seq len {self.seq_len}"


def grid_configs(
    model_size: str,
    strategies: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    seq_lens: tuple[int, ...],
    bucket_sizes_mb: tuple[float, ...],
) -> list[StepConfig]:
    """Every configuration of a grid, in the order the suite runs them (bucket sizes apply to
    ``ddp.BUCKETED_STRATEGIES`` only)."""
    return [
        StepConfig(strategy, model_size, batch_size, seq_len, bucket_size_mb)
        for batch_size in batch_sizes
        for seq_len in seq_lens
        for strategy in strategies
        for bucket_size_mb in (bucket_sizes_mb if strategy in ddp.BUCKETED_STRATEGIES else (None,))
    ]


@dataclass(frozen=True)
class StepSetup:
    """What one rank reports about a configuration once it is built and warmed up."""

    rank: int
    num_parameters: int
    num_parameter_tensors: int
    """Trainable parameter tensors (a tied weight counts once)."""
    bucket_sizes_bytes: list[int] | None
    """Gradient bytes in each bucket, in launch order (read after warm-up, when PyTorch's DDP has
    rebuilt its plan); None for strategies that do not bucket."""
    allreduce_calls_per_step: int
    bytes_per_step: int
    """Gradient bytes this rank all-reduces per step (0 for ``local``)."""


@dataclass(frozen=True)
class StepTiming:
    """One rank's figures for one timed step."""

    rank: int
    step_seconds: float
    comm_wait_seconds: float
    """From the last gradient produced by backward to gradients synchronized (module docstring)."""
    peak_memory_bytes: int | None
    """Peak CUDA memory allocated during the step; None on CPU."""


@dataclass(frozen=True)
class OutOfMemory:
    """Returned instead of a result by a rank that ran out of memory; it has freed its state."""

    rank: int
    message: str
    allocated_bytes: int | None
    """CUDA memory still allocated after freeing (None on CPU)."""
    peak_bytes: int | None
    total_bytes: int | None
    """The device's memory (None on CPU)."""


@dataclass(frozen=True)
class StepSummary:
    """The figures of a configuration over several timed rounds, as the benchmarks record them."""

    rank_step_seconds: list[float]
    """Each rank's median step time."""
    step_seconds: float
    """Median over rounds of the slowest rank's step time."""
    comm_wait_seconds: float
    """Median over rounds of the slowest rank's comm wait."""
    comm_fraction: float
    tokens_per_second: float
    """Tokens the whole group trains per second at ``step_seconds``."""
    peak_memory_bytes: int | None


class _Trainer:
    """The state one configuration keeps alive on a rank between timed steps."""

    def __init__(self, config: StepConfig) -> None:
        info = rank_info()
        self.config = config
        self.device = info.device
        torch.manual_seed(config.seed)
        module = build_model(config.model_size, device=info.device)
        if config.seq_len > module.config.context_length:
            raise ValueError(
                f"seq len {config.seq_len} exceeds model {config.model_size}'s context length "
                f"{module.config.context_length}; choose a shorter --seq-lens"
            )
        options = {"bucket_size_mb": config.bucket_size_mb} if config.strategy in ddp.BUCKETED_STRATEGIES else {}
        self.model = ddp.make_ddp(config.strategy, module, **options)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        generator = torch.Generator(device=info.device).manual_seed(config.seed)
        self.inputs, self.targets = random_batch(
            module.config, config.batch_size, config.seq_len, generator=generator, device=info.device
        )
        self.num_parameters = num_parameters(module)
        self.num_parameter_tensors = len(trainable_parameters(module))
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        self.cuda = info.device.type == "cuda"
        self._last_gradient_seconds = 0.0
        self._last_gradient_event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        # Registered after the strategy's own hooks, so on each parameter it fires once that
        # strategy has launched (or queued) the gradient's all-reduce.
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient)
            for p in module.parameters()
            if p.requires_grad
        ]

    def _on_gradient(self, _param: nn.Parameter) -> None:
        if self.cuda:
            self._last_gradient_event.record()
        else:
            self._last_gradient_seconds = time.perf_counter()

    def setup(self) -> StepSetup:
        sizes = getattr(self.model, "bucket_sizes_bytes", None)
        communicates = self.config.strategy != "local"
        return StepSetup(
            rank=rank_info().rank,
            num_parameters=self.num_parameters,
            num_parameter_tensors=self.num_parameter_tensors,
            bucket_sizes_bytes=list(sizes) if sizes is not None else None,
            allreduce_calls_per_step=int(self.model.num_allreduce_calls_per_step),
            bytes_per_step=self.gradient_bytes if communicates else 0,
        )

    def step(self) -> StepTiming:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            synchronized = torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        # Zeroing in place keeps gradients where the strategies put them (bucketed's are views
        # into its buckets); set_to_none would make them copy every gradient in again each step.
        self.optimizer.zero_grad(set_to_none=False)
        loss = language_model_loss(self.model(self.inputs), self.targets)
        loss.backward()
        self.model.finish_gradient_synchronization()
        if self.cuda:
            synchronized.record()
        else:
            synchronized_seconds = time.perf_counter()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        step_seconds = time.perf_counter() - start
        if self.cuda:
            comm_wait_seconds = self._last_gradient_event.elapsed_time(synchronized) / 1000.0
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            comm_wait_seconds = synchronized_seconds - self._last_gradient_seconds
            peak = None
        return StepTiming(rank_info().rank, step_seconds, max(0.0, comm_wait_seconds), peak)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


_trainer: _Trainer | None = None


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def _out_of_memory(error: BaseException) -> OutOfMemory:
    """Free this rank's state and describe what memory looked like."""
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    release_step()
    on_cuda = rank_info().device.type == "cuda"
    return OutOfMemory(
        rank=rank_info().rank,
        message=str(error).splitlines()[0] if str(error) else type(error).__name__,
        allocated_bytes=torch.cuda.memory_allocated() if on_cuda else None,
        peak_bytes=peak if on_cuda else None,
        total_bytes=torch.cuda.get_device_properties(rank_info().device).total_memory if on_cuda else None,
    )


def release_step() -> None:
    """Drop the configuration kept on this rank and return its memory to the device."""
    global _trainer
    if _trainer is not None:
        _trainer.close()
    _trainer = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prepare_step(config: StepConfig, warmup_steps: int = 1) -> StepSetup | OutOfMemory:
    """Run on every rank: build ``config`` (freeing any other), run ``warmup_steps`` untimed steps.

    A fresh build runs at least ``FRESH_BUILD_WARMUP_STEPS``: ``bucketed`` re-plans its buckets
    after its first step, and PyTorch's DDP reduces everything in one bucket in its first step,
    rebuilds its buckets in the second and records the new plan (which ``StepSetup`` reports) in
    the third.
    """
    global _trainer
    try:
        if _trainer is None or _trainer.config != config:
            release_step()
            _trainer = _Trainer(config)
            warmup_steps = max(FRESH_BUILD_WARMUP_STEPS, warmup_steps)
        for _ in range(warmup_steps):
            _trainer.step()
        return _trainer.setup()
    except Exception as error:
        if _is_out_of_memory(error):
            return _out_of_memory(error)
        raise


def timed_step(config: StepConfig) -> StepTiming | OutOfMemory:
    """Run on every rank: one timed training step of ``config`` (built by ``prepare_step``)."""
    if _trainer is None or _trainer.config != config:
        raise RuntimeError(f"timed_step({config.describe()}) before prepare_step built it on this rank")
    try:
        return _trainer.step()
    except Exception as error:
        if _is_out_of_memory(error):
            return _out_of_memory(error)
        raise


def first_out_of_memory(results: list) -> OutOfMemory | None:
    """The first rank's ``OutOfMemory`` marker among per-rank results, if any rank ran out."""
    return next((r for r in results if isinstance(r, OutOfMemory)), None)


def oom_reason(config: StepConfig, world_size: int, marker: OutOfMemory) -> str:
    """A skip reason naming the configuration and the memory figures."""
    gib = 2**30
    if marker.total_bytes is not None:
        memory = (
            f"peak {marker.peak_bytes / gib:.1f} GiB allocated of {marker.total_bytes / gib:.1f} GiB "
            f"on rank {marker.rank}'s GPU"
        )
    else:
        memory = f"host memory exhausted on rank {marker.rank}"
    return (
        f"out of memory: {config.describe()}, {world_size} ranks: {memory} ({marker.message}); "
        "use a smaller --batch-sizes, --seq-lens or --model-size"
    )


def summarize(config: StepConfig, world_size: int, rounds: list[list[StepTiming]]) -> StepSummary:
    """Medians over ``rounds`` (each the per-rank timings of one round), slowest rank per round."""
    if not rounds:
        raise ValueError("summarize needs at least one round of timings")
    step = statistics.median(max(t.step_seconds for t in timings) for timings in rounds)
    wait = statistics.median(max(t.comm_wait_seconds for t in timings) for timings in rounds)
    rank_step = [statistics.median(timings[rank].step_seconds for timings in rounds) for rank in range(world_size)]
    peaks = [t.peak_memory_bytes for timings in rounds for t in timings if t.peak_memory_bytes is not None]
    return StepSummary(
        rank_step_seconds=rank_step,
        step_seconds=step,
        comm_wait_seconds=wait,
        comm_fraction=wait / step if step > 0 else 0.0,
        tokens_per_second=world_size * config.batch_size * config.seq_len / step if step > 0 else 0.0,
        peak_memory_bytes=max(peaks) if peaks else None,
    )


def extra_info(
    config: StepConfig, backend: str, device: str, world_size: int, setup: StepSetup, summary: StepSummary
) -> dict:
    """The figures every step benchmark records (reports and regression checks read these keys)."""
    return {
        "strategy": config.strategy,
        "backend": backend,
        "device": device,
        "world_size": world_size,
        "model_size": config.model_size,
        "num_parameters": setup.num_parameters,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "bucket_size_mb": config.bucket_size_mb,
        "num_parameter_tensors": setup.num_parameter_tensors,
        "num_buckets": len(setup.bucket_sizes_bytes) if setup.bucket_sizes_bytes is not None else None,
        "bucket_sizes_bytes": setup.bucket_sizes_bytes,
        "allreduce_calls_per_step": setup.allreduce_calls_per_step,
        "bytes_per_step": setup.bytes_per_step,
        "step_seconds": summary.step_seconds,
        "comm_wait_seconds": summary.comm_wait_seconds,
        "comm_fraction": summary.comm_fraction,
        "tokens_per_second": summary.tokens_per_second,
        "peak_memory_bytes": summary.peak_memory_bytes,
        "rank_step_seconds": summary.rank_step_seconds,
    }


def software_info(backend: str, device: str, world_size: int) -> dict:
    """What a saved run records beside pytest-benchmark's machine info: torch, backend, device
    and, where there is a GPU, its name and the CUDA and NCCL versions."""
    info = {"torch": torch.__version__, "backend": backend, "device": device, "world_size": world_size}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        if torch.distributed.is_nccl_available():
            info["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return info


def device_name(device: torch.device | str) -> str:
    """``cpu``, or the GPU's name (e.g. ``NVIDIA H100 80GB HBM3``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


__all__ = [
    "OutOfMemory",
    "StepConfig",
    "StepSetup",
    "StepSummary",
    "StepTiming",
    "device_name",
    "extra_info",
    "first_out_of_memory",
    "grid_configs",
    "oom_reason",
    "prepare_step",
    "release_step",
    "software_info",
    "summarize",
    "timed_step",
]
