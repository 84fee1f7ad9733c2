"""One options layer: what a launch, a configuration, a measurement's rounds and a benchmark grid
are, declared once, with their units, their defaults, their parsing and their validation.

``LaunchOptions`` (backend, world size, device, timeout), ``RoundOptions`` (how many rounds a
measurement runs), ``GridOptions`` (what is benchmarked and for how long) are the definitions, and
every flag is an ``Option`` declared once below (``LAUNCH_OPTIONS``, ``CONFIG_OPTIONS``,
``ROUND_OPTIONS``, ``GRID_OPTIONS``): its flag, the field it fills, its parser and its help.
``bind`` adds options to an ``argparse`` parser or to pytest's (both take ``add(flag, **kwargs)``)
with the defaults a command gives, so ``pytest perf_tests`` and every ``python -m ddp`` command
share flags, help texts, parsers and meanings; only defaults differ per command (``--rounds`` is
the fewest timed rounds everywhere). Every check runs in the parent process, before any rank
starts: a bad value is an ``OptionError`` whose one-line message says what to do, which pytest
turns into a usage error and the command line into exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddp.bench.config import GRAD_COMMS, OPTIMIZERS, PRECISIONS
from ddp.bench.stats import parse_percent
from ddp.bench.workloads import check_workload, max_seq_len
from ddp.launcher import BACKENDS, DEFAULT_TIMEOUT_SECONDS, choose_backend, default_device, unavailable_reason
from ddp.model import MODEL_SIZES
from ddp.strategies.registry import DEFAULT_GRID_STRATEGIES, StrategyError, resolve_strategy, takes_bucket_size, takes_comm_dtype

DEVICES = ("cpu", "cuda")
# How a grid's configurations share rounds (``ddp.bench.measure.GridMeasurer``).
INTERLEAVE = ("group", "local", "off")


# Bounds of a benchmark's share of the session's round budget: at least enough for the minimum
# rounds of a slow step, at most what a regression check needs (about 100 rounds of a 1 s step).
MIN_BENCHMARK_BUDGET_SECONDS = 3.0
MAX_BENCHMARK_BUDGET_SECONDS = 120.0
# The default cap on a benchmark's rounds. The precision target, the comparison a run aims at and
# the time budget decide when rounds stop; the cap only bounds the bootstrap's arrays (2000
# resamples x 2000 rounds x 8 bytes = 32 MB each). A small model's step of 10 ms on 2 CPU cores
# scatters over x2.4 between its 10th and 90th percentiles: 200 rounds left its median uncertain by
# +-5% and a 15% slowdown unresolved (docs/regression-gate.md).
MAX_ROUNDS = 2000


class OptionError(ValueError):
    """A bad option value; the message is one line that says what to do."""


# ------------------------------------------------------------------------------------ parsing


def parse_list(text: str, kind: Callable, what: str) -> tuple:
    """``"1,10,100"`` -> ``(1, 10, 100)``: the one parser of comma-separated options."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise OptionError(f"expected a comma-separated list of {what}, got {text!r}")
    try:
        return tuple(kind(part) for part in parts)
    except (TypeError, ValueError):
        raise OptionError(f"expected a comma-separated list of {what}, got {text!r}") from None


def argument_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    """Wrap a parser for ``type=``: argparse (and pytest, which uses it) report ArgumentTypeError
    as ``error: argument --flag: message``."""

    def parse_argument(text: str):
        try:
            return parse(text)
        except OptionError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse_argument.__name__ = name  # argparse names the type in some messages
    return parse_argument


def positive_ints(text: str, what: str = "positive integers") -> tuple[int, ...]:
    values = parse_list(text, int, what)
    if any(value < 1 for value in values):
        raise OptionError(f"expected {what} (1 or more), got {text!r}")
    return values


def positive_floats(text: str, what: str = "positive numbers") -> tuple[float, ...]:
    values = parse_list(text, float, what)
    if any(not math.isfinite(value) or value <= 0 for value in values):
        raise OptionError(f"expected {what} (finite, above 0), got {text!r}")
    return values


def strategy_names(text: str) -> tuple[str, ...]:
    """Registered names or ``package.module:ClassName``, each imported and checked here."""
    names = parse_list(text, str, "strategies")
    if len(set(names)) != len(names):
        raise OptionError(f"give each strategy once, got {text!r}")
    for name in names:
        try:
            resolve_strategy(name)
        except (StrategyError, TypeError) as error:
            raise OptionError(str(error)) from None
    return names


def workload_name(text: str) -> str:
    try:
        return check_workload(text.strip())
    except ValueError as error:
        raise OptionError(str(error)) from None


def model_size_name(text: str) -> str:
    if text.strip() not in MODEL_SIZES:
        raise OptionError(f"unknown model size {text.strip()!r}: choose one of {', '.join(MODEL_SIZES)} (or --model package.module:build)")
    return text.strip()


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise OptionError(f"expected a whole number of 0 or more, got {text!r}") from None
    if value < 0:
        raise OptionError(f"expected a whole number of 0 or more, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value < 1:
        raise OptionError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return positive_floats(text, "a positive number")[0]


# ------------------------------------------------------------------------------------ definitions


@dataclass(frozen=True)
class Option:
    """One command-line option, declared once and bound by pytest and every command."""

    flag: str
    dest: str
    """The field it fills (of ``GridOptions``, ``RoundOptions``, ``LaunchOptions``, or the command's own)."""
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


def bind(add: Callable, options: tuple[Option, ...], defaults: dict[str, object] | object, skip: tuple[str, ...] = ()) -> None:
    """Bind ``options`` with ``defaults`` (by ``dest``: a dict, or a dataclass such as ``RoundOptions``)."""
    for option in options:
        if option.flag in skip:
            continue
        default = defaults.get(option.dest) if isinstance(defaults, dict) else getattr(defaults, option.dest, None)
        option.bind(add, default)


def option(flag: str) -> Option:
    """The definition of ``flag`` (tests read them)."""
    return next(o for o in ALL_OPTIONS if o.flag == flag)


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


# ------------------------------------------------------------------------------------ one configuration


CONFIG_OPTIONS = (
    Option("--model", "model", workload_name,
           "model to train: a size of ddp.model.MODEL_SIZES, a named model (mlp, wide-mlp, conv, ...), or your own "
           "as package.module:build"),
    Option("--model-size", "model", model_size_name, "a size of the built-in Transformer LM (the same as --model SIZE)"),
    Option("--batch-size", "batch_size", positive_int, "samples (sequences) per rank per step"),
    Option("--seq-len", "seq_len", positive_int, "tokens per sequence, where the model has them"),
    Option("--bucket-size-mb", "bucket_size_mb", positive_float, "bucket cap in MiB for the strategies that take bucket_size_mb"),
    Option("--strategies", "strategies", strategy_names, "strategies, comma-separated: registered names or package.module:ClassName"),
)


def add_config_options(add: Callable, *, model: str | None, batch_size: int | None, seq_len: int | None,
                       bucket_size_mb: float | None = 25.0, strategies: tuple[str, ...] | None = None) -> None:
    """Bind the options of commands that train one configuration (profile, versus, buckets):
    ``--model``, ``--batch-size``, ``--seq-len``, the step's numerics (``NUMERICS_OPTIONS``, one
    value each), and ``--bucket-size-mb`` and ``--strategies`` where given a default."""
    skip = tuple(flag for flag, default in (("--bucket-size-mb", bucket_size_mb), ("--strategies", strategies)) if default is None)
    bind(add, CONFIG_OPTIONS, {"model": model, "batch_size": batch_size, "seq_len": seq_len,
                               "bucket_size_mb": bucket_size_mb, "strategies": strategies}, skip)
    bind(add, NUMERICS_OPTIONS, NUMERICS_DEFAULTS)


def choices_of(flag: str, choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A parser of a comma-separated subset of ``choices``, e.g. ``--precision fp32,bf16``."""

    def parse(text: str) -> tuple[str, ...]:
        values = parse_list(text, str, f"{flag} values")
        unknown = [value for value in values if value not in choices]
        if unknown or len(set(values)) != len(values):
            raise OptionError(f"{flag} takes one or more of {', '.join(choices)}, each once, comma-separated; got {text!r}")
        return values

    return parse


# The step's numerics (``ddp.bench.config.StepConfig``; what each value means: ``ddp.bench.trainer``).
# One definition each, list-valued: the grid runs every value given, a command that trains one
# configuration takes one (``step_numerics``).
NUMERICS_OPTIONS = (
    Option("--precision", "precisions", choices_of("--precision", PRECISIONS),
           "what the step computes in: fp32 (fp32 matmuls), tf32 (TF32 matmuls; on CPU the same as fp32), bf16 "
           "(autocast around forward and loss, fp32 weights, gradients and AdamW); see docs/perf-suite.md"),
    Option("--optimizer", "optimizers", choices_of("--optimizer", OPTIMIZERS), "AdamW's implementation: foreach or fused"),
    Option("--grad-comm", "grad_comms", choices_of("--grad-comm", GRAD_COMMS),
           "the dtype gradients are all-reduced in by the strategies that take comm_dtype (bucketed, torch): fp32, or "
           "bf16 accumulated back into fp32 gradients"),
)
NUMERICS_DEFAULTS = {"precisions": (PRECISIONS[0],), "optimizers": (OPTIMIZERS[0],), "grad_comms": (GRAD_COMMS[0],)}


def step_numerics(get: Callable[[str], object]) -> dict:
    """The numerics of the one configuration a command trains, as ``StepConfig`` keywords
    (``numerics_for`` keeps ``grad_comm`` to the strategies that take it)."""
    numerics = {}
    for o in NUMERICS_OPTIONS:
        values = get(o.dest)
        if len(values) != 1:
            raise OptionError(f"{o.flag} {','.join(values)}: this command trains one configuration; give one value")
        numerics[o.dest[:-1]] = values[0]  # precisions -> precision
    return numerics


def numerics_for(strategy: str, numerics: dict) -> dict:
    """``numerics`` with a reduced-precision ``grad_comm`` kept only for a strategy that takes ``comm_dtype``."""
    return numerics if takes_comm_dtype(strategy) else {**numerics, "grad_comm": "fp32"}


# ------------------------------------------------------------------------------------ rounds


@dataclass(frozen=True)
class RoundOptions:
    """How many rounds a measurement runs (``ddp.bench.measure``): at least ``min_rounds``, then
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
    budget_seconds: float
    """Stop adding rounds once they took this long, precise or not (inf: no budget)."""

    def __post_init__(self) -> None:
        if self.min_rounds > self.max_rounds:
            raise OptionError(f"--rounds {self.min_rounds} exceeds --max-rounds {self.max_rounds}: raise --max-rounds")

    @classmethod
    def fixed(cls, rounds: int, warmup_rounds: int) -> RoundOptions:
        """Exactly ``rounds`` timed rounds."""
        return cls(rounds, rounds, warmup_rounds, target_precision=1.0, budget_seconds=float("inf"))


ROUND_OPTIONS = (
    Option("--rounds", "min_rounds", positive_int, "timed rounds every benchmark gets at least"),
    Option("--max-rounds", "max_rounds", positive_int, "timed rounds no benchmark gets more of"),
    Option("--warmup-rounds", "warmup_rounds", non_negative_int, "untimed rounds before the timed ones"),
    Option("--target-precision", "target_precision", lambda t: _fraction(t, "--target-precision"),
           "add rounds until the 95%% interval of the median is within +- this of it, e.g. 2%%"),
    Option("--round-budget", "budget_seconds", positive_float,
           "seconds of rounds after which a benchmark stops adding rounds, precise or not"),
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


def check_seq_len(model: str, seq_len: int) -> None:
    """``OptionError`` if ``seq_len`` exceeds the model's context length."""
    limit = max_seq_len(model)
    if limit is not None and seq_len > limit:
        raise OptionError(f"--seq-len {seq_len} exceeds model {model}'s context length {limit}: choose a shorter one")


# ------------------------------------------------------------------------------------ grid


@dataclass(frozen=True)
class GridOptions:
    """What a benchmark run times, and how long it may take."""

    model: str
    """A size of ``ddp.model.MODEL_SIZES``, a model of ``ddp.bench.workloads.NAMED_WORKLOADS``, or
    ``package.module:build`` (your own model; see the README)."""
    strategies: tuple[str, ...]
    """Registered names or ``package.module:ClassName``."""
    batch_sizes: tuple[int, ...]
    """Samples (sequences) per rank per step."""
    seq_lens: tuple[int, ...]
    """Tokens per sequence."""
    bucket_sizes_mb: tuple[float, ...]
    """Bucket caps in MiB, for the strategies whose constructor takes ``bucket_size_mb``."""
    min_rounds: int
    """Timed rounds every benchmark gets at least."""
    max_rounds: int
    """Timed rounds no benchmark gets more of."""
    warmup_rounds: int
    """Untimed rounds before the timed ones (a fresh build gets its own warm-up steps too)."""
    target_precision: float
    """Stop adding rounds once the 95% interval of the median is within +- this fraction of it
    (0.02 means +-2%)."""
    budget_seconds: float | None
    """Stop adding rounds once a benchmark's rounds took this long, precise or not; None shares
    ``session_budget_seconds`` among the grid's step benchmarks (see ``round_budget_seconds``)."""
    session_budget_seconds: float
    """With ``budget_seconds`` None: the seconds of timed rounds the whole grid may take, shared
    equally among its step benchmarks, so that a small grid gets many rounds per benchmark and the
    default grid still finishes in time."""
    interleave: str
    """``group``: every strategy of one model, batch and sequence length in the same rounds, local
    included, so every comparison in the group (the overhead over local too) is paired; ``local``:
    each strategy with a local twin in the same rounds; ``off``: each alone. See
    ``ddp.bench.measure.GridMeasurer``; group holds the group's models in memory at once."""
    allreduce_sizes_mb: tuple[float, ...]
    """float32 all-reduce sizes in MiB."""
    allreduce_world_sizes: tuple[int, ...]
    """Ranks for the all-reduce benchmark."""
    precisions: tuple[str, ...] = ("fp32",)
    """What steps compute in (``ddp.bench.trainer.PRECISIONS``): each is a group of its own."""
    optimizers: tuple[str, ...] = ("foreach",)
    """AdamW implementations (``foreach``, ``fused``)."""
    grad_comms: tuple[str, ...] = ("fp32",)
    """Gradient all-reduce dtypes, for the strategies that take ``comm_dtype`` (others communicate
    gradients as they are, once)."""

    def __post_init__(self) -> None:
        self.round_options()  # refuses --rounds above --max-rounds
        limit = max_seq_len(self.model)
        if limit is not None and max(self.seq_lens) > limit:
            raise OptionError(
                f"--seq-lens {max(self.seq_lens)} exceeds model {self.model}'s context length {limit}: "
                "choose shorter sequences"
            )

    def buckets_for(self, strategy: str) -> tuple[float | None, ...]:
        return self.bucket_sizes_mb if takes_bucket_size(strategy) else (None,)

    def grad_comms_for(self, strategy: str) -> tuple[str, ...]:
        return self.grad_comms if takes_comm_dtype(strategy) else ("fp32",)

    @property
    def num_step_benchmarks(self) -> int:
        per_group = sum(len(self.buckets_for(s)) * len(self.grad_comms_for(s)) for s in self.strategies)
        return len(self.precisions) * len(self.optimizers) * len(self.batch_sizes) * len(self.seq_lens) * per_group

    def round_budget_seconds(self) -> float:
        """The time budget of one benchmark's rounds: ``budget_seconds``, or the session's budget
        shared among the step benchmarks, within [MIN, MAX]_BENCHMARK_BUDGET_SECONDS."""
        if self.budget_seconds is not None:
            return self.budget_seconds
        share = self.session_budget_seconds / max(1, self.num_step_benchmarks)
        return min(MAX_BENCHMARK_BUDGET_SECONDS, max(MIN_BENCHMARK_BUDGET_SECONDS, share))

    def round_options(self) -> RoundOptions:
        """The rounds of each of the grid's measurements."""
        return RoundOptions(self.min_rounds, self.max_rounds, self.warmup_rounds, self.target_precision, self.round_budget_seconds())


def gpu_world_sizes(gpus: int) -> tuple[int, ...]:
    """Powers of two up to the number of GPUs, and that number itself: 8 GPUs -> 2, 4, 8."""
    sizes = [2**k for k in range(1, gpus.bit_length()) if 2**k <= gpus]
    return tuple(sorted(set(sizes) | ({gpus} if gpus >= 2 else set()))) or (1,)


def grid_defaults(backend: str, device: str) -> GridOptions:
    """The seeds' grid on GPUs (model xl, batch 2 and 4, sequences 128 to 512, buckets 1 to 1000
    MB); on CPU a grid that runs in under 10 minutes on 2 cores (model mini: 9.3M parameters, 37 MB
    of gradients, its largest tensors 10 MB, so 1, 10 and 100 MB caps give many, a few and one bucket)."""
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return GridOptions(
            model="xl", strategies=DEFAULT_GRID_STRATEGIES, batch_sizes=(2, 4), seq_lens=(128, 256, 512),
            bucket_sizes_mb=(1.0, 10.0, 100.0, 1000.0), min_rounds=10, max_rounds=MAX_ROUNDS, warmup_rounds=2,
            target_precision=0.01, budget_seconds=None, session_budget_seconds=1800.0, interleave="off",
            allreduce_sizes_mb=(1.0, 10.0, 100.0, 1024.0),
            # NCCL needs a GPU per rank; gloo ranks can share one
            allreduce_world_sizes=gpu_world_sizes(gpus) if backend == "nccl" else (2, 4, 6),
        )
    return GridOptions(
        model="mini", strategies=DEFAULT_GRID_STRATEGIES, batch_sizes=(4, 8), seq_lens=(64, 128),
        bucket_sizes_mb=(1.0, 10.0, 100.0), min_rounds=5, max_rounds=MAX_ROUNDS, warmup_rounds=1,
        # 200 s of rounds: the builds, warm-ups and memory counts of the 40 step configurations
        # take about 280 s more, and with 270 s the default run took 10 min 27 s (2026-11-23).
        target_precision=0.02, budget_seconds=None, session_budget_seconds=200.0, interleave="local",
        allreduce_sizes_mb=(1.0, 10.0, 100.0), allreduce_world_sizes=(2, 4, 6),
    )


def _list_of(config_flag: str, flag: str, dest: str, parse: Callable, what: str) -> Option:
    """The list form of a configuration option (``--batch-sizes`` of ``--batch-size``): its meaning, a list."""
    single = next(o for o in CONFIG_OPTIONS if o.flag == config_flag)
    return Option(flag, dest, parse, f"{single.help}; a comma-separated list of {what}")


# The grid's own options, and the definitions it shares with the other commands.
GRID_OPTIONS = (
    CONFIG_OPTIONS[0],  # --model
    CONFIG_OPTIONS[1],  # --model-size
    CONFIG_OPTIONS[5],  # --strategies
    _list_of("--batch-size", "--batch-sizes", "batch_sizes", lambda t: positive_ints(t, "batch sizes"), "them"),
    _list_of("--seq-len", "--seq-lens", "seq_lens", lambda t: positive_ints(t, "sequence lengths"), "them"),
    _list_of("--bucket-size-mb", "--bucket-sizes", "bucket_sizes_mb", lambda t: positive_floats(t, "bucket sizes in MiB"), "them"),
    *ROUND_OPTIONS,
    Option("--session-budget", "session_budget_seconds", positive_float,
           "seconds of timed rounds the whole grid may take, shared among its step benchmarks when --round-budget is not given"),
    Option("--interleave", "interleave", lambda t: _choice(t, "--interleave", INTERLEAVE),
           "group: all strategies of a batch and seq len in the same rounds, local included (paired comparisons); "
           "local: each with a local twin; off: each alone (least memory)"),
    Option("--allreduce-sizes-mb", "allreduce_sizes_mb", lambda t: positive_floats(t, "sizes in MiB"), "float32 all-reduce sizes in MiB"),
    Option("--allreduce-world-sizes", "allreduce_world_sizes", lambda t: positive_ints(t, "world sizes"),
           "ranks for the all-reduce benchmark"),
    *NUMERICS_OPTIONS,
)

ALL_OPTIONS = tuple(dict.fromkeys((*LAUNCH_OPTIONS, *CONFIG_OPTIONS, *ROUND_OPTIONS, *GRID_OPTIONS)))


def _fraction(text: str, flag: str) -> float:
    try:
        return parse_percent(text, flag)
    except ValueError as error:
        raise OptionError(str(error)) from None


def percent_type(flag: str) -> Callable[[str], float]:
    """An argparse/pytest ``type=`` for a percentage option (``10%`` or ``0.1``)."""
    return argument_type(lambda text: _fraction(text, flag), flag.lstrip("-").replace("-", "_"))


def _choice(text: str, flag: str, choices: tuple[str, ...]) -> str:
    if text.strip() not in choices:
        raise OptionError(f"{flag} takes one of {', '.join(choices)}, got {text!r}")
    return text.strip()


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
    if "min_rounds" in given and "max_rounds" not in given:
        given["max_rounds"] = max(defaults.max_rounds, given["min_rounds"])
    return dataclasses.replace(defaults, **given)
