"""What a rank keeps between the parent's calls, and the entry points the parent runs on it.

One ``RankBench`` per rank process, kept by that process's ``ddp.launcher.Rank`` (the launcher's
worker, or the process torchrun started) and handed to the entry points below, holds the trainers of the configurations being timed and
the all-reduce benchmark's buffers; ``release`` frees them. Building another set of configurations
frees the old one first (an xl model and its AdamW state take 32 GB), and a released
configuration leaves nothing alive (``Trainer.close``): every configuration gets the memory it
would get alone. On CUDA, ``release`` checks that the device got back what the configurations it
dropped held, and says what is left otherwise.

**Out of memory** is not an error here: a rank that runs out frees what it held and returns an
``OutOfMemory`` marker, so the caller decides (perf_tests skip with its ``reason``). It is freed
outside the ``except`` block: the exception's traceback holds the frames of the failed step, and
with them its activations and autograd graph. A configuration this machine cannot run
(``ddp.bench.rounds.trainer.CannotRun``) returns an ``RankCannotRun`` marker the same way. A rank
whose process a signal ended (the host's out-of-memory killer) returns nothing: the parent makes
a ``RankLost`` marker of the launcher's ``RankKilled`` instead.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from ddp.bench.collectives.recording import traced_steps
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.ledger import BUILDS, MEMORY_COUNTS, RESTORED, ROUNDS, TRACED, WARMUP, Ledger, take
from ddp.bench.rounds.reuse import KeptModels
from ddp.bench.rounds.trainer import CannotRun, StepSetup, StepTiming, Trainer
from ddp.launcher import Rank, RankInfo, RankKilled, Withdrawn, on_rank, preload_in_ranks
from ddp.strategies.base import gather_full_params
from ddp.strategies.registry import steps_to_settle

# Every rank runs this module's entry points, and counts memory under MemTracker on CPU: imported
# in the fork server, once, rather than in each rank of each group at its first call (MemTracker's
# module alone took 1.3 s here). Neither touches CUDA, which a rank initialises after its fork.
preload_in_ranks(__name__, "torch.distributed._tools.mem_tracker")

T = TypeVar("T")


@dataclass(frozen=True)
class OutOfMemory(Withdrawn):
    """Returned instead of a result by a rank that ran out of memory; it has freed its state.

    The launcher waits only a short grace for the other ranks, which may be blocked in a collective
    this rank left (ranks do not always run out together: another process's memory on one GPU, a
    model that allocates per rank), and replaces the group if they are, or if ``group_broken``."""

    rank: int
    message: str
    allocated_bytes: int | None
    """CUDA memory still allocated after freeing (None on CPU)."""
    peak_bytes: int | None
    total_bytes: int | None
    """The device's memory (None on CPU)."""
    group_broken: bool = False
    """The error came from the communicator (an NCCL error that mentions out of memory): the
    process group may be unusable, so it is replaced rather than reused."""


# What the allocators say when they refuse: CUDA's and NCCL's "out of memory"; the CPU's
# DefaultCPUAllocator (c10/core/impl/alloc_cpu.cpp) "can't allocate memory" or "not enough memory".
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error (``torch.cuda.OutOfMemoryError`` exists in every supported
    torch), or a RuntimeError that says so (host allocations, NCCL)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(words in str(error).lower() for words in _OUT_OF_MEMORY)
    )


@dataclass(frozen=True)
class RankCannotRun(Withdrawn):
    """Returned instead of a result by a rank that cannot run a configuration (``CannotRun``); it
    has freed its state."""

    rank: int
    message: str


@dataclass(frozen=True)
class RankLost:
    """Not a rank's result but the parent's, made from ``ddp.launcher.RankKilled``: a signal ended
    a rank's process (most often the host's out-of-memory killer, which no rank can catch or
    report) while it ran a configuration. Its group was ended; the next call starts fresh ranks."""

    rank: int
    message: str
    """The error's first line: the rank, its process and group, the signal and its likely cause."""

    @classmethod
    def of(cls, error: RankKilled) -> RankLost:
        return cls(error.rank, error.summary)


@dataclass(frozen=True)
class _Failure:
    """What is kept of an out-of-memory error once its traceback (and the tensors its frames
    hold) is gone."""

    message: str
    group_broken: bool
    peak_bytes: int | None


@dataclass
class RankBench:
    """The state one rank keeps between the parent's calls: see the module docstring."""

    trainers: dict[StepConfig, Trainer] = field(default_factory=dict)
    allreduce_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    """float32 buffers of the all-reduce benchmark, by element count."""
    kept: KeptModels = field(default_factory=KeptModels)
    """Models kept for the next configuration of the same workload (``ddp.bench.rounds.reuse``)."""
    ledger: Ledger = field(default_factory=Ledger)
    """What each configuration's builds, warm-up, memory counts, rounds and traced steps took
    here, until the parent takes it (``take_ledger``)."""

    def prepare(self, info: RankInfo, configs: Sequence[StepConfig], warmup_steps: int,
                count_memory: bool = True, fixed_warmup: bool = False, traced_steps: int = 0) -> list[StepSetup] | Withdrawn:
        """Build ``configs`` (freeing every other one, keeping those already built: the local
        twin of the next strategy of the same group is the same), warm up each fresh build
        (``_build``) and run ``warmup_steps`` untimed steps of each kept one.
        ``count_memory``: each fresh build's training state counted (``Trainer.count_setup``) in
        its warm-up. ``traced_steps``: that many traced steps of each fresh build in its warm-up
        (``StepSetup.traced``; CPU only: on CUDA the profiler leaves CUPTI attached to the
        process, ``trace``). ``fixed_warmup``: a fresh build's warm-up is its settling steps
        alone, never more however its step changes: contenders whose weights are compared
        afterwards (``ddp.bench.rounds.race``) must have trained the same steps.
        """

        def build() -> list[StepSetup]:
            self._build(info, configs, warmup_steps, count_memory=count_memory, fixed_warmup=fixed_warmup,
                        traced_steps=traced_steps)
            return [self._count_setup(config, count_memory) for config in configs]

        return self._withdrawing(info, build)

    def _count_setup(self, config: StepConfig, count_memory: bool) -> StepSetup:
        trainer = self.trainers[config]
        if not count_memory or trainer.memory is not None:
            return trainer.count_setup(count_memory)  # nothing to count: the kept count
        with self.ledger.timing(MEMORY_COUNTS, config):
            return trainer.count_setup(count_memory)

    def _settle(self, info: RankInfo, trainer: Trainer, steps: int) -> list[float]:
        """``steps`` untimed steps of a fresh build, the last one counting its collectives where
        its strategy does not say (``Trainer.count_collectives``); the plain steps' slowest-rank
        times since the last counting step (a step under the profiler compares with nothing)."""
        seconds: list[float] = []
        with self.ledger.timing(WARMUP, trainer.config, count=steps):
            for index in range(steps):
                if index == steps - 1 and not trainer.states_its_collectives:
                    trainer.count_collectives()
                    seconds = []
                else:
                    seconds.append(_slowest(info, trainer.step().step_seconds))
        return seconds

    def _until_settled(self, info: RankInfo, config: StepConfig, seconds: list[float], steps: int) -> None:
        """Untimed steps of a fresh build that has trained ``steps`` (``seconds``: its plain steps'
        times so far) while ``still_changing`` says so, at most ``MAX_WARMUP_STEPS`` in all. The
        ranks agree on every decision: each step's time is its slowest rank's."""
        trainer = self.trainers[config]
        while still_changing(seconds) and steps < MAX_WARMUP_STEPS:
            with self.ledger.timing(WARMUP, config):
                seconds.append(_slowest(info, trainer.step().step_seconds))
            steps += 1

    def _build(self, info: RankInfo, configs: Sequence[StepConfig], warmup_steps: int, keep_others: bool = False,
               count_memory: bool = False, fixed_warmup: bool = False, traced_steps: int = 0) -> None:
        """Build and warm up ``configs`` (see ``prepare``), freeing every other one unless ``keep_others``.

        A fresh build's warm-up: the steps its plan needs to settle, at least ``warmup_steps``
        (its strategy's ``steps_to_settle``: ``bucketed`` re-plans its buckets after its first step,
        PyTorch's DDP rebuilds its buckets in its second and records the new plan, which
        ``StepSetup`` reports, in its third; a user's class may do the same); then the steps that
        run anyway, its training state counted (``count_memory``: ``Trainer.count_memory``, two
        steps under MemTracker on CPU) or its traced steps (``traced_steps``), which also tell
        whether the step has stopped changing (``still_changing``, on their times, each kind
        compared with itself: a step under MemTracker costs about two plain ones); then plain
        steps while it still changes (``_until_settled``). On CUDA the step ends in a synchronize
        (``Trainer.step``), so what changes there over the first steps (the caching allocator
        growing its pool, cuBLAS's handles and workspaces, the kernels' first loads) is in the
        times compared; on CPU, mostly the first touch of the allocator's pages (mini's first
        step of a fresh build: 1.0-1.3x the next on this project's machine)."""
        kept = {config: self.trainers.pop(config) for config in configs if config in self.trainers}
        others, self.trainers = self.trainers, {}
        if keep_others:
            kept = {**others, **kept}
        else:
            self.trainers = others
            self.release(info, keep_models=True)  # whatever is not asked for any more, before building (memory)
        self.trainers = dict(kept)
        self.kept.keep_only([*configs, *self.trainers])
        settled: dict[StepConfig, tuple[int, list[float]]] = {}  # each fresh build's steps so far, and its plain steps' times
        for config in configs:
            if config in kept:
                if not warmup_steps:
                    continue
                with self.ledger.timing(WARMUP, config, count=warmup_steps):
                    for _ in range(warmup_steps):
                        kept[config].step()
                continue
            # Built and settled one at a time, so that on CUDA what each holds between its steps
            # is what the allocator gained meanwhile (``ddp.bench.rounds.trainer.own_peak_bytes`` reads it).
            before, held_before, restores = _allocated_bytes(info), self.kept.held_bytes(), self.kept.restores
            with self.ledger.timing(BUILDS, config):
                trainer = self.trainers[config] = Trainer(config, info, workloads=self.kept.workload)
                if info.device.type == "cuda":  # its allocations and initialising kernels are queued: the build's, not its first step's
                    torch.cuda.synchronize(info.device)
            if self.kept.restores > restores:
                self.ledger.add(RESTORED, 0.0, config)
            steps = max(steps_to_settle(config.strategy), warmup_steps)
            settled[config] = steps, self._settle(info, trainer, steps)
            if before is not None:  # a kept copy made, or a released module taken, is not this build's doing
                trainer.resident_bytes = _allocated_bytes(info) - before - (self.kept.held_bytes() - held_before)
        for config, (steps, seconds) in settled.items():
            trainer = self.trainers[config]
            if count_memory:
                with self.ledger.timing(MEMORY_COUNTS, config):
                    tracked = [_slowest(info, timing.step_seconds) for timing in trainer.count_memory()]
                steps += len(tracked)
                seconds = tracked if len(tracked) > 1 else seconds + tracked  # on CUDA one plain step
            if traced_steps:
                with self.ledger.timing(TRACED, config, count=traced_steps):
                    trainer.traced = recorded = traced_in_warmup(trainer, traced_steps)
                steps += traced_steps
                seconds = [_slowest(info, step.seconds) for step in recorded]
            if not fixed_warmup:
                self._until_settled(info, config, seconds, steps)

    def round(self, info: RankInfo, configs: Sequence[StepConfig], round_index: int) -> list[StepTiming] | Withdrawn:
        """One step of each configuration, in an order that rotates with ``round_index`` so that
        drift in the machine falls on all of them alike; timings in the order of ``configs``."""
        missing = [c.describe() for c in configs if c not in self.trainers]
        if missing:
            raise RuntimeError(f"a round of {'; '.join(missing)} before prepare built it on this rank")
        shift = round_index % len(configs)
        order = list(range(len(configs)))[shift:] + list(range(len(configs)))[:shift]

        def run() -> list[StepTiming]:
            timings: dict[int, StepTiming] = {}
            for index in order:
                if len(configs) > 1:
                    dist.barrier()  # every rank starts each contender's step together
                with self.ledger.timing(ROUNDS, configs[index]):
                    timings[index] = self.trainers[configs[index]].step()
            return [timings[index] for index in range(len(configs))]

        return self._withdrawing(info, run)

    def trace(self, info: RankInfo, configs: Sequence[StepConfig], warmup_steps: int, steps: int,
              keep_built: bool = False) -> list[list[RecordedStep]] | Withdrawn:
        """``steps`` traced steps of each configuration (``ddp.bench.collectives.recording.traced_steps``), one
        configuration after the other, each built and warmed up first (as ``prepare`` does) unless
        it is built already, and everything freed afterwards; per configuration the step records
        (none for a configuration that communicates nothing). ``keep_built``: nothing is freed, what
        is built is traced as it is, without warm-up (CPU only: traced where it was timed, below).

        The traced steps may run the profiler, and on CUDA the profiler leaves CUPTI attached to
        the process once done (Kineto tears it down only when TEARDOWN_CUPTI says so, and then
        lazily: pytorch#144455, kineto#1264, #1554), which slows every kernel launched after it by
        10-20% in the reports there. So this runs on ranks that time nothing afterwards
        (``ddp.bench.rounds.traced.trace``)."""

        def run() -> list[list[RecordedStep]]:
            self._build(info, configs, 0 if keep_built else warmup_steps, keep_others=keep_built)
            traces = []
            for config in configs:
                with self.ledger.timing(TRACED, config, count=steps):
                    traces.append(traced_steps(self.trainers[config], steps))
            if not keep_built:
                self.release(info)
            # What the profiler's records held, freed, would stay with this process (above): on
            # CPU, where it traced in a group that goes on timing, 0.6 GiB a configuration of small.
            hand_back_free_memory(info.device)
            return traces

        return self._withdrawing(info, run)

    def _withdrawing(self, info: RankInfo, work: Callable[[], T]) -> T | Withdrawn:
        """``work()``, or the marker of why it could not run (``CannotRun``: ``RankCannotRun``; out of
        memory: ``OutOfMemory``), this rank's state freed."""
        try:
            return work()
        except CannotRun as error:
            message, failure = str(error), None
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            failure = self._failure(info, error)
        # Freed here, once the except block has let go of the traceback: its frames hold the
        # failed step's tensors, which nothing could free while it was handled.
        if failure is not None:
            return self.out_of_memory(info, failure)
        self.release(info)
        return RankCannotRun(info.rank, message)

    @staticmethod
    def _failure(info: RankInfo, error: BaseException) -> _Failure:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        return _Failure(
            message=message,
            group_broken=isinstance(error, dist.DistError) or "nccl" in message.lower(),
            peak_bytes=torch.cuda.max_memory_allocated(info.device) if info.device.type == "cuda" else None,
        )

    def out_of_memory(self, info: RankInfo, failure: _Failure) -> OutOfMemory:
        """Free this rank's state and describe what memory looked like."""
        on_cuda = info.device.type == "cuda"
        self.release(info)
        return OutOfMemory(
            rank=info.rank,
            message=failure.message,
            allocated_bytes=torch.cuda.memory_allocated(info.device) if on_cuda else None,
            peak_bytes=failure.peak_bytes,
            total_bytes=torch.cuda.get_device_properties(info.device).total_memory if on_cuda else None,
            group_broken=failure.group_broken,
        )

    def release(self, info: RankInfo, keep_models: bool = False) -> None:
        """Drop every trainer and buffer kept on this rank and return the memory to the device;
        ``keep_models``: their models stay for the next build of the same workload
        (``ddp.bench.rounds.reuse``; the parent frees with it off, and every copy goes too). On
        CUDA, say so where a user sees it when the device did not get back what they held: what
        each trainer had allocated once built (``resident_bytes``) and the buffers' bytes. Memory
        that something else holds (a configuration kept for the next build, a test's own model) is
        none of its business."""
        dropped = sum(trainer.resident_bytes or 0 for trainer in self.trainers.values())
        dropped += sum(buffer.numel() * buffer.element_size() for buffer in self.allreduce_buffers.values())
        before, held_before = _allocated_bytes(info), self.kept.held_bytes()
        trainers, self.trainers = self.trainers, {}
        for config in list(trainers):
            trainer = trainers.pop(config)
            workload = trainer.workload
            trainer.close()
            if keep_models:
                self.kept.give_back(config, workload)
            del trainer, workload
        if not keep_models:
            self.kept.keep_only([])
        self.allreduce_buffers = {}
        gc.collect()
        if info.device.type == "cuda":
            # cuBLAS keeps a workspace per handle and stream (32 MiB each on Hopper by its default
            # CUBLAS_WORKSPACE_CONFIG) in the caching allocator, where empty_cache() does not reach
            # it: only this call frees it (what PyTorch's own tests call between tests). Absent from
            # CPU builds. A build's first matmul makes it, so it counts in that build's resident bytes.
            clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_cublas_workspaces is not None:
                clear_cublas_workspaces()
            torch.cuda.empty_cache()
            held = dropped - ((before - held_before) - (_allocated_bytes(info) - self.kept.held_bytes()))
            if held > 2**20:  # not an error: the next build may still fit
                print(f"ddp-bench: rank {info.rank} still holds {held / 2**20:.1f} MiB of CUDA memory of the "
                      "configurations it released", flush=True)

    def trainer(self, config: StepConfig) -> Trainer:
        if config not in self.trainers:
            raise RuntimeError(f"{config.describe()} is not built on this rank: prepare it first")
        return self.trainers[config]


# A step "still changing" is more than this much faster than the one before it. Mini's steps on
# this project's 2-core CPU scatter by about +-10% from one to the next once warm (local at 4 x 64:
# 208-250 ms over ten steps after the first), and the first step of a fresh build there is 1.0-1.3x
# the next (270 ms against 219); on a GPU the first steps take several times the next (the
# allocator's pool, cuBLAS's handles, the kernels' first loads). At 10% a warm CPU step read as
# changing about once a build, which cost the default run 10 s of steps that changed nothing.
WARMUP_CHANGE = 0.20
MAX_WARMUP_STEPS = 12
"""No fresh build gets more warm-up steps than this, changing or not (the plan's settling included)."""


def still_changing(seconds: Sequence[float], tolerance: float = WARMUP_CHANGE) -> bool:
    """Whether a step is still getting faster, by the last two of ``seconds`` (consecutive untimed
    steps of one kind): fewer than two, or the last more than ``tolerance`` faster than the one before."""
    return len(seconds) < 2 or seconds[-1] < (1.0 - tolerance) * seconds[-2]


def traced_in_warmup(trainer: Trainer, steps: int) -> list[dict]:
    """``steps`` traced steps of a build in its warm-up (``traced_steps``), on CPU only: on CUDA
    the profiler leaves CUPTI attached to a process that goes on timing (``RankBench.trace``)."""
    if trainer.cuda:
        raise RuntimeError("traced steps in a warm-up run on CPU only: on CUDA trace on ranks that time nothing")
    return traced_steps(trainer, steps)


def _slowest(info: RankInfo, seconds: float) -> float:
    """The slowest rank's ``seconds``: what every rank decides on (one all-reduce, untimed)."""
    if info.world_size == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=info.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _allocated_bytes(info: RankInfo) -> int | None:
    """CUDA memory allocated on this rank's GPU; None on CPU."""
    return torch.cuda.memory_allocated(info.device) if info.device.type == "cuda" else None


# Entry points the parent runs on every rank (``RankGroup.run`` needs importable functions); each
# is handed the calling rank (``on_rank``), whose ``RankBench`` it uses.


@on_rank
def prepare(rank: Rank, configs: Sequence[StepConfig], warmup_steps: int = 1,
            count_memory: bool = True, fixed_warmup: bool = False, traced_steps: int = 0) -> list[StepSetup] | Withdrawn:
    return rank.keep(RankBench).prepare(rank.info, configs, warmup_steps, count_memory, fixed_warmup, traced_steps)


@on_rank
def timed_round(rank: Rank, configs: Sequence[StepConfig], round_index: int = 0) -> list[StepTiming] | Withdrawn:
    return rank.keep(RankBench).round(rank.info, configs, round_index)


@on_rank
def traced(rank: Rank, configs: Sequence[StepConfig], warmup_steps: int, steps: int,
           keep_built: bool = False) -> list[list[RecordedStep]] | Withdrawn:
    return rank.keep(RankBench).trace(rank.info, configs, warmup_steps, steps, keep_built)


@on_rank
def set_model_reuse(rank: Rank, enabled: bool) -> None:
    """Keep built models for the next configuration of the same workload, or not (then every kept
    copy goes): ``ddp.bench.rounds.reuse``."""
    kept = rank.keep(RankBench).kept
    kept.enabled = enabled
    if not enabled:
        kept.keep_only([])


@on_rank
def take_ledger(rank: Rank) -> Ledger:
    """This rank's ledger since the last call (``ddp.bench.rounds.ledger``), emptied here."""
    return take(rank.keep(RankBench).ledger)


@on_rank
def release(rank: Rank) -> None:
    rank.keep(RankBench).release(rank.info)


@on_rank
def return_cached_memory(rank: Rank) -> None:
    """``hand_back_free_memory`` on a rank."""
    hand_back_free_memory(rank.info.device)


def hand_back_free_memory(device: torch.device) -> None:
    """Give the memory this process has freed but still holds back to the device, so that another
    process on the same GPU or host may use it. On CUDA the caching allocator keeps a step's
    transient peak reserved (``torch.cuda.empty_cache`` returns its free blocks). On CPU glibc's
    heap keeps freed blocks resident unless they lie at its top, so a process keeps the most its
    steps and the profiler's records ever held: six profiled steps of ``small`` left 1.2 GiB more
    resident here, which ``malloc_trim(0)`` gave back in 0.09 s (the CPU's ``empty_cache``;
    nothing where the C library has none, as musl's or macOS's)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif (trim := getattr(_c_library(), "malloc_trim", None)) is not None:
        trim(0)


@functools.cache
def _c_library() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library the process already has loaded


@on_rank
def allocated_bytes(rank: Rank) -> int | None:
    """CUDA memory allocated on this rank's GPU now; None on CPU."""
    return _allocated_bytes(rank.info)


# Elements of each trained parameter a rank hands the parent to tell whether contenders trained
# alike, evenly spaced over the tensor: xl's 2.0B parameters whole would be 8 GB a rank through the
# launcher's pipe and /dev/shm (64 MB in a container by default), 1,024 of each of its 435 tensors 1.8 MB.
WEIGHT_SAMPLE = 1024


@on_rank
def weights_sample(rank: Rank, config: StepConfig) -> list[tuple[float, torch.Tensor]]:
    """The trained parameters of a configuration on this rank, in brief, on the CPU: per parameter
    its norm (in float64, every element counted) and up to ``WEIGHT_SAMPLE`` of its elements at
    evenly spaced places, the same places for every contender (``ddp.bench.rounds.race``)."""
    sampled = []
    for param in gather_full_params(rank.keep(RankBench).trainer(config).model).values():
        flat = param.detach().reshape(-1)
        every = max(1, flat.numel() // WEIGHT_SAMPLE)
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64).item()
        sampled.append((norm, flat[::every][:WEIGHT_SAMPLE].float().cpu().clone()))
    return sampled


def first_withdrawn(results: Sequence) -> OutOfMemory | RankCannotRun | None:
    """The first rank's marker among per-rank results, if any rank ran out of memory or could not run."""
    return next((r for r in results if isinstance(r, Withdrawn)), None)


def skip_reason(config: StepConfig, world_size: int, marker: OutOfMemory | RankCannotRun | RankLost) -> str:
    """Why ``config`` was not measured: the rank's out-of-memory figures, why it cannot run, or
    what ended a rank's process."""
    if isinstance(marker, RankCannotRun):
        return f"cannot run {config.describe()}: {marker.message}"
    if isinstance(marker, RankLost):
        return (f"rank killed: {config.describe()}, {world_size} rank{'s' if world_size != 1 else ''}: "
                f"{marker.message}; the next benchmark runs on fresh ranks")
    return oom_reason(config, world_size, marker)


def oom_reason(config: StepConfig, world_size: int, marker: OutOfMemory) -> str:
    """A skip reason naming the configuration and the memory figures."""
    gib = 2**30
    if marker.total_bytes is not None:
        memory = (
            f"peak {marker.peak_bytes / gib:.1f} GiB allocated of {marker.total_bytes / gib:.1f} GiB "
            f"on rank {marker.rank}'s GPU"
        )
    else:
        memory = f"host memory exhausted on rank {marker.rank}"
    return (
        f"out of memory: {config.describe()}, {world_size} rank{'s' if world_size != 1 else ''}: {memory} ({marker.message}); "
        "use a smaller batch size, sequence length or model"
    )
