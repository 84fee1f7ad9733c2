"""Reduced precision trains like a single process in the same precision, within a tolerance
measured, not chosen.

Each strategy (``--strategies``, default every DDP; a user's own class too) runs the benchmark's own step (``ddp.bench.rounds.trainer.Trainer``: the code that is timed)
for ``STEPS`` steps of the ``tiny`` LM in a precision, and is compared with a single process
training the whole global batch with the same weights, data, AdamW and precision, written here
with torch's own switches (``torch.autocast``, ``torch.set_float32_matmul_precision``): the
independent reference.

**The tolerance** of a precision is derived from a second reference run in it: the same single
process, but computing the gradient as data parallelism does, each rank's shard on its own and the
shards' gradients averaged in fp32 (and, for reduced-precision communication, each shard's share
rounded to its dtype and their sum rounded again, as an all-reduce in that dtype does). That run differs from the whole-batch
reference only by the reordering and rounding any correct DDP makes, so its distance from the
reference (the *floor*) is what a correct strategy may differ by. A strategy passes when both its
largest and its mean absolute difference from the reference are within ``FLOOR_FACTOR`` times the
floor's, plus ``FP32_SLACK`` for the last-bit differences of fp32 sums in another order.
Because AdamW moves every weight by about the learning rate whatever its gradient's size, the
largest difference alone cannot tell a strategy that never communicates from a correct one; the
mean can (``tests/test_precision_harness.py`` checks that the tolerance fails such a strategy).

**Reduced-precision communication, exactly** (every ``--grad-comm`` of ``GRAD_COMM`` that sends
another dtype: bf16, fp16): on a model with a parameter used on one rank only and one used on
none, with and without ``no_sync()``, each gradient ``bucketed`` and ``torch`` leave must be the
sum in that dtype of the ranks' own gradients, bit for bit (``test_reduced_communication_sums_what_each_rank_sent``).

**Reduced-precision communication against fp32 communication**: ``bucketed`` and ``torch`` run
the same steps both ways; the relative difference of their parameters is printed (``pytest -s``) and recorded
(``record_property``); they must differ (the option does something), no weight by more than AdamW
can move two runs apart (``ADAMW_REACH``), and in sum by less than ``REDUCED_COMM_MEAN_SHARE`` of that.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist

from correctness_tests.models import MODEL_CASES
from correctness_tests.precision_reference import (
    BATCH_SIZE,
    BUCKET_SIZE_MB,
    FLOOR_FACTOR,
    FP32_SLACK,
    MODEL,
    SEQ_LEN,
    STEPS,
    train_and_references,
    within_tolerance,
)
from correctness_tests.selection import only_those_taking, strategies_under_test, takes
from ddp.bench.config.shape import cannot_run
from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.values import GRAD_COMM
from ddp.bench.config.workloads import build_workload, rank_batches
from ddp.bench.rounds.trainer import LEARNING_RATE, Trainer
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import gather_full_params
from ddp.strategies.registry import make_ddp, supports_no_sync, takes_bucket_size, takes_comm_dtype, traits

ADAMW_REACH = 2 * LEARNING_RATE * sum(math.sqrt(step) for step in range(1, STEPS + 1))
"""How far apart two AdamW runs from the same weights can drift per weight in ``STEPS`` steps,
whatever their gradients: a bias-corrected Adam step moves a weight by at most ``lr * sqrt(t)`` at
step t (Cauchy-Schwarz on the moments), each run one way. (Measured: a strategy that never
communicates reaches 6e-4 = 2 * 3 * lr on some weights.)"""
REDUCED_COMM_MEAN_SHARE = 0.01
"""Reduced-precision communication against fp32: the parameters' summed absolute difference must
stay below this share of every weight drifting ``ADAMW_REACH`` apart. bf16 rounds each gradient by
at most 2**-9 of itself (fp16 by 2**-11, within its range), which turns round only the updates of gradients near zero; a share of 1% of
the worst case leaves room for those and none for a wrong sum (measured on the tiny LM: 0.017% with fp32 steps, 0.007% with bf16)."""


def relative_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, float]:
    """``max``: the largest, over parameter tensors, of max |a - e| / max |e|; ``mean``: sum |a - e| /
    sum |e| over every element (elementwise ratios would blow up on weights near zero)."""
    pairs = [(a.double(), e.double()) for a, e in zip(actual, expected, strict=True)]
    largest = max(((a - e).abs().max() / e.abs().max()).item() for a, e in pairs)
    total = sum((a - e).abs().sum().item() for a, e in pairs) / sum(e.abs().sum().item() for _, e in pairs)
    return {"max": largest, "mean": total}


def cases(strategies: tuple[str, ...]) -> list:
    """Every strategy of ``--strategies`` (default: every DDP) in fp32 and bf16, and with each
    reduced-precision communication (``GRAD_COMM``) where it takes ``comm_dtype``; then tf32 and the fused AdamW once each."""
    out = []
    strategies = [s for s in strategies if traits(s).communicates]
    if not strategies:
        return [pytest.param(None, id="none", marks=pytest.mark.skip(reason="no strategy under test communicates"))]
    for strategy in strategies:
        bucket = BUCKET_SIZE_MB if takes_bucket_size(strategy) else None
        comms = tuple(GRAD_COMM) if takes_comm_dtype(strategy) else ("fp32",)
        for precision in ("fp32", "bf16"):
            for comm in comms:
                config = StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, bucket, precision=precision, grad_comm=comm)
                out.append(pytest.param(config, id=f"{strategy}-{precision}{'' if comm == 'fp32' else f'-{comm}comm'}"))
    # tf32 is fp32 on CPU (and TF32 matmuls on GPUs); the fused AdamW is another implementation of the
    # same update: each once, on the first and the last strategy under test
    for strategy, numerics in ((strategies[0], {"precision": "tf32"}), (strategies[-1], {"precision": "bf16", "optimizer": "fused"})):
        bucket = BUCKET_SIZE_MB if takes_bucket_size(strategy) else None
        config = StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, bucket, **numerics)
        out.append(pytest.param(config, id=f"{strategy}-{'-'.join(numerics.values())}"))
    return out + shape_cases(strategies)


# The step's shapes (ddp.bench.config.shape), each against one process on the whole batch without
# checkpointing: accumulation over 2 and 4 micro-batches, checkpointed blocks, then both in bf16 once.
SHAPES = ({"grad_accum": 2}, {"grad_accum": 4}, {"activation_checkpointing": "blocks"})


def shape_cases(strategies: list[str]) -> list:
    """Every strategy at each of ``SHAPES``; one it cannot run skipped with the reason (``cannot_run``)."""
    out = []
    for strategy in strategies:
        bucket = BUCKET_SIZE_MB if takes_bucket_size(strategy) else None
        for shape in SHAPES:
            config = StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, bucket, **shape)
            reason = cannot_run(config)
            out.append(pytest.param(config, id=config.test_id, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    runs_both = [s for s in strategies if not cannot_run(StepConfig(s, MODEL, BATCH_SIZE, SEQ_LEN,
                                                                    BUCKET_SIZE_MB if takes_bucket_size(s) else None,
                                                                    grad_accum=2))]
    if runs_both:
        strategy = runs_both[-1]
        config = StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, BUCKET_SIZE_MB if takes_bucket_size(strategy) else None,
                            precision="bf16", grad_accum=2, activation_checkpointing="blocks")
        out.append(pytest.param(config, id=config.test_id))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    strategies = strategies_under_test(metafunc.config)
    if "config" in metafunc.fixturenames:
        metafunc.parametrize("config", cases(strategies))
    if "comm_dtype_strategy" in metafunc.fixturenames:
        metafunc.parametrize("comm_dtype_strategy", only_those_taking("comm_dtype", strategies, "reduced gradient communication"))
    if "reduced_comm" in metafunc.fixturenames:  # every --grad-comm that sends another dtype than the gradients'
        metafunc.parametrize("reduced_comm", [name for name, comm in GRAD_COMM.items() if comm.dtype is not None])


def test_trains_like_one_process_in_the_same_precision(rank_group, config: StepConfig):
    results = rank_group.run(train_and_references, config)
    for rank, result in enumerate(results[1:], start=1):
        for mine, rank0 in zip(result["trained"], results[0]["trained"]):
            torch.testing.assert_close(mine, rank0, rtol=0, atol=0, msg=lambda m: f"rank {rank} differs from rank 0: {m}")
    mine, floor, ok = within_tolerance(results)
    print(f"\n{config.test_id}: from one process max {mine['max']:.3g}, mean {mine['mean']:.3g}; floor max {floor['max']:.3g}, "
          f"mean {floor['mean']:.3g}")
    assert ok, (
        f"{config.describe()}: differs from one process in {config.precision} by max {mine['max']:.3g}, mean "
        f"{mine['mean']:.3g}; a correct DDP's reordering differs by max {floor['max']:.3g}, mean {floor['mean']:.3g} "
        f"(tolerance {FLOOR_FACTOR:g} x that + {FP32_SLACK:g})"
    )


@on_rank
def reduced_against_fp32_communication(rank: Rank, strategy: str, precision: str, reduced: str) -> list[dict]:
    """Runs on every rank: the same steps with fp32 and with ``reduced`` gradient communication."""
    info = rank.info
    trained = {}
    for comm in ("fp32", reduced):
        bucket = BUCKET_SIZE_MB if takes_bucket_size(strategy) else None
        trainer = Trainer(StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, bucket, precision=precision, grad_comm=comm), info)
        try:
            for _ in range(STEPS):
                trainer.step()
            trained[comm] = [p.detach().cpu() for p in gather_full_params(trainer.model).values()]
        finally:
            trainer.close()
    return trained


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reduced_communication_error_is_measured_and_bounded(rank_group, comm_dtype_strategy, reduced_comm, precision,
                                                             record_property):
    strategy = comm_dtype_strategy
    trained = rank_group.run(reduced_against_fp32_communication, strategy, precision, reduced_comm)[0]
    reduced, fp32 = trained[reduced_comm], trained["fp32"]
    error = relative_difference(reduced, fp32)
    record_property(f"{reduced_comm}_comm_relative_difference", error)
    print(f"\n{strategy}, {precision} step, {STEPS} steps of {MODEL}: {reduced_comm} against fp32 gradient all-reduce, "
          f"relative difference of the parameters: max {error['max']:.3g}, mean {error['mean']:.3g}")
    assert error["max"] > 0 and error["mean"] > 0, f"{reduced_comm} communication changed nothing: is comm_dtype applied?"
    largest = max((a - e).abs().max().item() for a, e in zip(reduced, fp32))
    assert largest <= ADAMW_REACH, f"a weight moved {largest:.3g} from the fp32-communication run: more than AdamW can ({ADAMW_REACH:.3g})"
    summed = sum((a - e).abs().sum().item() for a, e in zip(reduced, fp32))
    worst = ADAMW_REACH * sum(e.numel() for e in fp32)
    assert summed < REDUCED_COMM_MEAN_SHARE * worst, (
        f"{reduced_comm} communication moved the weights {summed / worst:.2%} of the furthest AdamW can; "
        f"bound {REDUCED_COMM_MEAN_SHARE:.0%}"
    )
    print(f"  summed difference: {summed / worst:.3%} of every weight drifting as far as AdamW can")


@on_rank
def reduced_sync_against_emulation(rank: Rank, strategy: str, reduced: str, accumulate: bool) -> None:
    """Runs on every rank: one synchronizing step of ``routed_mlp`` (expert 0 used on rank 0 only,
    expert 2 on none) with gradients communicated in ``reduced`` (``GRAD_COMM``), each gradient
    checked against what an all-reduce in that dtype of the ranks' own gradients gives: every
    rank's share g / world size rounded to it, the sum rounded again (exact for 2 ranks: one
    addition in that dtype), a gradient no rank produced left None."""
    info = rank.info
    sent = GRAD_COMM[reduced]
    case = MODEL_CASES["routed_mlp"]
    torch.manual_seed(0)
    module = case.build().to(info.device)
    alone = copy.deepcopy(module)
    options = sent.strategy_options()
    if takes_bucket_size(strategy):
        options["bucket_size_mb"] = 1e-4  # a few small buckets
    if takes(strategy, "find_unused_parameters"):
        options["find_unused_parameters"] = True  # PyTorch's DDP must be told (routed_mlp leaves experts unused)
    model = make_ddp(strategy, module, **options)
    inputs, targets = case.batch(4 * info.world_size, torch.Generator().manual_seed(1234))
    rows = slice(4 * info.rank, 4 * (info.rank + 1))
    mine, my_targets = inputs[rows].to(info.device), targets[rows].to(info.device)
    micro = [(mine[:2], my_targets[:2]), (mine[2:], my_targets[2:])] if accumulate else [(mine, my_targets)]
    for net in (alone, model):
        for index, (x, y) in enumerate(micro):
            context = model.no_sync() if net is model and index < len(micro) - 1 else contextlib.nullcontext()
            with context:
                (case.loss(net(x), y) / len(micro)).backward()
    model.finish_gradient_synchronization()
    for (name, own), param in zip(alone.named_parameters(), module.parameters()):
        used = torch.tensor([own.grad is not None], dtype=torch.int32, device=info.device)
        local = own.grad if own.grad is not None else torch.zeros_like(own)
        shares = [torch.empty_like(local) for _ in range(info.world_size)]
        dist.all_gather(shares, local)
        dist.all_reduce(used)
        if used.item() == 0:
            assert param.grad is None, f"{strategy}: {name} got a gradient though no rank produced one"
            continue
        expected = sent.rounded(sum(sent.rounded(share / info.world_size) for share in shares))
        torch.testing.assert_close(param.grad, expected, rtol=0, atol=0, msg=lambda m: f"{strategy}, {name}: {m}")


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_reduced_communication_sums_what_each_rank_sent(rank_group, comm_dtype_strategy, reduced_comm, accumulate):
    if rank_group.world_size > 2:
        pytest.skip("a reduced-precision sum of more than 2 ranks depends on the backend's order of additions: run with --world-size 2")
    if accumulate and not supports_no_sync(comm_dtype_strategy):
        pytest.skip(f"{comm_dtype_strategy} has no no_sync(): add that context manager to test gradient accumulation")
    rank_group.run(reduced_sync_against_emulation, comm_dtype_strategy, reduced_comm, accumulate)


class _GradientsAfterSync:
    """A step observer (``ddp.bench.config.shape.StepObserver``'s shape) keeping a copy of every
    gradient once ``finish_gradient_synchronization()`` returned, by parameter name."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.gradients: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        yield
        if name == "gradient_sync":
            self.gradients = {n: p.grad.detach().cpu().clone() for n, p in self.module.named_parameters() if p.grad is not None}


@on_rank
def synchronized_gradients(rank: Rank, config: StepConfig) -> dict:
    """Runs on every rank: the gradients the benchmark's step leaves after synchronization in its
    first step; rank 0 also the gradients of one process on the whole global batch, without checkpointing."""
    info = rank.info
    trainer = Trainer(config, info)
    try:
        observer = _GradientsAfterSync(trainer.model.module)
        trainer.step(observer)
        result = {"trained": observer.gradients}
    finally:
        trainer.close()
    if info.rank == 0:
        torch.manual_seed(config.seed)
        workload = build_workload(config.model, config.batch_size, config.seq_len, info.device)
        batches = [b for rank in range(info.world_size)
                   for b in rank_batches(workload, config.seed, rank, info.world_size, info.device, config.grad_accum)]
        inputs, targets = torch.cat([i for i, _ in batches]), torch.cat([t for _, t in batches])
        workload.loss(workload.module(inputs), targets).backward()
        result["reference"] = {n: p.grad.detach().cpu() for n, p in workload.module.named_parameters() if p.grad is not None}
    return result


@pytest.mark.parametrize("shape", [{"grad_accum": 2}, {"grad_accum": 4}, {"activation_checkpointing": "blocks"},
                                   {"grad_accum": 4, "activation_checkpointing": "blocks"}],
                         ids=["accum2", "accum4", "ckpt", "accum4-ckpt"])
@pytest.mark.parametrize("strategy", ["local", "naive", "bucketed", "torch"])
def test_a_shaped_step_synchronizes_the_whole_batch_mean(rank_group, strategy, shape):
    """AdamW hides a gradient's scale (its update is nearly the same for g and 4g), so the
    parameters alone cannot tell a step that forgot to divide each micro-batch's loss: the
    gradients after synchronization must be the whole batch's mean, as one process computes it
    (``local`` keeps its own rank's: rank 0's micro-batches only, compared likewise)."""
    config = StepConfig(strategy, MODEL, BATCH_SIZE, SEQ_LEN, BUCKET_SIZE_MB if takes_bucket_size(strategy) else None, **shape)
    results = rank_group.run(synchronized_gradients, config)
    trained, reference = results[0]["trained"], results[0]["reference"]
    if not traits(strategy).communicates:  # local: rank 0's own micro-batches, as one process on them alone
        return _check_local(config, trained, rank_group.world_size)
    assert sorted(trained) == sorted(reference)
    for name, gradient in reference.items():
        torch.testing.assert_close(trained[name], gradient, rtol=1e-4, atol=1e-7, msg=lambda m: f"{config.describe()}, {name}: {m}")


def _check_local(config: StepConfig, trained: dict, world_size: int) -> None:
    torch.manual_seed(config.seed)
    workload = build_workload(config.model, config.batch_size, config.seq_len, "cpu")
    batches = rank_batches(workload, config.seed, 0, world_size, "cpu", config.grad_accum)
    inputs, targets = torch.cat([i for i, _ in batches]), torch.cat([t for _, t in batches])
    workload.loss(workload.module(inputs), targets).backward()
    for name, param in workload.module.named_parameters():
        torch.testing.assert_close(trained[name], param.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{config.describe()}, {name}: {m}")
