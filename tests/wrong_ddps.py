"""DDP classes with one known mistake each, for testing that the correctness suite names it.

``SimpleDDP`` is a correct DDP in few lines: it broadcasts from rank 0, skips frozen parameters,
all-reduces each used gradient with AVG, and leaves None where no rank used a parameter. Each
wrong class below changes one of its methods to make one common mistake. The test that
``SimpleDDP`` itself passes is what shows that each failure comes from that one change.
The classes live at module level so that ``make_ddp`` can load them by import path, like a
user's class: "tests.wrong_ddps:SumsInsteadOfAverages".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class SimpleDDP(nn.Module):
    """Correct: after backward, all-reduce (AVG) each gradient that some rank produced."""

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self._require_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward time, as torch's DDP does
        self.broadcast_from_rank0()

    @torch.no_grad()
    def broadcast_from_rank0(self) -> None:
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            dist.broadcast(tensor, src=0, group=self.process_group)

    def parameters_to_sync(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        self._sync_this_backward = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        params = self.parameters_to_sync()
        # A parameter can be used on some ranks only. Every rank must join the same all-reduces,
        # so they first agree on which parameters got a gradient on any rank.
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        if dist.get_backend(self.process_group) != "gloo" and params:
            used = used.to(params[0].device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group)
        for param, used_somewhere in zip(params, used.tolist()):
            if used_somewhere:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self.reduce(param.grad)

    def reduce(self, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=self.process_group)


class SumsInsteadOfAverages(SimpleDDP):
    """All-reduces with SUM and never divides: gradients world-size times too large."""

    def reduce(self, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)


class NoBroadcast(SimpleDDP):
    """Never broadcasts: each rank keeps the parameters it started with."""

    def broadcast_from_rank0(self) -> None:
        pass


class ReducesTiedTwice(SimpleDDP):
    """Sums the gradient once for each parameter name, then divides each tensor once.

    A tied weight has two names, so it is summed twice: once would be right. (Averaging twice
    would hide the mistake, because an average of equal values is that value.)
    """

    def parameters_to_sync(self) -> list[nn.Parameter]:
        return [p for _, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad]

    def reduce(self, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        if self._sync_this_backward:
            world_size = dist.get_world_size(self.process_group)
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.div_(world_size)


class ChangesFrozen(SimpleDDP):
    """Synchronizes every parameter, frozen ones included, with zeros where there is no gradient."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        for param in self.module.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.reduce(param.grad)


class ZerosForUnused(SimpleDDP):
    """Skips the used-mask: a parameter that no rank used gets a zero gradient instead of None."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        for param in self.parameters_to_sync():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.reduce(param.grad)


class NeverSynchronizes(SimpleDDP):
    """Broadcasts at construction but never all-reduces: each rank keeps its own gradient."""

    def finish_gradient_synchronization(self) -> None:
        pass


class PerParameterDDP(nn.Module):
    """The textbook per-parameter DDP, written apart from ``SimpleDDP`` as a student writes it:
    broadcast at construction, a ``register_post_accumulate_grad_hook`` on every trainable
    parameter that launches an async all-reduce (SUM, then divided by the world size) of its
    gradient as soon as backward has accumulated it, and a wait for every handle in
    ``finish_gradient_synchronization``. It does nothing about unused parameters: a parameter that
    this rank's forward did not use gets no hook call, so this rank launches fewer all-reduces
    than a rank that used it, and the ranks' collectives no longer match. Every other case trains
    like one process."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self._handles: list[tuple[dist.Work, torch.Tensor]] = []
        self._sync = True
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_gradient)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._sync:
            self._handles.append((dist.all_reduce(param.grad, async_op=True), param.grad))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self._handles:
            handle.wait()
            grad.div_(self.world_size)
        self._handles.clear()


class ExtraCollectiveOnRankZero(SimpleDDP):
    """Correct gradients, but rank 0 issues one collective more than the others (a barrier after
    synchronizing): the ranks' collectives differ in count, with every parameter used everywhere."""

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        if dist.get_rank(self.process_group) == 0:
            dist.barrier(group=self.process_group)
