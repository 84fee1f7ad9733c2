"""ddp-bench: data-parallel training strategies, and the means to test and benchmark them.

>>> import ddp
>>> model = ddp.make_ddp("bucketed", module, bucket_size_mb=25.0)
>>> loss_fn(model(x), y).backward()
>>> model.finish_gradient_synchronization()
>>> optimizer.step()
"""

from ddp.base import DataParallel
from ddp.bucketed import BucketedDDP
from ddp.flat import FlatDDP
from ddp.local import LocalTraining
from ddp.naive import NaiveDDP
from ddp.overlap import OverlapDDP
from ddp.registry import BUCKETED_STRATEGIES, DDP_STRATEGIES, STRATEGIES, make_ddp, resolve_strategy
from ddp.torch_ddp import TorchDDP

__all__ = [
    "BUCKETED_STRATEGIES",
    "BucketedDDP",
    "DDP_STRATEGIES",
    "DataParallel",
    "FlatDDP",
    "LocalTraining",
    "NaiveDDP",
    "OverlapDDP",
    "STRATEGIES",
    "TorchDDP",
    "make_ddp",
    "resolve_strategy",
]
