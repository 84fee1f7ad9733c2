"""The one options layer: parsing, validation before any rank starts, backend choice, and the
one-line errors of every command."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp.bench.options import (
    ALL_OPTIONS,
    CONFIG_OPTIONS,
    GRID_OPTIONS,
    LAUNCH_OPTIONS,
    NUMERICS_OPTIONS,
    ROUND_OPTIONS,
    GridOptions,
    LaunchOptions,
    OptionError,
    RoundOptions,
    add_grid_options,
    add_launch_options,
    gpu_world_sizes,
    grid_defaults,
    grid_options,
    launch_options,
    option,
    parse_list,
    round_options,
)
from ddp.cli import COMMANDS, command_parser, gpu_check
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
    if gpus == 0:
        assert resolved.why == "auto: no GPU"
    elif resolved.backend == "nccl":
        assert resolved.why == f"auto: {gpus} GPU(s) for 2 rank(s)"
    else:
        assert resolved.why == f"auto: {gpus} GPU(s), fewer than the 2 ranks nccl needs"


def test_gpu_all_reduce_world_sizes_follow_the_gpu_count():
    assert gpu_world_sizes(8) == (2, 4, 8)
    assert gpu_world_sizes(6) == (2, 4, 6)
    assert gpu_world_sizes(2) == (2,)
    assert gpu_world_sizes(1) == (1,)


def test_a_small_grid_gets_a_larger_share_of_the_session_budget():
    default = grid_defaults("gloo", "cpu")
    assert default.num_step_benchmarks == 2 * 2 * (4 + 2 * 3)
    assert default.round_budget_seconds() == pytest.approx(200.0 / 40)
    small = GridOptions(**{**default.__dict__, "strategies": ("local", "bucketed"), "bucket_sizes_mb": (25.0,),
                           "batch_sizes": (4,), "seq_lens": (64,)})
    assert small.round_budget_seconds() == pytest.approx(100.0)  # 200 s shared by 2
    alone = GridOptions(**{**small.__dict__, "strategies": ("local",)})
    assert alone.round_budget_seconds() == pytest.approx(120.0)  # 200 s for 1, capped
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
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/test_options.py", "--collect-only",
                           "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert f"ddp-bench: {LaunchOptions().resolve().describe()}" in done.stdout


def suite_parser() -> argparse.ArgumentParser:
    """What the suites' pytest command lines may hold: the options the root conftest binds, and
    the few of pytest's and pytest-benchmark's the plan uses."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("paths", nargs="+")
    for flag in ("-q", "-rs"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("-p", action="append")
    parser.add_argument("--benchmark-json")
    add_launch_options(parser.add_argument)
    add_grid_options(parser.add_argument)
    return parser


def test_gpu_check_plans_valid_commands(tmp_path, capsys):
    assert ddp_main(["gpu-check", "--out", str(tmp_path / "check"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = [re.fullmatch(r"# (.*) \(at most (\d+) s\)", line) for line in lines if line.startswith("#")][:-1]
    names, limits = [m.group(1) for m in planned], [int(m.group(2)) for m in planned]
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    assert names == [part.name for part in gpu_check.parts(tmp_path)] and len(commands) == 6
    # within 10 minutes in all: each part is ended at its limit
    assert sum(limits) <= gpu_check.TOTAL_LIMIT_SECONDS == 600 and lines[-1] == f"# at most {sum(limits)} s in all"
    parsed = {}
    for name, command in zip(names, commands):
        assert command[:2] == [sys.executable, "-m"], name
        if command[2] == "pytest":
            assert "-rs" in command, name  # skip reasons reach the summary
            args = suite_parser().parse_args(command[3:])
            assert all((ROOT / path).exists() for path in args.paths), f"{name}: {args.paths}"
            grid_options(vars(args).get, args.backend, args.device or "cuda")  # the grid is one the suite accepts
        else:
            assert command[2] == "ddp"
            args = command_parser(command[3]).parse_args(command[4:])
        launch = launch_options(vars(args).get)
        parsed[name] = (launch.backend, launch.device, launch.world_size, getattr(args, "model", None))
    assert parsed == {
        "correctness, 2 gloo ranks over CUDA": ("gloo", "cuda", 2, None),
        "correctness, 1 NCCL rank": ("nccl", None, 1, None),
        "xl steps, 1 NCCL rank": ("nccl", None, 1, "xl"),
        "out of memory on real CUDA memory": ("nccl", None, 1, "2.7b"),
        "profile, 1 NCCL rank": ("nccl", None, 1, "medium"),
        "profile, 2 gloo ranks over CUDA": ("gloo", "cuda", 2, "small"),
    }


def test_gpu_check_summary_reads_counts_and_skip_reasons():
    log = ("....s\nSKIPPED [4] correctness_tests/test_launcher.py:42: needs 2 ranks: no rank 1\n"
           "======= 362 passed, 7 skipped in 173.16s =======\n")
    assert gpu_check.outcome_of(log) == ("362 passed, 7 skipped in 173.16s", ["4 x needs 2 ranks: no rank 1"])
    assert gpu_check.outcome_of("wrote profile\n") == ("wrote profile", [])


def test_every_command_binds_the_shared_options_from_their_one_definition():
    """Each option a command shares with pytest or another command comes from its definition in
    ``ddp.bench.options``: the same flag, destination, parser and help text (only the default is the
    command's); the commands that time rounds take every round option, those that train one
    configuration every configuration option they need."""
    expected = {
        "versus": {*LAUNCH_OPTIONS, *ROUND_OPTIONS, *CONFIG_OPTIONS, *NUMERICS_OPTIONS},
        "buckets": {*LAUNCH_OPTIONS, *ROUND_OPTIONS, *(o for o in CONFIG_OPTIONS if o.flag != "--bucket-size-mb"),
                    option("--bucket-sizes"), *NUMERICS_OPTIONS},
        "profile": {*LAUNCH_OPTIONS, *CONFIG_OPTIONS, *NUMERICS_OPTIONS},
        "simulate": {option(f) for f in ("--model-size", "--batch-size", "--seq-len", "--strategies", "--bucket-sizes")},
        "run": {option("--backend"), *(o for o in GRID_OPTIONS if o.flag != "--allreduce-world-sizes")},
        "compare": set(), "report": set(), "gpu-check": set(),
    }
    assert set(expected) == set(COMMANDS)
    for command, options in expected.items():
        actions = {flag: action for action in command_parser(command)._actions for flag in action.option_strings}
        bound = {o for o in ALL_OPTIONS if o.flag in actions}
        assert bound == options, f"ddp {command}: {sorted(o.flag for o in bound ^ options)}"
        for definition in bound:
            action = actions[definition.flag]
            assert action.dest == definition.dest, (command, definition.flag)
            assert action.help.startswith(definition.help + " ("), (command, definition.flag)  # then its default
            assert (action.type.option if action.type else None) == (None if definition.choices else definition), command
            assert tuple(action.choices or ()) == tuple(definition.choices or ()), (command, definition.flag)
    # pytest binds the launch and grid options from the same definitions (the root conftest)
    pytest_flags = {flag for flag in ROOT.joinpath("conftest.py").read_text().split() if flag.startswith("--")}
    assert not pytest_flags & {o.flag for o in ALL_OPTIONS}, "the root conftest must not declare a shared option itself"


def test_rounds_mean_at_least_everywhere():
    defaults = RoundOptions(min_rounds=5, max_rounds=20, warmup_rounds=1, target_precision=0.02, budget_seconds=10.0)
    assert round_options({"min_rounds": 30}.get, defaults).max_rounds == 30  # --rounds above the default max raises it
    assert round_options({}.get, defaults) == defaults
    with pytest.raises(OptionError, match="--rounds 30 exceeds --max-rounds 20: raise --max-rounds"):
        round_options({"min_rounds": 30, "max_rounds": 20}.get, defaults)
    grid = grid_defaults("gloo", "cpu")
    assert grid.round_options() == RoundOptions(grid.min_rounds, grid.max_rounds, grid.warmup_rounds, grid.target_precision,
                                                grid.round_budget_seconds())


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
        (["versus", "--precision", "fp16"], "--precision takes one or more of fp32, tf32, bf16, each once, comma-separated"),
        (["profile", "--strategies", "naive", "--optimizer", "adam", "--out", "x"], "--optimizer takes one or more of foreach, fused"),
        (["run", "--precision", "fp32,fp8"], "--precision takes one or more of fp32, tf32, bf16, each once, comma-separated"),
        (["versus", "--precision", "fp32,bf16"], "--precision fp32,bf16: this command trains one configuration; give one value"),
        (["profile", "--strategies", "torch", "--grad-comm", "bf16", "--backend", "gloo", "--out", "x"],
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
