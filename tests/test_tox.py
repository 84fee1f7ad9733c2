"""tox's environments install what they say (tox.ini), read through tox's own ``tox config``: the
CPU environments take torch's CPU build from PyTorch's CPU index, pinned to the version CI
installs (``gloo-cpu``) or to the ends of the range ``pyproject.toml`` admits (``torch-lowest``,
``torch-newest``), so that a CPU machine never downloads a CUDA build's nvidia-* packages;
``nccl-gpu`` keeps the CUDA torch it finds. (Running ``tox -e gloo-cpu`` itself takes about 18
minutes, beyond CI's run: its measured size and time are in docs/perf-suite.md.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
ENVIRONMENTS = ("gloo-cpu", "torch-lowest", "torch-newest", "nccl-gpu", "perf-compare")


@pytest.fixture(scope="module")
def tox_config() -> dict[str, dict[str, str]]:
    done = subprocess.run([sys.executable, "-m", "tox", "config", "-e", ",".join(ENVIRONMENTS), "-k", "deps",
                           "system_site_packages", "description", "commands"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    config, section, key = {}, None, None
    for line in done.stdout.splitlines():
        if match := re.fullmatch(r"\[testenv:(.+)\]", line.strip()):
            section = config.setdefault(match.group(1), {})
        elif match := re.fullmatch(r"(\w+) =(.*)", line):
            key = match.group(1)
            section[key] = match.group(2).strip()
        elif line.startswith("  ") and section is not None and key is not None:
            section[key] = (section[key] + "\n" + line.strip()).strip()
    assert set(config) == set(ENVIRONMENTS)
    return config


def torch_lines(deps: str) -> list[str]:
    return [line for line in deps.splitlines() if line.startswith("torch")]


def test_cpu_environments_take_torchs_cpu_build_from_its_index(tox_config):
    ci_torch = re.search(r'pip install --quiet "torch==([^"]+)"', (ROOT / ".ci" / "run").read_text()).group(1)
    lower = str(next(s for s in Requirement(next(d for d in declared_dependencies() if d.startswith("torch"))).specifier
                     if s.operator == ">=").version)
    expected = {"gloo-cpu": f"torch=={ci_torch}", "perf-compare": f"torch=={ci_torch}", "torch-lowest": f"torch=={lower}.*",
                "torch-newest": "torch"}
    for name, pin in expected.items():
        deps = tox_config[name]["deps"]
        assert deps.splitlines()[0] == CPU_INDEX, f"{name}: the CPU index must come first in deps: {deps!r}"
        assert torch_lines(deps) == [pin], f"{name}: {deps!r}"
        assert tox_config[name]["system_site_packages"] == "False", name
        assert "CPU build" in tox_config[name]["description"] or name == "perf-compare", name
    assert "perf_tests" in tox_config["gloo-cpu"]["commands"] and "--backend gloo" in tox_config["gloo-cpu"]["commands"]


def test_the_gpu_environment_keeps_the_cuda_torch_it_finds(tox_config):
    gpu = tox_config["nccl-gpu"]
    assert gpu["system_site_packages"] == "True" and CPU_INDEX not in gpu["deps"] and not torch_lines(gpu["deps"])
    assert "--backend nccl" in gpu["commands"] and "CUDA torch" in gpu["description"]


def declared_dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    return re.findall(r'^\s*"([^"]+)",', block, flags=re.M)
