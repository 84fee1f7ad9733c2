"""Commands that keep several models built race within memory: contenders that do not fit
together run one at a time in alternating blocks, and one that cannot fit even alone is refused
before anything is built, with the figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ddp.bench.race as race_module
from ddp.bench.config import StepConfig
from ddp.bench.measure import measure_in_blocks
from ddp.bench.memory import GIB, fit, parameter_count
from ddp.bench.options import RoundOptions
from ddp.bench.race import race, race_configs
from ddp.bench.rank_state import parameters_of
from ddp.strategies.registry import DEFAULT_CONTENDERS

XL_PARAMETERS = 1_998_235_200
H100_BYTES = 81_559 * 2**20  # what an H100 80GB HBM3 reports


def test_xl_on_one_h100_fits_alone_but_not_three_together():
    memory = fit(race_configs(DEFAULT_CONTENDERS, {"model": "xl", "batch_size": 2, "seq_len": 128, "bucket_size_mb": 25.0}), XL_PARAMETERS, H100_BYTES, 1)
    assert not memory.together
    assert all(memory.alone.values())
    assert memory.too_large() is None
    # local and bucketed keep 16 B a parameter, torch 20, and one step's temporaries 4
    assert memory.needed_together_bytes == XL_PARAMETERS * (16 + 16 + 20 + 4)
    assert "together they need about 104.2 GiB per rank, 71.7 GiB usable of 79.6 GiB" == memory.explain()


def test_a_model_too_large_alone_is_refused_with_what_it_needs():
    parameters = 3_400_000_000
    memory = fit(race_configs(DEFAULT_CONTENDERS, {"model": "2.7b", "batch_size": 2, "seq_len": 128, "bucket_size_mb": 25.0}), parameters, H100_BYTES, 1)
    message = memory.too_large()
    assert message.startswith("torch 25 MiB, model 2.7b, batch 2, seq len 128 needs about 76.0 GiB")
    assert "use a smaller --model" in message


def test_the_estimate_reads_what_each_strategy_shards():
    """16 bytes a parameter replicated, 4 + 4 + 8/N with a sharded optimizer, 16/N fully sharded
    (``Sharding``), 4 more where the strategy keeps its gradient buckets (PyTorch's DDP): the
    3.4B-parameter model that no replicated strategy fits on one 80 GB GPU fits fully sharded on 8."""
    parameters = 3_400_000_000
    values = {"model": "2.7b", "batch_size": 1, "seq_len": 128, "bucket_size_mb": 25.0}
    configs = {name: StepConfig.of(name, values) for name in ("torch", "sharded_optimizer", "zero", "fsdp", "torch_fsdp")}
    memory = fit(list(configs.values()), parameters, H100_BYTES, 8)
    needed = {name: memory.needed_alone_bytes[config] - 4 * parameters for name, config in configs.items()}  # less the step's
    assert needed == {"torch": 20 * parameters, "sharded_optimizer": 9 * parameters, "zero": 13 * parameters,
                      "fsdp": 2 * parameters, "torch_fsdp": 2 * parameters}
    assert [name for name, config in configs.items() if not memory.alone[config]] == ["torch"]


def test_small_models_stay_together():
    configs = race_configs(DEFAULT_CONTENDERS, {"model": "mini", "batch_size": 2, "seq_len": 64, "bucket_size_mb": 1.0})
    assert fit(configs, parameter_count("mini", 2, 64), 8 * GIB, 2).together


def test_parameters_are_counted_without_building():
    assert parameter_count("tiny", 2, 16) == sum(p.numel() for p in __import__("ddp").model.build_model("tiny").parameters())
    assert parameter_count("mlp", 2, 1) > 100_000_000  # 0.4 GB of weights: built on the meta device


def test_blocks_pair_rounds_of_configurations_built_one_at_a_time(rank_group):
    configs = [StepConfig("local", "tiny", 2, 16), StepConfig("bucketed", "tiny", 2, 16, 1.0)]
    measurement, parameters = measure_in_blocks(rank_group, configs, RoundOptions.fixed(4, 1), collect=parameters_of)
    assert measurement.configs == configs
    assert len(measurement.rounds) == 4  # two blocks of two rounds, paired by index
    assert all(len(round_) == 2 and len(round_[0]) == rank_group.world_size for round_ in measurement.rounds)
    assert set(parameters) == set(configs) and len(parameters[configs[1]]) == rank_group.world_size


def test_the_race_runs_in_blocks_when_the_contenders_do_not_fit_together(rank_group, monkeypatch):
    def not_together(ranks, configs):
        return fit(configs, 10**9, 40 * GIB, ranks.world_size)  # a billion parameters each, 40 GiB: alone only

    monkeypatch.setattr(race_module, "fit_on", not_together)
    result = race(rank_group, {"model": "tiny", "batch_size": 2, "seq_len": 16, "bucket_size_mb": 1.0}, RoundOptions.fixed(2, 1))
    assert result.interleaving.startswith("one at a time in alternating blocks of rounds (they do not fit")
    assert result.weights_differ is None  # bucketed and torch trained alike, block by block
    assert {name: len(rounds) for name, rounds in result.record.round_seconds.items()} == {"local": 2, "bucketed": 2, "torch": 2}


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
