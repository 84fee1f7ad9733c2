"""A strategy that computes in its own dtype (FSDP's mixed precision under ``--precision bf16``) is
paired with a floor in the same recipe, ``local_mixed``: fp32 masters, weights cast to bf16 for
forward and backward, gradients cast back. Its paired overhead is then sharding and communication,
not the difference between that recipe and ``local``'s autocast over fp32 weights."""

from __future__ import annotations

import copy

import pytest
import torch

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig, expand
from ddp.bench.config.values import forward_autocast
from ddp.bench.config.workloads import build_workload
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.trainer import strategy_options
from ddp.strategies.registry import FLOOR, FLOOR_MIXED, make_ddp

TINY = dict(model="tiny", batch_size=2, seq_len=16)


@pytest.mark.parametrize("strategy, precision, floor", [
    ("fsdp", "bf16", FLOOR_MIXED), ("torch_fsdp", "bf16", FLOOR_MIXED), ("fsdp", "fp32", FLOOR),
    ("bucketed", "bf16", FLOOR), ("torch", "bf16", FLOOR), (FLOOR, "bf16", FLOOR), (FLOOR_MIXED, "bf16", FLOOR_MIXED),
])
def test_each_strategy_is_paired_with_the_floor_of_its_recipe(strategy, precision, floor):
    config = StepConfig.of(strategy, {**TINY, "precision": precision,
                                      "bucket_size_mb": 1.0 if strategy in ("bucketed", "torch") else None})
    twin = config.local_twin()
    assert twin.strategy == floor and twin.precision == precision
    assert config.group == StepConfig.of(FLOOR, {**TINY, "precision": precision})  # one group whatever the floor
    # the floor is built in the strategy's recipe: fsdp's compute dtype, or none
    assert strategy_options(twin).get("compute_dtype") == strategy_options(config).get("compute_dtype")


def test_a_grid_with_local_has_the_floor_of_each_recipe_after_it():
    bf16 = expand({"strategy": (FLOOR, "bucketed", "fsdp"), "model": ("tiny",), "batch_size": (2,), "seq_len": (16,),
                   "bucket_size_mb": (1.0,), "precision": ("fp32", "bf16")})
    assert [(c.strategy, c.precision) for c in bf16] == [
        (FLOOR, "fp32"), ("bucketed", "fp32"), ("fsdp", "fp32"),
        (FLOOR, "bf16"), (FLOOR_MIXED, "bf16"), ("bucketed", "bf16"), ("fsdp", "bf16")]
    without_local = expand({"strategy": ("fsdp",), "model": ("tiny",), "batch_size": (2,), "seq_len": (16,), "precision": ("bf16",)})
    assert [c.strategy for c in without_local] == ["fsdp"]


def _gradients(model, inputs, targets, workload) -> dict[str, torch.Tensor]:
    with forward_autocast("bf16", torch.device("cpu")):
        loss = workload.loss(model(inputs), targets)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_mixed_floor_computes_as_fsdp_s_recipe_does():
    """``local_mixed`` against the recipe written out (the one correctness_tests hold fsdp to: a bf16
    copy of the fp32 weights computes, its gradients become the masters'): the same gradients to
    the bit, tied weights included; ``local`` under autocast is a different recipe."""
    torch.manual_seed(0)
    workload = build_workload("tiny", 2, 16, "cpu")
    inputs, targets = workload.batch(torch.Generator().manual_seed(1))
    reference = copy.deepcopy(workload.module)
    for param in reference.parameters():
        param.data = param.data.to(torch.bfloat16)
    with forward_autocast("bf16", torch.device("cpu")):
        workload.loss(reference(inputs).float(), targets).backward()
    expected = {name: p.grad.float() for name, p in reference.named_parameters()}

    floor = make_ddp(FLOOR_MIXED, copy.deepcopy(workload.module), compute_dtype=torch.bfloat16)
    masters = floor.gather_full_params()
    assert masters.keys() == expected.keys() and all(p.dtype == torch.float32 for p in floor.parameters()), \
        "every trained parameter has one fp32 master"
    with forward_autocast("bf16", torch.device("cpu")):
        workload.loss(floor(inputs), targets).backward()
    for name in masters:
        torch.testing.assert_close(floor._trained[name].grad, expected[name], rtol=0, atol=0, msg=name)

    plain = _gradients(make_ddp(FLOOR, copy.deepcopy(workload.module)), inputs, targets, workload)
    assert any(not torch.equal(plain[f"module.{name}"], expected[name]) for name in expected), \
        "local under autocast computed fsdp's recipe: the floors would not differ"


def test_the_mixed_floor_without_a_compute_dtype_is_local():
    torch.manual_seed(0)
    workload = build_workload("tiny", 2, 16, "cpu")
    inputs, targets = workload.batch(torch.Generator().manual_seed(1))
    plain = _gradients(make_ddp(FLOOR, copy.deepcopy(workload.module)), inputs, targets, workload)
    mixed = _gradients(make_ddp(FLOOR_MIXED, copy.deepcopy(workload.module)), inputs, targets, workload)
    assert plain.keys() == mixed.keys()
    for name in plain:
        torch.testing.assert_close(mixed[name], plain[name], rtol=0, atol=0)


def test_a_grid_group_pairs_fsdp_with_the_mixed_floor_and_the_others_with_local(rank_group):
    """The suite's grid group in bf16: ``bucketed`` over ``local``, ``fsdp`` over ``local_mixed``,
    all in the same rounds."""
    configs = expand({"strategy": (FLOOR, "bucketed", "fsdp"), **{k: (v,) for k, v in TINY.items()},
                      "bucket_size_mb": (1.0,), "precision": ("bf16",)})
    measurer = GridMeasurer(rank_group, configs, RoundOptions.fixed(3, 1), "group")
    floor_of = {}
    for config in configs:
        measurement, index, twin = measurer.measurement(config)
        assert measurement.configs[index] == config
        floor_of[config.strategy] = None if twin is None else measurement.configs[twin].strategy
    assert floor_of == {FLOOR: None, FLOOR_MIXED: None, "bucketed": FLOOR, "fsdp": FLOOR_MIXED}
