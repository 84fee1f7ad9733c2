"""What fits in memory, from the prediction (``ddp.bench.memory.predict``): commands that keep several
models built race within memory (contenders that do not fit together run one at a time in
alternating blocks, one that cannot fit even alone is refused before anything is built, with the
figures); the grid skips a configuration predicted not to fit and runs the next; the largest batch
that fits. The prediction itself is held to PyTorch's MemTracker in test_memory_prediction.py."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp.bench.rounds.race as race_module
from ddp.analysis.markdown import write_report
from ddp.bench.config.options import RoundOptions, grid_defaults
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.fake_step import run_fake_step
from ddp.bench.memory.predict import (
    GIB,
    HEADROOM,
    Fit,
    NotBuilt,
    device_memory_bytes,
    fit,
    largest_batch,
    parameter_count,
    predict,
    predict_moments,
    predict_or_none,
    too_large,
    usable_bytes,
)
from ddp.bench.memory.state import StateMemory
from ddp.bench.results.records import load_run
from ddp.bench.rounds.blocks import measure_in_blocks
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.loop import NotRun
from ddp.bench.rounds.race import race, race_configs
from ddp.bench.rounds.rank_state import release, weights_sample
from ddp.bench.rounds.trainer import own_peak_bytes
from ddp.launcher import Rank, RankInfo
from ddp.strategies.registry import DEFAULT_CONTENDERS, FLOOR
from tests import synthetic

XL_PARAMETERS = 1_998_235_200
H100_BYTES = 81_559 * 2**20  # what an H100 80GB HBM3 reports


@pytest.mark.slow
def test_xl_on_one_h100_fits_alone_but_not_three_together():
    """Between steps local keeps 12 bytes a parameter (fp32 weights, AdamW's two moments; its
    gradients are freed by zero_grad), bucketed and torch 16 (their buckets, which bucketed's
    gradients are views of); the largest step needs 8 more (gradients and AdamW's temporaries):
    52 bytes a parameter together, 97 GiB for xl, against 71.7 usable of an H100's 79.6."""
    configs = race_configs(DEFAULT_CONTENDERS, {"model": "xl", "batch_size": 2, "seq_len": 128, "bucket_size_mb": 25.0})
    memory = fit(configs, H100_BYTES, 1)
    assert not memory.together
    assert all(memory.alone.values())
    assert memory.too_large() is None
    assert memory.needed_together_bytes == pytest.approx(52 * XL_PARAMETERS, rel=0.01)
    assert memory.explain().startswith("together they need about 96.") and "71.7 GiB usable of 79.6 GiB" in memory.explain()


def test_each_group_of_ranks_stepping_a_configuration_holds_its_own_peak():
    """Two groups of ranks on the same devices each keep what their own step held at its peak (on
    CUDA the caching allocator, on CPU glibc's heap): the same configuration built by two groups
    needs twice its predicted peak, not twice its kept state and one step. On this project's
    machine `small` at 2 x 64 with PyTorch's DDP and its twin in two groups was predicted to fit
    with one step counted, and the host's out-of-memory killer ended a rank."""
    config = StepConfig("torch", "small", 2, 64, 1.0)
    peak = predict(config, 2).total_bytes
    assert fit([config], H100_BYTES, 2).needed_together_bytes == peak
    assert fit([config, config], H100_BYTES, 2).needed_together_bytes == 2 * peak
    twin = config.local_twin()
    pair = fit([config, twin], H100_BYTES, 2).needed_together_bytes
    assert fit([config, twin, config, twin], H100_BYTES, 2).needed_together_bytes == 2 * pair


@pytest.mark.parametrize(
    ("backend", "world_size", "gpus", "local_rank", "shares"),
    [
        ("gloo", 2, 1, 0, 2),  # 2 gloo ranks over one GPU's CUDA tensors: half each
        ("gloo", 2, 1, 1, 2),
        ("gloo", 3, 2, 0, 2),  # ranks 0 and 2 on GPU 0, rank 1 alone on GPU 1
        ("gloo", 3, 2, 1, 1),
        ("nccl", 2, 2, 1, 1),  # NCCL: a GPU per rank
        ("nccl", 1, 1, 0, 1),
    ],
)
def test_ranks_sharing_a_gpu_are_each_given_their_share_of_it(monkeypatch, backend, world_size, gpus, local_rank, shares):
    """The device's properties injected: on a machine without a GPU the CUDA branch runs all the same."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": H100_BYTES}))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    rank = Rank(RankInfo(local_rank, world_size, backend, torch.device("cuda", local_rank % gpus)))
    assert device_memory_bytes(rank) == H100_BYTES // shares


@pytest.mark.slow
def test_a_default_gpu_run_pairs_its_xl_steps_with_their_twin_where_the_pairs_fit_one_h100():
    """The headline figures (overhead over local, local's MFU, the points of MFU lost) need the twin
    in the same rounds: the GPU grid interleaves it. Counting the three processes of the default
    layout on each GPU (two timing groups and the tracer: ``PROCESS_BYTES`` each), every pair at
    batch 2 x 1,024 fits one 80 GB GPU; at batch 4 the twin gives way where a strategy keeps
    gradient buffers (bucketed, torch: 78.4 GiB together), on an H200 none does."""
    grid = grid_defaults("nccl", "cuda")
    assert grid.interleave == FLOOR and grid.model == "xl" and grid.values("precision") == ("bf16",)
    h200_bytes = 143_771 * 2**20
    for world_size in (1, 2):
        apart = {c.test_id for c in grid.configs() if c.strategy != FLOOR
                 and not fit([c, c.local_twin()], H100_BYTES, world_size, processes=3, device="cuda").together}
        assert apart == {c.test_id for c in grid.configs() if c.batch_size == 4 and c.strategy in ("bucketed", "torch")}
        assert all(fit([c, c.local_twin()], h200_bytes, world_size, processes=3, device="cuda").together
                   for c in grid.configs())


def test_a_steps_peak_does_not_count_what_other_configurations_hold_on_the_gpu():
    """CUDA's max_memory_allocated counts every configuration resident on the rank: local on xl at
    batch 4 x 128 peaks at 38.2 GiB alone (the H100 evidence), and beside a bucketed twin holding
    32.5 GiB the allocator reads 70.7 GiB. What the twin held at the step's start is taken off."""
    own_resident, twin_resident, growth = 30.0 * GIB, 32.5 * GIB, 8.2 * GIB
    assert own_peak_bytes(own_resident + twin_resident + growth, own_resident + twin_resident, own_resident) == own_resident + growth
    assert own_peak_bytes(int(38.2 * GIB), int(30.0 * GIB), int(30.0 * GIB)) == int(38.2 * GIB)  # alone: as measured
    assert own_peak_bytes(int(38.2 * GIB), int(30.0 * GIB), None) == int(38.2 * GIB)  # resident unknown: everything
    # less allocated at the start than it held once (a cache freed since): nothing to take off
    assert own_peak_bytes(int(38.2 * GIB), int(29.0 * GIB), int(30.0 * GIB)) == int(38.2 * GIB)


def test_a_model_too_large_alone_is_refused_with_what_it_needs():
    configs = race_configs(DEFAULT_CONTENDERS, {"model": "2.7b", "batch_size": 2, "seq_len": 128, "bucket_size_mb": 25.0})
    message = fit(configs, H100_BYTES, 1).too_large()
    assert message.startswith("torch 25 MiB, model 2.7b, batch 2, seq len 128 is predicted to need 76.1 GiB per rank")  # 24 B a parameter at its step
    assert "use a smaller --model" in message and "python -m ddp memory" in message


def test_the_prediction_reads_what_each_strategy_shards():
    """At the optimizer step a rank holds parameters, gradients and AdamW's moments as its
    strategy's ``Sharding`` says (16 bytes a parameter replicated, 4 + 4 + 8/N with a sharded
    optimizer, 16/N fully sharded), and PyTorch's DDP its buckets besides (4 more): the
    3.4B-parameter model that no replicated strategy fits on one 80 GB GPU fits sharded on 8."""
    values = {"model": "2.7b", "batch_size": 1, "seq_len": 128, "bucket_size_mb": 25.0}
    configs = {name: StepConfig.of(name, values) for name in ("torch", "sharded_optimizer", "zero", "fsdp", "torch_fsdp")}
    parameters = parameter_count("2.7b", 1, 128)
    # bytes a parameter on each of 8 ranks: parameters, gradients, AdamW's moments, buckets kept besides
    expected = {"torch": (4, 4, 8, 4), "sharded_optimizer": (4, 4, 1, 0), "zero": (4, 4, 1, 4),
                "fsdp": (0.5, 0.5, 1, 0), "torch_fsdp": (0.5, 0.5, 1, 0)}
    for name, config in configs.items():
        at_step = predict_moments(config, 8)["optimizer"]
        held = (at_step.parameters_bytes, at_step.gradients_bytes, at_step.optimizer_state_bytes, at_step.communication_bytes)
        assert held == pytest.approx(tuple(size * parameters for size in expected[name]), rel=1e-6), name
    memory = fit(list(configs.values()), H100_BYTES, 8)
    assert [name for name, config in configs.items() if not memory.alone[config]] == ["torch"]


def test_small_models_stay_together():
    configs = race_configs(DEFAULT_CONTENDERS, {"model": "mini", "batch_size": 2, "seq_len": 64, "bucket_size_mb": 1.0})
    assert fit(configs, 8 * GIB, 2).together


def test_largest_batch_is_the_edge_of_what_fits():
    config = StepConfig("bucketed", "small", 1, 512, 25.0)
    memory = 8 * GIB
    largest = largest_batch(config, 2, memory)
    assert largest >= 1
    assert predict(dataclasses.replace(config, batch_size=largest), 2).total_bytes <= usable_bytes(memory)
    assert predict(dataclasses.replace(config, batch_size=largest + 1), 2).total_bytes > usable_bytes(memory)
    assert largest_batch(config, 2, GIB // 2) == 0  # not even batch 1: its states alone are 1.9 GiB


def test_the_line_through_two_batches_is_the_trace_at_the_batch():
    """The prediction traces batch 1 and 2 and extends the line; the trace at batch 6 itself agrees
    within a few KiB (rounding of the line)."""
    one, two, six = (run_fake_step("mini", batch, 64, "bf16") for batch in (1, 2, 6))
    line = two.at_batch(one, 5)
    assert abs(line.forward_peak.total - six.forward_peak.total) < 64 * 1024
    assert max(abs(a.total - b.total) for a, b in zip(line.backward, six.backward, strict=True)) < 64 * 1024


def test_a_grid_skips_what_is_predicted_not_to_fit_and_runs_the_next(rank_group):
    small, large = StepConfig("local", "tiny", 2, 16), StepConfig("local", "tiny", 64, 128)
    memory_bytes = math.ceil(predict(small, rank_group.world_size).total_bytes / (1 - HEADROOM))  # small just fits
    measurer = GridMeasurer(rank_group, [large, small], RoundOptions.fixed(2, 1), "off", memory_bytes=memory_bytes)
    assert predict(large, rank_group.world_size).total_bytes > usable_bytes(memory_bytes)
    skipped = measurer.measurement(large)
    assert isinstance(skipped, NotRun) and isinstance(skipped.marker, NotBuilt)
    reason = skipped.reason(rank_group.world_size)
    assert reason.startswith("predicted not to fit: local, model tiny, batch 64, seq len 128") and "not built" in reason
    measured = measurer.measurement(small)
    assert not isinstance(measured, NotRun) and len(measured[0].rounds) == 2
    rank_group.run(release)


def test_parameters_are_counted_without_building():
    assert parameter_count("tiny", 2, 16) == sum(p.numel() for p in __import__("ddp").model.build_model("tiny").parameters())
    assert parameter_count("mlp", 2, 1) > 100_000_000  # 0.4 GB of weights: built on the meta device


def test_blocks_pair_rounds_of_configurations_built_one_at_a_time(rank_group):
    configs = [StepConfig("local", "tiny", 2, 16), StepConfig("bucketed", "tiny", 2, 16, 1.0)]
    measurement, parameters = measure_in_blocks(rank_group, configs, RoundOptions.fixed(4, 1), collect=weights_sample)
    assert measurement.configs == configs
    assert len(measurement.rounds) == 4  # two blocks of two rounds, paired by index
    assert all(len(round_) == 2 and len(round_[0]) == rank_group.world_size for round_ in measurement.rounds)
    assert set(parameters) == set(configs) and len(parameters[configs[1]]) == rank_group.world_size


@pytest.mark.slow
def test_the_race_runs_in_blocks_when_the_contenders_do_not_fit_together(rank_group, monkeypatch):
    def not_together(ranks, configs):
        return Fit(False, dict.fromkeys(configs, True), 50 * GIB, dict.fromkeys(configs, 20 * GIB), 40 * GIB)

    monkeypatch.setattr(race_module, "fit_on", not_together)
    result = race(rank_group, {"model": "tiny", "batch_size": 2, "seq_len": 16, "bucket_size_mb": 1.0}, RoundOptions.fixed(2, 1))
    assert result.interleaving.startswith("one at a time in alternating blocks of rounds (they do not fit")
    assert result.weights_differ is None  # bucketed and torch trained alike, block by block
    assert {name: len(rounds) for name, rounds in result.record.round_seconds.items()} == {"local": 2, "bucketed": 2, "torch": 2}


def test_the_race_tells_a_contender_that_trains_differently_from_a_sample_of_its_weights(rank_group):
    """The ranks hand the parent each parameter's norm and evenly spaced elements, not the model
    (``weights_sample``): enough to see that a DDP that never synchronizes trained otherwise."""
    values = {"model": "tiny", "batch_size": 2, "seq_len": 16, "bucket_size_mb": 1.0}
    result = race(rank_group, values, RoundOptions.fixed(2, 1), contenders=("tests.wrong_ddps:NeverSynchronizes", "bucketed"))
    assert result.weights_differ is not None and result.weights_differ.startswith("tests.wrong_ddps:NeverSynchronizes against bucketed")


@pytest.mark.slow
def test_versus_refuses_a_model_too_large_before_building_it():
    done = subprocess.run(
        [sys.executable, "-m", "ddp", "versus", "--model", "2.7b", "--batch-size", "1", "--seq-len", "8", "--world-size", "2",
         "--backend", "gloo"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    if done.returncode == 0:
        pytest.skip("this host has the memory for 2.7b three times over")
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ddp-bench versus: error: torch 25 MiB, model 2.7b") and "GiB" in line, line


# Runs the command and, once it is done, prints its own peak resident memory (KiB) as the last line of stderr.
MEASURED = ("import resource, sys\nfrom ddp.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as exit:\n"
            "    code = exit.code\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(code)")


def run_memory_command(*arguments: str) -> tuple[subprocess.CompletedProcess, int]:
    """The command's result, its stderr without the last line, and its peak resident memory in KiB."""
    done = subprocess.run([sys.executable, "-c", MEASURED, "memory", *arguments], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[1])
    *stderr, peak_kib = done.stderr.strip().splitlines()
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "\n".join(stderr)), int(peak_kib)


@pytest.mark.slow
def test_the_memory_command_predicts_xl_on_8_ranks_without_building_it():
    """The issue's command: the table and the largest batch per strategy, xl never built (its fp32
    weights alone are 7.4 GiB; the command's whole process stays under 2 GiB)."""
    done, peak_kib = run_memory_command("--model", "xl", "--strategies", "local,torch,bucketed,sharded_optimizer,fsdp", "--world-size", "8",
                              "--batch-sizes", "1,4,16", "--seq-lens", "1024", "--device-memory", "80GiB")
    assert done.returncode == 0, done.stderr[-2000:]
    assert peak_kib < 2 * 2**20, f"{peak_kib} KiB: the model was built"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("model xl on 8 ranks: predicted peak per rank, GiB (device memory 80.0 GiB, given; 72.0 GiB usable")
    rows = {tuple(line.split()[:2]): line.split() for line in lines if line.split()[:1] and line.split()[1:2] in (["1"], ["4"], ["16"])}
    assert rows[("local", "1")][-1] == "yes" and rows[("local", "16")][-1] == "NO"
    assert float(rows[("local", "1")][4]) == pytest.approx(4 * XL_PARAMETERS / GIB, abs=0.01)  # fp32 weights, whole
    largest = lines[lines.index("largest batch per rank that fits:") + 3:]
    batches = {line.split()[0]: int(line.split()[-1]) for line in largest if line.strip()}
    assert set(batches) == {"local", "torch", "bucketed", "sharded_optimizer", "fsdp"}
    assert batches["torch"] <= batches["local"] <= batches["sharded_optimizer"] <= batches["fsdp"]


class ReadsItsData(torch.nn.Module):
    """Keeps only the positive inputs: a shape known only from the data, which no fake tensor has."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x[x > 0].reshape(-1, 8)[:1])


def build_reads_its_data(batch_size: int, seq_len: int):
    def batch(generator):
        return torch.randn(batch_size, 8, generator=generator), torch.randn(1, 8, generator=generator)

    return ReadsItsData(), batch, torch.nn.functional.mse_loss


def test_a_model_that_cannot_be_traced_has_no_prediction_and_is_built_all_the_same():
    config = StepConfig("local", f"{__name__}:build_reads_its_data", 2, 1)
    assert predict_or_none(config, 2) is None
    assert too_large(config, 2, 1) is None  # not refused: built, and a rank out of memory says so
    assert fit([config], 1, 2).together
    # a strategy named in a saved run that does not resolve here: no prediction either, no error
    assert predict_or_none(StepConfig.from_dict({"strategy": "gone", "model": "tiny", "batch_size": 2, "seq_len": 16}), 2) is None


@pytest.mark.parametrize("arguments,message", [
    (("--model", f"{__name__}:build_reads_its_data", "--seq-lens", "1"), "no prediction: model tests.test_memory:build_reads_its_data: "
     "its step could not be traced on fake tensors"),
    (("--device-memory", "80"), "--device-memory takes a size with its unit, such as 80GiB"),
    (("--world-size", "0"), "expected a whole number of 1 or more"),
    (("--strategies", "nope"), "unknown strategy 'nope'"),
    (("--model", "tiny", "--seq-lens", "4096"), "exceeds model tiny's context length"),
])
def test_the_memory_command_refuses_bad_input_in_one_line(arguments, message):
    done, _ = run_memory_command(*arguments)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ddp-bench memory: error:") and message in line, line


def test_a_step_row_saves_its_predicted_and_measured_peak_and_the_report_sets_them_side_by_side(tmp_path):
    """The prediction (made by the record) and MemTracker's peak (as a rank reports it) survive
    the saved JSON, and the report's section gives their ratio."""
    config = synthetic.config("bucketed", bucket_size_mb=1.0)
    predicted = predict(config, 2)
    tracked = {"Parameter": predicted.parameters_bytes, "Optstate": predicted.optimizer_state_bytes,
               "Total": predicted.total_bytes * 2}  # a measured peak twice the prediction: ratio 0.500
    state = StateMemory(1, 1, 1, tracked_peak_bytes=tracked)
    record = synthetic.step(config, [0.1] * 5, memory=[state, state])
    assert record.predicted_memory == predicted
    path = synthetic.write(tmp_path / "run.json", synthetic.run_json([synthetic.step_benchmark(record)]))
    (loaded,) = load_run(path).steps
    assert loaded.predicted_memory == predicted and loaded.memory.tracked_peak_bytes == [tracked, tracked]
    assert loaded.measured_peak_bytes == predicted.total_bytes * 2
    report = write_report([path], tmp_path / "report").read_text()
    section = report.split("## Peak memory per rank: predicted before building, and measured")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| bucketed 1 MiB"))
    assert f"| {predicted.moment} " in row and "| 0.500 " in row and "Parameter" in row
