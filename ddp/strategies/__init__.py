"""The data-parallel strategies, one file each, behind one interface (``base.Strategy``), and the
registry of their names (``registry``)."""

from ddp.strategies.base import DataParallel, Strategy, Traits, Transfer
from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.flat import FlatDDP
from ddp.strategies.local import LocalTraining
from ddp.strategies.naive import NaiveDDP
from ddp.strategies.overlap import OverlapDDP
from ddp.strategies.registry import (
    BUCKETED_STRATEGIES,
    DDP_STRATEGIES,
    STRATEGIES,
    StrategyError,
    make_ddp,
    resolve_strategy,
    supports_no_sync,
    takes_bucket_size,
    traits,
)
from ddp.strategies.torch_ddp import TorchDDP

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
    "Strategy",
    "StrategyError",
    "TorchDDP",
    "Traits",
    "Transfer",
    "make_ddp",
    "resolve_strategy",
    "supports_no_sync",
    "takes_bucket_size",
    "traits",
]
