"""Which strategies correctness_tests/ checks: those given with ``--strategies`` (registered names or
``package.module:ClassName``), else every registered strategy that communicates. Every test here
is parametrized over them, so ``pytest correctness_tests --strategies mypkg.mod:MyDDP`` runs only
the checks of that class."""

from __future__ import annotations

import pytest

from ddp.strategies.registry import DDP_STRATEGIES, STRATEGIES, takes_option


def strategies_under_test(config: pytest.Config) -> tuple[str, ...]:
    return config.getoption("strategy") or DDP_STRATEGIES


def takes(strategy: str, option: str) -> bool:
    """Whether the strategy's constructor names ``option`` (``comm_dtype``, ``compute_dtype``, ...)."""
    return takes_option(strategy, option)


def only_those_taking(option: str, strategies: tuple[str, ...], what: str) -> list:
    """The strategies that take ``option``, to parametrize a check of ``what`` over. A user's class
    without it gets one skipped case saying what to add (a registered one is simply left out);
    none at all, one skipped case saying so rather than an empty parameter set."""
    cases = [s for s in strategies if takes(s, option)]
    cases += [pytest.param(s, id=f"{s}-no-{option}", marks=pytest.mark.skip(
        reason=f"{s} takes no {option} option: add one to its constructor to test {what}"))
        for s in strategies if s not in STRATEGIES and not takes(s, option)]
    return cases or [pytest.param(None, id=f"no-{option}", marks=pytest.mark.skip(
        reason=f"no strategy under test takes {option}: nothing to test of {what}"))]
