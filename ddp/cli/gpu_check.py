"""``python -m ddp gpu-check --out DIR``: everything one GPU can check, in one command.

Runs, each as its own pytest or ddp process so that one failure does not hide the others:

1. the correctness suite with 2 gloo ranks over CUDA tensors on the one GPU;
2. the correctness suite with one NCCL rank;
3. every strategy's training step on the xl model at world size 1 with NCCL, batch 2 and 4,
   sequence 128 to 512, with peak memory: with no network, what remains is each strategy's own
   machinery (hooks, copies, launches), the number that explains why a Python bucketed DDP can lose
   to PyTorch's C++ reducer;
3b. xl in fp32, tf32 and bf16 side by side (local, bucketed, torch; batch 4 x seq 512, where
   bf16 and tf32 run about 3x faster than fp32 in a plain loop), with achieved TFLOP/s and MFU;
4. the out-of-memory skip on real CUDA memory: a configuration that cannot fit, then one that
   does, which must still run;
5. ``ddp profile`` on CUDA at world size 1 (NCCL) and with 2 gloo ranks over CUDA.

It needs only torch, pytest, pytest-benchmark, tabulate and matplotlib, writes pytest-benchmark JSON,
profiles and logs into ``--out``, and ``summary.md`` with each part's outcome. Sized to finish in
about 10 minutes on one H100. ``--dry-run`` prints the commands instead (what CI checks).

The profiles run from the installed package anywhere. The other parts run the test suites,
which live in a ddp-bench checkout, not in the package: ``--suite PATH`` (default: the current
folder, when it holds ``correctness_tests/`` and ``perf_tests/``); without one they are skipped,
saying so in the summary.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddp.analysis.tables import table
from ddp.cli import UsageError

SKIPPED = "skipped"

XL_STEPS = ("--model", "xl", "--batch-sizes", "2,4", "--seq-lens", "128,256,512", "--bucket-sizes", "25",
            "--rounds", "3", "--max-rounds", "5", "--warmup-rounds", "1", "--round-budget", "5")
# The step users train with: 2048 tokens a step, where compute shrinks about 3x with tf32 or bf16.
XL_PRECISIONS = ("--model", "xl", "--strategies", "local,bucketed,torch", "--batch-sizes", "4", "--seq-lens", "512",
                 "--bucket-sizes", "25", "--precision", "fp32,tf32,bf16", "--rounds", "3", "--max-rounds", "5",
                 "--warmup-rounds", "1", "--round-budget", "5")
# 2.7b at 16 x 1024 tokens needs far more than any one GPU has for activations; the next
# configuration (tiny) must still run on the same session.
OUT_OF_MEMORY = ("--model", "2.7b", "--strategies", "local", "--batch-sizes", "16", "--seq-lens", "1024",
                 "--rounds", "1", "--max-rounds", "1", "--warmup-rounds", "0")


SUITES = ("correctness_tests", "perf_tests")  # the folders of a checkout that the suite parts run


def parts(out: Path) -> list[tuple[str, list[str]]]:
    """(name, command) of each part; a pytest command runs in the suite's folder."""
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return [
        ("correctness, 2 gloo ranks over CUDA", [*pytest, "correctness_tests", "--backend", "gloo", "--device", "cuda", "--world-size", "2"]),
        ("correctness, 1 NCCL rank", [*pytest, "correctness_tests", "--backend", "nccl", "--world-size", "1"]),
        ("xl steps, 1 NCCL rank", [*pytest, "perf_tests/test_step.py", "--backend", "nccl", "--world-size", "1", *XL_STEPS,
                                   "--benchmark-json", str(out / "xl_steps.json")]),
        ("xl in fp32, tf32 and bf16, 1 NCCL rank", [*pytest, "perf_tests/test_step.py", "--backend", "nccl", "--world-size", "1",
                                                    *XL_PRECISIONS, "--benchmark-json", str(out / "xl_precisions.json")]),
        ("out of memory on real CUDA memory", [*pytest, "perf_tests/test_step.py", "perf_tests/test_harness.py", "-rs",
                                               "--backend", "nccl", "--world-size", "1", *OUT_OF_MEMORY]),
        ("profile, 1 NCCL rank", [python, "-m", "ddp", "profile", "--strategies", "naive,overlap,bucketed,torch", "--model", "medium",
                                  "--batch-size", "2", "--seq-len", "256", "--backend", "nccl", "--world-size", "1",
                                  "--out", str(out / "profile_nccl")]),
        ("profile, 2 gloo ranks over CUDA", [python, "-m", "ddp", "profile", "--strategies", "naive,overlap,bucketed,torch",
                                             "--model", "small", "--batch-size", "2", "--seq-len", "128", "--backend", "gloo",
                                             "--device", "cuda", "--world-size", "2", "--out", str(out / "profile_gloo_cuda")]),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for JSON, profiles, logs and summary.md (new or empty)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--suite", type=Path, default=Path("."),
                        help="a ddp-bench checkout holding correctness_tests/ and perf_tests/ (default: the current folder); "
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
        for name, command in plan:
            print(f"# {name}\n{shlex.join(command)}")
        return 0
    if not torch.cuda.is_available():
        raise UsageError("gpu-check needs a GPU, none found: run it on a machine with one (or use --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (name, command) in enumerate(plan, start=1):
        if needs_suite(command) and suite is None:
            rows.append([name, SKIPPED, "", f"no test suite in {args.suite.resolve()}: give --suite PATH to a ddp-bench checkout", ""])
            print(f"{name}: {rows[-1][1]}: {rows[-1][3]}", flush=True)
            continue
        began = time.monotonic()
        log = args.out / f"part{index}.log"
        with log.open("w") as file:
            done = subprocess.run(command, cwd=suite or args.out, stdout=file, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - began
        last = [line for line in log.read_text().splitlines() if line.strip()][-1:] or [""]
        rows.append([name, "ok" if done.returncode == 0 else f"FAILED ({done.returncode})", f"{seconds:.0f}", last[0], log.name])
        print(f"{name}: {rows[-1][1]} in {seconds:.0f} s: {last[0]}", flush=True)
    summary = table(rows, ["part", "outcome", "seconds", "last line", "log"], "github")
    (args.out / "summary.md").write_text(
        f"# ddp-bench gpu-check\n\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n\n{summary}\n"
    )
    print(f"wrote {args.out / 'summary.md'}")
    return 0 if all(row[1] in ("ok", SKIPPED) for row in rows) and any(row[1] == "ok" for row in rows) else 1
