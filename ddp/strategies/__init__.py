"""The data-parallel strategies, one file each, behind one interface (``base.Strategy``), and the
registry of their names (``registry``)."""

from ddp.strategies.base import DataParallel, Strategy, gather_full_params, make_optimizer
from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.declarations import Sharding, Traits, Transfer
from ddp.strategies.flat import FlatDDP
from ddp.strategies.fsdp import FullyShardedDP
from ddp.strategies.local import LocalTraining
from ddp.strategies.naive import NaiveDDP
from ddp.strategies.overlap import OverlapDDP
from ddp.strategies.registry import (
    BUCKETED_STRATEGIES,
    DDP_STRATEGIES,
    DEFAULT_GRID_STRATEGIES,
    SHARDED_STRATEGIES,
    STRATEGIES,
    StrategyError,
    make_ddp,
    resolve_strategy,
    supports_no_sync,
    takes_bucket_size,
    traits,
)
from ddp.strategies.sharded_optimizer import ShardedOptimizer, ShardedOptimizerDDP
from ddp.strategies.torch_ddp import TorchDDP
from ddp.strategies.torch_fsdp import TorchFSDP
from ddp.strategies.zero import ZeroDDP

__all__ = [
    "BUCKETED_STRATEGIES",
    "BucketedDDP",
    "DDP_STRATEGIES",
    "DEFAULT_GRID_STRATEGIES",
    "DataParallel",
    "FlatDDP",
    "FullyShardedDP",
    "LocalTraining",
    "NaiveDDP",
    "OverlapDDP",
    "SHARDED_STRATEGIES",
    "STRATEGIES",
    "Sharding",
    "ShardedOptimizer",
    "ShardedOptimizerDDP",
    "Strategy",
    "StrategyError",
    "TorchDDP",
    "TorchFSDP",
    "Traits",
    "Transfer",
    "ZeroDDP",
    "gather_full_params",
    "make_ddp",
    "make_optimizer",
    "resolve_strategy",
    "supports_no_sync",
    "takes_bucket_size",
    "traits",
]
