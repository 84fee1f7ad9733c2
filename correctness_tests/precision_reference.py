"""The benchmark's own step against one process on the whole global batch, in a precision: the
core of ``test_precision.py`` (its module docstring has the method and why the tolerance is the
floor's), kept here so that the harness's own check of the tolerance trains through the very same
code without importing a test module."""

from __future__ import annotations

import contextlib

import torch

from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.values import GRAD_COMM, sharded_compute_dtype
from ddp.bench.config.workloads import build_workload, rank_batches
from ddp.bench.rounds.trainer import LEARNING_RATE, Trainer
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import gather_full_params

STEPS = 3


MODEL = "tiny"


BATCH_SIZE = 2


SEQ_LEN = 32


BUCKET_SIZE_MB = 0.05  # the tiny LM's 1 MB of gradients in several buckets


FLOOR_FACTOR = 2.0
"""How far above the floor a strategy may be: the floor is one correct reordering, a strategy's is
another (its own sum order, its own bf16 casts), of the same size but not the same values."""


FP32_SLACK = 1e-6
"""Absolute: fp32 sums in another order differ in their last bits (2**-24 relative on weights of
about 0.02, amplified by AdamW to at most a few times that in 3 steps), far below 1e-6."""


def _numerics(precision: str, device: torch.device):
    """The reference's own statement of each precision (the step's is ``ddp.bench.rounds.trainer``)."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _loss(workload, inputs, targets, config: StepConfig, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of a forward in ``config``'s precision, and the tensors its gradients are taken
    of: the parameters themselves, or, for a strategy that computes in a dtype of its own
    (``sharded_compute_dtype``: FSDP's mixed precision), a copy of them in that dtype, whose
    gradients become the fp32 parameters' (the recipe written out here with ``functional_call``)."""
    model = workload.module
    compute = sharded_compute_dtype(config.precision, config.strategy)
    with _numerics(config.precision, device):
        if compute is None:
            return workload.loss(model(inputs), targets), list(model.parameters())
        copies = {name: p.detach().to(compute).requires_grad_() for name, p in model.named_parameters()}
        logits = torch.func.functional_call(model, copies, (inputs,))
        return workload.loss(logits.float(), targets), list(copies.values())


def reference_parameters(config: StepConfig, world_size: int, device: torch.device, split: bool) -> list[torch.Tensor]:
    """One process training ``config``'s whole global batch, every rank's micro-batches at once,
    without checkpointing (``split``: micro-batch by micro-batch, gradients averaged in fp32, each
    rank's share and their sum rounded as an all-reduce in ``config.grad_comm``'s dtype rounds them)."""
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        torch.manual_seed(config.seed)
        workload = build_workload(config.model, config.batch_size, config.seq_len, device)
        model = workload.module
        implementation = {"fused": True} if config.optimizer == "fused" else {"foreach": True}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, **implementation)
        pieces = config.grad_accum * world_size  # the micro-batches of the whole global batch
        shards = [rank_batches(workload, config.seed, rank, world_size, device, config.grad_accum) for rank in range(world_size)]
        for _ in range(STEPS):
            if split:
                shard_grads = []
                for micro_batches in shards:
                    rank_grads = None
                    for inputs, targets in micro_batches:
                        loss, taken = _loss(workload, inputs, targets, config, device)
                        grads = [g.float() / pieces for g in torch.autograd.grad(loss, taken)]
                        rank_grads = grads if rank_grads is None else [a + g for a, g in zip(rank_grads, grads)]
                    shard_grads.append(rank_grads)
                sent = GRAD_COMM[config.grad_comm]  # each share rounded to what it is sent in, the sum again
                for param, *per_shard in zip(model.parameters(), *shard_grads):
                    param.grad = sent.rounded(sum(sent.rounded(g) for g in per_shard))
            else:
                inputs = torch.cat([inputs for micro_batches in shards for inputs, _ in micro_batches])
                targets = torch.cat([targets for micro_batches in shards for _, targets in micro_batches])
                loss, taken = _loss(workload, inputs, targets, config, device)
                for param, grad in zip(model.parameters(), torch.autograd.grad(loss, taken)):
                    param.grad = grad.float()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().cpu() for _, p in sorted(model.named_parameters())]  # by name, as the strategy's
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


@on_rank
def train_and_references(rank: Rank, config: StepConfig) -> dict:
    """Runs on every rank: the strategy's parameters after ``STEPS`` steps of the benchmark's step;
    rank 0 also trains the two references."""
    info = rank.info
    trainer = Trainer(config, info)
    try:
        for _ in range(STEPS):
            trainer.step()
        full = gather_full_params(trainer.model)  # whole parameters, sharded strategies' too
        result = {"trained": [full[name].detach().cpu() for name in sorted(full)]}
    finally:
        trainer.close()
    if info.rank == 0:
        result["reference"] = reference_parameters(config, info.world_size, info.device, split=False)
        result["floor"] = reference_parameters(config, info.world_size, info.device, split=True)
    return result


def distance(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, float]:
    """Largest and mean absolute difference over every parameter element."""
    diffs = torch.cat([(a.double() - e.double()).abs().reshape(-1) for a, e in zip(actual, expected, strict=True)])
    return {"max": diffs.max().item(), "mean": diffs.mean().item()}


def within_tolerance(results: list[dict]) -> tuple[dict, dict, bool]:
    """(the strategy's distance from the reference, the floor's, whether it is within tolerance) on rank 0."""
    trained, reference, floor = results[0]["trained"], results[0]["reference"], results[0]["floor"]
    mine, floors = distance(trained, reference), distance(floor, reference)
    ok = all(mine[key] <= FLOOR_FACTOR * floors[key] + FP32_SLACK for key in ("max", "mean"))
    return mine, floors, ok
