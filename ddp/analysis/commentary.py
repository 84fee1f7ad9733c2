"""The report's commentary, generated from the numbers of a saved run: which strategy won each
configuration and by how much against the runner-up and the reference strategies, where
communication is most exposed, why bucket counts are not total / cap, and whether the run's noise
resolves the differences it shows. Sentences only; ``ddp.analysis.markdown`` places them."""

from __future__ import annotations

from collections import defaultdict

from ddp.analysis.figures import (
    BucketPlan,
    Win,
    bucket_plans,
    overheads_over_local,
    resolved_apart,
    several_models,
    winners,
)
from ddp.analysis.tables import mib, ms, pct
from ddp.bench.collectives.timeline import BOUND_BY_RULE
from ddp.bench.results.records import Run, StepRecord
from ddp.strategies.bucketed import BYTES_PER_MB
from ddp.strategies.registry import is_floor, traits


def _times(faster: StepRecord, slower: StepRecord) -> str:
    if not resolved_apart(faster, slower):
        return f"not resolved against {slower.label} ({ms(slower.step_seconds)} ms: the 95% intervals overlap)"
    return (
        f"{slower.step_seconds / faster.step_seconds:.2f}x faster than {slower.label} "
        f"({ms(slower.step_seconds)} ms, {ms(slower.step_seconds - faster.step_seconds)} ms less per step)"
    )


def winner_sentence(win: Win, with_model: bool) -> str:
    w = win.winner
    text = f"**{win.group.group_label(with_model)}**: {w.label} is fastest at {ms(w.step_seconds)} ms"
    # the runner-up and every reference strategy, nearest first
    against = {r.strategy: r for r in [win.runner_up, *win.references] if r is not None and r.strategy != w.strategy}
    margins = [_times(w, other) for other in sorted(against.values(), key=lambda s: s.step_seconds)]
    return text + (": " + "; ".join(margins) if margins else "") + "."


def plan_sentence(plan: BucketPlan) -> str:
    described = traits(plan.strategy)
    text = (
        f"- {plan.strategy}, cap {plan.bucket_size_mb:g} MiB: **{plan.num_buckets} bucket(s)** for "
        f"{mib(plan.total_bytes)} MiB of gradients (total / cap = {plan.total_over_cap})"
    )
    if plan.bucket_sizes_bytes is not None:
        sizes = [float(mib(size)) for size in plan.bucket_sizes_bytes]
        listed = ", ".join(f"{s:g}" for s in sizes[:12]) + (f", ... ({len(sizes) - 12} more)" if len(sizes) > 12 else "")
        text += f"; sizes in launch order, MiB: {listed}"
        if plan.oversized_buckets and described.closes_bucket_after_cap:
            text += (
                f"; {plan.oversized_buckets} bucket(s) exceed the cap ({plan.strategy} closes a bucket once it has "
                "reached the cap, not before the tensor that would overflow it)"
            )
        elif plan.oversized_buckets:
            text += f"; {plan.oversized_buckets} bucket(s) hold a single tensor larger than the cap"
    first = described.first_bucket_bytes
    large_first = first is not None and plan.bucket_size_mb * BYTES_PER_MB < first
    if plan.num_buckets < plan.total_over_cap:
        if large_first and plan.total_bytes <= first:
            text += (
                f". Fewer than total / cap: every gradient fits in {plan.strategy}'s first bucket, which it fills up "
                f"to {mib(first)} MiB whatever the cap says"
            )
        else:
            text += ". Fewer than total / cap: some buckets hold more than the cap"
            if not described.closes_bucket_after_cap:
                text += ", a tensor larger than the cap in a bucket of its own"
            if large_first:
                text += f" (and {plan.strategy}'s first bucket, filled up to {mib(first)} MiB whatever the cap says)"
    elif plan.num_buckets > plan.total_over_cap:
        text += ". More than total / cap: a bucket is closed as soon as the next tensor would overflow it, so buckets are rarely full"
    return text + "."


def faster_than_local(steps: list[StepRecord]) -> list[StepRecord]:
    """Data-parallel steps faster than ``local`` at their configuration: communication cannot make a
    step faster, so each one is noise (or a machine busy with something else) larger than the difference."""
    return [o.step for o in overheads_over_local(steps) if o.extra_seconds < 0]


def median_spread(steps: list[StepRecord]) -> float | None:
    """The median over benchmarks of the half-width of the median's 95% interval, relative to the median."""
    spreads = sorted(
        (s.step_seconds_ci95[1] - s.step_seconds_ci95[0]) / 2 / s.step_seconds
        for s in steps if s.step_seconds_ci95 and s.step_seconds > 0
    )
    return spreads[len(spreads) // 2] if spreads else None


def noise_sentence(steps: list[StepRecord]) -> str | None:
    spread = median_spread(steps)
    suspicious = faster_than_local(steps)
    if not suspicious and (spread is None or spread < 0.03):
        return None
    parts = []
    if spread is not None:
        parts.append(f"the 95% intervals of the medians are +-{pct(spread)} wide (median over benchmarks)")
    if suspicious:
        compared = len(overheads_over_local(steps))
        parts.append(
            f"{len(suspicious)} of {compared} data-parallel steps ran faster than `local`, which does no communication"
        )
    return (
        "**Noise warning**: " + "; ".join(parts) + ". Differences of that order are not resolved by this run: "
        "use more --rounds, larger steps (--batch-sizes, --seq-lens) or a machine nobody else is using."
    )


def commentary_section(run: Run) -> list[str]:
    steps = run.steps
    lines = ["## Commentary (generated from the numbers above)", ""]
    noise = noise_sentence(steps)
    if noise:
        lines += [noise, ""]
    wins = winners(steps)
    with_model = several_models(steps)
    if wins:
        counts = defaultdict(int)
        for win in wins:
            counts[win.winner.strategy] += 1
        tally = ", ".join(f"{name} at {n} of {len(wins)}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines += [f"Fastest data-parallel strategy per configuration: {tally}.", ""]
        lines += [f"- {winner_sentence(win, with_model)}" for win in wins]
        lines.append("")
    exposed = [s for s in steps if not is_floor(s.strategy) and s.exposed_comm_seconds is not None]
    if exposed:
        worst = max(exposed, key=lambda s: s.exposed_comm_seconds)
        share = max(exposed, key=lambda s: s.exposed_comm_fraction or 0.0)
        text = (
            f"Largest exposed communication: {worst.label} at {worst.group.group_label(with_model)} communicates "
            f"{ms(worst.exposed_comm_seconds)} ms per step with no compute beside it ({pct(worst.exposed_comm_fraction)} "
            "of its traced steps)"
        )
        if share is not worst:
            text += (
                f"; the largest share is {share.label} at "
                f"{share.group.group_label(with_model)}: {pct(share.exposed_comm_fraction)} of its traced steps "
                f"({ms(share.exposed_comm_seconds)} ms)"
            )
        lines += [text + ".", ""]
    host = [s for s in steps if s.bound_by == "host"]
    if host:
        lines += [f"Bound by the host ({len(host)} of {len(steps)} steps: {', '.join(sorted({s.label for s in host}))}), by "
                  f"the rule: {BOUND_BY_RULE}. Their step times, MFU and differences between strategies measure how fast "
                  "the host launches work, not the device: grow the batch or the sequence, or cut the host's work per step "
                  "(CUDA graphs, torch.compile), before reading them as the device's.", ""]
    plans = bucket_plans(steps)
    if plans:
        lines += [
            "Bucket plans. Buckets are filled in backward order and closed when the next tensor would "
            "overflow the cap, and a tensor larger than the cap gets a bucket of its own, so the count is "
            "not total / cap: it is at most the number of gradient tensors (when every tensor is at least "
            "the cap, bucketing launches one all-reduce per tensor, like overlap) and can be far below total / cap.",
            "",
        ]
        lines += [plan_sentence(plan) for plan in plans]
        if all(plan.bucket_sizes_bytes is None for plan in plans):
            lines.append("- (Per-bucket sizes are not in this run: its extra_info has no bucket_sizes_bytes.)")
        lines.append("")
    return lines
