"""What is benchmarked: a step's configuration, each of its axes declared once.

A configuration (``StepConfig``) is one training step the suite can build and time. Each field a
user chooses is an *axis*, declared by the ``Axis`` in its metadata: its flag for one value and
its grid form for a comma-separated list, its parser and checks, the grid's default values with
gloo on CPU and with CUDA, the strategies it applies to, and how a value is named. Everything
else follows from those declarations, here and nowhere else:

- the options of pytest and of every ``python -m ddp`` command (``ddp.bench.config.options`` binds ``AXES``);
- a grid's expansion into configurations (``expand``), in the order the suite runs them;
- test ids, benchmark group names, ``describe()`` and the labels of report columns;
- the ``config`` object nested in a saved step record (``to_dict``, ``from_dict``).

An axis has one of four roles:

- ``strategy``: the strategy itself, a registered name or ``package.module:ClassName``;
- ``workload``: the work of a step (model, batch size, sequence length), named in every group;
- ``option``: how the step computes (precision, AdamW's implementation, ...), named in ids and
  groups only where it is not the default, so an option added later leaves the names of a run at the defaults unchanged;
- ``member``: an option that applies to some strategies only (the bucket cap, the dtype gradients
  are communicated in), named with the strategy; a strategy it does not apply to has its default.

Configurations that differ only in their strategy and members form a *group* (``group``: the
configuration of the floor, ``local``, with the same workload and options): the strategies of a group
are timed side by side and each is paired with the group's ``local``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddp.bench.config.parsing import OptionError, choice, parse_list, positive_float, positive_int
from ddp.bench.config.shape import ACTIVATION_CHECKPOINTING, StepShape
from ddp.bench.config.values import GRAD_COMM, OPTIMIZER, PRECISION, sharded_compute_dtype
from ddp.bench.config.workloads import check_workload, max_seq_len
from ddp.strategies.registry import (
    DEFAULT_GRID_STRATEGIES,
    FLOOR,
    FLOOR_MIXED,
    STRATEGIES,
    StrategyError,
    resolve_strategy,
    takes_bucket_size,
    takes_comm_dtype,
)

ROLES = ("strategy", "workload", "option", "member")


@dataclass(frozen=True)
class Axis:
    """The declaration of one field of ``StepConfig``: everything the options, the grid, the names
    and the records need to know of it."""

    role: str
    """``strategy``, ``workload``, ``option`` or ``member`` (module docstring)."""
    flag: str
    """The option of one value, for the commands that train one configuration (``--batch-size``)."""
    help: str
    """What it means, for every command alike (the default is added per command)."""
    parse: Callable[[str], Any]
    """Text to one value; raises ``OptionError`` saying what to write."""
    plural: str
    """What a list of values is called in messages (``batch sizes``)."""
    cpu: tuple
    """The grid's values by default with gloo on CPU."""
    gpu: tuple
    """The grid's values by default with CUDA."""
    text: Callable[[Any], str]
    """A value in words, for group names, ``describe()`` and report labels (``batch 4``, ``bf16``)."""
    id: Callable[[Any], str] | None = None
    """A value in a test id (``b4``, ``bf16``); None: never in ids (the model: it names the group)."""
    grid_flag: str | None = None
    """The grid's option, a comma-separated list (``--batch-sizes``); None: ``flag`` takes the list."""
    one_per_grid: bool = False
    """A grid runs one value (the model: test ids do not name it)."""
    applies: Callable[[str], bool] | None = None
    """The strategies a member applies to (by name); others keep the default."""
    valid: Callable[[Any], bool] | None = None
    """Whether a value given in code (not parsed) is one this axis takes."""
    check: Callable[[StepConfig], str | None] | None = None
    """A check against the other fields: a message saying what to change, or None."""
    aliases: tuple[str, ...] = ()
    """Other spellings of ``flag``."""
    choices: tuple | None = None
    """The values it takes, where they are a fixed few."""
    name: str = field(default="", init=False)
    """The field it declares (set once ``StepConfig`` is defined)."""
    default: Any = field(default=None, init=False)
    """The field's default (the workload axes and the strategy have none: every configuration gives them)."""

    @property
    def list_flag(self) -> str:
        return self.grid_flag or self.flag

    def parse_grid(self, text: str) -> tuple:
        """The grid form: a comma-separated list, each value once (one value where ``one_per_grid``)."""
        if self.one_per_grid:
            return (self.parse(text),)
        values = parse_list(text, self.parse, self.plural)
        if len(set(values)) != len(values):
            raise OptionError(f"give each of the {self.plural} once, got {text!r}")
        return values


def _axis(default: Any = dataclasses.MISSING, **declaration) -> Any:
    """A ``StepConfig`` field declared by an ``Axis``."""
    return field(default=default, metadata={"axis": Axis(**declaration)})


def strategy_name(text: str) -> str:
    """A registered name or ``package.module:ClassName``, imported and checked here (in the parent)."""
    try:
        resolve_strategy(text.strip())
    except (StrategyError, TypeError) as error:
        raise OptionError(str(error)) from None
    return text.strip()


def workload_name(text: str) -> str:
    try:
        return check_workload(text.strip())
    except ValueError as error:
        raise OptionError(str(error)) from None


def _context_length(config: StepConfig) -> str | None:
    limit = max_seq_len(config.model)
    if limit is not None and config.seq_len > limit:
        return f"seq len {config.seq_len} exceeds model {config.model}'s context length {limit}: choose a shorter one"
    return None


# What each value means is declared in ddp.bench.config.values; the axes take their choices from there.
PRECISIONS = tuple(PRECISION)
OPTIMIZERS = tuple(OPTIMIZER)
GRAD_COMMS = tuple(GRAD_COMM)
COMPILE = ("off", "on")


@dataclass(frozen=True)
class StepConfig:
    """One benchmarked configuration; equal configurations share the state kept on the ranks."""

    strategy: str = _axis(
        role="strategy", flag="--strategies", aliases=("--strategy",), plural="strategies",
        help="strategies, comma-separated: registered names or package.module:ClassName",
        parse=strategy_name, cpu=DEFAULT_GRID_STRATEGIES, gpu=DEFAULT_GRID_STRATEGIES, text=str, id=str,
    )
    """A registered name or ``package.module:ClassName``."""
    model: str = _axis(
        role="workload", flag="--model", aliases=("--model-size",), one_per_grid=True, plural="models",
        help="model to train: a size of ddp.model.MODEL_SIZES, a named model (mlp, wide-mlp, conv, ...), or your "
        "own as package.module:build",
        parse=workload_name, cpu=("mini",), gpu=("xl",), text=lambda v: f"model {v}",
    )
    """A workload (``ddp.bench.config.workloads``): an LM size, a named model or ``package.module:build``."""
    batch_size: int = _axis(
        role="workload", flag="--batch-size", grid_flag="--batch-sizes", plural="batch sizes",
        help="samples (sequences) per rank in a micro-batch: the step's batch per rank at --grad-accum 1",
        parse=positive_int, valid=lambda v: v >= 1,
        # On CPU one batch size: the two sequence lengths already double the step, and each size
        # added costs the default run about 5 minutes on 2 cores (docs/perf-suite.md).
        cpu=(4,), gpu=(2, 4), text=lambda v: f"batch {v}", id=lambda v: f"b{v}",
    )
    """Samples (sequences) per rank in a micro-batch (a step trains ``grad_accum`` of them)."""
    seq_len: int = _axis(
        role="workload", flag="--seq-len", grid_flag="--seq-lens", plural="sequence lengths",
        help="tokens per sequence, where the model has them", parse=positive_int, valid=lambda v: v >= 1,
        # On a GPU, 2,048 and 4,096 tokens a step: xl's eager step in bf16 is bound by the GPU there,
        # by the host's ~6,000 launches at 1,024 tokens and below (docs/gpu.md).
        cpu=(64, 128), gpu=(1024,), text=lambda v: f"seq len {v}", id=lambda v: f"s{v}", check=_context_length,
    )
    """Tokens per sequence."""
    bucket_size_mb: float | None = _axis(
        None, role="member", flag="--bucket-size-mb", grid_flag="--bucket-sizes", plural="bucket sizes in MiB",
        help="bucket cap in MiB for the strategies that take bucket_size_mb", parse=positive_float,
        valid=lambda v: v > 0, applies=takes_bucket_size,
        # mini's 35.5 MiB of gradients (largest tensor 9.8 MiB): caps of 1, 10 and 100 MiB give many buckets, a few, one
        cpu=(1.0, 10.0, 100.0), gpu=(1.0, 10.0, 100.0, 1000.0),
        text=lambda v: f"{v:g} MiB", id=lambda v: f"bucket{v:g}mb",
    )
    """Bucket cap in MiB for strategies that take ``bucket_size_mb``; None for every other one."""
    precision: str = _axis(
        "fp32", role="option", flag="--precision", plural="precisions", choices=PRECISIONS,
        help="what the step computes in: fp32 (fp32 matmuls), tf32 (TF32 matmuls; on CPU the same as fp32), bf16 "
        "(autocast around forward and loss, fp32 weights, gradients and AdamW); see docs/perf-suite.md",
        # bf16 on a GPU: what GPU users train in (autocast over fp32 masters); the CPU's fp32
        parse=choice("--precision", PRECISIONS), cpu=("fp32",), gpu=("bf16",), text=str, id=str,
    )
    """``fp32``, ``tf32`` or ``bf16``: what the step computes in (``ddp.bench.rounds.trainer``)."""
    optimizer: str = _axis(
        "foreach", role="option", flag="--optimizer", plural="AdamW implementations", choices=OPTIMIZERS,
        help="AdamW's implementation: foreach or fused", parse=choice("--optimizer", OPTIMIZERS),
        cpu=("foreach",), gpu=("foreach",), text=lambda v: f"{v} AdamW", id=str,
    )
    """AdamW's implementation: ``foreach`` or ``fused``."""
    grad_comm: str = _axis(
        "fp32", role="member", flag="--grad-comm", plural="gradient dtypes", choices=GRAD_COMMS, applies=takes_comm_dtype,
        help="the dtype gradients are all-reduced in by the strategies that take comm_dtype (bucketed, torch), "
        "accumulated back into fp32 gradients: " + ", ".join(GRAD_COMM),
        parse=choice("--grad-comm", GRAD_COMMS), cpu=("fp32",), gpu=("fp32",),
        text=lambda v: f"{v} comm", id=lambda v: f"{v}comm",
    )
    """What strategies that take ``comm_dtype`` all-reduce gradients in (``ddp.bench.config.values.GRAD_COMM``)."""
    compile: str = _axis(
        "off", role="option", flag="--compile", plural="compile settings", choices=COMPILE,
        help="on: the model under torch.compile, its forward and backward compiled before the strategy wraps it (the "
        "strategy stays eager); a configuration that cannot compile is skipped with the reason; see docs/perf-suite.md",
        parse=choice("--compile", COMPILE), cpu=("off",), gpu=("off",),
        text=lambda v: "compiled" if v == "on" else "eager", id=lambda v: "compile" if v == "on" else "eager",
    )
    """``on``: the model compiled by ``torch.compile`` (``ddp.bench.rounds.trainer``); ``off``: eager."""
    grad_accum: int = _axis(
        1, role="option", flag="--grad-accum", plural="micro-batch counts", valid=lambda v: v >= 1,
        help="micro-batches of --batch-size samples each a step trains per rank, all but the last under the strategy's "
        "no_sync() (gradient accumulation); a strategy that cannot accumulate without communicating is skipped saying "
        "so; see docs/perf-suite.md",
        parse=positive_int, cpu=(1,), gpu=(1,),
        text=lambda v: f"{v} micro-batches", id=lambda v: f"accum{v}",
    )
    """Micro-batches a step (``ddp.bench.config.shape``): 1, no accumulation."""
    activation_checkpointing: str = _axis(
        "none", role="option", flag="--activation-checkpointing", plural="activation checkpointing policies",
        choices=ACTIVATION_CHECKPOINTING,
        help="blocks: each of the model's repeated blocks (its largest nn.ModuleList) under torch.utils.checkpoint, "
        "recomputed in backward; none: forward saves what it saves; see docs/perf-suite.md",
        parse=choice("--activation-checkpointing", ACTIVATION_CHECKPOINTING), cpu=("none",), gpu=("none",),
        text=lambda v: "checkpointed blocks" if v == "blocks" else "no checkpointing",
        id=lambda v: "ckpt" if v == "blocks" else "nockpt",
    )
    """``blocks``: the model's repeated blocks recomputed in backward (``ddp.bench.config.shape``); ``none``."""
    seed: int = 0
    """Seeds the model's weights and the global batch (not an axis: every configuration uses 0)."""

    def __post_init__(self) -> None:
        for axis, value in self.axis_values():
            if axis.choices is not None and value not in axis.choices:
                raise OptionError(f"{axis.flag} takes one of {', '.join(map(str, axis.choices))}, got {value!r}")
            if axis.valid is not None and value is not None and not axis.valid(value):
                raise OptionError(f"{axis.flag} {value!r} is not a value it takes: {axis.help}")
            if axis.applies is None:
                continue
            if not axis.applies(self.strategy) and value != axis.default:
                raise OptionError(f"strategy {self.strategy!r} takes no {axis.name} (it is not an option of its "
                                  f"constructor): leave {axis.flag} at its default, {axis.default}")
            if axis.applies(self.strategy) and value is None:
                raise OptionError(f"strategy {self.strategy!r} needs {axis.flag}: {axis.help}")
        for axis, _ in self.axis_values():
            problem = axis.check(self) if axis.check is not None else None
            if problem:
                raise OptionError(problem)

    # ----------------------------------------------------------------------- the axes' values

    def axis_values(self, *roles: str) -> Iterable[tuple[Axis, Any]]:
        """(axis, value) of each axis in declaration order, those of ``roles`` only if given."""
        return [(a, getattr(self, name)) for name, a in AXES.items() if not roles or a.role in roles]

    def _named(self, *roles: str) -> list[tuple[Axis, Any]]:
        """The axes of ``roles`` that names carry: the workload always, the others where not at their default."""
        return [(a, v) for a, v in self.axis_values(*roles) if a.role == "workload" or v != a.default]

    @classmethod
    def of(cls, strategy: str, values: Mapping[str, Any]) -> StepConfig:
        """``strategy`` with ``values`` (by field name), each member only where it applies to the
        strategy: the one way to build the configurations of several strategies from one set of options."""
        kept = {name: value for name, value in values.items()
                if name in FIELDS and name != "strategy"
                and (AXES.get(name) is None or AXES[name].applies is None or AXES[name].applies(strategy))}
        return cls(strategy=strategy, **kept)

    def values(self) -> dict[str, Any]:
        """Every field by name."""
        return {name: getattr(self, name) for name in FIELDS}

    # ----------------------------------------------------------------------- names

    @property
    def test_id(self) -> str:
        """Stable, e.g. ``bucketed-b2-s128-bucket25mb`` or ``torch-b4-s512-bucket25mb-bf16-fused``:
        comparisons match on it. Options at their defaults are left out, as in every name."""
        parts = [self.strategy]
        parts += [a.id(v) for a, v in self._named("workload", "member", "option") if a.id is not None]
        return "-".join(parts)

    @property
    def label(self) -> str:
        """The strategy with its members, as report columns name it: ``bucketed 25 MiB``, ``bucketed
        25 MiB bf16 comm``, ``naive``."""
        return " ".join([self.strategy, *(a.text(v) for a, v in self._named("member"))])

    def group_label(self, with_model: bool = True) -> str:
        """The group in words: ``model mini, batch 4, seq len 64, bf16``."""
        named = [(a, v) for a, v in self._named("workload", "option") if with_model or a.name != "model"]
        return ", ".join(a.text(v) for a, v in named)

    @property
    def group_name(self) -> str:
        """The benchmark group: the strategies of one group side by side."""
        return f"step: {self.group_label()}"

    def describe(self) -> str:
        """In words, e.g. ``bucketed 25 MiB, model xl, batch 4, seq len 512, bf16``."""
        return f"{self.label}, {self.group_label()}"

    @property
    def variant(self) -> str:
        """The options in words, the first (the precision) always named and the others where they
        are not the default: ``fp32``, ``bf16``, ``fp32 fused AdamW``: what a report sets side by side
        for one workload."""
        options = self.axis_values("option")
        return " ".join(a.text(v) for index, (a, v) in enumerate(options) if index == 0 or v != a.default)

    # ----------------------------------------------------------------------- groups

    def local_twin(self) -> StepConfig:
        """What this configuration is paired with: its group's floor, ``local`` with the same
        workload and options; ``local_mixed`` where the strategy computes in its own dtype under
        this precision (``sharded_compute_dtype``: FSDP's mixed precision), the same recipe."""
        floor = FLOOR_MIXED if sharded_compute_dtype(self.precision, self.strategy) is not None else FLOOR
        return StepConfig.of(floor, self._shared())

    @property
    def group(self) -> StepConfig:
        """What the strategies of one group share, named by its floor: ``local`` with the same
        workload and options."""
        return StepConfig.of(FLOOR, self._shared())

    def _shared(self) -> dict:
        return {name: v for name, v in self.values().items() if AXES.get(name) is None or AXES[name].role != "member"}

    @property
    def step_shape(self) -> StepShape:
        """What the step does (``ddp.bench.config.shape``): micro-batches, tokens, phases, checkpointing."""
        return StepShape.of(self)

    @property
    def workload(self) -> tuple:
        """The workload axes' values: (model, batch size, seq len)."""
        return tuple(v for _, v in self.axis_values("workload"))

    def sort_key(self) -> tuple:
        """Registry order of strategies, then each axis's values in their declared order."""
        key = []
        for axis, value in self.axis_values():
            if axis.role == "strategy":
                order = list(STRATEGIES)
                key.append((order.index(value) if value in order else len(order), value))
            elif axis.choices is not None:
                key.append((axis.choices.index(value), ""))
            else:
                key.append((0 if value is None else 1, value if value is not None else 0))
        return tuple(key)

    # ----------------------------------------------------------------------- saved records

    def to_dict(self) -> dict[str, Any]:
        """The ``config`` object of a saved record."""
        return self.values()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepConfig:
        """A configuration saved by ``to_dict``, taken as it was saved (not checked again: a user's
        strategy or model saved there need not be importable where the run is read); an axis the
        file predates is at its default."""
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown configuration fields {', '.join(unknown)}: saved by a newer ddp-bench")
        missing = sorted(name for name, f in FIELDS.items() if f.default is dataclasses.MISSING and name not in data)
        if missing:
            raise ValueError(f"the configuration lacks {', '.join(missing)}")
        config = cls.__new__(cls)
        for name, f in FIELDS.items():
            object.__setattr__(config, name, data.get(name, f.default))
        return config


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(StepConfig)}
AXES: dict[str, Axis] = {f.name: f.metadata["axis"] for f in dataclasses.fields(StepConfig) if "axis" in f.metadata}
for _name, _axis_ in AXES.items():
    assert _axis_.role in ROLES, _name
    object.__setattr__(_axis_, "name", _name)
    object.__setattr__(_axis_, "default", None if FIELDS[_name].default is dataclasses.MISSING else FIELDS[_name].default)


def expand(values: Mapping[str, tuple]) -> list[StepConfig]:
    """Every configuration of a grid (``values``: each axis's values by field name; an axis left
    out is at its default), in the order the suite runs them: the options outermost, then the
    workloads, then the strategies in the order given, each with its members where they apply."""
    def given(name: str) -> tuple:
        return tuple(values.get(name, (AXES[name].default,)))

    outer = [name for name, a in AXES.items() if a.role == "option"] + [name for name, a in AXES.items() if a.role == "workload"]
    members = [name for name, a in AXES.items() if a.role == "member"]
    configs = []
    for combination in itertools.product(*(given(name) for name in outer)):
        common = dict(zip(outer, combination))
        for strategy in given("strategy"):
            choices = [given(name) if AXES[name].applies(strategy) else (AXES[name].default,) for name in members]
            for member_values in itertools.product(*choices):
                configs.append(StepConfig.of(strategy, {**common, **dict(zip(members, member_values))}))
    if FLOOR in given("strategy"):  # a grid with its floor has each configuration's (``local_twin``), after it
        others: dict[StepConfig, list[StepConfig]] = {}
        for config in configs:
            if (twin := config.local_twin()).strategy != FLOOR:
                others.setdefault(config.group, []).append(twin)
        configs = [c for config in configs for c in ([config, *others.get(config, [])] if config.strategy == FLOOR else [config])]
    return list(dict.fromkeys(configs))
