"""``measure_in_blocks``: configurations that do not fit in memory together, each built alone and
timed in alternating blocks of rounds (the race of ``ddp versus`` and the bucket sweep when they
do not fit together)."""

from __future__ import annotations

from collections.abc import Sequence

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.stats import relative_half_width
from ddp.bench.rounds.loop import Measurement, NotRun, free, measure
from ddp.bench.rounds.trainer import StepSetup

BLOCKS = 2  # forward then reversed order: the fewest blocks in which a linear drift cancels


def measure_in_blocks(ranks, configs: Sequence[StepConfig], policy: RoundOptions, collect=None, collect_for=None,
                      blocks: int = BLOCKS) -> tuple[Measurement | NotRun, dict]:
    """``measure`` for configurations that do not fit in memory together: each is built alone,
    runs a block of rounds and is freed, in the order given and then reversed (A B C, C B A, ...).

    Round i of a configuration's block is paired with round i of every other configuration's block
    of the same index, so each paired comparison is between steps at most one block apart instead
    of one round apart: drift slower than a block cancels in the ratios, and the reversed order
    cancels a drift that is linear over the whole race; a faster drift widens the intervals
    instead of biasing them. Every block is a fresh build with its own warm-up, so the time to
    build is not in the rounds. Rounds: ``policy.min_rounds`` in all, split evenly among the
    blocks (at least one each); the precision target and budget are not used.

    ``collect(config)``, a rank function, runs after the last block of each configuration in
    ``collect_for`` (default: all), while it is still built (e.g. ``weights_sample``); returns
    (measurement, {config: per-rank results})."""
    configs = list(configs)
    blocks = max(1, min(blocks, policy.min_rounds))
    block_policy = RoundOptions.fixed(-(-policy.min_rounds // blocks), policy.warmup_rounds)
    timings: dict[StepConfig, list] = {config: [] for config in configs}
    setups: dict[StepConfig, list[StepSetup]] = {}
    collected = {}
    for block in range(blocks):
        order = configs if block % 2 == 0 else configs[::-1]
        for config in order:
            result = measure(ranks, [config], block_policy, fixed_warmup=True)
            if isinstance(result, NotRun):
                free(ranks)
                return result, collected
            setups.setdefault(config, result.setups[0])
            timings[config] += [round_[0] for round_ in result.rounds]
            if collect is not None and block == blocks - 1 and (collect_for is None or config in collect_for):
                collected[config] = ranks.run(collect, config)
            free(ranks)
    count = min(len(rounds) for rounds in timings.values())
    rounds = [[timings[config][index] for config in configs] for index in range(count)]
    precision = max(relative_half_width([max(t.seconds for t in per_rank) for per_rank in timings[config]]) for config in configs)
    return Measurement(configs, [setups[config] for config in configs], rounds, precision, policy.target_precision), collected
