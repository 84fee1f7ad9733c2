"""No data parallelism: each rank trains alone. The floor that every strategy's overhead is
measured against; not a DDP (ranks drift apart), so it is not in the correctness tests."""

from __future__ import annotations

import contextlib

from torch import nn

from ddp.base import trainable_parameters


class LocalTraining(nn.Module):
    """The same interface as the strategies, communicating nothing at all."""

    num_allreduce_calls_per_step = 0

    def __init__(self, module: nn.Module, *, process_group=None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.parameters_to_sync = trainable_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize."""
