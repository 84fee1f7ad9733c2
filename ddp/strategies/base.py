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

and through its declared ``sharding`` (``ddp.strategies.declarations.Sharding``): which state it
splits over the ranks, from which the memory a rank needs follows.

What the suite reads of a strategy beyond this interface (traits, cost schedule, buffers, units)
is declared beside its class, not in it: ``ddp.strategies.declarations``.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ddp.strategies.declarations import REPLICATED, declare_interface
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


# What the suite calls on any strategy, a user's own included.
REQUIRED_METHODS = ("forward", "finish_gradient_synchronization")


class Strategy(nn.Module, abc.ABC):
    """The interface of every strategy: wrap ``module``, ``forward``, ``finish_gradient_synchronization()``,
    optional ``no_sync()`` (a context manager under which backward accumulates gradients; a class
    without one cannot be asked to accumulate).

    Two figures the benchmarks record are optional: ``num_allreduce_calls_per_step`` (collectives
    one synchronizing step launches) and ``bucket_sizes_bytes`` (the bucket plan). None means the
    strategy does not know; the benchmark then counts the collectives it launches itself.

    **What a strategy says about itself** is declared beside the class (``declare``, in
    ``ddp.strategies.declarations``): it is all that the harness, the cost model, the plots and the
    report know of a strategy, and none of them names it.
    """

    module: nn.Module
    collective_recorder: CollectiveRecorder | None = None
    """Set on an instance while ``ddp profile`` records its collectives (``ddp.strategies.tracing``);
    strategies pass it to every ``launch_all_reduce``."""

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


# What a subclass of the interface is unless it declares otherwise: replicated, settled after one step.
declare_interface(Strategy, sharding=REPLICATED, steps_to_settle=1)


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

    def _unhook_gradients(self) -> None:
        """Remove every hook ``_hook_gradients`` hung (and nothing a subclass's ``close`` also releases)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def close(self) -> None:
        self._unhook_gradients()

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


declare_interface(DataParallel, accumulates_locally=True)  # its no_sync(): a backward inside communicates nothing
