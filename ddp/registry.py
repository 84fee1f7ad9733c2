"""One registry of strategy names, and ``make_ddp``, the one way to build any of them.

The same names appear in test ids, benchmark groups, report columns and command-line options.
"""

from __future__ import annotations

import importlib

from torch import nn

from ddp.bucketed import BucketedDDP
from ddp.flat import FlatDDP
from ddp.local import LocalTraining
from ddp.naive import NaiveDDP
from ddp.overlap import OverlapDDP
from ddp.torch_ddp import TorchDDP

STRATEGIES: dict[str, type[nn.Module]] = {
    "local": LocalTraining,
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": BucketedDDP,
    "torch": TorchDDP,
}

# Strategies that train like one process on the whole batch (``local`` does not).
DDP_STRATEGIES = tuple(name for name in STRATEGIES if name != "local")

# Strategies whose constructor takes ``bucket_size_mb``.
BUCKETED_STRATEGIES = ("bucketed", "torch")

_INTERFACE = ("forward", "finish_gradient_synchronization", "no_sync")


def resolve_strategy(name: str) -> type[nn.Module]:
    """Look up a registered name, or import ``"package.module:ClassName"`` (a user's own DDP)."""
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name such as 'bucketed', got {type(name).__name__}")
    if name in STRATEGIES:
        return STRATEGIES[name]
    if ":" not in name:
        raise ValueError(
            f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}, "
            "or give your own class as 'package.module:ClassName'"
        )
    module_path, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"cannot load strategy {name!r} ({error}): the module must be importable from this "
            "Python (check PYTHONPATH) and define that class"
        ) from error
    missing = [attr for attr in _INTERFACE if not callable(getattr(cls, attr, None))]
    if missing:
        raise TypeError(f"strategy {name!r} lacks {', '.join(missing)}: a DDP class must define {', '.join(_INTERFACE)}")
    return cls


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
