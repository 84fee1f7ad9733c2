"""A strategy made slower on purpose, to show that the regression gate catches a slowdown:

    DDP_BENCH_SLOWDOWN=0.15 pytest perf_tests/test_step.py --strategies local,examples.slowed:SlowedBucketed ...

``SlowedBucketed`` is ``bucketed`` that, when ``DDP_BENCH_SLOWDOWN`` is set, waits that fraction of
the time from the start of its forward to the end of its gradient synchronization, after the
synchronization: a wait that hides nothing (waiting before it would overlap the all-reduces still
in flight and cost less than asked). Unset, it is ``bucketed``.
"""

from __future__ import annotations

import os
import time

from ddp.strategies.bucketed import BucketedDDP


class SlowedBucketed(BucketedDDP):
    def forward(self, *args, **kwargs):
        self._forward_began = time.perf_counter()
        return super().forward(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        fraction = float(os.environ.get("DDP_BENCH_SLOWDOWN", "0"))
        if fraction > 0:
            time.sleep(fraction * (time.perf_counter() - self._forward_began))
