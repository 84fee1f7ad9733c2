"""Loading what a user names as ``package.module:attribute`` (their own DDP class or model
builder), with one error that says what to check."""

from __future__ import annotations

import importlib


def load_object(spec: str, what: str) -> object:
    """The attribute ``spec`` names; ``ValueError`` if the module cannot be imported or lacks it."""
    module_path, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_path), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"cannot load {what} {spec!r} ({error}): the module must be importable from this Python "
            "(check PYTHONPATH) and define that name"
        ) from None
