"""``python -m ddp gpu-check``: the plan of stages within the 8-minute budget, the commands each
stage would run on a GPU accepted by the suite, a stage past its limit ended with everything it
started, and the summary's table. The stages themselves run in CI as their CPU rehearsal
(``gpu-check --rehearse`` in ``.ci/run``)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp.acceptance import gpu_stages
from ddp.acceptance.gpu_stages import Target
from ddp.bench.config.options import add_grid_options, add_launch_options, grid_options, launch_options
from ddp.bench.results.records import RunFileError
from ddp.cli import gpu_check
from ddp.cli import main as ddp_main

ROOT = Path(__file__).parents[1]
H100_BYTES = 81_559 * 2**20


def test_the_plan_names_every_stage_with_its_limit_and_adds_up_to_at_most_eight_minutes(tmp_path, capsys):
    assert ddp_main(["gpu-check", "--out", str(tmp_path / "check"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = [re.fullmatch(r"# (\S+): at most (\d+) s on one H100 \((.+)\)", line) for line in lines[:-1]]
    assert all(planned), lines
    assert [m.group(1) for m in planned] == [stage.name for stage in gpu_check.STAGES]
    total = sum(int(m.group(2)) for m in planned)
    assert total <= gpu_check.TOTAL_LIMIT_SECONDS == 480
    assert lines[-1].startswith(f"# at most {total} s in all")
    assert not (tmp_path / "check").exists()  # a dry run writes nothing


def test_stages_run_in_the_order_asked_and_a_wrong_name_is_one_line(tmp_path, capsys):
    assert ddp_main(["gpu-check", "--out", str(tmp_path / "a"), "--dry-run", "--stages", "layout,harness"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["# layout", "# harness"]
    limits = {stage.name: stage.limit_seconds for stage in gpu_check.STAGES}
    assert lines[-1].startswith(f"# at most {limits['layout'] + limits['harness']} s in all")
    for wrong in ("harness,nope", "harness,harness", ","):
        with pytest.raises(SystemExit) as exited:
            ddp_main(["gpu-check", "--out", str(tmp_path / "b"), "--stages", wrong])
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and "choose from harness, precision" in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", sorted(gpu_stages.CORRECTNESS_SECONDS_PER_TEST))
def test_the_correctness_stages_select_what_fits_their_limit_and_every_step_shape(name):
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "correctness_tests", "--collect-only", "-q", "-p", "no:cacheprovider",
         *gpu_stages.CORRECTNESS[0], "-k", gpu_stages.CORRECTNESS[1]], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert collected.returncode == 0 and ids, collected.stdout + collected.stderr
    limit = next(stage.limit_seconds for stage in gpu_check.STAGES if stage.name == name)
    estimate = gpu_stages.STAGE_START_SECONDS + len(ids) * gpu_stages.CORRECTNESS_SECONDS_PER_TEST[name]
    assert estimate <= limit, f"{len(ids)} tests: about {estimate:.0f} s on one H100, past the stage's {limit} s"
    # the GPU trains every strategy of the selection in each of the step's shapes
    for strategy in ("bucketed", "torch", "fsdp"):
        for shape in ("accum2", "accum4", "ckpt"):
            assert any(f"[{strategy}-" in i and i.split("[")[1].rstrip("]").endswith(shape) for i in ids), (strategy, shape)


def suite_parser() -> argparse.ArgumentParser:
    """What a stage's pytest command line may hold: the options the root conftest binds, and the
    few of pytest's and pytest-benchmark's the stages use."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("-k")
    parser.add_argument("--benchmark-json")
    add_launch_options(parser.add_argument)
    add_grid_options(parser.add_argument)
    return parser


class _Ran(Exception):
    """Stops a stage once it has asked for its pytest command."""


PYTEST_STAGES = ("harness", "precision", "fit", "compile", "correctness-gloo-cuda", "correctness-nccl", "layout")


@pytest.mark.parametrize("name", PYTEST_STAGES)
def test_each_stage_runs_on_a_gpu_a_command_the_suite_accepts(name, monkeypatch, tmp_path):
    """The GPU's commands are not run in CI (the rehearsal runs others): each is parsed here as the
    suite would parse it, its grid validated, its paths present, its ranks the stage's."""
    asked = []

    def pytest_command(suite, out, stage_name, *args):
        asked.append(args)
        raise _Ran

    monkeypatch.setattr(gpu_stages, "_pytest", pytest_command)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": H100_BYTES}))
    stage = next(s for s in gpu_check.STAGES if s.name == name)
    with pytest.raises(_Ran):
        stage.run(Target(rehearse=False), tmp_path, ROOT)
    (args,) = asked
    parsed = suite_parser().parse_args([a for a in args if not a.startswith("--junitxml")])
    assert all((ROOT / path).exists() for path in parsed.paths), parsed.paths
    launch = launch_options(vars(parsed).get)
    assert (launch.backend, launch.device, launch.world_size) in (("nccl", None, 1), ("gloo", "cuda", 2))
    grid = grid_options(vars(parsed).get, launch.backend, launch.device or "cuda")
    if parsed.paths[0].startswith("perf_tests"):  # the layout stage's processes share one GPU: a smaller model
        assert grid.model == ("mini" if name == "layout" else "xl"), name


def test_fit_runs_the_largest_batch_the_prediction_allows_and_the_next(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(gpu_stages, "_pytest", lambda suite, out, name, *args: (asked.append(args), (_ for _ in ()).throw(_Ran)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": H100_BYTES}))
    with pytest.raises(_Ran):
        gpu_stages.fit(Target(rehearse=False), tmp_path, ROOT)
    args = list(asked[0])
    # xl in bf16 at seq 1024 on an 80 GB GPU: batch 10 is predicted to fit the 71.7 GiB usable, 11 not
    assert args[args.index("--batch-sizes") + 1] == "10,11" and args[args.index("--seq-lens") + 1] == "1024"


def test_fit_reads_the_outcomes_under_the_ids_the_suite_gives_its_run(monkeypatch, tmp_path):
    """The stage's run is the suite's grid (its precision named): the ids in its report are the
    grid's configurations'; read under others, a batch that ran reads as never run (2026-11-27 on
    an H200, once the GPU's default precision became bf16: "it did not run: None")."""

    def pytest_command(suite, out, name, *args):
        parsed = suite_parser().parse_args([a for a in args if not a.startswith("--junitxml")])
        launch = launch_options(vars(parsed).get)
        ids = [config.test_id for config in grid_options(vars(parsed).get, launch.backend, "cuda").configs()]
        junit = out / "fit.xml"
        junit.write_text(f'<testsuites><testsuite><testcase name="test_step[{ids[0]}]"/><testcase name="test_step[{ids[1]}]">'
                         '<skipped message="predicted not to fit: ..."/></testcase></testsuite></testsuites>')
        return 0, junit

    monkeypatch.setattr(gpu_stages, "_pytest", pytest_command)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": H100_BYTES}))
    with pytest.raises(RunFileError, match="fit.json: no such file"):  # past both outcome checks, to its saved JSON
        gpu_stages.fit(Target(rehearse=False), tmp_path, ROOT)


def test_a_stage_past_its_limit_is_ended_with_every_process_it_started(tmp_path):
    """A stage's pytest, torchrun and ranks are its children: ending only the stage would leave
    them running (and holding the GPU) into the next stage."""
    grandchild = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(grandchild)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    began = time.monotonic()
    code, seconds = gpu_check.run_stage([sys.executable, "-c", script], 3, tmp_path / "stage.log", tmp_path)
    assert code is None and seconds < 10 and time.monotonic() - began < 10
    assert not _alive(int(grandchild.read_text())), "the stage's child outlived the stage"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie waiting for its parent's wait() is dead
    except FileNotFoundError:
        return False


def test_a_stage_that_returns_leaves_nothing_running_either(tmp_path):
    grandchild = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(grandchild)!r}, 'w').write(str(child.pid))")
    code, _ = gpu_check.run_stage([sys.executable, "-c", script], 30, tmp_path / "stage.log", tmp_path)
    assert code == 0
    assert not _alive(int(grandchild.read_text()))  # run_stage returns once none of its group is left


def test_the_summary_is_a_table_of_stage_limit_seconds_outcome_and_figure(tmp_path):
    rows = [["harness", 50, "31", "ok", "harness / plain loop 1.004 [0.991, 1.017] over 10 rounds"],
            ["fit", 45, "45", "TIMED OUT after 45 s", "killed with every process it started; see its stage.log"]]
    gpu_check.write_summary(tmp_path / "summary.md", rows, rehearse=True)
    text = (tmp_path / "summary.md").read_text()
    assert "| stage " in text and "| harness " in text and "TIMED OUT after 45 s" in text
    assert f"torch {torch.__version__}" in text and "Left out of the correctness stages" in text


def test_without_a_gpu_it_says_to_rehearse_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: gpu-check would run")
    done = subprocess.run([sys.executable, "-m", "ddp", "gpu-check", "--out", str(tmp_path / "new")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--rehearse" in done.stderr and not (tmp_path / "new").exists()


def test_the_layout_samples_the_ranks_by_the_pids_nvidia_smi_gives(monkeypatch):
    """In a container ``nvidia-smi`` lists the GPU's processes by their host pids, none of them
    ours: then every process it lists is the stage's (the GPU is lent to the check alone), not
    none, which let the stage pass having sampled nothing."""
    host = {4_000_001: 900 * 2**20, 4_000_002: 800 * 2**20}  # pids no process here has
    assert gpu_stages.ranks_of(host, gpu=True) == (host, True)
    assert gpu_stages.ranks_of(host, gpu=False) == ({}, False)  # /proc's pids are always ours
    assert gpu_stages.ranks_of({}, gpu=True) == ({}, False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # a rank of this process group
    try:
        monkeypatch.setattr(gpu_stages, "_is_rank", lambda pid: pid == child.pid)
        assert gpu_stages.ranks_of({child.pid: 5, **host}, gpu=True) == ({child.pid: 5}, False)
    finally:
        child.kill()
        child.wait()
