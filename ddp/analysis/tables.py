"""How figures are written in every table ddp-bench prints or saves: times in ms, intervals,
sizes in MiB, shares in per cent, and one ``table`` on ``tabulate``. The report, ``ddp compare``,
``ddp simulate``, ``ddp versus``, ``ddp buckets`` and the pytest gate all format through here."""

from __future__ import annotations

from tabulate import tabulate

from ddp.strategies.bucketed import BYTES_PER_MB


def ms(seconds: float | None, digits: int = 2, missing: str = "") -> str:
    """Seconds as milliseconds, ``digits`` after the point; ``missing`` for None."""
    return missing if seconds is None else f"{seconds * 1e3:.{digits}f}"


def interval_ms(interval: list[float] | tuple[float, float] | None, digits: int = 2) -> str:
    """A 95% interval in seconds as ``[low, high]`` in ms; empty when there is none."""
    return "" if not interval else f"[{ms(interval[0], digits)}, {ms(interval[1], digits)}]"


def ratio_interval(interval: list[float] | tuple[float, float] | None) -> str:
    return "" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def mib(nbytes: float) -> str:
    return f"{nbytes / BYTES_PER_MB:.3g}"


def pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def table(rows: list, headers: list[str], tablefmt: str = "simple") -> str:
    """Rows under headers, text as given (no number parsing): ``simple`` for a terminal,
    ``github`` for Markdown."""
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
