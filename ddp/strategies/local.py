"""No data parallelism: each rank trains alone. The floor that every strategy's overhead is
measured against; not a DDP (ranks drift apart), so it is not in the correctness tests.

``local_mixed`` is the floor of a strategy that computes in its own dtype (FSDP's mixed precision,
``compute_dtype``): fp32 master weights the optimizer steps, a copy of them in ``compute_dtype``
that forward and backward compute with, the gradients cast back onto the masters; the same recipe
as ``fsdp`` with the sharding and the communication taken out, so that the overhead of an FSDP
step over it is sharding and communication, not a difference of recipe (``local`` under autocast
keeps fp32 weights and casts at each matmul)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ddp.strategies.base import Strategy, trainable_parameters
from ddp.strategies.declarations import REPLICATED, MemoryPlan, StepBuffers, declarations, declare, no_step_buffers, nothing_sent
from ddp.strategies.fsdp import check_compute_dtype, forward_in


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


class LocalMixedPrecision(LocalTraining):
    """``LocalTraining`` that computes in ``compute_dtype`` over fp32 masters, as ``fsdp`` does
    (module docstring); without one, ``LocalTraining`` itself. The trainable parameters leave the
    module for ``masters`` (what the optimizer steps; tied weights stay one); each forward points
    the module's names at the masters cast to ``compute_dtype`` (differentiable: backward casts
    the gradients back onto the masters), kept until the next forward, so that a checkpointed
    block recomputed in backward computes with the same weights. On CUDA each cast is a kernel on
    the current stream before forward's first, as ``fsdp`` casts each gathered shard; the copies
    are device memory held from one forward to the next (``mixed_precision_copies``)."""

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | str | None = None, process_group=None) -> None:
        super().__init__(module, process_group=process_group)
        self.compute_dtype = check_compute_dtype(compute_dtype)
        self._trained = dict(module.named_parameters())  # by name, before they leave the module
        self._slots: list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = []
        if self.compute_dtype is None:
            return
        slots: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
        for child in module.modules():
            for attribute, param in child._parameters.items():
                if param is not None and param.requires_grad:
                    slots.setdefault(id(param), (param, []))[1].append((child, attribute))
        self._slots = list(slots.values())
        self.masters = nn.ParameterList([param for param, _ in self._slots])
        for _, places in self._slots:  # the module's names become plain attributes, set each forward
            for child, attribute in places:
                del child._parameters[attribute]
        with torch.no_grad():
            self._point_at_copies()

    def _point_at_copies(self) -> None:
        for master, places in self._slots:
            weight = master.to(self.compute_dtype)
            for child, attribute in places:
                setattr(child, attribute, weight)

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            self._point_at_copies()
        return forward_in(self.compute_dtype, self.module, *args, **kwargs)

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        return {name: param.detach() for name, param in self._trained.items()}

    def close(self) -> None:
        """Put the masters back as the module's parameters, the copies gone: the module as built."""
        super().close()
        for master, places in self._slots:
            for child, attribute in places:
                delattr(child, attribute)
                child._parameters[attribute] = master
        self._slots = []


def mixed_precision_copies(plan: MemoryPlan) -> StepBuffers:
    """The masters' copy in the compute dtype, held from one forward to the next; none without one."""
    if not plan.computes_in_another_dtype:
        return StepBuffers()
    return StepBuffers(kept_bytes=plan.gathered(plan.gradient_bytes))


# What the harness and the report read of them (ddp.strategies.declarations).
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
declare(LocalMixedPrecision, **declarations(LocalTraining, step_buffers=mixed_precision_copies, line_style="-."))
