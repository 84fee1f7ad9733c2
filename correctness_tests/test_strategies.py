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
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import ddp
from correctness_tests.collectives import CollectiveCheck, checking, side_group
from correctness_tests.diagnose import (
    Mismatch,
    diagnose_initial,
    diagnose_step,
    frozen_names,
    named_buffer_values,
    named_gradients,
    named_ties,
    named_values,
)
from correctness_tests.models import MODEL_CASES
from correctness_tests.selection import only_those_taking, strategies_under_test
from ddp.launcher import rank_info
from ddp.strategies.base import REPLICATED, gather_full_params, make_optimizer, sharding_of, shards_parameters
from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.registry import resolve_strategy, supports_no_sync, takes_bucket_size, traits

STEPS = 3
ROWS_PER_RANK = 4
# Micro-batches a step: 1, no accumulation; more, that many backward passes a step, all but the
# last in no_sync(), each micro-batch's loss divided by their number (ddp.bench.config.shape).
MICRO_BATCHES = (1, 2, 4)


def accumulation_id(micro_batches: int) -> str:
    """``step``, ``no_sync`` (two micro-batches) or ``no_sync4``: the case's last id part."""
    return "step" if micro_batches == 1 else "no_sync" if micro_batches == 2 else f"no_sync{micro_batches}"


# Bucket sizes for ``bucketed`` and ``torch``, as functions of the model's gradient sizes in bytes.
BUCKET_CASES = {
    "one_tensor_per_bucket": lambda sizes: 1e-9,
    "few_per_bucket": lambda sizes: sum(sizes) / 3 / 2**20,
    "all_in_one": lambda sizes: 2 * sum(sizes) / 2**20,
    "tensor_over_cap": lambda sizes: max(sizes) / 2 / 2**20,
}


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


# (class, options): the strategy builds its optimizer from them (a sharded one for ZeRO).
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    # eps well above float rounding of tiny gradients, which Adam would otherwise amplify to a full step;
    # weight decay large enough that a gradient wrongly set to zeros (instead of None) shows.
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.5}),
}


def _strategy_options(strategy: str, bucket_case: str | None, module, has_unused: bool) -> dict:
    options = {}
    if bucket_case is not None:
        sizes = [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad]
        options["bucket_size_mb"] = BUCKET_CASES[bucket_case](sizes)
    if has_unused and "find_unused_parameters" in inspect.signature(ddp.resolve_strategy(strategy)).parameters:
        options["find_unused_parameters"] = True  # PyTorch's DDP must be told (its fast path assumes none)
    return options


def _check_bucket_plan(model: BucketedDDP, bucket_case: str) -> None:
    sizes = [p.numel() * p.element_size() for p in model.parameters_to_sync]
    if bucket_case == "one_tensor_per_bucket":
        assert model.num_allreduce_calls_per_step == len(sizes)
    elif bucket_case == "all_in_one":
        assert model.num_allreduce_calls_per_step == 1
    elif bucket_case == "tensor_over_cap":
        largest = max(sizes)
        assert largest in model.bucket_sizes_bytes, "a tensor over the cap must have a bucket of its own"
    cap = model.bucket_size_mb * 2**20
    assert all(size <= cap or size in sizes for size in model.bucket_sizes_bytes)
    assert sum(model.bucket_sizes_bytes) == sum(sizes)


def _raise_on(mismatch: Mismatch | None) -> None:
    if mismatch is not None:
        raise AssertionError(str(mismatch))


def sharded_parameters_skip(strategy: str, model_name: str) -> str | None:
    """Why a strategy that shards parameters cannot train this model, or None."""
    if MODEL_CASES[model_name].has_unused_parameters and shards_parameters(resolve_strategy(strategy)):
        return (
            f"{strategy} shards parameters and gathers each unit when it runs, so every rank must run the same "
            f"modules; {model_name} routes rows to experts per rank (PyTorch's FSDP has the same requirement)"
        )
    return None


def _moved_on_some_rank(reference: dict, actual: dict) -> set[str]:
    """Names of the parameters that match the reference on at least one rank (a MAX all-reduce)."""
    names = list(reference)
    flags = torch.tensor([_difference_free(actual[n], reference[n]) for n in names], dtype=torch.int32)
    if dist.get_backend() != "gloo":
        flags = flags.to(rank_info().device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {name for name, flag in zip(names, flags.tolist()) if flag}


def _difference_free(actual: torch.Tensor, expected: torch.Tensor) -> int:
    return int(actual.shape == expected.shape and torch.allclose(actual.double().cpu(), expected.double().cpu(), rtol=1e-4, atol=1e-5))


def _full_values(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in gather_full_params(model).items()}


def _namer(module: torch.nn.Module):
    """Names a tensor for collective messages: a parameter, or a parameter's gradient."""

    def describe(tensor: torch.Tensor) -> str | None:
        for name, param in module.named_parameters():
            if tensor is param or tensor.data_ptr() == param.data_ptr():
                return repr(name)
            if param.grad is not None and tensor.data_ptr() == param.grad.data_ptr() and tensor.numel() == param.numel():
                return f"{name!r} gradient"
        return None

    return describe


def train_against_reference(strategy, bucket_case, model_name, optimizer_name, micro_batches) -> list[torch.Tensor]:
    """Runs on every rank: train the strategy and the reference side by side, compare each step.
    Every rank's collectives are checked against the others' as they are issued (``collectives``)."""
    info = rank_info()
    case = MODEL_CASES[model_name]
    torch.manual_seed(0)
    reference = case.build().to(info.device)
    local = copy.deepcopy(reference)
    check = CollectiveCheck(side_group(), _namer(local))
    with checking(check):
        return _train_against_reference(info, check, case, reference, local, strategy, bucket_case, optimizer_name,
                                        micro_batches)


def _train_against_reference(info, check, case, reference, local, strategy, bucket_case, optimizer_name, micro_batches):
    with torch.no_grad():  # rank 0's parameters must win: start every other rank elsewhere
        for tensor in (*local.parameters(), *local.buffers()):
            if tensor.is_floating_point():
                tensor.add_(info.rank)
    model = ddp.make_ddp(strategy, local, **_strategy_options(strategy, bucket_case, local, case.has_unused_parameters))
    check.end()
    module = getattr(model, "module", local)
    _raise_on(
        diagnose_initial(info.rank, named_values(reference), _full_values(model))
        or diagnose_initial(info.rank, named_buffer_values(reference), named_buffer_values(module), kind="buffer")
    )
    if isinstance(model, BucketedDDP):
        _check_bucket_plan(model, bucket_case)
    optimizer_cls, optimizer_options = OPTIMIZERS[optimizer_name]
    reference_optimizer = optimizer_cls(reference.parameters(), **optimizer_options)
    optimizer = make_optimizer(model, optimizer_cls, **optimizer_options)
    frozen, tied = frozen_names(reference), named_ties(reference)
    compare_gradients = not shards_parameters(model)  # a sharded module's gradients are its shards'

    generator = torch.Generator().manual_seed(1234)
    rows = slice(info.rank * ROWS_PER_RANK, (info.rank + 1) * ROWS_PER_RANK)
    for step in range(STEPS):
        inputs, targets = case.batch(ROWS_PER_RANK * info.world_size, generator)
        inputs, targets = inputs.to(info.device), targets.to(info.device)
        mine, my_targets = inputs[rows], targets[rows]

        # What this rank would hold if it never communicated, for diagnosing a strategy that does
        # not. Computed on a copy so that the reference's buffers and gradients stay untouched.
        alone = copy.deepcopy(reference)
        alone.zero_grad()  # the copy holds the last step's gradients
        case.loss(alone(mine), my_targets).backward()
        local_grads = named_gradients(alone)
        check.begin(f"step {step}", [n for n, g in local_grads.items() if g is None and n not in frozen])

        reference_optimizer.zero_grad()
        case.loss(reference(inputs), targets).backward()
        reference_grads = named_gradients(reference)
        reference_optimizer.step()

        previous = _full_values(model)
        optimizer.zero_grad()
        if micro_batches > 1:
            micro = ROWS_PER_RANK // micro_batches
            with model.no_sync():
                for start in range(0, ROWS_PER_RANK - micro, micro):
                    (case.loss(model(mine[start : start + micro]), my_targets[start : start + micro]) / micro_batches).backward()
            (case.loss(model(mine[-micro:]), my_targets[-micro:]) / micro_batches).backward()
        else:
            case.loss(model(mine), my_targets).backward()
        model.finish_gradient_synchronization()
        # as synchronization left them, before the optimizer reads them
        grads = named_gradients(module) if compare_gradients else None
        optimizer.step()
        check.end()
        values = _full_values(model)
        expected = named_values(reference)

        _raise_on(
            diagnose_step(
                step,
                info.rank,
                info.world_size,
                reference_grads,
                grads,
                expected,
                values,
                frozen=frozen,
                tied=tied,
                local_grads=local_grads,
                previous_params=previous,
                moved_on_some_rank=_moved_on_some_rank(expected, values),
                update_proportional_to_gradient=optimizer_cls is torch.optim.SGD,
            )
        )
        # diagnose_step judges values as assert_close does. assert_close still runs because it
        # also checks dtype, device and layout.
        for name, value in expected.items():
            assert_close(values[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
        for (name, value), actual in zip(reference.named_buffers(), module.buffers()):
            assert_close(actual, value, msg=lambda m: f"buffer {name}: {m}")
    return [value.cpu() for value in _full_values(model).values()]


def test_trains_like_one_process(rank_group, strategy, bucket_case, model_name, optimizer_name, micro_batches):
    per_rank = rank_group.run(train_against_reference, strategy, bucket_case, model_name, optimizer_name, micro_batches)
    for rank, params in enumerate(per_rank[1:], start=1):
        for mine, rank0 in zip(params, per_rank[0]):
            assert_close(mine, rank0, rtol=0, atol=0, msg=lambda m: f"rank {rank} differs from rank 0: {m}")


BF16_STEPS = 3
BF16_LR = 0.1


def train_in_bf16(strategy: str, model_name: str) -> dict[str, float]:
    """Runs on every rank: ``strategy`` (``fsdp``, or any that takes ``compute_dtype``) with ``compute_dtype=torch.bfloat16`` against the same recipe in one
    process on the whole batch (a bf16 copy of the fp32 weights computes, its gradients become the
    fp32 masters', plain SGD steps them), and against fp32 training. Returns the largest differences
    and the tolerance derived from the run (see the test)."""
    info = rank_info()
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
