"""The report's PNG plots, drawn with matplotlib (Agg, no display) from a loaded run
(``ddp.bench.results.records``), every median with its 95% interval as an error bar.

- ``report_step_vs_bucket_seq{N}.png``: step time against bucket cap, one figure per sequence
  length, one line per batch size and bucketing strategy (in the strategy's own ``line_style``:
  bucketed solid, torch dashed), with ``local`` as the floor;
- ``report_compute_vs_comm.png``: per configuration, each strategy's step split into compute and
  exposed communication (``exposed_comm_seconds``), stacked;
- ``report_collective_timeline.png``: the collectives of the heaviest configuration, a panel per
  strategy: ready, launched, done, from backward's end (``ddp.analysis.collectives``);
- ``report_allreduce.png``: all-reduce time and bus bandwidth against size, one line per backend
  and world size.

Each function returns the path it wrote, or None when the run holds nothing to draw.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

from ddp.analysis import collectives  # noqa: E402
from ddp.analysis.costmodel import Prediction  # noqa: E402
from ddp.analysis.figures import groups, several_models, sorted_steps, step_order  # noqa: E402
from ddp.bench.config.step_config import AXES  # noqa: E402
from ddp.bench.results.records import Run, strategy_label  # noqa: E402
from ddp.strategies.bucketed import BYTES_PER_MB  # noqa: E402
from ddp.strategies.registry import FLOOR, traits  # noqa: E402

DPI = 100  # keeps each PNG well under 200 KB


def _yerr_ms(steps) -> list[list[float]] | None:
    """Error bars from each step's 95% interval of its median, in ms below and above it (0 where a
    two-level interval, ``ddp.bench.results.stats.median_interval``, lies wholly on one side of the median)."""
    if not all(s.step_seconds_ci95 for s in steps):
        return None
    return [
        [max(0.0, s.step_seconds - s.step_seconds_ci95[0]) * 1e3 for s in steps],
        [max(0.0, s.step_seconds_ci95[1] - s.step_seconds) * 1e3 for s in steps],
    ]


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def plot_step_vs_bucket(run: Run, seq_len: int, path: Path, variant: str | None = None) -> Path | None:
    """Step time against bucket cap at ``seq_len`` (and, where the run has several, one ``variant``
    of the options: each gets its own figure, so that every line stays readable)."""
    steps = [s for s in run.steps if s.config.seq_len == seq_len and variant in (None, s.config.variant)]
    bucketed = [s for s in steps if s.config.bucket_size_mb is not None]
    if not bucketed:
        return None
    figure, axes = plt.subplots(figsize=(9.0, 4.2))
    # one colour per group (a batch size, ...), ``local`` its floor; within it one line per strategy
    # and its members other than the cap (bf16 communication), in the strategy's own line style
    # (bucketed solid, torch dashed), each with a marker of its own
    keys = groups(bucketed)
    colors = {key: f"C{i}" for i, key in enumerate(keys)}
    names = list(dict.fromkeys(_line_name(s) for s in sorted(bucketed, key=step_order)))
    markers = {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(names)}
    for key in keys:
        suffix = _varying_label(key, keys)
        lines: dict[str, list] = {}
        for s in sorted((s for s in bucketed if s.group == key), key=step_order):
            lines.setdefault(_line_name(s), []).append(s)
        for name, line in lines.items():
            line.sort(key=lambda s: s.config.bucket_size_mb)
            axes.errorbar(
                [s.config.bucket_size_mb for s in line],
                [s.step_seconds * 1e3 for s in line],
                yerr=_yerr_ms(line),
                capsize=3,
                linestyle=traits(line[0].strategy).line_style,
                marker=markers[name],
                color=colors[key],
                label=f"{name}{suffix}",
            )
        local = [s for s in steps if s.group == key and s.strategy == FLOOR]
        if local:
            axes.axhline(local[0].step_seconds * 1e3, color=colors[key], linestyle=traits(FLOOR).line_style,
                         linewidth=1, label=f"{FLOOR}{suffix}")
    axes.set_xscale("log")
    caps = sorted({s.config.bucket_size_mb for s in bucketed})
    axes.set_xticks(caps, [f"{cap:g}" for cap in caps])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)  # differences between caps read against the whole step
    axes.set_xlabel("bucket cap (MiB)")
    axes.set_ylabel("step time, median (ms)")
    models = ", ".join(sorted({s.config.model for s in steps}))
    axes.set_title(f"Step time against bucket cap: model {models}, seq len {seq_len}" + (f", {variant}" if variant else ""),
                   fontsize="medium")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.grid(True, which="both", alpha=0.3)
    return _save(figure, path)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _line_name(step) -> str:
    """A line of step against bucket cap: the strategy with its members other than the cap (``torch bf16 comm``)."""
    members = [AXES[name].text(value) for name, value in step.config.values().items()
               if name in AXES and AXES[name].role == "member" and name != "bucket_size_mb" and value != AXES[name].default]
    return " ".join([step.strategy, *members])


def _varying_label(key, keys) -> str:
    """``, batch 4``: the group's values of the axes that differ between the figure's groups."""
    varying = [name for name, axis in AXES.items() if axis.role in ("workload", "option")
               and len({getattr(k, name) for k in keys}) > 1]
    return "".join(f", {AXES[name].text(getattr(key, name))}" for name in varying)


def plot_compute_vs_comm(run: Run, path: Path) -> Path | None:
    keys = groups(run.steps)
    if not keys:
        return None
    with_model = several_models(run.steps)
    columns = min(2, len(keys))
    rows = (len(keys) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        steps = sorted_steps([s for s in run.steps if s.group == key])
        labels = [s.label for s in steps]
        compute = [s.compute_seconds * 1e3 for s in steps]
        comm = [s.waited_seconds * 1e3 for s in steps]
        ax.bar(labels, compute, color="C0", label="the rest of the step")
        ax.bar(labels, comm, bottom=compute, color="C3", label="exposed communication (its share of the traced steps)")
        ax.set_title(key.group_label(with_model))
        ax.set_ylabel("median step (ms), split by\nthe traced steps' shares")
        ax.tick_params(axis="x", labelrotation=45, labelsize="small")
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    figure.suptitle("Compute against exposed communication per strategy")
    return _save(figure, path)


def plot_allreduce(run: Run, path: Path) -> Path | None:
    if not run.allreduces:
        return None
    figure, (time_axes, bw_axes) = plt.subplots(1, 2, figsize=(11, 4.0))
    for backend, world_size in sorted({(a.backend, a.world_size) for a in run.allreduces}):
        line = sorted((a for a in run.allreduces if (a.backend, a.world_size) == (backend, world_size)), key=lambda a: a.size_bytes)
        sizes = [a.size_bytes / BYTES_PER_MB for a in line]
        label = f"{backend}, {world_size} ranks"
        time_axes.plot(sizes, [a.seconds * 1e3 for a in line], marker="o", label=label)
        bw_axes.plot(sizes, [a.busbw_gbps for a in line], marker="o", label=label)
    time_axes.set_yscale("log")
    time_axes.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    time_axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    time_axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    time_axes.set_ylabel("time, slowest rank, median (ms)")
    bw_axes.set_ylabel("busbw (GB/s)")
    bw_axes.set_ylim(bottom=0)
    sizes = sorted({a.size_bytes / BYTES_PER_MB for a in run.allreduces})
    for ax, title in ((time_axes, "All-reduce time"), (bw_axes, "All-reduce bus bandwidth")):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{size:g}" for size in sizes])
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("size (MiB, float32)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return _save(figure, path)


def plot_collective_timeline(run: Run, path: Path) -> Path | None:
    """The collectives of the report's detailed group (``ddp.analysis.collectives.detail_group``),
    a panel per strategy on one time axis from backward's end: each collective's wait from ready
    to launch (thin) and flight from launch to done (thick; red where it holds exposed time, the
    tail outlined), backward shaded."""
    detail = collectives.detail_group(run.steps)
    if detail is None:
        return None
    steps = collectives.with_collectives([s for s in run.steps if s.group == detail])
    heights = [max(1.0, min(4.0, 0.12 * len(s.collectives.collectives))) for s in steps]
    figure, axes = plt.subplots(len(steps), 1, figsize=(9.0, 1.0 + sum(heights)), sharex=True, squeeze=False,
                                gridspec_kw={"height_ratios": heights})
    for ax, step in zip(axes.flat, steps):
        trace = step.collectives
        ax.axvspan(trace.backward_start_seconds * 1e3, 0.0, color="0.92", label="backward's computation")
        ax.axvline(0.0, color="0.3", linewidth=1.0)
        for y, c in enumerate(trace.collectives):
            if c.ready_seconds is not None and c.ready_seconds < c.launch_seconds:
                ax.hlines(y, c.ready_seconds * 1e3, c.launch_seconds * 1e3, color="0.55", linewidth=1.0)
            exposed = c.exposed_seconds >= collectives.LISTED_EXPOSED_SECONDS
            ax.barh(y, (c.done_seconds - c.launch_seconds) * 1e3, left=c.launch_seconds * 1e3, height=0.7,
                    color="C3" if exposed else "C0", edgecolor="black" if c.label == trace.tail else "none")
        ax.set_yticks([])
        ax.set_ylabel(step.label, rotation=0, ha="right", va="center", fontsize="small")
        ax.invert_yaxis()
    axes.flat[-1].set_xlabel("ms from the end of backward's computation (slowest rank, median of the traced steps)")
    figure.suptitle(f"Collectives of {detail.group_label(several_models(run.steps))}: ready to launch (grey), in flight "
                    "(red: holds exposed time; outlined: the tail)", fontsize="medium")
    return _save(figure, path)


def draw_all(run: Run, out: Path) -> list[Path]:
    """Every plot the run has data for, written into ``out``."""
    variants = list(dict.fromkeys(g.variant for g in groups(run.steps)))
    drawn = []
    for seq in sorted({s.config.seq_len for s in run.steps}):
        if len(variants) == 1:
            drawn.append(plot_step_vs_bucket(run, seq, out / f"report_step_vs_bucket_seq{seq}.png"))
        else:
            drawn += [plot_step_vs_bucket(run, seq, out / f"report_step_vs_bucket_seq{seq}_{variant.replace(' ', '_')}.png", variant)
                      for variant in variants]
    drawn.append(plot_compute_vs_comm(run, out / "report_compute_vs_comm.png"))
    drawn.append(plot_collective_timeline(run, out / "report_collective_timeline.png"))
    drawn.append(plot_allreduce(run, out / "report_allreduce.png"))
    return [path for path in drawn if path is not None]


def plot_scaling(predictions: list[Prediction], path: Path, title: str) -> None:
    """Step time against world size (log x), one line per strategy and bucket size, per batch."""
    workloads = sorted({(p.batch_size, p.seq_len) for p in predictions})
    figure, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
    for axis, (batch_size, seq_len) in zip(axes[0], workloads):
        lines = defaultdict(list)
        for p in predictions:
            if (p.batch_size, p.seq_len) == (batch_size, seq_len):
                lines[strategy_label(p.strategy, p.bucket_size_mb)].append((p.world_size, p.step_seconds * 1e3))
        for label, points in sorted(lines.items()):
            points.sort()
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("world size (ranks)")
        axis.set_ylabel("predicted step time (ms)")
        axis.set_title(f"batch {batch_size} per rank, seq len {seq_len}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
