"""What a rank's training state occupies: parameters, gradients and optimizer state, counted once.

Counted the same way on every device: the bytes of the distinct storages behind the tensors a
strategy trains with (a tied weight, or gradients that are views into one bucket, count once; a
DTensor counts its local shard). Parameters are the strategy's ``parameters()`` (for FSDP the
shards, plus frozen parameters it keeps whole); gradients are their ``.grad`` when
synchronization has just finished (so a bucketed strategy's buckets count in full, flags
included); optimizer state is every tensor in the optimizer's ``state``, and in that of any
optimizer it wraps (a sharded optimizer keeps its shard's state in an inner one). What no
tensor of those holds is not counted: PyTorch's reducer buckets, communication buffers,
activations. On CUDA the allocator's peak over the timed steps (``StepRecord.peak_memory_bytes``) shows all of it.

Counting visits every parameter, so it runs in its own untimed steps (``measure_memory``), never
in a timed one: the last warm-up steps of a fresh build (``ddp.bench.rounds.rank_state.RankBench.prepare``),
once its plan has settled.

**The peak on CPU**, where no allocator counts it: the untimed steps run under PyTorch's
``MemTracker`` (``tracked_peak``), which follows every storage an operator returns and reports the
bytes of each of its categories at the moment the total peaked. What a rank held before is
registered with it first (the module, every optimizer's state, and the tensors the strategy
keeps: buckets, gathered units), and the peak is taken over two steps, so that a buffer it only
sees once an operator returns it (PyTorch's DDP's buckets) is counted in the second. It is the measured
figure a step's predicted peak (``ddp.bench.memory.predict``) is set beside; on CUDA that is the
allocator's ``max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ddp.bench.config.shape import ACCUMULATE


@dataclass(frozen=True)
class StateMemory:
    """One rank's training state, in bytes."""

    parameters_bytes: int
    gradients_bytes: int
    """Gradients held right after ``finish_gradient_synchronization()``."""
    optimizer_state_bytes: int
    tracked_peak_bytes: dict[str, int] | None = None
    """On CPU: ``MemTracker``'s peak by its category, and ``Total`` (``tracked_peak``); None on
    CUDA, and for a compiled model (the tracker does not follow compiled graphs)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor holds its shard


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer's state and in that of the optimizers it wraps."""
    for current in optimizers_within(optimizer):
        for state in current.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


class _GradientCounter:
    """A step observer (``ddp.bench.config.shape.StepObserver``'s shape) counting gradients after synchronization."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.gradients_bytes = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield
        if name == "gradient_sync":
            self.gradients_bytes = storage_bytes(p.grad for p in self.model.parameters())


TRACKER_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def optimizers_within(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer and every optimizer it wraps (a sharded optimizer steps an inner one)."""
    found, stack = [], [optimizer]
    while stack:
        current = stack.pop()
        if any(current is seen for seen in found):
            continue
        found.append(current)
        stack += [value for value in vars(current).values() if isinstance(value, torch.optim.Optimizer)]
    return found


# The tracker sees a storage that existed before it was entered only once an operator returns it
# (PyTorch's DDP's buckets, which its reducer copies the gradients into): the second step is
# tracked with every such storage known.
TRACKED_STEPS = 2


def strategy_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor a strategy object holds in its attributes, their lists, dicts and dataclasses
    (buckets, gathered units, copies), each once; what the tracker then counts as ``Other``."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.Tensor):
            found.setdefault(id(current), current)
        elif isinstance(current, (list, tuple, set)):
            stack += list(current)
        elif isinstance(current, dict):
            stack += list(current.values())
        elif isinstance(current, torch.nn.Module) or hasattr(current, "__dataclass_fields__"):
            stack += list(vars(current).values())
    return list(found.values())


@contextlib.contextmanager
def _module_hooks_removed_afterwards() -> Iterator[None]:
    """Remove, once the block is done, every gradient hook ``MemTracker``'s module tracker hung on
    the step's tensors. Its ``register_multi_grad_hook`` (mode ``all``, torch 2.11 to 2.13) keeps
    the hooked tensors' autograd nodes in the hook's own closure while the nodes hold the hook: a
    cycle through C++ that Python's collector cannot free, which kept the whole graph, and through
    it every parameter of the configuration, alive after the tracker was gone (``tests/test_release.py``
    found it). Removing the hooks breaks the cycle."""
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook
    handles = []

    def register_and_keep(*args, **kwargs):
        handles.append(register(*args, **kwargs))
        return handles[-1]

    # Process-wide while the block runs: a rank runs one step at a time, and no other tracker.
    mod_tracker.register_multi_grad_hook = register_and_keep
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        with contextlib.ExitStack() as removals:  # every handle removed, even if one raises
            for handle in handles:
                removals.callback(handle.remove)


class _FreshModuleStats:
    """A step observer (``ddp.bench.config.shape.StepObserver``'s shape) that clears ``MemTracker``'s
    per-module figures before every forward of the model, each micro-batch's (the tracker refuses
    a second forward of the root without it; its peak is kept), around ``observer``'s phases."""

    def __init__(self, tracker, observer=None) -> None:
        self.tracker = tracker
        self.observer = observer

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name in (ACCUMULATE, "forward"):  # a micro-batch's forward starts
            self.tracker.reset_mod_stats()
        with self.observer.phase(name) if self.observer is not None else contextlib.nullcontext():
            yield


def tracked_peak(trainer, observer=None) -> tuple[dict[str, int], list]:
    """Run ``TRACKED_STEPS`` untimed steps of ``trainer`` (each watched by ``observer``) under
    PyTorch's ``MemTracker`` and return its peak over them: the bytes of each of its categories
    (``TRACKER_CATEGORIES``) at the moment the total peaked, and ``Total`` (module docstring); and
    the steps' timings (``StepTiming``: they are warm-up steps too, ``RankBench.prepare``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    optimizers = optimizers_within(trainer.optimizer)
    known = {id(t) for t in (*trainer.model.parameters(), *trainer.model.buffers())}
    known |= {id(t) for o in optimizers for t in optimizer_state_tensors(o)}
    held = [t for t in strategy_tensors(trainer.model) if id(t) not in known]
    tracker.track_external(trainer.model, *optimizers, *held)
    del held  # the tracker follows them by weak reference: one the strategy replaces is freed as in a step
    with _module_hooks_removed_afterwards(), tracker:
        timings = [trainer.step(_FreshModuleStats(tracker, observer)) for _ in range(TRACKED_STEPS)]
    peak = tracker.get_tracker_snapshot("peak").get(trainer.device, {})
    return {str(getattr(key, "value", key)): int(value) for key, value in peak.items()}, timings


def measure_memory(trainer) -> tuple[StateMemory, list]:
    """Run an untimed step of ``trainer`` (a ``ddp.bench.rounds.trainer.Trainer``) and count its state; on
    CPU the steps of ``tracked_peak``, for the measured peak. Returns the count and the steps'
    timings (``StepTiming``)."""
    counter = _GradientCounter(trainer.model)
    peak = None
    if trainer.device.type == "cpu" and trainer.config.compile == "off":  # the tracker does not follow compiled graphs
        peak, timings = tracked_peak(trainer, counter)
    else:
        timings = [trainer.step(counter)]
    return StateMemory(
        parameters_bytes=storage_bytes(trainer.model.parameters()),
        gradients_bytes=counter.gradients_bytes,
        optimizer_state_bytes=storage_bytes(optimizer_state_tensors(trainer.optimizer)),
        tracked_peak_bytes=peak,
    ), timings
