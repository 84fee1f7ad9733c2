"""``python -m ddp buckets``: the measured sweep of bucket caps, run as a user runs it, to its end:
every cap measured against ``local``, the best one named with whether its interval resolves it,
and the cost model's advice beside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp.bench.rounds.buckets import Sweep
from tests import synthetic


@pytest.mark.slow
def test_the_sweep_names_the_best_measured_cap_and_the_advice():
    done = subprocess.run(
        [sys.executable, "-m", "ddp", "buckets", "--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--strategies",
         "bucketed", "--bucket-sizes", "0.1,1", "--rounds", "2", "--max-rounds", "2", "--world-size", "2", "--backend", "gloo"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"measured best cap for bucketed: (0\.1|1) MiB \((resolved|not resolved from the next best)", done.stdout)
    assert "recommends for bucketed" in done.stdout and "best cap MiB" in done.stdout


def test_the_best_cap_is_the_smallest_overhead_and_resolved_only_apart_from_every_other():
    def record(cap: float, overhead: float, spread: float):
        config = synthetic.config("bucketed", bucket_size_mb=cap)
        rounds = [0.1 + overhead + d for d in (-spread, 0.0, spread)]
        return synthetic.step(config, rounds, local_rounds=[0.1] * 3)

    apart = Sweep([record(1.0, 0.02, 0.0), record(10.0, 0.01, 0.0)], [])
    assert apart.best("bucketed").config.bucket_size_mb == 10.0 and apart.resolved_best("bucketed")
    overlapping = Sweep([record(1.0, 0.02, 0.01), record(10.0, 0.015, 0.01)], [])
    assert overlapping.best("bucketed").config.bucket_size_mb == 10.0 and not overlapping.resolved_best("bucketed")
