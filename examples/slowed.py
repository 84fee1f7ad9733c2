"""Strategies made slower on purpose, by a known share of their own step and in a chosen place:
the slowdowns that the regression gate's power study injects (perf_tests/power_study.py,
docs/regression-gate.md), usable with any grid::

    DDP_BENCH_SLOWDOWN=0.15 DDP_BENCH_SLOWDOWN_AT=backward \\
        pytest perf_tests/test_step.py --strategies local,examples.slowed:SlowedBucketed --warmup-rounds 23 ...

``SlowedBucketed`` is ``bucketed`` (and ``Slowed`` makes any strategy class slow the same way:
mix it in and declare the class as its parent, with the steps its calibration needs, as
``SlowedBucketed`` is declared below).
``DDP_BENCH_SLOWDOWN`` is a fraction f of the configuration's *median step*; unset or 0, nothing
is slowed and no hook is hung. The wait keeps the core busy, as slower code does: a sleep let the
core idle, and on a 2-core machine the steps after it ran slower too, ``local`` twins included
(x1.10 to x1.18 where a busy wait moved them x0.97 to x1.04; docs/regression-gate.md), which hid
the slowdown from the paired ratio. ``DDP_BENCH_SLOWDOWN_AT`` says where the wait of f x median falls:

- ``sync`` (default): after ``finish_gradient_synchronization()`` returned: a wait that hides
  nothing (waiting before it would overlap all-reduces still in flight).
- ``forward``: at the start of the strategy's forward, before the model runs.
- ``backward``: at the start of backward, in an autograd Function on the model's output: the
  gradients, and the all-reduces they launch, come that much later.
- ``optimizer``: after the optimizer's step, in a hook that PyTorch calls for every optimizer
  (``torch.optim.optimizer.register_optimizer_step_post_hook``; the strategy does not own the
  optimizer, the harness builds AdamW) and that acts only on the optimizer of this strategy's
  parameters.
- ``machine``: every configuration on the rank alike, ``local`` twins included: after each
  optimizer step of any configuration, a wait of f times *that* configuration's median step. This
  is a uniformly slower machine, which the gate must not blame on the code.

**The median step** is each configuration's own, measured in process before any wait: from the
start of its model's forward (the outermost module call) to the end of its optimizer's step, over
``CALIBRATION_STEPS`` steps after ``SKIPPED_STEPS`` (the first steps allocate). The strategy says
so in its declared ``steps_to_settle`` (``SETTLE_STEPS``), so the harness's warm-up covers its calibration; in ``machine`` mode the
``local`` twins calibrate during their own warm-up, so give ``--warmup-rounds`` of at least
``SETTLE_STEPS`` (23).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.declarations import declarations, declare

PLACES = ("sync", "forward", "backward", "optimizer", "machine")
SKIPPED_STEPS = 2
CALIBRATION_STEPS = 20  # a median of 8 steps was off by up to 6% on this 2-core machine (docs/regression-gate.md)
SETTLE_STEPS = SKIPPED_STEPS + CALIBRATION_STEPS + 1  # untimed steps the harness gives a slowed strategy


def slowdown_from_environment() -> tuple[float, str]:
    """(fraction, place) from ``DDP_BENCH_SLOWDOWN`` and ``DDP_BENCH_SLOWDOWN_AT``; ValueError saying what to set."""
    text = os.environ.get("DDP_BENCH_SLOWDOWN", "0")
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"DDP_BENCH_SLOWDOWN must be a fraction of the step such as 0.15, got {text!r}") from None
    if not 0 <= fraction < 10:
        raise ValueError(f"DDP_BENCH_SLOWDOWN must be a fraction of the step such as 0.15, got {text!r}")
    place = os.environ.get("DDP_BENCH_SLOWDOWN_AT", "sync")
    if place not in PLACES:
        raise ValueError(f"DDP_BENCH_SLOWDOWN_AT must be one of {', '.join(PLACES)}, got {place!r}")
    return fraction, place


def busy_wait(seconds: float) -> None:
    """Keep the core busy for ``seconds``, as slower code would (a sleep lets it idle, and the steps
    after an idle core ran slower on this machine: docs/regression-gate.md)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StepClock:
    """Each optimizer's step on this rank, from the start of the outermost module call before it to
    the end of its ``step()``, and its median over the calibration steps.

    The ranks run one configuration's step at a time, so the latest outermost forward before an
    optimizer's step is that configuration's. The hooks are PyTorch's global ones (module forward
    pre/post hooks, optimizer step post hook), hung once per process while a slowed strategy is
    alive and removed with the last one."""

    def __init__(self) -> None:
        self.users = 0
        self._depth = 0
        self._forward_began = 0.0
        self._steps: dict[int, list[float]] = {}  # per optimizer (by id), its steps' seconds
        self._handles = []
        self.after_step = []
        """Callbacks ``(optimizer, median_seconds or None)`` run after every optimizer's step."""
        self.machine_fraction = 0.0
        """After every optimizer's calibrated step, wait this fraction of its median: a slower machine."""

    def acquire(self) -> None:
        if self.users == 0:
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._enter),
                nn.modules.module.register_module_forward_hook(self._leave),
                register_optimizer_step_post_hook(self._stepped),
            ]
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            for handle in self._handles:
                handle.remove()
            self._handles, self._steps, self._depth, self.machine_fraction = [], {}, 0, 0.0
            self.after_step.clear()

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._forward_began = time.perf_counter()
        self._depth += 1

    def _leave(self, module, args, output) -> None:
        self._depth -= 1

    def median_seconds(self, optimizer) -> float | None:
        """The optimizer's median calibration step, or None while it is still calibrating."""
        steps = self._steps.get(id(optimizer), [])
        measured = steps[SKIPPED_STEPS:SKIPPED_STEPS + CALIBRATION_STEPS]
        return statistics.median(measured) if len(measured) == CALIBRATION_STEPS else None

    def _stepped(self, optimizer, args, kwargs) -> None:
        steps = self._steps.setdefault(id(optimizer), [])
        if len(steps) < SKIPPED_STEPS + CALIBRATION_STEPS:
            steps.append(time.perf_counter() - self._forward_began)
        median = self.median_seconds(optimizer)
        for callback in list(self.after_step):
            callback(optimizer, median)
        if self.machine_fraction > 0 and median is not None:
            busy_wait(self.machine_fraction * median)


CLOCK = StepClock()


class _WaitInBackward(torch.autograd.Function):
    """Identity in forward; its backward, the first thing backward runs, waits."""

    @staticmethod
    def forward(ctx, output, slowed):
        ctx.slowed = slowed
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.slowed.wait()
        return grad, None


class Slowed:
    """Mix in before a strategy class: ``class SlowedFlat(Slowed, FlatDDP)``. See the module docstring."""

    def __init__(self, module: nn.Module, **options) -> None:
        super().__init__(module, **options)
        self.slowdown_fraction, self.slowdown_place = slowdown_from_environment()
        self._median_seconds: float | None = None
        self._own_parameter = next(p for p in module.parameters() if p.requires_grad)
        self._hooked = self.slowdown_fraction > 0
        if self._hooked:
            CLOCK.acquire()
            CLOCK.after_step.append(self._after_optimizer_step)
            if self.slowdown_place == "machine":
                CLOCK.machine_fraction = self.slowdown_fraction  # once per process, however many are alive

    def wait(self) -> None:
        """Wait f x this configuration's median step (nothing while it calibrates)."""
        if self._median_seconds is not None:
            busy_wait(self.slowdown_fraction * self._median_seconds)

    def _owns(self, optimizer) -> bool:
        return any(p is self._own_parameter for group in optimizer.param_groups for p in group["params"])

    def _after_optimizer_step(self, optimizer, median_seconds: float | None) -> None:
        if self._owns(optimizer):
            self._median_seconds = median_seconds
            if self.slowdown_place == "optimizer":
                self.wait()

    def forward(self, *args, **kwargs):
        if self._hooked and self.slowdown_place == "forward":
            self.wait()
        output = super().forward(*args, **kwargs)
        if self._hooked and self.slowdown_place == "backward" and isinstance(output, torch.Tensor) and output.requires_grad:
            output = _WaitInBackward.apply(output, self)
        return output

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        if self.slowdown_place == "sync":
            self.wait()

    def close(self) -> None:
        if self._hooked:
            self._hooked = False
            CLOCK.after_step.remove(self._after_optimizer_step)
            CLOCK.release()
        super().close()


class SlowedBucketed(Slowed, BucketedDDP):
    """``bucketed``, slowed as ``DDP_BENCH_SLOWDOWN`` and ``DDP_BENCH_SLOWDOWN_AT`` say."""


declare(SlowedBucketed, **declarations(BucketedDDP, steps_to_settle=SETTLE_STEPS))
