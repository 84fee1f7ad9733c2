"""Naive data parallelism: after backward, all-reduce every parameter's gradient, one at a time.

The baseline every other strategy improves on: one blocking collective per parameter tensor and
no overlap with the backward pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp.strategies.base import DataParallel
from ddp.strategies.declarations import REPLICATED, Transfer, declare, no_step_buffers
from ddp.strategies.tracing import launch_all_reduce, ready_stamp


class NaiveDDP(DataParallel):
    """All-reduce each gradient after backward (``finish_gradient_synchronization``)."""

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return len(self.parameters_to_sync) + 1  # one per parameter, plus the used-mask

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        params = self.parameters_to_sync
        ready = ready_stamp(self.collective_recorder)  # every gradient is in: backward is over
        # Ranks must agree on which parameters to reduce, or their collectives would not pair up.
        self._all_reduce_used_mask([p.grad is not None for p in params]).wait()
        op = dist.ReduceOp.AVG  # the division by world size folded into the collective
        for index, (param, used_somewhere) in enumerate(zip(params, self.used_somewhere())):
            if not used_somewhere:
                continue  # no rank produced a gradient: leave it as single-process training would
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            launch_all_reduce(param.grad, op, self.process_group, f"param{index}", self.collective_recorder,
                              ready).wait()


def after_backward_one_by_one(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """After backward, one all-reduce per parameter, one after the other (the used mask's few
    bytes are left out)."""
    return [Transfer(backward_seconds, g.size_bytes) for g in gradients]


# What the harness, the report and the cost model read of it (ddp.strategies.declarations).
declare(
    NaiveDDP,
    sharding=REPLICATED,
    communicates=True,
    accumulates_locally=True,  # DataParallel.no_sync(): a backward inside it launches nothing
    steps_to_settle=1,
    step_buffers=no_step_buffers,  # all-reduces each gradient in place
    records_collectives=True,  # every gradient collective through launch_all_reduce
    reference_in_reports=True,  # the baseline the report measures the fastest strategy against
    communication_schedule=after_backward_one_by_one,
)
