"""``python -m ddp gpu-check --out DIR``: everything one GPU can check, in one command.

Runs, each as its own pytest or ddp process so that one failure does not hide the others:

1. the correctness suite with 2 gloo ranks over CUDA tensors on the one GPU;
2. the correctness suite with one NCCL rank;
3. every strategy's training step on the xl model at world size 1 with NCCL, at 256 and 2,048
   tokens a step (batch 4, sequence 64 and 512), with peak memory: with no network, what remains is each strategy's own
   machinery (hooks, copies, launches), the number that explains why a Python bucketed DDP can lose
   to PyTorch's C++ reducer;
4. the out-of-memory skip on real CUDA memory: a configuration that cannot fit, then one that
   does, which must still run;
5. ``ddp profile`` on CUDA at world size 1 (NCCL) and with 2 gloo ranks over CUDA.

It needs only torch, pytest, pytest-benchmark, tabulate and matplotlib, writes pytest-benchmark JSON,
profiles and logs into ``--out``, and ``summary.md`` with each part's outcome: what passed, what
skipped and why (pytest's own counts and skip reasons), what failed or ran out of time.

Sized to finish within 10 minutes on one H100: each part has a time limit (``Part.limit_seconds``,
from the first H100 run at commit 3975dc7, torch 2.11: the two correctness runs took 217 s and
173 s, an xl step benchmark about 6 s, the out-of-memory part 13 s) and the limits add up to at
most ``TOTAL_LIMIT_SECONDS``; a part past its limit is ended and reported as timed out, and the
next one runs. ``--dry-run`` prints the commands and their limits instead (what CI checks).

The profiles run from the installed package anywhere. The other parts run the test suites,
which live in a ddp-bench checkout, not in the package: ``--suite PATH`` (default: the current
folder, when it holds ``correctness_tests/``, ``tests/`` and ``perf_tests/``); without one they are skipped,
saying so in the summary.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp.analysis.tables import table
from ddp.cli import UsageError
from ddp.strategies.registry import FLOOR

SKIPPED = "skipped"

# Every strategy on xl at the two sizes of the plain-loop figures (256 and 2,048 tokens a step),
# 12 benchmarks of about 6 s each.
XL_STEPS = ("--model", "xl", "--batch-sizes", "4", "--seq-lens", "64,512", "--bucket-sizes", "25",
            "--rounds", "3", "--max-rounds", "5", "--warmup-rounds", "1", "--round-budget", "5")
# 2.7b at 16 x 1024 tokens needs far more than any one GPU has for activations; the next
# configuration (tiny) must still run on the same session.
OUT_OF_MEMORY = ("--model", "2.7b", "--strategies", FLOOR, "--batch-sizes", "16", "--seq-lens", "1024",
                 "--rounds", "1", "--max-rounds", "1", "--warmup-rounds", "0")


SUITES = ("correctness_tests", "tests", "perf_tests")  # the folders of a checkout that the suite parts run


TOTAL_LIMIT_SECONDS = 600


@dataclass(frozen=True)
class Part:
    name: str
    command: list[str]
    limit_seconds: int
    """Ended past this, and reported as timed out."""


def parts(out: Path) -> list[Part]:
    """The parts, in order; a pytest command runs in the suite's folder."""
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    profile = [python, "-m", "ddp", "profile", "--strategies", "naive,overlap,bucketed,torch"]
    return [
        Part("correctness, 2 gloo ranks over CUDA",
             [*pytest, "correctness_tests", "tests", "--backend", "gloo", "--device", "cuda", "--world-size", "2"], 240),
        Part("correctness, 1 NCCL rank", [*pytest, "correctness_tests", "tests", "--backend", "nccl", "--world-size", "1"], 190),
        Part("xl steps, 1 NCCL rank", [*pytest, "perf_tests/test_step.py", "--backend", "nccl", "--world-size", "1", *XL_STEPS,
                                       "--benchmark-json", str(out / "xl_steps.json")], 85),
        Part("out of memory on real CUDA memory", [*pytest, "perf_tests/test_step.py", "perf_tests/test_harness.py",
                                                   "--backend", "nccl", "--world-size", "1", *OUT_OF_MEMORY], 25),
        Part("profile, 1 NCCL rank", [*profile, "--model", "medium", "--batch-size", "2", "--seq-len", "256",
                                      "--backend", "nccl", "--world-size", "1", "--out", str(out / "profile_nccl")], 25),
        Part("profile, 2 gloo ranks over CUDA", [*profile, "--model", "small", "--batch-size", "2", "--seq-len", "128",
                                                 "--backend", "gloo", "--device", "cuda", "--world-size", "2",
                                                 "--out", str(out / "profile_gloo_cuda")], 25),
    ]


def outcome_of(log: str) -> tuple[str, list[str]]:
    """pytest's counts line (or the last line of another command) and its skip reasons, each once
    with how often: ``SKIPPED [3] file:line: reason`` becomes ``3 x reason``."""
    lines = [line for line in log.splitlines() if line.strip()]
    counts = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), None)
    skips = [re.sub(r"^SKIPPED \[(\d+)\] \S+: ", r"\1 x ", line) for line in lines if line.startswith("SKIPPED [")]
    return counts or (lines[-1] if lines else ""), skips


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for JSON, profiles, logs and summary.md (new or empty)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--suite", type=Path, default=Path("."),
                        help="a ddp-bench checkout holding correctness_tests/, tests/ and perf_tests/ (default: the current folder); "
                        "without one the parts that run them are skipped")


def needs_suite(command: list[str]) -> bool:
    return "pytest" in command


def has_suite(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in SUITES)


def main(args: argparse.Namespace) -> int:
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UsageError(f"--out {args.out} exists and is not an empty folder: give a new one (nothing saved is overwritten)")
    plan = parts(args.out.resolve())
    suite = args.suite.resolve() if has_suite(args.suite) else None
    if args.dry_run:
        for part in plan:
            print(f"# {part.name} (at most {part.limit_seconds} s)\n{shlex.join(part.command)}")
        print(f"# at most {sum(part.limit_seconds for part in plan)} s in all")
        return 0
    if not torch.cuda.is_available():
        raise UsageError("gpu-check needs a GPU, none found: run it on a machine with one (or use --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    for index, part in enumerate(plan, start=1):
        if needs_suite(part.command) and suite is None:
            rows.append([part.name, SKIPPED, "", f"no test suite in {args.suite.resolve()}: give --suite PATH to a ddp-bench checkout", ""])
            print(f"{part.name}: {rows[-1][1]}: {rows[-1][3]}", flush=True)
            continue
        began = time.monotonic()
        log = args.out / f"part{index}.log"
        with log.open("w") as file:
            try:
                returncode = subprocess.run(part.command, cwd=suite or args.out, stdout=file, stderr=subprocess.STDOUT,
                                            timeout=part.limit_seconds).returncode
                status = "ok" if returncode == 0 else f"FAILED (exit {returncode})"
            except subprocess.TimeoutExpired:  # subprocess.run has ended it
                status = f"TIMED OUT after {part.limit_seconds} s"
        seconds = time.monotonic() - began
        counts, skips = outcome_of(log.read_text())
        rows.append([part.name, status, f"{seconds:.0f}", counts, log.name])
        skipped += [f"- {part.name}: {skip}" for skip in skips]
        print(f"{part.name}: {status} in {seconds:.0f} s: {counts}", flush=True)
    summary = table(rows, ["part", "outcome", "seconds", "passed, skipped, failed", "log"], "github")
    (args.out / "summary.md").write_text(
        f"# ddp-bench gpu-check\n\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}\n\n"
        f"{summary}\n\n## Skipped, and why\n\n" + "\n".join(skipped or ["nothing skipped"]) + "\n"
    )
    print(f"wrote {args.out / 'summary.md'}")
    return 0 if all(row[1] in ("ok", SKIPPED) for row in rows) and any(row[1] == "ok" for row in rows) else 1
