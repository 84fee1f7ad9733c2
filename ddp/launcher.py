"""The one place that starts ranks: a persistent group of worker processes, one per rank.

``RankGroup`` starts ``world_size`` processes once (``rank_process_context``), each joined into a ``torch.distributed``
process group through a ``FileStore`` in a private temporary folder (no ports to collide between
parallel runs), and then runs any importable function on every rank, as often as asked:

    group = RankGroup(world_size=2, backend="gloo")
    results = group.run(train_step, config)   # one result per rank
    group.close()

A rank that raises fails the call with that rank's traceback; a call that outlives its timeout
fails with every rank's stack, dumped by ``faulthandler``. A rank whose process a signal ended
(most often the kernel's out-of-memory killer, whose SIGKILL no rank can catch or report) fails
the call with ``RankKilled``, naming the rank, its group (``label``), the signal and its likely
cause. Either way the group is torn down and the next call starts a fresh one. Ranks die with
their parent (``PR_SET_PDEATHSIG``), ignore Ctrl-C (the parent ends them) and are closed at
interpreter exit.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 600.0
# How long the other ranks get to report after one has failed: they are often blocked in a
# collective that the failed rank will never join.
GRACE_AFTER_FAILURE_SECONDS = 2.0


# How long the other ranks get to finish after one has withdrawn from a call (returned a
# ``Withdrawn`` result, e.g. out of memory): they may be waiting in a collective it left.
GRACE_AFTER_WITHDRAWAL_SECONDS = 10.0


class RankError(RuntimeError):
    """A rank raised, died or hung; the message carries its traceback or every rank's stack."""

    group_intact: bool = False
    """True when every rank answered and each failed rank's exception said the process group is
    still in step (``group_intact`` on the exception): the group is then kept for the next call."""


# What the signal that ended a rank usually means, for the message that names it; any other
# signal is described by ``signal.strsignal``.
SIGNAL_CAUSES = {
    # A rank cannot catch SIGKILL, and nothing in the suite sends it but ``RankGroup.kill``, which
    # ends ranks the parent has already given up on.
    signal.SIGKILL: "likely the host's out-of-memory killer: see `dmesg` / `journalctl -k`",
    signal.SIGSEGV: "a segmentation fault in native code (a C++ or CUDA extension, a driver)",
    # Shared memory between processes lives in /dev/shm: 64 MB in a container unless --shm-size raises it.
    signal.SIGBUS: "a bus error, often /dev/shm full: raise a container's --shm-size",
    signal.SIGABRT: "an abort in native code (a failed assertion; NCCL or CUDA giving up)",
    signal.SIGTERM: "asked to stop from outside (a job scheduler, a time limit, `kill`)",
    signal.SIGFPE: "an arithmetic fault in native code",
    signal.SIGILL: "an illegal instruction: a binary built for another CPU",
}


def signal_cause(number: int) -> tuple[str, str]:
    """The name of signal ``number`` (``SIGKILL``) and what it likely means."""
    try:
        known = signal.Signals(number)
    except ValueError:
        return f"signal {number}", "an unknown signal"
    return known.name, SIGNAL_CAUSES.get(known) or (signal.strsignal(known) or known.name).lower()


class RankKilled(RankError):
    """A rank's process was ended by a signal (a negative exit code): most often the kernel's
    out-of-memory killer, when the host ran out of memory. ``summary``, the message's first line,
    names the rank, its process (the pid the kernel's log names), its group, the call, the signal
    and its likely cause; the rest carries what every rank said. The group's other ranks are
    ended: its next call starts fresh ones."""

    def __init__(self, summary: str, details: str = "", *, rank: int, label: str, signal_name: str) -> None:
        super().__init__(f"{summary}\n{details}" if details else summary)
        self.summary = summary
        self.rank = rank
        self.label = label
        self.signal_name = signal_name


class Withdrawn:
    """Base of results a rank returns when it leaves a call early without failing it (out of
    memory): the launcher then does not wait for the other ranks beyond a short grace, since they
    may be blocked in a collective the withdrawn rank will never join. Ranks still running after
    the grace get the withdrawn rank's result, and the group is replaced before its next call, as
    it is when ``group_broken`` says the communicator itself may be unusable."""

    group_broken: bool = False


BACKENDS = ("auto", "gloo", "nccl")


def choose_backend(backend: str, world_size: int) -> tuple[str, str]:
    """The backend to run and why: ``auto`` means NCCL when there is a GPU for every rank,
    otherwise gloo (on CPU tensors by default)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend, f"--backend {backend}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world_size and dist.is_nccl_available():
        return "nccl", f"auto: {gpus} GPU(s) for {world_size} rank(s)"
    if gpus:
        return "gloo", f"auto: {gpus} GPU(s), fewer than the {world_size} ranks nccl needs"
    return "gloo", "auto: no GPU"


def unavailable_reason(backend: str, world_size: int, device: str) -> str | None:
    """Why this configuration cannot run here, phrased as what to do; None when it can."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size < 1:
        return f"world size must be at least 1, got {world_size}"
    if backend == "nccl" and device == "cpu":
        return "nccl runs on GPUs only: drop --device cpu, or use --backend gloo for CPU tensors"
    if backend == "nccl":
        if gpus < world_size:
            return f"nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) found; use --backend gloo"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL; use --backend gloo"
    if device == "cuda" and gpus == 0:
        return "--device cuda needs a GPU, none found; use --device cpu"
    return None


def default_device(backend: str) -> str:
    """Where tensors live when no device is given: cuda for nccl, cpu for gloo."""
    return "cuda" if backend == "nccl" else "cpu"


@dataclass(frozen=True)
class RankInfo:
    """What a function running on a rank may ask about where it runs."""

    rank: int
    world_size: int
    backend: str
    device: torch.device


T = TypeVar("T")


@dataclass
class Rank:
    """A rank process as the functions run on it see it: where it runs, and what it keeps between
    calls. Made once per rank process by ``enter_rank`` (``RankGroup``'s worker, or a process that
    torchrun started) and handed to every function marked ``on_rank``, so that no module keeps a
    rank's state in a global of its own."""

    info: RankInfo
    _kept: dict[type, Any] = field(default_factory=dict)

    def keep(self, kind: type[T]) -> T:
        """This rank's one instance of ``kind``, made with ``kind()`` on first use and kept."""
        if kind not in self._kept:
            self._kept[kind] = kind()
        return self._kept[kind]


def on_rank(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as taking the calling ``Rank`` as its first argument when a ``RankGroup`` (or
    ``ddp.bench.rounds.in_process.InProcessRanks``) runs it; the caller passes only the other arguments."""
    fn.takes_rank = True
    return fn


def call_on_rank(rank: Rank, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    """Call ``fn`` as a rank runs it: with ``rank`` first if it is marked ``on_rank``."""
    return fn(rank, *args, **kwargs) if getattr(fn, "takes_rank", False) else fn(*args, **kwargs)


def enter_rank(info: RankInfo) -> Rank:
    """Make this process's ``Rank``: the one place that says where a rank process runs. It is
    handed to every function marked ``on_rank``: no module keeps it."""
    return Rank(info)


def share_cores(ranks_on_this_machine: int) -> None:
    """Give each CPU rank its share of the machine's cores instead of every rank oversubscribing
    all of them (threads fighting over cores make steps slower and noisier)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


def bind_to_cores(info: RankInfo, bound: bool) -> None:
    """Bind every thread of this CPU rank (its own and gloo's) to its share of the cores the
    process may use, rank r to the r-th share (round-robin, one core each, where ranks outnumber
    cores), or, ``bound`` False, let them run on all of them again, as they started. What MPI
    launchers do by default (Open MPI binds each process to a core when there are no more
    processes than cores) and a plain torchrun run does not: ``ddp.bench.rounds.allreduce`` binds
    its ranks while it times, because unbound, two gloo ranks' threads meeting on one core made a
    1 MiB all-reduce on this project's 2-core machine take 1.2 to 2.5 ms from one group of ranks
    to the next, and 0.7 to 0.9 ms bound. The training steps stay unbound, as a user's run is.
    On CUDA, and where the OS has no per-thread affinity (not Linux), nothing is done: a GPU
    rank's work is the GPU's, and binding it to a NUMA node is the cluster launcher's business."""
    tasks = Path("/proc/self/task")
    if info.device.type != "cpu" or not hasattr(os, "sched_setaffinity") or not tasks.is_dir():
        return
    allowed = sorted(_ALLOWED_CORES)
    if bound:
        share = max(1, len(allowed) // info.world_size)
        start = (info.rank * share) % len(allowed)
        cores = set(allowed[start:start + share])
    else:
        cores = set(allowed)
    for task in tasks.iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or one the OS keeps


# The cores a rank process may run on, read once when this module is imported (in the fork server:
# what every rank inherits, before anything binds it).
_ALLOWED_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))


def join_process_group(
    rank: int, world_size: int, local_rank: int, ranks_on_this_machine: int, backend: str, device_type: str, **init
) -> Rank:
    """Make this process rank ``rank``: its device (GPU ``local_rank``, or its share of the CPU
    cores), the process group (``init`` goes to ``init_process_group``: a store, or env://), and
    its ``Rank`` (``enter_rank``). Every rank joins here, ``RankGroup``'s workers and torchrun's
    processes alike."""
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        share_cores(ranks_on_this_machine)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, **({"device_id": device} if backend == "nccl" else {}), **init
    )
    return enter_rank(RankInfo(rank, world_size, backend, device))


# What torchrun (or any env:// launcher) sets for each process it starts.
TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunRank:
    """Where torchrun placed this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Ranks on this node."""

    @classmethod
    def from_environment(cls) -> TorchrunRank:
        """This process's place; ``ValueError`` saying how to start it when torchrun did not."""
        missing = [name for name in TORCHRUN_ENVIRONMENT if name not in os.environ]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set: start this under torchrun")
        return cls(*(int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")))

    def join(self, backend: str, device_type: str) -> Rank:
        """Join the process group torchrun's environment describes (``join_process_group``)."""
        return join_process_group(self.rank, self.world_size, self.local_rank, self.local_world_size, backend, device_type,
                                  init_method="env://")

    @staticmethod
    def leave() -> None:
        """Leave the process group together: every rank waits for the others (rank 0 may still be
        writing the run) before the group is destroyed."""
        dist.barrier()
        dist.destroy_process_group()


# What a rank process has imported before it is forked (``rank_process_context``); the layers
# above add what their ranks run (``preload_in_ranks``).
RANK_PRELOAD = ["torch", "torch.distributed", "ddp.launcher"]


def preload_in_ranks(*modules: str) -> None:
    """Have every rank process forked from now on import ``modules`` already (the fork server
    imports them once): what the ranks run at their first call would otherwise cost each rank of
    each group its import time then. Takes effect for a fork server not yet started: call it at
    import time, before the first ``RankGroup`` starts."""
    RANK_PRELOAD.extend(module for module in modules if module not in RANK_PRELOAD)


def rank_process_context() -> multiprocessing.context.BaseContext:
    """How rank processes are started: forked from multiprocessing's fork server, a clean
    single-threaded process started once per parent that has imported torch (``RANK_PRELOAD``).
    A rank then starts in a fraction of a second instead of importing torch again (2.5 s of CPU
    here, for each rank of each group), and finds what its calls run imported already.

    On CUDA: the fork server never touches a GPU (importing torch does not initialise CUDA), so
    each rank initialises CUDA itself after the fork, which CUDA requires; PyTorch's
    multiprocessing notes name "spawn" and "forkserver" as the start methods that work with CUDA.
    The ranks' environment is the parent's at each start (``_worker_main`` sets it), as with spawn;
    what torch reads at import (``TORCH_*`` logging settings) is the parent's when the server
    started. A rank's parent is the fork server, which exits when this process does, so
    ``_die_with_parent`` still ends the ranks with it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    return context


# The name a rank process goes by (``/proc/PID/comm``, what ps, top and nvidia-smi show): its
# command line is the fork server's, so this is how a rank is told from the server.
RANK_PROCESS_NAME = "ddp-bench-rank"


def _die_with_parent(rank: int) -> None:
    """End this process with its parent, and name it ``RANK_PROCESS_NAME`` and its rank."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, f"{RANK_PROCESS_NAME}{rank}".encode()[:15])
    except OSError:
        pass  # not Linux: the parent's atexit handler still ends the ranks


def _worker_main(
    rank: int, world_size: int, backend: str, device_type: str, store_path: str, stack_dir: str, conn,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, environment: dict[str, str] | None = None,
) -> None:
    if environment is not None:  # the parent's, as it is now: the fork server's is from its own start
        os.environ.clear()
        os.environ.update(environment)
    _die_with_parent(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    store = dist.FileStore(store_path, world_size)
    # Longer than a call's timeout, so that a hang is reported by the parent with every rank's
    # stack rather than ended by the collective's own timeout.
    timeout = datetime.timedelta(seconds=timeout_seconds * 2)
    local_rank = rank % torch.cuda.device_count() if device_type == "cuda" else rank
    this_rank = join_process_group(rank, world_size, local_rank, world_size, backend, device_type, store=store, timeout=timeout)
    conn.send(("ready", None))
    try:
        while True:
            try:
                task = conn.recv()
            except EOFError:
                return
            if task is None:
                return
            fn, args, kwargs = task
            try:
                result = call_on_rank(this_rank, fn, args, kwargs)
            except BaseException as error:
                # An exception may say the ranks left the group in step (e.g. every rank stopped
                # before the same collective): then the parent keeps the group.
                conn.send(("error_intact" if getattr(error, "group_intact", False) else "error", traceback.format_exc()))
            else:
                conn.send(("ok", result))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()
_started_seconds = [0.0]  # every group's starts in this process: a run's time by part reads it


def started_seconds() -> float:
    """Seconds this process has spent starting groups of ranks (the fork server's imports, forking,
    joining the process group: on CUDA each rank's context and, at its first collective, NCCL's
    communicator)."""
    return _started_seconds[0]


@atexit.register
def _close_live_groups() -> None:
    for group in list(_live_groups):
        group.close()


class RankGroup:
    """A reusable group of ``world_size`` rank processes sharing one process group."""

    def __init__(
        self,
        world_size: int = 2,
        backend: str = "auto",
        device: str | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        label: str | None = None,
    ) -> None:
        """``label`` names the group where its errors are reported ("rank 1 of {label} was
        killed"), e.g. "timing group 2" or "the tracing ranks"; default "a group of N ranks"."""
        self.world_size = world_size
        self.label = label or f"a group of {world_size} rank{'s' if world_size != 1 else ''}"
        self.backend = choose_backend(backend, world_size)[0]
        self.device = device or default_device(self.backend)
        reason = unavailable_reason(self.backend, world_size, self.device)
        if reason:
            raise RuntimeError(reason)
        self.timeout_seconds = timeout_seconds
        self._processes: list[multiprocessing.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None
        self.starts = 0  # how many times ranks were (re)started: tests of recovery read it
        self._replace_before_next_call = False

    @property
    def started(self) -> bool:
        return bool(self._processes)

    @property
    def usable(self) -> bool:
        """Started, and not to be replaced before its next call (a rank withdrew and the others
        may be stuck): what is asked of it now runs on these processes."""
        return self.started and not self._replace_before_next_call

    def start(self) -> None:
        if self.started:
            return
        started = time.perf_counter()
        context = rank_process_context()
        self._tmpdir = tempfile.mkdtemp(prefix="ddp-bench-ranks-")
        store_path = os.path.join(self._tmpdir, "store")
        _live_groups.add(self)
        for rank in range(self.world_size):
            parent_conn, child_conn = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, self.device, store_path, self._tmpdir, child_conn,
                      self.timeout_seconds, dict(os.environ)),
                name=f"{RANK_PROCESS_NAME}{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            self._processes.append(process)
            self._conns.append(parent_conn)
        self.starts += 1
        try:
            self._collect(timeout_seconds=120.0, what="starting the process group")
        except BaseException:
            self.kill()
            raise
        finally:
            _started_seconds[0] += time.perf_counter() - started

    def run(self, fn: Callable[..., Any], *args, timeout_seconds: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank (``fn(rank, *args, **kwargs)`` if it is marked
        ``on_rank``); return each rank's result, by rank.

        ``fn`` must be importable by its module path (defined at module level), as must its
        arguments and result be picklable.
        """
        if self._replace_before_next_call:
            self.kill()
            self._replace_before_next_call = False
        self.start()
        what = _describe(fn)
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send((fn, args, kwargs))
                except OSError as error:  # BrokenPipeError, ConnectionResetError: its process is gone
                    raise self._send_failed(rank, what, error) from None
            return self._collect(timeout_seconds or self.timeout_seconds, what=what)
        except RankError as error:
            if not error.group_intact:
                self.kill()
            raise
        except BaseException:
            # Whatever went wrong (a rank's error, a hang, Ctrl-C), the ranks may be stuck in a
            # collective: replace them rather than reuse them.
            self.kill()
            raise

    def _collect(self, timeout_seconds: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        signals: dict[int, int] = {}  # ranks whose process a signal ended: the signal's number
        intact: set[int] = set()  # ranks whose error left the group in step
        withdrawn: Withdrawn | None = None
        withdrawal_deadline = float("inf")
        deadline = time.monotonic() + timeout_seconds
        conn_rank = {id(conn): rank for rank, conn in enumerate(self._conns)}
        sentinel_rank = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while len(results) + len(errors) < self.world_size:
            pending = [c for r, c in enumerate(self._conns) if r not in results and r not in errors]
            pending_sentinels = [s for s, r in sentinel_rank.items() if r not in results and r not in errors]
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, GRACE_AFTER_FAILURE_SECONDS)
            elif withdrawn is not None:
                remaining = min(remaining, withdrawal_deadline - time.monotonic())
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(pending + pending_sentinels, timeout=remaining)
            if not ready:
                break
            for item in ready:
                if isinstance(item, int):  # a sentinel: the process exited
                    rank = sentinel_rank[item]
                    conn = self._conns[rank]
                    if conn.poll():
                        continue  # it sent something before dying; read that first
                    errors[rank] = self._death_message(rank, signals)
                    continue
                rank = conn_rank[id(item)]
                try:
                    status, payload = item.recv()
                except (EOFError, OSError):  # the rank's process ended without a word (reset: it left a call unread)
                    errors[rank] = self._death_message(rank, signals)
                    continue
                if status in ("error", "error_intact"):
                    errors[rank] = payload
                    if status == "error_intact":
                        intact.add(rank)
                else:
                    results[rank] = payload
                    if isinstance(payload, Withdrawn) and withdrawn is None:
                        withdrawn = payload
                        withdrawal_deadline = time.monotonic() + GRACE_AFTER_WITHDRAWAL_SECONDS
        if errors:
            shown = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
            headline = f"{len(errors)} of {self.world_size} ranks of {self.label} failed in {what}:\n{shown}"
            if signals:
                raise self._killed(min(signals), signals[min(signals)], what, headline)
            error = RankError(headline)
            error.group_intact = len(results) + len(errors) == self.world_size and intact == set(errors)
            raise error
        if withdrawn is not None:
            stuck = [r for r in range(self.world_size) if r not in results]
            if stuck or any(isinstance(r, Withdrawn) and r.group_broken for r in results.values()):
                # The stuck ranks wait in a collective the withdrawn rank left, or the communicator
                # may be broken: replace the group before its next call.
                self._replace_before_next_call = True
            return [results.get(rank, withdrawn) for rank in range(self.world_size)]
        if len(results) < self.world_size:
            stuck = [r for r in range(self.world_size) if r not in results]
            raise RankError(
                f"{what} timed out after {timeout_seconds:.0f} s; ranks {stuck} did not finish. "
                f"Where each rank was:\n{self._dump_stacks(stuck)}"
            )
        return [results[rank] for rank in range(self.world_size)]

    def _death_message(self, rank: int, signals: dict[int, int]) -> str:
        """What ended rank ``rank``'s process; a signal's number is added to ``signals``."""
        code = self._exit_code(rank)
        if code is not None and code < 0:
            signals[rank] = -code
            name, cause = signal_cause(-code)
            return f"rank {rank} (pid {self._processes[rank].pid}) was killed by {name}: {cause}"
        return f"rank {rank} died with exit code {code}"

    def _exit_code(self, rank: int) -> int | None:
        # The pipe and the sentinel close a moment before the process can be reaped.
        self._processes[rank].join(5.0)
        return self._processes[rank].exitcode

    def _killed(self, rank: int, number: int, what: str, details: str = "") -> RankKilled:
        name, cause = signal_cause(number)
        summary = f"rank {rank} of {self.label} (pid {self._processes[rank].pid}) was killed by {name} in {what}, {cause}"
        details = "\n".join(filter(None, ["its other ranks were ended; the next call starts fresh ones", details]))
        return RankKilled(summary, details, rank=rank, label=self.label, signal_name=name)

    def _send_failed(self, rank: int, what: str, error: OSError) -> RankError:
        """The error of a call that could not be sent to rank ``rank``: ``RankKilled`` when a
        signal had ended its process (between calls: the out-of-memory killer picks the process
        that holds the most memory, busy or not)."""
        code = self._exit_code(rank)
        if code is not None and code < 0:
            return self._killed(rank, -code, what)
        ended = "its process is running" if code is None else f"its process died with exit code {code}"
        return RankError(f"rank {rank} of {self.label} could not be sent {what} ({error}): {ended}")

    def _dump_stacks(self, ranks: list[int]) -> str:
        for rank in ranks:
            if self._processes[rank].is_alive():
                os.kill(self._processes[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes from a signal handler; give it a moment
        dumps = []
        for rank in ranks:
            path = Path(self._tmpdir) / f"rank{rank}.txt"
            text = path.read_text() if path.exists() else ""
            dumps.append(f"--- rank {rank} ---\n{text.strip() or '(no stack: the rank was not running Python)'}")
        return "\n".join(dumps)

    def close(self) -> None:
        """Ask every rank to leave its process group and exit; end any that do not."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """End every rank at once and remove the rendezvous folder."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        _live_groups.discard(self)

    def __enter__(self) -> RankGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
