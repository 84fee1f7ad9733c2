"""``--compile on``: the model under ``torch.compile`` (``ddp.bench.rounds.trainer``), an option axis of the
grid declared in one place. A compiled step trains as the eager one does, and a strategy the
compiler cannot take is skipped with the compiler's reason, never a crash."""

from __future__ import annotations

import pytest
import torch

from ddp.bench.config.options import RoundOptions, grid_defaults, grid_options
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.loop import Measurement, NotRun, measure
from ddp.bench.rounds.rank_state import release
from ddp.bench.rounds.trainer import CannotRun, Trainer
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import gather_full_params
from ddp.strategies.registry import DDP_STRATEGIES, takes_bucket_size

pytestmark = pytest.mark.slow  # a minute or more on 2 cores: CI runs it with -m slow

STEPS = 3


def test_compile_is_an_option_of_the_grid_off_by_default():
    compiled = StepConfig("bucketed", "tiny", 2, 32, 1.0, compile="on")
    assert compiled.test_id == "bucketed-b2-s32-bucket1mb-compile"
    assert compiled.group_name == "step: model tiny, batch 2, seq len 32, compiled"
    assert compiled.local_twin() == StepConfig("local", "tiny", 2, 32, compile="on")  # the floor is compiled too
    assert StepConfig("bucketed", "tiny", 2, 32, 1.0).test_id == "bucketed-b2-s32-bucket1mb"  # off: names unchanged
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda")):
        assert grid_defaults(backend, device).values("compile") == ("off",)
    grid = grid_options({"compile": ("off", "on"), "strategy": ("local", "naive"), "model": ("tiny",), "batch_size": (2,),
                         "seq_len": (32,)}.get, "gloo", "cpu")
    assert [c.test_id for c in grid.configs()] == ["local-b2-s32", "naive-b2-s32", "local-b2-s32-compile", "naive-b2-s32-compile"]


@on_rank
def trained(rank: Rank, strategy: str) -> dict:
    """Runs on every rank: ``STEPS`` of the benchmark's step, eager and compiled, from the same
    seed; returns each one's parameters, or why the compiled one cannot run (``cannot_run``)."""
    info = rank.info
    out = {}
    for compile_ in ("off", "on"):
        config = StepConfig(strategy, "tiny", 2, 32, 1.0 if takes_bucket_size(strategy) else None, compile=compile_)
        trainer = Trainer(config, info)
        try:
            for _ in range(STEPS):
                trainer.step()
            out[compile_] = [p.detach().cpu().clone() for p in gather_full_params(trainer.model).values()]
        except CannotRun as error:
            return {"cannot_run": str(error)}
        finally:
            trainer.close()
    return out


@pytest.mark.parametrize("strategy", ["bucketed", "torch"])
def test_a_compiled_step_trains_as_the_eager_one(rank_group, strategy):
    results = rank_group.run(trained, strategy)
    if "cannot_run" in results[0]:
        pytest.skip(f"this machine cannot compile: {results[0]['cannot_run']}")
    for result in results:
        for compiled, eager in zip(result["on"], result["off"], strict=True):
            # the same arithmetic reordered by the compiler: fp32 rounding, compounded over 3 AdamW steps
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_every_strategy_compiled_is_measured_or_skipped_with_the_compilers_reason(rank_group):
    """Each strategy, compiled, either runs (and is measured) or is skipped saying that
    torch.compile failed and what to do, and the next one runs on the same ranks."""
    for strategy in ("local", *DDP_STRATEGIES):
        config = StepConfig(strategy, "tiny", 2, 32, 1.0 if takes_bucket_size(strategy) else None, compile="on")
        result = measure(rank_group, [config], RoundOptions.fixed(2, 0))
        if isinstance(result, NotRun):
            reason = result.reason(rank_group.world_size)
            assert reason.startswith(f"cannot run {config.describe()}: torch.compile failed (") and "--compile off" in reason, reason
        else:
            assert isinstance(result, Measurement) and len(result.rounds) == 2, strategy
        rank_group.run(release)


@on_rank
def compiled_graphs(rank: Rank, strategy: str) -> int:
    """Runs on every rank: the graphs AOTAutograd compiled for two steps of ``strategy`` compiled at
    a 0.05 MiB bucket cap (tiny's blocks hold 0.2 MiB of gradients each: several buckets a block)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(StepConfig(strategy, "tiny", 2, 32, 0.05, compile="on"), rank.info)
    try:
        for _ in range(2):
            trainer.step()
    except CannotRun as error:
        return str(error)
    finally:
        trainer.close()
    return counters["aot_autograd"]["total"]


def test_pytorchs_ddp_compiles_into_the_same_graphs_as_a_hand_written_strategy(rank_group):
    """Like for like: every strategy's compiled step is the same per-block graphs (one, shared by the
    identical blocks), not split by dynamo's DDPOptimizer at PyTorch's DDP's buckets only."""
    graphs = {strategy: rank_group.run(compiled_graphs, strategy)[0] for strategy in ("bucketed", "torch")}
    if any(isinstance(count, str) for count in graphs.values()):
        pytest.skip(f"this machine cannot compile: {graphs}")
    assert graphs["torch"] == graphs["bucketed"] == 1, graphs
