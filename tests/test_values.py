"""Every value of every numeric axis (``ddp.bench.config.values``) through every consumer.

Each value's declaration is the one statement of what it means; these tests push each value the
command line takes through each consumer that reads it (the trainer's strategy options and bytes
sent, the precision switches, AdamW's builder, the memory prediction, the cost model, the
rounding the correctness reference emulates, the MFU's peak tables, the names in ids and
reports; the correctness suite's cases iterate the tables themselves) and check that the
consumer did what the declaration says. A value a consumer does not know fails here, as does a
choice the command line offers with no declaration.
"""

from __future__ import annotations

import pytest
import torch

from ddp.analysis.costmodel import Gradient, Sent
from ddp.bench.config.step_config import AXES, StepConfig
from ddp.bench.config.values import GRAD_COMM, OPTIMIZER, PRECISION, forward_autocast, numerics, sharded_compute_dtype
from ddp.bench.memory.predict import model_shape, predict_moments, step_buffers
from ddp.bench.results.flops import PEAK_TFLOPS
from ddp.bench.rounds.trainer import gradient_bytes_sent, strategy_options
from ddp.model import build_model
from ddp.strategies.declarations import Sharding

DECLARED = {"precision": PRECISION, "grad_comm": GRAD_COMM, "optimizer": OPTIMIZER}


@pytest.mark.parametrize("axis", sorted(DECLARED))
def test_the_command_line_offers_exactly_the_declared_values(axis):
    assert AXES[axis].choices == tuple(DECLARED[axis])
    assert AXES[axis].default in DECLARED[axis]


def _config(**values) -> StepConfig:
    return StepConfig("bucketed", "tiny", 2, 32, 1.0, **values)


@pytest.mark.parametrize("grad_comm", sorted(GRAD_COMM))
def test_a_gradient_dtype_reaches_the_trainer_the_prediction_and_the_cost_model(grad_comm):
    declared = GRAD_COMM[grad_comm]
    config = _config(grad_comm=grad_comm)
    # the trainer builds the strategy with the declared dtype and counts the bytes sent in it
    assert strategy_options(config).get("comm_dtype") is declared.dtype
    params = list(build_model("tiny").parameters())
    itemsize = 4 if declared.dtype is None else declared.dtype.itemsize
    assert gradient_bytes_sent(config, params) == sum(p.numel() for p in params) * itemsize
    # the memory prediction keeps bucketed's copy of its buckets in it (none where it sends fp32)
    shape = model_shape(config)
    copies = step_buffers(config, shape, 2).kept_bytes
    assert copies == (0 if declared.dtype is None else shape.trainable_bytes * itemsize // 4)
    # the cost model sends it
    gradients = [Gradient("w", 1000 * 4, backward_flops_per_token=0.0, element_size=4)]
    (sent,) = Sent(grad_comm=grad_comm).gradients("bucketed", gradients)
    assert (sent.size_bytes, sent.element_size) == (1000 * itemsize, itemsize)
    # a strategy that takes no comm_dtype sends its gradients as they are, whatever the value
    assert Sent(grad_comm=grad_comm).gradients("naive", gradients) == gradients
    # the names
    assert (grad_comm == AXES["grad_comm"].default) or f"{grad_comm}comm" in config.test_id


@pytest.mark.parametrize("grad_comm", sorted(GRAD_COMM))
def test_a_gradient_dtype_rounds_as_its_dtype_does(grad_comm):
    declared = GRAD_COMM[grad_comm]
    value = torch.tensor([1.0 + 2**-12, 3.0e-3], dtype=torch.float32)
    expected = value if declared.dtype is None else value.to(declared.dtype).float()
    torch.testing.assert_close(declared.rounded(value), expected, rtol=0, atol=0)


@pytest.mark.parametrize("precision", sorted(PRECISION))
def test_a_precision_sets_its_switches_and_reaches_every_consumer(precision):
    declared = PRECISION[precision]
    before = torch.get_float32_matmul_precision()
    with numerics(precision):
        assert torch.get_float32_matmul_precision() == declared.matmul_precision
        assert torch.backends.cudnn.allow_tf32 == declared.cudnn_tf32
    assert torch.get_float32_matmul_precision() == before
    with forward_autocast(precision, torch.device("cpu")):
        assert (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None) == declared.autocast_dtype
    # FSDP's compute dtype is the autocast dtype, for the strategies that take compute_dtype only
    assert sharded_compute_dtype(precision, "torch_fsdp") == declared.autocast_dtype
    assert sharded_compute_dtype(precision, "bucketed") is None
    fsdp = StepConfig("torch_fsdp", "tiny", 2, 32, precision=precision)
    assert strategy_options(fsdp).get("compute_dtype") == declared.autocast_dtype
    gathered = 1.0 if declared.autocast_dtype is None else declared.autocast_dtype.itemsize / 4
    assert Sent(precision=precision).gather_scale("torch_fsdp") == gathered
    # every GPU the MFU knows has a peak in it
    for _, name, peaks in PEAK_TFLOPS:
        assert precision in peaks, f"{name} has no peak for {precision}"
    assert precision == "fp32" or precision in _config(precision=precision).test_id


class ShardsInFp32(torch.nn.Module):
    """A user's parameter-sharding class whose constructor takes no ``compute_dtype``: the run
    builds it as it is under ``--precision bf16``, so it gathers fp32 parameters."""

    sharding = Sharding(parameters=True, gradients=True, optimizer_state=True)

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        pass


def test_simulate_gathers_in_the_dtype_the_run_builds_the_strategy_with():
    user_class = f"{__name__}:ShardsInFp32"
    config = StepConfig(user_class, "tiny", 2, 32, precision="bf16")
    assert "compute_dtype" not in strategy_options(config)
    assert Sent(precision="bf16").gather_scale(user_class) == 1.0
    assert Sent(precision="bf16").gather_scale("fsdp") == 0.5


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER))
def test_an_optimizer_builds_its_adamw_and_costs_its_temporaries(optimizer):
    declared = OPTIMIZER[optimizer]
    built = declared.build([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    assert isinstance(built, torch.optim.AdamW)
    assert {key: built.defaults[key] for key in declared.options} == declared.options
    config = _config(optimizer=optimizer)
    stepped = predict_moments(config, 2)["optimizer"]
    assert stepped.temporaries_bytes == declared.temporaries * model_shape(config).trainable_bytes
    assert optimizer == AXES["optimizer"].default or optimizer in config.test_id
