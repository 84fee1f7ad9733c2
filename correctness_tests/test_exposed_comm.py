"""Exposed communication adds up: every strategy's ``comm_wait_seconds`` (``ddp.bench.trainer``)
accounts for what its step costs over ``local``'s, PyTorch's DDP included, whose wait happens
inside ``loss.backward()``.

For each strategy, measured in the same rounds as ``local`` (the same step without
communication: forward + backward + optimizer), medians over rounds:

    exposed >= step - local step - tolerance

The tolerance is what synchronizing may cost without waiting: on a CPU, gloo's threads take cores
from the computation they overlap, and a strategy spends time copying gradients into its buckets
and in its own Python (``TOLERANCE_OF_LOCAL`` of the local step plus ``TOLERANCE_SECONDS``).

Before the fix, ``torch``'s figure ran from the last gradient to the return of
``finish_gradient_synchronization()`` and read zero however long its reducer waited in backward:
``DelayedTorchDDP`` holds every bucket ``NETWORK_DELAY_SECONDS`` longer, as a slow network would,
so its step is slower than ``local``'s by far more than the tolerance, all of it a wait.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddp.bench.config import StepConfig
from ddp.bench.measure import Measurement, measure
from ddp.bench.options import RoundOptions
from ddp.bench.rank_state import release
from ddp.strategies import DDP_STRATEGIES, TorchDDP, takes_bucket_size

TOLERANCE_OF_LOCAL = 0.5
TOLERANCE_SECONDS = 0.020
NETWORK_DELAY_SECONDS = 0.100


def _delayed_allreduce(process_group, bucket):
    """PyTorch's default hook (average the bucket), delivered ``NETWORK_DELAY_SECONDS`` after the
    all-reduce completed, from a thread of its own: a delay in a ``then`` callback would run
    inline, inside backward, whenever the all-reduce was already done. Unannotated: DDP reads the
    annotations, and this module's are strings."""
    world_size = dist.get_world_size(process_group)
    reduced = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    delivered = torch.futures.Future()

    def deliver_late() -> None:
        reduced.wait()
        time.sleep(NETWORK_DELAY_SECONDS)
        delivered.set_result(bucket.buffer().div_(world_size))

    threading.Thread(target=deliver_late, daemon=True).start()
    return delivered


class DelayedTorchDDP(TorchDDP):
    """PyTorch's DDP on a slow network: its reducer waits for its buckets inside backward."""

    def __init__(self, module, **options) -> None:
        super().__init__(module, **options)
        self.ddp.register_comm_hook(self.process_group, _delayed_allreduce)


def _medians(configs: list[StepConfig], rank_group) -> tuple[float, dict[str, tuple[float, float]]]:
    """local's median step, and (step, exposed) medians of every other configuration, by strategy."""
    try:
        measurement = measure(rank_group, configs, RoundOptions.fixed(7, 1))
    finally:
        rank_group.run(release)
    assert isinstance(measurement, Measurement)
    local = statistics.median(measurement.round_seconds(0))
    figures = {
        config.strategy.rsplit(":", 1)[-1]: (
            statistics.median(measurement.round_seconds(index)),
            statistics.median(measurement.comm_wait_seconds(index)),
        )
        for index, config in enumerate(configs[1:], start=1)
    }
    return local, figures


def _check_adds_up(local: float, figures: dict[str, tuple[float, float]]) -> float:
    tolerance = TOLERANCE_OF_LOCAL * local + TOLERANCE_SECONDS
    shown = ", ".join(f"{name}: step {s * 1e3:.1f} ms, exposed {e * 1e3:.1f} ms" for name, (s, e) in figures.items())
    for name, (step, exposed) in figures.items():
        assert exposed >= step - local - tolerance, (
            f"{name}'s exposed communication does not account for its step: local {local * 1e3:.1f} ms, "
            f"tolerance {tolerance * 1e3:.1f} ms; {shown}"
        )
    return tolerance


def _needs_two_ranks(rank_group) -> None:
    if rank_group.world_size < 2:
        pytest.skip("needs 2 ranks or more: with one rank nothing is communicated")


def test_exposed_communication_accounts_for_the_step_of_every_strategy(rank_group) -> None:
    _needs_two_ranks(rank_group)
    configs = [StepConfig("local", "tiny", 2, 32)] + [
        StepConfig(name, "tiny", 2, 32, 1.0 if takes_bucket_size(name) else None) for name in DDP_STRATEGIES
    ]
    _check_adds_up(*_medians(configs, rank_group))


def test_a_wait_inside_backward_is_exposed(rank_group) -> None:
    _needs_two_ranks(rank_group)
    delayed = StepConfig(f"{__name__}:DelayedTorchDDP", "tiny", 2, 32)
    local, figures = _medians([delayed.local_twin(), delayed], rank_group)
    tolerance = _check_adds_up(local, figures)
    step, exposed = figures["DelayedTorchDDP"]
    assert step - local > 2 * tolerance, f"the delay must dominate: local {local:.4f} s, step {step:.4f} s"
    # The last bucket is delivered the delay after its all-reduce, launched by backward's last gradient.
    assert exposed >= 0.9 * NETWORK_DELAY_SECONDS, f"torch's reducer waited in backward: exposed {exposed * 1e3:.1f} ms"
