"""Bad input fails at construction with an error that says what to do."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddp
from ddp.launcher import Rank, RankGroup, on_rank


def test_unknown_strategy_lists_known_names():
    with pytest.raises(ValueError, match="unknown strategy 'bucketted'.*naive, flat, overlap, bucketed, torch"):
        ddp.make_ddp("bucketted", nn.Linear(2, 2))


def test_plugin_that_cannot_be_imported():
    with pytest.raises(ValueError, match="cannot load strategy 'no_such_package.ddp:MyDDP'.*PYTHONPATH"):
        ddp.make_ddp("no_such_package.ddp:MyDDP", nn.Linear(2, 2))


def test_plugin_class_that_does_not_exist():
    with pytest.raises(ValueError, match="cannot load strategy 'ddp.naive:NoSuchDDP'"):
        ddp.make_ddp("ddp.naive:NoSuchDDP", nn.Linear(2, 2))


def test_plugin_without_the_interface():
    with pytest.raises(ValueError, match="lacks finish_gradient_synchronization: a DDP class must define"):
        ddp.make_ddp("torch.nn:Linear", nn.Linear(2, 2))


class TakesNoModule:
    def __init__(self) -> None:
        pass

    def forward(self, x):
        return x

    def finish_gradient_synchronization(self) -> None:
        pass


def test_plugin_whose_constructor_takes_no_module():
    with pytest.raises(ValueError, match=r"cannot be built as TakesNoModule\(module\).*take the module to wrap"):
        ddp.make_ddp(f"{__name__}:TakesNoModule", nn.Linear(2, 2))


def test_plugin_that_is_not_a_class():
    with pytest.raises(ValueError, match="is a function, not a class"):
        ddp.make_ddp("ddp.strategies.registry:make_ddp", nn.Linear(2, 2))


@pytest.mark.parametrize("strategy", ddp.BUCKETED_STRATEGIES)
@pytest.mark.parametrize("bucket_size_mb", [0, -1.0, math.inf, math.nan, "25", True, None])
def test_bucket_size_must_be_positive_and_finite(strategy, bucket_size_mb):
    with pytest.raises(ValueError, match="bucket_size_mb must be a positive finite number of MiB"):
        ddp.make_ddp(strategy, nn.Linear(2, 2), bucket_size_mb=bucket_size_mb)


@pytest.mark.parametrize("strategy", ddp.DDP_STRATEGIES)
def test_wrapping_before_a_process_group_exists(strategy):
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="needs a process group: call torch.distributed.init_process_group"):
        ddp.make_ddp(strategy, nn.Linear(2, 2))


def test_option_a_strategy_does_not_take():
    with pytest.raises(TypeError, match="strategy 'naive' does not take that option"):
        ddp.make_ddp("naive", nn.Linear(2, 2), bucket_size_mb=25.0)


def test_not_a_module():
    with pytest.raises(TypeError, match="make_ddp wraps an nn.Module, got function"):
        ddp.make_ddp("naive", lambda x: x)


def wrap_torch_around_a_module_without_parameters() -> None:
    ddp.make_ddp("torch", nn.ReLU())


def test_torch_refuses_a_module_without_trainable_parameters(rank_group):
    with pytest.raises(Exception, match="refuses a module with no parameter that requires grad"):
        rank_group.run(wrap_torch_around_a_module_without_parameters)


@on_rank
def backward_twice_without_finishing(rank: Rank, strategy: str) -> None:
    device = rank.info.device  # NCCL maps only CUDA tensors: build on the rank's device
    model = ddp.make_ddp(strategy, nn.Linear(4, 2, device=device))
    model(torch.ones(1, 4, device=device)).sum().backward()
    model(torch.ones(1, 4, device=device)).sum().backward()


@pytest.mark.parametrize("strategy", ["overlap", "bucketed"])
def test_second_backward_without_finishing_is_refused(rank_group, strategy):
    with pytest.raises(Exception, match="produced twice without finish_gradient_synchronization"):
        rank_group.run(backward_twice_without_finishing, strategy)


def test_nccl_without_enough_gpus_says_what_to_do():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs enough for 2 NCCL ranks")
    with pytest.raises(RuntimeError, match="nccl needs one GPU per rank: 2 ranks, .* found; use --backend gloo"):
        RankGroup(2, "nccl")


def test_an_optimizer_class_not_of_the_sharded_shape():
    """An Optimizer subclass is taken for a sharded optimizer, (params, optimizer_cls, **kwargs): one that is
    not is refused in the parent, as a command-line option too."""
    from ddp.bench.config.parsing import OptionError
    from ddp.bench.config.step_config import AXES

    with pytest.raises(ValueError, match=r"cannot be built as SGD\(params, optimizer_cls, \*\*kwargs\)"):
        ddp.make_ddp("torch.optim:SGD", nn.Linear(2, 2))
    with pytest.raises(OptionError, match=r"^strategy 'torch.optim:AdamW' is an optimizer class that cannot be built"):
        AXES["strategy"].parse_grid("bucketed,torch.optim:AdamW")


@pytest.mark.parametrize("compute_dtype", ["int8", "float33", torch.int32, 3])
def test_fsdp_compute_dtype_must_be_a_floating_dtype(compute_dtype):
    from ddp.strategies.fsdp import check_compute_dtype

    with pytest.raises(ValueError, match="compute_dtype must be a floating torch dtype such as torch.bfloat16"):
        check_compute_dtype(compute_dtype)
    assert check_compute_dtype("bfloat16") is torch.bfloat16 and check_compute_dtype(None) is None


class ScalarWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.scale


def wrap_torch_fsdp_around_a_scalar_parameter() -> None:
    ddp.make_ddp("torch_fsdp", ScalarWeight())


def test_torch_fsdp_names_a_scalar_parameter(rank_group):
    with pytest.raises(Exception, match=r"fully_shard cannot shard a 0-dimensional parameter \(scale\)"):
        rank_group.run(wrap_torch_fsdp_around_a_scalar_parameter)
