"""A configuration built from a kept model (``ddp.bench.rounds.reuse``) is indistinguishable from a
fresh build: the reference is the same configuration built fresh, in the same rank process.

Checked per strategy that replicates, after a different strategy trained the kept model for a few
steps: every parameter and buffer identical bit for bit before the first step, the same first
loss, the same weights bit for bit after three steps, a fresh optimizer (no state before its first
step), the same hooks on the parameters as a fresh build (nothing of the previous strategy left),
and its step time within the range of the fresh build's. What is not restorable (sharding
strategies, ``--compile on``, checkpointing, a user's model or class) is built fresh. On CUDA the
own peak is compared as well, in ``gpu-check`` (its ``layout`` stage).
"""

from __future__ import annotations

import statistics
from unittest import mock

import pytest
import torch

from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds import rank_state
from ddp.bench.rounds.rank_state import RankBench
from ddp.bench.rounds.reuse import KeptModels, attached, restorable, workload_key
from ddp.launcher import Rank, on_rank

BASE = dict(model="tiny", batch_size=2, seq_len=32, bucket_size_mb=1.0)
TIMED_STEPS = 12


def _hooks(module: torch.nn.Module) -> list[int]:
    return [len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {}) for p in module.parameters()]


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list:
    """Each parameter's step count and moments, as plain numbers (compared exactly)."""
    return [(float(state["step"]), state["exp_avg"].tolist(), state["exp_avg_sq"].tolist())
            for state in optimizer.state.values()]


def _first_loss(trainer) -> float:
    inputs, targets = trainer.batches[-1]
    with torch.no_grad():
        return trainer._forward_loss(inputs, targets).item()


@on_rank
def built_both_ways(rank: Rank, previous: StepConfig, config: StepConfig) -> dict:
    """``config`` built from the model ``previous`` trained and released, and built fresh."""
    info = rank.info
    reused_bench, fresh_bench = RankBench(), RankBench()
    reused_bench.kept.enabled = True
    # Each build's steps are its strategy's settling ones alone: steps added while a step still
    # changes are decided on its times, and two builds would train different numbers of steps.
    with mock.patch.object(rank_state, "still_changing", lambda seconds: False):
        reused_bench.prepare(info, [previous], warmup_steps=2, count_memory=False)
        reused_bench._build(info, [config], warmup_steps=0)  # releases previous, keeping its model
        reused = reused_bench.trainers[config]
        fresh_bench._build(info, [config], warmup_steps=0)
        fresh = fresh_bench.trainers[config]
    result = {
        "restores": reused_bench.kept.restores, "builds": reused_bench.kept.builds,
        "initial_equal": all(torch.equal(a, b) for a, b in zip(_state(reused.workload.module).values(),
                                                               _state(fresh.workload.module).values())),
        "hooks": (_hooks(reused.workload.module), _hooks(fresh.workload.module)),
        "optimizer_equal": _optimizer_state(reused.optimizer) == _optimizer_state(fresh.optimizer),
        "losses": (_first_loss(reused), _first_loss(fresh)),
    }
    # steps_to_settle steps were run by _build already; three more, then the weights again
    for _ in range(3):
        reused.step()
        fresh.step()
    result["trained_equal"] = all(torch.equal(a, b) for a, b in zip(_state(reused.workload.module).values(),
                                                                    _state(fresh.workload.module).values()))
    times = {"reused": [], "fresh": []}
    peaks = {"reused": [], "fresh": []}
    for _ in range(TIMED_STEPS):  # alternated, so that drift falls on both
        for name, trainer in (("reused", reused), ("fresh", fresh)):
            timing = trainer.step()
            times[name].append(timing.step_seconds)
            peaks[name].append(timing.peak_memory_bytes)  # a step's own CUDA peak; None on CPU
    result["times"], result["peaks"] = times, peaks
    reused_bench.release(info)
    fresh_bench.release(info)
    return result


@pytest.mark.parametrize("previous, strategy, precision", [
    ("torch", "bucketed", "fp32"), ("bucketed", "torch", "fp32"), ("overlap", "naive", "fp32"), ("flat", "local", "fp32"),
    # local_mixed takes the parameters out of the module for its masters: close() must put them back
    ("local_mixed", "bucketed", "bf16"),
])
def test_a_reused_model_trains_as_a_fresh_build(rank_group, previous, strategy, precision):
    config = StepConfig.of(strategy, {**BASE, "precision": precision})
    before = StepConfig.of(previous, {**BASE, "precision": precision})
    for result in rank_group.run(built_both_ways, before, config):
        assert result["restores"] == 1 and result["builds"] == 1, "the second build must come from the kept model"
        assert result["initial_equal"], "restored weights differ from a fresh build's"
        reused_hooks, fresh_hooks = result["hooks"]
        assert reused_hooks == fresh_hooks, f"{previous}'s hooks left on the model: {reused_hooks} vs {fresh_hooks}"
        assert result["optimizer_equal"], "the optimizer's state after the settling steps differs: not fresh"
        loss, fresh_loss = result["losses"]
        assert loss == fresh_loss
        assert result["trained_equal"], "three steps from the kept model trained differently from a fresh build"
        reused, fresh = result["times"]["reused"], result["times"]["fresh"]
        assert min(fresh) * 0.9 <= statistics.median(reused) <= max(fresh) * 1.1, (reused, fresh)
        reused_peaks, fresh_peaks = result["peaks"]["reused"], result["peaks"]["fresh"]
        if None not in reused_peaks:  # on CUDA: the same own peak, to the allocator's rounding
            assert min(fresh_peaks) * 0.99 <= statistics.median(reused_peaks) <= max(fresh_peaks) * 1.01, (
                reused_peaks, fresh_peaks)


def test_what_is_not_restorable_is_built_fresh():
    assert restorable(StepConfig.of("bucketed", BASE))
    assert restorable(StepConfig.of("torch", BASE))
    assert not restorable(StepConfig.of("fsdp", BASE))
    assert not restorable(StepConfig.of("torch_fsdp", BASE))
    assert not restorable(StepConfig.of("zero", BASE))
    assert not restorable(StepConfig.of("bucketed", {**BASE, "compile": "on"}))
    assert not restorable(StepConfig.of("bucketed", {**BASE, "activation_checkpointing": "blocks"}))


def test_a_model_missing_a_parameter_is_not_kept():
    config = StepConfig.of("bucketed", BASE)
    kept = KeptModels(enabled=True)
    torch.manual_seed(config.seed)
    whole = kept.workload(config, torch.device("cpu"))
    kept.give_back(config, whole)
    assert kept.spares[workload_key(config)] == [whole]
    emptied = kept.workload(config, torch.device("cpu"))
    assert emptied is whole and kept.restores == 1
    del emptied.module.ln_final._parameters["weight"]  # a strategy that took a parameter out and left it out
    kept.give_back(config, emptied)
    assert kept.spares[workload_key(config)] == [], "a module without its parameters was kept for the next build"


def test_a_model_with_a_hook_left_on_it_is_not_kept():
    module = torch.nn.Linear(2, 2)
    assert attached(module) is None
    module.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert "hook" in attached(module)
    module = torch.nn.Linear(2, 2)
    module.register_forward_hook(lambda *a: None)
    assert "_forward_hooks" in attached(module)


@on_rank
def built_together(rank: Rank, configs: list[StepConfig]) -> dict:
    """``configs`` (one workload) built in one ``prepare``, as a group's are, and each built fresh alone."""
    together = RankBench()
    together.kept.enabled = True
    with mock.patch.object(rank_state, "still_changing", lambda seconds: False):
        together.prepare(rank.info, configs, warmup_steps=0, count_memory=False)
        alone = {}
        for config in configs:
            bench = RankBench()
            bench._build(rank.info, [config], warmup_steps=0)
            alone[config] = bench
    result = {"restores": together.kept.restores, "builds": together.kept.builds, "equal": []}
    for config in configs:
        a, b = together.trainers[config], alone[config].trainers[config]
        result["equal"].append(all(torch.equal(x, y) for x, y in zip(_state(a.workload.module).values(),
                                                                     _state(b.workload.module).values())))
        alone[config].release(rank.info)
    together.release(rank.info)
    return result


def test_configurations_built_together_are_filled_from_the_first_ones_copy(rank_group):
    """A group's configurations are built together, every module in use: each after the first is
    allocated uninitialised and filled from the first's copy, and trains as a fresh build does."""
    configs = [StepConfig.of(name, BASE) for name in ("local", "bucketed", "torch")]
    for result in rank_group.run(built_together, configs):
        assert result["builds"] == 1 and result["restores"] == 2, result
        assert all(result["equal"]), f"trained weights differ from a fresh build's: {result['equal']}"
