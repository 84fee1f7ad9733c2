"""``ddp.model`` under bf16 autocast, as a careful user writes a model for it: the float32 residual
stream, every matmul, RoPE and attention in bf16, and no cast autocast does not need; in float32
nothing changes, bit for bit, and the parameters are the ones bucket plans, the cost model and
saved runs name.

**Which casts a step needs** (``casts_autocast_needs``), derived from the model's structure and
autocast's op lists. This follows CPU autocast's lists (``AutocastCPU`` in PyTorch's
``aten/src/ATen/autocast_mode.cpp``): ``linear`` and ``scaled_dot_product_attention`` are
lower-precision ops, so they cast float32 inputs to bf16; the loss's ``nll_loss`` and
``cross_entropy_loss`` are float32 ops, and they get the float32 logits the loss makes itself;
elementwise ops (RoPE's products, SiLU, the residual add) are on neither list and follow type
promotion. CUDA's lists put ``linear``, ``matmul`` and ``scaled_dot_product_attention`` on the
lower-precision list too; their float32 list adds ``pow``, ``rsqrt``, ``sum`` and
``log_softmax``, which here only ever read float32 (RMSNorm's statistics, the loss), so a CUDA
step needs the same casts. The ones needed:

- forward: each linear's weight once (autocast keeps one bf16 copy of a weight per autocast
  region), each RMSNorm's output once for all the linears that read it, the two RoPE tables
  once, and the loss's bf16 logits back to float32;
- backward: autograd hands every gradient to its input in that input's dtype, so each forward
  cast of a tensor that needs a gradient (weights, norm outputs, logits) has one back, and each
  residual add's bf16 branch (attention's and the FFN's output) gets its float32 gradient cast
  to bf16; the RoPE tables need no gradient.

Before this rule (the model at commit a0f062e) every linear cast its input on its own (q, k and v
three copies of one norm's output; w1 and w3 two), and RoPE's float32 tables promoted q and k to
float32, which attention then cast back: on ``tiny`` at batch 2 x 32 that step ran 74 casts
instead of 48. ``old_casts`` rebuilds that rule, and the tests below show each check fails it.

**Memory**: bf16 keeps each activation a matmul or attention reads at half the bytes, but also
autocast's bf16 copy of every matmul weight from forward to backward (the linear saves it for its
input's gradient). Below some number of tokens a micro-batch the copies weigh more than halving
saves: about 70 on ``tiny``, about 1,200 on ``xl`` (at batch 2 x 512, 3.96 GB of copies against
3.5 GB saved: predicted 8.75 GB of activations against float32's 8.24 GB, 9.22 GB with a cast per
consumer). So the memory comparison runs ``tiny`` at batch 1 x 128, where the rule of a cast per
consumer kept more than float32 at the forward's peak, and one cast per norm keeps less.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ddp.model
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.fake_step import run_fake_step
from ddp.bench.memory.predict import predict_moments
from ddp.model import MODEL_SIZES, RMSNorm, build_model, language_model_loss, num_parameters, random_batch

F32, BF16 = torch.float32, torch.bfloat16
CAST = torch.ops.aten._to_copy.default  # what Tensor.to, .float() and autocast's casts dispatch to
BATCH, SEQ = 2, 32  # the operator counts' step
MEMORY_BATCH, MEMORY_SEQ = 1, 128  # tiny's longest sequence: enough tokens that halving outweighs the weight copies

Cast = tuple[torch.dtype, torch.dtype, tuple[int, ...]]  # (from, to, shape)


class OperatorCounter(TorchDispatchMode):
    """Every aten operator run inside it, each cast by (from dtype, to dtype, shape), and each
    operator whose floating-point inputs mix dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.operators: Counter = Counter()
        self.casts: Counter[Cast] = Counter()
        self.mixed: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.operators[func] += 1
        if func is CAST and out.dtype != args[0].dtype:
            self.casts[(args[0].dtype, out.dtype, tuple(args[0].shape))] += 1
        dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if len(dtypes) > 1:
            self.mixed[func] += 1
        return out


def autocast(precision: str):
    return torch.autocast("cpu", dtype=BF16, enabled=precision == "bf16")


def counted_step(precision: str, batch: int = BATCH, seq: int = SEQ) -> OperatorCounter:
    """The operators of one training step of ``tiny`` (forward and loss in ``precision``, backward)."""
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs, targets = random_batch(model.config, batch, seq)
    with OperatorCounter() as counter:
        with autocast(precision):
            loss = language_model_loss(model(inputs), targets)
        loss.backward()
    return counter


def casts_autocast_needs(model: nn.Module, batch: int, seq: int) -> Counter[Cast]:
    """The casts of one bf16 step of ``model`` (module docstring), from its structure."""
    config = model.config
    stream = (batch, seq, config.d_model)  # (B, T, C)
    casts: Counter[Cast] = Counter()

    def there_and_back(shape: tuple[int, ...]) -> None:  # forward to bf16, its gradient back to float32
        casts[(F32, BF16, shape)] += 1
        casts[(BF16, F32, shape)] += 1

    for module in model.modules():
        if isinstance(module, nn.Linear):
            there_and_back(tuple(module.weight.shape))
        elif isinstance(module, RMSNorm):
            there_and_back(stream)
    casts[(F32, BF16, stream)] += 2 * config.num_layers  # each residual add's gradient into its bf16 branch
    casts[(F32, BF16, (seq, config.head_dim))] += 2  # RoPE's cos and sin, which need no gradient
    logits = (batch * seq, config.vocab_size)  # the loss's float32 copy of the logits, and its gradient back
    casts[(BF16, F32, logits)] += 1
    casts[(F32, BF16, logits)] += 1
    return casts


@pytest.fixture
def old_casts(monkeypatch):
    """The model as it was at commit a0f062e: every norm returns its input's dtype (float32) and
    RoPE's tables stay float32 under autocast, so each linear casts its own input."""
    monkeypatch.setattr(ddp.model, "compute_dtype", lambda x: x.dtype)


def test_a_bf16_step_runs_the_fp32_operators_plus_the_casts_autocast_needs():
    fp32, bf16 = counted_step("fp32"), counted_step("bf16")
    needed = casts_autocast_needs(build_model("tiny"), BATCH, SEQ)
    assert not fp32.casts
    assert bf16.casts == needed
    assert bf16.operators - fp32.operators == Counter({CAST: needed.total()})  # 48 on tiny
    assert not fp32.operators - bf16.operators


def test_the_count_fails_a_cast_per_consumer(old_casts):
    bf16 = counted_step("bf16")
    config = MODEL_SIZES["tiny"]
    needed = casts_autocast_needs(build_model("tiny"), BATCH, SEQ)
    surplus = bf16.casts - needed
    assert bf16.casts.total() > needed.total()  # 74 against 48 on tiny
    # Two more copies of ln1's output (k and v beside q), one more of ln2's (w3 beside w1), each
    # with its gradient cast back; and q and k cast to bf16 again for attention after RoPE.
    assert surplus[(F32, BF16, (BATCH, SEQ, config.d_model))] == 3 * config.num_layers
    assert surplus[(BF16, F32, (BATCH, SEQ, config.d_model))] == 3 * config.num_layers
    assert surplus[(F32, BF16, (BATCH, config.num_heads, SEQ, config.head_dim))] > 0


def test_under_autocast_only_the_residual_adds_mix_dtypes():
    """RoPE, attention and the FFN run in bf16 throughout; the residual stream is float32, so its
    adds take a bf16 branch (forward), and attention's backward reads its float32 log-sum-exp."""
    step = counted_step("bf16")
    layers = MODEL_SIZES["tiny"].num_layers
    assert step.mixed == Counter({
        torch.ops.aten.add.Tensor: 2 * layers,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: layers,
    })


def test_rope_in_float32_mixes_dtypes(old_casts):
    assert counted_step("bf16").mixed[torch.ops.aten.mul.Tensor] > 0  # bf16 q and k times float32 tables


def test_the_residual_stream_stays_float32():
    """Only the casts change: what each block adds to the stream is added in float32."""
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs, _ = random_batch(model.config, BATCH, SEQ)
    streams: list[torch.dtype] = []
    hooks = [block.register_forward_hook(lambda module, args, out: streams.append(out.dtype)) for block in model.blocks]
    try:
        with autocast("bf16"):
            model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    assert streams == [F32] * model.config.num_layers


def test_bf16_computes_the_fp32_logits_to_bf16s_precision():
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs, _ = random_batch(model.config, BATCH, SEQ)
    with torch.no_grad():
        fp32 = model(inputs)
        with autocast("bf16"):
            bf16 = model(inputs)
    assert bf16.dtype == BF16  # lm_head computes in bf16; the loss casts its logits to float32
    # bf16 rounds to 2**-9 relative; through 2 blocks and lm_head the logits (standard deviation
    # 0.156 at initialisation) moved by at most 2.6e-3, 1.7% of it, when measured (torch 2.13, as
    # with a cast per consumer: 2.8e-3). 5% of the spread leaves 3 times that.
    torch.testing.assert_close(bf16.float(), fp32, rtol=0, atol=0.05 * fp32.std().item())


def reference_logits(model: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """The same network written out with functional operators in float32, its parameters read by
    name and its RoPE tables recomputed: the independent reference for float32."""
    c = model.config
    p = dict(model.named_parameters())
    B, T = token_ids.shape
    nh, hs = c.num_heads, c.head_dim

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * weight

    half = hs // 2
    inv_freq = c.rope_theta ** (-torch.arange(half, dtype=F32) / half)  # (hs/2,)
    angles = torch.outer(torch.arange(T, dtype=F32), inv_freq).repeat(1, 2)  # (T, hs): pair i with i + hs/2
    cos, sin = angles.cos(), angles.sin()

    def rope(t):  # (B, nh, T, hs)
        first, second = t[..., :half], t[..., half:]
        return t * cos + torch.cat([-second, first], dim=-1) * sin

    def heads(t):  # (B, T, C) -> (B, nh, T, hs)
        return t.reshape(B, T, nh, hs).transpose(1, 2)

    x = F.embedding(token_ids, p["token_embedding.weight"])
    for i in range(c.num_layers):
        w = {name.removeprefix(f"blocks.{i}."): value for name, value in p.items() if name.startswith(f"blocks.{i}.")}
        h = rms_norm(x, w["ln1.weight"])
        q, k, v = (heads(F.linear(h, w[f"attn.{n}_proj.weight"])) for n in "qkv")
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, c.d_model), w["attn.output_proj.weight"])
        h = rms_norm(x, w["ln2.weight"])
        x = x + F.linear(F.silu(F.linear(h, w["ffn.w1.weight"])) * F.linear(h, w["ffn.w3.weight"]), w["ffn.w2.weight"])
    return F.linear(rms_norm(x, p["ln_final.weight"]), p["lm_head.weight"])


def test_fp32_computes_a_plain_transformer_bit_for_bit():
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs, targets = random_batch(model.config, BATCH, SEQ)
    logits = model(inputs)
    language_model_loss(logits, targets).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = reference_logits(model, inputs)
    language_model_loss(expected, targets).backward()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


# tiny's parameters in registration order, as saved runs, bucket plans and the cost model name them.
TINY_PARAMETERS = [
    ("token_embedding.weight", (1000, 64)),
    *((f"blocks.{i}.{name}", shape) for i in range(2) for name, shape in [
        ("ln1.weight", (64,)),
        ("attn.q_proj.weight", (64, 64)),
        ("attn.k_proj.weight", (64, 64)),
        ("attn.v_proj.weight", (64, 64)),
        ("attn.output_proj.weight", (64, 64)),
        ("ln2.weight", (64,)),
        ("ffn.w1.weight", (256, 64)),
        ("ffn.w3.weight", (256, 64)),
        ("ffn.w2.weight", (64, 256)),
    ]),
    ("ln_final.weight", (64,)),
    ("lm_head.weight", (1000, 64)),
]
# (tensors, parameters) of every size, as MODEL_SIZES's comments record them.
SIZE_COUNTS = {
    "tiny": (21, 259_392), "mini": (39, 9_316_608), "small": (111, 128_625_408), "medium": (219, 423_183_360),
    "large": (327, 969_411_840), "xl": (435, 1_998_235_200), "2.7b": (291, 3_406_809_600),
}


def test_parameters_keep_their_names_shapes_order_and_count():
    model = build_model("tiny")
    assert [(name, tuple(p.shape)) for name, p in model.named_parameters()] == TINY_PARAMETERS
    assert list(model.state_dict()) == [name for name, _ in TINY_PARAMETERS]  # RoPE's tables are not saved
    assert {name: (b.dtype, tuple(b.shape)) for name, b in model.named_buffers()} == {
        "rope_cos": (F32, (128, 16)), "rope_sin": (F32, (128, 16))}
    for size, counts in SIZE_COUNTS.items():
        meta = build_model(size, device="meta")
        assert (len(list(meta.parameters())), num_parameters(meta)) == counts, size


def predicted_activations(precision: str) -> dict[str, int]:
    """The prediction's activations (``ddp.bench.memory.predict``) at its forward and backward moments."""
    moments = predict_moments(StepConfig("local", "tiny", MEMORY_BATCH, MEMORY_SEQ, precision=precision), 1)
    return {moment: moments[moment].activations_bytes for moment in ("forward", "backward")}


def tracked_activations(precision: str) -> dict[str, int]:
    """PyTorch's ``MemTracker`` over one real step: activations once forward and loss are done, and
    at the step's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = build_model("tiny")
    inputs, targets = random_batch(model.config, MEMORY_BATCH, MEMORY_SEQ)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with autocast(precision):
            loss = language_model_loss(model(inputs), targets)
        after_forward = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]

    def activations(snapshot) -> int:
        return next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")

    return {"after forward": activations(after_forward), "at the peak": activations(peak)}


def test_bf16_keeps_no_more_activations_than_fp32():
    for measured in (predicted_activations, tracked_activations):
        fp32, bf16 = measured("fp32"), measured("bf16")
        for moment in fp32:
            assert bf16[moment] <= fp32[moment], f"{measured.__name__} {moment}: bf16 {bf16[moment]} > fp32 {fp32[moment]}"


def test_one_cast_per_norm_keeps_one_bf16_copy_of_its_output(monkeypatch):
    """Each block's surplus copies (two more of ln1's output, one more of ln2's), saved by the
    linears for backward, are gone; RoPE's bf16 tables, saved by its products, are new."""
    c = MODEL_SIZES["tiny"]
    saved = {}
    for rule in ("one cast", "a cast per consumer"):
        if rule == "a cast per consumer":
            monkeypatch.setattr(ddp.model, "compute_dtype", lambda x: x.dtype)
        predicted = run_fake_step("tiny", MEMORY_BATCH, MEMORY_SEQ, "bf16").backward[0].activations  # after forward
        saved[rule] = (predicted, tracked_activations("bf16")["after forward"])
    copies = c.num_layers * 3 * MEMORY_BATCH * MEMORY_SEQ * c.d_model * BF16.itemsize
    tables = 2 * MEMORY_SEQ * c.head_dim * BF16.itemsize
    for one, per_consumer in zip(saved["one cast"], saved["a cast per consumer"], strict=True):
        assert per_consumer - one == copies - tables  # 90,112 bytes

