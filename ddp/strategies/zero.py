"""PyTorch's ZeroRedundancyOptimizer (ZeRO-1) over PyTorch's DistributedDataParallel: the reference
for ``sharded_optimizer``.

``torch`` averages the gradients; ``torch.distributed.optim.ZeroRedundancyOptimizer`` keeps the
optimizer state of this rank's partition of the parameters only, steps it and broadcasts the
updated parameters. Memory per rank: 4 + 4 + 8/N bytes a parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp.strategies.bucketed import buckets_as_they_fill
from ddp.strategies.declarations import Sharding, Transfer, declare, kept_bucket_copy
from ddp.strategies.sharded_optimizer import parameters_gathered_after
from ddp.strategies.torch_ddp import TorchDDP


class ZeroDDP(TorchDDP):
    """``TorchDDP`` whose ``make_optimizer`` returns a ``ZeroRedundancyOptimizer``."""

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        # imported here: torch.distributed.optim takes seconds to import (it scripts its functional
        # optimizers), which every command would otherwise pay
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.module.parameters(), optimizer_class=optimizer_cls, process_group=self.process_group, **kwargs
        )


def buckets_then_broadcasts(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """PyTorch's DDP's buckets, then ZeroRedundancyOptimizer's broadcasts of the updated parameters."""
    buckets = buckets_as_they_fill(gradients, ready_seconds, backward_seconds, bucket_size_mb)
    return [*buckets, parameters_gathered_after(gradients, backward_seconds)]


# What the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    ZeroDDP,
    sharding=Sharding(optimizer_state=True),
    communicates=True,
    records_collectives=False,  # c10d's collectives, read from the profiler
    accumulates_locally=True,  # DistributedDataParallel.no_sync(); the broadcasts run in the optimizer's step
    # PyTorch's DDP averages the gradients: its buckets, their plan and the steps it needs to settle
    steps_to_settle=3,
    first_bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES,
    closes_bucket_after_cap=True,
    keeps_gradient_buckets=True,
    step_buffers=kept_bucket_copy,
    communication_schedule=buckets_then_broadcasts,
)
