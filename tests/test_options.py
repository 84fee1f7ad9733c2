"""The one options layer: parsing, validation before any rank starts, backend choice, and the
one-line errors of every command."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp.bench.config.options import (
    ALL_OPTIONS,
    AXIS_LIST_OPTIONS,
    AXIS_OPTIONS,
    GRID_OPTIONS,
    LAUNCH_OPTIONS,
    ROUND_OPTIONS,
    LaunchOptions,
    OptionError,
    RoundOptions,
    gpu_world_sizes,
    grid_defaults,
    grid_options,
    option,
    round_options,
)
from ddp.bench.config.parsing import parse_list
from ddp.bench.config.step_config import AXES, StepConfig, expand
from ddp.cli import COMMANDS, command_parser
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


def grid_with(**axes):
    """The default CPU grid with some axes' values replaced (by ``StepConfig`` field name)."""
    default = grid_defaults("gloo", "cpu")
    return dataclasses.replace(default, axes={**default.axes, **axes})


def test_a_small_grid_gets_a_larger_share_of_the_session_budget():
    default = grid_defaults("gloo", "cpu")
    assert default.num_step_benchmarks == 2 * (4 + 2 * 3)  # batch 4, seq len 64 and 128
    assert default.round_budget_seconds() == pytest.approx(9.0)  # 180 s / 20
    small = grid_with(strategy=("local", "bucketed"), bucket_size_mb=(25.0,), batch_size=(4,), seq_len=(64,))
    assert small.round_budget_seconds() == pytest.approx(90.0)  # 180 s shared by 2
    alone = dataclasses.replace(small, axes={**small.axes, "strategy": ("local",)}, session_budget_seconds=300.0)
    assert alone.round_budget_seconds() == pytest.approx(120.0)  # 300 s for 1, capped
    fixed = dataclasses.replace(default, rounds=dataclasses.replace(default.rounds, budget_seconds=7.0))
    assert fixed.round_budget_seconds() == 7.0


def test_seq_len_beyond_the_context_length_is_refused():
    with pytest.raises(OptionError, match="seq len 256 exceeds model tiny's context length 128"):
        grid_with(model=("tiny",), seq_len=(64, 256))


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
        (["trace", "missing.json"], "missing.json: no such file"),
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
    assert done.returncode == 4 and "--batch-sizes: expected a whole number of 1 or more, got '0'" in done.stderr


def test_the_pytest_header_says_which_backend_and_why():
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/test_options.py", "--collect-only",
                           "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert f"ddp-bench: {LaunchOptions().resolve().describe()}" in done.stdout


def test_every_command_binds_the_shared_options_from_their_one_definition():
    """Each option a command shares with pytest or another command comes from its definition: a
    step's axes from ``ddp.bench.config.step_config.AXES``, the rest from ``ddp.bench.config.options``, with the same
    flag, destination, parser and help text (only the default is the command's). The commands that
    time rounds take every round option; those that train one configuration take every option axis
    (a new one reaches them without an edit)."""
    options = [AXIS_OPTIONS[name] for name, axis in AXES.items() if axis.role == "option"]
    one = dict(AXIS_OPTIONS)
    lists = {name: AXIS_LIST_OPTIONS[name] for name in AXES}
    trains_one = [one["model"], one["batch_size"], one["seq_len"], one["grad_comm"], *options]  # and every member
    expected = {
        "versus": {*LAUNCH_OPTIONS, *ROUND_OPTIONS, *trains_one, one["bucket_size_mb"], lists["strategy"]},
        "buckets": {*LAUNCH_OPTIONS, *ROUND_OPTIONS, *trains_one, lists["bucket_size_mb"], lists["strategy"]},
        "profile": {*LAUNCH_OPTIONS, *trains_one, one["bucket_size_mb"], lists["strategy"]},
        "simulate": {one["model"], one["batch_size"], one["seq_len"], one["grad_accum"], one["activation_checkpointing"],
                     one["precision"], one["grad_comm"], lists["strategy"], lists["bucket_size_mb"]},
        "run": {option("--backend"), *(o for o in GRID_OPTIONS if o.flag not in ("--allreduce-world-sizes", "--rank-groups"))},
        "memory": {option("--world-size"), option("--device-memory"), one["model"], *(lists[name] for name in AXES if name != "model")},
        "compare": set(), "report": set(), "gpu-check": set(), "trace": set(),
    }
    assert set(expected) == set(COMMANDS)
    for command, options in expected.items():
        actions = {flag: action for action in command_parser(command)._actions for flag in action.option_strings}
        bound = {o for o in ALL_OPTIONS if o.flag in actions and actions[o.flag].type is not None
                 and getattr(actions[o.flag].type, "option", None) is o or (o.choices and o.flag in actions)}
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
    assert grid.round_options() == dataclasses.replace(grid.rounds, budget_seconds=grid.round_budget_seconds())
    # the grid's rounds are bound from the same definitions, and the same rule applies to them
    given = grid_options({"min_rounds": 3000}.get, "gloo", "cpu")
    assert (given.rounds.min_rounds, given.rounds.max_rounds) == (3000, 3000)


def test_numerics_are_axes_of_the_grid_and_bf16_communication_applies_where_it_can():
    grid = grid_with(model=("tiny",), batch_size=(2,), seq_len=(32,), strategy=("local", "naive", "bucketed", "torch"),
                     bucket_size_mb=(1.0,), precision=("fp32", "bf16"), grad_comm=("fp32", "bf16"))
    ids = [config.test_id for config in grid.configs()]
    # per precision: local, naive (fp32 communication only), bucketed and torch in both
    assert ids == [
        "local-b2-s32", "naive-b2-s32", "bucketed-b2-s32-bucket1mb", "bucketed-b2-s32-bucket1mb-bf16comm",
        "torch-b2-s32-bucket1mb", "torch-b2-s32-bucket1mb-bf16comm",
        "local-b2-s32-bf16", "naive-b2-s32-bf16", "bucketed-b2-s32-bucket1mb-bf16", "bucketed-b2-s32-bucket1mb-bf16-bf16comm",
        "torch-b2-s32-bucket1mb-bf16", "torch-b2-s32-bucket1mb-bf16-bf16comm",
    ]
    assert grid.num_step_benchmarks == len(ids)


def test_the_default_grid_keeps_every_option_at_its_default():
    """fp32, foreach AdamW, fp32 communication, ...: a default run keeps the names it always had;
    on a GPU but its precision, bf16 (what GPU users train in), named in its ids."""
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda")):
        grid = grid_defaults(backend, device)
        for name, axis in AXES.items():
            if axis.role == "option" or name == "grad_comm":
                expected = ("bf16",) if (name, device) == ("precision", "cuda") else (axis.default,)
                assert grid.values(name) == expected, (backend, name)


def test_every_axis_reaches_the_options_the_ids_and_the_groups_from_its_declaration():
    """What a new axis gets without an edit anywhere else: its list form in pytest and ``ddp run``,
    its one-value form in the commands that train one configuration (option axes), its value in
    test ids and group names wherever it is not the default, and its field in the saved config."""
    pytest_flags = {o.flag for o in GRID_OPTIONS}
    base = StepConfig("bucketed", "tiny", 2, 32, 1.0)
    for name, axis in AXES.items():
        assert axis.list_flag in pytest_flags, name
        assert AXIS_LIST_OPTIONS[name].dest == name and AXIS_OPTIONS.get(name, AXIS_LIST_OPTIONS[name]).dest == name
        assert name in base.to_dict() and StepConfig.from_dict(base.to_dict()) == base
        if axis.role not in ("option", "member") or axis.choices is None:
            continue
        other = next(value for value in axis.choices if value != axis.default)
        changed = StepConfig.of("bucketed", {**base.values(), name: other})
        assert changed.test_id != base.test_id and axis.id(other) in changed.test_id, name
        if axis.role == "option":
            assert axis.text(other) in changed.group_name and changed.local_twin().test_id.endswith(axis.id(other)), name
        else:
            assert changed.group_name == base.group_name and changed.local_twin() == base.local_twin(), name
        configs = expand({**{n: (v,) for n, v in base.values().items() if n in AXES}, name: (axis.default, other)})
        assert base in configs and changed in configs, name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["versus", "--precision", "fp16"], "--precision takes one of fp32, tf32, bf16, got 'fp16'"),
        (["profile", "--strategies", "naive", "--optimizer", "adam", "--out", "x"], "--optimizer takes one of foreach, fused"),
        (["run", "--precision", "fp32,fp8"], "argument --precision: --precision takes one of fp32, tf32, bf16, got 'fp8'"),
        (["versus", "--precision", "fp32,bf16"], "--precision takes one of fp32, tf32, bf16, got 'fp32,bf16'"),
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
    assert "--precision takes one of fp32, tf32, bf16, got 'fp16'" in result.stderr
