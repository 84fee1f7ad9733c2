"""Why a DDP class does not train like one process: the first mismatch, measured and explained.

The correctness suite trains a strategy and a single-process reference side by side. A bare
``assert_close`` says only that they differ. This module says where they differ (step, rank,
parameter), by how much (the largest absolute and relative difference, measured as
``torch.testing`` measures them), and, for the mistakes DDP classes often make, why:

- every parameter differs right after wrapping: it was not broadcast from rank 0;
- every gradient is world-size times too large: gradients were summed, not averaged;
- only a tied (shared) weight's gradient is off: it was reduced once for each of its names;
- a frozen parameter got a gradient or moved: frozen parameters were synchronized;
- only parameters that no rank used are wrong: they got zeros where one process leaves None;
- a gradient is None where one process has one: it was never synchronized (a hook missed);
- a gradient equals the one this rank computed alone: gradients were never all-reduced.

For a strategy that shards its gradients (FSDP), only values can be compared; the update a step
made (value after minus value before) then tells the sharded optimizer's mistakes apart:

- a parameter did not move on any rank: its shard was never stepped;
- it moved on some rank but not on this one: the updated shard was not gathered back;
- every update is world-size times one process's, with SGD: gradients summed, not averaged;
- an update further than one process's otherwise: a shard stepped more than once.

Gradients are compared before parameters. They are a strategy's whole job, and a wrong gradient
explains a wrong parameter but not the other way round. Each ``diagnose_*`` function is a pure
function of tensors keyed by parameter name, as ``named_parameters()`` names them. So it runs the
same on any rank, and in unit tests with no ranks at all. The ``named_*`` helpers at the bottom
build those dicts from a module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

# torch.testing.assert_close's defaults for float32, which the correctness suite uses for
# parameters: a value matches when |actual - expected| <= ATOL + RTOL * |expected|.
RTOL = 1e-4
ATOL = 1e-5
# A gradient counts as "k times the single-process one" when it equals k * reference within the
# tolerances above. Its k counts as the world size when it is within this fraction of it.
SCALE_TOLERANCE = 1e-2
MAX_NAMES_LISTED = 5  # longer lists of other mismatching parameters end with "and N more"

Tensors = Mapping[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class Mismatch:
    """Where a strategy first departs from single-process training, by how much, and why."""

    step: int | None
    """Training step, counted from 0. None means right after wrapping, before the first step."""
    rank: int
    name: str
    """The parameter's (or buffer's) name, as ``named_parameters()`` gives it."""
    quantity: str
    """What differs: "gradient" (before optimizer.step()), "value" (after it) or "initial value"."""
    max_abs_diff: float
    """Largest |actual - expected| over the tensor's elements. A missing gradient counts as zeros."""
    max_rel_diff: float
    """Largest |actual - expected| / |expected|. It is inf where expected is 0 and actual is not."""
    kind: str = "parameter"
    """"parameter" or "buffer"."""
    detail: str | None = None
    """What the two numbers cannot show, e.g. "the gradient is None here ..."."""
    also_differ: tuple[str, ...] = ()
    """The other parameters whose same quantity differs, in ``named_parameters()`` order."""
    hint: str | None = None
    """The likely mistake and its fix. None when the pattern is not one listed above."""

    def __str__(self) -> str:
        when = "before the first step" if self.step is None else f"step {self.step}"
        lines = [
            f"{when}, rank {self.rank}, {self.kind} {self.name!r}: "
            f"largest absolute difference {self.max_abs_diff:.1e}, "
            f"largest relative difference {self.max_rel_diff:.1e} ({self.quantity})"
        ]
        if self.detail:
            lines.append(f"  {self.detail}")
        if self.also_differ:
            shown = ", ".join(repr(name) for name in self.also_differ[:MAX_NAMES_LISTED])
            more = len(self.also_differ) - MAX_NAMES_LISTED
            lines.append(f"  also differ ({self.quantity}): {shown}" + (f" and {more} more" if more > 0 else ""))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Difference:
    name: str
    max_abs: float
    max_rel: float
    detail: str | None = None


def _as_float64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float64)


def _difference(
    name: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    rtol: float,
    atol: float,
    what: str = "the gradient",
) -> _Difference | None:
    """None when ``actual`` matches ``expected`` as ``assert_close`` would judge (NaN never matches).

    None matches only None. Compared with a tensor it counts as zeros for the numbers, and the
    difference's ``detail`` says which side was None.
    """
    if actual is None and expected is None:
        return None
    if actual is not None and expected is not None:
        if actual.shape != expected.shape:
            detail = f"{what} has shape {tuple(actual.shape)} here, {tuple(expected.shape)} in single-process training"
            return _Difference(name, math.inf, math.inf, detail)
        if actual.dtype != expected.dtype:
            detail = f"{what} is {actual.dtype} here, {expected.dtype} in single-process training"
            return _Difference(name, math.inf, math.inf, detail)
    detail = None
    if actual is None:
        detail = f"{what} is None here, a tensor in single-process training"
        actual = torch.zeros_like(expected)
    elif expected is None:
        zeros = " of zeros" if not actual.any() else ""
        detail = f"{what} is a tensor{zeros} here, None in single-process training"
        expected = torch.zeros_like(actual)
    a, e = _as_float64(actual), _as_float64(expected)
    if detail is None and torch.isclose(a, e, rtol=rtol, atol=atol).all():
        return None
    if a.numel() == 0:
        return _Difference(name, 0.0, 0.0, detail)
    diff = (a - e).abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / e.abs())  # x/0 = inf, 0/0 = 0
    return _Difference(name, diff.max().item(), rel.max().item(), detail)


def _scale(actual: torch.Tensor | None, expected: torch.Tensor | None, rtol: float, atol: float) -> float | None:
    """The k for which ``actual`` equals ``k * expected`` within the tolerances, or None if none does."""
    if actual is None or expected is None or actual.shape != expected.shape:
        return None
    a, e = _as_float64(actual), _as_float64(expected)
    squared_norm = (e * e).sum()
    if not squared_norm > 0:
        return None
    k = ((a * e).sum() / squared_norm).item()  # least squares: the k minimizing |a - k e|
    return k if torch.isclose(a, k * e, rtol=rtol, atol=atol).all() else None


def _check_names(reference: Mapping, actual: Mapping, what: str) -> None:
    if list(reference) != list(actual):
        missing = [name for name in reference if name not in actual]
        extra = [name for name in actual if name not in reference]
        raise ValueError(
            f"the strategy's {what} are not named like single-process training's: "
            f"missing {missing}, unexpected {extra}, or a different order. "
            "The DDP class's .module must be the module it was given"
        )


def diagnose_initial(
    rank: int,
    reference: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    *,
    kind: str = "parameter",
    rtol: float = RTOL,
    atol: float = ATOL,
) -> Mismatch | None:
    """Compare a module's values right after wrapping with rank 0's own, before any step.

    ``reference``: rank 0's values before wrapping, as ``named_values`` or ``named_buffer_values``
    gives them. ``actual``: this rank's wrapped module's values. ``kind``: "parameter" or "buffer",
    for the message.
    """
    _check_names(reference, actual, f"{kind}s")
    differences = [d for name in reference if (d := _difference(name, actual[name], reference[name], rtol, atol))]
    if not differences:
        return None
    first = differences[0]
    if rank == 0:
        hint = (
            f"wrapping the module changed rank 0's own {kind}s. The constructor may only copy rank 0's "
            "values to the other ranks, never change them"
        )
    else:
        hint = (
            f"this rank starts from other {kind}s than rank 0: {kind}s were not broadcast from rank 0. "
            "Broadcast every parameter and buffer from rank 0 when wrapping the module "
            "(torch.distributed.broadcast(tensor, src=0))"
        )
    return Mismatch(
        step=None,
        rank=rank,
        name=first.name,
        quantity="initial value",
        max_abs_diff=first.max_abs,
        max_rel_diff=first.max_rel,
        kind=kind,
        detail=first.detail,
        also_differ=tuple(d.name for d in differences[1:]),
        hint=hint,
    )


def diagnose_step(
    step: int,
    rank: int,
    world_size: int,
    reference_grads: Tensors,
    actual_grads: Tensors,
    reference_params: Mapping[str, torch.Tensor],
    actual_params: Mapping[str, torch.Tensor],
    *,
    frozen: Collection[str] = (),
    tied: Sequence[Sequence[str]] = (),
    local_grads: Tensors | None = None,
    previous_params: Mapping[str, torch.Tensor] | None = None,
    moved_on_some_rank: Collection[str] = (),
    update_proportional_to_gradient: bool = False,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> Mismatch | None:
    """Compare one training step of a strategy with single-process training on the whole batch.

    Every mapping is keyed by parameter name, in ``named_parameters()`` order, one entry for each
    tensor (a tied weight appears once, under its first name).

    reference_grads / actual_grads: the gradients that single-process training and this rank's
        strategy hold just before ``optimizer.step()``, so after
        ``finish_gradient_synchronization()``. None where a parameter has no gradient.
        ``actual_grads`` None: the strategy shards gradients, only values are compared.
    reference_params / actual_params: the parameters after ``optimizer.step()``.
    frozen: names of the parameters with ``requires_grad=False``.
    tied: for each tensor shared between several names, all of its names (see ``named_ties``).
    local_grads: optional. The gradients this rank would hold if it never communicated, i.e. the
        single-process model's gradients on this rank's rows alone. With them, a strategy that
        never all-reduces is named as such.
    previous_params: optional. This rank's parameters before the step; with them a wrong value
        is explained by the update the step made (module docstring).
    moved_on_some_rank: names of the parameters that took single-process training's update on
        at least one rank in this step (the harness agrees on them with a collective).
    update_proportional_to_gradient: the optimizer's update scales with the gradient (SGD;
        Adam's does not), so summed gradients show as a world-size-times update.

    A parameter that got no gradient in single-process training, and is not frozen, is unused.
    Returns None when everything matches within ``rtol``/``atol``. Otherwise returns the first
    gradient mismatch, or, if every gradient matches, the first parameter mismatch.
    """
    _check_names(reference_params, actual_params, "parameters")
    grad_differences = []
    if actual_grads is not None:
        _check_names(reference_grads, actual_grads, "gradients")
        grad_differences = [
            d for name in reference_grads if (d := _difference(name, actual_grads[name], reference_grads[name], rtol, atol))
        ]
    if grad_differences:
        hint, reported = _explain_gradients(
            grad_differences, world_size, reference_grads, actual_grads, set(frozen), tied, local_grads, rtol, atol
        )
        return _mismatch(step, rank, "gradient", reported, grad_differences, hint)
    value_differences = [
        d
        for name in reference_params
        if (d := _difference(name, actual_params[name], reference_params[name], rtol, atol, what="the value"))
    ]
    if value_differences:
        frozen_ones = [d for d in value_differences if d.name in frozen]
        if frozen_ones:
            reported = frozen_ones[0]
            hint = (
                f"{reported.name!r} has requires_grad=False, yet its value changed. A frozen parameter "
                "must stay as it is: synchronize, zero and step only parameters with requires_grad=True"
            )
        elif previous_params is not None and (
            explained := _explain_update(
                value_differences, world_size, reference_params, actual_params, previous_params,
                set(moved_on_some_rank), update_proportional_to_gradient, rtol, atol,
            )
        ):
            hint, reported = explained
        elif actual_grads is None:
            reported = value_differences[0]
            hint = None
        else:
            reported = value_differences[0]
            hint = (
                "every gradient matched single-process training, but the value after optimizer.step() "
                "does not. Something changed the parameter outside its gradient: the wrapper's forward "
                "or hooks, a broadcast after the first step, or a second optimizer"
            )
        return _mismatch(step, rank, "value", reported, value_differences, hint)
    return None


def _explain_update(
    differences: list[_Difference],
    world_size: int,
    reference_params: Mapping[str, torch.Tensor],
    actual_params: Mapping[str, torch.Tensor],
    previous_params: Mapping[str, torch.Tensor],
    moved_on_some_rank: set[str],
    update_proportional_to_gradient: bool,
    rtol: float,
    atol: float,
) -> tuple[str, _Difference] | None:
    """A sharded optimizer's mistake read from the updates (module docstring), or None."""
    stale = [d for d in differences if _difference(d.name, actual_params[d.name], previous_params[d.name], 0.0, 0.0) is None]
    if stale:
        elsewhere = [d for d in stale if d.name in moved_on_some_rank]
        if elsewhere:
            return (
                f"{elsewhere[0].name!r} kept its value from before the step on this rank, while another rank "
                "holds its updated value: the updated shard was not gathered back. After stepping its "
                "shard, each rank must send its parameters to every other rank (broadcast or all-gather)",
                elsewhere[0],
            )
        return (
            f"{stale[0].name!r} kept its value from before the step on every rank: its shard was never "
            "stepped. Every trainable parameter must belong to exactly one rank's optimizer",
            stale[0],
        )

    def update(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return _as_float64(params[name]) - _as_float64(previous_params[name])

    scales = [_scale(update(actual_params, d.name), update(reference_params, d.name), 1e-2, 1e-6) for d in differences]
    if any(k is None for k in scales):
        return None
    if update_proportional_to_gradient and world_size > 1 and all(abs(k - world_size) <= SCALE_TOLERANCE * world_size for k in scales):
        return (
            f"the update is {scales[0]:.2f}x the single-process one, the world size: gradients are summed, "
            "not averaged (divide by the world size before or after the reduce-scatter)",
            differences[0],
        )
    if all(k > 1 + SCALE_TOLERANCE for k in scales):
        return (
            f"the update is {scales[0]:.2f}x the single-process one: a shard was stepped more than once. "
            "Call the inner optimizer's step() once per step, on this rank's shard only",
            differences[0],
        )
    return None


def _mismatch(
    step: int, rank: int, quantity: str, reported: _Difference, differences: list[_Difference], hint: str | None
) -> Mismatch:
    return Mismatch(
        step=step,
        rank=rank,
        name=reported.name,
        quantity=quantity,
        max_abs_diff=reported.max_abs,
        max_rel_diff=reported.max_rel,
        detail=reported.detail,
        also_differ=tuple(d.name for d in differences if d is not reported),
        hint=hint,
    )


def _explain_gradients(
    differences: list[_Difference],
    world_size: int,
    reference_grads: Tensors,
    actual_grads: Tensors,
    frozen: set[str],
    tied: Sequence[Sequence[str]],
    local_grads: Tensors | None,
    rtol: float,
    atol: float,
) -> tuple[str | None, _Difference]:
    """The hint for these gradient differences, and which difference to report with it.

    The patterns are tried from the most specific to the least specific. A frozen parameter
    with a gradient explains itself, whatever else differs. "Summed" needs every difference to
    fit it.
    """
    for d in differences:
        if d.name in frozen:
            return (
                f"{d.name!r} has requires_grad=False but got a gradient. A frozen parameter must keep "
                ".grad None, or the optimizer moves it (weight decay, momentum). Synchronize only "
                "parameters with requires_grad=True",
                d,
            )
    if all(reference_grads[d.name] is None for d in differences):
        names = ", ".join(repr(d.name) for d in differences[:MAX_NAMES_LISTED])
        return (
            f"only parameters that got no gradient in single-process training differ ({names}): "
            "no rank used them, and single-process training leaves their .grad None. A zero "
            "gradient instead lets weight decay and momentum move them. Give a parameter a gradient "
            "only if some rank used it (all-reduce a used-mask of which ranks have a .grad first)",
            differences[0],
        )
    for d in differences:
        if actual_grads[d.name] is None:
            return (
                "the gradient is None after finish_gradient_synchronization(), but single-process "
                "training has one: it was never synchronized. Either this rank did not use the "
                "parameter and did not join its all-reduce (give it a zero gradient and reduce it with "
                "the ranks that used it), or a gradient hook never fired",
                d,
            )
    first = differences[0]
    names_of = {group[0]: tuple(group) for group in tied if len(group) > 1}
    untied_with_gradient = [n for n in reference_grads if n not in names_of and reference_grads[n] is not None]
    if all(d.name in names_of for d in differences) and untied_with_gradient:
        names = names_of[first.name]
        scale = _scale(actual_grads[first.name], reference_grads[first.name], rtol, atol)
        times = f"{scale:.2f}x the single-process one" if scale is not None else "off"
        return (
            f"{first.name!r} is one tensor under {len(names)} names ({', '.join(map(repr, names))}). Its gradient "
            f"is {times}, while every untied parameter matches: it was reduced once for each of its names. "
            "Reduce each tensor once: module.parameters() lists a shared tensor once, while "
            "named_parameters(remove_duplicate=False) and per-module loops list it once for each name",
            first,
        )
    if local_grads is not None and all(
        _difference(d.name, actual_grads[d.name], local_grads[d.name], rtol, atol) is None for d in differences
    ):
        return (
            "the gradient equals the one this rank computed from its own rows alone: gradients were "
            "not all-reduced, so the ranks differ and each one trains on its own data. All-reduce "
            "every gradient with ReduceOp.AVG in finish_gradient_synchronization()",
            first,
        )
    scales = [_scale(actual_grads[d.name], reference_grads[d.name], rtol, atol) for d in differences]
    if world_size > 1 and all(
        k is not None and abs(k - world_size) <= SCALE_TOLERANCE * world_size for k in scales
    ):
        return (
            f"the gradient is {scales[0]:.2f}x the single-process one, the world size: gradients are "
            "summed, not averaged (divide by the world size or use ReduceOp.AVG)",
            first,
        )
    return None, first


# --- Gathering the inputs from a module -------------------------------------------------------


def _named(module: nn.Module, value: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {name: value(param) for name, param in module.named_parameters()}


def named_gradients(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of each parameter's ``.grad`` (None where it has none), keyed by name."""
    return _named(module, lambda p: None if p.grad is None else p.grad.detach().clone())


def named_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each parameter's value, keyed by name."""
    return _named(module, lambda p: p.detach().clone())


def named_buffer_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each buffer, keyed by name."""
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def frozen_names(module: nn.Module) -> frozenset[str]:
    """Names of the parameters with ``requires_grad=False``."""
    return frozenset(name for name, param in module.named_parameters() if not param.requires_grad)


def named_ties(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """For each tensor that several names share, all of its names. The first one is the name
    ``named_parameters()`` lists it under."""
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    return tuple(tuple(names) for names in names_by_tensor.values() if len(names) > 1)
