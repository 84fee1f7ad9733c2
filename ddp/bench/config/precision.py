"""What each precision of a step computes in (``StepConfig.precision``), defined here once: the
float32 matmul precision, cuDNN's TF32 switch, and the dtype autocast runs forward and loss in.
What each means, and why, is in ``ddp.bench.rounds.trainer``'s docstring; the step sets it
(``numerics``) outside its clock and restores it after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ddp.strategies.registry import takes_option

# What each of ``ddp.bench.config.step_config.PRECISIONS`` sets: torch's float32 matmul precision, cudnn's TF32
# switch, the autocast dtype (``ddp.bench.rounds.trainer``).
_NUMERICS = {
    "fp32": ("highest", False, None),
    "tf32": ("high", True, None),
    "bf16": ("highest", False, torch.bfloat16),
}


@contextlib.contextmanager
def numerics(precision: str) -> Iterator[None]:
    """The matmul and convolution precision of ``precision`` for the length of the block, the
    previous settings restored afterwards."""
    matmul, cudnn_tf32, _ = _NUMERICS[precision]
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


def forward_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What wraps forward and loss: ``torch.autocast`` for ``bf16``, nothing otherwise."""
    dtype = _NUMERICS[precision][2]
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def sharded_compute_dtype(precision: str, strategy: str) -> torch.dtype | None:
    """The dtype a strategy that takes ``compute_dtype`` (``fsdp``, ``torch_fsdp``, a user's FSDP
    class) gathers its parameters and computes in: bf16 under ``bf16``, as FSDP's mixed precision
    trains (bf16 all-gathers and compute, fp32 master shards and reduce-scatters:
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, what the
    course's FSDP asks for), so that the step and its all-gathers are what such a job runs; None
    for every other precision and strategy (the parameters compute in their own dtype)."""
    dtype = _NUMERICS[precision][2]
    return dtype if dtype is not None and takes_option(strategy, "compute_dtype") else None
