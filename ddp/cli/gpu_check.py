"""``python -m ddp gpu-check --out DIR``: every claim of the suite that only a GPU can check, in one
command that finishes within 8 minutes on one H100; ``--rehearse`` runs the same stages on the CPU
at ``tiny`` sizes (CI does), ``--dry-run`` prints the stages and their limits.

The stages (``ddp.acceptance.gpu_stages`` says what each holds the suite to) run one after the other,
each in a process of its own started in a session of its own (``run_stage``), with a time limit;
past it the whole process group is killed (the stage's pytest runs in that process, and its ranks
go with it), and the next stage runs. Each stage writes its log, its pytest-benchmark JSON where it runs the
benchmarks, and its outcome; ``DIR/summary.md`` is the table of stage, limit, seconds, outcome and
figure, with the GPU, torch and CUDA named.

The limits are for one H100 80GB HBM3 or H200 with torch 2.11 (``STAGES`` gives each one's
reasoning): what each stage took on an H200 from a freshly started machine (2026-11-27,
``docs/gpu-runs/2026-11-27-h200-c/``), with 30% more for an H100's slower host where the budget
allows. They add up to at most ``TOTAL_LIMIT_SECONDS``.

The stages that run the test suites need a ddp-bench checkout (``--suite``, default the current
folder); without one they are skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp.acceptance import gpu_stages
from ddp.acceptance.gpu_stages import CheckFailed, Target
from ddp.analysis.tables import table
from ddp.cli import UsageError

TOTAL_LIMIT_SECONDS = 480
SUITES = ("correctness_tests", "tests", "perf_tests")  # the folders of a checkout that the stages run
RESULT = "result.json"  # what a stage's process writes in its folder: its outcome and figure


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Target, Path, Path], str]
    limit_seconds: int
    """On one H100: killed whole past it."""
    estimate: str
    """Where the limit comes from."""
    needs_suite: bool = True


# Each limit: what the stage took on an H200 on 2026-11-27 from a freshly started machine
# (docs/gpu-runs/2026-11-27-h200-c/), times 1.3 for an H100 host 30% slower where the budget
# allows: compile's does not (62 s at 1.3x), oom's and correctness-gloo-cuda's by a second. No
# H100 has run this set.
STAGES = (
    Stage("harness", gpu_stages.harness, 40,
          "25 s on an H200 as a fresh machine's first stage (2026-11-27; 33 s once, the first imports of torch and "
          "CUDA's first kernels): start-up 10 s, a plain xl loop and the harness's built and warmed, 10 rounds of both "
          "at b4 x 128 (0.25 s a step)"),
    Stage("precision", gpu_stages.precision, 50,
          "36 s on an H200 (2026-11-27): start-up 4 s, xl's trace pairs for tf32 (fp32's) and bf16 10 s, local built "
          "twice (the second from a kept copy), 2 + 6 steps of 0.38 and 0.21 s"),
    Stage("fit", gpu_stages.fit, 65,
          "45 s on an H200 (2026-11-27), when it predicted fp32's batch 13 and ran 13 and 14 in bf16; in bf16 it runs "
          "22 and 23 there, 10 and 11 on an H100, not yet on a GPU: start-up 5 s, one trace pair of xl 5 s, the "
          "largest batch built, 4 steps of about 1.1 s"),
    Stage("oom", gpu_stages.oom, 40,
          "31 s on an H200 (2026-11-27): start-up 5 s, xl predicted at seq 128 (5 s), the hog fills the GPU in 1 GiB "
          "blocks and is freed, xl b2 x 128 built and 5 steps"),
    Stage("traced", gpu_stages.traced, 75,
          "57 s on an H200 (2026-11-27): small on 2 gloo ranks over CUDA, local, bucketed and torch traced, 6 rounds "
          "a check, 3 traced steps; xl at world size 1 with NCCL"),
    Stage("compile", gpu_stages.compile_, 55,
          "48 s on an H200 (2026-11-27): start-up 4 s, xl predicted (5 s), one xl block compiled forward and "
          "backward (warm-up 11 s), the torch strategy's from the cache, 2 x 5 steps"),
    Stage("correctness-gloo-cuda", gpu_stages.correctness(Target.two_ranks_on_one_gpu, "correctness-gloo-cuda",
                                                          gpu_stages.REUSE), 50,
          "39 s on an H200 (2026-11-27) with 46 tests: start-up 10 s, 42 tests (bucketed, torch and fsdp on the LM "
          "with AdamW, every precision and step shape) x 0.59 s and 4 reuse checks of 2 s"),
    Stage("correctness-nccl", gpu_stages.correctness(Target.one_rank, "correctness-nccl"), 45,
          "past 30 s on an H200 (2026-11-27: 40 of 42 tests done then), 22 s of pytest alone: start-up 10 s, the "
          "same 42 tests x 0.5 s"),
    Stage("layout", gpu_stages.layout, 55,
          "not yet run on a GPU as it stands; with small at b2 x 256 and five configurations 75 s of pytest on an H200 "
          "(2026-11-27: start-up 4 s, builds 19, first steps 17, rounds 9, traced steps 9, other 12); now mini at b2 x "
          "128 and three (estimated 35-40 s there): 3 groups of 2 gloo ranks over CUDA, 6 rounds and 2 traced steps "
          "each, built from kept copies"),
)


def run_stage(command: list[str], limit_seconds: float, log: Path, cwd: Path) -> tuple[int | None, float]:
    """Run ``command`` in a session of its own, its output into ``log``; past ``limit_seconds``, or
    once it returns, kill its whole process group (what it started: pytest and the rank processes,
    which stay in it; torchrun would start its workers in sessions of their own, and no stage runs
    it). Returns (its exit status, None if it was killed; seconds)."""
    began = time.monotonic()
    with log.open("w") as file:
        process = subprocess.Popen(command, cwd=cwd, stdout=file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=limit_seconds)
        except subprocess.TimeoutExpired:
            code = None
        # Whatever it left behind is ended too: a stage that returned may have left a child running.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        # The next stage starts once none is left (a killed rank's GPU memory goes back when it is gone).
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _group_alive(process.pid):
            time.sleep(0.05)
    return code, time.monotonic() - began


def _group_alive(group: int) -> bool:
    """Whether any process of process group ``group`` is left, a zombie not counted."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # after the command's ")": state, ppid, pgrp
            return True
    return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for the stages' logs, JSON and summary.md (new or empty)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages, their limits and estimates; run nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every stage on the CPU at tiny sizes (gloo), to find a broken stage before a GPU is at hand")
    parser.add_argument("--suite", type=Path, default=Path("."),
                        help="a ddp-bench checkout holding correctness_tests/, tests/ and perf_tests/ (default: the current folder)")
    parser.add_argument("--stages", type=stage_names, default=STAGES,
                        help="the stages to run, comma-separated, in the order given (default: all, in the order "
                        "--dry-run lists): to run again the ones that failed, or the ones that matter most first "
                        "on a machine lent for minutes")
    parser.add_argument("--stage", choices=[stage.name for stage in STAGES], help=argparse.SUPPRESS)  # one stage, in this process


def stage_names(text: str) -> tuple[Stage, ...]:
    by_name = {stage.name: stage for stage in STAGES}
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in by_name]
    if unknown or not names or len(set(names)) != len(names):
        problem = f"unknown {', '.join(unknown)}" if unknown else "each stage at most once" if names else "none given"
        raise argparse.ArgumentTypeError(f"{problem}: choose from {', '.join(by_name)}")
    return tuple(by_name[name] for name in names)


def has_suite(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in SUITES)


def stage_main(args: argparse.Namespace) -> int:
    """Run one stage in this process (the child ``main`` starts) and write its outcome."""
    stage = next(s for s in STAGES if s.name == args.stage)
    folder = args.out
    try:
        figure = stage.run(Target(args.rehearse), folder, args.suite.resolve())
        outcome = "ok"
    except CheckFailed as failed:
        outcome, figure = "FAILED", str(failed)
    except Exception as error:  # a stage that crashed: its traceback is in the log
        traceback.print_exc()
        outcome, figure = "FAILED", f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    print(f"{stage.name}: {outcome}: {figure}", flush=True)
    (folder / RESULT).write_text(json.dumps({"outcome": outcome, "figure": figure}))
    return 0 if outcome == "ok" else 1


# A rehearsal runs on two CPU cores at tiny sizes: the GPU's limits do not apply; this one only
# ends a stage that hangs.
REHEARSAL_LIMIT_SECONDS = 300


def plan_text(stages: tuple[Stage, ...] = STAGES) -> str:
    lines = [f"# {stage.name}: at most {stage.limit_seconds} s on one H100 ({stage.estimate})" for stage in stages]
    lines.append(f"# at most {sum(stage.limit_seconds for stage in stages)} s in all "
                 f"(the budget: {TOTAL_LIMIT_SECONDS} s); left out of the correctness stages: {gpu_stages.LEFT_OUT}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.stage:
        return stage_main(args)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UsageError(f"--out {args.out} exists and is not an empty folder: give a new one (nothing saved is overwritten)")
    if args.dry_run:
        print(plan_text(args.stages))
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        raise UsageError("gpu-check needs a GPU, none found: run it on a machine with one, or --rehearse its stages on the CPU")
    suite = args.suite.resolve() if has_suite(args.suite) else None
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    rows = []
    for stage in args.stages:
        folder = out / f"{STAGES.index(stage) + 1:02d}-{stage.name}"
        folder.mkdir()
        limit = REHEARSAL_LIMIT_SECONDS if args.rehearse else stage.limit_seconds
        if stage.needs_suite and suite is None:
            rows.append([stage.name, limit, "", "skipped", f"no test suite in {args.suite.resolve()}: give --suite PATH to a checkout"])
            print(f"{stage.name}: {rows[-1][3]}: {rows[-1][4]}", flush=True)
            continue
        command = [sys.executable, "-m", "ddp", "gpu-check", "--stage", stage.name, "--out", str(folder),
                   "--suite", str(suite or args.suite.resolve()), *(["--rehearse"] if args.rehearse else [])]
        code, seconds = run_stage(command, limit, folder / "stage.log", cwd=suite or out)
        result = folder / RESULT
        if code is None:
            outcome, figure = f"TIMED OUT after {limit} s", "killed with every process it started; see its stage.log"
        elif result.exists():
            outcome, figure = json.loads(result.read_text()).values()
        else:
            outcome, figure = f"FAILED (exit {code})", "no result written; see its stage.log"
        rows.append([stage.name, limit, f"{seconds:.0f}", outcome, figure])
        print(f"{stage.name}: {outcome} in {seconds:.0f} s: {figure}", flush=True)
    write_summary(out / "summary.md", rows, args.rehearse)
    print(f"wrote {out / 'summary.md'}")
    ran = [row for row in rows if row[3] != "skipped"]
    return 0 if ran and all(row[3] == "ok" for row in ran) else 1


def write_summary(path: Path, rows: list[list], rehearse: bool) -> None:
    if rehearse:
        where = f"CPU rehearsal at tiny sizes (gloo), torch {torch.__version__}: timing figures reported, not asserted"
    else:
        where = f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    summary = table(rows, ["stage", "limit s", "seconds", "outcome", "figure"], "github")
    path.write_text(
        f"# ddp-bench gpu-check\n\n{where}\n\n{summary}\n\n"
        f"Left out of the correctness stages: {gpu_stages.LEFT_OUT}.\n\n"
        "## The limits\n\n" + "\n".join(f"- {stage.name}: {stage.limit_seconds} s: {stage.estimate}" for stage in STAGES) + "\n"
    )
