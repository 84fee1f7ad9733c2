"""Whether configurations fit in memory together, estimated before any is built.

Commands that keep several models built at once (``ddp versus``: local, bucketed and torch;
``ddp buckets``: a strategy and its ``local`` twin) ask here first. On one 80 GB GPU the xl model
(2.0B parameters) fits alone with any strategy but not three at once (about 3 x 40 GiB), and an
attempt ends in out-of-memory after minutes of building. The estimate:

- what a built configuration keeps between steps: the bytes a parameter its strategy's ``Sharding``
  says a rank holds (fp32 weights 4, gradients 4, AdamW's two moments 8, each divided by the world
  size where the strategy shards it: 16 replicated, 4 + 4 + 8/N for ZeRO-1, 16/N fully sharded;
  16 for a user's class that does not say), and 4 more where the strategy keeps its gradient
  buckets beside the gradients (``Strategy.keeps_gradient_buckets``: PyTorch's DDP). One H100 run
  (torch 2.11, xl at batch 4 x seq 128) peaked at 60.8 GiB for torch against local's 38.1 GiB, 12
  bytes a parameter more, but in a run known to keep memory of earlier configurations alive: the
  estimate keeps the lower figure, so that it never refuses what may fit;
- what only the running step needs, freed before the next configuration's step: 4 bytes a
  parameter (foreach AdamW's temporaries: local's xl peak is 38.2 GiB, about 20 bytes a
  parameter) plus the activations, which are not estimated: ``HEADROOM`` of the memory is left
  for them.

Configurations fit together when every kept state plus one step's needs fit; each fits alone
when its own does. The estimate decides between racing the configurations built together or one
at a time (``ddp.bench.measure.measure_in_blocks``), and refuses only what cannot fit even alone;
a configuration the estimate let through may still run out of memory, which the callers skip
with the rank's figures (``ddp.bench.rank_state.OutOfMemory``). The parameters are counted on the meta device (no memory, no weights).
On CPU the memory is the host's available memory shared by the ranks on it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddp.bench.config import StepConfig
from ddp.bench.workloads import build_workload
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import FP32_BYTES, REPLICATED, sharding_of
from ddp.strategies.registry import resolve_strategy, traits

STEP_BYTES_PER_PARAMETER = 4  # foreach AdamW's temporaries during the step
HEADROOM = 0.10  # of the memory, left for activations and the allocator
GIB = 2**30


def parameter_count(model: str, batch_size: int, seq_len: int) -> int:
    """Trainable and frozen parameters of a workload, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        module = build_workload(model, batch_size, seq_len, "meta").module
    return sum(p.numel() for p in module.parameters())


def kept_bytes(config: StepConfig, parameters: int, world_size: int) -> float:
    """What a built configuration keeps on a rank between steps (module docstring)."""
    sharding = sharding_of(resolve_strategy(config.strategy)) or REPLICATED
    buckets = FP32_BYTES if traits(config.strategy).keeps_gradient_buckets else 0
    return parameters * (sharding.bytes_per_parameter(world_size)["total"] + buckets)


def step_bytes(parameters: int) -> int:
    return parameters * STEP_BYTES_PER_PARAMETER


@on_rank
def device_memory_bytes(rank: Rank) -> int:
    """Runs on a rank: the memory this rank may use (its GPU's total, or its share of the host's
    available memory among the ranks on this host)."""
    info = rank.info
    if info.device.type == "cuda":
        return torch.cuda.get_device_properties(info.device).total_memory
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:  # MemAvailable counts reclaimable caches, AVPHYS does not
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    # RankGroup starts every rank on this host; torchrun says how many it started here.
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)))


@dataclass(frozen=True)
class Fit:
    """What fits of a set of configurations in ``memory_bytes``."""

    together: bool
    """All built at once, stepping one at a time."""
    alone: dict[StepConfig, bool]
    """Each one on its own."""
    needed_together_bytes: int
    needed_alone_bytes: dict[StepConfig, int]
    memory_bytes: int

    def explain(self) -> str:
        usable = self.memory_bytes * (1 - HEADROOM)
        return (f"together they need about {self.needed_together_bytes / GIB:.1f} GiB per rank, "
                f"{usable / GIB:.1f} GiB usable of {self.memory_bytes / GIB:.1f} GiB")

    def too_large(self) -> str | None:
        """A one-line error when some configuration does not fit even alone, else None."""
        large = [c for c, fits in self.alone.items() if not fits]
        if not large:
            return None
        usable = self.memory_bytes * (1 - HEADROOM)
        worst = max(large, key=lambda c: self.needed_alone_bytes[c])
        return (f"{worst.describe()} needs about {self.needed_alone_bytes[worst] / GIB:.1f} GiB per rank before "
                f"activations, more than the {usable / GIB:.1f} GiB usable of {self.memory_bytes / GIB:.1f} GiB: "
                "use a smaller --model, more ranks with a strategy that shards, or a strategy that shards more")


def fit(configs: Sequence[StepConfig], parameters: int, memory_bytes: int, world_size: int) -> Fit:
    """Whether ``configs`` (all of one workload, ``parameters`` each, on ``world_size`` ranks) fit
    together and alone."""
    usable = memory_bytes * (1 - HEADROOM)
    alone = {c: kept_bytes(c, parameters, world_size) + step_bytes(parameters) for c in configs}
    together = sum(kept_bytes(c, parameters, world_size) for c in configs) + step_bytes(parameters)
    return Fit(together <= usable, {c: need <= usable for c, need in alone.items()}, together, alone, memory_bytes)


def fit_on(ranks, configs: Sequence[StepConfig]) -> Fit:
    """``fit`` against the smallest memory among ``ranks``."""
    first = configs[0]
    parameters = parameter_count(first.model, first.batch_size, first.seq_len)
    return fit(configs, parameters, min(ranks.run(device_memory_bytes)), ranks.world_size)
