"""Steps recorded collective by collective, on a rank: when each phase ran, when backward's
computation ended, and each collective's ready, launch and completion, on the ``time.perf_counter``
clock. ``ddp profile`` records its steps here (``ddp.bench.rounds.profiling``), and so do the untimed
*traced steps* of every benchmark (``traced_steps``, their number ``RoundOptions.traced_steps``),
run on ranks that time nothing afterwards (``ddp.bench.rounds.traced.trace``), so that a timed step never
carries a recorder nor follows a profiler in its process.

Where the collectives' times come from (a step's ``comm_source``):

- ``collective_records``: the strategy's own records (``ddp.strategies.tracing``: every strategy
  written here; gloo completes a work's future when the collective is done);
- ``profiler``: the profiler's record, for a strategy that records nothing itself (PyTorch's DDP,
  whose reducer launches its buckets from C++; a user's class): each of c10d's calls on the
  training thread (the launch) paired in order with gloo's execution of it on gloo's thread (its
  end is the completion); bucket labels and sizes from the strategy's ``bucket_sizes_bytes``
  where their number matches;
- ``nccl_kernels``: on NCCL the futures complete when the kernels are enqueued, so the GPU times of
  NCCL's kernels, and the compute kernels' for the phases.

The trace is read once, by the reader of every trace (``ddp.bench.collectives.timeline.read_recorded``).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.bench.collectives.timeline import read_recorded, with_timelines
from ddp.bench.config.shape import RecordedStep, StepObserver
from ddp.strategies import tracing
from ddp.strategies.declarations import traits_of

# How long to wait, after a step, for completion stamps that gloo's thread has yet to write: wait()
# may return before the future's callbacks have run.
COMPLETION_STAMP_TIMEOUT_SECONDS = 10.0


class PhaseRecorder(StepObserver):
    """Profiler and NVTX ranges around each phase, and their ``[start, end]`` into ``self.step``
    (a ``RecordedStep``'s ``phases``):
    each of the step's phases (``ddp.bench.config.shape.StepShape.phases``) once; a phase entered
    again in the same step (``accumulate``, once per micro-batch) spans from its first start to its
    last end, never only the last."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.step: dict = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_cuda:
            torch.cuda.nvtx.range_push(name)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            self.step.setdefault(name, [start, start])[1] = time.perf_counter()
            if self.on_cuda:
                torch.cuda.nvtx.range_pop()


def wait_for_completion_stamps(recorder: tracing.CollectiveRecorder) -> None:
    deadline = time.monotonic() + COMPLETION_STAMP_TIMEOUT_SECONDS
    while any(span.done_seconds is None for span in recorder.spans):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{sum(s.done_seconds is None for s in recorder.spans)} collectives never reported completion "
                f"within {COMPLETION_STAMP_TIMEOUT_SECONDS:.0f} s after the step"
            )
        time.sleep(0.001)


def recorded_step(trainer, together: bool = False) -> RecordedStep:
    """One step of ``trainer`` (a ``ddp.bench.rounds.trainer.Trainer``: handed in, not imported, as
    the rounds that drive it sit above this folder) with its phases and its collectives recorded
    (a ``RecordedStep``; no collectives for a strategy that records none). ``together``: every rank
    starts it at once (a barrier first, as a timed round of several configurations does).
    ``RuntimeError`` where the step entered other phases than its shape declares
    (``StepShape.phases``): the readers of the record find each phase by that name."""
    if together:
        dist.barrier()
    observer = PhaseRecorder(trainer.cuda)
    collectives = tracing.CollectiveRecorder()
    trainer.model.collective_recorder = collectives
    try:
        trainer.step(observer)
        wait_for_completion_stamps(collectives)
    finally:
        trainer.model.collective_recorder = None
    if tuple(observer.step) != trainer.shape.phases:  # the record is read by the phases the shape declares
        raise RuntimeError(f"the step entered the phases {', '.join(observer.step)}; its shape declares {', '.join(trainer.shape.phases)}")
    return RecordedStep(observer.step, trainer.backward_compute_end.seconds, [asdict(span) for span in collectives.spans])


def traced_steps(trainer, steps: int) -> list[RecordedStep]:
    """``steps`` recorded steps, each started by every rank at once, each with its collectives'
    times from the best source (module docstring) and its ``timeline``: the partition of its
    window (``ddp.bench.collectives.timeline``). Always ``steps`` training steps, whatever the source.

    On CUDA the steps always run under the profiler, CUDA activity recorded: the partition is the
    GPU's timeline (NCCL's kernels, or gloo's ranges over CUDA tensors), the same reading as
    ``ddp trace``'s. On CPU a strategy that records its collectives runs without a profiler, and
    the partition comes from the recorded phases and collectives (``cpu_partition``); one that
    records none (PyTorch's DDP) runs under the CPU profiler, which sees c10d's calls and gloo's work."""
    nccl = trainer.cuda and dist.is_initialized() and dist.get_backend() == "nccl"
    records_its_own = traits_of(type(trainer.model)).records_collectives
    if not trainer.cuda and (records_its_own or not trainer.communicates):
        return with_timelines([recorded_step(trainer, together=True) for _ in range(steps)])
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if trainer.cuda else [])
    with torch.profiler.profile(activities=activities) as profiler:
        records = [recorded_step(trainer, together=True) for _ in range(steps)]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return read_recorded(events, records, getattr(trainer.model, "bucket_sizes_bytes", None), cuda=trainer.cuda, nccl=nccl,
                         own_records=records_its_own)
