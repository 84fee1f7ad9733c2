"""PyTorch's own DistributedDataParallel behind ddp-bench's interface: the reference to beat."""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks a hook's
# annotations as objects (``dist.GradBucket``), which that import would turn into strings.
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp.strategies.base import Strategy, check_bucket_size_mb, check_comm_dtype, require_process_group, trainable_parameters
from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB, buckets_as_they_fill
from ddp.strategies.declarations import REPLICATED, declare, kept_bucket_copy


def bf16_compress_any_backend(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook`` itself, under another name: DDP refuses to register that
    hook by name unless NCCL 2.10+ (or XCCL) is there, but gloo reduces bf16 as well (checked
    with torch 2.13 on CPU), so on gloo it is registered through this wrapper."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


class TorchDDP(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` with ``bucket_size_mb`` as its ``bucket_cap_mb``.

    Its reducer synchronizes gradients during backward itself, so
    ``finish_gradient_synchronization`` has nothing left to do. ``find_unused_parameters`` keeps
    PyTorch's default (False, the fast path): a model with parameters unused in a step needs True.
    ``comm_dtype`` ``torch.bfloat16`` or ``torch.float16`` registers PyTorch's compress hook of that
    dtype (each bucket cast, divided by the world size, all-reduced, copied back into the fp32 bucket).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        process_group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.bucket_size_mb = check_bucket_size_mb(bucket_size_mb)
        self.comm_dtype = check_comm_dtype(comm_dtype)
        if self.comm_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"torch strategy: comm_dtype must be torch.bfloat16, torch.float16 or None; got {comm_dtype}")
        require_process_group(type(self).__name__, process_group)
        self.process_group = process_group
        self.parameters_to_sync = trainable_parameters(module)
        if not self.parameters_to_sync:
            raise ValueError(
                "PyTorch's DistributedDataParallel refuses a module with no parameter that requires grad; "
                "there is nothing to synchronize: train it without a DDP wrapper (or with the floor strategy, local)"
            )
        device = self.parameters_to_sync[0].device
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=process_group,
            bucket_cap_mb=self.bucket_size_mb,
            find_unused_parameters=find_unused_parameters,
        )
        if self.comm_dtype == torch.bfloat16:
            nccl = dist.get_backend(process_group) == "nccl"
            self.ddp.register_comm_hook(process_group, default_hooks.bf16_compress_hook if nccl else bf16_compress_any_backend)
        elif self.comm_dtype == torch.float16:
            self.ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """The reducer's bucket plan, as its logging data records it.

        DDP reduces everything in one bucket during the first step and then rebuilds its buckets
        in the order gradients arrived (the first capped at 1 MiB): read after that step, this is
        the plan of every later one.
        """
        data = self.ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
        return [int(size) for size in str(sizes).split(",") if size.strip()]

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return len(self.bucket_sizes_bytes)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the reducer waited for every bucket at the end of backward."""


# What the harness, the memory prediction, the cost model and the report read of it
# (ddp.strategies.declarations).
declare(
    TorchDDP,
    sharding=REPLICATED,
    communicates=True,
    records_collectives=False,  # the reducer's collectives are c10d's, read from the profiler
    step_buffers=kept_bucket_copy,
    # DDP reduces everything in one bucket in its first step, rebuilds its buckets in the second
    # and records the new plan (which bucket_sizes_bytes reads) in the third.
    steps_to_settle=3,
    line_style="--",  # dashed beside bucketed's solid line at the same bucket caps
    reference_in_reports=True,  # the one to beat
    first_bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES,  # 1 MiB, whatever bucket_cap_mb says
    keeps_gradient_buckets=True,  # gradient_as_bucket_view is left False, PyTorch's default
    accumulates_locally=True,  # DistributedDataParallel.no_sync(): its reducer launches nothing
    closes_bucket_after_cap=True,
    # bucketed's plan: PyTorch plans a 1 MiB first bucket and then re-plans by observed order; the
    # same plan for both is an approximation
    communication_schedule=buckets_as_they_fill,
)
