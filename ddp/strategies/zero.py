"""PyTorch's ZeroRedundancyOptimizer (ZeRO-1) over PyTorch's DistributedDataParallel: the reference
for ``sharded_optimizer``.

``torch`` averages the gradients; ``torch.distributed.optim.ZeroRedundancyOptimizer`` keeps the
optimizer state of this rank's partition of the parameters only, steps it and broadcasts the
updated parameters. Memory per rank: 4 + 4 + 8/N bytes a parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ddp.strategies.base import Sharding
from ddp.strategies.torch_ddp import TorchDDP


class ZeroDDP(TorchDDP):
    """``TorchDDP`` whose ``make_optimizer`` returns a ``ZeroRedundancyOptimizer``."""

    sharding = Sharding(optimizer_state=True)

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(
            self.module.parameters(), optimizer_class=optimizer_cls, process_group=self.process_group, **kwargs
        )
