"""What each value of the step's numeric axes means, declared once: ``precision``, ``grad_comm``
and ``optimizer`` (``StepConfig`` takes its choices of each from the tables here).

A value is a small frozen record of what its consumers need (the switches and dtypes it sets,
the builder it names, the memory it costs), and every consumer asks the record, never the
value's name: the trainer (``ddp.bench.rounds.trainer``), the memory prediction
(``ddp.bench.memory.predict``), the cost model (``ddp.analysis.costmodel.Sent``), the
correctness references (``correctness_tests/precision_reference.py``) and the report (each
axis's ``text``). Adding a value is one entry in its table; ``tests/test_values.py`` pushes
every value through every consumer. The step's shape (micro-batches, checkpointed blocks) is
declared likewise, in ``ddp.bench.config.shape``.

What each precision means, and why, is in ``ddp.bench.rounds.trainer``'s docstring; the step
sets it (``numerics``) outside its clock and restores it after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ddp.strategies.registry import takes_option


@dataclass(frozen=True)
class Precision:
    """What a step computes in: the same on CUDA and CPU, where a switch has no effect on CPU
    (TF32 exists on NVIDIA GPUs only: on CPU ``tf32`` computes fp32)."""

    matmul_precision: str
    """``torch.set_float32_matmul_precision``: ``highest`` (fp32) or ``high`` (TF32 on CUDA)."""
    cudnn_tf32: bool
    """``torch.backends.cudnn.allow_tf32`` (convolutions on CUDA)."""
    autocast_dtype: torch.dtype | None
    """What ``torch.autocast`` runs forward and loss in (weights, gradients and AdamW stay fp32);
    None: no autocast. A strategy that takes ``compute_dtype`` (FSDP) computes in it instead
    (``sharded_compute_dtype``)."""


PRECISION = {
    "fp32": Precision("highest", False, None),
    "tf32": Precision("high", True, None),
    "bf16": Precision("highest", False, torch.bfloat16),
}


@dataclass(frozen=True)
class GradComm:
    """What the strategies that take ``comm_dtype`` (``bucketed``, ``torch``) all-reduce the
    gradients in, accumulated back into the gradients' own dtype: ``bucketed`` casts each bucket
    into a buffer of it, ``torch`` registers PyTorch's compress hook of it (``bf16_compress_hook``,
    ``fp16_compress_hook``). On NCCL the all-reduce runs in that dtype; gloo reduces bf16 and fp16
    on CPU too (torch 2.13)."""

    dtype: torch.dtype | None
    """None: each gradient in its own dtype."""

    def strategy_options(self) -> dict[str, torch.dtype]:
        """The keyword a strategy that takes ``comm_dtype`` is built with (none for None)."""
        return {} if self.dtype is None else {"comm_dtype": self.dtype}

    def itemsize(self, gradient_itemsize: int) -> int:
        """Bytes an element on the wire, for gradients of ``gradient_itemsize`` bytes."""
        return gradient_itemsize if self.dtype is None else self.dtype.itemsize

    def rounded(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a value sent in this dtype arrives: rounded to it and back."""
        return tensor if self.dtype is None else tensor.to(self.dtype).to(tensor.dtype)


GRAD_COMM = {
    "fp32": GradComm(None),
    "bf16": GradComm(torch.bfloat16),
    "fp16": GradComm(torch.float16),  # 3 more mantissa bits than bf16, not its range: below 6e-8 flushed
}


@dataclass(frozen=True)
class Optimizer:
    """AdamW's implementation, asked for explicitly (torch's default is ``foreach`` on CUDA but its
    per-tensor loop on CPU). The same update on CUDA and CPU; on CUDA ``fused`` is one kernel."""

    keywords: tuple[tuple[str, bool], ...]
    """``torch.optim.AdamW``'s keyword choosing it."""
    temporaries: int
    """Copies of the stepped parameters it holds while it steps (MemTracker on mini, torch 2.13:
    foreach's ``_foreach_sqrt`` of ``exp_avg_sq`` is one copy; fused computes in place)."""

    def build(self, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, **self.options)

    @property
    def options(self) -> dict[str, bool]:
        return dict(self.keywords)


OPTIMIZER = {
    "foreach": Optimizer((("foreach", True),), temporaries=1),
    "fused": Optimizer((("fused", True),), temporaries=0),
}


@contextlib.contextmanager
def numerics(precision: str) -> Iterator[None]:
    """The matmul and convolution precision of ``precision`` for the length of the block, the
    previous settings restored afterwards."""
    meaning = PRECISION[precision]
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(meaning.matmul_precision)
    torch.backends.cudnn.allow_tf32 = meaning.cudnn_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


def forward_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What wraps forward and loss: ``torch.autocast`` in the precision's dtype, or nothing."""
    dtype = PRECISION[precision].autocast_dtype
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def sharded_compute_dtype(precision: str, strategy: str) -> torch.dtype | None:
    """The dtype a strategy that takes ``compute_dtype`` (``fsdp``, ``torch_fsdp``, a user's FSDP
    class) gathers its parameters and computes in: the precision's autocast dtype, as FSDP's mixed
    precision trains (bf16 all-gathers and compute, fp32 master shards and reduce-scatters:
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, what the
    course's FSDP asks for), so that the step and its all-gathers are what such a job runs; None
    for every other precision and strategy (the parameters compute in their own dtype)."""
    dtype = PRECISION[precision].autocast_dtype
    return dtype if dtype is not None and takes_option(strategy, "compute_dtype") else None
