"""Every strategy must train exactly like one process on the whole batch.

On every rank, the test trains a single-process reference on the whole batch (no communication:
the independent reference) and the strategy on that rank's rows, with the optimizer the strategy
makes (``ddp.strategies.base.make_optimizer``: a sharded one for ZeRO). It checks that the wrapped
module starts from rank 0's parameters, and after every step that the gradients and then the
parameters agree, reading the parameters whole by name (``gather_full_params``) so that sharded
strategies are checked like the others; a strategy that shards its gradients is judged by its
parameters alone. A mismatch fails with ``correctness_tests.diagnose``'s message: the step, rank, parameter and
size of the difference, and the likely mistake when it is a known one. The parent then checks
that all ranks hold identical parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import ddp
from correctness_tests.models import MODEL_CASES
from correctness_tests.selection import only_those_taking, strategies_under_test
from correctness_tests.training import (
    BUCKET_CASES,
    OPTIMIZERS,
    ROWS_PER_RANK,
    train_against_reference,
)
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import gather_full_params, make_optimizer
from ddp.strategies.declarations import REPLICATED, sharding_of, shards_parameters
from ddp.strategies.registry import resolve_strategy, supports_no_sync, takes_bucket_size, traits

# Micro-batches a step: 1, no accumulation; more, that many backward passes a step, all but the
# last in no_sync(), each micro-batch's loss divided by their number (ddp.bench.config.shape).
MICRO_BATCHES = (1, 2, 4)


def accumulation_id(micro_batches: int) -> str:
    """``step``, ``no_sync`` (two micro-batches) or ``no_sync4``: the case's last id part."""
    return "step" if micro_batches == 1 else "no_sync" if micro_batches == 2 else f"no_sync{micro_batches}"


def strategy_cases(strategies: tuple[str, ...]) -> list:
    """(strategy, bucket case) pairs for ``--strategies`` (default: every DDP). A strategy that takes
    ``bucket_size_mb`` runs every bucket case (PyTorch's DDP, the reference, whose bucketing PyTorch
    tests, one); a user's class without it gets one skipped case saying what to add. A strategy that
    communicates nothing (``local``) is left out."""
    cases = []
    for name in strategies:
        if not traits(name).communicates:
            continue
        if takes_bucket_size(name) and (
            ddp.resolve_strategy(name) is ddp.TorchDDP or sharding_of(resolve_strategy(name)) not in (None, REPLICATED)
        ):
            # PyTorch's reducer, and sharded strategies whose buckets are bucketed's or torch's: one plan will do
            cases.append((name, "few_per_bucket"))
        elif takes_bucket_size(name):
            cases += [(name, case) for case in BUCKET_CASES]
        else:
            cases.append((name, None))
    return cases


def training_cases(strategies: tuple[str, ...]) -> list:
    """Every (strategy, bucket case, model, optimizer, micro-batches) to train, and once per strategy
    each case it cannot run, skipped with what to add: ``no_sync()``, a ``bucket_size_mb`` option
    (a user's class), a model whose experts some ranks leave unused (a strategy that shards parameters)."""
    params = []
    for name, bucket in strategy_cases(strategies):
        accumulations = MICRO_BATCHES if supports_no_sync(name) else (1,)
        label = name if bucket is None else f"{name}-{bucket}"
        for model_name in MODEL_CASES:
            if reason := sharded_parameters_skip(name, model_name):
                params.append(pytest.param(name, bucket, model_name, "adamw", 1, id=f"{label}-{model_name}",
                                           marks=pytest.mark.skip(reason=reason)))
                continue
            params += [
                pytest.param(name, bucket, model_name, optimizer, micro_batches,
                             id=f"{label}-{model_name}-{optimizer}-{accumulation_id(micro_batches)}")
                for optimizer in OPTIMIZERS for micro_batches in accumulations
            ]
        if bucket is None and not supports_no_sync(name):
            reason = f"{name} has no no_sync(): add that context manager to test gradient accumulation"
            params.append(pytest.param(name, None, "frozen_mlp", "adamw", 2, id=f"{name}-no_sync",
                                       marks=pytest.mark.skip(reason=reason)))
    for name in strategies:
        if name not in ddp.STRATEGIES and traits(name).communicates and not takes_bucket_size(name):
            reason = f"{name} takes no bucket_size_mb option: add one to its constructor to test bucket plans"
            params.append(pytest.param(name, "few_per_bucket", "frozen_mlp", "adamw", 1, id=f"{name}-buckets",
                                       marks=pytest.mark.skip(reason=reason)))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    strategies = strategies_under_test(metafunc.config)
    if "bucket_case" in metafunc.fixturenames:
        metafunc.parametrize("strategy, bucket_case, model_name, optimizer_name, micro_batches", training_cases(strategies))
    if "compute_dtype_strategy" in metafunc.fixturenames:
        metafunc.parametrize("compute_dtype_strategy", only_those_taking("compute_dtype", strategies, "bf16 compute"))


def sharded_parameters_skip(strategy: str, model_name: str) -> str | None:
    """Why a strategy that shards parameters cannot train this model, or None."""
    if MODEL_CASES[model_name].has_unused_parameters and shards_parameters(resolve_strategy(strategy)):
        return (
            f"{strategy} shards parameters and gathers each unit when it runs, so every rank must run the same "
            f"modules; {model_name} routes rows to experts per rank (PyTorch's FSDP has the same requirement)"
        )
    return None


def test_trains_like_one_process(rank_group, strategy, bucket_case, model_name, optimizer_name, micro_batches):
    per_rank = rank_group.run(train_against_reference, strategy, bucket_case, model_name, optimizer_name, micro_batches)
    for rank, params in enumerate(per_rank[1:], start=1):
        for mine, rank0 in zip(params, per_rank[0]):
            assert_close(mine, rank0, rtol=0, atol=0, msg=lambda m: f"rank {rank} differs from rank 0: {m}")


BF16_STEPS = 3
BF16_LR = 0.1


@on_rank
def train_in_bf16(rank: Rank, strategy: str, model_name: str) -> dict[str, float]:
    """Runs on every rank: ``strategy`` (``fsdp``, or any that takes ``compute_dtype``) with ``compute_dtype=torch.bfloat16`` against the same recipe in one
    process on the whole batch (a bf16 copy of the fp32 weights computes, its gradients become the
    fp32 masters', plain SGD steps them), and against fp32 training. Returns the largest differences
    and the tolerance derived from the run (see the test)."""
    info = rank.info
    case = MODEL_CASES[model_name]
    torch.manual_seed(0)
    reference = case.build().to(info.device)
    fp32 = copy.deepcopy(reference)
    model = ddp.make_ddp(strategy, copy.deepcopy(reference), compute_dtype=torch.bfloat16)
    masters = getattr(model, "shards", None) or list(model.parameters())
    assert all(shard.dtype == torch.float32 for shard in masters), "master weights must stay fp32"
    optimizers = [torch.optim.SGD(m.parameters(), lr=BF16_LR) for m in (reference, fp32)]
    optimizer = make_optimizer(model, torch.optim.SGD, lr=BF16_LR)
    generator = torch.Generator().manual_seed(1234)
    rows = slice(info.rank * ROWS_PER_RANK, (info.rank + 1) * ROWS_PER_RANK)
    tolerance = 0.0
    for _ in range(BF16_STEPS):
        inputs, targets = case.batch(ROWS_PER_RANK * info.world_size, generator)
        inputs, targets = inputs.to(info.device), targets.to(info.device)
        compute = copy.deepcopy(reference)
        for param in compute.parameters():  # weights in bf16; buffers stay as they are, as fsdp leaves them
            param.data = param.data.to(torch.bfloat16)
        cast = inputs.to(torch.bfloat16) if inputs.is_floating_point() else inputs
        case.loss(compute(cast).float(), targets).backward()
        for master, low in zip(reference.parameters(), compute.parameters()):
            master.grad = low.grad.float()
        # Each rank's bf16 gradient of its rows is rounded once more than the whole batch's (2^-8
        # relative, bf16's 8-bit mantissa), and SGD moves a weight by lr x gradient: per step, at
        # most lr x 2^-8 x |g| apart, twice that for the halves' roundings adding up; over steps,
        # differences in the masters can round a bf16 weight to the neighbouring value, so the
        # bound adds up step by step.
        tolerance += 2 * BF16_LR * 2**-8 * max(p.grad.abs().max().item() for p in reference.parameters())
        optimizers[0].step()
        optimizers[0].zero_grad()
        optimizers[1].zero_grad()
        case.loss(fp32(inputs), targets).backward()
        optimizers[1].step()
        optimizer.zero_grad()
        case.loss(model(inputs[rows]), targets[rows]).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    full = gather_full_params(model)
    expected, in_fp32 = dict(reference.named_parameters()), dict(fp32.named_parameters())
    return {
        "to_bf16_reference": max((full[n] - expected[n]).abs().max().item() for n in full),
        "to_fp32": max((full[n] - in_fp32[n]).abs().max().item() for n in full),
        "tolerance": tolerance,
    }


def test_computes_in_bf16_over_fp32_masters(rank_group, compute_dtype_strategy):
    """``compute_dtype``: within a tolerance derived from bf16's rounding of the recipe run in one
    process, and measurably not fp32 training (else the option did nothing)."""
    for result in rank_group.run(train_in_bf16, compute_dtype_strategy, "tied_lm"):
        assert result["to_bf16_reference"] <= result["tolerance"], result
        assert result["to_fp32"] > result["to_bf16_reference"], result
