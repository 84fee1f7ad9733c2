"""Text to values, for every option of pytest and of every ``python -m ddp`` command: each parser
raises ``OptionError`` with a one-line message that says what to write instead. The options
themselves are declared in ``ddp.bench.config.step_config`` (a step's axes) and ``ddp.bench.config.options`` (the
launch, the rounds, the grid's run)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# The default cap on a benchmark's rounds. The precision target, the comparison a run aims at and
# the time budget decide when rounds stop; the cap only bounds the bootstrap (``ddp.bench.results.stats``)'s arrays (2000
# resamples x 2000 rounds x 8 bytes = 32 MB each). A small model's step of 10 ms on 2 CPU cores
# scatters over x2.4 between its 10th and 90th percentiles: 200 rounds left its median uncertain by
# +-5% and a 15% slowdown unresolved (docs/regression-gate.md).
MAX_ROUNDS = 2000


class OptionError(ValueError):
    """A bad option value; the message is one line that says what to do."""


def parse_list(text: str, kind: Callable, what: str) -> tuple:
    """``"1,10,100"`` -> ``(1, 10, 100)``: the one parser of comma-separated options (each part
    parsed by ``kind``, which may raise ``OptionError`` itself)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise OptionError(f"expected a comma-separated list of {what}, got {text!r}")
    try:
        return tuple(kind(part) for part in parts)
    except OptionError:
        raise
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
    try:
        value = float(text)
    except ValueError:
        raise OptionError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise OptionError(f"expected a positive number (finite, above 0), got {text!r}")
    return value


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


def choice(flag: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser of one of ``choices``."""

    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise OptionError(f"{flag} takes one of {', '.join(choices)}, got {text!r}")
        return text.strip()

    return parse


def percent(text: str, flag: str = "the threshold") -> float:
    """A relative threshold, as a fraction: "10%" -> 0.10, "0.1" -> 0.1.

    A bare number must be a fraction below 1: "10" is refused rather than guessed (10% or 1000%?).
    """
    usage = f"{flag} takes a percentage such as 10% (or a fraction such as 0.1), got {text!r}"
    stripped = str(text).strip()
    is_percent = stripped.endswith("%")
    try:
        value = float(stripped[:-1].strip() if is_percent else stripped)
    except ValueError:
        raise OptionError(usage) from None
    fraction = value / 100 if is_percent else value
    if not math.isfinite(fraction) or fraction <= 0 or (not is_percent and fraction >= 1):
        raise OptionError(usage)
    return fraction


def percent_type(flag: str) -> Callable[[str], float]:
    """An argparse/pytest ``type=`` for a percentage option (``10%`` or ``0.1``)."""
    return argument_type(lambda text: percent(text, flag), flag.lstrip("-").replace("-", "_"))


MEMORY_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
                "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def memory_size(text: str, flag: str = "--device-memory") -> int:
    """Bytes from a size with its unit: ``80GiB``, ``80 GB`` (10^9), ``512MiB``, ``1.5TiB``."""
    usage = f"{flag} takes a size with its unit, such as 80GiB, 80GB or 512MiB; got {text!r}"
    stripped = str(text).strip().lower().replace(" ", "")
    unit = next((u for u in sorted(MEMORY_UNITS, key=len, reverse=True) if stripped.endswith(u)), None)
    if unit is None:
        raise OptionError(usage)
    try:
        value = float(stripped[: -len(unit)])
    except ValueError:
        raise OptionError(usage) from None
    if not math.isfinite(value) or value <= 0:
        raise OptionError(usage)
    return int(value * MEMORY_UNITS[unit])
