"""An 8B-parameter Llama-3-shaped decoder (8,030,261,248 parameters: d_model 4096, 32 blocks, 32
query and 8 key/value heads, SwiGLU 14336, vocabulary 128,256), as a workload for
``ddp simulate --model tests.llama:build``. Build it on the meta device (``with torch.device("meta")``,
as the simulator does): on the CPU it would take 32 GB."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 4096, 32, 32, 8, 14336, 128_256
ROPE_THETA = 500_000.0


def rotate(x: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, head_dim), in x's dtype."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * frequencies  # (T, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        head_dim = D_MODEL // HEADS
        self.attention_norm = nn.RMSNorm(D_MODEL)
        self.wq = nn.Linear(D_MODEL, HEADS * head_dim, bias=False)
        self.wk = nn.Linear(D_MODEL, KV_HEADS * head_dim, bias=False)
        self.wv = nn.Linear(D_MODEL, KV_HEADS * head_dim, bias=False)
        self.wo = nn.Linear(HEADS * head_dim, D_MODEL, bias=False)
        self.ffn_norm = nn.RMSNorm(D_MODEL)
        self.w1 = nn.Linear(D_MODEL, FFN, bias=False)
        self.w3 = nn.Linear(D_MODEL, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, length, HEADS, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(h).view(batch, length, KV_HEADS, -1).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(h).view(batch, length, KV_HEADS, -1).transpose(1, 2)
        q, k = rotate(q), rotate(k)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hs)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, length, D_MODEL))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))  # FSDP's units
        self.norm = nn.RMSNorm(D_MODEL)
        self.output = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)  # (B, T, d_model)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))  # (B, T, vocab)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(batch_size: int, seq_len: int):
    def batch(generator: torch.Generator):
        tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    return Llama(), batch, loss
