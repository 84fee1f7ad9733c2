"""A strategy's declarations are its own (``ddp.strategies.declarations``): every registered
strategy declares what the suite must know of it, and a subclass that declares nothing gets none
of its parent's."""

from __future__ import annotations

import pytest

from ddp.strategies.declarations import (
    REPLICATED,
    Traits,
    declarations,
    declare,
    missing_declarations,
    sharding_of,
    traits_of,
)
from ddp.strategies.registry import STRATEGIES
from ddp.strategies.torch_ddp import TorchDDP


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_registered_strategy_declares_what_the_suite_must_know(name):
    missing = missing_declarations(STRATEGIES[name])
    assert not missing, f"{name} ({STRATEGIES[name].__name__}) must declare {', '.join(missing)} beside its class"


def test_a_subclass_that_declares_nothing_carries_none_of_its_parents_declarations():
    class HookedTorchDDP(TorchDDP):
        """A comm hook on PyTorch's DDP, declared by no one."""

    assert missing_declarations(HookedTorchDDP) == [
        "sharding", "communicates", "accumulates_locally", "records_collectives", "steps_to_settle", "step_buffers",
        "communication_schedule",
    ]
    own, inherited = traits_of(TorchDDP), traits_of(HookedTorchDDP)
    assert (own.reference_in_reports, own.line_style, own.steps_to_settle) == (True, "--", 3)
    # what Strategy's interface declares, Traits' defaults for the rest
    defaults = Traits()
    assert (inherited.reference_in_reports, inherited.line_style) == (defaults.reference_in_reports, defaults.line_style)
    assert (inherited.sharding, inherited.steps_to_settle) == (REPLICATED, 1)
    assert inherited.first_bucket_bytes is None and not inherited.keeps_gradient_buckets


def test_a_subclass_declared_as_its_parent_says_what_it_changes():
    class TracedTorchDDP(TorchDDP):
        pass

    declare(TracedTorchDDP, **declarations(TorchDDP, records_collectives=True))
    assert not missing_declarations(TracedTorchDDP)
    assert traits_of(TracedTorchDDP).records_collectives and not traits_of(TorchDDP).records_collectives
    assert traits_of(TracedTorchDDP).step_buffers is traits_of(TorchDDP).step_buffers
    with pytest.raises(TypeError, match="declared twice"):
        declare(TracedTorchDDP, line_style=":")
    with pytest.raises(TypeError, match="are not traits"):
        declarations(TorchDDP, line_colour="red")


def test_zero_is_not_reported_as_pytorchs_ddp():
    """``ZeroDDP`` builds on ``TorchDDP`` and carried its report style and reference role."""
    zero, torch_ddp = traits_of(STRATEGIES["zero"]), traits_of(STRATEGIES["torch"])
    assert torch_ddp.reference_in_reports and not zero.reference_in_reports
    assert zero.line_style != torch_ddp.line_style
    assert zero.keeps_gradient_buckets and zero.first_bucket_bytes == torch_ddp.first_bucket_bytes  # its DDP's buckets


def test_a_users_class_says_its_traits_as_attributes():
    class Mine:
        sharding = REPLICATED
        steps_to_settle = 5

    assert traits_of(Mine).steps_to_settle == 5 and sharding_of(Mine()) == REPLICATED
    assert sharding_of(type("Silent", (), {})) is None
