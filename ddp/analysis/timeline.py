"""Timeline figures of profiled steps, drawn from the JSON that ``ddp profile`` saves.

Per rank, two rows: compute (forward, backward up to its last gradient, waiting for gradient
synchronization, optimizer) and communication (each collective from launch to completion;
overlapping ones darken). A collective bar under a backward bar is communication hidden behind
compute; one under the gray "waiting" bar is exposed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on benchmark hosts

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

PHASE_COLORS = {
    "accumulate": "tab:purple",
    "forward": "tab:blue",
    "backward": "tab:orange",
    "gradient_sync": "lightgray",  # waiting for gradients: finish_gradient_synchronization, or DDP's reducer
    "optimizer": "tab:green",
}
LEGEND_LABELS = {
    "accumulate": "micro-batches before the last (no_sync)",
    "forward": "forward",
    "backward": "backward (to the last gradient)",
    "gradient_sync": "waiting for gradient sync",
    "optimizer": "optimizer",
}
COMM_COLOR = "tab:red"
ROW_HEIGHT = 0.8


def title(record: dict) -> str:
    if record["overlap_fraction"] is None:
        return f"{record['strategy']}: no communication"
    return (
        f"{record['strategy']}: overlap_fraction {record['overlap_fraction']:.2f}, "
        f"comm {record['comm_seconds'] * 1e3:.0f} ms/step, "
        f"exposed {record['exposed_comm_seconds'] * 1e3:.0f} ms/step (rank {record['slowest_rank']})"
    )


def draw(ax, record: dict) -> None:
    """One strategy's rows on ``ax``: rank 0 at the top, compute above communication."""
    labels = []
    rows = 2 * len(record["ranks"])
    for index, rank in enumerate(record["ranks"]):
        compute_y = rows - 1 - 2 * index
        comm_y = compute_y - 1
        labels += [(compute_y, f"rank {rank['rank']} compute"), (comm_y, f"rank {rank['rank']} comm")]
        for step in rank["steps"]:
            # After the last gradient, the rest of loss.backward() is waiting (PyTorch's reducer
            # waits for its buckets there), drawn as gradient_sync is.
            backward_start, backward_end = step["backward"]
            compute_end = step["backward_compute_end"]
            spans = {
                "accumulate": [step["accumulate"]] if "accumulate" in step else [],
                "forward": [step["forward"]],
                "backward": [(backward_start, compute_end)],
                "gradient_sync": [(compute_end, backward_end), step["gradient_sync"]],
                "optimizer": [step["optimizer"]],
            }
            for phase, intervals in spans.items():
                ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in intervals if e > s],
                               (compute_y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolors=PHASE_COLORS[phase],
                               edgecolor="none")
            comm = [(c["launch_seconds"] * 1e3, (c["done_seconds"] - c["launch_seconds"]) * 1e3)
                    for c in step["collectives"]]
            if comm:
                # A thin edge keeps collectives that were over in microseconds visible.
                ax.broken_barh(comm, (comm_y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolors=COMM_COLOR,
                               alpha=0.3, edgecolor=COMM_COLOR, linewidth=0.5)
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_title(title(record), fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _legend(fig, records: list[dict]) -> None:
    """The phases drawn (``accumulate`` only where a step accumulated) and the collectives."""
    accumulated = any("accumulate" in step for r in records for rank in r["ranks"] for step in rank["steps"])
    handles = [Patch(color=color, label=LEGEND_LABELS[phase]) for phase, color in PHASE_COLORS.items()
               if phase != "accumulate" or accumulated]
    handles.append(Patch(color=COMM_COLOR, alpha=0.5, label="collective in flight"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)


def plot_timeline(record: dict, path: Path) -> Path:
    """One strategy's timeline as a PNG at ``path``."""
    fig, ax = plt.subplots(figsize=(12, 0.7 * 2 * len(record["ranks"]) + 1.6))
    draw(ax, record)
    ax.set_xlabel("time since the first profiled step began (ms)")
    _legend(fig, [record])
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timelines(records: list[dict], path: Path) -> Path:
    """Several strategies stacked on one time axis, so their step lengths compare directly."""
    heights = [2 * len(r["ranks"]) for r in records]
    fig, axes = plt.subplots(len(records), 1, sharex=True, figsize=(12, 0.55 * sum(heights) + 1.2 * len(records)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, record in zip(axes[:, 0], records):
        draw(ax, record)
    axes[-1, 0].set_xlabel("time since the first profiled step began (ms)")
    _legend(fig, records)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
