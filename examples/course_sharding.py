"""A sharded optimizer and an FSDP written the way a course's test adapters ask for them, from
scratch (no ddp-bench code), to show that such classes run through the suite as they are:

    pytest correctness_tests --strategies examples.course_sharding:ShardedOptimizer,examples.course_sharding:FSDP
    pytest perf_tests --strategies local,bucketed,examples.course_sharding:FSDP --model tiny ...

``ShardedOptimizer(params, optimizer_cls, **kwargs)`` is a ``torch.optim.Optimizer``: ddp-bench sees
that and runs it as a strategy whose gradients ``bucketed`` averages. ``FSDP(module,
compute_dtype=None)`` is a module with ``finish_gradient_synchronization()`` (the hook after
backward) and ``gather_full_params()`` (the whole parameters by name). Both use the default group.

They are deliberately simple: the optimizer assigns parameters to ranks round-robin; the FSDP
shards each parameter on its own, gathers all of them before forward and keeps them until the
gradients are reduce-scattered (so it saves memory between steps, not during one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner: dict[nn.Parameter, int] = {}
        self.inner = None
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            self.owner[param] = len(self.owner) % self.world_size
        mine = [p for p in group["params"] if self.owner[p] == self.rank]
        if mine:
            options = {k: v for k, v in group.items() if k != "params"}
            if self.inner is None:
                self.inner = self.optimizer_cls([{"params": mine, **options}], **self.kwargs)
            else:
                self.inner.add_param_group({"params": mine, **options})

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure) if self.inner is not None else None
        for param, owner in self.owner.items():
            dist.broadcast(param.data, src=owner)
        return loss


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module, self.compute_dtype = module, compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor, src=0)
        self.names = [name for name, _ in module.named_parameters()]
        self.sharded = [p for p in module.parameters() if p.requires_grad]
        self.shards = nn.ParameterList()
        self.shapes = []
        for param in self.sharded:
            flat = param.detach().reshape(-1)
            padded = F.pad(flat, (0, -flat.numel() % self.world_size))
            self.shards.append(nn.Parameter(padded.chunk(self.world_size)[self.rank].clone()))
            self.shapes.append(param.shape)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # freed until forward
            param.requires_grad_(True)

    def _gather(self, shard: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        full = torch.empty(shard.numel() * self.world_size, dtype=dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.detach().to(dtype))
        return full[: shape.numel()].view(shape)

    def forward(self, *args, **kwargs):
        dtype = self.compute_dtype
        for param, shard, shape in zip(self.sharded, self.shards, self.shapes):
            param.data = self._gather(shard, shape, dtype or shard.dtype)
        if dtype is not None:
            args = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            output = self.module(*args, **kwargs)
            return output.float() if output.is_floating_point() else output
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        for param, shard in zip(self.sharded, self.shards):
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            flat = F.pad(grad.reshape(-1).float(), (0, shard.numel() * self.world_size - grad.numel()))
            piece = torch.empty_like(shard)
            dist.reduce_scatter_tensor(piece, flat / self.world_size)
            shard.grad = piece if shard.grad is None else shard.grad + piece
            param.grad = None
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        full = {id(p): self._gather(s, shape, s.dtype) for p, s, shape in zip(self.sharded, self.shards, self.shapes)}
        own = dict(self.module.named_parameters())
        return {name: full.get(id(own[name]), own[name].detach()) for name in self.names}
