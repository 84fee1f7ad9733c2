"""The cost model behind ``python -m ddp simulate``: predict one training step's time at other world sizes, from a
measured run.

    python -m ddp simulate --from RUN.json --world-sizes 2,8,64,1024 --json OUT.json [--link ib-400g]

Predicts from a run's ``local`` rows (compute) and all-reduce rows (the link), or from a given
link and step time:

- ``Link``: one all-reduce's seconds by Hockney's alpha-beta model of a ring (or a tree's
  latency term), ``alpha`` in seconds per step and ``busbw`` in bytes/s, fitted on the run
  (``calibrate``) or taken from ``LINKS``;
- ``predict_step``: one configuration's step at each world size, ``step_seconds`` = compute +
  ``exposed_comm_seconds`` (what communication adds after backward ends), from the strategy's own
  ``communication_schedule`` on one serial channel, or ``fully_sharded_step`` for a strategy whose
  ``Sharding`` splits parameters; a strategy that gives neither is not modelled;
- ``validation_rows``: the prediction at the run's own world size beside its measured median;
  the model is trusted elsewhere only as far as it matches there.

The model's assumptions (backward 2/3 of a micro-batch, 3/4 with checkpointed blocks; only the
last micro-batch's backward overlaps; gradients ready in reverse registration order by their
backward FLOPs; ``--overlap-slowdown`` on CPU) and what each rests on: docs/torchrun-and-simulate.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from torch import nn

from ddp.bench.config.shape import StepShape
from ddp.bench.config.step_config import AXES
from ddp.bench.config.workloads import build_workload
from ddp.bench.results.records import PredictionRecord, Run, RunFileError, ValidationRecord
from ddp.model import MODEL_SIZES, build_model
from ddp.strategies.declarations import sharding_of
from ddp.strategies.registry import FLOOR, resolve_strategy, traits

ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True)
class Link:
    """The alpha-beta cost of an all-reduce (docs/torchrun-and-simulate.md, "The model")."""

    name: str
    latency_seconds: float
    """alpha: seconds per algorithm step (a ring all-reduce on n ranks takes 2(n-1) steps)."""
    busbw_bytes_per_second: float
    """Achieved bus bandwidth, as nccl-tests reports it (busbw = algbw x 2(n-1)/n)."""
    algorithm: str = "ring"
    """``ring`` (latency 2(n-1) alpha) or ``tree`` (latency 2 ceil(log2 n) alpha)."""

    def latency_steps(self, world_size: int) -> int:
        return latency_steps(world_size, self.algorithm)

    def allreduce_seconds(self, size_bytes: float, world_size: int) -> float:
        """Seconds for one all-reduce of ``size_bytes`` on ``world_size`` ranks (0 on one rank)."""
        if world_size <= 1:
            return 0.0
        bus_bytes = size_bytes * 2 * (world_size - 1) / world_size
        return self.latency_seconds * self.latency_steps(world_size) + bus_bytes / self.busbw_bytes_per_second

    def collective_seconds(self, collective: str, size_bytes: float, world_size: int) -> float:
        """Seconds for one ``collective`` whose full buffer is ``size_bytes``: an all-reduce, or a
        reduce-scatter or all-gather, each half of a ring all-reduce (half its steps and bus bytes)."""
        if collective == "all_reduce":
            return self.allreduce_seconds(size_bytes, world_size)
        if collective in HALF_ALL_REDUCE:
            return self.allreduce_seconds(size_bytes, world_size) / 2
        raise ValueError(f"no cost of collective {collective!r}: use all_reduce, {', '.join(HALF_ALL_REDUCE)}")


# A ring all-reduce is a reduce-scatter followed by an all-gather, each of (n-1) steps moving
# (n-1)/n of the buffer: each costs half the all-reduce.
HALF_ALL_REDUCE = ("reduce_scatter", "all_gather")


def latency_steps(world_size: int, algorithm: str) -> int:
    if algorithm == "ring":
        return 2 * (world_size - 1)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(world_size)) if world_size > 1 else 0
    raise ValueError(f"unknown algorithm {algorithm!r}: use {' or '.join(ALGORITHMS)}")


GB = 1e9  # link bandwidths are quoted in 10^9 bytes per second

# Links for hardware not at hand. Bandwidths are achieved all-reduce bus bandwidths (what a
# ring of ranks sees per rank), below the wire rate; latencies are per algorithm step.
LINKS: dict[str, Link] = {
    # H100 SXM5, NVLink 4 through NVSwitch: 900 GB/s bidirectional, 450 GB/s per direction
    # (NVIDIA H100 Tensor Core GPU datasheet). nccl-tests all_reduce_perf on 8 x H100 SXM reaches
    # busbw 460-480 GB/s with NVLink SHARP (NVLS) and about 360-400 GB/s with rings ("NCCL-tests
    # in practice", docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests; busbw as defined in
    # NVIDIA/nccl-tests doc/PERFORMANCE.md). 380 GB/s: a ring, no NVLS (two GPUs get no NVLS gain).
    # alpha 3 us per step: about 6 us for a small all-reduce on 2 GPUs, NCCL's LL-protocol range.
    "nvlink-h100": Link("nvlink-h100", latency_seconds=3e-6, busbw_bytes_per_second=380 * GB),
    # 8 x A100 SXM4, NVLink 3 (600 GB/s bidirectional): nccl-tests busbw 230-250 GB/s (same source).
    "nvlink-a100": Link("nvlink-a100", latency_seconds=3e-6, busbw_bytes_per_second=230 * GB),
    # InfiniBand NDR, 400 Gb/s per port = 50 GB/s per direction (NVIDIA ConnectX-7 / Quantum-2);
    # achieved about 45 GB/s per port in nccl-tests between nodes. A ring bottlenecked by one
    # 400 Gb/s port per rank (a GPU per NIC, rail-optimized); alpha 5 us per step (switch hop,
    # NCCL's network proxy).
    "ib-400g": Link("ib-400g", latency_seconds=5e-6, busbw_bytes_per_second=45 * GB),
    # InfiniBand HDR, 200 Gb/s = 25 GB/s per direction; about 22 GB/s achieved.
    "ib-200g": Link("ib-200g", latency_seconds=5e-6, busbw_bytes_per_second=22 * GB),
    # 100 Gb/s Ethernet with TCP sockets (no RDMA): 12.5 GB/s wire, about 10 GB/s achieved, and a
    # kernel network stack per step.
    "ethernet-100g": Link("ethernet-100g", latency_seconds=20e-6, busbw_bytes_per_second=10 * GB),
}


def fit_link(samples: list[tuple[int, int, float]], algorithm: str = "ring", name: str = "fitted") -> Link:
    """Least-squares alpha and busbw from ``(size_bytes, world_size, seconds)`` samples.

    Each sample gives ``seconds = alpha * steps(n) + (1 / busbw) * bytes * 2(n-1)/n``: linear in
    (alpha, 1/busbw). A negative alpha (latency below the noise) is refitted as 0.
    """
    samples = [s for s in samples if s[1] > 1]
    if len(samples) < 2 or len({s[0] for s in samples}) < 2:
        raise ValueError(
            "fitting a link needs all-reduce timings at two sizes or more on more than one rank; run "
            "perf_tests/test_allreduce.py (or `ddp run --allreduce-sizes-mb 0.1,1,10`), or give --link"
        )
    design = np.array([[latency_steps(n, algorithm), b * 2 * (n - 1) / n] for b, n, _ in samples], dtype=float)
    seconds = np.array([s for _, _, s in samples], dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(design[:, 1] @ seconds / (design[:, 1] @ design[:, 1]))
    if beta <= 0:
        raise ValueError(f"the all-reduce timings do not grow with size (fitted 1/busbw {beta:g} s/B); time larger sizes")
    return Link(name, float(alpha), float(1.0 / beta), algorithm)


@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient, in the order backward produces them."""

    name: str
    size_bytes: int
    backward_flops_per_token: float
    """Backward FLOPs per token charged before this gradient is ready (its own, and for a
    block's first-ready q/k/v weight, attention's products)."""
    element_size: int = 4
    """Bytes per element (float32): buckets never mix element sizes."""


def gradients_in_backward_order(model_size: str, seq_len: int) -> list[Gradient]:
    """The model's gradients in reverse registration order, with the backward FLOPs before each."""
    model = build_model(model_size, device="meta")
    config = model.config
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    charged_attention: set[str] = set()
    gradients = []
    for name, param in reversed(named):
        matmul = param.dim() == 2 and "embedding" not in name
        flops = 4.0 * param.numel() if matmul else 0.0
        block = name.rsplit(".attn.", 1)[0] if ".attn." in name else None
        if block is not None and not name.endswith("output_proj.weight") and block not in charged_attention:
            # QK^T and AV backward: 2/3 of 12 d_model seq_len per token (model_flops_per_token).
            flops += 8.0 * config.d_model * seq_len
            charged_attention.add(block)
        gradients.append(Gradient(name, param.numel() * param.element_size(), flops, param.element_size()))
    return gradients


def default_overlap_slowdown(cpu_gloo: bool) -> float:
    """``overlap_slowdown`` when none is given: 1 for gloo on CPU, where communication and backward
    share the cores, 0 otherwise (NCCL runs beside the compute kernels). See docs/torchrun-and-simulate.md."""
    return 1.0 if cpu_gloo else 0.0


def gradients_of_module(module, seq_len: int) -> list[Gradient]:
    """Any model's gradients in reverse registration order, each weight of two or more dimensions
    charged 4 x numel backward FLOPs per token (a matmul or a convolution's weight), others none:
    the LM's rule without attention's own products, which a model of unknown shape cannot state."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    return [
        Gradient(name, p.numel() * p.element_size(), 4.0 * p.numel() if p.dim() >= 2 else 0.0, p.element_size())
        for name, p in reversed(named)
    ]


def gradients_of(model, seq_len: int) -> list[Gradient]:
    """A built-in LM size by name (``gradients_in_backward_order``), or a module."""
    return gradients_in_backward_order(model, seq_len) if isinstance(model, str) else gradients_of_module(model, seq_len)


def module_of(model) -> nn.Module:
    """A built-in LM size by name, built on the meta device (nothing allocated), or the module itself."""
    return build_model(model, device="meta") if isinstance(model, str) else model


def ready_times(gradients: list[Gradient], backward_seconds: float) -> list[float]:
    """Seconds after backward starts at which each gradient is ready (backward uniform in FLOPs)."""
    total = sum(g.backward_flops_per_token for g in gradients)
    done, times = 0.0, []
    for gradient in gradients:
        done += gradient.backward_flops_per_token
        times.append(backward_seconds * done / total if total > 0 else backward_seconds)
    return times


def channel_end(launches: list[tuple[float, float]]) -> float:
    """When the last of ``(ready_seconds, duration_seconds)`` transfers ends on one serial channel,
    each starting when it is ready and the previous one has ended."""
    end = 0.0
    for ready, duration in launches:
        end = max(end, ready) + duration
    return end


class NotModelled(ValueError):
    """A strategy whose class gives no cost schedule (``Traits.communication_schedule``)."""


def strategy_launches(
    strategy: str, gradients: list[Gradient], ready: list[float], backward_seconds: float, bucket_size_mb: float | None,
    link: Link, world_size: int,
) -> list[tuple[float, float]]:
    """``(ready, duration)`` of each collective of the strategy's ``communication_schedule``, in launch order."""
    schedule = traits(strategy).communication_schedule(gradients, ready, backward_seconds, bucket_size_mb)
    if schedule is None:
        raise NotModelled(f"strategy {strategy!r} gives no communication_schedule: the cost model cannot predict it")
    return [(t.ready_seconds, link.collective_seconds(t.collective, t.size_bytes, world_size)) for t in schedule]


Prediction = PredictionRecord  # the cost model's output is the saved record (ddp.bench.results.records)


@dataclass(frozen=True)
class Compute:
    """One configuration's step without communication, and how it splits (docs/torchrun-and-simulate.md)."""

    step_seconds: float
    optimizer_fraction: float = 0.0
    micro_batches: int = 1
    """Micro-batches a step (``StepShape.micro_batches``): compute split evenly over them."""
    backward_share: float = 2.0 / 3.0
    """Backward's share of a micro-batch's compute (``StepShape.backward_share``)."""

    @classmethod
    def of(cls, step_seconds: float, shape: StepShape, optimizer_fraction: float = 0.0) -> Compute:
        """The compute of a step of ``shape`` that takes ``step_seconds`` without communication."""
        return cls(step_seconds, optimizer_fraction, shape.micro_batches, shape.backward_share)

    @property
    def micro_batch_seconds(self) -> float:
        """One micro-batch's forward and backward."""
        return self.step_seconds * (1.0 - self.optimizer_fraction) / self.micro_batches

    @property
    def backward_seconds(self) -> float:
        """The synchronizing backward: the last micro-batch's (its recomputed forward included)."""
        return self.micro_batch_seconds * self.backward_share

    @property
    def forward_seconds(self) -> float:
        """One micro-batch's forward."""
        return self.micro_batch_seconds * (1.0 - self.backward_share)


def predict_step(
    strategy: str,
    bucket_size_mb: float | None,
    compute: Compute,
    gradients: list[Gradient],
    link: Link,
    world_size: int,
    overlap_slowdown: float = 0.0,
    module: nn.Module | None = None,
) -> tuple[float, float, float, int]:
    """``(step_seconds, exposed_comm_seconds, comm_seconds, collectives_per_step)`` of one step;
    ``module``: the model the gradients are of, for a strategy that shards it into units."""
    backward = compute.backward_seconds
    ready = ready_times(gradients, backward)
    described = traits(strategy)
    if not described.communicates or world_size <= 1:
        return compute.step_seconds, 0.0, 0.0, 0
    sharding = sharding_of(resolve_strategy(strategy))
    if sharding is not None and sharding.parameters:
        if compute.micro_batches > 1:  # every micro-batch gathers and reduce-scatters: not this schedule
            raise NotModelled(f"strategy {strategy!r} shards parameters: its accumulating micro-batches are not modelled")
        units = described.units(module) if module is not None else None
        if units is None:
            raise NotModelled(f"strategy {strategy!r} shards parameters but says no units (Traits.units) for this model")
        sizes = units_of(gradients, [name for name, _ in units])
        return fully_sharded_step(compute, sizes, link, world_size, described.prefetches_next_unit, overlap_slowdown)
    launches = strategy_launches(strategy, gradients, ready, backward, bucket_size_mb, link, world_size)
    comm = sum(duration for _, duration in launches)
    exposed = max(0.0, channel_end(launches) - backward)
    hidden = comm - exposed
    return compute.step_seconds + exposed + overlap_slowdown * hidden, exposed, comm, len(launches)


def units_of(gradients: list[Gradient], unit_names: list[str]) -> list[tuple[float, float]]:
    """``(bytes, backward FLOPs per token)`` of each unit a strategy gathers (``Traits.units``:
    their names, the root ``""`` last), in forward order with the root first: each gradient counts
    in the innermost unit whose name prefixes its parameter's name, else in the root."""
    named = sorted((name for name in unit_names if name), key=len, reverse=True)
    units: dict[str, list[float]] = {"": [0.0, 0.0], **{name: [0.0, 0.0] for name in unit_names if name}}
    for gradient in gradients:
        key = next((name for name in named if gradient.name.startswith(f"{name}.")), "")
        units[key][0] += gradient.size_bytes
        units[key][1] += gradient.backward_flops_per_token
    return [(size, flops) for name, (size, flops) in units.items() if name == "" or size > 0 or flops > 0]


def fully_sharded_step(
    compute: Compute, units: list[tuple[float, float]], link: Link, world_size: int, prefetch: bool, overlap_slowdown: float
) -> tuple[float, float, float, int]:
    """One full-sharding step on one serial channel (docs/torchrun-and-simulate.md): an all-gather before each
    unit's forward and backward, a reduce-scatter after each unit's backward; ``prefetch`` issues
    the next unit's all-gather when the current unit starts computing. ``units``: ``units_of``, the root first."""
    total_flops = sum(flops for _, flops in units) or 1.0
    forward_seconds = compute.forward_seconds
    channel_free = comm = 0.0

    def transfer(ready: float, collective: str, size_bytes: float) -> float:
        nonlocal channel_free, comm
        duration = link.collective_seconds(collective, size_bytes, world_size)
        channel_free = max(channel_free, ready) + duration
        comm += duration
        return channel_free

    def run(order: list[int], seconds_of, reduce_after: bool, start: float) -> float:
        now = start
        gathered = transfer(now, "all_gather", units[order[0]][0])
        for position, index in enumerate(order):
            now = max(now, gathered)  # a unit computes once its parameters are here
            upcoming = order[position + 1] if position + 1 < len(order) else None
            if prefetch and upcoming is not None:
                gathered = transfer(now, "all_gather", units[upcoming][0])
            now += seconds_of(index)
            if reduce_after and index != 0:  # the root's gradients are complete only at the end
                transfer(now, "reduce_scatter", units[index][0])
            if not prefetch and upcoming is not None:
                gathered = transfer(now, "all_gather", units[upcoming][0])
        if reduce_after:
            transfer(now, "reduce_scatter", units[0][0])
        return now

    forward_end = run(list(range(len(units))), lambda i: forward_seconds * units[i][1] / total_flops, False, 0.0)
    backward_order = [0] + list(range(len(units) - 1, 0, -1))  # the root's head first, its embedding's gradient last
    backward_end = run(backward_order, lambda i: compute.backward_seconds * units[i][1] / total_flops, True, forward_end)
    compute_seconds = forward_seconds + compute.backward_seconds
    end = max(backward_end, channel_free)
    exposed = end - compute_seconds
    hidden = max(0.0, comm - exposed)
    step = end + (compute.step_seconds - compute_seconds) + overlap_slowdown * hidden
    return step, exposed, comm, 3 * len(units)


@dataclass(frozen=True)
class Calibration:
    """What the model takes from a saved run: the model, the world size, the compute of each
    configuration (its ``local`` step) and the all-reduce timings to fit a link on."""

    model: str
    world_size: int
    backend: str
    device: str
    steps: list
    """The run's ``StepRecord``s."""
    local_seconds: dict[tuple[int, int], float]
    """(batch, seq len) -> the ``local`` step's seconds."""
    allreduce: list[tuple[int, int, float]]
    """(size_bytes, world_size, seconds) of each all-reduce row."""
    statistic: str

    def seconds(self, record) -> float:
        return _statistic(record.round_seconds, record.step_seconds, self.statistic)

    def computes(self, optimizer_fraction: float = 0.0) -> dict[tuple[int, int], Compute]:
        """(batch, seq len) -> its compute, in the step shape the run was measured in (one for the
        whole run: ``calibrate`` refuses a run that mixes options)."""
        config = self.steps[0].config
        return {(batch, seq): Compute.of(seconds, StepShape(batch, seq, config.grad_accum, config.activation_checkpointing),
                                         optimizer_fraction)
                for (batch, seq), seconds in self.local_seconds.items()}


def _statistic(rounds: list[float] | None, median: float, statistic: str) -> float:
    if statistic == "median" or not rounds:
        return median
    return min(rounds)


def calibrate(run: Run, statistic: str = "median") -> Calibration:
    """A ``Calibration`` from a saved run (``ddp.bench.results.records.load_run``); ``RunFileError`` saying
    what is missing."""
    steps = run.steps
    if not steps:
        raise RunFileError(f"{run.path} holds no step benchmarks (perf_tests/test_step.py or `ddp run` rows)")
    models = {s.config.model for s in steps}
    worlds = {s.world_size for s in steps}
    if len(models) != 1 or len(worlds) != 1:
        raise RunFileError(f"{run.path} mixes models {sorted(models)} or world sizes {sorted(worlds)}; give one run of one model")
    variants = {s.config.variant for s in steps}
    if len(variants) != 1 or any(s.config.grad_comm != AXES["grad_comm"].default for s in steps):
        raise RunFileError(
            f"{run.path} mixes options {sorted(variants)} or communicates gradients in bf16; the cost model takes one "
            "set of options (--precision, --grad-accum, --activation-checkpointing, ...) and fp32 gradient "
            "all-reduces: give a run of one value of each, without --grad-comm bf16"
        )
    local = {(s.config.batch_size, s.config.seq_len): _statistic(s.round_seconds, s.step_seconds, statistic)
             for s in steps if s.strategy == FLOOR}
    if not local:
        raise RunFileError(
            f"{run.path} has no `local` rows: the model needs a step without communication; benchmark with --strategies local,..."
        )
    allreduce = [(a.size_bytes, a.world_size, _statistic(a.round_seconds, a.seconds, statistic)) for a in run.allreduces]
    first = steps[0]
    return Calibration(first.config.model, first.world_size, first.backend, first.device, steps, local, allreduce, statistic)


def predict_grid(
    model_size,
    computes: dict[tuple[int, int], Compute],
    strategies: list[tuple[str, float | None]],
    world_sizes: list[int],
    link: Link,
    overlap_slowdown: float,
) -> list[Prediction]:
    """Every strategy at every world size and shape; a strategy with no cost schedule is left out."""
    predictions = []
    module = module_of(model_size)
    for (batch_size, seq_len), compute in sorted(computes.items()):
        gradients = gradients_of(model_size, seq_len)
        for world_size in world_sizes:
            for strategy, bucket_size_mb in strategies:
                try:
                    step, exposed, comm, calls = predict_step(
                        strategy, bucket_size_mb, compute, gradients, link, world_size, overlap_slowdown, module
                    )
                except NotModelled:
                    continue  # the caller names the strategies absent from the predictions
                predictions.append(
                    Prediction(strategy, bucket_size_mb, batch_size, seq_len, world_size, step, exposed, comm, calls)
                )
    return predictions


def validation_rows(run: Calibration, predictions: list[Prediction]) -> list[ValidationRecord]:
    """Measured median against prediction for every step row of the run, at its world size."""
    by_key = {(p.strategy, p.bucket_size_mb, p.batch_size, p.seq_len, p.world_size): p for p in predictions}
    rows = []
    for step in run.steps:
        config = step.config
        key = (config.strategy, config.bucket_size_mb, config.batch_size, config.seq_len, run.world_size)
        if key not in by_key:
            continue
        predicted = by_key[key]
        measured = run.seconds(step)
        rows.append(ValidationRecord(
            strategy=config.strategy, bucket_size_mb=config.bucket_size_mb, batch_size=config.batch_size, seq_len=config.seq_len,
            measured_step_seconds=measured, predicted_step_seconds=predicted.step_seconds,
            error=predicted.step_seconds / measured - 1.0, measured_exposed_comm_seconds=step.waited_seconds,
            predicted_exposed_comm_seconds=predicted.exposed_comm_seconds,
        ))
    return rows


CANDIDATE_BUCKET_SIZES_MB = (0.1, 0.25, 1, 5, 10, 25, 50, 100, 250, 1000)


@dataclass(frozen=True)
class Recommendation:
    """The bucketed strategy's best and worst candidate cap at one batch, sequence length and world size."""

    batch_size: int
    seq_len: int
    world_size: int
    bucket_size_mb: float
    step_seconds: float
    exposed_comm_seconds: float
    worst_bucket_size_mb: float
    worst_step_seconds: float


def recommend_bucket_sizes(
    model_size, computes: dict[tuple[int, int], Compute], world_sizes: list[int], link: Link, overlap_slowdown: float,
    strategy: str = "bucketed",
) -> list[Recommendation]:
    """Per batch, sequence length and world size: ``strategy``'s best bucket size among
    ``CANDIDATE_BUCKET_SIZES_MB``. ``model_size`` is an LM size or any module (see ``gradients_of``)."""
    grid = predict_grid(
        model_size, computes, [(strategy, mb) for mb in CANDIDATE_BUCKET_SIZES_MB], world_sizes, link, overlap_slowdown
    )
    groups = defaultdict(list)
    for p in grid:
        groups[(p.batch_size, p.seq_len, p.world_size)].append(p)
    rows = []
    for (batch_size, seq_len, world_size), options in sorted(groups.items()):
        best = min(options, key=lambda p: (p.step_seconds, -p.bucket_size_mb))
        worst = max(options, key=lambda p: p.step_seconds)
        rows.append(Recommendation(batch_size, seq_len, world_size, best.bucket_size_mb, best.step_seconds,
                                   best.exposed_comm_seconds, worst.bucket_size_mb, worst.step_seconds))
    return rows


def advice(model: str, shape: StepShape, local_seconds: float, world_sizes: list[int], link: Link,
           overlap_slowdown: float) -> list[Recommendation]:
    """The best bucketed cap per world size for a workload by name: the built-in LM by its size,
    any other model from its parameters (built once on the CPU; no rank is involved)."""
    subject = model if model in MODEL_SIZES else build_workload(model, shape.micro_batch_size, shape.seq_len, "cpu").module
    return recommend_bucket_sizes(subject, {(shape.micro_batch_size, shape.seq_len): Compute.of(local_seconds, shape)},
                                  world_sizes, link, overlap_slowdown)


# ---------------------------------------------------------------------------------------------
# What to change in one measured step, from its own collectives


def service_samples(trace, world_size: int) -> list[tuple[int, int, float]]:
    """``(size_bytes, world_size, seconds)`` of each collective of a traced step
    (``ddp.bench.results.records.CollectiveTrace``) as the link served it: on one channel a collective
    starts when it is launched and the previous one is done, so its time on the link is its
    completion minus the later of the two (its launch to completion would count the queue)."""
    samples, previous_done = [], float("-inf")
    for c in sorted(trace.collectives, key=lambda c: c.launch_seconds):
        start = max(c.launch_seconds, previous_done)
        if c.size_bytes > 0 and c.done_seconds > start:
            samples.append((c.size_bytes, world_size, c.done_seconds - start))
        previous_done = max(previous_done, c.done_seconds)
    return samples


def link_of_step(trace, world_size: int) -> Link:
    """The link a step's own collectives ran at (``fit_link`` on ``service_samples``); where they
    are all of one size, the bandwidth alone (their bytes over their time, no latency)."""
    samples = service_samples(trace, world_size)
    if not samples:
        raise ValueError("the step's collectives have no sizes or times to fit a link on")
    try:
        return fit_link(samples, name="fitted on this step's collectives")
    except ValueError:
        bus = sum(b * 2 * (n - 1) / n for b, n, _ in samples)
        return Link("fitted on this step's collectives (bandwidth only)", 0.0, bus / sum(s for *_, s in samples))


@dataclass(frozen=True)
class PlanAdvice:
    """What the cost model, calibrated on one measured step, says a different plan would do."""

    link: Link
    modelled_seconds: float
    """The model's step at the measured plan."""
    error: float
    """modelled / measured step - 1: how far off the model is on this very step."""
    best_bucket_size_mb: float
    best_seconds: float
    """The model's step at its best cap of ``CANDIDATE_BUCKET_SIZES_MB`` (with the measured cap)."""
    bf16_seconds: float | None
    """The model's step at the best cap with gradients all-reduced in bf16 (None where the step
    already communicates in bf16)."""

    @property
    def gain_seconds(self) -> float:
        """What the best cap saves over the measured plan, in the model."""
        return self.modelled_seconds - self.best_seconds


def plan_advice(step, local_seconds: float) -> PlanAdvice:
    """The cost model on one step record of a bucketing strategy (``ddp.bench.results.records.StepRecord``
    with ``collectives``): its link fitted on the step's own collectives (``link_of_step``), its
    compute the ``local`` twin's step, its gradients the built-in LM's (``gradients_of``); the
    step at the measured cap, at every candidate cap, and in bf16 at the best. Raises
    ``NotModelled`` (or ValueError) where it cannot."""
    config = step.config
    if config.bucket_size_mb is None:
        raise NotModelled(f"{config.describe()} was saved without a bucket cap to compare others with")
    if config.model not in MODEL_SIZES:
        raise NotModelled(f"model {config.model!r} is not a built-in LM size: the advice reads the LM's gradients")
    link = link_of_step(step.collectives, step.world_size)
    gradients = gradients_of(config.model, config.seq_len)
    slowdown = default_overlap_slowdown(step.backend == "gloo" and step.device == "cpu")
    bf16 = config.grad_comm == "bf16"

    def in_bf16(grads: list[Gradient]) -> list[Gradient]:
        return [dataclasses.replace(g, size_bytes=g.size_bytes // 2, element_size=2) for g in grads]

    if bf16:
        gradients = in_bf16(gradients)

    def modelled(cap: float, grads=gradients) -> float:
        return predict_step(config.strategy, cap, Compute.of(local_seconds, config.step_shape), grads, link,
                            step.world_size, slowdown)[0]

    measured_cap = config.bucket_size_mb
    at_cap = {cap: modelled(cap) for cap in sorted({*CANDIDATE_BUCKET_SIZES_MB, measured_cap})}
    best = min(at_cap, key=lambda cap: (at_cap[cap], cap != measured_cap))
    return PlanAdvice(
        link=link, modelled_seconds=at_cap[measured_cap], error=at_cap[measured_cap] / step.step_seconds - 1.0,
        best_bucket_size_mb=best, best_seconds=at_cap[best], bf16_seconds=None if bf16 else modelled(best, in_bf16(gradients)),
    )
