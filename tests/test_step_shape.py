"""The step's shape (``ddp.bench.config.shape``) as its consumers read it: tokens and FLOPs of a
record, phases of a recorded step, who can run a shape, what checkpointing changes, the memory
prediction and the cost model, each against figures worked by hand or an un-checkpointed twin."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddp.analysis.costmodel import Compute, Gradient, Link, predict_step
from ddp.bench.collectives.recording import PhaseRecorder, recorded_step
from ddp.bench.config.shape import (
    ACCUMULATE,
    PHASES,
    RecordedStep,
    StepShape,
    cannot_run,
    checkpoint_blocks,
    repeated_blocks,
)
from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.workloads import build_workload, rank_batches
from ddp.bench.memory.predict import largest_batch, predict, predict_moments
from ddp.bench.results.flops import workload_flops_per_token
from ddp.bench.rounds.trainer import Trainer
from ddp.launcher import Rank, on_rank
from ddp.model import MODEL_SIZES
from tests import synthetic

GIB = 2**30


def test_tokens_and_flops_count_every_micro_batch():
    config = StepConfig("bucketed", "mini", 8, 64, 1.0, grad_accum=4)
    shape = config.step_shape
    assert (shape.micro_batches, shape.samples_per_step, shape.tokens_per_step) == (4, 32, 4 * 8 * 64)
    assert shape.loss_scale == 0.25 and StepShape(8, 64).loss_scale is None
    record = synthetic.step(config, [0.5, 0.5, 0.5])
    flops = workload_flops_per_token("mini", 64)
    assert record.tokens_per_step == 4 * 8 * 64
    assert record.tokens_per_second == pytest.approx(2 * 4 * 8 * 64 / 0.5)  # two ranks
    assert record.achieved_tflops == pytest.approx(flops * 4 * 8 * 64 / 0.5 / 1e12)


def test_shape_axes_name_a_configuration_only_away_from_their_defaults():
    plain = StepConfig("bucketed", "mini", 8, 64, 1.0)
    shaped = dataclasses.replace(plain, grad_accum=4, activation_checkpointing="blocks")
    assert plain.test_id == "bucketed-b8-s64-bucket1mb"  # names of a run at the defaults unchanged
    assert shaped.test_id == "bucketed-b8-s64-bucket1mb-accum4-ckpt"
    assert "4 micro-batches" in shaped.describe() and "checkpointed blocks" in shaped.describe()
    assert shaped.local_twin().grad_accum == 4 and shaped.local_twin().activation_checkpointing == "blocks"
    assert StepConfig.from_dict({k: v for k, v in plain.to_dict().items()
                                 if k not in ("grad_accum", "activation_checkpointing")}) == plain  # a file before them


def test_phases_in_order_and_the_span_of_a_step():
    assert StepShape(2, 8).phases == PHASES
    assert StepShape(2, 8, micro_batches=3).phases == (ACCUMULATE, *PHASES)
    phases = {"accumulate": [1.0, 2.0], "forward": [2.0, 2.5], "backward": [2.5, 3.5], "gradient_sync": [3.5, 3.6],
              "optimizer": [3.6, 4.0]}
    step = RecordedStep(phases, backward_compute_end=3.5)
    assert step.span == (1.0, 4.0) and step.seconds == pytest.approx(3.0) and next(iter(step.phases)) == ACCUMULATE
    del phases["accumulate"]
    assert step.span == (2.0, 4.0) and tuple(step.phases) == PHASES


def test_a_phase_entered_per_micro_batch_spans_them_all():
    recorder = PhaseRecorder(on_cuda=False)
    for _ in range(3):
        with recorder.phase(ACCUMULATE):
            pass
    first_start = recorder.step[ACCUMULATE][0]
    with recorder.phase("forward"):
        pass
    assert recorder.step[ACCUMULATE][0] == first_start  # the first micro-batch's start, kept
    assert recorder.step[ACCUMULATE][1] <= recorder.step["forward"][0]


def test_who_can_run_which_shape_is_declared():
    assert cannot_run(StepConfig("local", "tiny", 2, 32, grad_accum=4)) is None
    assert cannot_run(StepConfig("torch", "tiny", 2, 32, 1.0, grad_accum=4)) is None
    fsdp = cannot_run(StepConfig("fsdp", "tiny", 2, 32, grad_accum=4))
    assert "accumulates_locally" in fsdp and fsdp.endswith("run it with --grad-accum 1")
    # a user's class that declares nothing is not asked to accumulate, even with a no_sync()
    assert "accumulates_locally" in cannot_run(StepConfig("tests.wrong_ddps:SimpleDDP", "tiny", 2, 32, grad_accum=2))
    assert cannot_run(StepConfig("fsdp", "tiny", 2, 32, activation_checkpointing="blocks")) is None
    no_blocks = cannot_run(StepConfig("bucketed", "mlp", 2, 32, 1.0, activation_checkpointing="blocks"))
    assert no_blocks.startswith("model mlp has no repeated blocks") and "nn.ModuleList" in no_blocks


def test_checkpointed_blocks_compute_the_same_and_keep_their_names():
    torch.manual_seed(0)
    plain = build_workload("tiny", 2, 32, "cpu")
    torch.manual_seed(0)
    checkpointed = build_workload("tiny", 2, 32, "cpu")
    checkpoint_blocks(checkpointed.module)
    names = [name for name, _ in plain.module.named_parameters()]
    assert [name for name, _ in checkpointed.module.named_parameters()] == names
    [(inputs, targets)] = rank_batches(plain, 0, 0, 1, "cpu")
    for workload in (plain, checkpointed):
        workload.loss(workload.module(inputs), targets).backward()
    for (name, a), b in zip(plain.module.named_parameters(), checkpointed.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
    with pytest.raises(ValueError, match="nn.ModuleList"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_accumulating_holds_every_gradient_through_the_last_micro_batch():
    """For a strategy that frees gradients between steps, a step of one micro-batch starts forward
    with none; accumulating, the last micro-batch's forward and backward run beside them all."""
    one, four = (StepConfig("naive", "mini", 2, 64, grad_accum=n) for n in (1, 4))
    whole = predict_moments(one, 2)["optimizer"].gradients_bytes
    assert predict_moments(one, 2)["forward"].gradients_bytes == 0
    assert predict_moments(four, 2)["forward"].gradients_bytes == whole
    assert predict_moments(four, 2)["backward"].gradients_bytes == whole
    assert predict_moments(four, 2)["forward"].activations_bytes == predict_moments(one, 2)["forward"].activations_bytes


def test_checkpointing_lowers_activations_and_raises_the_largest_batch():
    none, blocks = (StepConfig("bucketed", "mini", 8, 128, 1.0, activation_checkpointing=a) for a in ("none", "blocks"))
    saved, checkpointed = predict_moments(none, 2)["forward"], predict_moments(blocks, 2)["forward"]
    # mini saves every block's activations without it; with it, a block's input (8 x 128 x d_model fp32) per block
    d_model, layers = MODEL_SIZES["mini"].d_model, MODEL_SIZES["mini"].num_layers
    assert checkpointed.activations_bytes < saved.activations_bytes / 2
    assert checkpointed.activations_bytes >= layers * 8 * 128 * d_model * 4
    memory = predict(none, 2).total_bytes * 2
    assert largest_batch(blocks, 2, memory) > largest_batch(none, 2, memory)


def test_the_cost_model_overlaps_the_last_micro_batch_only():
    compute = Compute.of(1.2, StepShape(8, 64, micro_batches=4))
    assert compute.backward_seconds == pytest.approx(1.2 / 4 * 2 / 3) and compute.forward_seconds == pytest.approx(0.1)
    assert Compute.of(1.2, StepShape(8, 64, activation_checkpointing="blocks")).backward_seconds == pytest.approx(0.9)
    # a 1 MB gradient ready as backward starts, 0.5 s on the wire, then a tiny one at backward's end:
    # hidden by one micro-batch's 0.8 s backward, exposed past a quarter's 0.2 s
    gradients = [Gradient("first", 1_000_000, 0.0), Gradient("last", 4, 1.0)]
    link = Link("test", 0.0, 1_000_000 / 0.5)  # t(b, 2) = b * 2(2-1)/2 / busbw: 0.5 s for the first
    _, exposed_one, *_ = predict_step("overlap", None, Compute.of(1.2, StepShape(8, 64)), gradients, link, 2)
    _, exposed_four, *_ = predict_step("overlap", None, compute, gradients, link, 2)
    assert exposed_one == pytest.approx(0.0, abs=1e-4)
    assert exposed_four == pytest.approx(0.5 - 0.2, abs=1e-4)


@on_rank
def recorded_accumulating_step(rank: Rank, config: StepConfig) -> dict:
    trainer = Trainer(config, rank.info)
    try:
        for _ in range(config.step_shape.micro_batches):
            trainer.step()  # settled
        return recorded_step(trainer, together=True)
    finally:
        trainer.close()


def test_a_recorded_step_holds_every_micro_batch_and_communicates_in_the_last(rank_group):
    config = StepConfig("bucketed", "tiny", 2, 32, 0.05, grad_accum=3)
    step = rank_group.run(recorded_accumulating_step, config)[0]
    assert tuple(step.phases) == (ACCUMULATE, *PHASES)
    starts = [start for start, _ in step.phases.values()]
    assert starts == sorted(starts) and step.phases[ACCUMULATE][1] <= step.phases["forward"][0]
    # the buckets once, all launched by the synchronizing micro-batch: nothing inside no_sync()
    labels = [c["label"] for c in step.collectives]
    assert len(labels) == len(set(labels)) and any(label.startswith("bucket") for label in labels)
    assert all(c["launch_seconds"] >= step.phases["forward"][0] for c in step.collectives)
