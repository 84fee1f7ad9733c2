"""Every strategy must train exactly like one process on the whole batch.

On every rank, the test trains a single-process reference on the whole batch (no communication:
the independent reference) and the strategy on that rank's rows. It checks that the wrapped
module starts from rank 0's parameters, and after every step that the gradients and then the
parameters agree. A mismatch fails with ``correctness_tests.diagnose``'s message: the step, rank, parameter and
size of the difference, and the likely mistake when it is a known one. The parent then checks
that all ranks hold identical parameters.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch.testing import assert_close

import ddp
from ddp.strategies.bucketed import BucketedDDP
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
from ddp.launcher import rank_info
from ddp.strategies.registry import DDP_STRATEGIES, supports_no_sync, takes_bucket_size, traits
from correctness_tests.collectives import CollectiveCheck, checking, side_group
from correctness_tests.models import MODEL_CASES

STEPS = 3
ROWS_PER_RANK = 4
MICRO_BATCHES = 2  # with accumulation: this many backward passes per step, all but the last in no_sync()

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
        if ddp.resolve_strategy(name) is ddp.TorchDDP:
            cases.append(pytest.param(name, "few_per_bucket", id=name))
        elif takes_bucket_size(name):
            cases += [pytest.param(name, case, id=f"{name}-{case}") for case in BUCKET_CASES]
        else:
            cases.append(pytest.param(name, None, id=name))
            if name not in ddp.STRATEGIES:
                reason = f"{name} takes no bucket_size_mb option: add one to its constructor to test bucket plans"
                cases.append(pytest.param(name, "few_per_bucket", id=f"{name}-buckets", marks=pytest.mark.skip(reason=reason)))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "bucket_case" in metafunc.fixturenames:
        strategies = metafunc.config.getoption("strategies") or DDP_STRATEGIES
        metafunc.parametrize("strategy, bucket_case", strategy_cases(strategies))

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    # eps well above float rounding of tiny gradients, which Adam would otherwise amplify to a full step;
    # weight decay large enough that a gradient wrongly set to zeros (instead of None) shows.
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.5),
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


def train_against_reference(strategy, bucket_case, model_name, optimizer_name, accumulate) -> list[torch.Tensor]:
    """Runs on every rank: train the strategy and the reference side by side, compare each step.
    Every rank's collectives are checked against the others' as they are issued (``collectives``)."""
    info = rank_info()
    case = MODEL_CASES[model_name]
    torch.manual_seed(0)
    reference = case.build().to(info.device)
    local = copy.deepcopy(reference)
    check = CollectiveCheck(side_group(), _namer(local))
    with checking(check):
        return _train_against_reference(info, check, case, reference, local, strategy, bucket_case, optimizer_name, accumulate)


def _train_against_reference(info, check, case, reference, local, strategy, bucket_case, optimizer_name, accumulate):
    with torch.no_grad():  # rank 0's parameters must win: start every other rank elsewhere
        for tensor in (*local.parameters(), *local.buffers()):
            if tensor.is_floating_point():
                tensor.add_(info.rank)
    model = ddp.make_ddp(strategy, local, **_strategy_options(strategy, bucket_case, local, case.has_unused_parameters))
    check.end()
    _raise_on(
        diagnose_initial(info.rank, named_values(reference), named_values(model.module))
        or diagnose_initial(info.rank, named_buffer_values(reference), named_buffer_values(model.module), kind="buffer")
    )
    if isinstance(model, BucketedDDP):
        _check_bucket_plan(model, bucket_case)
    reference_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    frozen, tied = frozen_names(reference), named_ties(reference)

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

        optimizer.zero_grad()
        if accumulate:
            micro = ROWS_PER_RANK // MICRO_BATCHES
            with model.no_sync():
                for start in range(0, ROWS_PER_RANK - micro, micro):
                    (case.loss(model(mine[start : start + micro]), my_targets[start : start + micro]) / MICRO_BATCHES).backward()
            (case.loss(model(mine[-micro:]), my_targets[-micro:]) / MICRO_BATCHES).backward()
        else:
            case.loss(model(mine), my_targets).backward()
        model.finish_gradient_synchronization()
        grads = named_gradients(model.module)  # as synchronization left them, before the optimizer reads them
        optimizer.step()
        check.end()

        _raise_on(
            diagnose_step(
                step,
                info.rank,
                info.world_size,
                reference_grads,
                grads,
                named_values(reference),
                named_values(model.module),
                frozen=frozen,
                tied=tied,
                local_grads=local_grads,
            )
        )
        # diagnose_step judges values as assert_close does. assert_close still runs because it
        # also checks dtype, device and layout.
        for (name, expected), actual in zip(reference.named_parameters(), model.module.parameters()):
            assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
        for (name, expected), actual in zip(reference.named_buffers(), model.module.buffers()):
            assert_close(actual, expected, msg=lambda m: f"buffer {name}: {m}")
    return [p.detach().cpu() for p in model.module.parameters()]


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODEL_CASES))
def test_trains_like_one_process(rank_group, strategy, bucket_case, model_name, optimizer_name, accumulate):
    if accumulate and not supports_no_sync(strategy):
        pytest.skip(f"{strategy} has no no_sync(): add that context manager to test gradient accumulation")
    per_rank = rank_group.run(train_against_reference, strategy, bucket_case, model_name, optimizer_name, accumulate)
    for rank, params in enumerate(per_rank[1:], start=1):
        for mine, rank0 in zip(params, per_rank[0]):
            assert_close(mine, rank0, rtol=0, atol=0, msg=lambda m: f"rank {rank} differs from rank 0: {m}")


def test_user_class_by_import_path(rank_group):
    """``make_ddp`` takes "package.module:ClassName": a user's own DDP runs the same tests."""
    rank_group.run(train_against_reference, "ddp.strategies.flat:FlatDDP", None, "frozen_mlp", "adamw", True)
