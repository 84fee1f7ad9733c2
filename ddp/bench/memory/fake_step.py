"""What a workload's step holds besides its training state, traced with nothing allocated.

One forward, loss and backward of the workload run on fake tensors (``FakeTensorMode``: meta
storage with a device, so the CPU's autocast applies and nothing is allocated), under a dispatch
mode that follows every storage an operator returns until it is freed, as PyTorch's ``MemTracker``
does on real tensors, and sorts it the way that tracker does:

- ``activations``: made in forward or by the loss (what backward saves, and the loss's own
  tensors), freed as backward consumes them;
- ``temporaries``: made in backward (the gradients of activations, an operator's scratch
  outputs), except
- ``gradients``: a parameter's gradient, from the moment autograd accumulates it.

Every sample is taken after an operator returns, so an operator's scratch memory inside a kernel
is not seen (nor is it by ``MemTracker``). Two things a trace on fake tensors would get wrong are
set right here:

- attention: on fake (meta) tensors ``scaled_dot_product_attention`` would pick its math kernel,
  which saves the (B, heads, T, T) probabilities; on a CPU or a GPU it picks a fused (flash) kernel
  that saves only its output and a log-sum-exp per row. The trace asks for the fused kernel
  (``_fused_sdp_choice`` answered ``FLASH``), as the real step gets.
- shape: everything an LM saves grows with the batch, so the prediction traces batch 1 and 2
  and extends the line (``FakeStep.at_batch``, ``ddp.bench.memory.predict.fake_step_of``); the suite's tests
  check the line against a trace at the batch itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddp.bench.config.shape import StepShape
from ddp.bench.config.values import forward_autocast  # the step's own autocast, defined once
from ddp.bench.config.workloads import meta_workload, rank_batches

CATEGORIES = ("activations", "temporaries", "gradients")
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


@dataclass(frozen=True)
class Sample:
    """Bytes held at one moment of the traced step, by category (module docstring)."""

    activations: int
    temporaries: int
    gradients: int

    @property
    def total(self) -> int:
        return self.activations + self.temporaries + self.gradients

    def scaled(self, factor: float, base: Sample) -> Sample:
        """``base`` + ``factor`` x (self - base), category by category: a line through two traces."""
        return Sample(*(round(b + factor * (s - b)) for s, b in zip(self.as_tuple(), base.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, int, int]:
        return self.activations, self.temporaries, self.gradients


@dataclass(frozen=True)
class FakeStep:
    """One step of a workload traced: the peak of forward and loss, and backward moment by moment."""

    forward_peak: Sample
    """The most forward and the loss held at once (activations only)."""
    backward: tuple[Sample, ...]
    """After each operator of backward: the activations still saved, the temporaries, and the
    gradients accumulated so far (their whole size once backward ends)."""

    def at_batch(self, other: FakeStep, factor: float) -> FakeStep:
        """The trace on the line through ``other`` (factor 0) and this one (factor 1), at ``factor``."""
        if len(self.backward) != len(other.backward):
            raise ValueError("the two traces ran different operators: they are not one workload at two batches")
        return FakeStep(
            self.forward_peak.scaled(factor, other.forward_peak),
            tuple(s.scaled(factor, o) for s, o in zip(self.backward, other.backward, strict=True)),
        )


class _StorageTracker(TorchDispatchMode):
    """Follows every storage an operator returns until it is freed, by category."""

    def __init__(self) -> None:
        super().__init__()
        self.held = dict.fromkeys(CATEGORIES, 0)
        self.category: dict[int, str] = {}  # storage key -> category
        self.size: dict[int, int] = {}
        self.finalizers: dict[int, weakref.ref] = {}
        self.phase = "activations"
        self.samples: list[Sample] = []
        self.forward_peak = Sample(0, 0, 0)
        self.ignored: set[int] = set()

    def ignore(self, tensors) -> None:
        """Storages held before the trace (parameters, the batch): not counted."""
        for tensor in tensors:
            self.ignored.add(_key(tensor))

    def _freed(self, key: int) -> None:
        category = self.category.pop(key, None)
        if category is not None:
            self.held[category] -= self.size.pop(key)
            self.finalizers.pop(key, None)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = _key(tensor)
        if key in self.category or key in self.ignored:
            return
        self.category[key] = self.phase
        self.size[key] = storage.nbytes()
        self.held[self.phase] += storage.nbytes()
        self.finalizers[key] = weakref.ref(storage, lambda _ref, key=key: self._freed(key))

    def regrade(self, tensor: torch.Tensor, category: str) -> None:
        """Count ``tensor``'s storage as ``category`` from now on (a gradient once accumulated)."""
        key = _key(tensor)
        if key not in self.category:
            self._track(tensor)
        old = self.category[key]
        self.held[old] -= self.size[key]
        self.held[category] += self.size[key]
        self.category[key] = category

    def sample(self) -> Sample:
        return Sample(self.held["activations"], self.held["temporaries"], self.held["gradients"])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._fused_sdp_choice.default:
            return _FLASH  # what a CPU or GPU picks; meta would pick math (module docstring)
        out = func(*args, **(kwargs or {}))
        made = [tensor for tensor in tree_flatten(out)[0] if isinstance(tensor, torch.Tensor)]
        if not made:
            # A query (autograd asks each tensor's device, two thirds of the operators seen): it
            # allocates nothing, and what was freed since the last sample is no peak; the next
            # operator's sample holds it, and the sequence stays the same at every batch.
            return out
        for tensor in made:
            self._track(tensor)
        now = self.sample()
        if self.phase == "activations":
            if now.total > self.forward_peak.total:
                self.forward_peak = now
        else:
            self.samples.append(now)
        return out


def _key(tensor: torch.Tensor) -> int:
    return torch.multiprocessing.reductions.StorageWeakRef(tensor.untyped_storage()).cdata


def run_fake_step(model: str, batch_size: int, seq_len: int, precision: str, activation_checkpointing: str = "none",
                  parameter_dtype: torch.dtype | None = None) -> FakeStep:
    """Run one forward, loss and backward of ``model`` at ``batch_size`` x ``seq_len`` in
    ``precision`` (``fp32``/``tf32`` or ``bf16`` autocast), on fake tensors, its blocks
    checkpointed where ``activation_checkpointing`` is ``blocks`` (``ddp.bench.config.shape``): the
    recomputed forward's tensors are made in backward, so they count as its temporaries.
    ``parameter_dtype``: the floating parameters in that dtype, as an FSDP strategy with a compute
    dtype gathers them (autocast then casts none of them, and their gradients are in it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    workload = meta_workload(model, batch_size, seq_len)  # shapes only; its own, as to_empty changes it below
    [(inputs, targets)] = rank_batches(workload, 0, 0, 1, "cpu")  # real and small: token ids or a few samples
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the meta module is only read for shapes
    with fake:
        module = workload.module.to_empty(device="cpu")  # fake CPU tensors: the CPU's autocast applies
        if parameter_dtype is not None:
            for param in module.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(parameter_dtype)
    StepShape(batch_size, seq_len, activation_checkpointing=activation_checkpointing).prepare(module)
    inputs, targets = fake.from_tensor(inputs), fake.from_tensor(targets)
    params = [p for p in module.parameters() if p.requires_grad]
    tracker = _StorageTracker()
    with fake, tracker:
        tracker.ignore([*module.parameters(), *module.buffers(), inputs, targets])
        with forward_autocast(precision, torch.device("cpu")):
            loss = workload.loss(module(inputs), targets)
        tracker.phase = "temporaries"
        handles = [p.register_post_accumulate_grad_hook(lambda p: tracker.regrade(p.grad, "gradients")) for p in params]
        try:
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        del loss
        end = tracker.sample()
    return FakeStep(tracker.forward_peak, (*tracker.samples, end))

