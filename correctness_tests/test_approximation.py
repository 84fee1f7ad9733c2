"""A strategy that approximates the gradients (``Traits.approximation``: PowerSGD) trains as its
declaration says, and still trains.

The exact tests (``test_strategies.py``, ``test_precision.py``) leave such a strategy out: it does
not train like one process on the whole batch, by design. Here, on every rank, each step's
synchronized gradients are compared with one process's gradients of the whole batch *at the
strategy's own current weights* (so that an earlier approximation does not carry into the
comparison), and held to the declaration:

- for its first ``exact_steps`` steps, every gradient equals the whole batch's;
- afterwards, every gradient it does not compress equals the whole batch's, and every one it
  compresses, viewed as a matrix ``(shape[0], -1)``, has rank at most ``max_rank`` and is not the
  whole batch's (the compression does something);
- trained ``TRAIN_STEPS`` steps on one fixed batch, its loss falls by at least
  ``PROGRESS_SHARE`` of what one process training exactly gains in the same steps.

``pytest correctness_tests --strategies torch_powersgd`` (or a user's class that declares an
approximation) runs only these for it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from correctness_tests.models import MODEL_CASES
from correctness_tests.training import ROWS_PER_RANK
from ddp.launcher import Rank, on_rank
from ddp.strategies.base import make_optimizer
from ddp.strategies.registry import APPROXIMATE_STRATEGIES, make_ddp, takes_bucket_size, traits

TRAIN_STEPS = 12
LEARNING_RATE = 1e-3
PROGRESS_SHARE = 0.5
"""Of the loss one process gains training exactly: rank-1 PowerSGD on these models keeps most of
it (error feedback returns what a step drops in later steps); a wrong sum or a lost gradient does not."""
BUCKET_SIZE_MB = 0.05  # the tiny LM's 1 MB of gradients in many buckets
MODELS = ("frozen_mlp", "tied_lm", "transformer_tiny")  # routed_mlp leaves parameters unused, which DDP must be told


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "approximating_strategy" not in metafunc.fixturenames:
        return
    given = metafunc.config.getoption("strategy")
    strategies = [s for s in (given or APPROXIMATE_STRATEGIES) if traits(s).approximation is not None]
    metafunc.parametrize("approximating_strategy", strategies or [pytest.param(
        None, marks=pytest.mark.skip(reason="no strategy under test declares an approximation: nothing to check here"))])


@on_rank
def approximated_steps(rank: Rank, strategy: str, model_name: str) -> dict:
    """Runs on every rank: ``TRAIN_STEPS`` steps of ``strategy`` on one fixed global batch, each
    step's gradients checked against the declaration; and one process training exactly on it."""
    info = rank.info
    case = MODEL_CASES[model_name]
    torch.manual_seed(0)
    module = case.build().to(info.device)
    alone, at_my_weights = copy.deepcopy(module), copy.deepcopy(module)
    # several buckets: each bucket's compression chained after the last's, in the same order on every rank
    model = make_ddp(strategy, module, **({"bucket_size_mb": BUCKET_SIZE_MB} if takes_bucket_size(strategy) else {}))
    declared = traits(strategy).approximation(model)
    inputs, targets = case.batch(ROWS_PER_RANK * info.world_size, torch.Generator().manual_seed(1234))
    inputs, targets = inputs.to(info.device), targets.to(info.device)
    rows = slice(ROWS_PER_RANK * info.rank, ROWS_PER_RANK * (info.rank + 1))
    optimizer = make_optimizer(model, torch.optim.AdamW, lr=LEARNING_RATE)
    exact_optimizer = torch.optim.AdamW(alone.parameters(), lr=LEARNING_RATE)
    losses, exact_losses, compressed_differs = [], [], False
    for step in range(TRAIN_STEPS):
        at_my_weights.load_state_dict(module.state_dict())
        at_my_weights.zero_grad(set_to_none=True)
        losses.append(case.loss(at_my_weights(inputs), targets))
        losses[-1].backward()
        optimizer.zero_grad(set_to_none=True)
        case.loss(model(inputs[rows]), targets[rows]).backward()
        model.finish_gradient_synchronization()
        for (name, whole), param in zip(at_my_weights.named_parameters(), module.parameters(), strict=True):
            if whole.grad is None:
                continue
            compressed = step >= declared.exact_steps and declared.compresses(tuple(param.shape))
            if not compressed:
                assert_close(param.grad, whole.grad, rtol=1e-4, atol=1e-6,
                             msg=lambda m: f"{strategy}, step {step}, {name} (synchronized exactly): {m}")
                continue
            matrix = param.grad.reshape(param.shape[0], -1)
            found = int(torch.linalg.matrix_rank(matrix))
            assert found <= declared.max_rank, f"{strategy}, step {step}, {name}: rank {found} > {declared.max_rank}"
            compressed_differs |= not torch.allclose(param.grad, whole.grad, rtol=1e-3, atol=1e-6)
        optimizer.step()
        exact_optimizer.zero_grad(set_to_none=True)
        exact_losses.append(case.loss(alone(inputs), targets))
        exact_losses[-1].backward()
        exact_optimizer.step()
    return {"losses": [loss.item() for loss in losses], "exact_losses": [loss.item() for loss in exact_losses],
            "compressed_differs": compressed_differs}


@pytest.mark.parametrize("model_name", MODELS)
def test_an_approximating_strategy_keeps_its_declaration_and_still_trains(rank_group, approximating_strategy, model_name):
    result = rank_group.run(approximated_steps, approximating_strategy, model_name)[0]
    losses, exact = result["losses"], result["exact_losses"]
    assert result["compressed_differs"], f"{approximating_strategy} compressed nothing: its gradients are all exact"
    gained, exact_gain = losses[0] - min(losses[-3:]), exact[0] - min(exact[-3:])
    print(f"\n{approximating_strategy} on {model_name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"one process exactly {exact[0]:.4f} -> {exact[-1]:.4f}")
    assert exact_gain > 0, f"{model_name} does not train in {TRAIN_STEPS} steps at lr {LEARNING_RATE}: nothing to compare"
    assert gained >= PROGRESS_SHARE * exact_gain, (
        f"{approximating_strategy} on {model_name} gained {gained:.4g} of loss in {TRAIN_STEPS} steps, less than "
        f"{PROGRESS_SHARE:.0%} of exact training's {exact_gain:.4g}"
    )
