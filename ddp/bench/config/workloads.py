"""What is trained: a model, the batch one rank trains on per step, and the loss.

Every benchmark trains a *workload*, named one of three ways:

- a size of the built-in Transformer LM (``ddp.model.MODEL_SIZES``: tiny ... xl, 2.7b);
- a model of ``NAMED_WORKLOADS`` (the MLPs and the conv net that ``ddp versus`` races on);
- your own, as ``package.module:build``, where ``build`` follows this contract::

      def build(batch_size: int, seq_len: int):
          model = MyNet()                             # an nn.Module on the CPU; the suite moves it
          def batch(generator: torch.Generator):      # one rank's batch for one step, on the CPU
              return inputs, targets
          return model, batch, loss_fn                # loss_fn(model(inputs), targets) -> scalar

The data policy, the same for every tool: each rank trains on its own shard of a seeded global
batch, as in real data-parallel training. ``rank_batches`` draws the world's batches from one
generator seeded with ``seed``, in rank order, and keeps this rank's (its micro-batches where a
step accumulates several): any rank, or a single process, can rebuild any shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddp.importing import load_object
from ddp.model import MODEL_SIZES, build_model, language_model_loss, random_batch

Batch = tuple[torch.Tensor, torch.Tensor]
Build = Callable[[int, int], tuple[nn.Module, Callable[[torch.Generator], Batch], Callable]]


class DeepMLP(nn.Module):
    """``depth`` square Linear + ReLU layers: many mid-sized gradients, as in a deep network."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvNet(nn.Module):
    """A plain 3x3 convolution stack over a small image, then a linear classifier."""

    def __init__(self, channels: int, depth: int, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.body = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()) for _ in range(depth))
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(torch.relu(self.stem(x)))  # (B, C, H, W)
        return self.head(x.mean(dim=(2, 3)))  # (B, classes)


def _mlp(width: int, depth: int) -> Build:
    def build(batch_size: int, seq_len: int):
        def batch(generator: torch.Generator) -> Batch:
            return torch.randn(batch_size, width, generator=generator), torch.randn(batch_size, width, generator=generator)

        return DeepMLP(width, depth), batch, F.mse_loss

    return build


def _conv(channels: int, depth: int, side_pixels: int = 6, classes: int = 1000) -> Build:
    def build(batch_size: int, seq_len: int):
        def batch(generator: torch.Generator) -> Batch:
            images = torch.randn(batch_size, 3, side_pixels, side_pixels, generator=generator)
            return images, torch.randint(0, classes, (batch_size,), generator=generator)

        return ConvNet(channels, depth, classes), batch, F.cross_entropy

    return build


class TensorStack(nn.Module):
    """``layers`` small layers, alternately Linear(width, width) and LayerNorm(width), two parameter
    tensors each: a model whose step is many tiny kernels, where a strategy's per-tensor host cost
    (a Python hook per gradient) is a visible share of the step."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) if index % 2 == 0 else nn.LayerNorm(width)
                                      for index in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _tensor_stack(tensors: int, width: int = 64) -> Build:
    def build(batch_size: int, seq_len: int):
        def batch(generator: torch.Generator) -> Batch:
            return torch.randn(batch_size, width, generator=generator), torch.randn(batch_size, width, generator=generator)

        return TensorStack(width, tensors // 2), batch, F.mse_loss

    return build


@dataclass(frozen=True)
class NamedWorkload:
    build: Build
    summary: str
    """What it is, and what ``batch_size`` and ``seq_len`` mean for it."""


# Models beside the Transformer LM, on which bucketing behaves differently (ddp versus races on them).
NAMED_WORKLOADS: dict[str, NamedWorkload] = {
    # 48 tensors, 100,712,448 parameters (~101M): 24 x Linear(2048, 2048)
    "mlp": NamedWorkload(_mlp(2048, 24), "deep MLP, 24 x Linear(2048, 2048); batch = rows, seq len unused"),
    # 8 tensors, 104,878,080 parameters (~105M): 4 x Linear(5120, 5120), each 100 MiB of gradient
    "wide-mlp": NamedWorkload(_mlp(5120, 4), "wide MLP, 4 x Linear(5120, 5120); batch = rows, seq len unused"),
    # 44 tensors, 74,399,720 parameters (~74M): 20 x Conv2d(640, 640, 3)
    "conv": NamedWorkload(_conv(640, 20), "conv net, 20 x Conv2d(640, 640, 3x3) on 6 x 6 images; batch = images"),
    # Many small tensors, for a strategy's cost per tensor: 10, 100 and 1,000 parameter tensors of
    # width 64 (about 10.7K, 107K and 1.07M parameters), alternately Linear and LayerNorm.
    **{f"tensors-{n}": NamedWorkload(_tensor_stack(n), f"{n} small tensors: {n // 2} layers, alternately Linear(64, 64) "
                                                          "and LayerNorm(64); batch = rows, seq len unused")
       for n in (10, 100, 1000)},
}


@dataclass
class Workload:
    """A model built for one rank, with its batch and loss."""

    name: str
    module: nn.Module
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _import_build(name: str) -> Build:
    build = load_object(name, "model")
    if not callable(build):
        raise ValueError(f"model {name!r} is not callable: name a function build(batch_size, seq_len)")
    return build


def check_workload(name: str) -> str:
    """``name`` if it names a workload; otherwise ``ValueError`` saying what would."""
    if name in MODEL_SIZES or name in NAMED_WORKLOADS:
        return name
    if ":" in name:
        _import_build(name)
        return name
    raise ValueError(
        f"unknown model {name!r}: choose a size ({', '.join(MODEL_SIZES)}), a named model "
        f"({', '.join(NAMED_WORKLOADS)}), or your own as package.module:build"
    )


def max_seq_len(name: str) -> int | None:
    """The longest sequence the workload accepts (the LM's context length); None if unknown."""
    return MODEL_SIZES[name].context_length if name in MODEL_SIZES else None


def build_workload(name: str, batch_size: int, seq_len: int, device: torch.device | str) -> Workload:
    """Build ``name`` for ``batch_size`` x ``seq_len`` with its parameters on ``device``.

    The built-in LM is built directly on the device (xl would otherwise take 8 GB of host memory on
    every rank first); any other model is built on the CPU, as its contract says, and moved.
    """
    if name in MODEL_SIZES:
        config = MODEL_SIZES[name]
        module = build_model(name, device=device)
        return Workload(name, module, lambda g: random_batch(config, batch_size, seq_len, generator=g), language_model_loss)
    build = NAMED_WORKLOADS[name].build if name in NAMED_WORKLOADS else _import_build(name)
    built = build(batch_size, seq_len)
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)):
        raise TypeError(
            f"model {name!r}: build(batch_size, seq_len) must return (model, batch, loss_fn), model an "
            f"nn.Module; got {type(built).__name__}"
        )
    module, batch, loss = built
    return Workload(name, module.to(device), batch, loss)


def meta_workload(name: str, batch_size: int, seq_len: int) -> Workload:
    """The workload with its model on the meta device: its structure and parameter shapes, nothing
    allocated or initialised (an 8B model in no memory); its batches are real, on the CPU. The one
    place a workload is built on meta: the memory prediction, the cost model and the fake step ask here."""
    with torch.device("meta"):
        return build_workload(name, batch_size, seq_len, "meta")


@functools.lru_cache(maxsize=32)
def meta_module(name: str, batch_size: int, seq_len: int) -> nn.Module:
    """``meta_workload``'s model, kept (the memory prediction, the cost model and the shape's
    checks ask again): read it, never change it (``meta_workload`` builds one to change)."""
    return meta_workload(name, batch_size, seq_len).module


def rank_batches(workload: Workload, seed: int, rank: int, world_size: int, device: torch.device | str,
                 micro_batches: int = 1) -> list[Batch]:
    """This rank's ``micro_batches`` micro-batches of the global batch seeded by ``seed``, moved to
    ``device``: the world's ``world_size * micro_batches`` micro-batches are drawn in order from one
    generator, rank r's being draws ``r * micro_batches`` to ``(r + 1) * micro_batches - 1``, so the
    whole batch in rank order is every draw in order (at one micro-batch, rank r's batch is the r-th draw)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(rank * micro_batches):
        workload.batch(generator)  # the earlier ranks' shards
    return [tuple(t.to(device) for t in workload.batch(generator)) for _ in range(micro_batches)]
