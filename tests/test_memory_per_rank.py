"""Memory per rank, measured as the step rows record it, agrees with each strategy's formula.

Every registered strategy is built by the benchmark's own trainer on the ``tiny`` LM and its state
counted (``ddp.bench.memory.state``). Summed over the ranks, parameters, gradients and optimizer state
must be what the strategy's ``Sharding`` says (replicated: N x 4, 4, 8 bytes a parameter; ZeRO-1:
N x 4, N x 4, 8; full sharding: 4, 4, 8) within 1% (FSDP pads each unit to a multiple of N,
bucketed strategies add a flag per tensor, AdamW a step counter per tensor). A ZeRO or FSDP rank
must also hold less than a replicated one, which is the point of sharding.
"""

from __future__ import annotations

import pytest

from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.rank_state import prepare, release
from ddp.strategies.declarations import Sharding, sharding_of
from ddp.strategies.registry import STRATEGIES, resolve_strategy, takes_bucket_size

KINDS = ("parameters", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def memory_by_strategy(rank_group):
    configs = [StepConfig(name, "tiny", 2, 16, 1.0 if takes_bucket_size(name) else None) for name in STRATEGIES]
    setups = rank_group.run(prepare, configs, 0)
    rank_group.run(release)
    return {config.strategy: [rank[i] for rank in setups] for i, config in enumerate(configs)}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_memory_per_rank_matches_the_formula(rank_group, memory_by_strategy, strategy):
    setups = memory_by_strategy[strategy]
    sharding: Sharding = sharding_of(resolve_strategy(strategy))
    world_size = len(setups)
    per_parameter = sharding.bytes_per_parameter(world_size)
    parameters = setups[0].num_parameters
    for kind in KINDS:
        measured = sum(getattr(setup.memory, f"{kind}_bytes") for setup in setups)
        expected = world_size * per_parameter[kind] * parameters
        assert measured == pytest.approx(expected, rel=0.01), f"{strategy} {kind}: {measured} bytes on {world_size} ranks, formula {expected:.0f}"


@pytest.mark.ranks(2, why="sharding saves nothing on one rank")
def test_sharding_holds_less_than_replication(rank_group, memory_by_strategy):

    def total(strategy: str) -> int:
        memory = memory_by_strategy[strategy][0].memory
        return memory.parameters_bytes + memory.gradients_bytes + memory.optimizer_state_bytes

    assert total("sharded_optimizer") < total("bucketed") and total("zero") < total("torch")
    assert total("fsdp") < total("sharded_optimizer") and total("torch_fsdp") < total("zero")


def test_formulas_read_as_the_course_writes_them():
    assert Sharding().formula == "4 + 4 + 8"
    assert Sharding(optimizer_state=True).formula == "4 + 4 + 8/N"
    assert Sharding(parameters=True, gradients=True, optimizer_state=True).formula == "16/N"
    assert Sharding(optimizer_state=True).bytes_per_parameter(4)["total"] == 10.0
