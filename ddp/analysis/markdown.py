"""``report.md``: its sections and tables from saved runs (``ddp.bench.records``), with the
figures of ``ddp.analysis.figures``, the commentary of ``ddp.analysis.commentary``, the comparison
of ``ddp.analysis.compare`` and the plots of ``ddp.analysis.plots``.

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

from ddp.analysis import plots
from ddp.analysis.commentary import commentary_section
from ddp.analysis.compare import compare
from ddp.analysis.compare import table as comparison_table
from ddp.analysis.figures import (
    _strategy_rank,
    bucket_plans,
    config_label,
    configs,
    machine_differences,
    machine_summary,
    overheads_over_local,
    sorted_steps,
    strategy_rank,
)
from ddp.analysis.sharding import FIT_WORLD_SIZES, H100_BYTES, LEVELS, MEASURED_HEADERS, fit_rows, measured_memory_rows
from ddp.analysis.tables import interval_ms, mib, ms, pct, ratio_interval, table
from ddp.bench.records import Run, RunFileError, StepRecord, load_run

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
    time_rows, headers = _pivot(steps, lambda s: f"{ms(s.step_seconds)} {interval_ms(s.step_seconds_ci95)}")
    share_rows, _ = _pivot(steps, lambda s: f"{pct(s.comm_fraction)} ({ms(s.comm_wait_seconds)} ms)")
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
    mfu = "MFU -" if step.mfu is None else f"MFU {pct(step.mfu)}"
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
                    ms(s.step_seconds), "" if o is None else ms(o.extra_seconds),
                    "" if s.strategy == "local" else ms(s.comm_wait_seconds)]
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
            order = " < ".join(f"{s.label} {ms(s.step_seconds)}" for s in ranked)
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
        [config_label(o.step.config, with_model), o.step.label, ms(o.local_seconds), ms(o.step.step_seconds),
         f"{ms(o.extra_seconds)} {interval_ms(o.interval)}", f"{o.ratio:.3f}",
         {None: "unpaired", True: "yes", False: "not resolved"}[o.resolved]]
        for o in overheads
    ]
    return section(
        "Overhead over `local`",
        "`local` trains each rank's batch with no communication at all: the price of data parallelism is the rest. "
        "Where the run interleaved each round with one of `local`, the overhead is the median over rounds of the "
        "difference within a round, with its 95% interval; 'not resolved' means the interval includes 0.",
        rows, ["config", "strategy", "local (ms)", "step (ms)", "overhead (ms) [95%]", "step / local", "resolved"],
    )


def memory_section(run: Run) -> list[str]:
    rows = measured_memory_rows(run.steps)
    if not rows:
        return []
    return [
        "## Memory per rank",
        "",
        "The state each strategy holds on its most loaded rank, counted as distinct tensor storages after "
        "gradients are synchronized (`ddp.bench.state_bytes`; the same count on CPU and CUDA), beside the formula of "
        "what it shards (fp32 weights, gradients, AdamW's two moments: replicated 4 + 4 + 8 bytes a parameter, "
        "ZeRO-1 4 + 4 + 8/N, full sharding 16/N). Activations and communication buffers are not state: on "
        "CUDA the allocator's peak over the same step shows them.",
        "",
        _table(rows, MEASURED_HEADERS),
        "",
    ]


def sharding_section(run: Run) -> list[str]:
    """Which model fits at which world size, and what the run measured sharding to cost."""
    sharded = [s for s in run.steps if s.memory_formula not in (None, "4 + 4 + 8")]
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
    # against bucketed where the run has it (sharded_optimizer and fsdp reuse its machinery), else PyTorch's DDP
    replicated = {s.config: s for s in sorted_steps(run.steps)[::-1] if s.strategy in ("bucketed", "torch")}
    costs = []
    for step in sorted_steps(sharded):
        reference = replicated.get(step.config)
        if reference is not None and step.parameters_bytes and reference.parameters_bytes:
            held = sum(step.parameters_bytes + step.gradients_bytes + step.optimizer_state_bytes)
            held_reference = sum(reference.parameters_bytes + reference.gradients_bytes + reference.optimizer_state_bytes)
            costs.append([config_label(step.config, False), step.label, reference.label,
                          f"{step.step_seconds / reference.step_seconds:.2f}", f"{held / held_reference:.2f}"])  # fmt: skip
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
    steps = [s for s in run.steps if s.bucket_size_mb is not None]
    if not steps:
        return []
    plans = {(p.strategy, p.bucket_size_mb): p for p in bucket_plans(steps)}
    keys = configs(steps)
    with_model = len({k[0] for k in keys}) > 1
    by = {(s.strategy, s.bucket_size_mb, s.grad_comm, s.config): s for s in steps}
    rows = []
    lines_of = sorted({(s.strategy, s.bucket_size_mb, s.grad_comm) for s in steps}, key=lambda k: (strategy_rank(k[0], k[1]), k[2]))
    for strategy, cap, comm in lines_of:
        plan = plans.get((strategy, cap))
        name = strategy if comm == "fp32" else f"{strategy} {comm} comm"
        row = [name, f"{cap:g}", "" if plan is None else plan.num_buckets, "" if plan is None else plan.total_over_cap]
        row += [ms(by[(strategy, cap, comm, k)].step_seconds) if (strategy, cap, comm, k) in by else "" for k in keys]
        rows.append(row)
    headers = ["strategy", "bucket cap (MB)", "buckets", "total / cap"] + [f"{config_label(k, with_model)} (ms)" for k in keys]
    return section(
        "By bucket size",
        "Median step time, ms, with the number of buckets each cap produced and the count that "
        "total gradient bytes / cap would suggest (see the commentary for why they differ).",
        rows, headers,
    )


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
        rows, ["backend", "ranks", "size (MiB)", "time (ms)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"],
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
            [name, ms(r.median_step_seconds[name]), interval_ms(r.median_step_seconds_ci95[name]),
             "reference" if name == r.reference else (
                 f"{r.ratio_over_reference[name]:.3f} {ratio_interval(r.ratio_over_reference_ci95[name])}"
                 if name in r.ratio_over_reference else ""),
             "" if name not in r.ratio_over_reference else (
                 "yes" if r.ratio_over_reference_ci95[name][1] < 1 or r.ratio_over_reference_ci95[name][0] > 1 else "not resolved")]
            for name in r.contenders
        ]
        cap = "" if r.bucket_size_mb is None else f", bucket cap {r.bucket_size_mb:g} MB"
        lines += [f"Model {r.model}{cap}, {r.world_size} ranks:", "",
                  _table(rows, ["strategy", "median (ms)", "95% interval", f"step / {r.reference} [95%]", "resolved"]), ""]
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
        lines += memory_section(run)
        lines += sharding_section(run)
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
