"""PyTorch's DistributedDataParallel with its PowerSGD communication hook: gradient compression.

PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) all-reduces a rank-r
approximation of each large gradient matrix instead of the matrix: for an n x m gradient M (a
weight's gradient viewed as ``(shape[0], -1)``), every rank computes P = M Q for a shared m x r
Q, all-reduces P (n x r), orthogonalizes it, computes Q = M^T P and all-reduces Q (m x r); the
synchronized gradient is P Q^T, of rank at most r. It sends (n + m) r elements instead of n m.
What the approximation drops is kept on each rank (error feedback) and added to the next step's
gradient, so that, summed over steps, nothing is lost. Vectors (biases, norms' weights) and
matrices that would not shrink by ``min_compression_rate`` go uncompressed, averaged exactly.

It is not exact, as every other strategy here is, in two ways PyTorch's hook states:

- for its first ``start_powersgd_iter`` steps it runs vanilla all-reduce: it trains exactly like
  one process on the whole batch (the hook's warm-up; PyTorch asks for at least 2 with error
  feedback, and suggests 10% of the run's steps for accuracy);
- afterwards each gradient it compresses is synchronized as a matrix of rank at most
  ``matrix_approximation_rank``, and the others exactly.

Its declaration says so (``approximation``: ``Approximation``), and the correctness suite holds it to
that (correctness_tests/test_approximation.py), and to training still converging. On CUDA and
NCCL the hook's three all-reduces a bucket (the uncompressed tensors, the Ps, the Qs) and its
orthogonalization (Gram-Schmidt at rank 1 or 2, QR above) run as PyTorch's reducer schedules
them, the all-reduces chained by futures; on gloo each bucket's chain is finished before the next
bucket's begins (``powersgd_in_bucket_order``: gloo would otherwise pair the ranks' collectives
in the order their callbacks ran).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook checks a hook's annotations.
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB, scheduled_buckets
from ddp.strategies.declarations import REPLICATED, Approximation, MemoryPlan, StepBuffers, Transfer, declare
from ddp.strategies.torch_ddp import TorchDDP

MIN_COMPRESSION_RATE = 2  # PyTorch's default: a matrix is compressed only where it shrinks by more than 2x


class TorchPowerSGD(TorchDDP):
    """``torch`` with ``powerSGD_hook``: ``matrix_approximation_rank`` r, vanilla all-reduce for the
    first ``start_powersgd_iter`` steps, error feedback and warm start on (PyTorch's defaults)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        process_group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        matrix_approximation_rank: int = 1,
        start_powersgd_iter: int = 2,
    ) -> None:
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be a positive int, got {matrix_approximation_rank!r}")
        if not isinstance(start_powersgd_iter, int) or start_powersgd_iter < 2:
            raise ValueError(f"start_powersgd_iter must be an int of at least 2 (PowerSGD with error feedback runs "
                             f"vanilla all-reduce for DDP's first two steps), got {start_powersgd_iter!r}")
        super().__init__(module, bucket_size_mb=bucket_size_mb, process_group=process_group,
                         find_unused_parameters=find_unused_parameters)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powersgd_iter = start_powersgd_iter
        self.state = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powersgd_iter,
            min_compression_rate=MIN_COMPRESSION_RATE,
        )
        nccl = dist.get_backend(process_group) == "nccl"
        self.ddp.register_comm_hook(self.state, powersgd.powerSGD_hook if nccl else powersgd_in_bucket_order)


def powersgd_in_bucket_order(state: powersgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook``, each bucket's all-reduces finished before the next bucket's
    begin. The hook launches a bucket's Ps and Qs from the callbacks of its earlier all-reduces;
    on gloo those run on gloo's worker threads as the all-reduces complete, so two ranks may
    launch different buckets' collectives in different orders and gloo pairs the wrong ones (mini
    in 1 MiB buckets on 2 ranks hung at the first compressed step, torch 2.13). Waiting here
    keeps every rank's collectives in bucket order, at the cost of the overlap. NCCL orders them
    on its stream: there the hook runs as PyTorch wrote it."""
    future = powersgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


def compresses(shape: tuple[int, ...], rank: int) -> bool:
    """Whether PowerSGD compresses a gradient of ``shape`` at ``rank``: a matrix (a weight viewed as
    ``(shape[0], -1)``) whose n m elements exceed ``MIN_COMPRESSION_RATE`` times its (n + m) r
    (``powerSGD_hook._should_compress``)."""
    if len(shape) < 2:
        return False
    n, m = shape[0], math.prod(shape[1:])
    return (n + m) * min(n, m, rank) * MIN_COMPRESSION_RATE < n * m


def powersgd_approximation(strategy: TorchPowerSGD) -> Approximation:
    """What a built ``TorchPowerSGD`` approximates (module docstring)."""
    rank = strategy.matrix_approximation_rank
    return Approximation(exact_steps=strategy.start_powersgd_iter, max_rank=rank,
                         compresses=lambda shape: compresses(tuple(shape), rank))


def compressed_buckets(gradients, ready_seconds, backward_seconds, bucket_size_mb, rank: int = 1) -> list[Transfer]:
    """The all-reduces of a compressed step (after the vanilla ones): PyTorch's bucket plan, each
    bucket sending its uncompressed tensors, then its Ps (n r a matrix), then its Qs (m r), one
    after the other once its last gradient is ready. Gradients without a shape are sent whole."""
    transfers = []
    for bucket in scheduled_buckets(gradients, bucket_size_mb):
        ready = max(ready_seconds[i] for i in bucket)
        whole = ps = qs = 0
        for i in bucket:
            gradient, shape = gradients[i], tuple(getattr(gradients[i], "shape", ()))
            if compresses(shape, rank):
                n, m = shape[0], math.prod(shape[1:])
                ps += n * min(n, m, rank) * gradient.element_size
                qs += m * min(n, m, rank) * gradient.element_size
            else:
                whole += gradient.size_bytes
        transfers += [Transfer(ready, size) for size in (whole, ps, qs) if size]
    return transfers


def error_feedback_buffers(plan: MemoryPlan) -> StepBuffers:
    """DDP's buckets (a second copy of the gradients) and PowerSGD's error feedback, a tensor the
    size of each bucket (kept from step to step); while a bucket is compressed, the hook's copy of
    it (``input_tensor_cp``, a bucket's worth at most). Its Ps and Qs, (n + m) r elements a matrix,
    are small beside them and left out."""
    bucket = plan.gradient_bytes if plan.bucket_bytes is None else min(plan.gradient_bytes, plan.bucket_bytes)
    return StepBuffers(kept_bytes=2 * plan.gradient_bytes, synchronization_bytes=bucket)


declare(
    TorchPowerSGD,
    sharding=REPLICATED,
    communicates=True,
    accumulates_locally=True,  # DistributedDataParallel.no_sync(): no hook runs inside it
    records_collectives=False,  # the hook's collectives are c10d's, read from the profiler
    # DDP re-plans its buckets over its first three steps; PowerSGD compresses from step 2 (the default)
    steps_to_settle=3,
    first_bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES,  # DDP's bucket plan
    closes_bucket_after_cap=True,
    keeps_gradient_buckets=True,
    step_buffers=error_feedback_buffers,
    communication_schedule=compressed_buckets,
    approximation=powersgd_approximation,
)
