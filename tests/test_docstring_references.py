"""Every dotted reference in a docstring names something that exists, and none points outside the
repository.

Docstrings name modules, classes, functions and attributes by their dotted path
(``ddp.bench.rounds.trainer.Trainer``, ``examples.toy:AveragingDDP``): no tool follows them when
code moves, so this test does. Each docstring of the project's Python files (modules, classes,
functions, and the string under an attribute) is read with ``ast``, each reference that starts
with one of the project's top-level packages is imported up to its longest importable module, and
the rest is looked up attribute by attribute.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("ddp", "correctness_tests", "perf_tests", "tests", "examples")
FOLDERS = PACKAGES + ("conftest.py",)
REFERENCE = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?)")
OUTSIDE = re.compile(r"\.\./shared|/work/|/tmp/")


def python_files() -> list[Path]:
    files = []
    for name in FOLDERS:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring in ``path``: module, class, function, and attribute strings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str):
                found.append((statement.lineno, statement.value.value))
    return found


def resolves(reference: str) -> bool:
    """Whether ``reference`` (``package.module.Name.attribute`` or ``package.module:Name``) names
    an importable module and, past it, attributes that exist."""
    module_part, _, after_colon = reference.partition(":")
    parts = module_part.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        rest = parts[cut:] + (after_colon.split(".") if after_colon else [])
        for name in rest:
            if not hasattr(target, name):
                # a dataclass field without a default, or an attribute set in __init__, is declared in the annotations
                if name in getattr(target, "__annotations__", {}) or name in getattr(target, "__dataclass_fields__", {}):
                    target = None
                    continue
                if target is None:
                    return True  # past an annotated attribute: its own attributes are not checked
                return False
            target = getattr(target, name)
        return True
    return False


def references() -> list[tuple[str, int, str]]:
    return [(str(path.relative_to(ROOT)), line, ref) for path in python_files() for line, text in docstrings(path)
            for ref in REFERENCE.findall(text)]


def test_every_dotted_reference_in_a_docstring_resolves():
    found = references()
    assert len(found) > 100, "the reference pattern found too few: is it still reading docstrings?"
    broken = [f"{path}:{line}: {ref}" for path, line, ref in found if not resolves(ref.rstrip("."))]
    assert not broken, "docstrings name what does not exist:\n" + "\n".join(broken)


def test_no_docstring_points_outside_the_repository():
    outside = [f"{path.relative_to(ROOT)}:{line}" for path in python_files() for line, text in docstrings(path)
               if OUTSIDE.search(text)]
    assert not outside, "docstrings point outside the repository: " + ", ".join(outside)


@pytest.mark.parametrize("reference, exists", [("ddp.launcher.RankGroup", True), ("ddp.launcher.NoSuchThing", False),
                                               ("ddp.no_such_module", False), ("examples.toy:AveragingDDP", True)])
def test_the_check_can_fail(reference, exists):
    assert resolves(reference) is exists
