"""``report.md``: its sections and tables from saved runs (``ddp.bench.results.records``), with the
figures of ``ddp.analysis.figures``, the commentary of ``ddp.analysis.commentary``, the comparison
of ``ddp.analysis.compare`` and the plots of ``ddp.analysis.plots``.

Nothing here reruns or parses printed output: every number comes from the JSON that
``--benchmark-json`` or ``--benchmark-save`` wrote. Time per step is the median round (one
training step on every rank, the slowest rank's time), shown with its 95% interval;
``exposed_comm_seconds`` (from the end of backward's computation to gradients synchronized) is the
communication the step could not hide, compute the rest. With several runs, the last one is
reported in full and every earlier one is compared with it, benchmark by benchmark.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ddp.analysis import collectives, plots
from ddp.analysis.commentary import commentary_section
from ddp.analysis.compare import DEFAULT_THRESHOLD, compare
from ddp.analysis.compare import table as comparison_table
from ddp.analysis.figures import (
    bucket_plans,
    groups,
    machine_differences,
    machine_summary,
    overheads_over_local,
    several_models,
    sorted_steps,
    step_order,
)
from ddp.analysis.sharding import (
    FIT_WORLD_SIZES,
    H100_BYTES,
    LEVELS,
    MEASURED_HEADERS,
    PEAK_HEADERS,
    fit_rows,
    measured_memory_rows,
    peak_memory_rows,
)
from ddp.analysis.tables import interval_ms, mib, ms, pct, ratio_interval, table
from ddp.bench.collectives.timeline import BOUND_BY_RULE
from ddp.bench.config.step_config import AXES, StepConfig
from ddp.bench.results.records import Run, RunFileError, StepRecord, load_run
from ddp.strategies.registry import DEFAULT_CONTENDERS, FLOOR, is_floor

TABLE_FORMAT = "github"


def _table(rows: list, headers: list[str]) -> str:
    return table(rows, headers, TABLE_FORMAT)


def section(title: str, intro: str, rows: list, headers: list[str]) -> list[str]:
    """A report section: its title, what its table shows, the table."""
    return [f"## {title}", "", intro, "", _table(rows, headers), ""]


def header_section(run: Run) -> list[str]:
    commit = run.commit_info
    commit_text = (
        f"{commit.get('id', '?')[:12]}{' (dirty tree)' if commit.get('dirty') else ''} on {commit.get('branch', '?')}"
        if commit
        else "not recorded"
    )
    rows = [["run", f"`{run.path}`"], ["saved", run.datetime or "not recorded"], ["commit", commit_text]]
    summary = machine_summary(run)
    summary.setdefault("GPU", "none")
    rows += [[key, value] for key, value in summary.items()]
    models = sorted({s.config.model for s in run.steps})
    if models:
        rows.append(["model", ", ".join(models)])
    return ["## Machine", "", _table(rows, ["", ""]), ""]


def _pivot(steps: list[StepRecord], cell, what: str) -> tuple[list, list[str]]:
    """A table with a row per strategy (its label) and a column per group, each named with
    ``what`` its cells hold and how they were obtained."""
    keys = groups(steps)
    with_model = several_models(steps)
    labels = list(dict.fromkeys(s.label for s in sorted(steps, key=step_order)))
    by = {(s.label, s.group): s for s in steps}
    rows = [[label] + [cell(by[(label, k)]) if (label, k) in by else "" for k in keys] for label in labels]
    return rows, ["strategy"] + [f"{k.group_label(with_model)}: {what}" for k in keys]


def step_section(run: Run) -> list[str]:
    steps = run.steps
    time_rows, headers = _pivot(steps, lambda s: f"{ms(s.step_seconds)} {interval_ms(s.step_seconds_ci95)}"
                                + ("" if (s.step_seconds_ci_coverage or 1.0) >= 0.95 else f" ({s.step_seconds_ci_coverage:.0%})"),
                                "median (ms) [95%]")
    share_rows, share_headers = _pivot(steps, exposed_cell, "exposed: traced median; wait: timed median")
    world = sorted({s.world_size for s in steps})
    short = [s for s in steps if (s.step_seconds_ci_coverage or 1.0) < 0.95]
    return [
        f"## Time per step ({', '.join(map(str, world))} ranks; batch is per rank)",
        "",
        "Median step time, ms, with its 95% interval (one step on every rank, the slowest rank's time):",
        "",
        _table(time_rows, headers),
        "",
        *([f"An interval followed by a percentage covers only that: {len(short)} step(s) had fewer rounds than "
           "a 95% interval of a median needs (6); take more with --rounds.", ""] if short else []),
        "Exposed communication: the step's communication with no compute beside it, from its traced steps "
        "(`ddp.bench.collectives.timeline`), as a share of its step (and in ms), and what bounds the step by "
        f"the rule `{BOUND_BY_RULE}`; then the timed rounds' wait from backward's last gradient to gradients "
        "synchronized, which on a host-bound step is the host's launch gap, not communication. Where nothing was "
        "traced (a run saved before schema 7), the wait alone, so marked.",
        "",
        _table(share_rows, share_headers),
        "",
    ]


def exposed_cell(step: StepRecord) -> str:
    """A step's exposed communication and what bounds it, beside the timed rounds' wait for
    gradients, which on a host-bound step is the host's launch gap (so flagged); the wait alone
    where nothing was traced."""
    wait = f"wait {ms(step.sync_wait_seconds)} ms" + (" (host-bound: the host's gap)" if step.bound_by == "host" else "")
    if step.exposed_comm_seconds is None:
        return f"{wait} (not traced)"
    return f"{pct(step.exposed_comm_fraction)} of its traced steps ({ms(step.exposed_comm_seconds)} ms), {bound_label(step)}; {wait}"


def bound_label(step: StepRecord) -> str:
    """``bound by host`` and the like: what a figure of the step measures; empty where not traced."""
    return "" if step.bound_by is None else f"bound by {step.bound_by}"


def _tflops(step: StepRecord) -> str:
    if step.achieved_tflops is None:
        return ""
    mfu = "MFU -" if step.mfu is None else f"MFU {pct(step.mfu)}"
    bound = f", {bound_label(step)}" if step.bound_by is not None else ""
    return f"{step.achieved_tflops:.3g} ({mfu}{bound})"


def flops_section(run: Run) -> list[str]:
    steps = [s for s in run.steps if s.achieved_tflops is not None]
    if not steps:
        return []
    rows, headers = _pivot(steps, _tflops, "TFLOP/s at the median step")
    flops = sorted({(s.config.model, s.config.seq_len, s.model_flops_per_token) for s in steps})
    per_token = "; ".join(f"{model} at seq {seq}: {value / 1e9:.4g} GFLOP" for model, seq, value in flops)
    unknown = sorted({s.device for s in steps if s.mfu is None})
    return [
        "## Achieved TFLOP/s and MFU",
        "",
        "Model TFLOP/s per device: FLOPs per token (6 x matmul weights + 12 x layers x d_model x seq len, "
        f"forward and backward: {per_token}) x batch x seq len / step time. MFU divides by the device's dense peak "
        "in the step's precision (`ddp.bench.results.flops.PEAK_TFLOPS`)"
        + (f"; none is known for {', '.join(unknown)}, so MFU is not given there." if unknown else ".")
        + " A step bound by the host measures the host's launches, not the device: its MFU is no device's.",
        "",
        _table(rows, headers),
        "",
    ] + mfu_lost_lines(steps)


def mfu_lost_lines(steps: list[StepRecord]) -> list[str]:
    """MFU with and without communication: each step's, its ``local`` twin's in the same rounds, and
    the points synchronization costs with their interval."""
    paired = [s for s in sorted_steps(steps) if s.mfu_lost_points is not None]
    if not paired:
        return []
    rows = [[s.group.group_label(), s.label, pct(s.local_mfu), pct(s.mfu),
             f"{s.mfu_lost_points:.2f} [{s.mfu_lost_points_ci95[0]:.2f}, {s.mfu_lost_points_ci95[1]:.2f}]"]
            for s in paired]
    return [
        "MFU with and without communication: the step's beside its `local` twin's in the same rounds (the same "
        "step, no synchronization), and the points of MFU synchronization costs (median over paired rounds, 95% "
        "interval):",
        "",
        _table(rows, ["config", "strategy", "MFU without communication (local)", "MFU", "points lost to synchronization [95%]"]),
        "",
    ]


def variant_section(run: Run) -> list[str]:
    """Per workload (model, batch, seq len) run with more than one set of options (precision, AdamW's
    implementation, ...): each strategy's step, overhead over local and exposed communication in
    every variant side by side, and how the ranking and the best bucket cap change."""
    steps = run.steps
    by_workload = defaultdict(list)
    for s in steps:
        by_workload[s.config.workload].append(s)
    workloads = [w for w, here in sorted(by_workload.items()) if len({s.config.variant for s in here}) > 1]
    if not workloads:
        return []
    overhead = {id(o.step): o for o in overheads_over_local(steps)}
    with_model = len({workload[0] for workload in workloads}) > 1
    lines = [
        "## By precision and options",
        "",
        f"The same steps in each variant (precision, AdamW's implementation, ...): median step (ms), overhead over "
        f"`{FLOOR}` in the same variant (ms), and exposed communication (ms). Reduced precision shrinks compute and not "
        "the gradients to all-reduce (unless communicated in bf16), so communication's share of the step grows.",
        "",
    ]
    for workload in workloads:
        here = by_workload[workload]
        variants = list(dict.fromkeys(g.variant for g in groups(here)))
        labels = list(dict.fromkeys(s.label for s in sorted(here, key=step_order)))
        by = {(s.label, s.config.variant): s for s in here}
        rows = []
        for label in labels:
            row = [label]
            for variant in variants:
                s = by.get((label, variant))
                o = overhead.get(id(s)) if s is not None else None
                row += ["", "", "", ""] if s is None else [
                    ms(s.step_seconds), "" if o is None else ms(o.extra_seconds),
                    "" if is_floor(s.strategy) else ms(s.exposed_comm_seconds), s.bound_by or ""]
            rows.append(row)
        headers = ["strategy"] + [f"{v}: {what}" for v in variants for what in ("step", "over local", "exposed comm", "bound by")]
        lines += [f"**{_workload_label(here[0], with_model)}**", "", _table(rows, headers), ""]
        for variant in variants:
            ranked = sorted((s for s in here if s.config.variant == variant and not is_floor(s.strategy)), key=lambda s: s.step_seconds)
            if not ranked:
                continue
            best_caps = {}
            for s in ranked:
                if s.config.bucket_size_mb is not None:
                    best_caps.setdefault(s.strategy, s.config.bucket_size_mb)
            order = " < ".join(f"{s.label} {ms(s.step_seconds)}" for s in ranked)
            caps = ", ".join(f"{name} {cap:g} MiB" for name, cap in best_caps.items())
            lines.append(f"- {variant}: {order} (ms)" + (f"; best cap: {caps}" if caps else ""))
        lines.append("")
    return lines


def _workload_label(step: StepRecord, with_model: bool) -> str:
    """The workload of a step in words, without its options: ``batch 4, seq len 64``."""
    workload_only = StepConfig.of(FLOOR, {name: getattr(step.config, name) for name, axis in AXES.items() if axis.role == "workload"})
    return workload_only.group_label(with_model)


def _over(step: StepRecord) -> str:
    """A step's label, naming its floor where it is not ``local`` (``fsdp (over local_mixed)``)."""
    floor = step.config.local_twin().strategy
    return step.label if floor == FLOOR else f"{step.label} (over {floor})"


def overhead_section(run: Run) -> list[str]:
    overheads = overheads_over_local(run.steps)
    if not overheads:
        return ["## Overhead over `local`", "", "No `local` benchmark in this run: nothing to measure overhead against.", ""]
    with_model = several_models([o.step for o in overheads])
    rows = [
        [o.step.group.group_label(with_model), _over(o.step), ms(o.local_seconds), ms(o.step.step_seconds),
         f"{ms(o.extra_seconds)} {interval_ms(o.interval)}", f"{o.ratio:.3f}",
         {None: "unpaired", True: "yes", False: "not resolved"}[o.resolved]]
        for o in overheads
    ]
    return section(
        "Overhead over `local`",
        "`local` trains each rank's batch with no communication at all: the price of data parallelism is the rest. "
        "Where the run interleaved each round with one of `local`, the overhead is the median over rounds of the "
        "difference within a round (paired), with its 95% interval, and step / local the median of each round's "
        "ratio: neither is the difference or ratio of the two medians beside them, each taken over all its rounds; "
        "'not resolved' means the interval includes 0. Unpaired rows (no local in their rounds) give the medians' "
        "difference and ratio.",
        rows, ["config", "strategy", "local: median (ms)", "step: median (ms)", "overhead: paired median (ms) [95%]",
               "step / local: paired median", "resolved"],
    )


def memory_section(run: Run) -> list[str]:
    rows = measured_memory_rows(run.steps)
    peaks = peak_memory_rows(sorted_steps(run.steps))
    lines = []
    if peaks:
        lines += [
            "## Peak memory per rank: predicted before building, and measured",
            "",
            "The peak each configuration was predicted to reach before anything was built (`python -m ddp memory`, "
            "`ddp.bench.memory.predict`: the training state from the strategy's declarations, activations and temporaries "
            "from the model's step traced on fake tensors), by category at the moment of the step it falls in, beside "
            "the measured peak: CUDA's `max_memory_allocated` over the timed steps, or on CPU PyTorch's `MemTracker` "
            "over untimed steps (its categories at its peak in the last column; a strategy's own buffers land in "
            "Gradient, Temp, Activation or Other by when it first saw them).",
            "",
            _table(peaks, PEAK_HEADERS),
            "",
        ]
    if not rows:
        return lines
    return lines + [
        "## Memory per rank",
        "",
        "The state each strategy holds on its most loaded rank, counted as distinct tensor storages after "
        "gradients are synchronized (`ddp.bench.memory.state`; the same count on CPU and CUDA), beside the formula of "
        "what it shards (fp32 weights, gradients, AdamW's two moments; bytes a parameter: "
        + ", ".join(f"{level} {sharding.formula}" for level, sharding in LEVELS.items())
        + "). Activations and communication buffers are not state: on CUDA the allocator's peak over the timed "
        "steps shows them.",
        "",
        _table(rows, MEASURED_HEADERS),
        "",
    ]


def sharding_section(run: Run) -> list[str]:
    """Which model fits at which world size, and what the run measured sharding to cost."""
    sharded = [s for s in run.steps if s.memory is not None and s.memory.sharding is not None and s.memory.sharding.is_sharded]
    if not sharded:
        return []
    gb = 1e9
    capacity = [
        [level] + [f"{H100_BYTES / (sharding.bytes_per_parameter(n)['total'] * 1e9):.1f}" for n in FIT_WORLD_SIZES]
        for level, sharding in LEVELS.items()
    ]
    fits = [
        [row.model, f"{row.num_parameters / 1e9:.2f}", row.level, row.formula]
        + [f"{row.bytes_per_rank[n] / gb:.1f}" for n in FIT_WORLD_SIZES]
        for row in fit_rows()
        if row.num_parameters >= 10**8
    ]
    lines = [
        "## Sharding: what fits, and what it costs",
        "",
        "Largest model (billions of parameters) whose training state fits one 80 GB GPU, by world size, "
        "before activations:",
        "",
        _table(capacity, ["state"] + [f"N={n}" for n in FIT_WORLD_SIZES]),
        "",
        "State per rank (GB) of the suite's model sizes:",
        "",
        _table(fits, ["model", "parameters (B)", "state", "bytes a parameter"] + [f"N={n}" for n in FIT_WORLD_SIZES]),
        "",
    ]
    # against the first of the default contenders the run has (bucketed: the sharded optimizer builds on it)
    replicated = {}
    for s in sorted(run.steps, key=lambda s: (DEFAULT_CONTENDERS.index(s.strategy) if s.strategy in DEFAULT_CONTENDERS else 99,
                                             step_order(s))):
        if s.strategy in DEFAULT_CONTENDERS and s.memory is not None:
            replicated.setdefault(s.group, s)
    costs = []
    for step in sorted_steps(sharded):
        reference = replicated.get(step.group)
        if reference is not None:
            held = sum(step.memory.rank_total(r) for r in range(step.world_size))
            held_reference = sum(reference.memory.rank_total(r) for r in range(reference.world_size))
            costs.append([step.group.group_label(False), step.label, reference.label,
                          f"{step.step_seconds / reference.step_seconds:.2f}", f"{held / held_reference:.2f}"])
    if costs:
        lines += [
            f"Measured here ({run.steps[0].world_size} ranks): step time and state held, each against replicated DDP "
            "(time: ratio of medians; state: summed over ranks):",
            "",
            _table(costs, ["config", "strategy", "against", "step time ratio", "state ratio"]),
            "",
            "At 8 to 512 ranks: `python -m ddp simulate --from RUN.json --strategies bucketed,sharded_optimizer,fsdp,torch_fsdp "
            "--world-sizes 8,64,512 --link ib-400g` (ZeRO-1 adds an exposed all-gather of the parameters, half an "
            "all-reduce's bytes; full sharding moves 1.5 times an all-reduce's bytes, in per-unit pieces that "
            "prefetching can hide).",
            "",
        ]
    return lines


def bucket_section(run: Run) -> list[str]:
    steps = [s for s in run.steps if s.config.bucket_size_mb is not None]
    if not steps:
        return []
    plans = {(p.strategy, p.bucket_size_mb): p for p in bucket_plans(steps)}
    keys = groups(steps)
    with_model = several_models(steps)
    by = {(s.label, s.group): s for s in steps}
    rows = []
    for label, first in {s.label: s for s in sorted(steps, key=step_order)}.items():
        cap = first.config.bucket_size_mb
        plan = plans.get((first.strategy, cap))
        row = [label, f"{cap:g}", "" if plan is None else plan.num_buckets, "" if plan is None else plan.total_over_cap]
        row += [ms(by[(label, k)].step_seconds) if (label, k) in by else "" for k in keys]
        rows.append(row)
    headers = ["strategy", "bucket cap (MiB)", "buckets", "total / cap"] + [f"{k.group_label(with_model)}: median (ms)" for k in keys]
    return section(
        "By bucket size",
        "Median step time, ms, with the number of buckets each cap produced and the count that "
        "total gradient bytes / cap would suggest (see the commentary for why they differ).",
        rows, headers,
    )


def collectives_section(run: Run) -> list[str]:
    """Why it is slow, collective by collective (``ddp.analysis.collectives``)."""
    rows, headers = collectives.summary_rows(run.steps)
    if not rows:
        return []
    lines = section(
        "Collective by collective",
        "Each collective of a step, timed in untimed traced steps after the timed rounds, on the rank whose traced "
        "steps were slowest. Its *exposed* share is the part of the step's exposed communication (backward's end to "
        "the optimizer) it alone held: in the order collectives completed, from the previous completion to its own. "
        "The shares add up to the exposed communication, up to what follows the last completion (copies back, the "
        "wake-up); the timed rounds' figure is beside them. The *tail* is the gradient collective that completed "
        "last: what the step waited for at its end.",
        rows, headers,
    )
    detail = collectives.detail_group(run.steps)
    with_model = several_models(run.steps)
    lines += [f"### Collectives of {detail.group_label(with_model)}", "",
              "Times in ms from the end of backward's computation (negative: during backward); medians over the traced "
              "steps. Ready: when its data was ready to send; launched: when it was handed to the backend; done: when it "
              "completed. The timeline plot draws the same.", ""]
    for step in collectives.with_collectives([s for s in run.steps if s.group == detail]):
        detail_rows, note = collectives.detail_rows(step)
        lines += [f"**{step.label}** (backward began at {ms(step.collectives.backward_start_seconds, 1)} ms; "
                  f"times from {step.collectives.comm_source.replace('_', ' ')})", "", _table(detail_rows, collectives.DETAIL_HEADERS), ""]
        if note:
            lines += [note, ""]
    rows, commands = collectives.advice_rows(run.steps)
    if rows:
        lines += ["### What to change", "",
                  "For each bucketing strategy whose tail is exposed beyond doubt (its interval above zero): the cost model "
                  "of `ddp simulate` calibrated on the step itself (its link fitted on the step's own collectives, its "
                  "compute the `local` twin's step), its error on the measured step, the cap among its candidates that it "
                  "predicts fastest and what it saves a step, what bf16 communication would save at that cap, and whether "
                  "the saving exceeds the model's own error on this step (only then is it more than a hint).", "",
                  _table(rows, collectives.ADVICE_HEADERS), ""]
        if commands:
            lines += ["Measure an advised cap beside the measured one:", "", *commands, ""]
    return lines


def allreduce_section(run: Run) -> list[str]:
    if not run.allreduces:
        return []
    results = sorted(run.allreduces, key=lambda a: (a.backend, a.world_size, a.size_bytes))
    rows = [
        [a.backend, a.world_size, mib(a.size_bytes), ms(a.seconds, 3), f"{a.algbw_gbps:.3f}",
         f"{a.busbw_gbps:.3f}", a.wrong]
        for a in results
    ]
    return section(
        "All-reduce",
        "float32 sum, time of the slowest rank (median). algbw = size / time; busbw = algbw x 2(n-1)/n "
        "(as nccl-tests), comparable with link bandwidth whatever the number of ranks. GB/s = 10^9 bytes/s.",
        rows, ["backend", "ranks", "size (MiB)", "time: median (ms)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"],
    )


def race_section(run: Run) -> list[str]:
    if not run.races:
        return []
    lines = [
        "## Races (alternating rounds)",
        "",
        "The contenders wrap the same model on the same ranks, one step of each per round in rotating order, so "
        "drift in the machine falls on all alike. Each contender's step / the reference's (median of the per-round "
        "ratios, 95% interval) below 1 means it is faster.",
        "",
    ]
    for r in run.races:
        rows = [
            [name, ms(r.step_seconds[name]), interval_ms(r.step_seconds_ci95[name]),
             "reference" if name == r.reference else (
                 f"{r.ratio_over_reference[name]:.3f} {ratio_interval(r.ratio_over_reference_ci95[name])}"
                 if name in r.ratio_over_reference else ""),
             "" if name not in r.ratio_over_reference else (
                 "yes" if r.ratio_over_reference_ci95[name][1] < 1 or r.ratio_over_reference_ci95[name][0] > 1 else "not resolved")]
            for name in r.contenders
        ]
        lines += [f"{r.configs[-1].group_label()}" + ("" if r.bucket_size_mb is None else f", bucket cap {r.bucket_size_mb:g} MiB")
                  + f", {r.world_size} ranks:", "",
                  _table(rows, ["strategy", "median (ms)", "95% interval", f"step / {r.reference}: paired median [95%]", "resolved"]), ""]
    return lines


def others_section(run: Run) -> list[str]:
    if not run.others:
        return []
    rows = [[o.name, o.group or "", ms(o.median_seconds)] for o in run.others]
    return [
        "## Other benchmarks",
        "",
        "Neither step nor all-reduce benchmarks (told apart by their extra_info): median only.",
        "",
        _table(rows, ["benchmark", "group", "median (ms)"]),
        "",
    ]


def comparison_section(old: Run, new: Run) -> list[str]:
    lines = [f"## Comparison: `{new.path}` against `{old.path}`", ""]
    differences = machine_differences(old, new)
    if differences:
        facts = "; ".join(f"{key}: {a} vs {b}" for key, (a, b) in differences.items())
        lines += [
            f"> **WARNING: the runs come from different machines or setups** ({facts}). A ratio between "
            "them measures the machine as much as the code: rerun both on one machine before drawing conclusions.",
            "",
        ]
    rows = compare(old, new, DEFAULT_THRESHOLD)
    matched = [r.ratio for r in rows if r.ratio is not None]
    only_old = sum(1 for r in rows if r.new_seconds is None)
    only_new = sum(1 for r in rows if r.old_seconds is None)
    summary = f"{len(matched)} benchmarks in both runs"
    if matched:
        geomean = math.exp(sum(math.log(r) for r in matched) / len(matched))
        summary += f", geometric mean of new / old {geomean:.3f}"
    summary += f"; {only_old} only in the old run, {only_new} only in the new one."
    verdicts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows if r.ratio_ci95)}
    if verdicts:
        summary += " Against a threshold of " + f"{DEFAULT_THRESHOLD:.0%}: " + ", ".join(f"{n} {v}" for v, n in verdicts.items()) + "."
    lines += [
        "Matched by benchmark name, as `ddp compare` does: new / old below 1 means the new run is faster, with a "
        "95% interval over both runs' rounds, taken on each round's step / local where both runs interleaved them "
        "(basis). " + summary,
        "",
        comparison_table(rows, TABLE_FORMAT),
        "",
    ]
    return lines


def render_markdown(runs: list[Run], images: list[Path]) -> str:
    """report.md for ``runs`` (the last reported in full, the earlier ones compared with it)."""
    run = runs[-1]
    lines = ["# ddp-bench report", ""]
    lines += header_section(run)
    if run.steps:
        lines += commentary_section(run)
    for old in runs[:-1]:
        lines += comparison_section(old, run)
    if run.steps:
        lines += step_section(run)
        lines += variant_section(run)
        lines += flops_section(run)
        lines += overhead_section(run)
        lines += memory_section(run)
        lines += sharding_section(run)
        lines += bucket_section(run)
        lines += collectives_section(run)
    else:
        lines += ["No step benchmarks in this run (run perf_tests/test_step.py for the step tables).", ""]
    lines += race_section(run)
    lines += allreduce_section(run)
    lines += others_section(run)
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{image.stem}]({image.name})" for image in images]
        lines.append("")
    return "\n".join(lines)


def write_report(paths: list[str | Path], out: str | Path) -> Path:
    """Read the runs, draw the plots into ``out`` and write ``out/report.md``; returns its path."""
    runs = [load_run(path) for path in paths]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunFileError(f"--out {out} is a file; give a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)

    images = plots.draw_all(runs[-1], out)
    report = out / "report.md"
    report.write_text(render_markdown(runs, images))
    return report
