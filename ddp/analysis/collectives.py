"""Why a step is slow, collective by collective: the figures behind the report's section of that
name and its timeline plot, from each step record's ``collectives`` (``ddp.bench.results.records.CollectiveTrace``).

Per step: its collectives, the share of the exposed communication each holds (they add up to the
exposed window up to the last completion), the *tail* (the gradient collective that completed
last: what the step waited for at its end), the collective exposed the most, and, for a bucketing
strategy whose tail is exposed beyond doubt (its interval above zero), what the cost model
calibrated on that very step says another cap or bf16 communication would do
(``ddp.analysis.costmodel.plan_advice``), with the model's error on the step, whether the
predicted gain exceeds that error, and the ``ddp buckets`` command that measures it.
"""

from __future__ import annotations

import statistics

from ddp.analysis.costmodel import NotModelled, plan_advice
from ddp.analysis.figures import groups, several_models, sorted_steps
from ddp.analysis.tables import interval_ms, mib, ms
from ddp.bench.results.records import CollectiveTiming, StepRecord
from ddp.strategies.registry import takes_bucket_size

# A per-collective table lists the collectives exposed at least this long, the most exposed
# first and at most so many, and the tail; the others (a per-parameter strategy launches
# hundreds) are counted in one line.
LISTED_EXPOSED_SECONDS = 1e-4
LISTED_MOST = 8


def with_collectives(steps: list[StepRecord]) -> list[StepRecord]:
    """The steps that carry per-collective figures, in table order."""
    return sorted_steps([s for s in steps if s.collectives is not None and s.collectives.collectives])


def most_exposed(step: StepRecord) -> CollectiveTiming:
    return max(step.collectives.collectives, key=lambda c: c.exposed_seconds)


def tail_resolved(step: StepRecord) -> bool:
    """Whether the tail's exposed share is above zero beyond the traced steps' noise."""
    tail = step.collectives.tail_timing
    return tail is not None and tail.exposed_seconds_ci95[0] > 0


def summary_rows(steps: list[StepRecord]) -> tuple[list[list], list[str]]:
    """A row per traced step: its exposed communication and what bounds it beside the
    collectives' shares added up (traced steps), the tail and the collective exposed the most."""
    with_model = several_models(steps)
    rows = []
    for s in with_collectives(steps):
        trace = s.collectives
        tail, top = trace.tail_timing, most_exposed(s)
        rows.append([
            s.group.group_label(with_model), s.label, len(trace.collectives),
            f"{ms(s.exposed_comm_seconds)}", trace.bound_by,
            f"{ms(trace.attributed_seconds)} {interval_ms(trace.attributed_seconds_ci95)}",
            "" if tail is None else f"{tail.label} ({mib(tail.size_bytes)} MiB): {ms(tail.exposed_seconds)} "
                                    f"{interval_ms(tail.exposed_seconds_ci95)}",
            f"{top.label}: {ms(top.exposed_seconds)}",
        ])
    headers = ["configuration", "strategy", "collectives", "exposed comm: traced median (ms)", "bound by",
               "shares added up: traced median (ms) [95%]", "tail: exposed, traced median (ms) [95%]",
               "exposed the most: traced median (ms)"]
    return rows, headers


def detail_group(steps: list[StepRecord]):
    """The group whose collectives the report details: the one with the most tokens per rank (the
    heaviest step), the last in table order among equals."""
    traced = with_collectives(steps)
    if not traced:
        return None
    keys = groups(traced)
    return max(keys, key=lambda k: (k.step_shape.tokens_per_step, keys.index(k)))


def detail_rows(step: StepRecord) -> tuple[list[list], str | None]:
    """The collectives of ``step`` exposed the most (at least ``LISTED_EXPOSED_SECONDS``, at most
    ``LISTED_MOST``) and the tail, in launch order, with their ready, launch and completion (ms
    from backward's end); and a line counting the rest."""
    trace = step.collectives
    exposed = sorted((c for c in trace.collectives if c.exposed_seconds >= LISTED_EXPOSED_SECONDS),
                     key=lambda c: c.exposed_seconds, reverse=True)[:LISTED_MOST]
    listed = [c for c in trace.collectives if c in exposed or c.label == trace.tail]
    rows = [[c.label + (" (tail)" if c.label == trace.tail else ""), mib(c.size_bytes) if c.size_bytes else "",
             ms(c.ready_seconds, 1), ms(c.launch_seconds, 1), ms(c.done_seconds, 1),
             f"{ms(c.exposed_seconds)} {interval_ms(c.exposed_seconds_ci95)}"] for c in listed]
    rest = [c for c in trace.collectives if c not in listed]
    note = None
    if rest:
        note = (f"{len(rest)} more collectives of {step.label} exposed {ms(sum(c.exposed_seconds for c in rest))} ms "
                f"together, {ms(max(c.exposed_seconds for c in rest))} ms at most.")
    return rows, note


DETAIL_HEADERS = ["collective", "MiB", "ready: traced median (ms)", "launched: traced median (ms)", "done: traced median (ms)",
                  "exposed: traced median (ms) [95%]"]


def local_seconds(step: StepRecord, steps: list[StepRecord]) -> float | None:
    """The step of ``step``'s ``local`` twin: paired in its rounds where it was, else the run's row."""
    if step.local_round_seconds:
        return statistics.median(step.local_round_seconds)
    twin = next((s for s in steps if s.config == step.config.local_twin()), None)
    return None if twin is None else twin.step_seconds


# A cap is advised only where the model predicts it saves more than this share of the step: below
# it the candidates are ties (a link fitted without latency costs every plan alike).
ADVISED_GAIN = 0.01


def advice_rows(steps: list[StepRecord]) -> tuple[list[list], list[str]]:
    """For each bucketing strategy whose tail is exposed beyond doubt: the cost model calibrated
    on the step (``plan_advice``), a row with its error on the step, the cap it advises and the
    gain it predicts, bf16 communication's, and whether the gain exceeds the model's own error;
    and the ``ddp buckets`` command that measures each advised cap beside the measured one (or why
    the model could not be calibrated)."""
    with_model = several_models(steps)
    rows, commands = [], []
    for step in with_collectives(steps):
        if not takes_bucket_size(step.strategy) or not tail_resolved(step):
            continue
        tail = step.collectives.tail_timing
        head = [step.group.group_label(with_model), step.label,
                f"{tail.label}: {ms(tail.exposed_seconds)} {interval_ms(tail.exposed_seconds_ci95)}"]
        local = local_seconds(step, steps)
        try:
            if local is None:
                raise NotModelled("no `local` twin in the run to take the compute from")
            advice = plan_advice(step, local)
        except (NotModelled, ValueError) as error:
            rows.append(head + ["", f"none: {error}", "", "", ""])
            continue
        cap = step.config.bucket_size_mb
        changes = advice.best_bucket_size_mb != cap and advice.gain_seconds > ADVISED_GAIN * advice.modelled_seconds
        trusted = changes and advice.gain_seconds > abs(advice.error) * step.step_seconds
        bf16 = "" if advice.bf16_seconds is None else f"-{ms((advice.best_seconds if changes else advice.modelled_seconds) - advice.bf16_seconds, 1)}"
        rows.append(head + [f"{advice.error:+.0%}",
                            f"{advice.best_bucket_size_mb:g} MiB: -{ms(advice.gain_seconds, 1)}" if changes else f"keep {cap:g} MiB",
                            bf16, ("yes" if trusted else "no") if changes else "", ms(step.step_seconds, 1)])
        if changes:
            commands.append(f"- {step.label}, {step.group.group_label(with_model)}: {confirm_command(step, advice.best_bucket_size_mb)}")
    return rows, commands


ADVICE_HEADERS = ["configuration", "strategy", "tail: exposed, traced median (ms) [95%]", "model's error on the step",
                  "cap advised: predicted gain (ms)", "bf16 comm at that cap: predicted (ms)", "gain beyond the error",
                  "measured step: median (ms)"]


def confirm_command(step: StepRecord, advised_cap: float) -> str:
    """The ``ddp buckets`` command that measures the advised cap beside the measured one."""
    config = step.config
    caps = ",".join(f"{c:g}" for c in dict.fromkeys([config.bucket_size_mb, advised_cap]))
    options = "".join(f" {axis.flag} {value}" for axis, value in config.axis_values("option", "member")
                      if value != axis.default and axis.name != "bucket_size_mb")
    return (f"`python -m ddp buckets --strategies {config.strategy} --model {config.model} --batch-size {config.batch_size} "
            f"--seq-len {config.seq_len} --bucket-sizes {caps}{options} --world-size {step.world_size}`")
