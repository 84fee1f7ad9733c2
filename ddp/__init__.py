"""ddp-bench: data-parallel training strategies, and the means to test and benchmark them.

>>> import ddp
>>> model = ddp.make_ddp("bucketed", module, bucket_size_mb=25.0)
>>> loss_fn(model(x), y).backward()
>>> model.finish_gradient_synchronization()
>>> optimizer.step()

The package is layered, each layer importing only those before it: ``ddp.strategies`` (the
strategies and their registry) and ``ddp.model``; ``ddp.launcher`` (the ranks); ``ddp.bench``
(options, the one training step, the saved-run schema, the all-reduce benchmark); ``ddp.analysis``
(figures, reports, plots, the cost model); ``ddp.cli`` (argument parsing and printing only).
"""

from ddp import strategies as _strategies
from ddp.strategies import *  # noqa: F403 (the strategies' exports are the package's)

__all__ = list(_strategies.__all__)
