"""Achieved TFLOP/s and MFU (``ddp.bench.results.flops``): the FLOPs formula on hand-worked examples, the
peak table, and what a step record carries (null on CPU and on unknown devices, never guessed)."""

from __future__ import annotations

import pytest

from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.flops import achieved_tflops, mfu, peak_tflops, workload_flops_per_token
from ddp.bench.rounds.loop import Measurement
from ddp.bench.rounds.summary import step_record
from ddp.bench.rounds.trainer import StepSetup, StepTiming
from ddp.model import MODEL_SIZES, model_flops_per_token


def test_flops_per_token_of_tiny_worked_by_hand():
    # tiny: vocab 1000, d_model 64, d_ff 256, 2 layers. Matmul weights N = 2 x (4 x 64^2 + 3 x 64 x 256)
    # + 64 x 1000 = 2 x (16,384 + 49,152) + 64,000 = 195,072; 6N = 1,170,432. Attention at seq 32:
    # 12 x 2 x 64 x 32 = 49,152. Total 1,219,584 FLOPs per token.
    assert model_flops_per_token(MODEL_SIZES["tiny"], 32) == 1_219_584
    assert workload_flops_per_token("tiny", 32) == 1_219_584
    assert workload_flops_per_token("mlp", 32) is None  # not an LM: no tokens to count


def test_mfu_of_xl_in_bf16_on_an_h100_worked_by_hand():
    # xl: vocab 10,000, d_model 1600, d_ff 6400, 48 layers. N = 48 x (4 x 1600^2 + 3 x 1600 x 6400) + 1600 x 10,000
    # = 48 x 40,960,000 + 16,000,000 = 1,982,080,000; 6N = 11,892,480,000. Attention at seq 512:
    # 12 x 48 x 1600 x 512 = 471,859,200. Total 12,364,339,200 FLOPs per token.
    flops = model_flops_per_token(MODEL_SIZES["xl"], 512)
    assert flops == 12_364_339_200
    # Batch 4 x seq 512 = 2048 tokens in 228.1 ms (the plain bf16 loop of the H100 evidence):
    # 12,364,339,200 x 2048 / 0.2281 = 111.01e12 FLOP/s; over the H100 SXM's dense bf16 peak 989.5: 11.2%.
    tflops = achieved_tflops(flops, 4 * 512, 0.2281)
    assert tflops == pytest.approx(111.01, abs=0.01)
    assert mfu(tflops, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(111.01 / 989.5, abs=1e-4)
    assert mfu(tflops, "NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(111.01 / 67.0, abs=1e-3)


@pytest.mark.parametrize(
    "device, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        # the datasheets' sparse figures halved: H100 PCIe 756* and 1,513*, NVL 1,671*, HGX B200 4.5 P*
        ("NVIDIA H100 PCIe", "tf32", 378.0),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200 NVL", "fp32", 60.0),
        ("NVIDIA GH200 480GB", "bf16", 989.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA B200", "fp32", 75.0),
        ("NVIDIA GB200", "bf16", 2500.0),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("cpu", "fp32", None),
    ],
)
def test_peaks_are_dense_and_unknown_devices_have_none(device, precision, peak):
    assert peak_tflops(device, precision) == peak


def _measurement(config: StepConfig) -> Measurement:
    setup = StepSetup(0, 10, 2, None, 3, 40)
    rounds = [[[StepTiming(0, seconds, 0.0, None), StepTiming(1, seconds, 0.0, None)]] for seconds in (0.5, 0.5, 0.5)]
    return Measurement([config], [[setup, setup]], rounds, 0.0, 0.02)


def test_step_records_carry_numerics_and_flops_and_mfu_only_where_a_peak_is_known():
    config = StepConfig("bucketed", "tiny", 2, 32, 25.0, precision="bf16", optimizer="fused", grad_comm="bf16")
    on_cpu = step_record(_measurement(config), "gloo", "cpu")
    assert on_cpu.config == config
    assert on_cpu.model_flops_per_token == 1_219_584
    # 1,219,584 x 64 tokens / 0.5 s = 156,106,752 FLOP/s
    assert on_cpu.achieved_tflops == pytest.approx(156_106_752 / 1e12)
    assert on_cpu.mfu is None
    on_h100 = step_record(_measurement(config), "nccl", "NVIDIA H100 80GB HBM3")
    assert on_h100.mfu == pytest.approx(156_106_752 / 1e12 / 989.5)
    assert on_h100.label == "bucketed 25 MiB bf16 comm" and on_h100.config.variant == "bf16 fused AdamW"


def test_names_carry_what_differs_from_the_default_numerics():
    default = StepConfig("bucketed", "xl", 2, 128, 25.0)
    assert default.test_id == "bucketed-b2-s128-bucket25mb"  # as saved before precision existed: still comparable
    assert default.group_name == "step: model xl, batch 2, seq len 128"
    bf16 = StepConfig("bucketed", "xl", 2, 128, 25.0, precision="bf16", optimizer="fused", grad_comm="bf16")
    assert bf16.test_id == "bucketed-b2-s128-bucket25mb-bf16-fused-bf16comm"
    assert bf16.group_name == "step: model xl, batch 2, seq len 128, bf16, fused AdamW"
    assert bf16.local_twin() == StepConfig("local", "xl", 2, 128, precision="bf16", optimizer="fused")
    assert StepConfig("torch", "xl", 2, 128, 25.0, precision="tf32").test_id == "torch-b2-s128-bucket25mb-tf32"


def test_reduced_precision_communication_only_where_the_strategy_takes_comm_dtype():
    with pytest.raises(ValueError, match="strategy 'naive' takes no grad_comm"):
        StepConfig("naive", "tiny", 2, 32, grad_comm="bf16")
    with pytest.raises(ValueError, match="--precision takes one of fp32, tf32, bf16, got 'fp16'"):
        StepConfig("local", "tiny", 2, 32, precision="fp16")


def test_a_comparison_of_steps_of_one_name_computed_differently_says_so(tmp_path):
    """Names leave the default options out; two runs whose steps share a name but not a
    configuration are not compared as if they were the same step."""
    from ddp.analysis.compare import compare
    from ddp.bench.results.records import load_run
    from tests import synthetic

    def run(**values):
        record = synthetic.step(synthetic.config("local", **values), [0.1] * 3)
        return load_run(synthetic.write(tmp_path / f"{len(values)}.json", synthetic.run_json([synthetic.step_benchmark(record)])))

    old, new = run(), run(seed=1)  # same name, another seed
    (row,) = compare(old, new, 0.10)
    assert row.name == "test_step[local-b2-s32]" and row.verdict.startswith("different configuration: ")


def test_mfu_with_and_without_communication_worked_by_hand():
    """tiny at batch 2 x seq 32 on an H100 in bf16: 1,219,584 FLOPs a token x 64 tokens =
    78,053,376 FLOPs a step. In rounds of 0.5 s beside a local twin at 0.4 s, MFU is
    78,053,376 / 0.5 / 989.5e12 and local's 78,053,376 / 0.4 / 989.5e12; synchronization costs
    their difference, 100 x 78,053,376 x (1/0.4 - 1/0.5) / 989.5e12 points."""
    config = StepConfig("bucketed", "tiny", 2, 32, 25.0, precision="bf16")
    setup = StepSetup(0, 10, 2, None, 3, 40)
    step_rounds, local_rounds = (0.5, 0.5, 0.5, 0.5, 0.5), (0.4, 0.4, 0.4, 0.4, 0.4)
    rounds = [[[StepTiming(r, s, 0.0, None) for r in range(2)], [StepTiming(r, local, 0.0, None) for r in range(2)]]
              for s, local in zip(step_rounds, local_rounds, strict=True)]
    measurement = Measurement([config, config.local_twin()], [[setup, setup], [setup, setup]], rounds, 0.0, 0.02)
    record = step_record(measurement, "nccl", "NVIDIA H100 80GB HBM3", 0, 1)
    flops = 78_053_376
    assert record.mfu == pytest.approx(flops / 0.5 / 989.5e12)
    assert record.local_mfu == pytest.approx(flops / 0.4 / 989.5e12)
    expected = 100 * flops * (1 / 0.4 - 1 / 0.5) / 989.5e12
    assert record.mfu_lost_points == pytest.approx(expected)
    assert record.mfu_lost_points_ci95 == pytest.approx([expected, expected])
    assert step_record(measurement, "gloo", "cpu", 0, 1).local_mfu is None  # no peak, no MFU
    assert step_record(measurement, "nccl", "NVIDIA H100 80GB HBM3", 0).mfu_lost_points is None  # not paired
