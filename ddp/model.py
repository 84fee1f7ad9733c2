"""The GPT-2-style Transformer language model that every strategy trains.

This file owns the model and what a benchmark needs to feed it: `ModelConfig`,
the named sizes in `MODEL_SIZES`, `build_model`, the loss, random token batches,
and the FLOPs-per-token estimate behind model FLOPs utilisation. The model is a
pre-norm decoder (RMSNorm, RoPE attention, SwiGLU) with no biases and an untied
`lm_head`.

Under autocast the residual stream stays float32 (the embedding's dtype) and every
matmul, RoPE and attention run in autocast's dtype, with one cast wherever the
stream enters them: each RMSNorm returns its output in the compute dtype
(`compute_dtype`), so a block's q, k and v projections share one cast, as do w1
and w3, and the RoPE tables are cast once per forward, so q and k leave RoPE in
the dtype attention takes. Without autocast nothing is cast: float32 computes
what it always did, bit for bit. tests/test_model_autocast.py counts a step's
casts against the ones autocast needs (48 on tiny, 968 on xl; a cast per
consumer made 74 and 1,638). bf16 still keeps autocast's bf16 copy of every
matmul weight until backward, so at few tokens a micro-batch it holds more than
float32 does (xl at batch 2 x 512: 3.96 GB of copies against 3.5 GB saved).

Submodules are assigned in the order `forward` uses them. `nn.Module` registers
parameters in assignment order, and gradients become ready in roughly the
reverse order during backward, so a data-parallel strategy that buckets
`reversed(list(model.parameters()))` can launch its first all-reduce as soon
as the last layers have finished their backward.
"""

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 10_000
    """Number of distinct token ids; inputs must lie in [0, vocab_size)."""
    context_length: int = 1024
    """Longest sequence, in tokens, the model accepts (sizes the RoPE tables)."""
    d_model: int
    """Width of the residual stream."""
    d_ff: int
    """Hidden width of the SwiGLU feed-forward layer."""
    num_layers: int
    """Number of Transformer blocks."""
    num_heads: int
    """Attention heads per block; each has d_model // num_heads dimensions."""
    rope_theta: float = 10000.0
    """RoPE base: the wavelength of the slowest rotating pair, in positions."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"{field.name} must be positive, got {getattr(self, field.name)}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}); "
                "change one of them so that each head gets a whole number of dimensions"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dimension d_model // num_heads = {self.head_dim} must be even because RoPE "
                "rotates dimensions in pairs; change d_model or num_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# Counts measured with num_parameters(); each block holds 9 tensors
# (ln1, q, k, v, output_proj, ln2, w1, w3, w2), plus embedding, final norm and lm_head.
MODEL_SIZES: dict[str, ModelConfig] = {
    # 21 tensors, 259,392 parameters: for tests and smoke runs on CPU.
    "tiny": ModelConfig(vocab_size=1000, context_length=128, d_model=64, d_ff=256, num_layers=2, num_heads=4),
    # 39 tensors, 9,316,608 parameters (~9.3M, 35.5 MiB of float32 gradients, the largest tensors
    # 9.8 MiB): the CPU benchmark default, big enough that bucket sizes matter, a step well under 1 s.
    "mini": ModelConfig(d_model=256, d_ff=1024, num_layers=4, num_heads=4),
    # 111 tensors, 128,625,408 parameters (~129M)
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    # 219 tensors, 423,183,360 parameters (~423M)
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    # 327 tensors, 969,411,840 parameters (~969M)
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    # 435 tensors, 1,998,235,200 parameters (~2.0B)
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    # 291 tensors, 3,406,809,600 parameters (~3.4B): GPT-3 2.7B's shape, plus 0.84B
    # for SwiGLU's third matrix.
    "2.7b": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls that read `x` compute in: autocast's where autocast is on for
    `x`'s device and would cast `x` (it leaves float64 alone), else `x`'s own dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32.

    Returns `x`'s dtype, or under autocast the compute dtype (`compute_dtype`): every layer
    that reads a norm's output is a matmul that would cast it, so casting here once serves
    all of them (q, k and v; w1 and w3) instead of each making its own copy.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Square and mean in float32: in bf16 the sum of squares loses too many bits.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(compute_dtype(x))


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, both (context_length, head_dim)."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)  # (hs/2,)
    positions = torch.arange(config.context_length, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (T_max, hs/2)
    # Dimension i is paired with i + hs/2 (see rotate_half), so both halves share one angle.
    angles = torch.cat([angles, angles], dim=-1)  # (T_max, hs)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + hs/2) pair of x (B, nh, T, hs) by its position's angle."""
    return x * cos + rotate_half(x) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.output_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.num_heads
        q = self.q_proj(x).view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.output_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # w1 and w3 both read x; w2 runs last, so it is registered last.
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, d_ff) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # One table shared by all layers rather than one per layer, so a strategy that
        # broadcasts buffers has two small tensors to send. Not persistent: they are
        # recomputed from the config, so checkpoints need not carry them.
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Parameters are visited in registration order, so a given torch.manual_seed
        # always yields the same weights.
        std = 0.02
        # GPT-2: every block adds its attention and FFN outputs to the residual stream,
        # so scale those projections down to keep the stream's variance from growing with depth.
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            if name.endswith(("output_proj.weight", "w2.weight")):
                nn.init.trunc_normal_(param, std=residual_std, a=-3 * residual_std, b=3 * residual_std)
            elif param.dim() == 2:  # embedding and every other linear layer
                nn.init.trunc_normal_(param, std=std, a=-3 * std, b=3 * std)
            # 1-D parameters are RMSNorm weights, already ones.

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, T) to next-token logits (B, T, vocab_size)."""
        B, T = token_ids.shape
        if T > self.config.context_length:
            raise ValueError(
                f"sequence length {T} exceeds context_length {self.config.context_length}; "
                "use shorter sequences or build the model with a larger context_length"
            )
        x = self.token_embedding(token_ids)  # (B, T, C), the residual stream: float32 under autocast too
        # In the dtype q and k come out of their projections, so that RoPE keeps them there (a
        # float32 table would promote them, and attention would cast them back): one cast per forward.
        dtype = compute_dtype(x)
        cos = self.rope_cos[:T].to(dtype)  # (T, hs), broadcasts over (B, nh)
        sin = self.rope_sin[:T].to(dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_final(x))  # (B, T, vocab_size)


def build_model(size: str | ModelConfig, *, device=None, dtype=None, **overrides) -> TransformerLM:
    """Build a named size from MODEL_SIZES (or a given config) with fields replaced by `overrides`.

    Example: `build_model("small", device="cuda", context_length=512)`.
    """
    if isinstance(size, str):
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(MODEL_SIZES)}")
        size = MODEL_SIZES[size]
    config = dataclasses.replace(size, **overrides)
    # Allocate directly on the target device: "2.7b" would otherwise take ~14 GB
    # of host memory on every rank before being copied over.
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = TransformerLM(config)
    return model.to(dtype=dtype) if dtype is not None else model


def num_parameters(module: nn.Module) -> int:
    """Number of trainable parameter elements; a parameter shared between modules counts once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)  # parameters() deduplicates


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (B, T, V), targets (B, T)."""
    # float32 for the log-softmax: over a 10k vocabulary bf16 rounding visibly shifts the loss.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def random_batch(
    config: ModelConfig, batch_size: int, seq_len: int, *, generator=None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets), both (batch_size, seq_len), with targets = inputs shifted by one.

    `generator` must live on `device`; pass a seeded one to get the same batch on every rank.
    """
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, seq_len + 1), generator=generator, device=device
    )  # (B, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Approximate training FLOPs (forward + backward) per token at sequence length `seq_len`.

        6 * N + 12 * num_layers * d_model * seq_len

    N counts the weights used in matrix multiplies: per block 4 * d_model**2 (q, k, v,
    output_proj) + 3 * d_model * d_ff (SwiGLU), plus d_model * vocab_size for lm_head. The
    embedding lookup and RMSNorm weights do no matmul work and are left out. Each weight
    costs 2 FLOPs per token forward and 4 backward, hence 6 * N. The second term is
    attention's QK^T and AV products (2 * 2 * seq_len * d_model forward per layer, times 3),
    counted without halving for the causal mask. This is the PaLM paper's model FLOPs
    (Chowdhery et al. 2022, appendix B: 6N + 12LHQT, H * Q = d_model) and nanoGPT's
    ``estimate_mfu``; RMSNorm, RoPE, softmax and the loss are left out as negligible.
    Worked example (tests/test_flops.py): tiny at seq_len 32 is 1,219,584.
    """
    c = config
    matmul_params = c.num_layers * (4 * c.d_model**2 + 3 * c.d_model * c.d_ff) + c.d_model * c.vocab_size
    return 6.0 * matmul_params + 12.0 * c.num_layers * c.d_model * seq_len
