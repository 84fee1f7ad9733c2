"""A built model kept for the next configuration that trains the same one, indistinguishable from
a fresh build.

The configurations of a grid group (model, batch, sequence length) all start from the same
initial weights (``Trainer`` seeds the build with ``StepConfig.seed``). Building the model again
for each one (allocating and initializing every parameter; on a GPU, after the previous one's
memory went back) is work no benchmark times. ``KeptModels`` keeps, per workload, a copy of the
freshly built state (parameters, buffers, and the random generators' state right after the
build) and, once a configuration is released, its module with every trace of the strategy gone
(``Trainer.close``: the strategy's ``close()``, every parameter hook and gradient dropped). The
next configuration of the same workload gets that module (or, where every such module is in use,
as when a group's configurations are built together, a module allocated without initialising it)
with the copy written back into it, and the generators set as the fresh build left them: the same weights bit for bit, the same batches,
the same first loss, an optimizer of its own (``Trainer`` makes one), nothing of the previous
strategy attached (tests/test_reuse.py holds a reused build to a fresh one step by step).

Only what can be restored that way is kept (``restorable``): the built-in LM sizes (a user's model
may keep state a copy of its tensors does not cover), wrapped by a strategy that replicates
(``REPLICATED``: a sharding strategy takes the parameters out of the module, or flattens them),
uncompiled (``--compile on`` rewrites the blocks in place), without activation checkpointing
(which wraps the blocks). Everything else is built fresh, as before.

Memory: the copy is one model's parameters and buffers per workload on the rank's device,
dropped once no configuration being built uses that workload. The parent counts it where it
decides what fits (``ddp.bench.rounds.grid_measurer.GridMeasurer``), and turns reuse off where it does
not. On CUDA the copy stays on the GPU so that restoring is a device-to-device copy (xl's 8 GB in
a few milliseconds at HBM bandwidth) rather than a host transfer that costs what a build does.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.workloads import Workload, build_workload
from ddp.model import MODEL_SIZES
from ddp.strategies.declarations import REPLICATED, sharding_of
from ddp.strategies.registry import StrategyError, resolve_strategy


def restorable(config: StepConfig) -> bool:
    """Whether ``config``'s model may come from a kept copy (module docstring)."""
    if config.model not in MODEL_SIZES or config.compile != "off" or config.activation_checkpointing != "none":
        return False
    if ":" in config.strategy:
        return False  # a user's class: what it leaves on the module is not known
    try:
        return sharding_of(resolve_strategy(config.strategy)) == REPLICATED
    except StrategyError:
        return False


def workload_key(config: StepConfig) -> Hashable:
    """What a model's initial state depends on: which model, for what batch, from which seed."""
    return config.model, config.batch_size, config.seq_len, config.seed


@dataclass
class _Copy:
    tensors: dict[str, torch.Tensor]
    """Every parameter and buffer as the build left it, by name."""
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def attached(module: nn.Module) -> str | None:
    """What a strategy left on ``module`` that a fresh build would not have, in a phrase; None if nothing."""
    for name, sub in module.named_modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            if getattr(sub, hooks, None):
                return f"{hooks} on {name or 'the model'}"
    for name, param in module.named_parameters():
        if param.grad is not None or param._post_accumulate_grad_hooks or param._backward_hooks:
            return f"a gradient or hook on {name}"
        if not param.requires_grad:
            return f"{name} frozen"
    return None


@dataclass
class KeptModels:
    """The copies and released modules of one rank (module docstring)."""

    enabled: bool = False
    """Keep copies at all (the parent says so where they fit: ``set_model_reuse``)."""
    copies: dict[Hashable, _Copy] = field(default_factory=dict)
    spares: dict[Hashable, list[Workload]] = field(default_factory=dict)
    builds: int = 0
    """Fresh builds made here."""
    restores: int = 0
    """Builds served from a kept copy."""

    def workload(self, config: StepConfig, device: torch.device) -> Workload:
        """``config``'s workload on ``device``: a released one restored to its initial state, or a
        fresh build (copied for the next where it may be). The caller has seeded the generators
        with ``config.seed``."""
        key = workload_key(config)
        keep = self.enabled and restorable(config)
        if keep and key in self.copies:
            copy = self.copies[key]
            if self.spares.get(key):
                workload = self.spares[key].pop()
            else:  # every released module is in use (a group's configurations built together): a new one
                workload = _unfilled(config, device)
            with torch.no_grad():
                for name, tensor in _state(workload.module).items():
                    tensor.copy_(copy.tensors[name])
            torch.set_rng_state(copy.cpu_rng)
            if copy.cuda_rng is not None:
                torch.cuda.set_rng_state(copy.cuda_rng, device)
            self.restores += 1
            return workload
        workload = build_workload(config.model, config.batch_size, config.seq_len, device)
        self.builds += 1
        if keep and key not in self.copies:
            with torch.no_grad():
                tensors = {name: tensor.detach().clone() for name, tensor in _state(workload.module).items()}
            cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            self.copies[key] = _Copy(tensors, torch.get_rng_state(), cuda_rng)
        return workload

    def give_back(self, config: StepConfig, workload: Workload | None) -> None:
        """Keep ``workload``'s module, its configuration closed, for the next of the same model,
        where it may be restored and nothing is left on it; else let it go."""
        key = workload_key(config)
        if workload is None or not (self.enabled and restorable(config) and key in self.copies):
            return
        copy = self.copies[key].tensors
        state = _state(workload.module)
        whole = state.keys() == copy.keys() and all(state[name].shape == copy[name].shape for name in copy)
        if whole and attached(workload.module) is None:  # a strategy that took a parameter out did not put it back
            self.spares.setdefault(key, []).append(workload)

    def keep_only(self, configs: list[StepConfig]) -> None:
        """Drop the copies and spares no configuration of ``configs`` can use (before building them)."""
        keys = {workload_key(c) for c in configs if self.enabled and restorable(c)}
        self.copies = {k: v for k, v in self.copies.items() if k in keys}
        self.spares = {k: v for k, v in self.spares.items() if k in keys}

    def held_bytes(self) -> int:
        """What the copies and the released modules hold (``RankBench`` keeps it out of a
        configuration's resident bytes)."""
        copies = sum(_nbytes(t) for copy in self.copies.values() for t in copy.tensors.values())
        spares = sum(_nbytes(t) for kept in self.spares.values() for w in kept for t in _state(w.module).values())
        return copies + spares


def _unfilled(config: StepConfig, device: torch.device) -> Workload:
    """``config``'s workload with its module's storage allocated on ``device`` and not initialised
    (built on the meta device, then ``to_empty``): what a kept copy is written into. Initialising
    mini's 9.3M parameters took 0.23 s of a build here, this 0.01 s."""
    workload = build_workload(config.model, config.batch_size, config.seq_len, "meta")
    workload.module.to_empty(device=device)
    return workload


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
