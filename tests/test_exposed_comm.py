"""Exposed communication adds up: every strategy's timed wait for gradients (``sync_wait_seconds``,
``ddp.bench.rounds.trainer``) accounts for what its step costs over ``local``'s, PyTorch's DDP
included, whose wait happens inside ``loss.backward()``; and the traced steps' communication alone
(``ddp.bench.collectives.timeline``) agrees with it.

On a CPU the real cost of communication is partly a wait and partly contention (gloo's threads
take cores from the backward they overlap, which shows in the step but is no wait), and on a
shared 2-core machine the second moves by tens of milliseconds from one run to the next. So the
ranks run on a slow network instead: one link that serves one all-reduce at a time, each for
``NETWORK_DELAY_SECONDS``, in the order launched (as one NCCL stream does): an all-reduce is
delivered the delay after the later of its launch and the previous one's delivery
(``slow_network``: ``torch.distributed.all_reduce`` for the strategies written here, a DDP comm hook
for PyTorch's reducer, which calls its collectives from C++). Then communication dominates every
step, and for each strategy, measured in the same rounds as ``local`` (the same step without
communication), medians over rounds:

    wait >= step - local step - tolerance        (the step adds up)
    wait >= 0.9 x NETWORK_DELAY_SECONDS          (the last collective's wait is seen)

The per-collective figures of the traced steps (``ddp.bench.rounds.summary.collective_trace``) are
known too: collectives complete in launch order, the delay apart, so the last launched is the
tail (the used mask where it goes last), alone on the link for the delay at the end.

The tolerance is what synchronizing may cost besides waiting: copies into buckets, the strategy's
own Python, the contention left (``TOLERANCE_OF_LOCAL`` of the local step plus
``TOLERANCE_SECONDS``). A figure that ran from the last gradient to the return of
``finish_gradient_synchronization()`` would read zero for ``torch`` here: its reducer waits before that.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.stats import median_ci
from ddp.bench.rounds.loop import Measurement, measure
from ddp.bench.rounds.rank_state import release
from ddp.bench.rounds.summary import collective_trace
from ddp.bench.rounds.traced import trace
from ddp.strategies import DDP_STRATEGIES, SHARDED_STRATEGIES, TorchDDP, takes_bucket_size, tracing
from ddp.strategies.declarations import declarations, declare
from tests.cuda_traces import read_on_nccl

pytestmark = pytest.mark.slow  # a minute or more on 2 cores: CI runs it with -m slow

NETWORK_DELAY_SECONDS = 0.020
TOLERANCE_OF_LOCAL = 0.5
TOLERANCE_SECONDS = 0.020
# What two measurements of the same wait may differ by however steady, per collective waited for:
# a thread's wake-up, sleep's grain (naive waits for 22 in a row).
SUM_RESOLUTION_SECONDS = 0.0002
_all_reduce = dist.all_reduce  # the real one, in every process that imports this module


class _Courier:
    """Delivers the link's all-reduces when due, from one thread per process: starting a thread per
    collective would take the cores backward runs on (about 10 ms a step for ``overlap``'s 22 on
    tiny, which would show as a longer backward in the steps that start them)."""

    def __init__(self) -> None:
        self._queue: list = []  # (deliver_at, sequence, deliver)
        self._due = threading.Condition()
        self._sequence = itertools.count()
        self._thread: threading.Thread | None = None

    def send(self, deliver_at: float, deliver) -> None:
        with self._due:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()
            heapq.heappush(self._queue, (deliver_at, next(self._sequence), deliver))
            self._due.notify()

    def _run(self) -> None:
        while True:
            with self._due:
                while not self._queue or self._queue[0][0] > time.perf_counter():
                    self._due.wait(None if not self._queue else self._queue[0][0] - time.perf_counter())
                _, _, deliver = heapq.heappop(self._queue)
            deliver()


_COURIER = _Courier()


class DelayedWork:
    """A collective's work that completes no sooner than ``deliver_at`` (``time.perf_counter``)."""

    def __init__(self, work: dist.Work, deliver_at: float) -> None:
        self.work, self.deliver_at = work, deliver_at

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        time.sleep(max(0.0, self.deliver_at - time.perf_counter()))
        return True

    def get_future(self) -> torch.futures.Future:
        """A future that completes when the work is delivered, from the courier's thread (as gloo
        completes its futures from its own threads)."""
        delivered = torch.futures.Future()
        _COURIER.send(self.deliver_at, lambda: delivered.set_result(self.work.get_future().wait()))
        return delivered


_link = {"free_at": 0.0}  # when the link has delivered the last all-reduce given to it (this process's)
_link_lock = threading.Lock()


def _slow_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    with _link_lock:
        _link["free_at"] = max(time.perf_counter(), _link["free_at"]) + NETWORK_DELAY_SECONDS
        deliver_at = _link["free_at"]
    work = DelayedWork(_all_reduce(tensor, op=op, group=group, async_op=True), deliver_at)
    if async_op:
        return work
    work.wait()
    return None


def slow_network(on: bool) -> None:
    """Runs on every rank: every ``torch.distributed.all_reduce`` completes the delay after its launch."""
    dist.all_reduce = _slow_all_reduce if on else _all_reduce


def _delayed_allreduce(model, bucket):
    """PyTorch's default hook (average the bucket), delivered when the link is done with it, from
    the courier's thread: a delay in a ``then`` callback would run inline, inside backward, whenever
    the all-reduce was already done. Launched through ``ddp.strategies.tracing`` with the
    strategy's recorder, as ``ddp profile``'s hook does: traced steps see each bucket. Unannotated:
    DDP reads the annotations, and this module's are strings."""
    process_group = model.process_group
    world_size = dist.get_world_size(process_group)
    work = tracing.launch_all_reduce(bucket.buffer(), dist.ReduceOp.SUM, process_group, f"bucket{bucket.index()}",
                                     model.collective_recorder)
    delivered = torch.futures.Future()

    def deliver() -> None:
        work.work.wait()
        delivered.set_result(bucket.buffer().div_(world_size))

    _COURIER.send(work.deliver_at, deliver)
    return delivered


class SlowNetworkTorchDDP(TorchDDP):
    """PyTorch's DDP on the slow network: its reducer waits for its buckets inside backward."""

    def __init__(self, module, *, bucket_size_mb: float = 25.0, **options) -> None:
        super().__init__(module, bucket_size_mb=bucket_size_mb, **options)
        self.ddp.register_comm_hook(self, _delayed_allreduce)


# PyTorch's DDP, except that its hook launches every bucket through ddp.strategies.tracing
declare(SlowNetworkTorchDDP, **declarations(TorchDDP, records_collectives=True))


def _on_the_slow_network(name: str) -> str:
    return f"{__name__}:SlowNetworkTorchDDP" if name == "torch" else name


# On the slow network the per-collective figures hold for these: every replicated strategy and the
# sharded optimizer, whose gradients go as bucketed's (its broadcasts come after, in the optimizer).
PER_COLLECTIVE = tuple(name for name in DDP_STRATEGIES if name not in SHARDED_STRATEGIES) + ("sharded_optimizer",)
TRACED_STEPS = 6
BUCKET_MB = 0.1  # tiny's 1 MB of gradients in several buckets (PyTorch's first one too: its cap is given)


@pytest.fixture(scope="module")
def slow_steps(rank_group) -> tuple[list[StepConfig], Measurement]:
    """``local`` and every strategy of ``PER_COLLECTIVE`` on the slow network: 7 timed rounds, then
    ``TRACED_STEPS`` traced steps of each."""
    configs = [StepConfig("local", "tiny", 2, 32)] + [
        StepConfig(_on_the_slow_network(name), "tiny", 2, 32, BUCKET_MB if takes_bucket_size(_on_the_slow_network(name)) else None)
        for name in PER_COLLECTIVE
    ]
    policy = RoundOptions.fixed(7, 1, traced_steps=TRACED_STEPS)
    try:
        rank_group.run(slow_network, True)
        measurement = measure(rank_group, configs, policy)
        measurement.traces = trace(rank_group, configs, policy)  # after the timed rounds: nothing is timed after them
    finally:
        rank_group.run(slow_network, False)
        rank_group.run(release)
    assert isinstance(measurement, Measurement)
    return configs, measurement


def _name(config: StepConfig) -> str:
    return config.strategy.rsplit(":", 1)[-1]


@pytest.mark.ranks(2, why="with one rank nothing is communicated")
def test_exposed_communication_accounts_for_the_step_of_every_strategy(slow_steps) -> None:
    configs, measurement = slow_steps
    # Sharded strategies also communicate where this figure does not look (FSDP's all-gathers in
    # forward and backward, ZeRO's broadcasts in the optimizer): their cost is their overhead over local.
    local = statistics.median(measurement.round_seconds(0))
    tolerance = TOLERANCE_OF_LOCAL * local + TOLERANCE_SECONDS
    figures = {
        _name(config): (
            statistics.median(measurement.round_seconds(index)),
            statistics.median(measurement.sync_wait_seconds(index)),
        )
        for index, config in enumerate(configs)
        if index > 0 and _name(config) not in SHARDED_STRATEGIES
    }
    shown = ", ".join(f"{name}: step {s * 1e3:.1f} ms, exposed {e * 1e3:.1f} ms" for name, (s, e) in figures.items())
    for name, (step, exposed) in figures.items():
        assert exposed >= step - local - tolerance, (
            f"{name}'s exposed communication does not account for its step: local {local * 1e3:.1f} ms, "
            f"tolerance {tolerance * 1e3:.1f} ms; {shown}"
        )
        assert exposed >= 0.9 * NETWORK_DELAY_SECONDS, f"{name}'s last collective's wait is not seen: {shown}"


def traced_from(backend: str) -> str:
    """Where the traced steps read the collectives' times (``ddp.bench.collectives.recording``): NCCL's kernels on
    NCCL at two ranks or more, the strategies' own records (the link's deliveries) elsewhere."""
    return "nccl_kernels" if backend == "nccl" else "collective_records"


def check_collectives(name: str, trace, timed: list[float], backend: str) -> None:
    """What the traced steps of one strategy on the slow link must show (see the test below). On
    NCCL the kernels' GPU times are read: the link delays the CPU's wait, which they do not see,
    and NCCL says nothing of when a gradient was ready; there the tail is still the last-launched
    gradient collective (one NCCL stream completes in launch order)."""
    assert trace is not None and trace.comm_source == traced_from(backend), name
    timed_ci = median_ci(timed)
    shown = (f"{name}: shares add up to {trace.attributed_seconds * 1e3:.2f} ms "
             f"[{trace.attributed_seconds_ci95[0] * 1e3:.2f}, {trace.attributed_seconds_ci95[1] * 1e3:.2f}], "
             f"the timed rounds exposed {statistics.median(timed) * 1e3:.2f} ms "
             f"[{timed_ci[0] * 1e3:.2f}, {timed_ci[1] * 1e3:.2f}]; "
             + ", ".join(f"{c.label} {c.exposed_seconds * 1e3:.1f}" for c in trace.collectives))

    def ready(c) -> float:
        return c.launch_seconds if c.ready_seconds is None else c.ready_seconds

    # The step waits for every collective, the used mask's too (it carries no gradient, but the
    # optimizer cannot start before it is back): one link delivers in launch order, so the last
    # launched is the last delivered, the tail.
    last_launched = max(trace.collectives, key=lambda c: c.launch_seconds)
    assert trace.tail == last_launched.label, shown
    assert all(ready(c) <= c.launch_seconds < c.done_seconds for c in trace.collectives), shown
    if trace.comm_source != "collective_records":
        return
    # The communication alone is most of the timed wait and no more than it: the wait also holds
    # the strategy's own work once the link has delivered (flat's copies back, a wake-up).
    resolution = SUM_RESOLUTION_SECONDS * len(trace.collectives)
    low, high = trace.attributed_seconds_ci95
    assert low <= timed_ci[1] + resolution and 0.9 * timed_ci[0] <= high + resolution, shown
    # Delivered the delay after the one before it, after backward's end: alone for the delay at
    # least (before that it shares the instants with the collectives still in flight beside it).
    assert 0.9 * NETWORK_DELAY_SECONDS <= trace.tail_timing.exposed_seconds <= trace.exposed_comm_seconds, shown


@pytest.mark.ranks(2, why="with one rank nothing is communicated")
def test_each_collectives_exposed_share_adds_up_and_the_last_launched_is_the_tail(slow_steps, rank_group) -> None:
    """Per collective, from the traced steps: the exposed shares add up to most of the wait the
    timed rounds measured and no more; the tail is the collective launched last (one link delivers
    in launch order), alone for the link's delay."""
    configs, measurement = slow_steps
    local = collective_trace(measurement.traces[0])  # local communicates nothing, and says what bounds it
    assert local.collectives == [] and local.exposed_comm_seconds == 0.0 and local.bound_by == "compute"
    for index, config in enumerate(configs[1:], start=1):
        trace = collective_trace(measurement.traces[index])
        assert trace is not None and trace.steps == TRACED_STEPS
        check_collectives(_name(config), trace, measurement.sync_wait_seconds(index), rank_group.backend)


def _nccl_step(bucket_ends: list[float]) -> tuple[list[dict], dict]:
    """A recorded CUDA trace of one step of PyTorch's DDP at two NCCL ranks (synthetic, in the
    shape Kineto writes: kernels correlated with their cudaLaunchKernel), and the step's CPU record:
    forward over [0, 1] s with DDP's buffer broadcast, backward's kernels to 2.0 s, one all-reduce
    kernel per bucket launched at 1.5 + 0.1 i and ending at ``bucket_ends[i]``, the optimizer at 2.5 s."""
    events = [{"name": "forward", "cat": "user_annotation", "ph": "X", "ts": 0.0, "dur": 1e6}]
    kernels = [("gemm", 0.1, 0.1, 0.9), ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0.2, 0.3, 0.31),
               ("gemm_backward", 1.0, 1.1, 2.0), ("adam", 2.4, 2.5, 2.6)]
    kernels += [("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1.5 + 0.1 * i, 1.6 + 0.1 * i, end)
                for i, end in enumerate(bucket_ends)]
    for correlation, (name, launch, start, end) in enumerate(kernels):
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ph": "X", "ts": launch * 1e6, "dur": 5,
                       "args": {"correlation": correlation}})
        events.append({"cat": "kernel", "name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                       "args": {"correlation": correlation}})
    cpu = RecordedStep({"forward": [0.0, 1.0], "backward": [1.0, 2.2], "gradient_sync": [2.2, 2.3], "optimizer": [2.3, 2.7]},
                       backward_compute_end=2.0)
    return events, cpu


def test_the_nccl_branch_of_the_check_on_a_recorded_cuda_trace() -> None:
    """What the check asks of two NCCL GPUs, on a recorded trace: the kernels' source, DDP's buffer
    broadcast named apart from the buckets, no ready time, the last-launched bucket the tail."""
    traces = []
    for rank in range(2):
        events, cpu = _nccl_step([1.8 + 0.01 * rank, 2.1, 2.3 + 0.01 * rank])
        (step,) = read_on_nccl(events, [cpu], [4096, 4096, 2048])
        traces.append([step] * TRACED_STEPS)
    trace = collective_trace(traces)
    assert [c.label for c in trace.collectives] == ["broadcast0", "bucket0", "bucket1", "bucket2"]
    assert all(c.ready_seconds is None for c in trace.collectives)
    check_collectives("torch", trace, [0.5] * 7, "nccl")
    assert trace.tail == "bucket2"
    # The buckets alone after backward's last kernel (2.0): [2.0, 2.3]; the broadcast beside forward's.
    assert trace.exposed_comm_seconds == pytest.approx(0.3) and trace.comm_seconds == pytest.approx(0.71, abs=1e-6)
