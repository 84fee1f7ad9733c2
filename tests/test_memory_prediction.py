"""The memory prediction (``ddp.bench.memory.predict``) against an independent measurement: PyTorch's
``MemTracker`` over one real step of every registered strategy and a user's class, on ``tiny`` and
``mini``, fp32 and bf16 (the sharding strategies in bf16 with FSDP's compute dtype, as the step
trains them; and fused AdamW on mini), and in fp32 with the step's two shapes
(``ddp.bench.config.shape``): two micro-batches accumulated, and checkpointed blocks; at world size 2
(the rank group's). A strategy that cannot run a shape is skipped with the reason.

The tracker reports the categories at the moment its total peaked. Compared within 10%, as
PyTorch's own tests hold ``FSDPMemTracker`` to CUDA's peak: the total, and category by category
where both have the category:

- parameters, module buffers, and the optimizer state (the tracker counts AdamW's temporaries
  there when it steps; the prediction calls them temporaries of the ``optimizer`` moment);
- activations, temporaries and gradients each on their own where the strategy holds no buffers
  of its own at that moment; where it does, the tracker has no category for them (a bucket
  counts as ``Gradient``, ``Temp``, ``Activation`` or ``Other`` by when it first saw it), so
  those four are compared together with the prediction's activations, temporaries, gradients and
  communication.

Where two moments of the step need the same within 2% (the end of backward and the optimizer
step of a model whose activations are small), either may be the tracker's peak; the categories
are compared with the one that matches.

Known blind spot, and why ``fsdp`` passes with room: the tracker does not see ``fsdp``'s gathered
root (its storage is grown with ``UntypedStorage.resize_`` through a handle other than the one it
registered), so where the peak falls at backward's start (tiny in bf16) the prediction is above it
by the root's size (5%).
"""

from __future__ import annotations

import pytest

from ddp.bench.config.shape import cannot_run
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import predict, predict_moments
from ddp.bench.memory.state import tracked_peak
from ddp.bench.rounds.trainer import Trainer
from ddp.launcher import on_rank
from ddp.strategies.registry import STRATEGIES, takes_bucket_size

pytestmark = pytest.mark.slow  # every strategy's real steps under MemTracker: about 5 minutes on 2 cores

TOLERANCE = 0.10
USER_CLASS = "examples.toy:AveragingDDP"
CASES = [(model, precision, "foreach", {}) for model in ("tiny", "mini") for precision in ("fp32", "bf16")]
CASES += [("mini", "fp32", "fused", {})]
CASES += [(model, "fp32", "foreach", shape) for model in ("tiny", "mini")
          for shape in ({"grad_accum": 2}, {"activation_checkpointing": "blocks"})]
SHAPE_IDS = {"grad_accum": lambda v: f"accum{v}", "activation_checkpointing": lambda v: "ckpt"}


def case_id(model: str, precision: str, optimizer: str, shape: dict) -> str:
    return "-".join([model, precision, *(["fused"] if optimizer == "fused" else []), *(SHAPE_IDS[k](v) for k, v in shape.items())])


@on_rank
def tracked(rank, config: StepConfig) -> dict[str, int]:
    """The tracker's peak over a step of ``config``, after the warm-up steps it needs to settle."""
    trainer = Trainer(config, rank.info)
    try:
        # One step settles every strategy: AdamW's state is made in it, FSDP initialises in it, and
        # PyTorch's reducer rebuilds its buckets at the next forward, within the tracked steps.
        trainer.step()
        return tracked_peak(trainer)[0]
    finally:
        trainer.close()


UNTRACKED = {
    "torch_powersgd": "MemTracker sees the thread it runs on only: PowerSGD's error feedback is allocated anew each step in a "
    "callback on gloo's worker thread (tests/test_powersgd_memory.py counts its state instead)",
}


def config_of(strategy: str, model: str, precision: str, optimizer: str = "foreach", shape: dict | None = None) -> StepConfig:
    bucket = 1.0 if takes_bucket_size(strategy) else None  # several buckets on mini
    return StepConfig(strategy, model, 2, 32, bucket, precision=precision, optimizer=optimizer, **(shape or {}))


def pairs(tracker: dict[str, int], prediction) -> dict[str, tuple[int, int]]:
    """(tracker's bytes, predicted bytes) of each category compared (module docstring)."""
    got = {key: tracker.get(key, 0) for key in ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")}
    mine = prediction.categories()
    optimizer_temporaries = mine["temporaries"] if prediction.moment == "optimizer" else 0
    compared = {
        "buffers": (got["Buffer"], mine["buffers"]),
        "optimizer_state": (got["Optstate"], mine["optimizer_state"] + optimizer_temporaries),
    }
    held = ("Gradient", "Activation", "Temp", "Other")
    if mine["communication"] == 0 and got["Other"] == 0:
        compared["parameters"] = (got["Parameter"], mine["parameters"])
        compared["gradients"] = (got["Gradient"], mine["gradients"])
        compared["activations"] = (got["Activation"], mine["activations"])
        compared["temporaries"] = (got["Temp"], mine["temporaries"] - optimizer_temporaries)
    else:
        # Gathered parameters are the tracker's Parameter where fully_shard makes them the module's,
        # and which of them are gathered at the peak depends on when a prefetch lands (a fresh clone
        # saw the root without the prefetched unit, where a run before had both): the tracker's
        # Parameter must lie between the predicted parameters and those plus every buffer the
        # strategy holds then (the nearer bound is what it is compared with).
        low, high = mine["parameters"], mine["parameters"] + mine["communication"]
        compared["parameters"] = (got["Parameter"], min(max(got["Parameter"], low), high))
        compared["parameters, gradients, activations, temporaries and communication"] = (
            got["Parameter"] + sum(got[key] for key in held),
            mine["parameters"] + mine["gradients"] + mine["activations"] + mine["temporaries"] - optimizer_temporaries
            + mine["communication"],
        )
    return compared


def within(measured: int, predicted: int, total: int) -> bool:
    """Within ``TOLERANCE`` of the measured figure; a category under 1% of the total within 1% of
    the total (a few KiB of flags or a norm's weight)."""
    return abs(predicted - measured) <= max(TOLERANCE * measured, 0.01 * total)


def mismatches(tracker: dict[str, int], config: StepConfig, world_size: int) -> list[str]:
    """What differs by more than the tolerance, at the moment that matches best; empty if nothing."""
    total = tracker["Total"]
    peak = predict(config, world_size)
    if abs(peak.total_bytes - total) > TOLERANCE * total:
        return [f"total: tracker {total:,} B, predicted {peak.total_bytes:,} B at {peak.moment}"]
    candidates = [p for p in predict_moments(config, world_size).values() if p.total_bytes >= 0.98 * peak.total_bytes]
    attempts = []
    for moment in candidates:
        wrong = [f"{name}: tracker {got:,} B, predicted {mine:,} B at {moment.moment}"
                 for name, (got, mine) in pairs(tracker, moment).items() if not within(got, mine, total)]
        if not wrong:
            return []
        attempts.append(wrong)
    return min(attempts, key=len)


@pytest.mark.parametrize("model,precision,optimizer,shape", CASES, ids=[case_id(*case) for case in CASES])
@pytest.mark.parametrize("strategy", [*STRATEGIES, USER_CLASS])
def test_prediction_within_10_percent_of_memtracker(rank_group, strategy, model, precision, optimizer, shape):
    if rank_group.device != "cpu":
        pytest.skip("MemTracker is compared on CPU tensors here; on a GPU each step row sets the prediction beside "
                    "max_memory_allocated (its predicted_memory and peak_memory_bytes)")
    if strategy in UNTRACKED:
        pytest.skip(UNTRACKED[strategy])
    config = config_of(strategy, model, precision, optimizer, shape)
    if reason := cannot_run(config):
        pytest.skip(reason)
    tracker = rank_group.run(tracked, config)
    largest = max(tracker, key=lambda t: t["Total"])
    wrong = mismatches(largest, config, rank_group.world_size)
    assert not wrong, f"{config.describe()}: " + "; ".join(wrong)


def test_the_comparison_can_fail():
    """The same comparison refuses a prediction off by more than 10% in one category."""
    config = config_of("bucketed", "mini", "fp32")
    prediction = predict(config, 2)
    honest = {"Parameter": prediction.parameters_bytes, "Buffer": prediction.buffers_bytes,
              "Optstate": prediction.optimizer_state_bytes + (prediction.temporaries_bytes if prediction.moment == "optimizer" else 0),
              "Gradient": prediction.gradients_bytes, "Activation": prediction.activations_bytes,
              "Temp": prediction.temporaries_bytes if prediction.moment != "optimizer" else 0,
              "Other": prediction.communication_bytes}
    honest["Total"] = sum(honest.values())
    assert mismatches(honest, config, 2) == []
    shifted = {**honest, "Parameter": honest["Parameter"] * 2 // 3, "Activation": honest["Activation"] + honest["Parameter"] // 3}
    assert any(line.startswith("parameters") for line in mismatches(shifted, config, 2))
    assert mismatches({**honest, "Total": honest["Total"] * 2}, config, 2)[0].startswith("total")
