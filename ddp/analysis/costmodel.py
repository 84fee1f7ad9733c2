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
- ``Machine``: nodes of ``gpus_per_node`` GPUs on one link, joined by another, each collective
  timed as NCCL's tuning model times rings and trees (``auto``: the faster);
- ``Overheads``: what an implementation adds besides bytes (a fixed cost per step, calibrated on
  measured steps by ``calibrate_on_measured``; per collective; waiting for the slowest rank);
  ``StepTerms``: the step and every term it adds up from, as ``--json`` saves them;
- ``subject_of``: any workload built on the meta device, its gradients ready by its FLOPs;
- ``validation_rows``: the prediction at the run's own world size beside its measured median;
  the model is trusted elsewhere only as far as it matches there.

The model's assumptions (backward 2/3 of a micro-batch, 3/4 with checkpointed blocks; only the
last micro-batch's backward overlaps; gradients ready in reverse registration order by their
backward FLOPs; ``--overlap-slowdown`` on CPU) and what each rests on: docs/torchrun-and-simulate.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from torch import nn

from ddp.bench.collectives.reading import bus_factor
from ddp.bench.config.shape import StepShape
from ddp.bench.config.step_config import AXES
from ddp.bench.config.values import GRAD_COMM, sharded_compute_dtype
from ddp.bench.config.workloads import build_workload, meta_module, meta_workload
from ddp.bench.results.records import PredictionRecord, Run, RunFileError, ValidationRecord
from ddp.model import MODEL_SIZES
from ddp.strategies.declarations import FP32_BYTES, sharding_of
from ddp.strategies.registry import FLOOR, resolve_strategy, takes_comm_dtype, traits

ALGORITHMS = ("auto", "ring", "tree")
"""``auto``: per collective the faster of ring and tree, as NCCL's tuning model picks (see ``Machine``)."""


@dataclass(frozen=True)
class Link:
    """The alpha-beta cost of a collective on one fabric (docs/torchrun-and-simulate.md, "The model")."""

    name: str
    latency_seconds: float
    """alpha: seconds per algorithm step (a ring all-reduce on n ranks takes 2(n-1) steps)."""
    busbw_bytes_per_second: float
    """Achieved bus bandwidth, as nccl-tests reports it (busbw = algbw x 2(n-1)/n)."""
    algorithm: str = "ring"
    """``ring`` (latency 2(n-1) alpha), ``tree`` (latency 2 ceil(log2 n) alpha) or ``auto`` (the faster)."""
    busbw_by_gpus: tuple[tuple[int, float], ...] = ()
    """A fabric whose bus bandwidth depends on how many of its GPUs a job spans (DGX-1's cube mesh):
    ``(GPUs up to, bytes/s)`` pairs, ascending; empty: ``busbw_bytes_per_second`` at any count."""
    port_per_gpu: bool = False
    """Across nodes: True where the bandwidth is one NIC's and each GPU has its own, so a node
    moves ``gpus_per_node`` times it; False where the figure is the node's (what nccl-tests
    reports for a job across nodes) or the link is not used across nodes."""

    def busbw_at(self, gpus: int) -> float:
        """Bus bandwidth of a collective over ``gpus`` GPUs of this fabric."""
        return next((bw for up_to, bw in self.busbw_by_gpus if gpus <= up_to), self.busbw_bytes_per_second)

    def latency_steps(self, world_size: int) -> int:
        return latency_steps(world_size, self.algorithm)

    def allreduce_seconds(self, size_bytes: float, world_size: int) -> float:
        """Seconds for one all-reduce of ``size_bytes`` on ``world_size`` ranks (0 on one rank);
        ``auto``: the faster of ring and tree."""
        if world_size <= 1:
            return 0.0
        bus_bytes = size_bytes * bus_factor("AllReduce", world_size)
        algorithms = ("ring", "tree") if self.algorithm == "auto" else (self.algorithm,)
        return min(self.latency_seconds * latency_steps(world_size, a) for a in algorithms) + bus_bytes / self.busbw_at(world_size)

    def collective_seconds(self, collective: str, size_bytes: float, world_size: int) -> float:
        """Seconds for one ``collective`` whose full buffer is ``size_bytes``: an all-reduce, or a
        reduce-scatter or all-gather, each half of a ring all-reduce (half its steps and bus bytes)."""
        if collective == "all_reduce":
            return self.allreduce_seconds(size_bytes, world_size)
        if collective in HALF_ALL_REDUCE:
            return replace(self, algorithm="ring").allreduce_seconds(size_bytes, world_size) / 2
        raise ValueError(f"no cost of collective {collective!r}: use all_reduce, {', '.join(HALF_ALL_REDUCE)}")

    def small_message_seconds(self, world_size: int) -> float:
        """One all-reduce of no bytes: the collective's latency at this world size."""
        return self.allreduce_seconds(0, world_size)

    def describe(self) -> str:
        if self.busbw_by_gpus:
            bandwidth = ", ".join(f"{bw / GB:g} GB/s up to {n} GPUs" for n, bw in self.busbw_by_gpus)
        else:
            bandwidth = f"busbw {self.busbw_bytes_per_second / GB:.3f} GB/s"
        port = " per GPU's NIC" if self.port_per_gpu else ""
        return f"{self.name}: alpha {self.latency_seconds * 1e6:.2f} us per step, {bandwidth}{port}"


# A ring all-reduce is a reduce-scatter followed by an all-gather, each of (n-1) steps moving
# (n-1)/n of the buffer: each costs half the all-reduce.
HALF_ALL_REDUCE = ("reduce_scatter", "all_gather")


def latency_steps(world_size: int, algorithm: str) -> int:
    if algorithm == "ring":
        return 2 * (world_size - 1)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(world_size)) if world_size > 1 else 0
    if algorithm == "auto":
        return min(latency_steps(world_size, "ring"), latency_steps(world_size, "tree"))
    raise ValueError(f"unknown algorithm {algorithm!r}: use {', '.join(ALGORITHMS)}")


GB = 1e9  # link bandwidths are quoted in 10^9 bytes per second

# Links for hardware not at hand. Bandwidths are achieved bus bandwidths (what nccl-tests reports
# as busbw, NVIDIA/nccl-tests doc/PERFORMANCE.md), below the wire rate; latencies are per
# algorithm step. Inside a node (`--link`) a preset is the node's fabric; across nodes
# (`--inter-link`) its bandwidth is one NIC's where `port_per_gpu`, else the node's.
LINKS: dict[str, Link] = {
    # H100 SXM5, NVLink 4 through NVSwitch: 900 GB/s bidirectional, 450 GB/s per direction
    # (NVIDIA H100 Tensor Core GPU datasheet). NCCL's rings reach busbw ~370 GB/s on it (NCCL's
    # maintainer, NVIDIA/nccl-tests#212: "450GB/s is the line rate. With the protocol overhead
    # (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"; NVLink SHARP all-reduces reach
    # ~480). 380 GB/s: a ring, no NVLS (two GPUs get no NVLS gain). alpha 3 us per step: about
    # 6 us for a small all-reduce on 2 GPUs, NCCL's LL-protocol range.
    "nvlink-h100": Link("nvlink-h100", latency_seconds=3e-6, busbw_bytes_per_second=380 * GB),
    # 8 x A100 SXM4, NVLink 3 (600 GB/s bidirectional): nccl-tests busbw 230-250 GB/s ("NCCL-tests
    # in practice", docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests).
    "nvlink-a100": Link("nvlink-a100", latency_seconds=3e-6, busbw_bytes_per_second=230 * GB),
    # DGX-1 with V100 (NVIDIA DGX-1 System Architecture whitepaper): six NVLink 2 links a GPU, 25 GB/s
    # per direction each, in a hybrid cube mesh; GPUs 0 and 1 share one link, a quad (0-3) is fully
    # connected by four links a GPU, all eight use all six. NCCL's rings use what the GPUs a job
    # spans have: one link for 2 GPUs, and at NVLink's ~87% protocol efficiency (the 370/450 of
    # H100's above; 21-22 GB/s over one NVLink 2 bridge in NVIDIA/nccl-tests#44) 22 GB/s on 2 GPUs,
    # 87 on a quad's four links, 130 on the eight GPUs' six (the "~130 GB/s" NCCL reports on DGX-1V).
    "dgx1-v100": Link("dgx1-v100", latency_seconds=3e-6, busbw_bytes_per_second=130 * GB,
                      busbw_by_gpus=((2, 22 * GB), (4, 87 * GB), (8, 130 * GB))),
    # InfiniBand NDR, 400 Gb/s per port = 50 GB/s per direction (NVIDIA ConnectX-7 / Quantum-2);
    # achieved about 45 GB/s per port in nccl-tests between nodes. One NIC per GPU (rail-optimized
    # DGX H100); as the job's only link (no --gpus-per-node) a ring bottlenecked by one port per
    # rank. alpha 5 us per step (switch hop, NCCL's network proxy).
    "ib-400g": Link("ib-400g", latency_seconds=5e-6, busbw_bytes_per_second=45 * GB, port_per_gpu=True),
    # InfiniBand HDR, 200 Gb/s = 25 GB/s per direction; about 22 GB/s achieved; one NIC per GPU.
    "ib-200g": Link("ib-200g", latency_seconds=5e-6, busbw_bytes_per_second=22 * GB, port_per_gpu=True),
    # DGX-1: four 100 Gb/s EDR InfiniBand NICs per node of eight GPUs, 50 GB/s per direction a node.
    # NCCL's all-reduce between DGX-1s reaches busbw ~40 GB/s (NVIDIA's GTC 2017 NCCL talk, S7155,
    # as cited in NVIDIA/nccl-tests#29: "the bandwidth in DGX-1 can reach 40 GB/s").
    "ib-4x100g": Link("ib-4x100g", latency_seconds=5e-6, busbw_bytes_per_second=40 * GB),
    # 100 Gb/s Ethernet with TCP sockets (no RDMA): 12.5 GB/s wire, about 10 GB/s achieved, and a
    # kernel network stack per step.
    "ethernet-100g": Link("ethernet-100g", latency_seconds=20e-6, busbw_bytes_per_second=10 * GB),
}


def parse_link(text: str, name: str = "given") -> Link:
    """A preset's name, or ``BUSBW_GB_PER_S,LATENCY_US`` (bus bandwidth as nccl-tests reports it,
    and the latency per algorithm step); ``ValueError`` saying which."""
    if text in LINKS:
        return LINKS[text]
    parts = text.split(",")
    try:
        busbw, latency = (float(part) for part in parts)
    except ValueError:
        raise ValueError(f"expected a preset ({', '.join(sorted(LINKS))}) or BUSBW_GB_PER_S,LATENCY_US, got {text!r}") from None
    if not (busbw > 0 and latency >= 0 and math.isfinite(busbw) and math.isfinite(latency)):
        raise ValueError(f"expected a bus bandwidth above 0 and a latency of 0 or more, got {text!r}")
    return Link(f"{name} ({busbw:g} GB/s, {latency:g} us)", latency * 1e-6, busbw * GB)


TREE_BANDWIDTH_EFFICIENCY = 0.9
"""A tree's bus bandwidth over the ring's (NCCL's tuning model, ``busBw*.9`` for trees)."""


@dataclass(frozen=True)
class Machine:
    """Nodes of ``gpus_per_node`` GPUs on ``intra`` (NVLink), joined by ``inter`` (the NICs); a
    collective's time as NCCL's tuning model states it (``src/graph/tuning.cc``, NCCL 2.7,
    commit 01afd20): a ring crosses the node boundary on 2(nodes-1) of an all-reduce's 2(n-1) steps
    (nodes-1 of a reduce-scatter's n-1), each at the inter-node latency, the others at the
    intra-node one, and moves its bus bytes at the slower of the two fabrics; a tree (all-reduce
    only) chains the GPUs of a node and joins nodes by a binary tree, 2((gpus per node - 1)
    intra + log2(nodes) inter) step latencies, at 0.9 of the bus bandwidth with half of it
    counted (NCCL's algbw ratio 0.5 for trees). ``auto`` takes the faster per collective. Without
    ``gpus_per_node`` the job is one fabric, ``intra`` (``Link``'s own formulas)."""

    intra: Link
    inter: Link | None = None
    gpus_per_node: int | None = None
    algorithm: str = "auto"

    @property
    def name(self) -> str:
        if self.gpus_per_node is None or self.inter is None:
            return self.intra.name
        return f"{self.gpus_per_node} GPUs a node on {self.intra.name}, nodes on {self.inter.name}"

    def describe(self) -> str:
        if self.gpus_per_node is None or self.inter is None:
            return f"{self.intra.describe()} ({self.algorithm})"
        return f"{self.gpus_per_node} GPUs a node; inside {self.intra.describe()}; across {self.inter.describe()} ({self.algorithm})"

    def _layout(self, world_size: int) -> tuple[int, int]:
        """(nodes, GPUs a node) of a job of ``world_size`` ranks, nodes filled first."""
        per_node = min(world_size, self.gpus_per_node)
        return math.ceil(world_size / per_node), per_node

    def collective_seconds(self, collective: str, size_bytes: float, world_size: int) -> float:
        if self.gpus_per_node is None or self.inter is None:
            return replace(self.intra, algorithm=self.algorithm).collective_seconds(collective, size_bytes, world_size)
        if collective not in ("all_reduce", *HALF_ALL_REDUCE):
            raise ValueError(f"no cost of collective {collective!r}: use all_reduce, {', '.join(HALF_ALL_REDUCE)}")
        if world_size <= 1:
            return 0.0
        nodes, per_node = self._layout(world_size)
        busbw = self.intra.busbw_at(per_node)
        if nodes > 1:
            across = self.inter.busbw_at(nodes) * (per_node if self.inter.port_per_gpu else 1)
            busbw = min(busbw, across)
        whole = collective == "all_reduce"
        steps, inter_steps = (2 * (world_size - 1), 2 * (nodes - 1)) if whole else (world_size - 1, nodes - 1)
        ring = ((steps - inter_steps) * self.intra.latency_seconds + inter_steps * self.inter.latency_seconds
                + size_bytes * steps / world_size / busbw)
        if not whole or self.algorithm == "ring":
            return ring
        tree = (2 * ((per_node - 1) * self.intra.latency_seconds + math.ceil(math.log2(nodes)) * self.inter.latency_seconds)
                + 2 * size_bytes / (TREE_BANDWIDTH_EFFICIENCY * busbw))
        return tree if self.algorithm == "tree" else min(ring, tree)

    def small_message_seconds(self, world_size: int) -> float:
        """One all-reduce of no bytes: NCCL's small-message latency as this machine's step
        latencies give it (the fixed cost a collective adds to a step, unless one is given)."""
        return self.collective_seconds("all_reduce", 0, world_size)


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
    design = np.array([[latency_steps(n, algorithm), b * bus_factor("AllReduce", n)] for b, n, _ in samples], dtype=float)
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
    ready_fraction: float | None = None
    """Share of backward done when it is ready, where a count of the model's FLOPs says
    (``gradients_by_flops``); None: from ``backward_flops_per_token`` in list order."""
    shape: tuple[int, ...] = ()
    """The parameter's shape (a compressing strategy's schedule reads it); empty where unknown."""


def gradients_in_backward_order(model_size: str, seq_len: int) -> list[Gradient]:
    """The model's gradients in reverse registration order, with the backward FLOPs before each."""
    model = meta_module(model_size, 1, seq_len)
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
        gradients.append(Gradient(name, param.numel() * param.element_size(), flops, param.element_size(),
                                  shape=tuple(param.shape)))
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
        Gradient(name, p.numel() * p.element_size(), 4.0 * p.numel() if p.dim() >= 2 else 0.0, p.element_size(),
                 shape=tuple(p.shape))
        for name, p in reversed(named)
    ]


def gradients_by_flops(module: nn.Module, inputs) -> list[Gradient]:
    """A model's gradients in reverse registration order, each ready when backward has redone the
    forward FLOPs counted after its module was first entered (``FlopCounterMode`` over one forward
    of ``inputs``, all on the meta device: nothing is allocated). Backward runs forward's operations
    in reverse at a constant multiple of their FLOPs (two matmuls per forward matmul), so the share
    of backward done when a weight's gradient is ready is the share of forward FLOPs from its
    module's entry to the end: a convolution early in a ResNet, few parameters over a large image,
    is ready near the end, as it is. ``backward_flops_per_token`` is each gradient's own share
    (the FLOPs between its readiness and the previous one's, relative), for ``units_of``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    entered: dict[int, float] = {}  # id(parameter) -> forward FLOPs counted when its module first ran

    def on_entry(submodule, _args):
        for param in submodule.parameters(recurse=False):
            entered.setdefault(id(param), float(counter.get_total_flops()))

    handles = [m.register_forward_pre_hook(on_entry) for m in module.modules()]
    try:
        with counter:
            module(*inputs) if isinstance(inputs, tuple | list) else module(inputs)
    finally:
        for handle in handles:
            handle.remove()
    total = float(counter.get_total_flops()) or 1.0
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    fractions = {name: 1.0 - entered.get(id(p), 0.0) / total for name, p in named}  # never ran: ready at the end
    by_readiness = sorted(fractions.values())
    previous = {f: (by_readiness[i - 1] if i else 0.0) for i, f in reversed(list(enumerate(by_readiness)))}
    return [
        Gradient(name, p.numel() * p.element_size(), (fractions[name] - previous[fractions[name]]) * total,
                 p.element_size(), fractions[name], tuple(p.shape))
        for name, p in reversed(named)
    ]


def workload_on_meta(name: str, batch_size: int, seq_len: int) -> tuple[nn.Module, list[Gradient]]:
    """A named workload or ``package.module:build`` built on the meta device (an 8B model in no
    memory), with its gradients by FLOPs (``gradients_by_flops``) over one batch of its own, whose
    shapes its ``batch`` gives on the CPU."""
    import torch

    workload = meta_workload(name, batch_size, seq_len)
    inputs, _ = workload.batch(torch.Generator().manual_seed(0))
    inputs = tuple(x.to("meta") for x in inputs) if isinstance(inputs, tuple | list) else inputs.to("meta")
    with torch.no_grad():
        return workload.module, gradients_by_flops(workload.module, inputs)


def subject_of(model, batch_size: int, seq_len: int) -> tuple[nn.Module, list[Gradient]]:
    """The module and its gradients in backward order: a built-in LM size (its FLOPs by formula,
    ``gradients_in_backward_order``), any other workload by name (``workload_on_meta``), or a module
    (``gradients_of_module``)."""
    if isinstance(model, str) and model in MODEL_SIZES:
        return module_of(model), gradients_in_backward_order(model, seq_len)
    if isinstance(model, str):
        return workload_on_meta(model, batch_size, seq_len)
    return model, gradients_of_module(model, seq_len)


def gradients_of(model, seq_len: int) -> list[Gradient]:
    """A built-in LM size by name (``gradients_in_backward_order``), or a module."""
    return gradients_in_backward_order(model, seq_len) if isinstance(model, str) else gradients_of_module(model, seq_len)


def module_of(model) -> nn.Module:
    """A built-in LM size by name, built on the meta device (nothing allocated), or the module itself."""
    return meta_module(model, 1, 1) if isinstance(model, str) else model


def ready_times(gradients: list[Gradient], backward_seconds: float) -> list[float]:
    """Seconds after backward starts at which each gradient is ready (backward uniform in FLOPs)."""
    if gradients and all(g.ready_fraction is not None for g in gradients):
        return [backward_seconds * g.ready_fraction for g in gradients]
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


@dataclass(frozen=True)
class Overheads:
    """What an implementation costs besides the bytes it moves (docs/torchrun-and-simulate.md,
    "Fixed costs"), and what waiting for the other ranks costs."""

    fixed_step_seconds: float = 0.0
    """Seconds a communicating step adds whatever the world size (hooks, bucket copies), calibrated
    on measured steps (``--measured-step-ms``, or a run's local/strategy pairs)."""
    collective_seconds: float | None = 0.0
    """Seconds each collective adds to the step beyond the link's schedule (launch, its bucket's
    copies); None: the machine's small-message all-reduce time at the world size
    (``small_message_seconds``), what ``ddp simulate`` charges unless told. Charged at more than one rank."""
    rank_variation: float = 0.0
    """Coefficient of variation of one rank's compute between ranks: a synchronous step waits for
    the slowest of n, ``rank_variation`` x compute x E[max of n standard normals] more (0 on one rank)."""
    collective_source: str = "none"
    """Where ``collective_seconds`` came from, as the output says it."""

    def per_collective(self, link, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        return self.collective_seconds if self.collective_seconds is not None else link.small_message_seconds(world_size)


NO_OVERHEADS = Overheads()


@functools.lru_cache(maxsize=None)
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.564 for 2, 1.424 for 8, 2.594 for
    128), by the integral of x n phi(x) Phi(x)^(n-1) on a fine grid."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


class StepTerms(NamedTuple):
    """One predicted step and the terms it adds up from: ``step_seconds`` = ``compute_seconds`` +
    ``fixed_step_seconds`` + ``fixed_collective_seconds`` + ``rank_wait_seconds`` +
    ``exposed_comm_seconds`` + ``overlap_slowdown_seconds``. (A tuple whose first four are
    step, exposed, comm and collectives, as ``predict_step`` returned before it named them.)"""

    step_seconds: float
    exposed_comm_seconds: float
    """What communication adds after compute ends: the channel's last collective's end minus the
    end of backward (docs/profiling.md's exposed communication: collectives with no compute beside them)."""
    comm_seconds: float
    """Every collective's time on the channel, hidden or not."""
    collectives_per_step: int
    compute_seconds: float
    """The step without communication (``Compute.step_seconds``)."""
    fixed_step_seconds: float = 0.0
    fixed_collective_seconds: float = 0.0
    """``collectives_per_step`` x the fixed cost of one (``Overheads.per_collective``)."""
    rank_wait_seconds: float = 0.0
    """Waiting for the slowest rank (``Overheads.rank_variation``)."""
    overlap_slowdown_seconds: float = 0.0
    """Compute lost to communication overlapped with it (``overlap_slowdown`` x hidden)."""


def predict_step(
    strategy: str,
    bucket_size_mb: float | None,
    compute: Compute,
    gradients: list[Gradient],
    link: Link,
    world_size: int,
    overlap_slowdown: float = 0.0,
    module: nn.Module | None = None,
    overheads: Overheads = NO_OVERHEADS,
    gather_scale: float = 1.0,
) -> StepTerms:
    """One step's ``StepTerms``; ``link``: a ``Link`` or a ``Machine``; ``module``: the model the
    gradients are of, for a strategy that shards it into units; ``gather_scale``: bytes of an
    all-gathered parameter element over a gradient element (0.5: bf16 weights over fp32 shards)."""
    backward = compute.backward_seconds
    ready = ready_times(gradients, backward)
    described = traits(strategy)
    if not described.communicates:
        return StepTerms(compute.step_seconds, 0.0, 0.0, 0, compute.step_seconds)
    if world_size <= 1:  # nothing crosses a link, but the implementation's hooks and copies still run
        fixed = overheads.fixed_step_seconds
        return StepTerms(compute.step_seconds + fixed, 0.0, 0.0, 0, compute.step_seconds, fixed)
    sharding = sharding_of(resolve_strategy(strategy))
    if sharding is not None and sharding.parameters:
        if compute.micro_batches > 1:  # every micro-batch gathers and reduce-scatters: not this schedule
            raise NotModelled(f"strategy {strategy!r} shards parameters: its accumulating micro-batches are not modelled")
        units = described.units(module) if module is not None else None
        if units is None:
            raise NotModelled(f"strategy {strategy!r} shards parameters but says no units (Traits.units) for this model")
        sizes = units_of(gradients, [name for name, _ in units])
        end, exposed, comm, calls, hidden = fully_sharded_step(
            compute, sizes, link, world_size, described.prefetches_next_unit, gather_scale
        )
    else:
        launches = strategy_launches(strategy, gradients, ready, backward, bucket_size_mb, link, world_size)
        comm = sum(duration for _, duration in launches)
        exposed = max(0.0, channel_end(launches) - backward)
        hidden, calls = comm - exposed, len(launches)
    per_collective = overheads.per_collective(link, world_size) * calls
    wait = overheads.rank_variation * compute.step_seconds * expected_max_of_normals(world_size)
    slowdown = overlap_slowdown * hidden
    step = compute.step_seconds + overheads.fixed_step_seconds + per_collective + wait + exposed + slowdown
    return StepTerms(step, exposed, comm, calls, compute.step_seconds, overheads.fixed_step_seconds, per_collective, wait,
                     slowdown)


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
    compute: Compute, units: list[tuple[float, float]], link: Link, world_size: int, prefetch: bool, gather_scale: float = 1.0,
) -> tuple[float, float, float, int, float]:
    """One full-sharding step on one serial channel (docs/torchrun-and-simulate.md): an all-gather before each
    unit's forward and backward, a reduce-scatter after each unit's backward; ``prefetch`` issues
    the next unit's all-gather when the current unit starts computing. ``units``: ``units_of``, the
    root first; ``gather_scale``: the all-gathers' bytes over the gradients' (0.5 for bf16 weights
    gathered over fp32 shards, whose gradients are reduce-scattered in fp32).
    Returns ``(end, exposed, comm, collectives, hidden)``: when the last unit's compute or
    collective ends, what communication added to compute, the channel's busy time, the
    collectives, and the channel time spent beside compute."""
    total_flops = sum(flops for _, flops in units) or 1.0
    forward_seconds = compute.forward_seconds
    channel_free = comm = 0.0

    def transfer(ready: float, collective: str, size_bytes: float) -> float:
        nonlocal channel_free, comm
        duration = link.collective_seconds(collective, size_bytes * (gather_scale if collective == "all_gather" else 1.0),
                                           world_size)
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
    return end, exposed, comm, 3 * len(units), max(0.0, comm - exposed)


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
    sent: Sent
    """What the run's steps communicated: its precision and its gradients' dtype (``--grad-comm``)."""

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
    grad_comms = {s.config.grad_comm for s in steps if takes_comm_dtype(s.strategy)}
    if len(variants) != 1 or len(grad_comms) > 1:
        raise RunFileError(
            f"{run.path} mixes options {sorted(variants)} or gradient dtypes {sorted(grad_comms)}; the cost model takes one "
            "set of options (--precision, --grad-accum, --activation-checkpointing, ...) and one --grad-comm: give a run "
            "of one value of each"
        )
    local = {(s.config.batch_size, s.config.seq_len): _statistic(s.round_seconds, s.step_seconds, statistic)
             for s in steps if s.strategy == FLOOR}
    if not local:
        raise RunFileError(
            f"{run.path} has no `local` rows: the model needs a step without communication; benchmark with --strategies local,..."
        )
    allreduce = [(a.size_bytes, a.world_size, _statistic(a.round_seconds, a.seconds, statistic)) for a in run.allreduces]
    first = steps[0]
    sent = Sent(first.config.precision, next(iter(grad_comms), AXES["grad_comm"].default))
    return Calibration(first.config.model, first.world_size, first.backend, first.device, steps, local, allreduce, statistic,
                       sent)


def prediction(strategy: str, bucket_size_mb: float | None, batch_size: int, seq_len: int, world_size: int,
               terms: StepTerms) -> Prediction:
    """The saved record of one predicted step, every term in it."""
    return Prediction(
        strategy, bucket_size_mb, batch_size, seq_len, world_size, terms.step_seconds, terms.exposed_comm_seconds,
        terms.comm_seconds, terms.collectives_per_step, compute_seconds=terms.compute_seconds,
        fixed_step_seconds=terms.fixed_step_seconds, fixed_collective_seconds=terms.fixed_collective_seconds,
        rank_wait_seconds=terms.rank_wait_seconds, overlap_slowdown_seconds=terms.overlap_slowdown_seconds,
    )


def predict_grid(
    model_size,
    computes: dict[tuple[int, int], Compute],
    strategies: list[tuple[str, float | None]],
    world_sizes: list[int],
    link: Link,
    overlap_slowdown: float,
    overheads: Overheads | dict[tuple[str, float | None], Overheads] = NO_OVERHEADS,
    sent: Sent | None = None,
) -> list[Prediction]:
    """Every strategy at every world size and shape; a strategy with no cost schedule is left out.
    ``model_size``: anything ``subject_of`` takes; ``overheads``: one for all, or one per
    (strategy, bucket cap); ``sent``: what is communicated (default fp32 all through)."""
    predictions = []
    sent = sent or Sent()
    for (batch_size, seq_len), compute in sorted(computes.items()):
        module, gradients = subject_of(model_size, batch_size, seq_len)
        for world_size in world_sizes:
            for strategy, bucket_size_mb in strategies:
                costs = overheads.get((strategy, bucket_size_mb), NO_OVERHEADS) if isinstance(overheads, dict) else overheads
                try:
                    terms = predict_step(strategy, bucket_size_mb, compute, sent.gradients(strategy, gradients), link,
                                         world_size, overlap_slowdown, module, costs, sent.gather_scale(strategy))
                except NotModelled:
                    continue  # the caller names the strategies absent from the predictions
                predictions.append(prediction(strategy, bucket_size_mb, batch_size, seq_len, world_size, terms))
    return predictions


@dataclass(frozen=True)
class Sent:
    """What a step communicates, each value read from its declaration
    (``ddp.bench.config.values``): a strategy that takes ``comm_dtype`` (bucketed, torch)
    all-reduces its gradients in ``GRAD_COMM[grad_comm]``'s dtype; a strategy that takes
    ``compute_dtype`` (``fsdp``, ``torch_fsdp``) all-gathers its parameters in the precision's
    ``sharded_compute_dtype`` (FSDP's mixed precision), and reduce-scatters fp32 gradients onto
    fp32 master shards. Every other strategy sends its gradients and parameters as they are."""

    precision: str = "fp32"
    grad_comm: str = "fp32"

    def gradients(self, strategy: str, gradients: list[Gradient]) -> list[Gradient]:
        dtype = GRAD_COMM[self.grad_comm].dtype
        if dtype is None or not takes_comm_dtype(strategy):
            return gradients
        return [dataclasses.replace(g, size_bytes=g.size_bytes // g.element_size * dtype.itemsize, element_size=dtype.itemsize)
                for g in gradients]

    def gather_scale(self, strategy: str) -> float:
        """All-gathered bytes over the fp32 parameters' (1.0 where the strategy gathers fp32)."""
        dtype = sharded_compute_dtype(self.precision, strategy)
        return 1.0 if dtype is None else dtype.itemsize / FP32_BYTES


RANK_VARIATION = 0.02
"""Default ``Overheads.rank_variation``: one rank's compute varies by 2% (its standard deviation
over its mean) between the ranks of a job. The one figure of the model calibrated on the published
rows (docs/torchrun-and-simulate.md, PyTorch's DDP benchmark on DGX-1s): DDP there costs 3 ms a step on one
GPU and 6-7 ms on 2 to 16, flat, while its 1 MB buckets cost 10-40 us a collective more than its
25 MB ones (the A/B of its diff.py): the 3-4 ms that communicating adds does not follow the bytes
on the link or the bucket count, but the ranks' synchronization, which 2% x 97 ms x E[max of n
normals] (1.1 ms on 2 GPUs, 2.8 ms on 8, 3.4 ms on 16) gives within the published
resolution of 1 ms. docs/torchrun-and-simulate.md, "Fixed costs"."""


@dataclass(frozen=True)
class Calibrated:
    """What measured steps of one configuration (``--measured-step-ms``) settle."""

    compute: Compute
    overheads: Overheads
    residuals_seconds: dict[int, float]
    """world size -> measured minus predicted step after calibration."""
    solved: str
    """``fixed step`` (a local step was given) or ``compute`` (none was: the fixed step is 0)."""


def calibrate_on_measured(
    model, shape: StepShape, strategy: str, bucket_size_mb: float | None, link, measured_seconds: dict[int, float],
    local_seconds: float | None, overheads: Overheads, overlap_slowdown: float = 0.0, sent: Sent | None = None,
) -> Calibrated:
    """Given a local step, the fixed cost per step that makes the predictions of ``strategy`` meet
    its measured steps (their mean residual); without one, the compute that does (bisected per
    measured step, then averaged), the fixed step 0: one measured step cannot tell the two apart."""
    sent = sent or Sent()
    module, gradients = subject_of(model, shape.micro_batch_size, shape.seq_len)
    gradients = sent.gradients(strategy, gradients)

    def step(compute: Compute, costs: Overheads, world_size: int) -> float:
        return predict_step(strategy, bucket_size_mb, compute, gradients, link, world_size, overlap_slowdown, module, costs,
                            sent.gather_scale(strategy)).step_seconds

    if local_seconds is not None:
        compute = Compute.of(local_seconds, shape)
        gaps = [seconds - step(compute, overheads, n) for n, seconds in measured_seconds.items()]
        costs = replace(overheads, fixed_step_seconds=float(np.mean(gaps)))
        solved = "fixed step"
    else:
        costs = replace(overheads, fixed_step_seconds=0.0)
        solutions = []
        for n, seconds in measured_seconds.items():
            low, high = 0.0, seconds
            for _ in range(60):
                middle = (low + high) / 2
                low, high = (middle, high) if step(Compute.of(middle, shape), costs, n) < seconds else (low, middle)
            solutions.append((low + high) / 2)
        compute = Compute.of(float(np.mean(solutions)), shape)
        solved = "compute"
    residuals = {n: seconds - step(compute, costs, n) for n, seconds in measured_seconds.items()}
    return Calibrated(compute, costs, residuals, solved)


@dataclass(frozen=True)
class PairedFixedSteps:
    """The fixed cost per step of each configuration of a saved run, from its ``local``/strategy
    pairs: at the run's world size, each measured step minus its prediction without a fixed step
    (``gaps``). A configuration's fixed step is the mean over the shapes it was measured at; its
    validation at one shape takes the mean over the others (held out), so that no row is checked
    against the figure fitted on it."""

    gaps: dict[tuple[str, float | None], dict[tuple[int, int], float]]
    """(strategy, bucket cap) -> (batch, seq len) -> measured minus predicted seconds."""

    def overheads(self, base: Overheads, leave_out: tuple[int, int] | None = None) -> dict[tuple[str, float | None], Overheads]:
        """``base`` with each configuration's fixed step: the mean of its gaps, without the one at
        ``leave_out`` where it has others (``held_out`` says where it has none)."""
        fitted = {}
        for key, by_shape in self.gaps.items():
            kept = [gap for shape, gap in by_shape.items() if shape != leave_out] or list(by_shape.values())
            fitted[key] = replace(base, fixed_step_seconds=float(np.mean(kept)))
        return fitted

    def held_out(self, key: tuple[str, float | None], shape: tuple[int, int]) -> bool:
        """Whether the fixed step validated at ``shape`` was fitted on other shapes only."""
        return any(other != shape for other in self.gaps.get(key, {}))


def fixed_steps_from_pairs(
    run: Calibration, computes: dict[tuple[int, int], Compute], machine, overlap_slowdown: float, overheads: Overheads,
    sent: Sent | None = None,
) -> PairedFixedSteps:
    """``PairedFixedSteps`` of every communicating configuration of ``run`` measured at a shape
    that has a ``local`` row (``computes``), predicted with ``overheads`` but no fixed step. The
    fixed step enters a prediction as a sum (``predict_step``), so each gap is exactly the
    fixed step that meets its row, as ``calibrate_on_measured`` would solve it."""
    configurations = sorted({(s.strategy, s.config.bucket_size_mb) for s in run.steps if traits(s.strategy).communicates},
                            key=lambda c: (c[0], c[1] or 0.0))
    base = replace(overheads, fixed_step_seconds=0.0)
    predicted = {(p.strategy, p.bucket_size_mb, p.batch_size, p.seq_len): p.step_seconds
                 for p in predict_grid(run.model, computes, configurations, [run.world_size], machine, overlap_slowdown, base, sent)}
    gaps: dict[tuple[str, float | None], dict[tuple[int, int], float]] = {}
    for step in run.steps:
        config = step.config
        key = (config.strategy, config.bucket_size_mb, config.batch_size, config.seq_len)
        if key in predicted:
            gaps.setdefault(key[:2], {})[key[2:]] = run.seconds(step) - predicted[key]
    return PairedFixedSteps(gaps)


def validation_rows(run: Calibration, predictions: list[Prediction],
                    paired: PairedFixedSteps | None = None) -> list[ValidationRecord]:
    """Measured median against prediction for every step row of the run, at its world size;
    ``paired``: where the predictions' fixed steps came from (``ValidationRecord.fixed_step_from``)."""
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
            fixed_step_from=_fixed_step_from(paired, config),
        ))
    return rows


def _fixed_step_from(paired: PairedFixedSteps | None, config) -> str:
    key = (config.strategy, config.bucket_size_mb)
    if paired is None or key not in paired.gaps:
        return "none"
    return "other shapes" if paired.held_out(key, (config.batch_size, config.seq_len)) else "this row"


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
    strategy: str = "bucketed", overheads: Overheads = NO_OVERHEADS, sent: Sent | None = None,
) -> list[Recommendation]:
    """Per batch, sequence length and world size: ``strategy``'s best bucket size among
    ``CANDIDATE_BUCKET_SIZES_MB``. ``model_size``: anything ``subject_of`` takes."""
    grid = predict_grid(
        model_size, computes, [(strategy, mb) for mb in CANDIDATE_BUCKET_SIZES_MB], world_sizes, link, overlap_slowdown,
        overheads, sent,
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
        bus = sum(b * bus_factor("AllReduce", n) for b, n, _ in samples)
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
    already communicates in a reduced dtype, or its strategy takes no ``comm_dtype``)."""

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
    gradients = Sent(config.precision, config.grad_comm).gradients(config.strategy, gradients)
    in_bf16 = functools.partial(Sent(config.precision, "bf16").gradients, config.strategy)
    # the advice's bf16 figure: for a strategy that can send bf16 and does not already send a reduced dtype
    bf16_possible = takes_comm_dtype(config.strategy) and GRAD_COMM[config.grad_comm].dtype is None

    def modelled(cap: float, grads=gradients) -> float:
        return predict_step(config.strategy, cap, Compute.of(local_seconds, config.step_shape), grads, link,
                            step.world_size, slowdown).step_seconds

    measured_cap = config.bucket_size_mb
    at_cap = {cap: modelled(cap) for cap in sorted({*CANDIDATE_BUCKET_SIZES_MB, measured_cap})}
    best = min(at_cap, key=lambda cap: (at_cap[cap], cap != measured_cap))
    return PlanAdvice(
        link=link, modelled_seconds=at_cap[measured_cap], error=at_cap[measured_cap] / step.step_seconds - 1.0,
        best_bucket_size_mb=best, best_seconds=at_cap[best],
        bf16_seconds=modelled(best, in_bf16(gradients)) if bf16_possible else None,
    )
