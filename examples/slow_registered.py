"""A pytest plugin that slows a registered strategy, by name, as a change to its code would:

    DDP_BENCH_SLOWED=bucketed DDP_BENCH_SLOWDOWN=0.15 pytest perf_tests -p examples.slow_registered

Every benchmark of ``bucketed`` keeps its name and configuration, and its step waits 15% of its
own median step after synchronizing (``examples.slowed``: the place and the calibration), in the
parent (its declarations, which the harness reads: a warm-up long enough to calibrate) and in
every rank, whose fork server imports this module too (``ddp.launcher.preload_in_ranks``). The
regression gate's power study on default runs injects its slowdowns this way
(perf_tests/power_study.py, docs/regression-gate.md). Unset, it does nothing.
"""

from __future__ import annotations

import inspect
import os

from ddp.launcher import preload_in_ranks
from ddp.strategies import registry
from ddp.strategies.declarations import declarations, declare
from examples.slowed import SETTLE_STEPS, Slowed


def slow_registered(name: str) -> None:
    """Make the registered strategy ``name`` its ``Slowed`` self, under the same name."""
    if name not in registry.STRATEGIES:
        raise ValueError(f"DDP_BENCH_SLOWED names no registered strategy: {name!r}; one of {', '.join(registry.STRATEGIES)}")
    original = registry.STRATEGIES[name]
    if not issubclass(original, Slowed):
        slowed = type(f"Slowed{original.__name__}", (Slowed, original), {"__module__": __name__})
        slowed.__signature__ = inspect.signature(original)  # its options (the bucket cap) as the grid reads them
        declare(slowed, **declarations(original, steps_to_settle=SETTLE_STEPS))  # the strategy, warmed up to calibrate
        registry.STRATEGIES[name] = slowed


if os.environ.get("DDP_BENCH_SLOWED"):
    slow_registered(os.environ["DDP_BENCH_SLOWED"])
    preload_in_ranks(__name__)
