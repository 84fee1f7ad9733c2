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

Counting visits every parameter, so it runs in its own untimed step (``measure_memory``), never
in a timed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateMemory:
    """One rank's training state, in bytes."""

    parameters_bytes: int
    gradients_bytes: int
    """Gradients held right after ``finish_gradient_synchronization()``."""
    optimizer_state_bytes: int


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
    optimizers, stack = [], [optimizer]
    while stack:
        current = stack.pop()
        if any(current is seen for seen in optimizers):
            continue
        optimizers.append(current)
        stack += [value for value in vars(current).values() if isinstance(value, torch.optim.Optimizer)]
    for current in optimizers:
        for state in current.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


class _GradientCounter:
    """A step observer (``ddp.bench.trainer.StepObserver``'s shape) counting gradients after synchronization."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.gradients_bytes = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield
        if name == "gradient_sync":
            self.gradients_bytes = storage_bytes(p.grad for p in self.model.parameters())


def measure_memory(trainer) -> StateMemory:
    """Run one untimed step of ``trainer`` (a ``ddp.bench.trainer.Trainer``) and count its state."""
    counter = _GradientCounter(trainer.model)
    trainer.step(counter)
    return StateMemory(
        parameters_bytes=storage_bytes(trainer.model.parameters()),
        gradients_bytes=counter.gradients_bytes,
        optimizer_state_bytes=storage_bytes(optimizer_state_tensors(trainer.optimizer)),
    )
