"""The one training step that every tool times, and what one step reports.

``Trainer.step`` is the step of perf_tests/, ``ddp run``, ``ddp versus`` and ``ddp profile``
alike, in the shape ``ddp.bench.config.shape`` declares: forward, loss and ``loss.backward()`` of
each micro-batch (all but the last under ``no_sync()``), ``finish_gradient_synchronization()``,
``AdamW.step()`` and ``zero_grad(set_to_none=True)``, with the numerics of ``StepConfig.precision``
set around it (``ddp.bench.config.values``) and the previous ones restored outside its clock.
Every rank trains its own shard of a seeded global batch, the same micro-batches every step
(``ddp.bench.config.workloads.rank_batches``). On CUDA the clock starts after a
``torch.cuda.synchronize()`` and stops after another, so it covers the GPU's work.

It reports, per rank (``StepTiming``): ``step_seconds``, and ``sync_wait_seconds``, from the
end of backward's computation (the first autograd-engine callback, queued by a hook on the loss)
until gradients are synchronized (on CUDA: the collectives completed on the compute stream). That
wait is not the step's exposed communication, which only a timeline shows
(``ddp.bench.collectives.timeline``, from the traced steps): on CUDA it is the gap between two
events, and where the GPU waits on the host the gap is the host's (1.25-1.77 ms at world size 1 in
tf32/bf16 on an H200, where nothing communicates). The
harness adds two clock readings, that hook and that callback to a step (on CUDA two events, the
synchronize and a reset of the peak-memory counter), nothing per parameter;
perf_tests/test_harness_cost.py holds it against a plain loop of the same work.

``Trainer.close`` leaves nothing the configuration allocated alive: the strategy's ``close()``,
then every hook still on a parameter (a hook that refers back to its strategy is a cycle through
autograd the collector cannot free; tests/test_release.py).

Each choice and what it rests on (AdamW's implementations, precision, ``--grad-comm``,
``--compile``, the exposed-communication clock): docs/perf-suite.md, "The step and the rounds".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ddp.bench.config.shape import ACCUMULATE, NO_OBSERVER, RecordedStep, StepObserver, cannot_run, repeated_blocks
from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.values import GRAD_COMM, OPTIMIZER, forward_autocast, numerics, sharded_compute_dtype
from ddp.bench.config.workloads import Workload, build_workload, rank_batches
from ddp.bench.memory.state import StateMemory, measure_memory
from ddp.launcher import RankInfo
from ddp.strategies.base import make_optimizer, trainable_parameters
from ddp.strategies.registry import make_ddp

LEARNING_RATE = 1e-4  # the value does not change the time of a step; any small one trains sanely


@dataclass(frozen=True)
class StepSetup:
    """What one rank reports about a configuration once it is built and warmed up."""

    rank: int
    num_parameters: int
    num_parameter_tensors: int
    """Trainable parameter tensors (a tied weight counts once)."""
    bucket_sizes_bytes: list[int] | None
    """Gradient bytes in each bucket, in launch order (read after warm-up, when PyTorch's DDP has
    rebuilt its plan); None for strategies that do not say."""
    collectives_per_step: int | None
    """Collectives one step launches: the strategy's own figure, else counted during a warm-up
    step (see ``count_collectives``); None if neither is possible."""
    bytes_per_step: int
    """Gradient bytes this rank all-reduces per step (0 for ``local``)."""
    memory: StateMemory | None = None
    """This rank's parameters, gradients, optimizer state and peak (``ddp.bench.memory.state``)."""
    communicates: bool = True
    """Whether a step launches any collective (``Trainer.communicates``): what is traced."""
    traced: list[RecordedStep] | None = None
    """The traced steps this build ran in its warm-up (``ddp.bench.collectives.recording.traced_steps``),
    where asked (``RankBench.prepare``'s ``traced_steps``); None otherwise."""


@dataclass(frozen=True)
class StepTiming:
    """One rank's figures for one timed step."""

    rank: int
    step_seconds: float
    sync_wait_seconds: float
    """From the end of backward's computation to gradients synchronized (module docstring). Can be
    slightly negative on CUDA, where the two events are on different streams' clocks."""
    peak_memory_bytes: int | None
    """Peak CUDA memory allocated by this configuration during the step (``own_peak_bytes``: what
    other configurations built on the rank hold is not counted); None on CPU."""

    @property
    def seconds(self) -> float:
        """What the timing loop reads of any timing."""
        return self.step_seconds


def own_peak_bytes(peak_bytes: int, allocated_at_start_bytes: int, resident_bytes: int | None) -> int:
    """The peak of one configuration's step on a rank that holds others too: the allocator's peak
    (``max_memory_allocated``, reset at the step's start) counts every configuration resident on
    the rank (a ``local`` twin, a group's models), so what the others held at the step's start,
    ``allocated_at_start_bytes - resident_bytes``, is taken off. ``resident_bytes``: what this
    configuration holds between its steps, measured when it was built (``RankBench.prepare``);
    None counts everything (the configuration alone)."""
    if resident_bytes is None:
        return peak_bytes
    return peak_bytes - max(0, allocated_at_start_bytes - resident_bytes)


class BackwardComputeEnd:
    """Stamps the end of backward's computation: the loss's hook (the first thing backward runs)
    queues an autograd-engine callback, which the engine runs once every gradient is computed and
    before any callback queued after it (see the module docstring)."""

    def __init__(self, cuda: bool) -> None:
        self.seconds = 0.0
        """``time.perf_counter`` when the callback ran."""
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        """Recorded on the engine's stream when the callback ran (CUDA)."""

    def watch(self, loss: torch.Tensor) -> None:
        """Stamp the end of the backward that ``loss.backward()`` is about to run."""
        loss.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._stamp)

    def _stamp(self) -> None:
        self.seconds = time.perf_counter()
        if self.event is not None:
            self.event.record()


def compile_in_place(module: nn.Module) -> None:
    """``--compile on``: the model's repeated blocks compiled each on its own (the children of its
    largest ``nn.ModuleList``: the LM's transformer blocks), in place (``nn.Module.compile``), as
    torchtitan compiles each TransformerBlock and PyTorch's regional compilation recipe does; a
    model without one is compiled whole. Two reasons: identical blocks share one compiled graph
    (dynamo inlines their modules, so the 48 blocks of xl cost one block's compile time, not the
    whole model's), and each block's backward is a graph of its own, so its gradients are ready,
    and their collectives can start, as it ends, under every strategy alike.

    Alike also means without dynamo's ``DDPOptimizer``, which splits a graph traced under PyTorch's
    DistributedDataParallel at every bucket boundary (``torch/_dynamo/backends/distributed.py``:
    the ``torch`` strategy only, hundreds of graphs on xl at a 1 MiB cap), while a hand-written
    strategy's hooks see only whole blocks: ``optimize_ddp`` is turned off in the process."""
    import torch._dynamo  # the compiler, imported only when compiling

    torch._dynamo.config.optimize_ddp = False
    blocks = repeated_blocks(module)
    for part in (blocks if blocks is not None else [module]):
        part.compile()


class CannotRun(Exception):
    """A configuration that cannot run here, its message one line saying why and what to do.
    Raised on a rank while building or stepping it (a compiler the machine lacks, a shape its
    strategy or model cannot run: the rank returns ``RankCannotRun`` and the suite skips it), and
    by the parent for a measurement that cannot be made (predicted not to fit, out of memory:
    ``ddp versus`` and ``ddp profile`` print it and exit)."""


def drop_parameter_hooks(module: nn.Module) -> None:
    """Drop every tensor hook and post-accumulate-grad hook on ``module``'s parameters, and their
    gradients: what a strategy that does not undo its own hooks would otherwise keep alive."""
    for param in module.parameters():
        param.grad = None
        # Emptied in place: autograd's C++ side holds these very dicts, not the attributes.
        for hooks in (param._post_accumulate_grad_hooks, param._backward_hooks):
            if hooks:
                hooks.clear()


def strategy_options(config: StepConfig) -> dict:
    """The keywords ``config``'s strategy is built with: its bucket cap, the dtype it communicates
    gradients in and the one it computes in, where it takes them (``StepConfig`` leaves the others
    at their defaults)."""
    options = {"bucket_size_mb": config.bucket_size_mb} if config.bucket_size_mb is not None else {}
    options.update(GRAD_COMM[config.grad_comm].strategy_options())
    if (compute_dtype := sharded_compute_dtype(config.precision, config.strategy)) is not None:
        options["compute_dtype"] = compute_dtype  # FSDP's mixed precision: bf16 gathered, fp32 masters
    return options


def gradient_bytes_sent(config: StepConfig, params: list[torch.Tensor]) -> int:
    """Bytes of gradient a rank all-reduces per step, in the dtype they are sent."""
    comm = GRAD_COMM[config.grad_comm]
    return sum(p.numel() * comm.itemsize(p.element_size()) for p in params)


class Trainer:
    """One configuration on one rank: the workload wrapped in its strategy, AdamW, this rank's batch."""

    def __init__(self, config: StepConfig, info: RankInfo, before_first_step: Callable[[nn.Module], None] | None = None,
                 workloads: Callable[[StepConfig, torch.device], Workload] | None = None) -> None:
        """``before_first_step(model)`` may adjust the wrapped model before it runs (``ddp profile``
        hooks PyTorch's reducer there); ``workloads(config, device)`` builds the workload in place of
        ``build_workload``, seeded as it would be (``ddp.bench.rounds.reuse.KeptModels``)."""
        self.config = config
        self.rank = info.rank
        self.world_size = info.world_size
        self.device = info.device
        self.cuda = info.device.type == "cuda"
        if reason := cannot_run(config):  # the parent refuses it first; a command that builds directly too
            raise CannotRun(reason)
        self.shape = config.step_shape
        torch.manual_seed(config.seed)  # the same initial weights for every strategy of a model
        if workloads is None:
            workload = build_workload(config.model, config.batch_size, config.seq_len, info.device)
        else:
            workload = workloads(config, info.device)
        self.workload: Workload = workload
        module = workload.module
        self.shape.prepare(module)  # checkpointed blocks, before compiling and wrapping (as torchtitan orders them)
        if config.compile == "on":
            compile_in_place(module)  # forward and backward compiled on the first step
        # counted before wrapping: a sharding strategy takes the parameters out of the module or empties them
        params = trainable_parameters(module)
        self.num_parameters = sum(p.numel() for p in params)
        self.num_parameter_tensors = len(params)
        self.gradient_bytes = gradient_bytes_sent(config, params)
        del params
        self.optimizer = self.batches = None
        self.model = make_ddp(config.strategy, module, **strategy_options(config))
        try:
            if getattr(self.model, "module", None) is not module:
                raise TypeError(
                    f"strategy {config.strategy!r} must keep the module it wraps as .module (the suite reads the "
                    "trained parameters there): set self.module = module in its constructor"
                )
            if before_first_step is not None:
                before_first_step(self.model)
            self.optimizer = make_optimizer(self.model, torch.optim.AdamW, lr=LEARNING_RATE,
                                            **OPTIMIZER[config.optimizer].options)
            self.batches = rank_batches(workload, config.seed, info.rank, info.world_size, info.device,
                                        self.shape.micro_batches)
        except BaseException:
            self.close()  # a half-built configuration must not outlive its error either
            raise
        self.backward_compute_end = BackwardComputeEnd(self.cuda)
        self.counted_collectives: int | None = None  # see count_collectives
        self.memory: StateMemory | None = None
        """The training state ``count_setup`` counted, kept for the next ``count_setup``."""
        self.traced: list[RecordedStep] | None = None
        """The traced steps of its warm-up, where it ran some (``StepSetup.traced``)."""
        self.resident_bytes: int | None = None
        """On CUDA, what this configuration keeps allocated between its steps (parameters, optimizer
        state, the strategy's buffers, the batch), set by ``RankBench.prepare`` once built and
        warmed up; ``own_peak_bytes`` reads it."""

    def count_setup(self, count_memory: bool = True) -> StepSetup:
        """What this configuration is, for the record, counted by training untimed steps where a
        count needs them: ``count_memory``, its training state (``ddp.bench.memory.state.measure_memory``:
        one step, two under MemTracker on CPU), once per build and the same count after (sizes do
        not change from step to step), else None; its collectives, by one step under the profiler
        where the strategy does not say (``count_collectives``; ``RankBench.prepare`` has made that
        the last warm-up step)."""
        sizes = getattr(self.model, "bucket_sizes_bytes", None)
        if count_memory and self.memory is None:
            self.count_memory()
        calls = self.collectives_per_step()
        communicates = calls is None or calls > 0
        return StepSetup(
            rank=self.rank,
            num_parameters=self.num_parameters,
            num_parameter_tensors=self.num_parameter_tensors,
            bucket_sizes_bytes=list(sizes) if sizes is not None else None,
            collectives_per_step=None if calls is None else int(calls),
            bytes_per_step=self.gradient_bytes if communicates else 0,
            memory=self.memory if count_memory else None,
            communicates=self.communicates,
            traced=self.traced,
        )

    def count_memory(self) -> list[StepTiming]:
        """Count this configuration's training state in untimed steps (``ddp.bench.memory.state.measure_memory``)
        and keep it for ``count_setup``; returns those steps' timings."""
        self.memory, timings = measure_memory(self)
        return timings

    def collectives_per_step(self) -> int | None:
        """The strategy's own count, else the one counted in warm-up (counting now if not yet)."""
        calls = getattr(self.model, "num_allreduce_calls_per_step", None)
        if calls is None:
            calls = self.counted_collectives if self.counted_collectives is not None else self.count_collectives()
        return calls

    @property
    def communicates(self) -> bool:
        """Whether a step launches any collective: more than one rank, and a strategy that says so
        or was counted doing so (unknown counts as yes)."""
        calls = self.collectives_per_step()
        return self.world_size > 1 and (calls is None or calls > 0)

    @property
    def states_its_collectives(self) -> bool:
        return getattr(self.model, "num_allreduce_calls_per_step", None) is not None

    def count_collectives(self) -> int | None:
        """Collectives one step launches, counted from the profiler's record of c10d's operators
        during one untimed step (``RankBench.prepare`` makes it the last warm-up step, so that
        counting adds no step: raced contenders must have trained alike): for a user's class that
        does not say."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profiler:
            self.step()
        names = [event.name for event in profiler.events()]
        self.counted_collectives = sum(
            1 for name in names if name.startswith("c10d::") and "barrier" not in name and "_coalesced" not in name
        )
        return self.counted_collectives

    def step(self, observer: StepObserver = NO_OBSERVER) -> StepTiming:
        """One step in this configuration's precision; setting and restoring it is outside the clock."""
        with numerics(self.config.precision):
            if self.config.compile == "off":
                return self._timed_step(observer)
            from torch._dynamo.exc import TorchDynamoException  # the compiler's errors, imported only when compiling
            from torch._inductor.exc import InvalidCxxCompiler

            try:
                return self._timed_step(observer)
            except (TorchDynamoException, InvalidCxxCompiler) as error:
                message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise CannotRun(f"torch.compile failed ({type(error).__name__}: {message}); run it with --compile off") from None

    def _timed_step(self, observer: StepObserver) -> StepTiming:
        phase = observer.phase
        compute_end = self.backward_compute_end
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            allocated_at_start = torch.cuda.memory_allocated(self.device)
            synchronized = torch.cuda.Event(enable_timing=True)
        *accumulated, (inputs, targets) = self.batches  # before the clock: nothing but the step's work in it
        start = time.perf_counter()
        if accumulated:
            with self.model.no_sync():
                for micro_inputs, micro_targets in accumulated:
                    with phase(ACCUMULATE):  # entered per micro-batch: an observer sees each one's forward start
                        self._forward_loss(micro_inputs, micro_targets).backward()
        with phase("forward"):
            loss = self._forward_loss(inputs, targets)
        compute_end.watch(loss)  # the last backward: the one that synchronizes
        with phase("backward"):
            loss.backward()
        with phase("gradient_sync"):
            self.model.finish_gradient_synchronization()
            if self.cuda:
                synchronized.record()
            synchronized_seconds = time.perf_counter()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        step_seconds = time.perf_counter() - start
        if self.cuda:
            sync_wait_seconds = compute_end.event.elapsed_time(synchronized) / 1000.0
            peak = own_peak_bytes(torch.cuda.max_memory_allocated(self.device), allocated_at_start, self.resident_bytes)
        else:
            sync_wait_seconds = synchronized_seconds - compute_end.seconds
            peak = None
        return StepTiming(self.rank, step_seconds, sync_wait_seconds, peak)

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward and loss in the step's precision, scaled as the shape says."""
        with forward_autocast(self.config.precision, self.device):
            return self.shape.scaled(self.workload.loss(self.model(inputs), targets))

    def close(self) -> None:
        """Undo what building this configuration hung on shared objects, and drop every reference
        to what it allocated (see the module docstring)."""
        if self.workload is None:
            return  # closed already
        close = getattr(self.model, "close", None)
        if callable(close):
            close()
        drop_parameter_hooks(self.workload.module)
        self.optimizer = self.model = self.workload = self.batches = None
