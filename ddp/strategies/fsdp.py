"""Fully sharded data parallelism (FSDP, ZeRO-3): parameters, gradients and optimizer state all split.

The model is cut into units: each child of a ``nn.ModuleList`` (a Transformer block, an expert),
and the root for every parameter outside them (embeddings, final norm, head; a weight tied across
units goes to the root too). A unit's trainable parameters are flattened into one fp32 vector,
padded to a multiple of the world size, and each rank keeps only its 1/N slice: the shard, the
one ``nn.Parameter`` of that unit the optimizer sees (so optimizer state is sharded as well).

For compute, a forward pre-hook all-gathers the unit's shards into its flat buffer (in
``compute_dtype`` if one is given: fp32 master shards, bf16 weights for the matmuls) and points
the module's parameter names at the pieces of one split of it; a forward post-hook frees the
buffer's storage (the views autograd saved stay, their memory does not), and a hook on the unit's
output gathers it again when backward reaches the unit. When autograd has accumulated the unit's whole flat
gradient, it is reduce-scattered (asynchronously, ``ReduceScatter``: on gloo as gloo's own is done)
in fp32, each rank keeping the average of its slice; ``finish_gradient_synchronization`` waits for
those and adds them to the shards' gradients. Memory per rank: 16/N bytes a parameter, plus the
largest gathered unit and its gradient.

Assumptions, as PyTorch's FSDP makes them: every rank runs every unit in each forward (a unit
that runs on some ranks only would leave the others out of its all-gather: a model that routes
data to modules per rank is not supported), and a unit's trainable parameters share one dtype and
device. ``no_sync()`` accumulates correctly but still communicates (each backward reduce-scatters;
the sharded gradients add up). Frozen parameters and buffers stay whole on every rank.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ddp.strategies.base import Strategy, broadcast_from_rank0, require_process_group
from ddp.strategies.declarations import MemoryPlan, Sharding, StepBuffers, declare, gathered_unit_buffers
from ddp.strategies.tracing import ReduceScatter


@dataclass
class Unit:
    """One all-gather's worth of parameters and the state of its flat buffer."""

    name: str
    module: nn.Module
    slots: list[list[tuple[nn.Module, str]]]
    """For each parameter, every (module, attribute) it is reachable by (a tied weight has several)."""
    shapes: list[torch.Size]
    numels: list[int]
    shard: nn.Parameter
    full: torch.Tensor
    """The gathered flat parameters (compute dtype, requires grad); its storage is freed between uses."""
    full_bytes: int
    gathered: bool = False
    pending: list[ReduceScatter] = field(default_factory=list)
    """The reduce-scatters backward launched, not yet waited."""


def plan_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Units, root last: the children of each outermost ``nn.ModuleList``, then the module itself."""
    units: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and not any(name.startswith(f"{unit}.") for unit, _ in units):
            units += [(f"{name}.{index}" if name else str(index), block) for index, block in enumerate(child)]
    return [*units, ("", module)]


def _unit_of(module_name: str, unit_names: list[str]) -> str:
    for unit in unit_names:
        if unit and (module_name == unit or module_name.startswith(f"{unit}.")):
            return unit
    return ""


def check_compute_dtype(compute_dtype: object) -> torch.dtype | None:
    """``None``, a floating ``torch.dtype`` or its name (``"bfloat16"``)."""
    if compute_dtype is None or isinstance(compute_dtype, torch.dtype):
        dtype = compute_dtype
    else:
        dtype = getattr(torch, str(compute_dtype), None)
    if compute_dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"compute_dtype must be a floating torch dtype such as torch.bfloat16 (or None), got {compute_dtype!r}")
    return dtype


ROOT_COPIES_AT_BACKWARD_END = 3  # see FullyShardedDP.step_buffers


def forward_in(compute_dtype: torch.dtype | None, module: nn.Module, *args, **kwargs):
    """``module``'s forward with its floating inputs cast to ``compute_dtype`` and its floating
    outputs back to fp32 (the loss is taken in fp32), as ``MixedPrecisionPolicy(param_dtype=...)``
    casts them; None: the plain forward."""
    if compute_dtype is None:
        return module(*args, **kwargs)

    def cast(dtype):
        return lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    output = module(*tree_map(cast(compute_dtype), args), **tree_map(cast(compute_dtype), kwargs))
    return tree_map(cast(torch.float32), output)


class FullyShardedDP(Strategy):
    """Parameters sharded per unit, all-gathered before each unit's forward and backward, freed
    after; gradients reduce-scattered to the shards; optional ``compute_dtype`` over fp32 shards."""

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | str | None = None, process_group=None) -> None:
        super().__init__()
        require_process_group(type(self).__name__, process_group)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.compute_dtype = check_compute_dtype(compute_dtype)
        broadcast_from_rank0(module, process_group)
        self._names = [name for name, _ in module.named_parameters()]  # the order and names gather_full_params gives
        name_of = {id(p): name for name, p in module.named_parameters()}
        unit_names = [name for name, _ in plan_units(module)]
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        units_of: dict[int, set[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for module_name, child in module.named_modules(remove_duplicate=False):
            for attribute, param in child._parameters.items():
                if param is None or not param.requires_grad:
                    continue
                if (child, attribute) not in slots.setdefault(id(param), []):
                    slots[id(param)].append((child, attribute))
                units_of.setdefault(id(param), set()).add(_unit_of(module_name, unit_names))
                params[id(param)] = param
        members: dict[str, list[int]] = {name: [] for name in unit_names}
        for key in params:  # registration order
            owners = units_of[key]
            members[owners.pop() if len(owners) == 1 else ""].append(key)
        self.units: list[Unit] = []
        self._hook_handles = []
        self._param_index: dict[str, tuple[Unit, int]] = {}
        for unit_name, unit_module in plan_units(module):
            keys = members[unit_name]
            if keys:
                unit = self._shard(unit_name, unit_module, [params[k] for k in keys], [slots[k] for k in keys])
                self.units.append(unit)
                for index, key in enumerate(keys):
                    self._param_index[name_of[id(params[key])]] = (unit, index)
        self.shards = nn.ParameterList([unit.shard for unit in self.units])

    @torch.no_grad()
    def _shard(self, name: str, unit_module: nn.Module, params: list[nn.Parameter], slots) -> Unit:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(
                f"fsdp flattens each unit's parameters into one tensor, but unit {name or '(root)'!r} mixes "
                f"{sorted(str(k) for k in kinds)}: give its trainable parameters one dtype and device"
            )
        dtype, device = kinds.pop()
        numels = [p.numel() for p in params]
        shard_numel = math.ceil(sum(numels) / self.world_size)
        flat = torch.zeros(shard_numel * self.world_size, dtype=dtype, device=device)
        torch.cat([p.reshape(-1) for p in params], out=flat[: sum(numels)])
        shard = nn.Parameter(flat[self.rank * shard_numel : (self.rank + 1) * shard_numel].clone())
        full = torch.empty(flat.numel(), dtype=self.compute_dtype or dtype, device=device, requires_grad=True)
        full_bytes = full.untyped_storage().nbytes()
        full.untyped_storage().resize_(0)
        unit = Unit(name, unit_module, slots, [p.shape for p in params], numels, shard, full, full_bytes)
        for param_slots in slots:  # the module's names now point at views of the gathered buffer
            for child, attribute in param_slots:
                del child._parameters[attribute]
                setattr(child, attribute, torch.empty(0, dtype=dtype, device=device))
        self._hook_handles += [
            unit_module.register_forward_pre_hook(lambda *_: self._gather_for_forward(unit)),
            unit_module.register_forward_hook(lambda _module, _inputs, output: self._after_forward(unit, output)),
            full.register_post_accumulate_grad_hook(lambda _full: self._reduce_scatter(unit)),
        ]
        return unit

    def close(self) -> None:
        """Remove the hooks on the module and on the gathered buffers: they refer back to this strategy."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    @torch.no_grad()
    def _all_gather_into_full(self, unit: Unit) -> None:
        unit.full.untyped_storage().resize_(unit.full_bytes)
        shard = unit.shard.detach().to(unit.full.dtype)
        # Backward's saved views of the buffer must not see this write as an in-place change:
        # it restores, between forward and backward, the very values they were saved with.
        with torch.autograd._unsafe_preserve_version_counter(unit.full):
            dist.all_gather_into_tensor(unit.full.detach(), shard, group=self.process_group)

    def _gather_for_forward(self, unit: Unit) -> None:
        if unit.gathered:  # a unit that runs twice in one forward
            return
        self._all_gather_into_full(unit)
        unit.gathered = True
        # One differentiable split, the padding its last piece: in backward its gradient is one
        # concatenation into a unit-sized tensor. A slice per parameter would make each
        # parameter's gradient a unit-sized tensor of its own (slice_backward), summed: a unit of
        # 1,000 tensors paid 1,000 of them (docs/results.md).
        pieces = torch.split(unit.full, [*unit.numels, unit.full.numel() - sum(unit.numels)])
        for piece, shape, param_slots in zip(pieces, unit.shapes, unit.slots):
            view = piece.view(shape)
            for child, attribute in param_slots:
                setattr(child, attribute, view)

    def _after_forward(self, unit: Unit, output):
        """Free the gathered parameters, and gather them again when backward reaches this unit's output."""
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and torch.is_grad_enabled():
            state = {"done": False}

            def regather(grad):
                if not state["done"]:
                    state["done"] = True
                    self._all_gather_into_full(unit)
                return grad

            for tensor in tensors:
                tensor.register_hook(regather)
        return output

    @torch.no_grad()
    def _reduce_scatter(self, unit: Unit) -> None:
        """Autograd has the unit's whole flat gradient: average it into the shards, in fp32."""
        gradient = unit.full.grad.to(torch.float32).div_(self.world_size)
        unit.full.grad = None
        unit.full.untyped_storage().resize_(0)
        self._send(unit, gradient)

    def _send(self, unit: Unit, gradient: torch.Tensor) -> None:
        """Launch the reduce-scatter of ``unit``'s flat fp32 ``gradient`` (no longer the caller's)."""
        for earlier in self.units:  # on gloo, buffers whose collective is done are freed now
            for scatter in earlier.pending:
                scatter.collect_if_done()
        unit.pending.append(ReduceScatter(gradient, self.process_group))

    def forward(self, *args, **kwargs):
        return forward_in(self.compute_dtype, self.module, *args, **kwargs)

    @torch.no_grad()
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients accumulate correctly across backwards (the sharded gradients add up), but
        each backward still reduce-scatters its units' gradients: ``accumulates_locally`` is False."""
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        for unit in self.units:
            for scatter in unit.pending:
                piece = scatter.wait()
                if unit.shard.grad is None:
                    unit.shard.grad = piece
                else:
                    unit.shard.grad.add_(piece)
            unit.pending = []

    @property
    def num_allreduce_calls_per_step(self) -> int:
        """Collectives a step launches: per unit, two all-gathers and one reduce-scatter."""
        return 3 * len(self.units)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        full_units = {}
        for unit in self.units:
            full = torch.empty(unit.shard.numel() * self.world_size, dtype=unit.shard.dtype, device=unit.shard.device)
            dist.all_gather_into_tensor(full, unit.shard.detach(), group=self.process_group)
            full_units[id(unit)] = full[: sum(unit.numels)].split(unit.numels)
        others = dict(self.module.named_parameters())
        gathered = {}
        for name in self._names:
            if name in self._param_index:
                unit, index = self._param_index[name]
                gathered[name] = full_units[id(unit)][index].view(unit.shapes[index])
            else:
                gathered[name] = others[name].detach()
        return gathered


def units_and_root_copies(plan: MemoryPlan) -> StepBuffers:
    """``fully_shard``'s (``gathered_unit_buffers``), and at backward's end the root's: its gathered
    parameters, its parameters' gradients and their concatenation into the unit's gradient (the
    split's backward), 3 roots; in a compute dtype, then the gathered root, that gradient and its
    fp32 copy to be reduced (``_reduce_scatter``). The root's own piece of the reduce-scatter does
    not exist yet then: it is taken off the gradients the prediction counts for every unit."""
    buffers = gathered_unit_buffers(plan, prefetches_next_unit=False)
    root = plan.unit_bytes[-1] if plan.unit_bytes else 0
    gathered, copied = plan.gathered(root), root if plan.computes_in_another_dtype else 0
    at_root = max(ROOT_COPIES_AT_BACKWARD_END * gathered, 2 * gathered + copied) - root // plan.world_size
    return buffers._replace(synchronization_bytes=at_root)


# What the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    FullyShardedDP,
    sharding=Sharding(parameters=True, gradients=True, optimizer_state=True),
    communicates=True,
    accumulates_locally=False,  # every backward reduce-scatters, no_sync() or not
    records_collectives=False,  # its collectives are c10d's, read from the profiler
    steps_to_settle=1,
    prefetches_next_unit=False,  # gathers when a unit starts
    units=plan_units,
    step_buffers=units_and_root_copies,
)
