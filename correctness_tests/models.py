"""Small models that each exercise one thing a strategy must get right, with their data and loss.

Every model is built from a seed, so every rank and the single-process reference build the same
one; every batch is built from a seed too, and the ranks split it by rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddp.model import MODEL_SIZES, build_model, language_model_loss, random_batch


class FrozenMLP(nn.Module):
    """An MLP with a frozen bias, a frozen free-standing parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.fc1.bias.requires_grad_(False)
        self.temperature = nn.Parameter(torch.tensor(1.5), requires_grad=False)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) / self.temperature + self.shift


class TiedLM(nn.Module):
    """The embedding and the output layer share one weight: it must be reduced once."""

    def __init__(self, vocab_size: int = 32, d_model: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.hidden = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        self.output.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.hidden(self.embedding(tokens))))


class RoutedMLP(nn.Module):
    """Each sample goes to the expert its first feature names; expert 2 is never chosen.

    With the batches below, rank 0's rows reach experts 0 and 1 and rank 1's reach expert 1
    only: expert 0 is used on some ranks and not others, expert 2 on none.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 3) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route, features = x[:, 0].long(), torch.relu(self.inp(x[:, 1:]))
        out = features.new_zeros(x.shape[0], 3)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero().flatten()
            if len(rows):
                out = out.index_put((rows,), expert(features[rows]))
        return out


def _regression_batch(batch_size: int, generator: torch.Generator, in_features: int = 8):
    return torch.randn(batch_size, in_features, generator=generator), torch.randn(batch_size, 4, generator=generator)


def _routed_batch(batch_size: int, generator: torch.Generator):
    x = torch.randn(batch_size, 8, generator=generator)
    half = batch_size // 2
    # First half of the rows (rank 0's share with 2 ranks) alternates experts 0 and 1; the rest use 1.
    x[:half, 0] = torch.arange(half) % 2
    x[half:, 0] = 1
    return x, torch.randn(batch_size, 3, generator=generator)


def _token_batch(batch_size: int, generator: torch.Generator, vocab_size: int = 32, seq_len: int = 6):
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _lm_batch(batch_size: int, generator: torch.Generator):
    return random_batch(MODEL_SIZES["tiny"], batch_size, 16, generator=generator)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class ModelCase:
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # torch's DDP needs find_unused_parameters=True for a model whose parameters can go unused
    has_unused_parameters: bool = False


MODEL_CASES: dict[str, ModelCase] = {
    "frozen_mlp": ModelCase(FrozenMLP, _regression_batch, F.mse_loss),
    "tied_lm": ModelCase(TiedLM, _token_batch, _token_loss),
    "routed_mlp": ModelCase(RoutedMLP, _routed_batch, F.mse_loss, has_unused_parameters=True),
    "transformer_tiny": ModelCase(lambda: build_model("tiny"), _lm_batch, language_model_loss),
}
