"""The harness's precision settings and the tolerance of correctness_tests/test_precision.py: the
tolerance must fail a strategy that does not communicate (else it could not fail at all), and
each step sets its precision and restores the previous one."""

from __future__ import annotations

import pytest
import torch

from correctness_tests.precision_reference import BATCH_SIZE, MODEL, SEQ_LEN, train_and_references, within_tolerance
from ddp.bench.config.step_config import StepConfig


@pytest.mark.ranks(2, why="with one rank, training alone is training on the whole batch")
def test_the_tolerance_catches_a_strategy_that_does_not_communicate(rank_group):
    """``local`` trains each rank's shard alone: in bf16, the precision with the widest floor, it
    must fall outside the tolerance, or the tolerance could not fail."""
    results = rank_group.run(train_and_references, StepConfig("local", MODEL, BATCH_SIZE, SEQ_LEN, precision="bf16"))
    mine, floor, ok = within_tolerance(results)
    assert not ok, f"a strategy that does not communicate passed: max {mine['max']:.3g}, mean {mine['mean']:.3g}; floor {floor}"


def test_each_step_sets_its_precision_and_restores_the_previous_one():
    from ddp.bench.config.values import numerics

    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = True
        for precision, inside in (("fp32", ("highest", False)), ("tf32", ("high", True)), ("bf16", ("highest", False))):
            with numerics(precision):
                assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == inside
            assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("medium", True)
        with pytest.raises(RuntimeError), numerics("tf32"):
            raise RuntimeError("a step that fails")
        assert torch.get_float32_matmul_precision() == "medium"  # restored even then
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]
