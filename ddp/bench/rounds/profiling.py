"""The rank side of ``ddp profile``: a few training steps of the one step (``ddp.bench.rounds.trainer``)
under ``torch.profiler``, with every collective's launch and completion recorded.

What a profiled step attaches to the trainer (``ddp.bench.collectives.recording.recorded_step``: a ``PhaseRecorder``): each phase
("forward", "backward", "gradient_sync", "optimizer") as a profiler range, an NVTX range of the
same name on CUDA (so Nsight Systems shows the same phases), and its ``[start, end]`` on the
``time.perf_counter`` clock. Collectives are recorded by ``ddp.strategies.tracing`` (gloo completes
the work's future on its own thread, which stamps the completion); for ``torch`` a DDP comm hook
launches the all-reduce through it too, so PyTorch's reducer is measured the same way.
``backward_compute_end`` is the trainer's end of backward's computation (``BackwardComputeEnd``).

Each rank writes its Chrome/Perfetto trace and returns its step records (``profile_on`` runs them);
the parent turns them into figures (``ddp.analysis.profiles``, ``ddp.analysis.overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.bench.collectives.recording import recorded_step
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.records import file_stem
from ddp.bench.rounds.rank_state import RankCannotRun, first_withdrawn, skip_reason
from ddp.bench.rounds.trainer import CannotRun, Trainer
from ddp.launcher import Rank, on_rank
from ddp.strategies import tracing
from ddp.strategies.registry import resolve_strategy
from ddp.strategies.torch_ddp import TorchDDP


@dataclass(frozen=True)
class ProfileConfig:
    step: StepConfig
    """What is trained."""
    warmup_steps: int = 1
    """Steps run before profiling, untraced (allocations, first-step copies, DDP's bucket rebuild)."""
    steps: int = 2
    """Steps profiled and summarised."""
    out_dir: str = "profile"
    """Folder for the traces, on the ranks' host."""


def _recorded_allreduce_hook(model, bucket):
    """PyTorch's default DDP hook (sum, then divide by world size), launched through
    ``ddp.strategies.tracing`` with the model's ``collective_recorder``, so that each bucket's
    launch and completion are recorded like any strategy's collectives.

    Unannotated on purpose: DDP accepts only the real classes as annotations, and this module's
    ``from __future__ import annotations`` would turn them into strings.
    """
    world_size = dist.get_world_size(model.process_group)
    work = tracing.launch_all_reduce(bucket.buffer(), dist.ReduceOp.SUM, model.process_group, f"bucket{bucket.index()}",
                                     model.collective_recorder)
    return work.get_future().then(lambda future: future.value()[0].div_(world_size))


def traced_by_comm_hook(strategy: str) -> bool:
    """Whether ``ddp profile`` records the strategy's collectives through a DDP comm hook (PyTorch's
    reducer, ``torch`` and what derives from it): such a strategy cannot also take the compress
    hook of a reduced-precision ``comm_dtype``, except on NCCL, whose kernels the trace shows."""
    return issubclass(resolve_strategy(strategy), TorchDDP)


def _trace_torch_reducer(model) -> None:
    # DDP takes one comm hook: with comm_dtype the strategy's is PyTorch's compress hook, kept
    # (NCCL kernels in the trace then say when it communicated; ``ddp profile`` refuses it on gloo).
    if isinstance(model, TorchDDP) and model.comm_dtype is None:  # must precede the first forward; the hook's state is the model itself
        model.ddp.register_comm_hook(model, _recorded_allreduce_hook)


@on_rank
def profile_rank(rank: Rank, config: ProfileConfig) -> dict:
    """Runs on every rank: warm up, profile ``config.steps`` steps, write this rank's trace.

    Returns ``{"rank", "device", "trace_file", "steps"}``, the steps ``RecordedStep``s on the
    ``time.perf_counter`` clock.
    """
    info = rank.info
    on_cuda = info.device.type == "cuda"
    trainer = None
    try:
        trainer = Trainer(config.step, info, before_first_step=_trace_torch_reducer)
        for _ in range(config.warmup_steps):
            trainer.step()
    except CannotRun as error:
        if trainer is not None:
            trainer.close()
        return RankCannotRun(info.rank, str(error))
    try:
        dist.barrier()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        steps: list[RecordedStep] = []
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(config.steps):
                steps.append(recorded_step(trainer))
                profiler.step()
        trace_file = Path(config.out_dir) / f"trace_{file_stem(config.step.strategy)}_rank{info.rank}.json"
        profiler.export_chrome_trace(str(trace_file))
    finally:
        trainer.close()
    return {"rank": info.rank, "device": str(info.device), "trace_file": str(trace_file), "steps": steps}


def profile_on(ranks, configs: list[ProfileConfig]) -> list[list[dict]]:
    """Profile each configuration on ``ranks`` (a ``RankGroup``): per configuration, each rank's
    record (its steps and the trace file it wrote). ``ddp.analysis.profiles`` reads them. Raises
    ``CannotRun`` naming the configuration when a rank cannot run it (``CannotRun``)."""
    records = []
    for config in configs:
        results = ranks.run(profile_rank, config)
        marker = first_withdrawn(results)
        if marker is not None:
            raise CannotRun(skip_reason(config.step, ranks.world_size, marker))
        records.append(results)
    return records
