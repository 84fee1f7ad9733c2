"""The one options layer: parsing, validation before any rank starts, backend choice, and the
one-line errors of every command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp.bench.options import GridOptions, LaunchOptions, OptionError, gpu_world_sizes, grid_defaults, parse_list
from ddp.cli import main as ddp_main

ROOT = Path(__file__).parents[1]


def test_lists_parse_once_and_refuse_what_is_not_a_list():
    assert parse_list("1, 10,100", float, "sizes") == (1.0, 10.0, 100.0)
    with pytest.raises(OptionError, match="expected a comma-separated list of sizes, got '1,x'"):
        parse_list("1,x", float, "sizes")
    with pytest.raises(OptionError, match="got ','"):
        parse_list(",", int, "sizes")


def test_nccl_on_cpu_tensors_is_refused_saying_what_to_do():
    with pytest.raises(OptionError, match="nccl runs on GPUs only: drop --device cpu, or use --backend gloo"):
        LaunchOptions(backend="nccl", device="cpu").resolve()


def test_auto_says_why_it_chose_its_backend():
    resolved = LaunchOptions(backend="auto", world_size=2).resolve()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = ("nccl", "cuda") if gpus >= 2 and torch.distributed.is_nccl_available() else ("gloo", "cpu")
    assert (resolved.backend, resolved.device) == expected
    assert resolved.why.startswith("auto: ") and f"{gpus} GPU" in resolved.why or resolved.why == "auto: no GPU"


def test_gpu_all_reduce_world_sizes_follow_the_gpu_count():
    assert gpu_world_sizes(8) == (2, 4, 8)
    assert gpu_world_sizes(6) == (2, 4, 6)
    assert gpu_world_sizes(2) == (2,)
    assert gpu_world_sizes(1) == (1,)


def test_a_small_grid_gets_a_larger_share_of_the_session_budget():
    default = grid_defaults("gloo", "cpu")
    assert default.num_step_benchmarks == 2 * 2 * (4 + 2 * 3)
    assert default.round_budget_seconds() == pytest.approx(270.0 / 40)
    small = GridOptions(**{**default.__dict__, "strategies": ("local", "bucketed"), "bucket_sizes_mb": (25.0,),
                           "batch_sizes": (4,), "seq_lens": (64,)})
    assert small.round_budget_seconds() == pytest.approx(120.0)  # 135 s each, capped
    fixed = GridOptions(**{**default.__dict__, "budget_seconds": 7.0})
    assert fixed.round_budget_seconds() == 7.0


def test_seq_len_beyond_the_context_length_is_refused():
    with pytest.raises(OptionError, match="--seq-lens 256 exceeds model tiny's context length 128"):
        GridOptions(**{**grid_defaults("gloo", "cpu").__dict__, "model": "tiny", "seq_lens": (64, 256)})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["versus", "--bucket-size-mb", "-3"], "argument --bucket-size-mb: expected a positive number"),
        (["profile", "--strategy", "bogus", "--out", "x"], "unknown strategy 'bogus'"),
        (["simulate", "--from", "missing.json"], "missing.json: no such file"),
        (["buckets", "--model", "nope.mod:build"], "cannot load model 'nope.mod:build'"),
        (["run", "--model", "tiny"], "ddp run must be started by torchrun"),
        (["compare", "a.json", "b.json", "--fail-slower", "ten"], "--fail-slower takes a percentage"),
        (["gpu-check"], "the following arguments are required: --out"),
    ],
)
def test_every_command_error_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        ddp_main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddp-bench {argv[0]}: error: ") and message in lines[0]


def test_pytest_refuses_bad_options_before_any_rank_starts():
    done = subprocess.run([sys.executable, "-m", "pytest", "perf_tests", "--batch-sizes", "0", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 4 and "expected batch sizes (1 or more), got '0'" in done.stderr


def test_the_pytest_header_says_which_backend_and_why():
    done = subprocess.run([sys.executable, "-m", "pytest", "correctness_tests/test_options.py", "--collect-only",
                           "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert f"ddp-bench: {LaunchOptions().resolve().describe()}" in done.stdout


def test_gpu_check_plans_valid_commands_within_ten_minutes(tmp_path, capsys):
    assert ddp_main(["gpu-check", "--out", str(tmp_path / "check"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    limits = [int(re.search(r"at most (\d+) s\)$", line).group(1)) for line in lines if line.startswith("# ") and "(at most" in line]
    assert len(commands) == len(limits) == 6
    assert sum(limits) <= 600 and lines[-1] == f"# at most {sum(limits)} s in all"
    options = [dict(zip(c, c[1:])) for c in commands]
    assert options[0]["--backend"] == "gloo" and options[0]["--device"] == "cuda" and options[0]["--world-size"] == "2"
    assert options[1]["--backend"] == "nccl" and options[1]["--world-size"] == "1"
    assert options[2]["--model"] == "xl" and options[2]["--backend"] == "nccl"
    for command in commands:
        assert command[0] == sys.executable  # the running interpreter, never one found on PATH
        if "pytest" in command:
            assert "-rs" in command  # skip reasons reach the summary


def test_gpu_check_summary_reads_counts_and_skip_reasons():
    from ddp.cli.gpu_check import outcome_of

    log = "....s\nSKIPPED [4] correctness_tests/test_launcher.py:42: needs 2 ranks: no rank 1\n======= 362 passed, 7 skipped in 173.16s =======\n"
    assert outcome_of(log) == ("362 passed, 7 skipped in 173.16s", ["4 x needs 2 ranks: no rank 1"])
    assert outcome_of("wrote profile\n") == ("wrote profile", [])
