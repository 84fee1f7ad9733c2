"""``pytest perf_tests --benchmark-compare`` refuses, before any rank starts, a comparison it cannot
make: a saved run that does not exist, or one of another grid. One line names the runs saved
there; the exit status is 2, as every command's usage error; nothing is measured first."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pytest_benchmark.utils import get_machine_id

from tests.synthetic import run_json, strategy_benchmark, write

ROOT = Path(__file__).resolve().parents[1]


def perf_run(project: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """``pytest perf_tests`` in ``project``, its runs saved in ``project/.bench``; and its seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "perf_tests", "-q", "-p", "no:cacheprovider",
                           f"--benchmark-storage=file://{project / '.bench'}", *flags],
                          cwd=project, capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - start


def saved(storage: Path, name: str, document: dict) -> None:
    folder = storage / get_machine_id()
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / f"{name}.json", document)


def exit_line(done: subprocess.CompletedProcess) -> str:
    (line,) = [line for line in done.stdout.splitlines() if "Exit:" in line]
    return line


def copy_project(tmp_path: Path) -> Path:
    """The checkout's suite in a folder of its own (pytest-benchmark names storage relative to the
    working folder), its storage empty."""
    for name in ("conftest.py", "pyproject.toml", "perf_tests", "ddp", "examples"):
        target = tmp_path / name
        if (ROOT / name).is_dir():
            subprocess.run(["cp", "-r", str(ROOT / name), str(target)], check=True)
        else:
            target.write_text((ROOT / name).read_text())
    return tmp_path


def test_a_missing_saved_run_fails_in_seconds_naming_what_exists(tmp_path):
    project = copy_project(tmp_path)
    saved(project / ".bench", "0001_baseline", run_json([strategy_benchmark("bucketed", [0.2] * 24, [0.18] * 24)]))
    done, seconds = perf_run(project, "--benchmark-compare=0099", "--ddp-fail-slower", "10%")
    assert done.returncode == 2, done.stdout[-2000:]
    assert seconds < 10
    assert "no saved run '0099'" in exit_line(done) and "0001_baseline" in exit_line(done)
    assert "regression gate" not in done.stdout  # nothing measured, nothing judged


def test_a_run_of_another_grid_fails_before_any_rank_starts(tmp_path):
    project = copy_project(tmp_path)
    # a baseline of mini's steps; this run asks for tiny's, under the same test ids
    saved(project / ".bench", "0001_mini", run_json([strategy_benchmark("bucketed", [0.2] * 24, [0.18] * 24)]))
    done, seconds = perf_run(project, "--model", "tiny", "--benchmark-compare=0001")
    assert done.returncode == 2, done.stdout[-2000:]
    assert seconds < 10
    line = exit_line(done)
    assert "a run of another grid" in line and "model mini" in line and "0001_mini" in line
