"""One registry of strategy names, the checks a user's own class must pass, and ``make_ddp``,
the one way to build any strategy.

The same names appear in test ids, benchmark groups, report columns and command-line options. A
user's class is named ``"package.module:ClassName"`` and is checked here, in the parent process,
before any rank starts: an import error, a missing method or a constructor that cannot take a
module is one error saying what to fix.

A user's sharded optimizer in a course's adapter shape, a ``torch.optim.Optimizer`` subclass built
as ``cls(params, optimizer_cls, **kwargs)``, is named the same way and runs as a strategy:
``bucketed`` averages the gradients and the class is the optimizer (``sharded_optimizer_strategy``).
A user's FSDP class needs no adapter: it is a strategy, ``cls(module, compute_dtype=None)``, whose
``gather_full_params()`` returns the whole parameters by name.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ddp.importing import load_object
from ddp.strategies.base import REQUIRED_METHODS, Strategy
from ddp.strategies.bucketed import BucketedDDP
from ddp.strategies.declarations import Traits, sharding_of, traits_of
from ddp.strategies.flat import FlatDDP
from ddp.strategies.fsdp import FullyShardedDP
from ddp.strategies.local import LocalMixedPrecision, LocalTraining
from ddp.strategies.naive import NaiveDDP
from ddp.strategies.overlap import OverlapDDP
from ddp.strategies.sharded_optimizer import ShardedOptimizerDDP, sharded_optimizer_strategy
from ddp.strategies.torch_ddp import TorchDDP
from ddp.strategies.torch_fsdp import TorchFSDP
from ddp.strategies.torch_powersgd import TorchPowerSGD
from ddp.strategies.zero import ZeroDDP

# The floor: the same training with no communication at all. Every overhead is measured against it
# (a strategy's step minus the floor's, in the same round); it is this name everywhere.
FLOOR = "local"
# The floor of a strategy that computes in its own dtype (``compute_dtype``: FSDP's mixed
# precision), in the same recipe: ``StepConfig.local_twin`` pairs them.
FLOOR_MIXED = "local_mixed"
FLOORS = (FLOOR, FLOOR_MIXED)

STRATEGIES: dict[str, type[nn.Module]] = {
    FLOOR: LocalTraining,
    FLOOR_MIXED: LocalMixedPrecision,
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": BucketedDDP,
    "torch": TorchDDP,
    "torch_powersgd": TorchPowerSGD,
    "sharded_optimizer": ShardedOptimizerDDP,
    "zero": ZeroDDP,
    "fsdp": FullyShardedDP,
    "torch_fsdp": TorchFSDP,
}

# Strategies that train like one process on the whole batch (``local``, which communicates nothing,
# does not; nor does one that declares an approximation, PowerSGD's compression).
DDP_STRATEGIES = tuple(name for name, cls in STRATEGIES.items()
                       if traits_of(cls).communicates and traits_of(cls).approximation is None)

# Strategies that synchronize an approximation of the gradients (``Traits.approximation``).
APPROXIMATE_STRATEGIES = tuple(name for name, cls in STRATEGIES.items() if traits_of(cls).approximation is not None)

# Built-in strategies that split training state over the ranks (ZeRO, FSDP).
SHARDED_STRATEGIES = tuple(name for name, cls in STRATEGIES.items() if sharding_of(cls) is not None and sharding_of(cls).is_sharded)

# What a perf grid runs unless told: the replicated strategies that train exactly. The sharded ones
# are asked for by name (``--strategies local,bucketed,sharded_optimizer,fsdp``): they would add
# minutes to the default CPU run, and their headline figure, memory, needs no timing; an
# approximating one (``torch_powersgd``) too: it trades accuracy for bytes, a choice of its own;
# and ``local_mixed``, which the sharded ones are paired with.
DEFAULT_GRID_STRATEGIES = tuple(name for name in STRATEGIES
                                if name not in (FLOOR_MIXED, *SHARDED_STRATEGIES, *APPROXIMATE_STRATEGIES))

# The replicated strategies a race sets side by side unless told, and the report measures sharding
# against: the hand-written bucketed DDP (which the sharded optimizer builds on) and PyTorch's, the
# one to beat (which ZeRO builds on).
DEFAULT_CONTENDERS = ("bucketed", "torch")

# Built-in strategies whose constructor takes ``bucket_size_mb``.
BUCKETED_STRATEGIES = tuple(name for name, cls in STRATEGIES.items() if "bucket_size_mb" in inspect.signature(cls).parameters)


def is_floor(strategy: str) -> bool:
    """Whether ``strategy`` is a floor: what others are paired with, never paired itself."""
    return strategy in FLOORS


class StrategyError(ValueError):
    """A strategy name that does not resolve to a usable class; the message says what to fix."""


def resolve_strategy(name: str) -> type[nn.Module]:
    """Look up a registered name, or import and check ``"package.module:ClassName"`` (a user's own DDP)."""
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name such as 'bucketed', got {type(name).__name__}")
    if name in STRATEGIES:
        return STRATEGIES[name]
    if ":" not in name:
        raise StrategyError(
            f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}, "
            "or give your own class as 'package.module:ClassName'"
        )
    try:
        cls = load_object(name, "strategy")
    except ValueError as error:
        raise StrategyError(str(error)) from None
    if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer):
        check_sharded_optimizer_class(name, cls)
        return sharded_optimizer_strategy(cls)
    check_strategy_class(name, cls)
    return cls


def check_sharded_optimizer_class(name: str, cls: type[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer class that cannot be built as ``cls(params, optimizer_cls, **kwargs)``."""
    try:
        inspect.signature(cls).bind([], torch.optim.AdamW, lr=1e-3)
    except TypeError as error:
        raise StrategyError(
            f"strategy {name!r} is an optimizer class that cannot be built as {cls.__name__}(params, "
            f"optimizer_cls, **kwargs) ({error}): a sharded optimizer takes the parameters, the optimizer "
            "class to shard and that class's options"
        ) from None
    except ValueError:
        pass  # no signature to read: it is tried on the ranks


def check_strategy_class(name: str, cls: object) -> None:
    """Refuse what cannot serve as a strategy: not a class, a required method missing, or a
    constructor that cannot be called as ``cls(module)``."""
    if not inspect.isclass(cls):
        raise StrategyError(
            f"strategy {name!r} is a {type(cls).__name__}, not a class: name a DDP or FSDP class, "
            "or a sharded optimizer class (a torch.optim.Optimizer subclass)"
        )
    missing = [method for method in REQUIRED_METHODS if not callable(getattr(cls, method, None))]
    if missing:
        raise StrategyError(
            f"strategy {name!r} lacks {', '.join(missing)}: a DDP class must define "
            f"{', '.join(REQUIRED_METHODS)} (no_sync is optional)"
        )
    try:
        inspect.signature(cls).bind(nn.Identity())
    except TypeError as error:
        raise StrategyError(
            f"strategy {name!r} cannot be built as {cls.__name__}(module) ({error}): its constructor must "
            "take the module to wrap as its first argument, and options as keywords"
        ) from None
    except ValueError:
        pass  # no signature to read (a C extension): it is tried on the ranks


def takes_option(name: str, option: str) -> bool:
    """Whether the strategy's constructor names ``option``: how the suite learns what a strategy,
    a user's own included, can do."""
    try:
        return option in inspect.signature(resolve_strategy(name)).parameters
    except ValueError:
        return False


def takes_bucket_size(name: str) -> bool:
    """Whether the strategy takes ``bucket_size_mb`` (then the grid's bucket sizes apply to it)."""
    return takes_option(name, "bucket_size_mb")


def takes_comm_dtype(name: str) -> bool:
    """Whether the strategy takes ``comm_dtype`` (a ``torch.dtype`` to all-reduce gradients in,
    accumulated back into the gradients' own dtype; then the grid's ``--grad-comm`` applies to it)."""
    return takes_option(name, "comm_dtype")


def steps_to_settle(name: str) -> int:
    """Untimed steps a fresh build of the strategy runs before it is timed: its
    ``steps_to_settle`` (``ddp.strategies.base.Strategy``), or ``base.DEFAULT_STEPS_TO_SETTLE``."""
    return traits(name).steps_to_settle


def supports_no_sync(name: str) -> bool:
    """Whether the strategy offers ``no_sync()`` for gradient accumulation."""
    return callable(getattr(resolve_strategy(name), "no_sync", None))


def traits(name: str) -> Traits:
    """What strategy ``name`` says about itself (``base.Strategy``'s attributes). A name saved in a
    run that no longer resolves here (a user's class not importable now) gets ``Strategy``'s
    defaults: readers of saved runs never fail on it."""
    try:
        return traits_of(resolve_strategy(name))
    except (StrategyError, TypeError):
        return traits_of(Strategy)


def make_ddp(name: str, module: nn.Module, **options) -> nn.Module:
    """Wrap ``module`` in the strategy called ``name``; ``options`` go to its constructor.

    >>> model = make_ddp("bucketed", module, bucket_size_mb=25.0)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"make_ddp wraps an nn.Module, got {type(module).__name__}")
    cls = resolve_strategy(name)
    try:
        return cls(module, **options)
    except TypeError as error:
        if "unexpected keyword argument" in str(error):
            raise TypeError(f"strategy {name!r} does not take that option ({error})") from error
        raise
