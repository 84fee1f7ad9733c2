"""The one options layer: parsing, validation before any rank starts, backend choice, and the
one-line errors of every command."""

from __future__ import annotations

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


def test_gpu_check_plans_valid_commands(tmp_path, capsys):
    assert ddp_main(["gpu-check", "--out", str(tmp_path / "check"), "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 7
    assert any("--precision fp32,tf32,bf16" in c and "xl" in c for c in commands)
    assert any("--backend gloo --device cuda --world-size 2" in c for c in commands)
    assert any("--backend nccl --world-size 1" in c and "xl" in c for c in commands)


def test_numerics_are_axes_of_the_grid_and_bf16_communication_applies_where_it_can():
    from ddp.bench.config import grid_configs

    grid = GridOptions(**{**grid_defaults("gloo", "cpu").__dict__, "model": "tiny", "batch_sizes": (2,), "seq_lens": (32,),
                          "strategies": ("local", "naive", "bucketed", "torch"), "bucket_sizes_mb": (1.0,),
                          "precisions": ("fp32", "bf16"), "grad_comms": ("fp32", "bf16")})
    ids = [config.test_id for config in grid_configs(grid)]
    # per precision: local, naive (fp32 communication only), bucketed and torch in both
    assert ids == [
        "local-b2-s32", "naive-b2-s32", "bucketed-b2-s32-bucket1mb", "bucketed-b2-s32-bucket1mb-bf16comm",
        "torch-b2-s32-bucket1mb", "torch-b2-s32-bucket1mb-bf16comm",
        "local-b2-s32-bf16", "naive-b2-s32-bf16", "bucketed-b2-s32-bucket1mb-bf16", "bucketed-b2-s32-bucket1mb-bf16-bf16comm",
        "torch-b2-s32-bucket1mb-bf16", "torch-b2-s32-bucket1mb-bf16-bf16comm",
    ]
    assert grid.num_step_benchmarks == len(ids)


def test_the_default_grid_stays_fp32_with_foreach_adamw():
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda")):
        grid = grid_defaults(backend, device)
        assert (grid.precisions, grid.optimizers, grid.grad_comms) == (("fp32",), ("foreach",), ("fp32",))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["versus", "--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
        (["profile", "--strategy", "naive", "--optimizer", "adam", "--out", "x"], "argument --optimizer: invalid choice: 'adam'"),
        (["run", "--precision", "fp32,fp8"], "--precision takes one or more of fp32, tf32, bf16, each once, comma-separated"),
        (["profile", "--strategy", "torch", "--grad-comm", "bf16", "--backend", "gloo", "--out", "x"],
         "profiling torch with --grad-comm bf16 needs nccl"),
    ],
)
def test_numerics_options_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        ddp_main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_pytest_refuses_an_unknown_precision_before_any_rank_starts():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "perf_tests/test_step.py", "--precision", "fp16", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 4  # pytest's usage error
    assert "--precision takes one or more of fp32, tf32, bf16" in result.stderr
