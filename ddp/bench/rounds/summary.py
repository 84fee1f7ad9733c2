"""From measured rounds to the figures a record holds: medians with their intervals, the overhead
over ``local`` paired over rounds, throughput, FLOPs and MFU, memory per rank beside the
strategy's formula and the peak predicted before it was built (``ddp.bench.memory.predict``). The arithmetic only: the schema is ``ddp.bench.results.records``, the statistics
``ddp.bench.results.stats``, the FLOPs ``ddp.bench.results.flops``."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np

from ddp.bench.collectives.reading import comm_source
from ddp.bench.collectives.timeline import BOUND_BY_RULE, FIGURES, TAIL_RULE, usual_tail
from ddp.bench.collectives.timeline import medians as timeline_medians
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.values import sharded_compute_dtype
from ddp.bench.memory.predict import predict_or_none
from ddp.bench.results.flops import achieved_tflops, mfu, workload_flops_per_token
from ddp.bench.results.records import CollectiveTiming, CollectiveTrace, RaceRecord, StateRecord, StepRecord
from ddp.bench.results.stats import (
    interval_coverage,
    median_ci,
    median_interval,
    paired_ci,
    paired_difference_ci,
    paired_ratio_ci,
    relative_half_width,
)
from ddp.strategies.declarations import sharding_of
from ddp.strategies.registry import is_floor, resolve_strategy


def mfu_without_communication(local_rounds: list[float], rounds: list[float], mfu_seconds: float,
                              groups: list[int] | None = None) -> dict:
    """The MFU of the ``local`` twin (the same step without communication) at its median, and the
    points of MFU synchronization costs: the median over paired rounds of local's MFU minus the
    step's, with its 95% bootstrap interval. ``mfu_seconds`` is MFU x step time, the same for both
    (the work of one step over the device's peak): a round's MFU is ``mfu_seconds / seconds``;
    ``groups``: each round's group of ranks (the interval two-level, ``ddp.bench.results.stats``)."""
    points = 100.0 * mfu_seconds
    lost, *lost_ci = paired_ci(rounds, local_rounds, lambda step, local: np.median(points / local - points / step, axis=-1),
                               groups=groups)
    return dict(local_mfu=mfu_seconds / statistics.median(local_rounds), mfu_lost_points=lost, mfu_lost_points_ci95=lost_ci)


def collective_trace(rank_traces: list[list[RecordedStep]]) -> CollectiveTrace | None:
    """What bounds the step from every rank's traced steps (``ddp.bench.collectives.recording``),
    each with its ``timeline`` (``ddp.bench.collectives.timeline``), on the rank whose traced steps
    were slowest: medians over its steps of the partition and of each collective's times (from the
    end of backward's computation) and shares, with 95% intervals; ``bound_by`` by its rule applied
    to the medians; the tail the steps most often had (the latest-ending among ties). None when no
    rank traced a step."""
    ranks = [r for r, steps in enumerate(rank_traces) if steps]
    if not ranks:
        return None
    rank = max(ranks, key=lambda r: statistics.median(s.seconds for s in rank_traces[r]))
    steps = rank_traces[rank]
    timelines = [step.timeline for step in steps]
    per_label: dict[str, dict[str, list]] = {}
    for step, timeline in zip(steps, timelines):
        origin = step.backward_compute_end
        shares = {row["label"]: row for row in timeline["collectives"]}
        for c in step.collectives:
            figures = per_label.setdefault(c["label"], {"size_bytes": c["size_bytes"], "ready": [], "launch": [], "done": [],
                                                        "exposed": [], "overlapped": [], "phase": []})
            if c.get("ready_seconds") is not None:
                figures["ready"].append(c["ready_seconds"] - origin)
            figures["launch"].append(c["launch_seconds"] - origin)
            figures["done"].append(c["done_seconds"] - origin)
            row = shares.get(c["label"])
            figures["exposed"].append(row["exposed_seconds"] if row else 0.0)
            figures["overlapped"].append(row["overlapped_seconds"] if row else 0.0)
            if row:
                figures["phase"].append(row["phase"])
    timings = sorted((
        CollectiveTiming(label=label, size_bytes=f["size_bytes"],
                         ready_seconds=statistics.median(f["ready"]) if f["ready"] else None,
                         launch_seconds=statistics.median(f["launch"]), done_seconds=statistics.median(f["done"]),
                         exposed_seconds=statistics.median(f["exposed"]), exposed_seconds_ci95=list(median_ci(f["exposed"])),
                         overlapped_seconds=statistics.median(f["overlapped"]),
                         phase=Counter(f["phase"]).most_common(1)[0][0] if f["phase"] else None)
        for label, f in per_label.items()
    ), key=lambda c: c.launch_seconds)
    exposed = [t["exposed_comm_seconds"] for t in timelines]
    attributed = [sum(row["exposed_seconds"] for row in t["collectives"]) for t in timelines]
    figures = timeline_medians(timelines)
    return CollectiveTrace(
        rank=rank, steps=len(steps), comm_source=comm_source(steps),
        backward_start_seconds=statistics.median(s.phases["backward"][0] - s.backward_compute_end for s in steps),
        **{key: figures[key] for key in FIGURES}, exposed_comm_seconds_ci95=list(median_ci(exposed)),
        bound_by=figures["bound_by"], bound_by_rule=BOUND_BY_RULE,
        attributed_seconds=statistics.median(attributed), attributed_seconds_ci95=list(median_ci(attributed)),
        collectives=timings, tail=usual_tail(timelines), tail_rule=f"the most frequent over the traced steps of: {TAIL_RULE}",
    )


def step_record(measurement, backend: str, device: str, index: int = 0, local_index: int | None = None,
                **counted) -> StepRecord:
    """The record of configuration ``index`` of a ``ddp.bench.rounds.loop.Measurement``, paired with
    ``local_index`` (its local twin in the same rounds) when given; ``device`` is ``cpu`` or the GPU's
    name; ``counted``: the record's fields only the measurer knows (``builds``, ``warmup_rounds``,
    ``memory_counts``, ``traced_steps``: ``GridMeasurer.record_counts``; ``unpaired_reason``)."""
    config = measurement.configs[index]
    setups = measurement.setups[index]
    setup = setups[0]
    rounds = measurement.round_seconds(index)
    groups = measurement.round_groups or [0] * len(rounds)
    waits = measurement.sync_wait_seconds(index)
    step = statistics.median(rounds)
    fractions = [e / s for e, s in zip(waits, rounds) if s > 0]
    fraction_groups = [g for g, s in zip(groups, rounds) if s > 0]
    paired = {}
    if local_index is not None:
        local = measurement.round_seconds(local_index)
        difference, *difference_ci = paired_difference_ci(rounds, local, groups=groups)
        ratio, *ratio_ci = paired_ratio_ci(rounds, local, groups=groups)
        paired = dict(
            local_round_seconds=local, overhead_seconds=difference, overhead_seconds_ci95=difference_ci,
            overhead_ratio=ratio, overhead_ratio_ci95=ratio_ci,
        )
    world_size = len(setups)
    memories = [rank_setup.memory for rank_setup in setups]
    memory = None
    if all(m is not None for m in memories):
        memory = StateRecord(
            parameters_bytes=[m.parameters_bytes for m in memories],
            gradients_bytes=[m.gradients_bytes for m in memories],
            optimizer_state_bytes=[m.optimizer_state_bytes for m in memories],
            sharding=sharding_of(resolve_strategy(config.strategy)),
            tracked_peak_bytes=[m.tracked_peak_bytes for m in memories] if all(m.tracked_peak_bytes for m in memories) else None,
        )
    tokens = config.step_shape.tokens_per_step
    flops_per_token = workload_flops_per_token(config.model, config.seq_len)
    tflops = achieved_tflops(flops_per_token, tokens, step)
    step_mfu = mfu(tflops, device, config.precision)
    if step_mfu is not None and local_index is not None:
        paired.update(mfu_without_communication(paired["local_round_seconds"], rounds, step_mfu * step, groups))
    sizes = setup.bucket_sizes_bytes
    traced = None if measurement.traces is None else collective_trace(measurement.traces[index])
    return StepRecord(
        config=config, backend=backend, device=device, world_size=world_size,
        num_parameters=setup.num_parameters, num_parameter_tensors=setup.num_parameter_tensors,
        num_buckets=None if sizes is None else len(sizes), bucket_sizes_bytes=sizes,
        collectives_per_step=setup.collectives_per_step, bytes_per_step=setup.bytes_per_step,
        step_seconds=step, step_seconds_ci95=list(median_interval(rounds, groups)), round_seconds=rounds,
        round_groups=groups, step_seconds_ci_coverage=interval_coverage(len(rounds), groups),
        rank_step_seconds=[statistics.median(r) for r in measurement.rank_round_seconds(index)],
        sync_wait_seconds=statistics.median(waits), sync_wait_fraction=statistics.median(fractions),
        sync_wait_fraction_ci95=list(median_interval(fractions, fraction_groups) if min(fractions, default=0) > 0
                                     else median_ci(fractions)),
        tokens_per_step=tokens, tokens_per_second=world_size * tokens / step,
        target_precision=measurement.target_precision,
        reached_precision=relative_half_width(rounds, groups=groups) if len(rounds) > 1 else None,
        model_flops_per_token=flops_per_token, achieved_tflops=tflops, mfu=step_mfu,
        peak_memory_bytes=measurement.peak_memory_bytes(index), memory=memory,
        predicted_memory=predict_or_none(config, world_size),
        collectives=traced, exposed_comm_seconds=None if traced is None else traced.exposed_comm_seconds,
        bound_by=None if traced is None else traced.bound_by,
        compute_dtype=_dtype_name(sharded_compute_dtype(config.precision, config.strategy)),
        **paired, **counted,
    )


def _dtype_name(dtype) -> str | None:
    """``bfloat16`` for ``torch.bfloat16``; None for None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def race_record(measurement, backend: str, reference: str) -> RaceRecord:
    """The record of a race (``ddp.bench.rounds.race``): ``local`` (configuration 0), any other floor
    and the contenders in the same rounds, each divided by ``reference``'s and less its floor's
    (``StepConfig.local_twin``)."""
    configs = list(measurement.configs)
    names = [config.strategy for config in configs]
    rounds = {name: measurement.round_seconds(index) for index, name in enumerate(names)}
    contenders = [c for c in configs if not is_floor(c.strategy)]
    ratios = {c.strategy: paired_ratio_ci(rounds[c.strategy], rounds[reference]) for c in contenders if c.strategy != reference}
    overhead = {c.strategy: paired_difference_ci(rounds[c.strategy], rounds[c.local_twin().strategy]) for c in contenders}
    return RaceRecord(
        configs=list(measurement.configs), num_parameters=measurement.setups[0][0].num_parameters,
        world_size=len(measurement.setups[0]), backend=backend, contenders=names, reference=reference, round_seconds=rounds,
        step_seconds={name: statistics.median(r) for name, r in rounds.items()},
        step_seconds_ci95={name: list(median_ci(r)) for name, r in rounds.items()},
        ratio_over_reference={name: value[0] for name, value in ratios.items()},
        ratio_over_reference_ci95={name: list(value[1:]) for name, value in ratios.items()},
        overhead_over_local_seconds={name: value[0] for name, value in overhead.items()},
        overhead_over_local_seconds_ci95={name: list(value[1:]) for name, value in overhead.items()},
    )
