"""``python -m ddp simulate``: predict one training step's time at other world sizes, from a
measured run.

    python -m ddp simulate --from RUN.json --world-sizes 2,8,64,1024 --json OUT.json [--link ib-400g]

The model has three parts, each calibrated on the run (RUN.json, pytest-benchmark JSON from
perf_tests/ or ``ddp run``) or given:

**Link.** One all-reduce of ``b`` bytes on ``n`` ranks takes (Hockney's alpha-beta model of a
ring all-reduce, the algorithm nccl-tests' busbw is defined for)::

    t(b, n) = alpha * steps(n) + b * 2(n-1)/n / busbw          steps(n) = 2(n-1) for a ring,
                                                                          2 ceil(log2 n) for a tree

``alpha`` (seconds per step) and ``busbw`` (bytes/s) are fitted by least squares on the run's
all-reduce microbenchmark rows (``extra_info`` ``size_bytes``, ``world_size``, ``stats.median``),
or taken from ``--link`` (``LINKS``, sources cited there). The tree only changes the latency
term (NCCL's trees reach about the ring's bus bandwidth on large messages).

**Compute.** A step without communication is the run's ``local`` row at the same batch and
sequence length (its median step). Backward takes ``2/3`` of the part that is not optimizer
(backward does two matmuls per forward matmul: the gradients of the input and of the weight),
and ``--optimizer-fraction`` of the step is the optimizer (default 0: for the models here AdamW
is a few per cent of a step, and it runs after gradient synchronization either way, so it only
shifts where backward starts).

**When gradients are ready.** Backward runs through the parameters in reverse registration
order (ddp/model.py registers them in forward order). A parameter's gradient is ready once the
backward FLOPs of everything after it and of itself are done; a weight used in a matmul costs
FLOPs in proportion to its size (4 x numel per token in backward, as ``model_flops_per_token``
counts), attention's own products (8 x d_model x seq_len per token per layer in backward) are
charged just before the block's q/k/v weights, and embedding and RMSNorm weights cost nothing.

**Strategies.** One communication channel, all-reduces serialized in launch order (as on one
NCCL communicator, or gloo's one pair of connections per rank pair):

- ``naive``: after backward, one all-reduce per parameter, one after the other;
- ``flat``: after backward, one all-reduce of all gradient bytes;
- ``overlap``: one all-reduce per parameter, launched when its gradient is ready;
- ``bucketed`` and ``torch``: the buckets of ``ddp.bucketed.plan_buckets`` (the same rule, on
  the model's parameters built on the meta device), each launched when its last gradient is
  ready and its predecessors were launched. (PyTorch's DDP plans a 1 MiB first bucket and then
  re-plans by observed order; the same plan for both is an approximation.)

``exposed_comm_seconds`` is what communication adds after backward ends (the last all-reduce's
end minus the end of backward); ``step_seconds`` = compute + exposed.

**Communication that competes with compute** (``--overlap-slowdown``). On GPUs NCCL runs beside
the compute kernels and overlapped communication costs little. With gloo on CPU the all-reduce
runs on the same cores as backward: communication hidden under backward still delays it. The
model charges ``overlap_slowdown`` x (communication overlapped with backward) to the step;
its default is 1 when the run was gloo on CPU (the communication thread takes the core the
rank's compute would use) and 0 otherwise. It is an assumption stated up front, not fitted to
the validation rows.

**Validation.** For every step row of the run, the prediction at the run's world size is put
next to the measured median (``validation_rows``): the model is trusted at other world sizes
only as far as it matches here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tabulate import tabulate

import ddp
from ddp.bucketed import plan_buckets
from ddp.model import MODEL_SIZES, build_model

ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True)
class Link:
    """The alpha-beta cost of an all-reduce (see the module docstring)."""

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
        gradients.append(Gradient(name, param.numel() * param.element_size(), flops))
    return gradients


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


def bucket_launches(
    gradients: list[Gradient], ready: list[float], bucket_size_mb: float, link: Link, world_size: int
) -> list[tuple[float, float]]:
    """``(ready, duration)`` of each bucket of ``plan_buckets``' plan, in launch order."""

    class _Sized:  # what plan_buckets reads of a parameter
        def __init__(self, index: int, size_bytes: int) -> None:
            self.index, self._bytes = index, size_bytes
            self.dtype, self.device = "float32", "meta"

        def numel(self) -> int:
            return self._bytes

        def element_size(self) -> int:
            return 1

    plan = plan_buckets([_Sized(i, g.size_bytes) for i, g in enumerate(gradients)], bucket_size_mb)
    launches = []
    for bucket in plan:
        size_bytes = sum(p._bytes for p in bucket) + 4 * len(bucket)  # ddp/bucketed.py's flags
        launches.append((max(ready[p.index] for p in bucket), link.allreduce_seconds(size_bytes, world_size)))
    return launches


@dataclass(frozen=True)
class Prediction:
    strategy: str
    bucket_size_mb: float | None
    batch_size: int
    seq_len: int
    world_size: int
    step_seconds: float
    exposed_comm_seconds: float
    comm_seconds: float
    """All-reduce time of the step on the channel, hidden or not."""
    num_allreduces: int


@dataclass(frozen=True)
class Compute:
    """One configuration's step without communication, and how it splits."""

    step_seconds: float
    optimizer_fraction: float = 0.0

    @property
    def backward_seconds(self) -> float:
        return self.step_seconds * (1.0 - self.optimizer_fraction) * 2.0 / 3.0


def predict_step(
    strategy: str,
    bucket_size_mb: float | None,
    compute: Compute,
    gradients: list[Gradient],
    link: Link,
    world_size: int,
    overlap_slowdown: float = 0.0,
) -> tuple[float, float, float, int]:
    """``(step_seconds, exposed_comm_seconds, comm_seconds, num_allreduces)`` of one step."""
    backward = compute.backward_seconds
    ready = ready_times(gradients, backward)
    if strategy == "local" or world_size <= 1:
        return compute.step_seconds, 0.0, 0.0, 0
    if strategy == "naive":
        launches = [(backward, link.allreduce_seconds(g.size_bytes, world_size)) for g in gradients]
    elif strategy == "flat":
        launches = [(backward, link.allreduce_seconds(sum(g.size_bytes for g in gradients), world_size))]
    elif strategy == "overlap":
        launches = [(r, link.allreduce_seconds(g.size_bytes, world_size)) for r, g in zip(ready, gradients)]
    elif strategy in ddp.BUCKETED_STRATEGIES:
        launches = bucket_launches(gradients, ready, bucket_size_mb, link, world_size)
    else:
        raise ValueError(f"no model of strategy {strategy!r}; simulate knows local, {', '.join(ddp.DDP_STRATEGIES)}")
    comm = sum(duration for _, duration in launches)
    exposed = max(0.0, channel_end(launches) - backward)
    hidden = comm - exposed
    return compute.step_seconds + exposed + overlap_slowdown * hidden, exposed, comm, len(launches)


@dataclass
class Run:
    """What simulate reads from a saved run."""

    model_size: str
    world_size: int
    backend: str
    device: str
    steps: list[dict]
    """extra_info of each step row, with ``median_seconds`` added."""
    allreduce: list[tuple[int, int, float]]
    """(size_bytes, world_size, median seconds) of each all-reduce row."""

    def local_seconds(self) -> dict[tuple[int, int], float]:
        return {(s["batch_size"], s["seq_len"]): s["median_seconds"] for s in self.steps if s["strategy"] == "local"}


def load_run(path: Path, statistic: str = "median") -> Run:
    """Step and all-reduce rows of a saved run, each timed by ``statistic`` of its rounds."""
    data = json.loads(Path(path).read_text())
    steps, allreduce = [], []
    for bench in data.get("benchmarks", []):
        extra, median = bench.get("extra_info", {}), bench["stats"][statistic]
        if "size_bytes" in extra:
            allreduce.append((int(extra["size_bytes"]), int(extra["world_size"]), float(median)))
        elif "strategy" in extra:
            steps.append({**extra, "median_seconds": float(median)})
    if not steps:
        raise SystemExit(f"{path} holds no step benchmarks (perf_tests/test_step.py or `ddp run` rows)")
    sizes = {s["model_size"] for s in steps}
    worlds = {s["world_size"] for s in steps}
    if len(sizes) != 1 or len(worlds) != 1:
        raise SystemExit(f"{path} mixes model sizes {sorted(sizes)} or world sizes {sorted(worlds)}; give one run of one model")
    first = steps[0]
    return Run(first["model_size"], first["world_size"], first["backend"], first["device"], steps, allreduce)


def predict_grid(
    model_size: str,
    computes: dict[tuple[int, int], Compute],
    strategies: list[tuple[str, float | None]],
    world_sizes: list[int],
    link: Link,
    overlap_slowdown: float,
) -> list[Prediction]:
    predictions = []
    for (batch_size, seq_len), compute in sorted(computes.items()):
        gradients = gradients_in_backward_order(model_size, seq_len)
        for world_size in world_sizes:
            for strategy, bucket_size_mb in strategies:
                step, exposed, comm, calls = predict_step(
                    strategy, bucket_size_mb, compute, gradients, link, world_size, overlap_slowdown
                )
                predictions.append(
                    Prediction(strategy, bucket_size_mb, batch_size, seq_len, world_size, step, exposed, comm, calls)
                )
    return predictions


def validation_rows(run: Run, predictions: list[Prediction]) -> list[dict]:
    """Measured median against prediction for every step row of the run, at its world size."""
    by_key = {(p.strategy, p.bucket_size_mb, p.batch_size, p.seq_len, p.world_size): p for p in predictions}
    rows = []
    for step in run.steps:
        key = (step["strategy"], step["bucket_size_mb"], step["batch_size"], step["seq_len"], run.world_size)
        if key not in by_key:
            continue
        predicted = by_key[key]
        rows.append(
            {
                "strategy": step["strategy"],
                "bucket_size_mb": step["bucket_size_mb"],
                "batch_size": step["batch_size"],
                "seq_len": step["seq_len"],
                "measured_step_seconds": step["median_seconds"],
                "predicted_step_seconds": predicted.step_seconds,
                "error": predicted.step_seconds / step["median_seconds"] - 1.0,
                "measured_comm_wait_seconds": step["comm_wait_seconds"],
                "predicted_exposed_comm_seconds": predicted.exposed_comm_seconds,
            }
        )
    return rows


CANDIDATE_BUCKET_SIZES_MB = (0.1, 0.25, 1, 5, 10, 25, 50, 100, 250, 1000)


def recommend_bucket_sizes(
    model_size: str, computes: dict[tuple[int, int], Compute], world_sizes: list[int], link: Link, overlap_slowdown: float
) -> list[dict]:
    """Per batch, sequence length and world size: the bucketed strategy's best bucket size."""
    rows = []
    grid = predict_grid(
        model_size, computes, [("bucketed", mb) for mb in CANDIDATE_BUCKET_SIZES_MB], world_sizes, link, overlap_slowdown
    )
    groups = defaultdict(list)
    for p in grid:
        groups[(p.batch_size, p.seq_len, p.world_size)].append(p)
    for (batch_size, seq_len, world_size), options in sorted(groups.items()):
        best = min(options, key=lambda p: (p.step_seconds, -p.bucket_size_mb))
        worst = max(options, key=lambda p: p.step_seconds)
        rows.append(
            {
                "batch_size": batch_size,
                "seq_len": seq_len,
                "world_size": world_size,
                "bucket_size_mb": best.bucket_size_mb,
                "step_seconds": best.step_seconds,
                "exposed_comm_seconds": best.exposed_comm_seconds,
                "worst_bucket_size_mb": worst.bucket_size_mb,
                "worst_step_seconds": worst.step_seconds,
            }
        )
    return rows


def _label(strategy: str, bucket_size_mb: float | None) -> str:
    return f"{strategy} {bucket_size_mb:g} MB" if bucket_size_mb is not None else strategy


def plot_scaling(predictions: list[Prediction], path: Path, title: str) -> None:
    """Step time against world size (log x), one line per strategy and bucket size, per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(p.batch_size, p.seq_len) for p in predictions})
    figure, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for axis, (batch_size, seq_len) in zip(axes[0], shapes):
        lines = defaultdict(list)
        for p in predictions:
            if (p.batch_size, p.seq_len) == (batch_size, seq_len):
                lines[_label(p.strategy, p.bucket_size_mb)].append((p.world_size, p.step_seconds * 1e3))
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


def _csv(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="run", type=Path, default=None, help="a saved run (pytest-benchmark JSON) to calibrate on")
    parser.add_argument("--world-sizes", type=_csv(int), default=(2, 8, 64, 1024), help="ranks to predict (default: 2,8,64,1024)")
    parser.add_argument("--json", type=Path, default=None, help="write the predictions here (a JSON list)")
    parser.add_argument("--link", choices=sorted(LINKS), default=None, help="a preset link instead of the run's fitted one")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="ring", help="latency term of the all-reduce (default: ring)")
    parser.add_argument(
        "--overlap-slowdown",
        type=float,
        default=None,
        help="seconds of compute lost per second of communication overlapped with backward "
        "(default: 1 for a gloo-on-CPU run, where both share the cores; 0 otherwise)",
    )
    parser.add_argument(
        "--optimizer-fraction", type=float, default=0.0, help="share of a local step spent in the optimizer (default: 0)"
    )
    parser.add_argument(
        "--statistic",
        choices=("median", "min"),
        default="median",
        help="which statistic of a run's rounds to calibrate and validate on (default: median; min "
        "shows what the model does with the least-disturbed rounds on a shared machine)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the scaling plot (PNG) here")
    parser.add_argument("--validation-json", type=Path, default=None, help="write the validation rows here")
    without_run = parser.add_argument_group("without --from: a configuration described by hand (needs --link)")
    without_run.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=None)
    without_run.add_argument("--local-step-ms", type=float, default=None, help="one step without communication, in ms")
    without_run.add_argument("--batch-size", type=int, default=None)
    without_run.add_argument("--seq-len", type=int, default=None)
    without_run.add_argument("--strategies", type=_csv(str), default=tuple(ddp.DDP_STRATEGIES))
    without_run.add_argument("--bucket-sizes", type=_csv(float), default=(1.0, 10.0, 100.0, 1000.0), help="MB")


def _strategy_grid(strategies, bucket_sizes) -> list[tuple[str, float | None]]:
    grid = []
    for strategy in strategies:
        if strategy in ddp.BUCKETED_STRATEGIES:
            grid.extend((strategy, float(mb)) for mb in bucket_sizes)
        else:
            grid.append((strategy, None))
    return grid


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def main(args: argparse.Namespace) -> int:
    if args.run is not None:
        run = load_run(args.run, args.statistic)
        model_size = run.model_size
        locals_ = run.local_seconds()
        if not locals_:
            raise SystemExit(f"{args.run} has no `local` rows: the model needs a step without communication; benchmark with --strategies local,...")
        computes = {shape: Compute(seconds, args.optimizer_fraction) for shape, seconds in locals_.items()}
        strategies = sorted({(s["strategy"], s["bucket_size_mb"]) for s in run.steps}, key=lambda s: (s[0], s[1] or 0))
        cpu_gloo = run.backend == "gloo" and run.device == "cpu"
        samples = [s for s in run.allreduce if s[1] == run.world_size] or run.allreduce
    else:
        if args.link is None or None in (args.model_size, args.local_step_ms, args.batch_size, args.seq_len):
            raise SystemExit("without --from, give --link, --model-size, --local-step-ms, --batch-size and --seq-len")
        run, model_size, cpu_gloo, samples = None, args.model_size, False, []
        computes = {(args.batch_size, args.seq_len): Compute(args.local_step_ms / 1e3, args.optimizer_fraction)}
        strategies = _strategy_grid(args.strategies, args.bucket_sizes)

    if args.link is not None:
        link = LINKS[args.link]
        link = Link(link.name, link.latency_seconds, link.busbw_bytes_per_second, args.algorithm)
    else:
        link = fit_link(samples, args.algorithm, name=f"fitted on {args.run.name}")
    slowdown = args.overlap_slowdown if args.overlap_slowdown is not None else (1.0 if cpu_gloo else 0.0)
    print(
        f"link {link.name}: alpha {link.latency_seconds * 1e6:.2f} us per step ({link.algorithm}), "
        f"busbw {link.busbw_bytes_per_second / GB:.3f} GB/s; overlap slowdown {slowdown:g}; model {model_size}"
    )

    world_sizes = sorted(set(args.world_sizes) | ({run.world_size} if run else set()))
    predictions = predict_grid(model_size, computes, strategies, world_sizes, link, slowdown)
    print(
        tabulate(
            [
                [p.world_size, p.batch_size, p.seq_len, _label(p.strategy, p.bucket_size_mb), p.num_allreduces,
                 _ms(p.comm_seconds), _ms(p.exposed_comm_seconds), _ms(p.step_seconds)]
                for p in predictions
            ],
            headers=["ranks", "batch", "seq len", "strategy", "all-reduces", "comm ms", "exposed comm ms", "step ms"],
        )
    )  # fmt: skip

    recommendations = recommend_bucket_sizes(model_size, computes, world_sizes, link, slowdown)
    print("\nrecommended bucket size (bucketed; candidates " + ", ".join(f"{mb:g}" for mb in CANDIDATE_BUCKET_SIZES_MB) + " MB)")
    print(
        tabulate(
            [
                [r["world_size"], r["batch_size"], r["seq_len"], f"{r['bucket_size_mb']:g}", _ms(r["step_seconds"]),
                 f"{r['worst_bucket_size_mb']:g}", _ms(r["worst_step_seconds"])]
                for r in recommendations
            ],
            headers=["ranks", "batch", "seq len", "best bucket MB", "step ms", "worst bucket MB", "step ms"],
        )
    )  # fmt: skip

    if run is not None:
        rows = validation_rows(run, predictions)
        print(f"\nvalidation at the run's {run.world_size} ranks: measured {args.statistic} against predicted")
        print(validation_table(rows))
        errors = [abs(r["error"]) for r in rows if r["strategy"] != "local"]
        if errors:
            within = sum(e <= 0.15 for e in errors)
            print(f"{within} of {len(errors)} communicating configurations within 15%; median |error| {statistics.median(errors):.1%}")
        if args.validation_json:
            args.validation_json.write_text(json.dumps(rows, indent=2))

    if args.json is not None:
        keys = ("strategy", "bucket_size_mb", "batch_size", "seq_len", "world_size", "step_seconds", "exposed_comm_seconds")
        args.json.write_text(json.dumps([{k: asdict(p)[k] for k in keys} for p in predictions], indent=2))
        print(f"wrote {len(predictions)} predictions to {args.json}")
    if args.plot is not None:
        plot_scaling(predictions, args.plot, f"ddp simulate: model {model_size}, link {link.name}")
        print(f"wrote {args.plot}")
    return 0


def validation_table(rows: list[dict]) -> str:
    return tabulate(
        [
            [r["batch_size"], r["seq_len"], _label(r["strategy"], r["bucket_size_mb"]), _ms(r["measured_step_seconds"]),
             _ms(r["predicted_step_seconds"]), f"{r['error']:+.1%}", _ms(r["measured_comm_wait_seconds"]),
             _ms(r["predicted_exposed_comm_seconds"])]
            for r in rows
        ],
        headers=["batch", "seq len", "strategy", "measured ms", "predicted ms", "error", "measured comm wait ms", "predicted exposed ms"],
    )  # fmt: skip
