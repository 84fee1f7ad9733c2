"""What one training step does, declared once: its micro-batches, its tokens, its phases, which
backward overlaps communication, and what forward saves for backward.

A configuration's step (``StepConfig``) on one rank, as ``ddp.bench.rounds.trainer.Trainer`` runs it:

1. phase ``accumulate`` (only when ``grad_accum`` > 1): ``grad_accum - 1`` micro-batches, each
   forward, loss and backward, under the strategy's ``no_sync()``: gradients accumulate on the
   rank and nothing is communicated;
2. phases ``forward`` and ``backward``: the last micro-batch; its backward is the one that
   communicates, so the only one whose communication can overlap computation;
3. ``gradient_sync``: ``finish_gradient_synchronization()``;
4. ``optimizer``: AdamW's step and ``zero_grad(set_to_none=True)``.

Each micro-batch holds ``batch_size`` samples of ``seq_len`` tokens: a rank trains
``grad_accum * batch_size * seq_len`` tokens a step. Each micro-batch's loss is divided by
``grad_accum`` (nothing is divided at 1), so that the accumulated gradient is the mean over the
step's samples, as one process training the whole batch has it with a loss that averages over its
samples (the language model's cross-entropy, ``F.mse_loss``).

**Activation checkpointing** (``activation_checkpointing``): ``none``, forward saves what autograd
saves; ``blocks``, each of the model's repeated blocks (``repeated_blocks``: the children of its
largest ``nn.ModuleList``, the LM's transformer blocks) runs under ``torch.utils.checkpoint``
(non-reentrant, the variant PyTorch recommends and torchtitan uses): forward saves each block's
inputs only, and backward runs the block's forward again before the block's own backward. The
parameters' names do not change (the block's ``forward`` is wrapped in place, no wrapper module),
so strategies, sharding units and saved parameters see the same model. Model FLOPs, MFU's numerator,
do not count the recomputation (PaLM's definition, ``ddp.bench.results.flops``); the compute the cost model
schedules does (``backward_share``).

**On CUDA and NCCL** the shape is the same: ``no_sync()`` keeps NCCL's collectives out of the
accumulating backwards as it keeps gloo's (PyTorch's reducer and the hand-written strategies decide
at forward time, ``ddp.strategies.base.DataParallel``), and checkpointing recomputes on the compute
stream, so the last backward's kernels run longer and its gradients' collectives start later.

**Who can run which shape** (``cannot_run``), decided in the parent before anything is built, by
what a strategy declares, never by its name: accumulation needs ``accumulates_locally`` (a
``no_sync()`` that communicates nothing: not ``fsdp`` and ``torch_fsdp``, which reduce-scatter in
every backward, nor a user's class that does not say); checkpointing needs a model with repeated
blocks.

Every consumer reads the shape here instead of re-enacting the step: the trainer's loop
(``micro_batches``, ``scaled``), the recorder of phases (``phases``, ``RecordedStep``), the record's
tokens and FLOPs (``tokens_per_step``), the memory prediction (gradients held across micro-batches,
the trace made with the checkpointing applied), the cost model (compute per micro-batch, overlap in
the last backward only) and the correctness references.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn

# The phases of a step's synchronizing micro-batch and after it, in order; a profile's steps and
# the traced steps name them so.
PHASES = ("forward", "backward", "gradient_sync", "optimizer")
ACCUMULATE = "accumulate"
"""The phase of the micro-batches before the last, under ``no_sync()`` (absent at ``grad_accum`` 1)."""
ALL_PHASES = (ACCUMULATE, *PHASES)
ACTIVATION_CHECKPOINTING = ("none", "blocks")


@dataclass(frozen=True)
class StepShape:
    """The shape of one configuration's step on one rank (module docstring)."""

    micro_batch_size: int
    """Samples (sequences) of one micro-batch: ``StepConfig.batch_size``."""
    seq_len: int
    """Tokens per sample (the built-in LM's; other workloads ignore it but count by it)."""
    micro_batches: int = 1
    """Micro-batches a step: ``StepConfig.grad_accum``."""
    activation_checkpointing: str = "none"
    """``none`` or ``blocks`` (module docstring)."""

    @classmethod
    def of(cls, config) -> StepShape:
        """The shape of a ``ddp.bench.config.step_config.StepConfig``."""
        return cls(config.batch_size, config.seq_len, config.grad_accum, config.activation_checkpointing)

    # ----------------------------------------------------------------------- counts

    @property
    def samples_per_step(self) -> int:
        """Samples one rank trains in a step, over its micro-batches."""
        return self.micro_batches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank trains in a step: micro-batches x batch x sequence length."""
        return self.samples_per_step * self.seq_len

    @property
    def loss_scale(self) -> float | None:
        """What each micro-batch's loss is multiplied by, ``1 / micro_batches``; None at 1 (the loss as it is)."""
        return None if self.micro_batches == 1 else 1.0 / self.micro_batches

    # ----------------------------------------------------------------------- phases

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases of this step, in order (``accumulate`` first where there is more than one micro-batch)."""
        return ALL_PHASES if self.micro_batches > 1 else PHASES

    @property
    def recomputes_forward(self) -> bool:
        """Whether backward runs forward's computation again (checkpointed blocks)."""
        return self.activation_checkpointing == "blocks"

    @property
    def backward_share(self) -> float:
        """Backward's share of one micro-batch's forward and backward compute: 2/3 (backward does
        two matmuls per forward matmul, for the input's gradient and the weight's), 3/4 where it
        recomputes forward first."""
        backward = 2.0 + (1.0 if self.recomputes_forward else 0.0)
        return backward / (1.0 + backward)

    # ----------------------------------------------------------------------- the loop

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as its backward takes it (``loss_scale``)."""
        return loss if self.loss_scale is None else loss * self.loss_scale

    def prepare(self, module: nn.Module) -> None:
        """Apply the activation policy to ``module`` in place, before a strategy wraps it;
        ``ValueError`` saying what to expose where the model has no repeated blocks."""
        if self.recomputes_forward:
            checkpoint_blocks(module)


class StepObserver:
    """What a tool attaches to the step: ``phase(name)`` wraps each of the step's phases
    (``StepShape.phases``), once a step, and ``accumulate`` once per micro-batch
    before the last. The default does nothing."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


NO_OBSERVER = StepObserver()


@dataclass
class RecordedStep:
    """One training step as a rank recorded it (``ddp.bench.collectives.recording``), every time in
    seconds on one clock: ``time.perf_counter``'s where recorded, the GPU's where its phases and
    collectives were read from a CUDA trace (``ddp.bench.collectives.timeline.read_recorded``)."""

    phases: dict[str, list[float]]
    """``[start, end]`` of each phase the step's shape declares (``StepShape.phases``), in its order;
    a phase entered again in the step (``accumulate``) spans its first start to its last end."""
    backward_compute_end: float
    """When backward computed its last gradient (``BackwardComputeEnd``)."""
    collectives: list[dict] = field(default_factory=list)
    """Each collective's ``label``, ``size_bytes``, ``ready_seconds``, ``launch_seconds`` and
    ``done_seconds`` (``ddp.strategies.tracing.CollectiveSpan``'s fields), from ``comm_source``."""
    comm_source: str | None = None
    """Where the collectives' times came from (``ddp.bench.collectives.reading``'s ``COMM_FROM_*``);
    None: the strategy's own records, as recorded."""
    collective_records: list[dict] | None = None
    """The strategy's own records, kept where ``collectives`` took their times from NCCL's kernels."""
    unpaired: bool = False
    """The profiler's c10d calls and gloo's work could not be paired: ``collectives`` is empty."""
    timeline: dict | None = None
    """The partition of its window (``ddp.bench.collectives.timeline``), once read."""

    @property
    def span(self) -> tuple[float, float]:
        """``(start, end)``: from its first phase's start to the optimizer's end."""
        first = self.phases[ACCUMULATE] if ACCUMULATE in self.phases else self.phases["forward"]
        return first[0], self.phases["optimizer"][1]

    @property
    def seconds(self) -> float:
        start, end = self.span
        return end - start

    @property
    def launched(self) -> list[dict]:
        """What the strategy launched (its records), whatever gave the collectives' times."""
        return self.collectives if self.collective_records is None else self.collective_records


# --------------------------------------------------------------------------- activation checkpointing


def repeated_blocks(module: nn.Module) -> nn.ModuleList | None:
    """The model's repeated blocks: its largest non-empty ``nn.ModuleList`` (the LM's
    ``blocks``), or None where it has none. What checkpointing and ``--compile on`` apply to one by one."""
    lists = [child for child in module.modules() if isinstance(child, nn.ModuleList) and len(child) > 0]
    return max(lists, key=len, default=None)


NO_BLOCKS = ("has no repeated blocks to checkpoint: keep them in an nn.ModuleList attribute of the model "
             "(as ddp.model keeps its transformer blocks), or run it with --activation-checkpointing none")


def checkpoint_blocks(module: nn.Module) -> None:
    """Run each of ``repeated_blocks(module)`` under non-reentrant ``torch.utils.checkpoint``, its
    ``forward`` wrapped in place (parameter names unchanged); ``ValueError`` (``NO_BLOCKS``)
    where there are none. A block's forward hooks (a strategy's) run once, in forward; the
    recomputation in backward calls the wrapped ``forward`` alone."""
    blocks = repeated_blocks(module)
    if blocks is None:
        raise ValueError(f"the model {NO_BLOCKS}")
    for block in blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)


# --------------------------------------------------------------------------- who can run a shape


def cannot_run(config) -> str | None:
    """Why ``config``'s step cannot run with its strategy and model, in one line saying what to do;
    None where it can (module docstring). Asked in the parent, before any rank builds it."""
    from ddp.bench.config.workloads import meta_module  # the model's structure, nothing allocated
    from ddp.strategies.registry import traits

    shape = StepShape.of(config)
    if shape.micro_batches > 1 and not traits(config.strategy).accumulates_locally:
        return (f"{config.strategy} cannot accumulate gradients without communicating (its class does not declare "
                f"accumulates_locally = True: a no_sync() that skips every collective), so --grad-accum "
                f"{shape.micro_batches} would time its communication {shape.micro_batches} times a step: "
                "run it with --grad-accum 1")
    if shape.recomputes_forward and repeated_blocks(meta_module(config.model, config.batch_size, config.seq_len)) is None:
        return f"model {config.model} {NO_BLOCKS}"
    return None
