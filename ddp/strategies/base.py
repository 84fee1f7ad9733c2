"""The interface every data-parallel strategy implements, and the pieces they share.

A strategy wraps any ``nn.Module``. On construction every rank receives rank 0's parameters and
buffers; after ``loss.backward()`` a call to ``finish_gradient_synchronization()`` leaves every
trainable parameter's gradient averaged over the ranks, exactly as one process training on the
whole batch would have it. ``no_sync()`` skips communication for gradient accumulation.

``Strategy`` is the interface, declared once: every strategy here, ``local`` and ``torch``
included, derives from it. A user's own class need not: what the suite requires of it is
``REQUIRED_METHODS``, a constructor ``(module, **options)`` (see ``ddp.strategies.registry``) and
the wrapped module kept as ``.module`` (checked when the benchmark builds it);
everything else (``no_sync``, ``bucket_size_mb``, the figures below) is optional, and the suite
measures or skips where a class lacks it.

**Strategies that shard** (ZeRO, FSDP) own more than the gradients, and say so through two optional
methods, read everywhere through the functions of the same name below (a class without them gets
the replicated default):

- ``make_optimizer(optimizer_cls, **kwargs)``: the optimizer the step uses. Default
  ``optimizer_cls(strategy.parameters(), **kwargs)``; a ZeRO strategy returns one that steps only
  this rank's shard and gathers the updated parameters back.
- ``gather_full_params()``: every trained parameter, whole, by its name in the wrapped module's
  ``named_parameters()``. Default: the module's own parameters; an FSDP strategy all-gathers them.

and through ``sharding`` (a ``Sharding``) on the class: which state it splits over the ranks, from
which the memory a rank needs follows (``Sharding.bytes_per_parameter``).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ddp.strategies.tracing import USED_MASK_LABEL, CollectiveRecorder, launch_all_reduce


def require_process_group(strategy: str, process_group: dist.ProcessGroup | None) -> None:
    """Fail with an instruction when a strategy is built before ``init_process_group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{strategy} needs a process group: call torch.distributed.init_process_group(...) "
            "before wrapping the model (torchrun or ddp.launcher.RankGroup do this for you)"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")


def check_bucket_size_mb(bucket_size_mb: object) -> float:
    """Return ``bucket_size_mb`` as a float, or raise saying what a valid value looks like."""
    if (
        isinstance(bucket_size_mb, bool)
        or not isinstance(bucket_size_mb, (int, float))
        or not math.isfinite(bucket_size_mb)
        or bucket_size_mb <= 0
    ):
        raise ValueError(
            f"bucket_size_mb must be a positive finite number of MiB (e.g. 25.0), got {bucket_size_mb!r}"
        )
    return float(bucket_size_mb)


def check_comm_dtype(comm_dtype: object) -> torch.dtype | None:
    """Return ``comm_dtype`` (None: communicate gradients in their own dtype), or raise saying what
    a valid value looks like."""
    if comm_dtype is not None and (not isinstance(comm_dtype, torch.dtype) or not comm_dtype.is_floating_point):
        raise ValueError(f"comm_dtype must be a floating torch.dtype such as torch.bfloat16, or None; got {comm_dtype!r}")
    return comm_dtype


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients, each once: a tied weight appears a single time, frozen ones never."""
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """Give every rank rank 0's parameters and buffers, one collective per dtype and device."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src=src, group=process_group)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # two fp32 moments a parameter (AdamW's exp_avg and exp_avg_sq)


@dataclass(frozen=True)
class Sharding:
    """Which training state a strategy splits over the ranks; every rank holds the rest whole.

    Replicated DDP splits nothing (16 bytes a parameter with fp32 AdamW); a sharded optimizer
    (ZeRO-1) the optimizer state (4 + 4 + 8/N); full sharding (FSDP, ZeRO-3) all three (16/N), each
    plus the unit of parameters gathered for compute and the strategy's buffers.
    """

    parameters: bool = False
    gradients: bool = False
    optimizer_state: bool = False

    def bytes_per_parameter(self, world_size: int) -> dict[str, float]:
        """Bytes a rank holds per model parameter, fp32 weights and AdamW, by kind and in total."""
        share = 1.0 / world_size
        figures = {
            "parameters": FP32_BYTES * (share if self.parameters else 1.0),
            "gradients": FP32_BYTES * (share if self.gradients else 1.0),
            "optimizer_state": ADAM_STATE_BYTES * (share if self.optimizer_state else 1.0),
        }
        figures["total"] = sum(figures.values())
        return figures

    @property
    def is_sharded(self) -> bool:
        """Whether the strategy splits anything over the ranks."""
        return self.parameters or self.gradients or self.optimizer_state

    @property
    def level(self) -> str:
        """What it is called: ``replicated (DDP)``, ``ZeRO-1 (sharded optimizer)``, ``full sharding (FSDP)``."""
        if self.parameters and self.gradients and self.optimizer_state:
            return "full sharding (FSDP)"
        if self.optimizer_state and not (self.parameters or self.gradients):
            return "ZeRO-1 (sharded optimizer)"
        return "replicated (DDP)" if not self.is_sharded else f"sharded: {self.formula}"

    @property
    def formula(self) -> str:
        """The bytes a parameter as a user reads them, e.g. ``4 + 4 + 8/N``."""
        terms = [(FP32_BYTES, self.parameters), (FP32_BYTES, self.gradients), (ADAM_STATE_BYTES, self.optimizer_state)]
        if all(sharded for _, sharded in terms):
            return "16/N"
        return " + ".join(f"{size}/N" if sharded else str(size) for size, sharded in terms)


REPLICATED = Sharding()


def sharding_of(model_or_class: object) -> Sharding | None:
    """What a strategy (instance or class) shards; None for a user's class that does not say."""
    sharding = getattr(model_or_class, "sharding", None)
    return sharding if isinstance(sharding, Sharding) else None


def shards_parameters(model_or_class: object) -> bool:
    """Whether the wrapped module's own parameters are not the whole trained ones: the strategy
    says so in ``sharding``, or (a user's class that does not say) it gathers them itself."""
    sharding = sharding_of(model_or_class)
    if sharding is not None:
        return sharding.parameters
    return callable(getattr(model_or_class, "gather_full_params", None))


# What the suite calls on any strategy, a user's own included.
REQUIRED_METHODS = ("forward", "finish_gradient_synchronization")


class GradientSize(Protocol):
    """What a cost schedule reads of one gradient (``ddp.analysis.costmodel.Gradient`` has it)."""

    size_bytes: int
    element_size: int


class Transfer(NamedTuple):
    """One collective of a step in a cost schedule."""

    ready_seconds: float
    """When it can be launched, in seconds after backward started."""
    size_bytes: int
    """Bytes of the whole buffer (for a reduce-scatter its input, for an all-gather its output)."""
    collective: str = "all_reduce"
    """``all_reduce``, ``reduce_scatter`` or ``all_gather`` (a sharded strategy's)."""


class MemoryPlan(NamedTuple):
    """What a strategy's buffers are sized by (``Strategy.step_buffers``), for one rank."""

    gradient_bytes: int
    """Every trainable parameter's gradient, the whole model's."""
    unit_bytes: tuple[int, ...]
    """A strategy that shards parameters: the parameters of each of its ``units``, whole, root last
    (empty where it has none)."""
    world_size: int
    gradient_itemsize: int
    """Bytes an element of the gradients (4: fp32)."""
    comm_itemsize: int | None
    """Bytes an element a strategy that takes ``comm_dtype`` communicates in; None: the gradients' own."""


class StepBuffers(NamedTuple):
    """What a strategy holds on a rank beyond parameters, gradients and optimizer state, by moment
    of the step, in bytes (``ddp.bench.memory.predict`` adds it to the training state and the activations)."""

    kept_bytes: int = 0
    """Held from one step to the next (PyTorch's DDP's buckets, a bf16 copy of each bucket)."""
    forward_bytes: int = 0
    """More at forward's end, when it holds the most (the units an FSDP rank has gathered)."""
    backward_bytes: int = 0
    """More at backward's start, when the activations peak (the units an FSDP rank has gathered)."""
    unit_backward_bytes: int = 0
    """More again once backward has produced gradients, while a unit's backward runs: its whole
    gradient before the reduce-scatter and the shard that yields (a strategy that shards
    parameters by unit). It decides the peak where activations no longer do: checkpointed blocks,
    whose backward holds little more than one block's recomputed forward."""
    synchronization_bytes: int = 0
    """More once backward has ended, while the gradients are synchronized (copies of them, a
    gathered unit's whole gradient)."""
    gather_bytes: int = 0
    """More once AdamW has stepped (its temporaries freed), while the updated parameters are
    gathered (a sharded optimizer's flattened broadcasts)."""
    gradients_kept: bool = False
    """True where the gradients live in buffers the strategy keeps (``bucketed``'s buckets, each
    gradient a view into one), so they are whole all step: ``zero_grad(set_to_none=True)`` frees
    nothing."""


def bucket_copy_buffers(plan: MemoryPlan, keeps_gradient_buckets: bool) -> StepBuffers:
    """A replicated strategy's: a second copy of the gradients kept in its buckets where it keeps
    them (PyTorch's DDP), nothing else (a strategy that all-reduces the gradients in place)."""
    return StepBuffers(kept_bytes=plan.gradient_bytes if keeps_gradient_buckets else 0)


def gathered_unit_buffers(plan: MemoryPlan, prefetches_next_unit: bool) -> StepBuffers:
    """A strategy that shards parameters by unit. Forward holds the most at its end, the loss:
    the root unit is gathered (it encloses the others), the last unit has run and been freed. At
    backward's start, when the activations peak, the root is gathered and, where the strategy
    prefetches, the last unit too; the units gathered later in backward, and their whole
    gradients, are held once the activations they consumed have been freed (``MemTracker`` on
    tiny and mini with PyTorch's ``fully_shard``: the peak at backward's start, the root alone
    gathered at forward's end)."""
    if not plan.unit_bytes:
        return StepBuffers()
    root, largest = plan.unit_bytes[-1], max(plan.unit_bytes[:-1], default=0)
    return StepBuffers(forward_bytes=root, backward_bytes=root + (largest if prefetches_next_unit else 0),
                       unit_backward_bytes=largest + largest // plan.world_size)


class Strategy(nn.Module, abc.ABC):
    """The interface of every strategy: wrap ``module``, ``forward``, ``finish_gradient_synchronization()``,
    optional ``no_sync()`` (a context manager under which backward accumulates gradients; a class
    without one cannot be asked to accumulate).

    Two figures the benchmarks record are optional: ``num_allreduce_calls_per_step`` (collectives
    one synchronizing step launches) and ``bucket_sizes_bytes`` (the bucket plan). None means the
    strategy does not know; the benchmark then counts the collectives it launches itself.

    **What a strategy says about itself.** The class attributes below and
    ``communication_schedule`` are all that the harness, the cost model, the plots and the report
    know of a strategy: a new strategy is one file, and none of them names it. A user's class that
    does not derive from ``Strategy`` gets these defaults (``traits_of``).
    """

    module: nn.Module
    sharding: Sharding = REPLICATED
    """What the strategy splits over the ranks; its memory formula follows (``Sharding``)."""
    collective_recorder: CollectiveRecorder | None = None
    """Set on an instance while ``ddp profile`` records its collectives (``ddp.strategies.tracing``);
    strategies pass it to every ``launch_all_reduce``."""

    records_collectives: bool = False
    """True where every gradient collective of the step goes through ``launch_all_reduce`` with the
    ``collective_recorder`` (the hand-written strategies): traced steps take its records, with their
    ready times; otherwise the profiler's record of c10d's collectives (``ddp.bench.collectives.recording``)."""

    communicates: bool = True
    """False for a strategy that synchronizes nothing (``local``): no gradient bytes per step."""
    accumulates_locally: bool = False
    """True where ``no_sync()`` skips every collective, so that backwards inside it only accumulate
    gradients on the rank and the first backward after it synchronizes them all (the replicated
    strategies, PyTorch's DDP; ``local``, which never communicates). False where backward
    communicates inside ``no_sync()`` too, or the class does not say: the benchmark does not time
    gradient accumulation with it (``ddp.bench.config.shape.cannot_run``)."""
    line_style: str = "-"
    """matplotlib line style of the strategy in plots (``torch`` dashed beside ``bucketed``)."""
    reference_in_reports: bool = False
    """The report measures the fastest strategy against this one too (PyTorch's DDP, the one to
    beat; ``naive``, the one every strategy improves on)."""
    first_bucket_bytes: int | None = None
    """Bytes the first bucket is filled up to whatever the cap (PyTorch's DDP: 1 MiB); None if
    the first bucket follows the cap like the others. The report explains bucket counts with it."""
    closes_bucket_after_cap: bool = False
    """True where a bucket is closed once it has reached the cap (PyTorch's DDP), so buckets may
    exceed it; False where it is closed before the tensor that would overflow it."""
    keeps_gradient_buckets: bool = False
    """True where the strategy keeps its buckets beside the parameters' gradients, a second copy of
    them (PyTorch's DDP without ``gradient_as_bucket_view``): 4 more bytes a parameter in memory."""
    prefetches_next_unit: bool = False
    """A strategy that shards parameters: True where it issues the next unit's all-gather when the
    current unit starts computing (``fully_shard``'s implicit prefetching), False where it gathers a
    unit when the unit starts. The cost model schedules the all-gathers by it."""

    @classmethod
    def units(cls, module: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """A strategy that shards parameters: the units it all-gathers one at a time, as (name,
        submodule), the root (``""``, holding every parameter outside the others) last. A parameter
        belongs to the innermost unit whose name prefixes its own. None: the strategy gathers no units."""
        return None

    @classmethod
    def communication_schedule(
        cls,
        gradients: Sequence[GradientSize],
        ready_seconds: Sequence[float],
        backward_seconds: float,
        bucket_size_mb: float | None,
    ) -> list[Transfer] | None:
        """The collectives of one step for the cost model (``ddp simulate``), in launch order:
        ``gradients`` in the order backward produces them, ``ready_seconds[i]`` when gradient i is
        ready, ``backward_seconds`` when backward ends. None: the strategy does not say (the
        simulator then skips it); an empty list: it communicates nothing."""
        return [] if not cls.communicates else None

    @classmethod
    def step_buffers(cls, plan: MemoryPlan) -> StepBuffers:
        """The memory this strategy holds beyond its training state (``StepBuffers``), sized by
        ``plan``. The default: ``bucket_copy_buffers`` on ``keeps_gradient_buckets``."""
        return bucket_copy_buffers(plan, cls.keeps_gradient_buckets)

    steps_to_settle: int = 1
    """Steps after which the strategy's plan (buckets, collectives per step) is final: the
    harness runs at least this many untimed steps of a fresh build before timing it (a race, as
    many of every contender as the slowest to settle needs). A class that does not derive from
    ``Strategy`` and does not say gets ``DEFAULT_STEPS_TO_SETTLE``."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """The optimizer of this strategy's training: ``optimizer_cls`` over its parameters, unless it shards."""
        return optimizer_cls(self.parameters(), **kwargs)

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every trained parameter, whole, by its name in the wrapped module (detached, not copied)."""
        return {name: p.detach() for name, p in self.module.named_parameters()}

    def close(self) -> None:
        """Undo what wrapping did to the module (hooks on its parameters), so that the module and
        everything the strategy allocated can be freed once the caller drops them. The harness
        calls it when it is done with a configuration; a hook left on a parameter that refers
        back to the strategy is a cycle through autograd that Python's collector cannot free."""

    @abc.abstractmethod
    def finish_gradient_synchronization(self) -> None:
        """Leave every trainable parameter's gradient averaged over the ranks."""

    @property
    def num_allreduce_calls_per_step(self) -> int | None:
        return None

    @property
    def bucket_sizes_bytes(self) -> list[int] | None:
        return None


@dataclass(frozen=True)
class Traits:
    """What the suite reads of a strategy class: ``Strategy``'s attributes of the same names, the
    class's own where it has them, ``Strategy``'s defaults where it does not."""

    communicates: bool
    accumulates_locally: bool
    steps_to_settle: int
    line_style: str
    reference_in_reports: bool
    first_bucket_bytes: int | None
    closes_bucket_after_cap: bool
    keeps_gradient_buckets: bool
    prefetches_next_unit: bool
    units: Callable[[nn.Module], list[tuple[str, nn.Module]] | None]
    communication_schedule: Callable[..., list[Transfer] | None]
    step_buffers: Callable[[MemoryPlan], StepBuffers]


# Steps a user's class gets before its figures are read, when it does not say (PyTorch's DDP needs three).
DEFAULT_STEPS_TO_SETTLE = 3


def traits_of(cls: type) -> Traits:
    """The ``Traits`` of any strategy class, a user's that does not derive from ``Strategy`` included."""

    def read(name: str):
        return getattr(cls, name, getattr(Strategy, name))

    schedule = getattr(cls, "communication_schedule", None)
    if schedule is None:  # a user's class that says nothing: nothing the simulator can model
        def schedule(*_args, **_kwargs):
            return None
    buffers = getattr(cls, "step_buffers", None)
    if buffers is None:  # a user's class that says nothing: Strategy's default, on its own keeps_gradient_buckets
        def buffers(plan: MemoryPlan) -> StepBuffers:
            return bucket_copy_buffers(plan, bool(read("keeps_gradient_buckets")))
    return Traits(
        communicates=bool(read("communicates")),
        accumulates_locally=bool(read("accumulates_locally")),
        steps_to_settle=int(getattr(cls, "steps_to_settle", DEFAULT_STEPS_TO_SETTLE)),
        line_style=str(read("line_style")),
        reference_in_reports=bool(read("reference_in_reports")),
        first_bucket_bytes=read("first_bucket_bytes"),
        closes_bucket_after_cap=bool(read("closes_bucket_after_cap")),
        keeps_gradient_buckets=bool(read("keeps_gradient_buckets")),
        prefetches_next_unit=bool(read("prefetches_next_unit")),
        units=read("units"),
        communication_schedule=schedule,
        step_buffers=buffers,
    )


def make_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    """The optimizer any strategy trains with, a user's class included: its own ``make_optimizer``
    if it has one, else ``Strategy``'s (``optimizer_cls`` over its parameters)."""
    own = getattr(model, "make_optimizer", None)
    return own(optimizer_cls, **kwargs) if callable(own) else Strategy.make_optimizer(model, optimizer_cls, **kwargs)


def gather_full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter of any strategy, whole, by name: its own ``gather_full_params()``
    if it has one, else ``Strategy``'s (the wrapped module's parameters)."""
    own = getattr(model, "gather_full_params", None)
    return dict(own()) if callable(own) else Strategy.gather_full_params(model)


class DataParallel(Strategy):
    """Base class of the hand-written strategies: holds the wrapped module, the process group and
    the ``no_sync`` state, and gives every rank rank 0's parameters and buffers.

    Subclasses implement ``finish_gradient_synchronization()``. Whether a backward pass
    communicates is decided when ``forward`` runs, as in PyTorch's DistributedDataParallel: a
    forward inside ``no_sync()`` produces a backward that communicates nothing.
    """

    accumulates_locally = True  # a backward inside no_sync() communicates nothing

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        require_process_group(type(self).__name__, process_group)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.parameters_to_sync = trainable_parameters(module)
        self._require_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward time
        self._hook_handles: list[RemovableHandle] = []
        broadcast_from_rank0(module, process_group)

    def _hook_gradients(self, params: list[nn.Parameter], hook: Callable[[nn.Parameter], None]) -> None:
        """Run ``hook(param)`` once each parameter's gradient is accumulated; ``close`` removes it."""
        self._hook_handles += [p.register_post_accumulate_grad_hook(hook) for p in params]

    def close(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def forward(self, *args, **kwargs):
        self._sync_this_backward = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after leaving synchronizes them."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def _all_reduce_used_mask(self, used_locally: list[bool]) -> dist.Work:
        """Launch a MAX all-reduce of which parameters got a gradient on this rank.

        Needed because a parameter may be used on some ranks only: the others contribute zeros,
        and a parameter no rank used must keep the gradient single-process training leaves it.
        In the usual step every parameter got a gradient here, and then the result is all ones
        whatever the other ranks send: the mask is a tensor of ones kept on the device (MAX leaves
        it unchanged), so the step makes no host-to-device copy for it and ``used_somewhere``
        reads nothing back, either of which would stall a GPU's stream.
        """
        device = self.parameters_to_sync[0].device if self.parameters_to_sync else torch.device("cpu")
        if dist.get_backend(self.process_group) == "gloo":
            device = torch.device("cpu")
        self._all_used_locally = all(used_locally)
        if self._all_used_locally:
            if getattr(self, "_ones_mask", None) is None or self._ones_mask.numel() != len(used_locally):
                self._ones_mask = torch.ones(len(used_locally), dtype=torch.int32, device=device)
            self._used_mask = self._ones_mask
        else:
            self._used_mask = torch.tensor(used_locally, dtype=torch.int32, device=device)
        return launch_all_reduce(self._used_mask, dist.ReduceOp.MAX, self.process_group, USED_MASK_LABEL,
                                 self.collective_recorder)

    def used_somewhere(self) -> list[bool]:
        """After the mask's all-reduce completed: which parameters got a gradient on some rank."""
        if self._all_used_locally:
            return [True] * self._used_mask.numel()
        return [bool(flag) for flag in self._used_mask.tolist()]
