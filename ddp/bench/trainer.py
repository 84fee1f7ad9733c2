"""The one training step that every tool times, and the state a rank keeps between calls.

**The step**, defined here once and driven by perf_tests/, ``ddp run``, ``ddp versus`` and
``ddp profile`` alike: forward, loss, ``loss.backward()``, ``finish_gradient_synchronization()``,
``AdamW.step()`` and ``zero_grad(set_to_none=True)`` (PyTorch's default: what a user's loop does,
and the path on which ``bucketed`` folds averaging into its one copy per gradient). On CUDA the step
ends with ``torch.cuda.synchronize()``, so that its clock stops when the GPU is done. Every rank
trains its own shard of a seeded global batch (``ddp.bench.workloads.rank_batch``), the same batch
every step: the data does not change a step's time, and a fixed batch keeps host-to-device copies
out of it. The optimizer is ``AdamW(lr=LEARNING_RATE)``, its implementation ``StepConfig.optimizer``:
``foreach`` (``AdamW(foreach=True)``, torch's default on CUDA; asked for explicitly, since torch's
default on CPU is a per-tensor loop) or ``fused`` (``AdamW(fused=True)``, one kernel per parameter
group; CPU has it too since torch 2.4).

**Precision** (``StepConfig.precision``), what the step's numbers are, defined here and nowhere else:

- ``fp32``: fp32 weights, gradients and optimizer; fp32 matmuls and convolutions
  (``torch.set_float32_matmul_precision("highest")``, ``torch.backends.cudnn.allow_tf32 = False``).
- ``tf32``: the same, with TF32 tensor-core matmuls and convolutions (``"high"``, cudnn
  ``allow_tf32 = True``). On CPU, "high" computes as "highest" (checked bitwise with torch 2.13),
  so tf32 there is fp32.
- ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around forward and loss (not
  backward: autograd runs each op's backward in its forward's dtype), the recipe of PyTorch's AMP:
  fp32 master weights, fp32 gradients (autocast's casts return them in fp32), fp32 optimizer;
  whatever autocast leaves in fp32 runs as ``fp32`` says. It runs on CPU too (slowly).

The setting is made at the start of every step and the previous one restored at its end
(``numerics``), so configurations timed side by side do not leak into each other.

**Gradient communication** (``StepConfig.grad_comm``): ``bf16`` asks a strategy whose constructor
takes ``comm_dtype`` to all-reduce gradients in bf16 and accumulate the result back into the fp32
gradients (PyTorch's ``bf16_compress_hook``); ``fp32`` communicates gradients as they are.

Tools differ only in what they attach: a ``StepObserver`` wraps each phase (the profiler's ranges,
NVTX), and ``RankBench`` runs several configurations' steps in one round in rotating order (a
strategy and its ``local`` twin, or ``ddp versus``'s contenders), in the shape of nccl-tests: one
timing loop, callbacks per use.

**The figures** of one step, on each rank: ``step_seconds``; ``comm_wait_seconds``, from the moment
backward computed its last parameter gradient (a tensor hook, which runs before any strategy's or
PyTorch's reducer's hook) until gradients were synchronized (``finish_gradient_synchronization()``
returned and, on CUDA, the collectives completed on the compute stream): the communication the
step could not hide. PyTorch's DDP waits for its buckets inside ``loss.backward()``, so timing from
the return of backward would show ``torch`` waiting for nothing; with the hook every strategy is
measured the same way, and for ``local`` the figure is the autograd engine's tail, the floor.

**The state**: one ``RankBench`` per rank process (``rank_bench()``), owned by that process (the
launcher's worker, or the process torchrun started), holding the trainers of the configurations
being timed and the all-reduce buffer; ``release`` frees them. Building another set of
configurations frees the old one first (an xl model and its AdamW state take 32 GB).

**Out of memory** is not an error here: a rank that runs out frees what it held and returns an
``OutOfMemory`` marker, so the caller decides (perf_tests skip with ``oom_reason``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from ddp.bench.workloads import Workload, build_workload, rank_batch
from ddp.launcher import RankInfo, Withdrawn, rank_info
from ddp.strategies.base import trainable_parameters
from ddp.strategies.registry import make_ddp, takes_bucket_size, takes_comm_dtype

LEARNING_RATE = 1e-4  # the value does not change the time of a step; any small one trains sanely
FRESH_BUILD_WARMUP_STEPS = 3  # see RankBench.prepare
# Strategies whose plan is final after their first step: one warm-up step of a fresh build will do.
SETTLED_AFTER_ONE_STEP = ("local", "naive", "flat", "overlap")
PHASES = ("forward", "backward", "gradient_sync", "optimizer")
PRECISIONS = ("fp32", "tf32", "bf16")  # see the module docstring
OPTIMIZERS = ("foreach", "fused")
GRAD_COMMS = ("fp32", "bf16")
# What each precision sets: torch's float32 matmul precision, cudnn's TF32 switch, the autocast dtype.
_NUMERICS = {
    "fp32": ("highest", False, None),
    "tf32": ("high", True, None),
    "bf16": ("highest", False, torch.bfloat16),
}


@contextlib.contextmanager
def numerics(precision: str) -> Iterator[None]:
    """The matmul and convolution precision of ``precision`` for the length of the block, the
    previous settings restored afterwards."""
    matmul, cudnn_tf32, _ = _NUMERICS[precision]
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


def forward_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What wraps forward and loss: ``torch.autocast`` for ``bf16``, nothing otherwise."""
    dtype = _NUMERICS[precision][2]
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


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
    """``fp32``, ``tf32`` or ``bf16``: what the step computes in (module docstring)."""
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
        """Human-readable, e.g. ``bucketed (bucket 25 MB), model xl, batch 4 per rank, seq len 512, fp32``."""
        bucket = f" (bucket {self.bucket_size_mb:g} MB)" if self.bucket_size_mb is not None else ""
        comm = f", {self.grad_comm} gradient all-reduce" if self.grad_comm != "fp32" else ""
        optimizer = f", {self.optimizer} AdamW" if self.optimizer != "foreach" else ""
        return (f"{self.strategy}{bucket}, model {self.model}, batch {self.batch_size} per rank, seq len {self.seq_len}, "
                f"{self.precision}{optimizer}{comm}")

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


@dataclass(frozen=True)
class StepSetup:
    """What one rank reports about a configuration once it is built and warmed up."""

    rank: int
    num_parameters: int
    num_parameter_tensors: int
    """Trainable parameter tensors (a tied weight counts once)."""
    bucket_sizes_bytes: list[int] | None
    """Gradient bytes in each bucket, in launch order (read after warm-up, when PyTorch's DDP has
    rebuilt its plan); None for strategies that do not say."""
    allreduce_calls_per_step: int | None
    """Collectives one step launches: the strategy's own figure, else counted during a warm-up
    step (see ``count_collectives``); None if neither is possible."""
    bytes_per_step: int
    """Gradient bytes this rank all-reduces per step (0 for ``local``)."""


@dataclass(frozen=True)
class StepTiming:
    """One rank's figures for one timed step."""

    rank: int
    step_seconds: float
    comm_wait_seconds: float
    """From the last gradient computed by backward to gradients synchronized (module docstring).
    Can be slightly negative on CUDA, where the two events are on different streams' clocks."""
    peak_memory_bytes: int | None
    """Peak CUDA memory allocated during the step; None on CPU."""

    @property
    def seconds(self) -> float:
        """What the timing loop reads of any timing."""
        return self.step_seconds


@dataclass(frozen=True)
class OutOfMemory(Withdrawn):
    """Returned instead of a result by a rank that ran out of memory; it has freed its state.

    The launcher waits only a short grace for the other ranks, which may be blocked in a collective
    this rank left (ranks do not always run out together: another process's memory on one GPU, a
    model that allocates per rank), and replaces the group if they are, or if ``group_broken``."""

    rank: int
    message: str
    allocated_bytes: int | None
    """CUDA memory still allocated after freeing (None on CPU)."""
    peak_bytes: int | None
    total_bytes: int | None
    """The device's memory (None on CPU)."""
    group_broken: bool = False
    """The error came from the communicator (an NCCL error that mentions out of memory): the
    process group may be unusable, so it is replaced rather than reused."""


class StepObserver:
    """What a tool attaches to the step: ``phase(name)`` wraps each of ``PHASES``. The default does nothing."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


NO_OBSERVER = StepObserver()


class Trainer:
    """One configuration on one rank: the workload wrapped in its strategy, AdamW, this rank's batch."""

    def __init__(self, config: StepConfig, info: RankInfo, before_first_step: Callable[[nn.Module], None] | None = None) -> None:
        """``before_first_step(model)`` may adjust the wrapped model before it runs (``ddp profile``
        hooks PyTorch's reducer there)."""
        self.config = config
        self.device = info.device
        self.cuda = info.device.type == "cuda"
        torch.manual_seed(config.seed)  # the same initial weights for every strategy of a model
        workload = build_workload(config.model, config.batch_size, config.seq_len, info.device)
        self.workload: Workload = workload
        module = workload.module
        options = {"bucket_size_mb": config.bucket_size_mb} if config.bucket_size_mb is not None else {}
        if config.grad_comm == "bf16":
            options["comm_dtype"] = torch.bfloat16
        self.model = make_ddp(config.strategy, module, **options)
        if getattr(self.model, "module", None) is not module:
            raise TypeError(
                f"strategy {config.strategy!r} must keep the module it wraps as .module (the suite reads the "
                "trained parameters there): set self.module = module in its constructor"
            )
        if before_first_step is not None:
            before_first_step(self.model)
        implementation = {"fused": True} if config.optimizer == "fused" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, **implementation)
        self.inputs, self.targets = rank_batch(workload, config.seed, info.rank, info.world_size, info.device)
        params = trainable_parameters(module)
        self.num_parameters = sum(p.numel() for p in params)
        self.num_parameter_tensors = len(params)
        # Bytes of gradient this rank all-reduces per step, in the dtype they are sent.
        comm_bytes = {"bf16": torch.bfloat16.itemsize}.get(config.grad_comm)  # None: each gradient's own size
        self.gradient_bytes = sum(p.numel() * (comm_bytes or p.element_size()) for p in params)
        self.last_gradient_seconds = 0.0  # perf_counter time of the last gradient computed
        self._last_gradient_event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        # A tensor hook runs when a gradient has been computed, before it is accumulated and so
        # before any strategy's post-accumulate hook (or DDP's reducer) launches communication.
        self._hooks = [p.register_hook(self._on_gradient) for p in params]

    def _on_gradient(self, grad: torch.Tensor) -> None:
        self.last_gradient_seconds = time.perf_counter()
        if self.cuda:
            self._last_gradient_event.record()

    def setup(self, rank: int) -> StepSetup:
        sizes = getattr(self.model, "bucket_sizes_bytes", None)
        calls = getattr(self.model, "num_allreduce_calls_per_step", None)
        if calls is None:
            calls = self.count_collectives()
        return StepSetup(
            rank=rank,
            num_parameters=self.num_parameters,
            num_parameter_tensors=self.num_parameter_tensors,
            bucket_sizes_bytes=list(sizes) if sizes is not None else None,
            allreduce_calls_per_step=None if calls is None else int(calls),
            bytes_per_step=self.gradient_bytes if self.config.strategy != "local" else 0,
        )

    def count_collectives(self) -> int | None:
        """Collectives one step launches, counted from the profiler's record of c10d's operators
        during one untimed step: for a user's class that does not say."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profiler:
            self.step()
        names = [event.name for event in profiler.events()]
        return sum(1 for name in names if name.startswith("c10d::") and "barrier" not in name and "_coalesced" not in name)

    def step(self, observer: StepObserver = NO_OBSERVER) -> StepTiming:
        """One step in this configuration's precision; setting and restoring it is outside the clock."""
        with numerics(self.config.precision):
            return self._timed_step(observer)

    def _timed_step(self, observer: StepObserver) -> StepTiming:
        phase = observer.phase
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            synchronized = torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        with phase("forward"), forward_autocast(self.config.precision, self.device):
            loss = self.workload.loss(self.model(self.inputs), self.targets)
        with phase("backward"):
            loss.backward()
        with phase("gradient_sync"):
            self.model.finish_gradient_synchronization()
            if self.cuda:
                synchronized.record()
            synchronized_seconds = time.perf_counter()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        step_seconds = time.perf_counter() - start
        if self.cuda:
            comm_wait_seconds = self._last_gradient_event.elapsed_time(synchronized) / 1000.0
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            comm_wait_seconds = synchronized_seconds - self.last_gradient_seconds
            peak = None
        return StepTiming(rank_info().rank, step_seconds, comm_wait_seconds, peak)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error (``torch.cuda.OutOfMemoryError`` exists in every supported
    torch), or a RuntimeError that says so (host allocations, NCCL)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


@dataclass
class RankBench:
    """The state one rank keeps between the parent's calls: see the module docstring."""

    trainers: dict[StepConfig, Trainer] = field(default_factory=dict)
    allreduce_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    """float32 buffers of the all-reduce benchmark, by element count."""

    def prepare(self, configs: Sequence[StepConfig], warmup_steps: int) -> list[StepSetup] | OutOfMemory:
        """Build ``configs`` (freeing every other one, keeping those already built: the local
        twin of the next strategy at the same batch and sequence length is the same) and run
        ``warmup_steps`` untimed steps of each.

        A fresh build runs at least ``FRESH_BUILD_WARMUP_STEPS`` (one for ``SETTLED_AFTER_ONE_STEP``):
        ``bucketed`` re-plans its buckets after its first step, and PyTorch's DDP reduces everything
        in one bucket in its first step, rebuilds its buckets in the second and records the new plan
        (which ``StepSetup`` reports) in the third; a user's class may do the same.
        """
        info = rank_info()
        try:
            kept = {config: self.trainers.pop(config) for config in configs if config in self.trainers}
            self.release()  # whatever is not asked for any more, before building (memory)
            fresh = [config for config in configs if config not in kept]
            self.trainers = {config: kept.get(config) or Trainer(config, info) for config in configs}
            for config in configs:
                fresh_steps = 1 if config.strategy in SETTLED_AFTER_ONE_STEP else FRESH_BUILD_WARMUP_STEPS
                steps = max(fresh_steps, warmup_steps) if config in fresh else warmup_steps
                for _ in range(steps):
                    self.trainers[config].step()
            return [trainer.setup(info.rank) for trainer in self.trainers.values()]
        except Exception as error:
            if is_out_of_memory(error):
                return self.out_of_memory(error)
            raise

    def round(self, configs: Sequence[StepConfig], round_index: int) -> list[StepTiming] | OutOfMemory:
        """One step of each configuration, in an order that rotates with ``round_index`` so that
        drift in the machine falls on all of them alike; timings in the order of ``configs``."""
        missing = [c.describe() for c in configs if c not in self.trainers]
        if missing:
            raise RuntimeError(f"a round of {'; '.join(missing)} before prepare built it on this rank")
        shift = round_index % len(configs)
        order = list(range(len(configs)))[shift:] + list(range(len(configs)))[:shift]
        timings: dict[int, StepTiming] = {}
        try:
            for index in order:
                if len(configs) > 1:
                    dist.barrier()  # every rank starts each contender's step together
                timings[index] = self.trainers[configs[index]].step()
        except Exception as error:
            if is_out_of_memory(error):
                return self.out_of_memory(error)
            raise
        return [timings[index] for index in range(len(configs))]

    def out_of_memory(self, error: BaseException) -> OutOfMemory:
        """Free this rank's state and describe what memory looked like."""
        info = rank_info()
        on_cuda = info.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(info.device) if on_cuda else None
        self.release()
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        return OutOfMemory(
            rank=info.rank,
            message=message,
            allocated_bytes=torch.cuda.memory_allocated(info.device) if on_cuda else None,
            peak_bytes=peak,
            total_bytes=torch.cuda.get_device_properties(info.device).total_memory if on_cuda else None,
            group_broken=isinstance(error, dist.DistError) or "nccl" in message.lower(),
        )

    def release(self) -> None:
        """Drop every trainer and buffer kept on this rank and return the memory to the device."""
        for trainer in self.trainers.values():
            trainer.close()
        self.trainers = {}
        self.allreduce_buffers = {}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def trainer(self, config: StepConfig) -> Trainer:
        if config not in self.trainers:
            raise RuntimeError(f"{config.describe()} is not built on this rank: prepare it first")
        return self.trainers[config]


_RANK_BENCH = RankBench()


def rank_bench() -> RankBench:
    """This rank process's ``RankBench``."""
    return _RANK_BENCH


# Entry points the parent runs on every rank (``RankGroup.run`` needs importable functions).


def prepare(configs: Sequence[StepConfig], warmup_steps: int = 1) -> list[StepSetup] | OutOfMemory:
    return rank_bench().prepare(configs, warmup_steps)


def timed_round(configs: Sequence[StepConfig], round_index: int = 0) -> list[StepTiming] | OutOfMemory:
    return rank_bench().round(configs, round_index)


def release() -> None:
    rank_bench().release()


def parameters_of(config: StepConfig) -> list[torch.Tensor]:
    """The trained parameters of a configuration on this rank, on the CPU (for checks that two
    strategies trained alike)."""
    return [p.detach().cpu() for p in rank_bench().trainer(config).model.module.parameters()]


def first_out_of_memory(results: Sequence) -> OutOfMemory | None:
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
        "use a smaller batch size, sequence length or model"
    )
