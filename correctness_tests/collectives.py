"""Every rank must issue the same collectives: checked before each one, so a mismatch is named
instead of crashing the backend.

A DDP class whose ranks issue different collectives (a different count, size, dtype, operation or
order; typically a per-parameter DDP that all-reduces only the gradients this rank produced, on a
model whose ranks use different parameters) does not fail with a mismatch on gloo: it aborts the
process (``Received data size doesn't match expected size``), resets the other rank's connection,
or leaves one rank waiting for a collective that never comes. So while the correctness suite
trains a strategy, ``checking`` wraps ``torch.distributed``'s collective functions: before a
collective on the default group runs, every rank exchanges what it is about to issue on a side
gloo group of its own, and at the end of each phase (wrapping the module, each step) how many it
issued. The side exchanges stay in lockstep even when the real collectives do not (a rank that
issues one collective fewer meets the others' next collective with its end of the phase), so
every rank finds the first difference at the same exchange, before any mismatched collective
reaches the backend, and raises ``CollectiveMismatch`` naming the phase, what each rank issued
and the likely cause. The process group stays in step, so the launcher keeps it for the next test.

What it sees: calls through ``torch.distributed.<collective>`` (``dist.all_reduce(...)``), as a
DDP class written against the public API makes them, on the default group. Not seen: a function
imported by name before the check started (``from torch.distributed import all_reduce``),
collectives on other groups, and C++ callers (PyTorch's own DDP reducer), which issue matching
collectives by construction. This is the check ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes in C++
(a fingerprint of each collective compared across ranks), made here per phase so that a count
that differs at the end of a step is named too, and the cause can be told from the parameters
each rank used.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# torch.distributed's collectives that a DDP class may call; those this torch lacks are skipped.
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "all_reduce_coalesced",
)  # fmt: skip
LISTED = 6  # a rank's collectives shown in a message, then "and N more"

UNUSED_HINT = (
    "parameters unused on some ranks: a DDP must still reduce them, as PyTorch's does with "
    "find_unused_parameters=True"
)


class CollectiveMismatch(AssertionError):
    """The ranks issued different collectives in one phase; the message says which and why.
    Every rank raises it at the same exchange, before the mismatched collective: the process
    group is still in step, and the launcher keeps it."""

    group_intact = True


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _op_name(op) -> str:
    """SUM, AVG, ...: a ``ReduceOp`` object prints its address, which differs between ranks."""
    if hasattr(op, "name"):
        return op.name
    return next((member.name for member in dist.ReduceOp.RedOpType.__members__.values() if op == member), type(op).__name__)


class CollectiveCheck:
    """Checks one rank's collectives against the other ranks', phase by phase.

    ``describe(tensor)`` names a tensor for messages (e.g. "'fc1.weight' gradient"), or None.
    """

    def __init__(self, group: dist.ProcessGroup, describe: Callable[[torch.Tensor], str | None] = lambda t: None) -> None:
        self.group = group
        self.describe = describe
        self.phase = "wrapping the module"
        self.unused: tuple[str, ...] = ()
        self.issued: list[str] = []
        self._inside = threading.local()  # a collective's own inner calls are not checked again

    def begin(self, phase: str, unused: Sequence[str] = ()) -> None:
        """Start a phase; ``unused``: the trainable parameters this rank's data leaves unused in it."""
        self.phase, self.unused, self.issued = phase, tuple(unused), []

    def end(self) -> None:
        """Every rank must have issued as many collectives in this phase as this one."""
        self._exchange(("end", len(self.issued)), f"ended {self.phase} after {len(self.issued)} collective(s)")

    def before(self, name: str, arguments: dict) -> None:
        """Exchange the collective about to run (its arguments by name) with every rank's."""
        tensors = [t for key in ("tensor", "tensor_list", "output_tensor", "output", "output_tensor_list", "tensors")
                   for t in _tensors(arguments.get(key))]  # fmt: skip
        op = arguments.get("op", dist.ReduceOp.SUM if "reduce" in name else None)  # the default, said or not
        op = None if op is None else _op_name(op)
        src = arguments.get("src", arguments.get("group_src"))
        fingerprint = (name, tuple((tuple(t.shape), str(t.dtype)) for t in tensors), op, src)
        details = [", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)]
        details += [f"op={op}"] if op is not None else []
        details += [f"src={src}"] if src is not None else []
        described = f"{name}({', '.join(d for d in details if d)})"
        names = [n for n in (self.describe(t) for t in tensors) if n]
        if names:
            described += f" of {', '.join(names)}"
        self._exchange(("collective", len(self.issued), fingerprint), f"collective {len(self.issued) + 1}: {described}")
        self.issued.append(described)

    def _exchange(self, mine: tuple, described: str) -> None:
        everyone: list = [None] * self.group.size()
        dist.all_gather_object(everyone, (mine, described), group=self.group)
        if all(entry == everyone[0][0] for entry, _ in everyone):
            return
        # Every rank found the same difference at the same exchange: one more, aligned, for the story.
        stories: list = [None] * self.group.size()
        dist.all_gather_object(stories, (self.issued, self.unused), group=self.group)
        raise CollectiveMismatch(self._message(everyone, stories))

    def _message(self, everyone: list, stories: list) -> str:
        lines = [f"{self.phase}: the ranks issued different collectives (each rank must issue the same ones, "
                 "in the same order, with the same sizes); where they first differ:"]
        for rank, (_, described) in enumerate(everyone):
            lines.append(f"  rank {rank}: {described}")
        for rank, (issued, _) in enumerate(stories):
            shown = "; ".join(issued[:LISTED]) + (f"; and {len(issued) - LISTED} more" if len(issued) > LISTED else "")
            lines.append(f"  rank {rank} issued before that, in {self.phase}: {shown or 'nothing'}")
        unused = [set(names) for _, names in stories]
        if any(u != unused[0] for u in unused):
            everywhere = set.intersection(*unused)
            which = "; ".join(
                f"rank {rank} did not use {', '.join(repr(n) for n in sorted(u - everywhere))}"
                for rank, u in enumerate(unused) if u - everywhere
            )  # fmt: skip
            lines.append(f"  hint: {UNUSED_HINT} ({which}): issue the same collectives on every rank, "
                         "with a zero gradient where this rank has none")
        else:
            lines.append("  hint: a collective that depends on the rank or its data (a branch on the rank, the order "
                         "in which gradients became ready, a size read from the data)")
        return "\n".join(lines)


_side_group: dist.ProcessGroup | None = None


def side_group() -> dist.ProcessGroup:
    """The gloo group the checks exchange on, made once per rank process (every rank makes it at
    the same call, the first check of the session)."""
    global _side_group
    if _side_group is None:
        _side_group = dist.new_group(backend="gloo")
    return _side_group


@contextlib.contextmanager
def checking(check: CollectiveCheck) -> Iterator[CollectiveCheck]:
    """While inside, every collective on the default group through ``torch.distributed`` is checked."""
    originals = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}
    world = c10d.GroupMember.WORLD

    def wrap(name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def checked(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            group = arguments.get("group")
            if getattr(check._inside, "active", False) or (group is not None and group is not world):
                return original(*args, **kwargs)
            check._inside.active = True
            try:
                check.before(name, arguments)
                return original(*args, **kwargs)
            finally:
                check._inside.active = False

        checked.__wrapped__ = original
        return checked

    wrapped = {name: wrap(name, original) for name, original in originals.items()}
    for module in (dist, c10d):
        for name, function in wrapped.items():
            if hasattr(module, name):
                setattr(module, name, function)
    try:
        yield check
    finally:
        for module in (dist, c10d):
            for name, original in originals.items():
                if hasattr(module, name):
                    setattr(module, name, original)
