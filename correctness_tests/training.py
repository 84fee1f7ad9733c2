"""One strategy trained beside the single-process reference, on a rank: the core of
``test_strategies.py``, kept here so that other suites (a user's class, the diagnosis of wrong
ones, a strategy defined in a test) train through the very same code without importing a test
module.

On every rank, a single-process reference trains on the whole batch (no communication: the
independent reference) and the strategy on that rank's rows, with 1, 2 or 4 micro-batches a step
(all but the last under ``no_sync()``); after every step the gradients and then the parameters
must agree, judged by ``correctness_tests.diagnose``.
"""

from __future__ import annotations

import copy
import inspect

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
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import gather_full_params, make_optimizer
from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.declarations import shards_parameters

STEPS = 3


ROWS_PER_RANK = 4


# Bucket sizes for ``bucketed`` and ``torch``, as functions of the model's gradient sizes in bytes.
BUCKET_CASES = {
    "one_tensor_per_bucket": lambda sizes: 1e-9,
    "few_per_bucket": lambda sizes: sum(sizes) / 3 / 2**20,
    "all_in_one": lambda sizes: 2 * sum(sizes) / 2**20,
    "tensor_over_cap": lambda sizes: max(sizes) / 2 / 2**20,
}


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


def _moved_on_some_rank(reference: dict, actual: dict) -> set[str]:
    """Names of the parameters that match the reference on at least one rank (a MAX all-reduce)."""
    names = list(reference)
    flags = torch.tensor([_difference_free(actual[n], reference[n]) for n in names], dtype=torch.int32)
    if dist.get_backend() != "gloo":
        flags = flags.to(next(iter(reference.values())).device)
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


@on_rank
def train_against_reference(rank: Rank, strategy, bucket_case, model_name, optimizer_name, micro_batches) -> list[torch.Tensor]:
    """Runs on every rank: train the strategy and the reference side by side, compare each step.
    Every rank's collectives are checked against the others' as they are issued (``collectives``)."""
    info = rank.info
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
