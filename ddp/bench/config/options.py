"""One options layer: the flags of pytest and of every ``python -m ddp`` command, bound from one
definition each, with their defaults and their validation.

Every flag is an ``Option`` (its flag, the field it fills, its parser, its help). A step's axes are
declared in ``ddp.bench.config.step_config`` (``AXES``) and become options here, in their form of one value
(``--batch-size``, for a command that trains one configuration) or of the grid's list
(``--batch-sizes``); the launch (``LaunchOptions``: backend, world size, device, timeout), the
rounds of a measurement (``RoundOptions``) and the rest of a grid's run (``GridOptions``: the
session's budget, what shares a round, the all-reduce sizes) are declared below. ``bind`` adds
options to an ``argparse`` parser or to pytest's (both take ``add(flag, **kwargs)``) with the
defaults a command gives, so ``pytest perf_tests`` and every command share flags, help texts,
parsers and meanings; only defaults differ per command (``--rounds`` is the fewest timed rounds
everywhere). Every check runs in the parent process, before any rank starts: a bad value is an
``OptionError`` whose one-line message says what to do, which pytest turns into a usage error and
the command line into exit status 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddp.bench.config.parsing import (
    MAX_ROUNDS,
    OptionError,
    argument_type,
    choice,
    memory_size,
    non_negative_int,
    percent,
    positive_float,
    positive_floats,
    positive_int,
    positive_ints,
)
from ddp.bench.config.step_config import AXES, Axis, StepConfig, expand
from ddp.launcher import BACKENDS, DEFAULT_TIMEOUT_SECONDS, choose_backend, default_device, unavailable_reason
from ddp.strategies.registry import FLOOR

DEVICES = ("cpu", "cuda")
# How a grid's configurations share rounds (``ddp.bench.rounds.grid_measurer.GridMeasurer``).
INTERLEAVE = ("group", FLOOR, "off")

# Bounds of a benchmark's share of the session's round budget: at least enough for the minimum
# rounds of a slow step, at most what a regression check needs (about 100 rounds of a 1 s step).
MIN_BENCHMARK_BUDGET_SECONDS = 3.0
MAX_BENCHMARK_BUDGET_SECONDS = 120.0


# Groups of ranks a measurement's rounds are spread over: the fewest that measure the spread
# between processes (docs/regression-gate.md has what more of them buy).
RANK_GROUPS = 2

# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Option:
    """One command-line option, declared once and bound by pytest and every command."""

    flag: str
    dest: str
    """The field it fills (of ``StepConfig``, ``GridOptions``, ``RoundOptions``, ``LaunchOptions``, or the command's own)."""
    parse: Callable[[str], object] | None
    """Text to value, raising ``OptionError``; None with ``choices``."""
    help: str
    """What it means, the same for every command (the default is added per command)."""
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None

    def bind(self, add: Callable, default: object = None, default_text: str | None = None, also: tuple[str, ...] = (),
             **extra) -> None:
        """Add this option to a parser (``add`` is ``parser.add_argument`` or pytest's ``addoption``);
        ``also``: other spellings a command accepts, ``extra``: argparse keywords such as ``required``."""
        shown = default_text if default_text is not None else _show(default)
        if self.choices:
            kwargs = {"choices": self.choices}
        else:
            parse = argument_type(self.parse, self.dest)
            parse.option = self  # which definition a bound flag came from (tests read it)
            kwargs = {"type": parse, "metavar": self.flag.lstrip("-").upper().replace("-", "_")}
        help_text = f"{self.help} (default: {shown})" if not extra.get("required") else f"{self.help} (required)"
        add(self.flag, *self.aliases, *also, dest=self.dest, default=default, help=help_text, **kwargs, **extra)


def _show(value: object) -> str:
    if value is None:
        return "not given"
    if isinstance(value, tuple):
        return ",".join(_show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def bind(add: Callable, options: tuple[Option, ...], defaults: Mapping[str, object] | object, skip: tuple[str, ...] = ()) -> None:
    """Bind ``options`` with ``defaults`` (by ``dest``: a mapping, or a dataclass such as ``RoundOptions``)."""
    for option_ in options:
        if option_.flag in skip:
            continue
        default = defaults.get(option_.dest) if isinstance(defaults, Mapping) else getattr(defaults, option_.dest, None)
        option_.bind(add, default)


def axis_option(axis: Axis) -> Option:
    """An axis's option of one value (``--batch-size``)."""
    return Option(axis.flag, axis.name, axis.parse, axis.help, axis.aliases)


def axis_list_option(axis: Axis) -> Option:
    """An axis's option of the grid's list (``--batch-sizes``)."""
    what = "the one value a grid runs" if axis.one_per_grid else f"a comma-separated list of {axis.plural}"
    aliases = axis.aliases if axis.grid_flag is None else ()
    return Option(axis.list_flag, axis.name, axis.parse_grid, f"{axis.help}; {what}", aliases)


# The strategy is always a list (a grid's, a race's contenders, the strategies profiled): no command takes one alone.
AXIS_OPTIONS = {name: axis_option(axis) for name, axis in AXES.items() if axis.role != "strategy"}
AXIS_LIST_OPTIONS = {name: axis_list_option(axis) for name, axis in AXES.items()}


# ------------------------------------------------------------------------------------ launch


@dataclass(frozen=True)
class LaunchOptions:
    """Where the ranks run."""

    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto``: nccl when there is a GPU for every rank, else gloo."""
    world_size: int = 2
    """Number of ranks."""
    device: str | None = None
    """Where tensors live: ``cpu`` or ``cuda``; None means cuda with nccl, cpu with gloo. gloo also
    runs over CUDA tensors (one GPU may then hold several ranks)."""
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    """How long one call on the ranks may take before it fails with every rank's stack."""

    def resolve(self) -> ResolvedLaunch:
        """The backend and device this machine will run, and why; ``OptionError`` if it cannot."""
        if self.backend not in BACKENDS:
            raise OptionError(f"unknown backend {self.backend!r}: use {', '.join(BACKENDS)}")
        if self.device is not None and self.device not in DEVICES:
            raise OptionError(f"unknown device {self.device!r}: use {' or '.join(DEVICES)}")
        if self.world_size < 1:
            raise OptionError(f"world size must be at least 1, got {self.world_size}")
        backend, why = choose_backend(self.backend, self.world_size)
        device = self.device or default_device(backend)
        reason = unavailable_reason(backend, self.world_size, device)
        if reason:
            raise OptionError(reason)
        return ResolvedLaunch(backend, device, self.world_size, self.timeout_seconds, why)


@dataclass(frozen=True)
class ResolvedLaunch:
    """A launch this machine can run."""

    backend: str
    device: str
    world_size: int
    timeout_seconds: float
    why: str
    """Why this backend: what ``--backend auto`` found, or that it was asked for."""

    def describe(self) -> str:
        return f"{self.world_size} rank(s), {self.backend} on {self.device} ({self.why})"


LAUNCH_OPTIONS = (
    Option("--backend", "backend", None, "process-group backend; auto = nccl with one GPU per rank, else gloo", choices=BACKENDS),
    Option("--world-size", "world_size", positive_int, "number of ranks"),
    Option("--device", "device", None, "where tensors live; cuda for nccl, cpu for gloo when not given (gloo also runs over cuda)",
           choices=DEVICES),
    Option("--rank-timeout", "timeout_seconds", positive_float,
           "seconds one call on the ranks may take before it fails with every rank's stack"),
)


def add_launch_options(add: Callable, world_size: bool = True, only: tuple[str, ...] | None = None) -> None:
    """Bind ``LaunchOptions`` to a parser: ``add`` is ``parser.add_argument`` or pytest's ``group.addoption``;
    ``only`` names the flags a command takes (``ddp run`` under torchrun: ``--backend``)."""
    skip = () if world_size else ("--world-size",)
    if only is not None:
        skip = tuple(o.flag for o in LAUNCH_OPTIONS if o.flag not in only)
    bind(add, LAUNCH_OPTIONS, LaunchOptions(), skip)


def launch_options(get: Callable[[str], object], world_size: int | None = None) -> LaunchOptions:
    """``LaunchOptions`` from parsed values; ``get(dest)`` reads one (``vars(args).get`` or
    ``config.getoption``)."""
    return LaunchOptions(
        backend=get("backend"),
        world_size=world_size if world_size is not None else get("world_size"),
        device=get("device"),
        timeout_seconds=get("timeout_seconds"),
    )


# ------------------------------------------------------------------------------------ rounds


# Traced steps a benchmark runs by default: 6 is the fewest whose extremes are a 95% interval of
# their median (order statistics: 1 - 2/2^6 = 96.9%, ``ddp.bench.results.stats.median_ci``).
TRACED_STEPS = 6
# On CPU, 3: a traced step costs what a timed one does there, and the default run's rounds must be
# most of its time; the record's exposed communication is then the median of 3, its interval the
# extremes (75% coverage, which the record's ``collectives.steps`` lets a reader tell).
CPU_TRACED_STEPS = 3


@dataclass(frozen=True)
class RoundOptions:
    """How many rounds a measurement runs (``ddp.bench.rounds.loop``): at least ``min_rounds``, then
    more until the median is precise enough or the budget is spent, at most ``max_rounds``."""

    min_rounds: int
    """Timed rounds every measurement gets at least (``--rounds``)."""
    max_rounds: int
    """Timed rounds no measurement gets more of."""
    warmup_rounds: int
    """Untimed rounds before the timed ones (a fresh build gets its own warm-up steps too)."""
    target_precision: float
    """Stop adding rounds once the 95% interval of the median is within +- this fraction of it
    (0.02 means +-2%; 1.0 stops at ``min_rounds``)."""
    budget_seconds: float | None
    """Stop adding rounds once they took this long, precise or not (inf: no budget). None only in
    a grid's defaults: each benchmark gets a share of the session's budget (``GridOptions``)."""
    traced_steps: int = 0
    """Untimed steps after the timed rounds in which each collective is timed
    (``ddp.bench.collectives.recording``): the per-collective figures of the record; 0 for none."""

    def __post_init__(self) -> None:
        if self.min_rounds > self.max_rounds:
            raise OptionError(f"--rounds {self.min_rounds} exceeds --max-rounds {self.max_rounds}: raise --max-rounds")

    @classmethod
    def fixed(cls, rounds: int, warmup_rounds: int, traced_steps: int = 0) -> RoundOptions:
        """Exactly ``rounds`` timed rounds."""
        return cls(rounds, rounds, warmup_rounds, target_precision=1.0, budget_seconds=float("inf"), traced_steps=traced_steps)


def _fraction(flag: str) -> Callable[[str], float]:
    return lambda text: percent(text, flag)


ROUND_OPTIONS = (
    Option("--rounds", "min_rounds", positive_int, "timed rounds every benchmark gets at least"),
    Option("--max-rounds", "max_rounds", positive_int, "timed rounds no benchmark gets more of"),
    Option("--warmup-rounds", "warmup_rounds", non_negative_int, "untimed rounds before the timed ones"),
    Option("--target-precision", "target_precision", _fraction("--target-precision"),
           "add rounds until the 95%% interval of the median is within +- this of it, e.g. 2%%"),
    Option("--round-budget", "budget_seconds", positive_float,
           "seconds of rounds after which a benchmark stops adding rounds, precise or not"),
    Option("--traced-steps", "traced_steps", non_negative_int,
           "untimed steps after the timed rounds in which each collective is timed (0: none)"),
)


def add_round_options(add: Callable, defaults: RoundOptions) -> None:
    """Bind ``RoundOptions`` with a command's defaults."""
    bind(add, ROUND_OPTIONS, defaults)


def round_options(get: Callable[[str], object], defaults: RoundOptions) -> RoundOptions:
    """``RoundOptions`` from parsed values (None: not given, the default); ``--rounds`` above the
    default ``--max-rounds`` raises it rather than failing."""
    given = {o.dest: get(o.dest) for o in ROUND_OPTIONS}
    given = {dest: value for dest, value in given.items() if value is not None}
    if "min_rounds" in given and "max_rounds" not in given:
        given["max_rounds"] = max(defaults.max_rounds, given["min_rounds"])
    return dataclasses.replace(defaults, **given)


# ------------------------------------------------------------------------------------ one configuration


def add_config_options(add: Callable, defaults: Mapping[str, Any], lists: tuple[str, ...] = (),
                       required: tuple[str, ...] = (), only_given: bool = False) -> None:
    """Bind the axes a command that trains one configuration takes: those in ``defaults`` (by field
    name, their default for this command) and, unless ``only_given``, every option and member axis
    (at its ``StepConfig`` default), one value each; the axes in ``lists`` take the grid's list
    instead (``--strategies`` of ``ddp versus``)."""
    for name, axis in AXES.items():
        if name not in defaults and (only_given or axis.role not in ("option", "member")):
            continue
        default = defaults.get(name, axis.default)
        definition = AXIS_LIST_OPTIONS[name] if name in lists else AXIS_OPTIONS[name]
        if name in required:
            definition.bind(add, None, required=True)
        else:
            definition.bind(add, tuple(default) if name in lists and default is not None else default)


def config_values(get: Callable[[str], object]) -> dict[str, Any]:
    """The axes' values a command parsed (``add_config_options``), by field name, for ``StepConfig.of``."""
    return {name: value for name in AXES if (value := get(name)) is not None}


# ------------------------------------------------------------------------------------ grid


@dataclass(frozen=True)
class GridOptions:
    """What a benchmark run times, and how long it may take."""

    axes: Mapping[str, tuple]
    """Each axis's values by ``StepConfig`` field name (``ddp.bench.config.step_config.AXES``); the grid runs
    every combination (``configs``)."""
    rounds: RoundOptions
    """The rounds of each measurement; ``budget_seconds`` None shares ``session_budget_seconds``
    among the step benchmarks (``round_budget_seconds``)."""
    session_budget_seconds: float
    """With ``rounds.budget_seconds`` None: the seconds of timed rounds the whole grid may take,
    shared equally among its step benchmarks, so that a small grid gets many rounds per benchmark
    and the default grid still finishes in time."""
    interleave: str
    """``group``: every strategy of one group in the same rounds, local included, so every
    comparison in the group (the overhead over local too) is paired; ``local``: each strategy with a
    local twin in the same rounds; ``off``: each alone. See ``ddp.bench.rounds.grid_measurer.GridMeasurer``;
    group holds the group's models in memory at once."""
    allreduce_sizes_mb: tuple[float, ...]
    """float32 all-reduce sizes in MiB."""
    allreduce_world_sizes: tuple[int, ...]
    """Ranks for the all-reduce benchmark."""
    device_memory_bytes: int | None = None
    """The memory of one rank's device the grid fits its configurations in (``--device-memory``);
    None: what each rank has (``ddp.bench.memory.predict.device_memory_bytes``)."""
    rank_groups: int = RANK_GROUPS
    """Groups of ranks, each started apart (fresh processes), that every measurement's rounds are
    spread over (``ddp.bench.rounds.spread.measure_in_rank_groups``): 2 or more measure the spread from one
    run to the next, which the regression gate needs to call a slowdown; 1 saves a start-up and a
    build per configuration. A torchrun run (``ddp run``) is one group."""

    def __post_init__(self) -> None:
        if self.rank_groups < 1:
            raise OptionError(f"--rank-groups must be at least 1, got {self.rank_groups}")
        if self.interleave not in INTERLEAVE:
            raise OptionError(f"--interleave takes one of {', '.join(INTERLEAVE)}, got {self.interleave!r}")
        self.configs()  # every configuration is one the suite can build (checked in the parent)

    def values(self, name: str) -> tuple:
        return tuple(self.axes.get(name, (AXES[name].default,)))

    @property
    def model(self) -> str:
        return self.values("model")[0]

    @property
    def strategies(self) -> tuple[str, ...]:
        return self.values("strategy")

    def configs(self) -> list[StepConfig]:
        """Every step configuration, in the order the suite runs them (``ddp.bench.config.step_config.expand``)."""
        return expand(self.axes)

    @property
    def num_step_benchmarks(self) -> int:
        return len(self.configs())

    def round_budget_seconds(self) -> float:
        """The time budget of one benchmark's rounds: ``rounds.budget_seconds``, or the session's
        budget shared among the step benchmarks, within [MIN, MAX]_BENCHMARK_BUDGET_SECONDS."""
        if self.rounds.budget_seconds is not None:
            return self.rounds.budget_seconds
        share = self.session_budget_seconds / max(1, self.num_step_benchmarks)
        return min(MAX_BENCHMARK_BUDGET_SECONDS, max(MIN_BENCHMARK_BUDGET_SECONDS, share))

    def round_options(self) -> RoundOptions:
        """The rounds of each of the grid's measurements, the budget resolved."""
        return dataclasses.replace(self.rounds, budget_seconds=self.round_budget_seconds())


# The grid's own options beside the axes' and the rounds'.
RUN_OPTIONS = (
    Option("--session-budget", "session_budget_seconds", positive_float,
           "seconds of timed rounds the whole grid may take, shared among its step benchmarks when --round-budget is not given"),
    Option("--interleave", "interleave", choice("--interleave", INTERLEAVE),
           f"group: all strategies of a group (model, batch, seq len, options) in the same rounds, {FLOOR} included "
           "(paired comparisons); "
           f"{FLOOR}: each with a {FLOOR} twin; off: each alone (least memory)"),
    Option("--allreduce-sizes-mb", "allreduce_sizes_mb", lambda t: positive_floats(t, "sizes in MiB"), "float32 all-reduce sizes in MiB"),
    Option("--allreduce-world-sizes", "allreduce_world_sizes", lambda t: positive_ints(t, "world sizes"),
           "ranks for the all-reduce benchmark"),
    Option("--rank-groups", "rank_groups", positive_int,
           "groups of ranks, each started apart, that every benchmark's rounds are spread over: 2 or more measure "
           "how much a run differs from the next, which the regression gate needs to call a slowdown"),
    Option("--device-memory", "device_memory_bytes", memory_size,
           "memory of one rank's device that configurations must fit in, e.g. 40GiB: what is predicted not to fit is "
           "not built (default: each rank's share of its GPU, or of the host's available memory)"),
)
GRID_OPTIONS = (*AXIS_LIST_OPTIONS.values(), *ROUND_OPTIONS, *RUN_OPTIONS)
ALL_OPTIONS = tuple(dict.fromkeys((*LAUNCH_OPTIONS, *AXIS_OPTIONS.values(), *GRID_OPTIONS)))


def option(flag: str) -> Option:
    """The definition of ``flag`` (tests read them)."""
    return next(o for o in ALL_OPTIONS if o.flag == flag)


def gpu_world_sizes(gpus: int) -> tuple[int, ...]:
    """Powers of two up to the number of GPUs, and that number itself: 8 GPUs -> 2, 4, 8."""
    sizes = [2**k for k in range(1, gpus.bit_length()) if 2**k <= gpus]
    return tuple(sorted(set(sizes) | ({gpus} if gpus >= 2 else set()))) or (1,)


def grid_defaults(backend: str, device: str) -> GridOptions:
    """The axes' own defaults (``Axis.gpu`` with CUDA, ``Axis.cpu`` otherwise: on CPU a grid that runs
    in under 10 minutes on 2 cores), and the rounds and budget of each."""
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return GridOptions(
            axes={name: axis.gpu for name, axis in AXES.items()},
            # 10 rounds at least; more only until the median is within +-1%, which a GPU-bound step
            # (0.3% a round on an H200, fp32 to bf16) reaches in them: the budget is a ceiling.
            # 300 s for the grid's 24 steps, 12.5 s each, is about what +-1% takes at 2% a round
            # (31 rounds of a pair: 14 s for an xl pair at 4 x 1,024, 7 at 2 x 1,024, at the H200's
            # step times; the larger pairs stop a little short).
            rounds=RoundOptions(min_rounds=10, max_rounds=MAX_ROUNDS, warmup_rounds=2, target_precision=0.01,
                                budget_seconds=None, traced_steps=TRACED_STEPS),
            # Each strategy with its local twin, as on CPU: the paired overhead, local_mfu and
            # mfu_lost_points are the suite's headline figures. At batch 2 x 1,024 in bf16 a
            # strategy and its twin fit an 80 GB GPU together (torch 25 MiB: 29.8 + 22.3 GiB kept,
            # its step's 14.9 more, beside three processes' 4.5: 71.5 of 71.7 usable). At batch 4
            # they do not (backward's 21.5 GiB of activations on top): the twin gives way, the step
            # is measured alone and its row says why (``unpaired_reason``); an H200 pairs both.
            session_budget_seconds=300.0, interleave=FLOOR,
            allreduce_sizes_mb=(1.0, 10.0, 100.0, 1024.0),
            # NCCL needs a GPU per rank; gloo ranks can share one
            allreduce_world_sizes=gpu_world_sizes(gpus) if backend == "nccl" else (2, 4, 6),
        )
    return GridOptions(
        axes={name: axis.cpu for name, axis in AXES.items()},
        # 24 rounds at least: the regression gate judges a benchmark from 20 rounds a run
        # (``ddp.analysis.compare``), and two default runs must compare with every step decided.
        rounds=RoundOptions(min_rounds=24, max_rounds=MAX_ROUNDS, warmup_rounds=0, target_precision=0.02, budget_seconds=None,
                            traced_steps=CPU_TRACED_STEPS),
        # 180 s of rounds for the grid's 20 steps, 9 s each: 24 rounds of mini's slowest group of
        # strategies stepping together (``interleave="group"``: a round steps the group and one
        # local). Rounds were 68% of the step benchmarks' time in the default run
        # (docs/perf-suite.md: where a default run's seconds go).
        session_budget_seconds=180.0, interleave="group",
        # Two world sizes: 6 gloo ranks on 2 cores time the scheduler more than gloo, and the
        # default run's minutes belong to its step benchmarks.
        allreduce_sizes_mb=(1.0, 10.0, 100.0), allreduce_world_sizes=(2, 4),
    )


def add_grid_options(add: Callable, skip: tuple[str, ...] = ()) -> None:
    """Bind ``GridOptions`` to a parser (defaults are resolved per backend by ``grid_options``)."""
    for grid_option in GRID_OPTIONS:
        if grid_option.flag not in skip:
            grid_option.bind(add, None, "per backend, see docs/perf-suite.md")


def grid_options(get: Callable[[str], object], backend: str, device: str, skip: tuple[str, ...] = ()) -> GridOptions:
    """The defaults of ``backend``/``device`` with every option given on the command line applied."""
    defaults = grid_defaults(backend, device)
    given = {o.dest: get(o.dest) for o in GRID_OPTIONS if o.flag not in skip}
    given = {dest: value for dest, value in given.items() if value is not None}
    axes = {**defaults.axes, **{name: given[name] for name in AXES if name in given}}
    run = {o.dest: given[o.dest] for o in RUN_OPTIONS if o.dest in given}
    rounds = round_options(lambda dest: given.get(dest), defaults.rounds)
    return dataclasses.replace(defaults, axes=axes, rounds=rounds, **run)
