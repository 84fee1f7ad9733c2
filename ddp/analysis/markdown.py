"""``report.md``: tables and generated commentary from saved runs (``ddp.bench.records``), with
the figures of ``ddp.analysis.figures`` and the plots of ``ddp.analysis.plots``.

Nothing here reruns or parses printed output: every number comes from the JSON that
``--benchmark-json`` or ``--benchmark-save`` wrote. Time per step is the median round (one
training step on every rank, the slowest rank's time), shown with its 95% interval;
``comm_wait_seconds`` (from the last gradient backward produced to gradients synchronized) is the
communication the step could not hide, compute the rest. With several runs, the last one is
reported in full and every earlier one is compared with it, benchmark by benchmark.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from ddp.analysis import plots
from ddp.analysis.compare import compare
from ddp.analysis.figures import (
    BucketPlan,
    STRATEGY_ORDER,
    TORCH_FIRST_BUCKET_BYTES,
    Win,
    _strategy_rank,
    bucket_plans,
    config_label,
    configs,
    machine_differences,
    machine_summary,
    overheads_over_local,
    resolved_apart,
    winners,
)
from ddp.bench.records import Run, RunFileError, StepRecord, load_run
from ddp.strategies.bucketed import BYTES_PER_MB
from ddp.strategies.registry import BUCKETED_STRATEGIES

TABLE_FORMAT = "github"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / BYTES_PER_MB:.3g}"


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def _interval_ms(interval: list[float] | None) -> str:
    return "" if not interval else f"[{_ms(interval[0])}, {_ms(interval[1])}]"


def _table(rows: list, headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True)


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
    models = sorted({s.model for s in run.steps})
    if models:
        rows.append(["model", ", ".join(models)])
    return ["## Machine", "", _table(rows, ["", ""]), ""]


def _pivot(steps: list[StepRecord], cell) -> tuple[list, list[str]]:
    keys = configs(steps)
    with_model = len({k[0] for k in keys}) > 1
    labels = list(dict.fromkeys(s.label for s in sorted(steps, key=_strategy_rank)))
    by = {(s.label, s.config): s for s in steps}
    rows = [[label] + [cell(by[(label, k)]) if (label, k) in by else "" for k in keys] for label in labels]
    return rows, ["strategy"] + [config_label(k, with_model) for k in keys]


def step_section(run: Run) -> list[str]:
    steps = run.steps
    time_rows, headers = _pivot(steps, lambda s: f"{_ms(s.step_seconds)} {_interval_ms(s.step_seconds_ci95)}")
    share_rows, _ = _pivot(steps, lambda s: f"{_pct(s.comm_fraction)} ({_ms(s.comm_wait_seconds)} ms)")
    world = sorted({s.world_size for s in steps})
    return [
        f"## Time per step ({', '.join(map(str, world))} ranks; batch is per rank)",
        "",
        "Median step time, ms, with its 95% interval (one step on every rank, the slowest rank's time):",
        "",
        _table(time_rows, headers),
        "",
        "Communication share: the slowest rank's wait from its last gradient to gradients synchronized, "
        "as a share of its step (and in ms). For `local` it is the floor of the measurement.",
        "",
        _table(share_rows, headers),
        "",
    ]


def _tflops(step: StepRecord) -> str:
    if step.achieved_tflops is None:
        return ""
    mfu = "MFU -" if step.mfu is None else f"MFU {_pct(step.mfu)}"
    return f"{step.achieved_tflops:.3g} ({mfu})"


def flops_section(run: Run) -> list[str]:
    steps = [s for s in run.steps if s.achieved_tflops is not None]
    if not steps:
        return []
    rows, headers = _pivot(steps, _tflops)
    flops = sorted({(s.model, s.seq_len, s.model_flops_per_token) for s in steps})
    per_token = "; ".join(f"{model} at seq {seq}: {value / 1e9:.4g} GFLOP" for model, seq, value in flops)
    unknown = sorted({s.device for s in steps if s.mfu is None})
    return [
        "## Achieved TFLOP/s and MFU",
        "",
        "Model TFLOP/s per device: FLOPs per token (6 x matmul weights + 12 x layers x d_model x seq len, "
        f"forward and backward: {per_token}) x batch x seq len / step time. MFU divides by the device's dense peak "
        "in the step's precision (`ddp.bench.flops.PEAK_TFLOPS`)"
        + (f"; none is known for {', '.join(unknown)}, so MFU is not given there." if unknown else "."),
        "",
        _table(rows, headers),
        "",
    ]


def precision_section(run: Run) -> list[str]:
    """Per model, batch and seq len run in more than one precision: each strategy's step, overhead
    over local and exposed communication in every precision side by side, and how the ranking and
    the best bucket cap change."""
    steps = run.steps
    by_base = defaultdict(list)
    for s in steps:
        by_base[s.config[:3]].append(s)
    bases = [base for base, here in sorted(by_base.items()) if len({s.numerics for s in here}) > 1]
    if not bases:
        return []
    overhead = {id(o.step): o for o in overheads_over_local(steps)}
    with_model = len({base[0] for base in bases}) > 1
    lines = [
        "## By precision",
        "",
        "The same steps in each precision: median step (ms), overhead over `local` in the same precision (ms), "
        "and exposed communication (comm wait, ms). Reduced precision shrinks compute and not the gradients "
        "to all-reduce (unless communicated in bf16), so communication's share of the step grows.",
        "",
    ]
    for base in bases:
        here = by_base[base]
        numerics = [c[3] for c in configs(here)]
        labels = list(dict.fromkeys(s.label for s in sorted(here, key=_strategy_rank)))
        by = {(s.label, s.numerics): s for s in here}
        rows = []
        for label in labels:
            row = [label]
            for n in numerics:
                s = by.get((label, n))
                o = overhead.get(id(s)) if s is not None else None
                row += ["", "", ""] if s is None else [
                    _ms(s.step_seconds), "" if o is None else _ms(o.extra_seconds),
                    "" if s.strategy == "local" else _ms(s.comm_wait_seconds)]
            rows.append(row)
        headers = ["strategy"] + [f"{n}: {what}" for n in numerics for what in ("step", "over local", "exposed comm")]
        model, batch, seq = base
        title = f"batch {batch}, seq {seq}" if not with_model else f"{model}, batch {batch}, seq {seq}"
        lines += [f"**{title}**", "", _table(rows, headers), ""]
        for n in numerics:
            ranked = sorted((s for s in here if s.numerics == n and s.strategy != "local"), key=lambda s: s.step_seconds)
            if not ranked:
                continue
            best_caps = {}
            for s in ranked:
                if s.bucket_size_mb is not None:
                    best_caps.setdefault(s.label.replace(f" {s.bucket_size_mb:g} MB", ""), s.bucket_size_mb)
            order = " < ".join(f"{s.label} {_ms(s.step_seconds)}" for s in ranked)
            caps = ", ".join(f"{name} {cap:g} MB" for name, cap in best_caps.items())
            lines.append(f"- {n}: {order} (ms)" + (f"; best cap: {caps}" if caps else ""))
        lines.append("")
    return lines


def overhead_section(run: Run) -> list[str]:
    overheads = overheads_over_local(run.steps)
    if not overheads:
        return ["## Overhead over `local`", "", "No `local` benchmark in this run: nothing to measure overhead against.", ""]
    with_model = len({o.step.model for o in overheads}) > 1
    rows = [
        [config_label(o.step.config, with_model), o.step.label, _ms(o.local_seconds), _ms(o.step.step_seconds),
         f"{_ms(o.extra_seconds)} {_interval_ms(o.interval)}", f"{o.ratio:.3f}",
         {None: "unpaired", True: "yes", False: "not resolved"}[o.resolved]]
        for o in overheads
    ]
    return [
        "## Overhead over `local`",
        "",
        "`local` trains each rank's batch with no communication at all: the price of data parallelism is the rest. "
        "Where the run interleaved each round with one of `local`, the overhead is the median over rounds of the "
        "difference within a round, with its 95% interval; 'not resolved' means the interval includes 0.",
        "",
        _table(rows, ["config", "strategy", "local (ms)", "step (ms)", "overhead (ms) [95%]", "step / local", "resolved"]),
        "",
    ]


def bucket_section(run: Run) -> list[str]:
    steps = [s for s in run.steps if s.strategy in BUCKETED_STRATEGIES and s.bucket_size_mb is not None]
    if not steps:
        return []
    plans = {(p.strategy, p.bucket_size_mb): p for p in bucket_plans(steps)}
    keys = configs(steps)
    with_model = len({k[0] for k in keys}) > 1
    by = {(s.strategy, s.bucket_size_mb, s.grad_comm, s.config): s for s in steps}
    rows = []
    lines_of = sorted({(s.strategy, s.bucket_size_mb, s.grad_comm) for s in steps}, key=lambda k: (STRATEGY_ORDER.index(k[0]), k[2], k[1]))
    for strategy, cap, comm in lines_of:
        plan = plans.get((strategy, cap))
        name = strategy if comm == "fp32" else f"{strategy} {comm} comm"
        row = [name, f"{cap:g}", "" if plan is None else plan.num_buckets, "" if plan is None else plan.total_over_cap]
        row += [_ms(by[(strategy, cap, comm, k)].step_seconds) if (strategy, cap, comm, k) in by else "" for k in keys]
        rows.append(row)
    headers = ["strategy", "bucket cap (MB)", "buckets", "total / cap"] + [f"{config_label(k, with_model)} (ms)" for k in keys]
    return [
        "## By bucket size",
        "",
        "Median step time, ms, with the number of buckets each cap produced and the count that "
        "total gradient bytes / cap would suggest (see the commentary for why they differ).",
        "",
        _table(rows, headers),
        "",
    ]


def allreduce_section(run: Run) -> list[str]:
    if not run.allreduces:
        return []
    results = sorted(run.allreduces, key=lambda a: (a.backend, a.world_size, a.size_bytes))
    rows = [
        [a.backend, a.world_size, _mib(a.size_bytes), f"{a.seconds * 1e3:.3f}", f"{a.algbw_gbps:.3f}",
         f"{a.busbw_gbps:.3f}", a.wrong]
        for a in results
    ]
    return [
        "## All-reduce",
        "",
        "float32 sum, time of the slowest rank (median). algbw = size / time; busbw = algbw x 2(n-1)/n "
        "(as nccl-tests), comparable with link bandwidth whatever the number of ranks. GB/s = 10^9 bytes/s.",
        "",
        _table(rows, ["backend", "ranks", "size (MiB)", "time (ms)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"]),
        "",
    ]


def race_section(run: Run) -> list[str]:
    if not run.races:
        return []
    rows = []
    for r in run.races:
        times = r.median_step_seconds
        low, high = r.ratio_bucketed_over_torch_ci95
        rows.append(
            [r.model, f"{r.bucket_size_mb:g}", _ms(times.get("local")), _ms(times.get("bucketed")), _ms(times.get("torch")),
             f"{r.ratio_bucketed_over_torch:.3f} [{low:.3f}, {high:.3f}]", "yes" if high < 1 or low > 1 else "not resolved"]
        )
    return [
        "## Bucketed against PyTorch's DDP (alternating rounds)",
        "",
        "Both wrap the same model on the same ranks, one step of each per round in rotating order, so "
        "drift in the machine falls on both alike. bucketed / torch (median of the per-round ratios, 95% interval) "
        "below 1 means bucketed is faster.",
        "",
        _table(rows, ["model", "bucket cap (MB)", "local (ms)", "bucketed (ms)", "torch (ms)", "bucketed / torch", "resolved"]),
        "",
    ]


def others_section(run: Run) -> list[str]:
    if not run.others:
        return []
    rows = [[o.name, o.group or "", _ms(o.median_seconds)] for o in run.others]
    return [
        "## Other benchmarks",
        "",
        "Neither step nor all-reduce benchmarks (told apart by their extra_info): median only.",
        "",
        _table(rows, ["benchmark", "group", "median (ms)"]),
        "",
    ]


def _times(faster: StepRecord, slower: StepRecord) -> str:
    if not resolved_apart(faster, slower):
        return f"not resolved against {slower.label} ({_ms(slower.step_seconds)} ms: the 95% intervals overlap)"
    return (
        f"{slower.step_seconds / faster.step_seconds:.2f}x faster than {slower.label} "
        f"({_ms(slower.step_seconds)} ms, {_ms(slower.step_seconds - faster.step_seconds)} ms less per step)"
    )


def winner_sentence(win: Win, with_model: bool) -> str:
    w = win.winner
    text = f"**{config_label(win.config, with_model)}**: {w.label} is fastest at {_ms(w.step_seconds)} ms"
    margins = []
    if win.torch is not None and win.torch.strategy != w.strategy:
        margins.append(_times(w, win.torch))
    elif win.runner_up is not None:
        margins.append(_times(w, win.runner_up))
    if win.naive is not None and win.naive.strategy != w.strategy:
        margins.append(_times(w, win.naive))
    return text + (": " + "; ".join(margins) if margins else "") + "."


def plan_sentence(plan: BucketPlan) -> str:
    text = (
        f"- {plan.strategy}, cap {plan.bucket_size_mb:g} MB: **{plan.num_buckets} bucket(s)** for "
        f"{_mib(plan.total_bytes)} MiB of gradients (total / cap = {plan.total_over_cap})"
    )
    if plan.bucket_sizes_bytes is not None:
        sizes = [float(_mib(size)) for size in plan.bucket_sizes_bytes]
        listed = ", ".join(f"{s:g}" for s in sizes[:12]) + (f", ... ({len(sizes) - 12} more)" if len(sizes) > 12 else "")
        text += f"; sizes in launch order, MiB: {listed}"
        if plan.oversized_buckets and plan.strategy == "torch":
            text += (
                f"; {plan.oversized_buckets} bucket(s) exceed the cap (PyTorch closes a bucket once it has "
                "reached the cap, not before the tensor that would overflow it)"
            )
        elif plan.oversized_buckets:
            text += f"; {plan.oversized_buckets} bucket(s) hold a single tensor larger than the cap"
    torch_first = plan.strategy == "torch" and plan.bucket_size_mb * BYTES_PER_MB < TORCH_FIRST_BUCKET_BYTES
    if plan.num_buckets < plan.total_over_cap:
        if torch_first and plan.total_bytes <= TORCH_FIRST_BUCKET_BYTES:
            text += (
                ". Fewer than total / cap: every gradient fits in PyTorch's first bucket, which DDP fills up "
                "to 1 MiB whatever bucket_cap_mb says"
            )
        else:
            text += ". Fewer than total / cap: some buckets hold more than the cap"
            if plan.strategy != "torch":
                text += ", a tensor larger than the cap in a bucket of its own"
            if torch_first:
                text += " (and PyTorch's first bucket, filled up to 1 MiB whatever bucket_cap_mb says)"
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
        parts.append(f"the 95% intervals of the medians are +-{_pct(spread)} wide (median over benchmarks)")
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
    with_model = len({w.config[0] for w in wins}) > 1
    if wins:
        counts = defaultdict(int)
        for win in wins:
            counts[win.winner.strategy] += 1
        tally = ", ".join(f"{name} at {n} of {len(wins)}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines += [f"Fastest data-parallel strategy per configuration: {tally}.", ""]
        lines += [f"- {winner_sentence(win, with_model)}" for win in wins]
        lines.append("")
    exposed = [s for s in steps if s.strategy != "local"]
    if exposed:
        worst = max(exposed, key=lambda s: s.comm_wait_seconds)
        share = max(exposed, key=lambda s: s.comm_fraction)
        text = (
            f"Largest exposed communication: {worst.label} at {config_label(worst.config, with_model)} waits "
            f"{_ms(worst.comm_wait_seconds)} ms per step for its gradients ({_pct(worst.comm_fraction)} of the step)"
        )
        if share is not worst:
            text += (
                f"; the largest share is {share.label} at "
                f"{config_label(share.config, with_model)}: {_pct(share.comm_fraction)} ({_ms(share.comm_wait_seconds)} ms)"
            )
        local = [s.comm_wait_seconds for s in steps if s.strategy == "local"]
        if local:
            text += f". `local`, with nothing to wait for, measures up to {_ms(max(local))} ms: the floor of this figure"
        lines += [text + ".", ""]
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


# The threshold a report's comparison judges against, as `ddp compare`'s default.
COMPARISON_THRESHOLD = 0.10


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
    rows = compare(old, new, COMPARISON_THRESHOLD)
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
        summary += " Against a threshold of " + f"{COMPARISON_THRESHOLD:.0%}: " + ", ".join(f"{n} {v}" for v, n in verdicts.items()) + "."
    body = [
        [r.name, _ms(r.old_seconds) or "absent", _ms(r.new_seconds) or "absent", "" if r.ratio is None else f"{r.ratio:.3f}",
         "" if r.ratio_ci95 is None else f"[{r.ratio_ci95[0]:.3f}, {r.ratio_ci95[1]:.3f}]", r.verdict, r.basis]
        for r in rows
    ]
    lines += [
        "Matched by benchmark name, as `ddp compare` does: new / old below 1 means the new run is faster, with a "
        "95% interval over both runs' rounds, taken on each round's step / local where both runs interleaved them "
        "(basis). " + summary,
        "",
        _table(body, ["benchmark", "old (ms)", "new (ms)", "new / old", "95% interval", "verdict", "basis"]),
        "",
    ]
    return lines


def render_markdown(runs: list[Run], images: list[Path]) -> str:
    """report.md for ``runs`` (the last reported in full, the earlier ones compared with it)."""
    run = runs[-1]
    lines = ["# ddp-bench report", ""]
    lines += [f"> {note}" for earlier in runs for note in earlier.notes]
    lines += [""] if any(r.notes for r in runs) else []
    lines += header_section(run)
    if run.steps:
        lines += commentary_section(run)
    for old in runs[:-1]:
        lines += comparison_section(old, run)
    if run.steps:
        lines += step_section(run)
        lines += precision_section(run)
        lines += flops_section(run)
        lines += overhead_section(run)
        lines += bucket_section(run)
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
