"""What a strategy declares about itself, kept apart from its training code: what the harness,
the memory prediction, the cost model and the report read of it, and nothing else does.

A strategy's file holds its class, the code a student reads, and below it one ``declare(Class,
...)`` with what the suite needs to know: which state it shards (``Sharding``), whether it
communicates and can accumulate without communicating, its collectives for the cost model
(``communication_schedule``, of ``Transfer``s), its buffers for the memory prediction
(``step_buffers``, ``StepBuffers`` sized by a ``MemoryPlan``), its sharding units, how the report
draws and explains it. ``traits_of`` reads them for any class.

Declarations belong to the exact class that makes them: a subclass of a strategy (a comm hook on
PyTorch's DDP, PowerSGD) inherits none of its parent's cost schedule, buffers or report style; it
declares its own, or says in its ``declare`` that it is declared as its parent
(``declare(Sub, **declarations(Parent, ...))``). ``missing_declarations`` names what a strategy must
declare; every registered one does (``tests/test_declarations.py``). Only the two interfaces,
``Strategy`` and ``DataParallel``, declare for their subclasses (``declare_interface``), what
their own code makes true of any subclass (``DataParallel.no_sync``). A user's class that calls
no ``declare`` may instead set the same names as class attributes (or classmethods), and gets
``Traits``' defaults for what it does not say. None of the readers names a strategy: a new
strategy is one file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

from torch import nn

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
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return traits_of(cls).sharding


def shards_parameters(model_or_class: object) -> bool:
    """Whether the wrapped module's own parameters are not the whole trained ones: the strategy
    says so in ``sharding``, or (a user's class that does not say) it gathers them itself."""
    sharding = sharding_of(model_or_class)
    if sharding is not None:
        return sharding.parameters
    return callable(getattr(model_or_class, "gather_full_params", None))


class GradientSize(Protocol):
    """What a cost schedule reads of one gradient (``ddp.analysis.costmodel.Gradient`` has it)."""

    size_bytes: int
    element_size: int
    shape: tuple[int, ...]
    """The parameter's shape (empty where unknown)."""


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
    compute_itemsize: int | None = None
    """Bytes an element a strategy that takes ``compute_dtype`` gathers its parameters and computes
    their gradients in (2 under bf16, ``ddp.bench.config.values.sharded_compute_dtype``); None:
    the gradients' own."""
    bucket_bytes: int | None = None
    """The cap of a strategy's buckets, in bytes (``bucket_size_mb``); None where it takes none."""

    def gathered(self, size_bytes: int) -> int:
        """``size_bytes`` of parameters (in the gradients' dtype) as gathered: in the compute dtype."""
        return size_bytes * (self.compute_itemsize or self.gradient_itemsize) // self.gradient_itemsize

    @property
    def computes_in_another_dtype(self) -> bool:
        return self.compute_itemsize is not None and self.compute_itemsize != self.gradient_itemsize


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
    pending_gradient_bytes: int = 0
    """At most this much of the gradients backward has made so far, held beside the kept ones
    until the buffer they go into is complete (``bucketed``: the fresh gradients of the bucket
    being filled, moved into it once its last one is in)."""


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
    gathered at forward's end). Gathered in ``plan.compute_itemsize`` where there is one."""
    if not plan.unit_bytes:
        return StepBuffers()
    root, largest = plan.unit_bytes[-1], max(plan.unit_bytes[:-1], default=0)
    gathered_root, gathered_largest = plan.gathered(root), plan.gathered(largest)
    # A unit's whole gradient reduce-scattered in the gradients' dtype (fp32), and the shard that
    # yields; in another compute dtype the gradient autograd made in it is copied first (both held
    # for a moment, the shard after the first is freed).
    made = gathered_largest if plan.computes_in_another_dtype else 0
    return StepBuffers(forward_bytes=gathered_root,
                       backward_bytes=gathered_root + (gathered_largest if prefetches_next_unit else 0),
                       unit_backward_bytes=largest + max(made, largest // plan.world_size))


@dataclass(frozen=True)
class Approximation:
    """What a strategy that does not train exactly like one process approximates, as the
    correctness suite holds it (correctness_tests/test_approximation.py)."""

    exact_steps: int
    """Steps from the start that synchronize exactly, as every other strategy does (PowerSGD's
    vanilla all-reduces before ``start_powerSGD_iter``)."""
    max_rank: int
    """Afterwards, each gradient it compresses, viewed as a matrix ``(shape[0], -1)``, is
    synchronized with rank at most this; every other gradient exactly."""
    compresses: Callable[[tuple[int, ...]], bool]
    """``compresses(shape)``: whether it compresses a gradient of that shape."""


@dataclass(frozen=True)
class Traits:
    """What the suite reads of a strategy class, each with the default a class that does not say
    gets (``traits_of``)."""

    sharding: Sharding | None = None
    """What the strategy splits over the ranks; its memory formula follows. None: a user's class
    that does not say (``Strategy`` declares ``REPLICATED``)."""
    communicates: bool = True
    """False for a strategy that synchronizes nothing (``local``): no gradient bytes per step."""
    accumulates_locally: bool = False
    """True where ``no_sync()`` skips every collective, so that backwards inside it only accumulate
    gradients on the rank and the first backward after it synchronizes them all (the replicated
    strategies, PyTorch's DDP; ``local``, which never communicates). False where backward
    communicates inside ``no_sync()`` too, or the class does not say: the benchmark does not time
    gradient accumulation with it (``ddp.bench.config.shape.cannot_run``)."""
    records_collectives: bool = False
    """True where every gradient collective of the step goes through ``launch_all_reduce`` with the
    ``collective_recorder`` (the hand-written strategies): traced steps take its records, with their
    ready times; otherwise the profiler's record of c10d's collectives (``ddp.bench.collectives.recording``)."""
    steps_to_settle: int = 3
    """Steps after which the strategy's plan (buckets, collectives per step) is final: the harness
    runs at least this many untimed steps of a fresh build before timing it (a race, as many of
    every contender as the slowest to settle needs). ``Strategy`` declares 1; a user's class that
    does not say gets 3 (PyTorch's DDP needs three)."""
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
    units: Callable[[nn.Module], list[tuple[str, nn.Module]] | None] | None = None
    """``units(module)``: a strategy that shards parameters, the units it all-gathers one at a time,
    as (name, submodule), the root (``""``, holding every parameter outside the others) last; a
    parameter belongs to the innermost unit whose name prefixes its own. Not declared: it gathers no
    units (None)."""
    communication_schedule: Callable[..., list[Transfer] | None] | None = None
    """``communication_schedule(gradients, ready_seconds, backward_seconds, bucket_size_mb)``: the
    collectives of one step for the cost model (``ddp simulate``), in launch order: ``gradients``
    (``GradientSize``) in the order backward produces them, ``ready_seconds[i]`` when gradient i is
    ready, ``backward_seconds`` when backward ends. Not declared: nothing for a strategy that does
    not communicate, else None (the simulator skips it)."""
    step_buffers: Callable[[MemoryPlan], StepBuffers] | None = None
    """``step_buffers(plan)``: the memory the strategy holds beyond its training state, sized by
    ``plan``. Not declared: ``bucket_copy_buffers`` on ``keeps_gradient_buckets``."""
    approximation: Callable[[nn.Module], Approximation] | None = None
    """``approximation(strategy)``: what a built strategy that does not train exactly like one
    process approximates (PowerSGD's compression); None: it is exact. An approximating strategy
    is left out of the exact correctness tests and of the default grid, and asked for by name."""


DECLARABLE = {f.name for f in fields(Traits)}
_OWN: dict[type, dict] = {}
"""What each class declared itself (``declare``), by the exact class."""
_INTERFACE: dict[type, dict] = {}
"""What an interface declares for every subclass (``declare_interface``)."""


def _check(cls: type, declared: dict) -> None:
    unknown = sorted(set(declared) - DECLARABLE)
    if unknown:
        raise TypeError(f"{cls.__name__}: {', '.join(unknown)} are not traits; a strategy declares {', '.join(sorted(DECLARABLE))}")


def declare(cls: type, **declared) -> type:
    """Declare ``cls``'s traits (``Traits``' names), beside the class rather than inside it; they
    are ``cls``'s alone (its subclasses declare their own). Returns ``cls``."""
    _check(cls, declared)
    if cls in _OWN:
        raise TypeError(f"{cls.__name__} is declared twice: give one declare() beside the class")
    _OWN[cls] = dict(declared)
    return cls


def declare_interface(base: type, **declared) -> type:
    """What every subclass of the interface ``base`` is unless it declares otherwise: only what
    ``base``'s own code makes true of them (``DataParallel.no_sync`` skips every collective)."""
    _check(base, declared)
    _INTERFACE[base] = dict(declared)
    return base


def declarations(cls: type, **changes) -> dict:
    """What ``cls`` declared itself with ``changes`` made, for a subclass declared as its parent:
    ``declare(Sub, **declarations(Parent, line_style=":"))``."""
    _check(cls, changes)
    return {**_OWN.get(cls, {}), **changes}


def missing_declarations(cls: type) -> list[str]:
    """The traits a strategy must declare itself that ``cls`` did not: what it shards, whether it
    communicates and can accumulate without it, how its collectives are recorded, when its plan
    settles, its buffers; a communicating strategy that gathers no parameters its cost schedule,
    one that does its units. Every one of them when ``cls`` made no ``declare`` of its own."""
    own = _OWN.get(cls, {})
    traits = traits_of(cls)
    gathers = traits.sharding is not None and traits.sharding.parameters
    required = ["sharding", "communicates", "accumulates_locally", "records_collectives", "steps_to_settle", "step_buffers"]
    required += ["units"] if gathers else ["communication_schedule"] if traits.communicates else []
    return [name for name in required if name not in own]


def nothing_sent(*_args, **_kwargs) -> list[Transfer]:
    """The cost schedule of a strategy that communicates nothing."""
    return []


def no_step_buffers(plan: MemoryPlan) -> StepBuffers:
    """The buffers of a strategy that holds none beyond its training state."""
    return StepBuffers()


def kept_bucket_copy(plan: MemoryPlan) -> StepBuffers:
    """A second copy of the gradients, kept in the strategy's buckets (PyTorch's DDP)."""
    return bucket_copy_buffers(plan, keeps_gradient_buckets=True)


def traits_of(cls: type) -> Traits:
    """The ``Traits`` of any strategy class: what its interfaces declare, then what it declares
    itself (``declare``; for a user's class that makes none, class attributes of the same names),
    ``Traits``' defaults for the rest."""
    given = {}
    for base in reversed(cls.__mro__):
        given.update(_INTERFACE.get(base, {}))
    if cls in _OWN:
        given.update(_OWN[cls])
    else:
        given.update({name: value for name in DECLARABLE if (value := getattr(cls, name, None)) is not None})
    if not isinstance(given.get("sharding"), Sharding):
        given.pop("sharding", None)  # a user's attribute of that name that is no Sharding says nothing
    traits = Traits(**given)
    communicates = bool(traits.communicates)
    keeps_gradient_buckets = bool(traits.keeps_gradient_buckets)

    def no_schedule(*_args, **_kwargs) -> list[Transfer] | None:
        return [] if not communicates else None

    def own_buckets(plan: MemoryPlan) -> StepBuffers:
        return bucket_copy_buffers(plan, keeps_gradient_buckets)

    def no_units(module: nn.Module) -> None:
        return None

    return dataclasses.replace(
        traits, communicates=communicates, accumulates_locally=bool(traits.accumulates_locally),
        records_collectives=bool(traits.records_collectives), steps_to_settle=int(traits.steps_to_settle),
        keeps_gradient_buckets=keeps_gradient_buckets, units=traits.units or no_units,
        communication_schedule=traits.communication_schedule or no_schedule, step_buffers=traits.step_buffers or own_buckets,
    )
