"""A user's own model and DDP class, as ddp-bench takes them:

    pytest correctness_tests --strategies examples.toy:AveragingDDP
    pytest perf_tests --model examples.toy:build --strategies local,bucketed,examples.toy:AveragingDDP

``build`` follows the contract of ``ddp.bench.config.workloads``; ``AveragingDDP`` has only what the suite
requires (a constructor taking the module, ``forward``, ``finish_gradient_synchronization()`` and
``.module``): no ``no_sync`` (the accumulation cases are skipped, saying so), no ``bucket_size_mb``
and no figures of its own (the perf suite counts the collectives it launches).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ResidualMLP(nn.Module):
    """A small residual MLP classifier over feature vectors."""

    def __init__(self, features: int = 256, hidden: int = 512, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def build(batch_size: int, seq_len: int):
    """The model, one rank's batch for one step, and the loss (``seq_len`` is not used)."""
    model = ResidualMLP()

    def batch(generator: torch.Generator):
        return torch.randn(batch_size, 256, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)

    return model, batch, F.cross_entropy


class AveragingDDP(nn.Module):
    """A correct minimal DDP: broadcast from rank 0, then average every gradient after backward.

    A parameter may get a gradient on some ranks only (a routed layer): the ranks first agree,
    with a MAX all-reduce of which ones got one, so that every rank joins the same all-reduces;
    ranks without that gradient send zeros, and one that no rank used keeps None."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        device = params[0].device if dist.get_backend() != "gloo" else torch.device("cpu")
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        for param, used_somewhere in zip(params, used.tolist()):
            if not used_somewhere:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
