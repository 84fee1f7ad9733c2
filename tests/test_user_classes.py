"""A user's class named by import path, ``"package.module:ClassName"``, runs the correctness checks
like a registered strategy: a DDP class, an FSDP class, and a sharded optimizer class (adapted to
a strategy by the registry), some written from scratch in a course's adapter shapes."""

from __future__ import annotations

import pytest

from correctness_tests.training import train_against_reference
from ddp.strategies.registry import supports_no_sync


@pytest.mark.parametrize(
    "spec",
    [
        "ddp.strategies.flat:FlatDDP",
        "ddp.strategies.fsdp:FullyShardedDP",
        # an optimizer class (params, optimizer_cls, **kwargs): the registry adapts it to a strategy
        "ddp.strategies.sharded_optimizer:ShardedOptimizer",
        # written from scratch in a course's adapter shapes (no ddp-bench code)
        "examples.course_sharding:FSDP",
        "examples.course_sharding:ShardedOptimizer",
    ],
    ids=["ddp", "fsdp", "sharded_optimizer", "course_fsdp", "course_sharded_optimizer"],
)
@pytest.mark.parametrize("model_name", ["frozen_mlp", "tied_lm"])
def test_user_class_by_import_path(rank_group, spec, model_name):
    """``make_ddp`` takes "package.module:ClassName": a user's own DDP, FSDP or sharded optimizer
    runs the same tests."""
    rank_group.run(train_against_reference, spec, None, model_name, "adamw", 2 if supports_no_sync(spec) else 1)


