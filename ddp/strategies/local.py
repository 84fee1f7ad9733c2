"""No data parallelism: each rank trains alone. The floor that every strategy's overhead is
measured against; not a DDP (ranks drift apart), so it is not in the correctness tests."""

from __future__ import annotations

import contextlib

from torch import nn

from ddp.strategies.base import Strategy, trainable_parameters
from ddp.strategies.declarations import REPLICATED, declare, no_step_buffers, nothing_sent


class LocalTraining(Strategy):
    """The same interface as the strategies, communicating nothing at all."""

    def __init__(self, module: nn.Module, *, process_group=None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.parameters_to_sync = trainable_parameters(module)

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return 0

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Nothing to skip: backward accumulates gradients as it always does."""
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize."""


# What the harness and the report read of it (ddp.strategies.declarations).
declare(
    LocalTraining,
    sharding=REPLICATED,
    communicates=False,
    records_collectives=False,
    steps_to_settle=1,
    step_buffers=no_step_buffers,
    communication_schedule=nothing_sent,
    accumulates_locally=True,  # it never communicates
    line_style=":",  # drawn as the floor under the others
)
