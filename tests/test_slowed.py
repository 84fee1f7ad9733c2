"""The slowdowns the power study injects (examples/slowed.py) wait where and as long as they say:
f times the configuration's own median step, after calibrating, in the named phase, and for
``machine`` in every configuration's step alike. Waits are recorded, not waited, so that these
checks do not depend on the machine's load."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

FRACTION = 0.25


def slowed_steps(place: str, steps: int) -> dict:
    """On a rank: a slowed bucketed and a plain model (a ``local`` twin) step alternately; every
    wait is recorded with the model and phase it fell in."""
    import examples.slowed as slowed

    phase = ["build"]
    waits: list[tuple[int, str, str, float]] = []
    step = [0]

    def recording_wait(seconds: float) -> None:
        waits.append((step[0], *phase, seconds))

    os.environ.update(DDP_BENCH_SLOWDOWN=str(FRACTION), DDP_BENCH_SLOWDOWN_AT=place)
    real_wait, slowed.busy_wait = slowed.busy_wait, recording_wait
    try:
        torch.manual_seed(0)
        model = slowed.SlowedBucketed(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), bucket_size_mb=1.0)
        twin = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizers = {"slowed": torch.optim.AdamW(model.parameters()), "twin": torch.optim.AdamW(twin.parameters())}
        for step[0] in range(steps):
            for name, net in (("slowed", model), ("twin", twin)):
                phase[:] = [name, "forward"]
                loss = net(torch.randn(8, 16)).square().mean()
                phase[1] = "backward"
                loss.backward()
                phase[1] = "sync"
                if name == "slowed":
                    net.finish_gradient_synchronization()
                phase[1] = "optimizer"
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
        medians = {name: slowed.CLOCK.median_seconds(opt) for name, opt in optimizers.items()}
        model.close()
        return {"waits": waits, "medians": medians, "hooks_left": slowed.CLOCK.users + len(slowed.CLOCK._handles)}
    finally:
        slowed.busy_wait = real_wait
        del os.environ["DDP_BENCH_SLOWDOWN"], os.environ["DDP_BENCH_SLOWDOWN_AT"]


@pytest.mark.parametrize("place", ["sync", "forward", "backward", "optimizer"])
def test_a_slowed_strategy_waits_a_share_of_its_median_step_in_the_named_place(rank_group, place):
    from examples.slowed import SETTLE_STEPS

    settle = SETTLE_STEPS
    result = rank_group.run(slowed_steps, place, settle + 4)[0]
    median = result["medians"]["slowed"]
    assert median is not None and median > 0
    waits = result["waits"]
    # nothing while calibrating; from then on one wait per step, in the slowed model's named phase
    assert settle - 2 <= waits[0][0] <= settle - 1  # the calibrating steps are steps 0 .. settle - 2
    assert [w[0] for w in waits] == list(range(waits[0][0], settle + 4))
    assert {(w[1], w[2]) for w in waits} == {("slowed", place)}
    assert all(w[3] == pytest.approx(FRACTION * median) for w in waits)
    assert result["hooks_left"] == 0


def test_a_slower_machine_slows_every_configuration_by_its_own_median(rank_group):
    from examples.slowed import SETTLE_STEPS

    settle = SETTLE_STEPS
    result = rank_group.run(slowed_steps, "machine", settle + 3)[0]
    for name in ("slowed", "twin"):
        waits = [w for w in result["waits"] if w[1] == name]
        assert waits and all(w[2] == "optimizer" for w in waits)
        assert len(waits) >= 3 and all(w[3] == pytest.approx(FRACTION * result["medians"][name]) for w in waits)
    assert result["hooks_left"] == 0


def test_a_bad_slowdown_is_refused_saying_what_to_set(monkeypatch):
    from examples.slowed import slowdown_from_environment

    monkeypatch.setenv("DDP_BENCH_SLOWDOWN", "15%")
    with pytest.raises(ValueError, match="DDP_BENCH_SLOWDOWN must be a fraction of the step such as 0.15"):
        slowdown_from_environment()
    monkeypatch.setenv("DDP_BENCH_SLOWDOWN", "0.15")
    monkeypatch.setenv("DDP_BENCH_SLOWDOWN_AT", "gpu")
    with pytest.raises(ValueError, match="DDP_BENCH_SLOWDOWN_AT must be one of sync, forward, backward, optimizer, machine"):
        slowdown_from_environment()


def test_busy_wait_lasts_as_long_as_asked():
    import examples.slowed as slowed

    began = time.perf_counter()
    slowed.busy_wait(0.02)
    assert time.perf_counter() - began >= 0.02
