"""The declared requirements hold for the environment the suite runs in.

pyproject.toml states the torch range once; a GPU user installs the project beside the CUDA
torch they have, which pip keeps only when it satisfies that range. This test reads the range
from pyproject.toml and checks the torch it runs with against it, so a release outside the range
cannot pass the suite unnoticed, and the range cannot drift from what the suite is run on.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

packaging_requirements = pytest.importorskip("packaging.requirements", reason="packaging (a dependency of pytest) is missing")
from packaging.version import Version  # noqa: E402

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def declared_dependencies() -> list[str]:
    """The [project] dependencies list of pyproject.toml (tomllib where Python has it)."""
    text = PYPROJECT.read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)["project"]["dependencies"]
    # Python 3.10: the list is plain strings; read it as a Python literal once comments are gone.
    block = re.search(r"^dependencies = (\[.*?^\])", text, flags=re.S | re.M).group(1)
    return ast.literal_eval(re.sub(r"#.*", "", block))


def requirement(name: str):
    matches = [packaging_requirements.Requirement(line) for line in declared_dependencies()]
    matches = [r for r in matches if r.name == name]
    assert len(matches) == 1, f"{name} must be declared exactly once in pyproject.toml, found {len(matches)}"
    return matches[0]


def test_the_installed_torch_satisfies_the_declared_range():
    declared = requirement("torch")
    # torch.__version__ carries a local label (2.13.0+cpu, 2.11.0+cu130): the range is on the release.
    installed = Version(torch.__version__)
    assert declared.specifier.contains(installed, prereleases=True), (
        f"torch {torch.__version__} is outside the declared range {declared}: install a torch in the range, "
        "or widen it in pyproject.toml once the suite has run green on this release"
    )


def test_the_range_admits_the_releases_the_suite_has_run_on():
    """2.11 ran green on an H100 (2.11.0+cu130), 2.13 in CI; later minors are not excluded."""
    specifier = requirement("torch").specifier
    for release in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14.0"):
        assert specifier.contains(release, prereleases=True), f"{specifier} refuses torch {release}"
    assert not specifier.contains("2.10.0"), "2.10 has never been run: the range must not claim it"


LOCAL_MODULES = {"ddp", "correctness_tests", "tests", "perf_tests", "conftest", "examples"}


def imported_packages() -> set[str]:
    """Top-level modules imported anywhere in the package and the suites, stdlib and local left out."""
    root = PYPROJECT.parent
    found = set()
    for folder in ("ddp", "correctness_tests", "tests", "perf_tests"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - LOCAL_MODULES


def test_every_imported_package_is_declared():
    text = PYPROJECT.read_text()
    extras = re.search(r"^test = (\[.*?\])", text, flags=re.M).group(1)
    declared = {
        packaging_requirements.Requirement(line).name.replace("-", "_")
        for line in [*declared_dependencies(), *ast.literal_eval(extras)]
    }
    missing = imported_packages() - declared
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
    assert {"torch", "numpy"} <= imported_packages()  # the scan sees what it must


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib (Python 3.11 and later)")
def test_uv_takes_each_torch_build_from_pytorchs_index_for_its_extra():
    """uv's documented way for PyTorch: one extra per build, the extras conflicting, torch from an
    explicit index per extra (nothing else from it), each extra asking for the declared range."""
    import tomllib

    project = tomllib.loads(PYPROJECT.read_text())
    extras = project["project"]["optional-dependencies"]
    indexes = {index["name"]: index for index in project["tool"]["uv"]["index"]}
    sources = {source["extra"]: source["index"] for source in project["tool"]["uv"]["sources"]["torch"]}
    builds = {"cpu": "https://download.pytorch.org/whl/cpu", "cu130": "https://download.pytorch.org/whl/cu130"}
    assert {extra: indexes[sources[extra]]["url"] for extra in builds} == builds
    assert all(indexes[sources[extra]]["explicit"] for extra in builds)
    assert project["tool"]["uv"]["conflicts"] == [[{"extra": extra} for extra in builds]]
    for extra in builds:
        (declared,) = (packaging_requirements.Requirement(line) for line in extras[extra])
        assert declared == requirement("torch"), f"the {extra} extra asks for {declared}, the project for {requirement('torch')}"
