"""What the README and docs/perf-suite.md say of the saved record and the options is what the code
defines: every key of their tables is a field of the record (docs/perf-suite.md lists them all),
every flag of the options table is an option (and every grid option is listed), and the schema
version they state is the one the code writes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ddp.bench.config.options import AXIS_LIST_OPTIONS, GRID_OPTIONS, grid_defaults
from ddp.bench.config.step_config import AXES, StepConfig
from ddp.bench.results.records import SCHEMA_VERSION, AllReduceRecord, RaceRecord, StateRecord, StepRecord

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PERF_SUITE = (ROOT / "docs" / "perf-suite.md").read_text()


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def first_column_names(table: list[str]) -> set[str]:
    """The backticked names in the first cell of each row of a Markdown table (header and rule skipped)."""
    names = set()
    for row in table[2:]:
        first = row.strip().strip("|").split("|")[0]
        names |= set(re.findall(r"`([^`]+)`", first))
    return names


def table_after(text: str, marker: str) -> list[str]:
    """The first Markdown table after the line that starts with ``marker``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[first:end]


@pytest.mark.parametrize(
    "marker, cls",
    [("**`StepRecord`**", StepRecord), ("**`config`**", StepConfig), ("**`memory`**", StateRecord),
     ("**`AllReduceRecord`**", AllReduceRecord), ("**`RaceRecord`**", RaceRecord)],
    ids=["step", "config", "memory", "allreduce", "race"],
)
def test_perf_suite_lists_every_key_of_the_record_and_no_other(marker, cls):
    listed = first_column_names(table_after(PERF_SUITE, marker))
    assert listed == fields(cls), f"docs/perf-suite.md {marker}: missing {sorted(fields(cls) - listed)}, unknown {sorted(listed - fields(cls))}"


def test_the_readme_keys_are_keys_of_the_step_record():
    listed = first_column_names(table_after(README, "| key | meaning |"))
    assert listed and listed <= fields(StepRecord), f"README names keys the record lacks: {sorted(listed - fields(StepRecord))}"


def test_the_options_table_lists_every_grid_option_and_no_other():
    listed = {name for name in first_column_names(table_after(PERF_SUITE, "| option | GPU default")) if name.startswith("--")}
    assert listed == {o.flag for o in GRID_OPTIONS}


@pytest.mark.parametrize("path", ["README.md", "docs/perf-suite.md", "docs/architecture.md"])
def test_the_schema_version_stated_is_the_one_written(path):
    stated = [int(v) for v in re.findall(r"schema(?:_version`| version| \(version)?,? (\d+)", (ROOT / path).read_text())]
    assert stated and set(stated) == {SCHEMA_VERSION}, f"{path} states schema {stated}, the code writes {SCHEMA_VERSION}"


def test_the_options_table_states_each_axis_default_as_declared():
    """The GPU and CPU default columns of the axes' rows are the declarations' ``Axis.gpu`` and ``Axis.cpu``."""
    rows = {re.findall(r"`([^`]+)`", row.split("|")[1])[0]: [cell.strip() for cell in row.strip().strip("|").split("|")]
            for row in table_after(PERF_SUITE, "| option | GPU default")[2:]}
    declared = {"gpu": grid_defaults("nccl", "cuda"), "cpu": grid_defaults("gloo", "cpu")}

    def stated(cell: str) -> str:
        return cell.split(" (")[0].replace("`", "").strip()

    for name in AXES:
        flag = AXIS_LIST_OPTIONS[name].flag
        gpu_cell, cpu_cell = rows[flag][1], rows[flag][2]
        for column, cell in (("gpu", gpu_cell), ("cpu", cpu_cell if stated(cpu_cell) != "the same" else gpu_cell)):
            values = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in declared[column].values(name))
            assert stated(cell) == values, f"docs/perf-suite.md states {flag} {stated(cell)!r} on {column}, declared {values!r}"
