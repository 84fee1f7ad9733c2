"""Will it fit? The peak memory of a configuration's step on one rank, predicted before anything is
built, by category, and what fits in a device's memory.

- ``predict``: the peak, in bytes, the way PyTorch's ``MemTracker`` reports one (each category at
  the moment the total peaked) over the step's moments (``forward``, ``backward``,
  ``synchronization``, ``optimizer``, ``gather``), in the shape the step declares
  (``ddp.bench.config.shape``: one micro-batch's activations, with its checkpointing, beside the
  gradients the earlier micro-batches left). The training state comes from the strategy's
  declarations (``Sharding``, ``StepBuffers``), never its name; activations and temporaries from
  one step traced on fake tensors (``ddp.bench.memory.fake_step``), made once per model, sequence
  length and precision. A compiled model is predicted as its eager step.
- ``fits``, ``largest_batch``: within ``1 - HEADROOM`` of the device's memory (the headroom is
  for what the prediction leaves out: the allocator's rounding and fragmentation, a CUDA context,
  kernels' scratch memory). ``fit``: several configurations kept built at once fit when each
  one's kept state plus the largest step's own needs do. On CPU the memory is the host's
  available memory shared by the ranks on it.

How each category is counted, and how close it comes to ``MemTracker`` (tests/test_memory_prediction.py
holds every strategy to it): docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.values import GRAD_COMM, OPTIMIZER, sharded_compute_dtype
from ddp.bench.config.workloads import meta_module
from ddp.bench.memory.fake_step import FakeStep, run_fake_step
from ddp.bench.results.records import MemoryPrediction
from ddp.launcher import Rank, on_rank
from ddp.strategies.declarations import REPLICATED, MemoryPlan, StepBuffers, sharding_of
from ddp.strategies.registry import StrategyError, resolve_strategy, traits

HEADROOM = 0.10  # of the memory: the allocator's rounding and fragmentation, a CUDA context, kernels' scratch
# (the prediction read 37.2 GiB where local xl at batch 4 x 128 peaked at 38.2 GiB on an H100: 0.97)
GIB = 2**30
# What a rank process holds besides its configurations, counted once per process in every fit
# decision (``fit``): on CUDA its context (about 0.5 GiB with lazy module loading on an H100,
# CUDA 12-13) and NCCL's communicator buffers (NCCL_BUFFSIZE 4 MiB per channel and peer, and its
# proxy's: 0.5-2 GB per process at two to eight ranks); on CPU the interpreter, torch and gloo
# (230 MB resident for an idle spawned rank here, torch 2.13, /proc/self/status; forked from the
# launcher's fork server, 158 MB resident of which 55 MB its own, /proc/self/smaps_rollup).
PROCESS_BYTES = {"cuda": int(1.5 * GIB), "cpu": 256 * 2**20}
MOMENTS = ("forward", "backward", "synchronization", "optimizer", "gather")
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, each the size of its parameter


class NoPrediction(Exception):
    """A configuration whose peak cannot be predicted; the message says why, in a phrase."""


@dataclass(frozen=True)
class ModelShape:
    """What the prediction reads of a model, built on the meta device."""

    parameter_bytes: int
    """Every parameter, trainable or frozen."""
    trainable_bytes: int
    """Every trainable parameter, once: the bytes of its gradient too."""
    buffer_bytes: int
    gradient_itemsize: int
    """Bytes an element of the gradients (of the first trainable parameter; 4 if there is none)."""
    unit_bytes: tuple[int, ...]
    """The parameters of each of the strategy's ``units``, whole, root last (empty: it has none)."""


def parameter_count(model: str, batch_size: int, seq_len: int) -> int:
    """Trainable and frozen parameters of a workload, built on the meta device (nothing allocated)."""
    return sum(p.numel() for p in meta_module(model, batch_size, seq_len).parameters())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _unit_bytes(module: torch.nn.Module, units: list[tuple[str, torch.nn.Module]] | None) -> tuple[int, ...]:
    """Bytes of the parameters of each unit, a parameter in the innermost unit whose name prefixes its own."""
    if not units:
        return ()
    names = [name for name, _ in units]
    if "" not in names:
        raise NoPrediction(f"its units {names} have no root (the unit named ''): units() must end with ('', module)")
    sizes = dict.fromkeys(names, 0)
    seen = set()
    for name, param in module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner = max((u for u in names if u == "" or name.startswith(f"{u}.")), key=len)
        sizes[owner] += _nbytes(param)
    return tuple(sizes[name] for name in names)


@functools.lru_cache(maxsize=256)
def model_shape(config: StepConfig) -> ModelShape:
    module = meta_module(config.model, config.batch_size, config.seq_len)
    params = list(dict.fromkeys(module.parameters()))  # a tied weight once
    trainable = [p for p in params if p.requires_grad]
    units = traits(config.strategy).units(module)
    return ModelShape(
        parameter_bytes=sum(_nbytes(p) for p in params),
        trainable_bytes=sum(_nbytes(p) for p in trainable),
        buffer_bytes=sum(_nbytes(b) for b in module.buffers()),
        gradient_itemsize=trainable[0].element_size() if trainable else 4,
        unit_bytes=_unit_bytes(module, units),
    )


@functools.lru_cache(maxsize=16)
def _fake_steps(model: str, seq_len: int, precision: str, activation_checkpointing: str,
                parameter_dtype: torch.dtype | None) -> tuple[FakeStep, FakeStep] | str:
    """Batch 1 and 2 traced, or why not (kept, so that a model that cannot be traced is tried once)."""
    try:
        one, two = (run_fake_step(model, batch, seq_len, precision, activation_checkpointing, parameter_dtype)
                    for batch in (1, 2))
        two.at_batch(one, 1)  # the two ran the same operators
    except Exception as error:  # the trace runs the user's own code: any error it raises means no trace
        return f"its step could not be traced on fake tensors ({type(error).__name__}: {str(error).strip()[:200]})"
    return one, two


def fake_step_of(config: StepConfig) -> FakeStep:
    """The traced forward and backward of one of ``config``'s micro-batches (``ddp.bench.memory.fake_step``),
    its blocks checkpointed as the step's are, its parameters in the dtype its strategy computes
    in (``sharded_compute_dtype``: autocast then keeps no copy of them); ``NoPrediction`` where the
    model's step cannot be traced."""
    return _fake_step_at(*fake_step_key(config), config.batch_size)


def fake_step_key(config: StepConfig) -> tuple:
    """What a configuration's traced step depends on: configurations of one key share one pair of
    traces (batch 1 and 2, about 5 s of an H200 host's CPU for xl, 20 s of this project's 2 cores).
    TF32 changes how matmuls compute, not what a step allocates: traced with fp32."""
    precision = "fp32" if config.precision == "tf32" else config.precision
    return (config.model, config.seq_len, precision, config.activation_checkpointing,
            sharded_compute_dtype(config.precision, config.strategy))


@functools.lru_cache(maxsize=256)
def _fake_step_at(model: str, seq_len: int, precision: str, activation_checkpointing: str,
                  parameter_dtype: torch.dtype | None, batch_size: int) -> FakeStep:
    """The step of ``batch_size`` from the trace pair of its ``fake_step_key`` (the arguments before it)."""
    traces = _fake_steps(model, seq_len, precision, activation_checkpointing, parameter_dtype)
    if isinstance(traces, str):
        raise NoPrediction(f"model {model}: {traces}")
    one, two = traces
    return two.at_batch(one, batch_size - 1)


def _strategy_class(config: StepConfig) -> type:
    """The strategy's class; ``NoPrediction`` for a name that does not resolve here (a user's class
    named in a saved run that is not importable now)."""
    try:
        return resolve_strategy(config.strategy)
    except StrategyError as error:
        raise NoPrediction(str(error)) from None


def step_buffers(config: StepConfig, shape: ModelShape, world_size: int) -> StepBuffers:
    """What ``config``'s strategy says it holds beyond its training state (``StepBuffers``)."""
    plan = MemoryPlan(
        gradient_bytes=shape.trainable_bytes,
        unit_bytes=shape.unit_bytes,
        world_size=world_size,
        gradient_itemsize=shape.gradient_itemsize,
        comm_itemsize=getattr(GRAD_COMM[config.grad_comm].dtype, "itemsize", None),
        compute_itemsize=getattr(sharded_compute_dtype(config.precision, config.strategy), "itemsize", None),
        bucket_bytes=None if config.bucket_size_mb is None else round(config.bucket_size_mb * 2**20),
    )
    return traits(config.strategy).step_buffers(plan)


def predict(config: StepConfig, world_size: int) -> MemoryPrediction:
    """The peak memory of ``config``'s step on one of ``world_size`` ranks (module docstring)."""
    return max(predict_moments(config, world_size).values(), key=lambda p: p.total_bytes)


@functools.lru_cache(maxsize=1024)
def predict_moments(config: StepConfig, world_size: int) -> dict[str, MemoryPrediction]:
    """What a rank holds at each of ``MOMENTS`` of ``config``'s step, by category."""
    shape = model_shape(config)
    trace = fake_step_of(config)
    sharding = sharding_of(_strategy_class(config)) or REPLICATED
    buffers = step_buffers(config, shape, world_size)

    def share(size: float, sharded: bool) -> int:
        return round(size / world_size) if sharded else round(size)

    parameters = share(shape.parameter_bytes, sharding.parameters)
    optimizer_state = share(ADAMW_MOMENTS * shape.trainable_bytes, sharding.optimizer_state)
    gradients_whole = share(shape.trainable_bytes, sharding.gradients)
    # Whole from the step's start where the strategy keeps them, and through the last micro-batch
    # where earlier ones accumulated them (``ddp.bench.config.shape``): its forward and backward run
    # beside every gradient.
    kept_gradients = gradients_whole if buffers.gradients_kept or config.grad_accum > 1 else 0
    common = dict(parameters_bytes=parameters, buffers_bytes=shape.buffer_bytes, optimizer_state_bytes=optimizer_state)
    forward = MemoryPrediction(
        **common, gradients_bytes=kept_gradients, activations_bytes=trace.forward_peak.activations,
        temporaries_bytes=0, communication_bytes=buffers.kept_bytes + buffers.forward_bytes, moment="forward",
    )

    def backward_buffers(sample) -> int:
        # a unit's whole gradient once backward has made gradients; the gradients made so far that
        # wait for their buffer to be complete
        return (buffers.kept_bytes + buffers.backward_bytes + (buffers.unit_backward_bytes if sample.gradients > 0 else 0)
                + min(buffers.pending_gradient_bytes, gradients_so_far(sample)))

    # Traced with the parameters in the strategy's compute dtype, the gradients so far are in it
    # too; they become the masters' (fp32) once reduced.
    compute = sharded_compute_dtype(config.precision, config.strategy)
    to_masters = shape.gradient_itemsize / compute.itemsize if compute is not None else 1.0

    def gradients_so_far(sample) -> int:
        return share(sample.gradients * to_masters, sharding.gradients)

    held = max(trace.backward, key=lambda s: s.activations + s.temporaries
               + (kept_gradients or gradients_so_far(s)) + backward_buffers(s))
    backward = MemoryPrediction(
        **common, gradients_bytes=kept_gradients or gradients_so_far(held),
        activations_bytes=held.activations, temporaries_bytes=held.temporaries,
        communication_bytes=backward_buffers(held), moment="backward",
    )
    synchronization = MemoryPrediction(
        **common, gradients_bytes=kept_gradients or gradients_whole, activations_bytes=trace.backward[-1].activations,
        temporaries_bytes=trace.backward[-1].temporaries, communication_bytes=buffers.kept_bytes + buffers.synchronization_bytes,
        moment="synchronization",
    )
    optimizer = MemoryPrediction(
        **common, gradients_bytes=gradients_whole, activations_bytes=0,
        temporaries_bytes=share(OPTIMIZER[config.optimizer].temporaries * shape.trainable_bytes, sharding.optimizer_state),
        communication_bytes=buffers.kept_bytes, moment="optimizer",
    )
    gather = MemoryPrediction(
        **common, gradients_bytes=gradients_whole, activations_bytes=0, temporaries_bytes=0,
        communication_bytes=buffers.kept_bytes + buffers.gather_bytes, moment="gather",
    )
    return {p.moment: p for p in (forward, backward, synchronization, optimizer, gather)}


def predict_or_none(config: StepConfig, world_size: int) -> MemoryPrediction | None:
    """``predict``, or None where there is no prediction (``NoPrediction``): a user's model whose
    forward reads its data (``.item()``, a data-dependent shape) or runs an operator with no fake
    implementation, a user's strategy whose units have no root."""
    try:
        return predict(config, world_size)
    except NoPrediction:
        return None


def kept_bytes(config: StepConfig, world_size: int) -> int:
    """What a built configuration keeps on a rank between steps: parameters, buffers, optimizer
    state, gradients its strategy keeps, its kept buffers."""
    at_step = predict_moments(config, world_size)["optimizer"]  # the gradients whole, nothing of the step's own
    buffers = step_buffers(config, model_shape(config), world_size)
    return (at_step.parameters_bytes + at_step.buffers_bytes + at_step.optimizer_state_bytes
            + (at_step.gradients_bytes if buffers.gradients_kept else 0) + buffers.kept_bytes)


def usable_bytes(memory_bytes: int) -> int:
    """What the prediction may fill of ``memory_bytes`` (``HEADROOM`` kept)."""
    return int(memory_bytes * (1 - HEADROOM))


def fits(config: StepConfig, world_size: int, memory_bytes: int) -> bool:
    return predict(config, world_size).total_bytes <= usable_bytes(memory_bytes)


def largest_batch(config: StepConfig, world_size: int, memory_bytes: int, limit: int = 1 << 20) -> int:
    """The largest batch per rank, up to ``limit``, at which ``config`` (its other fields as they
    are) is predicted to fit; 0 if not even batch 1 does. The need grows with the batch, so a
    bisection finds it."""

    def fits_at(batch: int) -> bool:
        return fits(dataclasses.replace(config, batch_size=batch), world_size, memory_bytes)

    if not fits_at(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits_at(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits_at(middle) else (low, middle)
    return low


@dataclass(frozen=True)
class NotBuilt:
    """Why a configuration was not built, decided in the parent: its predicted peak does not fit
    (``too_large``), or its strategy or model cannot run its step's shape
    (``ddp.bench.config.shape.cannot_run``)."""

    message: str


def size_text(size_bytes: float) -> str:
    """A memory size as a reader takes it in: GiB from 1 GiB up, MiB below."""
    return f"{size_bytes / GIB:.1f} GiB" if size_bytes >= GIB else f"{size_bytes / 2**20:.1f} MiB"


def too_large(config: StepConfig, world_size: int, memory_bytes: int) -> str | None:
    """A one-line reason when ``config`` does not fit (``fits``: its predicted peak beyond the
    usable share of ``memory_bytes``), else None: the grid never builds it. One rule with ``ddp
    memory``: the largest batch it says fits is built, the next is refused. The headroom is not
    spare: the prediction leaves out what adds to a CUDA peak (the allocator's rounding, cuBLAS's
    workspaces; the context and fragmentation are not even in ``max_memory_allocated``), so a
    configuration predicted within it would run out of memory or come close. None too where there
    is no prediction (it is built, and a rank that runs out of memory says so)."""
    prediction = predict_or_none(config, world_size)
    if prediction is None or prediction.total_bytes <= usable_bytes(memory_bytes):
        return None
    ranks = f"{world_size} rank" + ("s" if world_size != 1 else "")
    return (f"predicted not to fit: {config.describe()}, {ranks}, needs {size_text(prediction.total_bytes)} per rank "
            f"at its peak ({prediction.moment}), more than the {size_text(usable_bytes(memory_bytes))} usable of the "
            f"{size_text(memory_bytes)} of the device; not built (python -m ddp memory shows what fits)")


@on_rank
def device_memory_bytes(rank: Rank) -> int:
    """Runs on a rank: the memory this rank may use: its share of its GPU's memory among the ranks
    of this host on that GPU, or its share of the host's available memory among the ranks on it."""
    info = rank.info
    if info.device.type == "cuda":
        total = torch.cuda.get_device_properties(info.device).total_memory
        return total // ranks_on_device(local_world_size(info.world_size), torch.cuda.device_count(), info.device.index or 0)
    return host_memory_bytes(info.world_size)


def local_world_size(world_size: int) -> int:
    """Ranks on this host: torchrun says how many it started here; ``RankGroup`` starts them all here."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def ranks_on_device(local_ranks: int, device_count: int, device_index: int) -> int:
    """How many of this host's ``local_ranks`` share GPU ``device_index``: local rank r runs on GPU
    r mod ``device_count`` (``ddp.launcher``), so gloo's ranks over CUDA tensors share GPUs when
    there are fewer GPUs than ranks (NCCL refuses that: one GPU per rank)."""
    return max(1, sum(1 for r in range(local_ranks) if r % max(1, device_count) == device_index))


def host_memory_bytes(ranks_on_host: int) -> int:
    """This host's available memory shared among ``ranks_on_host`` ranks."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:  # MemAvailable counts reclaimable caches, AVPHYS does not
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    return available // local_world_size(ranks_on_host)


@dataclass(frozen=True)
class Fit:
    """What fits of a set of configurations in ``memory_bytes``."""

    together: bool
    """All built at once, stepping one at a time, beside the processes' own memory and any kept copy."""
    alone: dict[StepConfig, bool]
    """Each one on its own."""
    needed_together_bytes: int
    needed_alone_bytes: dict[StepConfig, int]
    memory_bytes: int

    outside_bytes: int = 0
    """What the rank processes and kept copies hold besides the configurations (``fit``)."""

    def explain(self) -> str:
        outside = f" with {self.outside_bytes / GIB:.1f} GiB of processes and kept copies" if self.outside_bytes else ""
        return (f"together they need about {self.needed_together_bytes / GIB:.1f} GiB per rank{outside}, "
                f"{usable_bytes(self.memory_bytes) / GIB:.1f} GiB usable of {self.memory_bytes / GIB:.1f} GiB")

    def too_large(self) -> str | None:
        """A one-line error when some configuration does not fit even alone, else None."""
        large = [c for c, alone in self.alone.items() if not alone]
        if not large:
            return None
        worst = max(large, key=lambda c: self.needed_alone_bytes[c])
        return (f"{worst.describe()} is predicted to need {self.needed_alone_bytes[worst] / GIB:.1f} GiB per rank, more "
                f"than the {usable_bytes(self.memory_bytes) / GIB:.1f} GiB usable of {self.memory_bytes / GIB:.1f} GiB: "
                "use a smaller --model or batch, more ranks with a strategy that shards, or a strategy that shards more "
                "(python -m ddp memory shows what fits)")


def fit(configs: Sequence[StepConfig], memory_bytes: int, world_size: int, processes: int = 0,
        device: str = "cpu", copies: Sequence[StepConfig] = ()) -> Fit:
    """Whether ``configs`` on ``world_size`` ranks fit together (every kept state, plus the largest
    step's own needs once per process stepping them) and alone (each one's predicted peak). A
    configuration listed twice counts twice (built by two groups of ranks on the same devices). ``processes``: rank processes
    sharing ``memory_bytes`` (one per group of ranks), each holding ``PROCESS_BYTES`` of
    ``device``; ``copies``: configurations whose model a rank keeps a copy of
    (``ddp.bench.rounds.reuse``: its parameters and buffers), each counted. Without a prediction
    for one of them (``predict_or_none``) they are taken to fit: they are built, and an
    out-of-memory rank says so."""
    usable = usable_bytes(memory_bytes)
    outside = processes * PROCESS_BYTES["cuda" if device == "cuda" else "cpu"]
    outside += sum(model_shape(c).parameter_bytes + model_shape(c).buffer_bytes for c in copies)
    predictions = {c: predict_or_none(c, world_size) for c in configs}
    if any(p is None for p in predictions.values()):
        return Fit(True, dict.fromkeys(configs, True), 0, dict.fromkeys(configs, 0), memory_bytes, outside)
    alone = {c: p.total_bytes for c, p in predictions.items()}
    kept = {c: kept_bytes(c, world_size) for c in configs}
    # Each process that steps them keeps its own step's transient (the largest): on CUDA its
    # caching allocator holds the peak reserved, on CPU glibc's heap keeps it resident
    # (``ddp.bench.rounds.rank_state.hand_back_free_memory``). A configuration listed k times is
    # built by k groups of ranks: k processes on each device.
    processes_stepping = max(Counter(configs).values())
    transient = max(alone[c] - kept[c] for c in configs)
    together = sum(kept[c] for c in configs) + processes_stepping * transient + outside
    return Fit(together <= usable, {c: need <= usable for c, need in alone.items()}, together, alone, memory_bytes,
               outside)


def fit_on(ranks, configs: Sequence[StepConfig]) -> Fit:
    """``fit`` against the smallest memory among ``ranks``."""
    return fit(configs, min(ranks.run(device_memory_bytes)), ranks.world_size)
