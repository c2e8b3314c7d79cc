"""The layout's rules, checked on the source: the core (``coolsd/``) imports nothing from ``baselines``,
``eval`` or ``scripts`` (also not inside functions), scripts are thin entry points, every module says what
it is.

Reads the files with ``ast``; runs in well under a second.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE_THE_CORE = ("baselines", "eval", "scripts")
SCRIPT_MAX_LINES = 100


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, at any depth (functions, classes, try blocks)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_core_imports_nothing_from_baselines_eval_or_scripts():
    files = python_files("coolsd")
    assert len(files) > 20  # the walk found the package
    offending = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in files for line, module in imported_modules(ast.parse(path.read_text()))
                 if module.split(".")[0] in OUTSIDE_THE_CORE]
    assert not offending, offending


def test_the_checker_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from eval.metrics import FIDKID\n    import baselines.exact\n")
    assert [m for _, m in imported_modules(tree)] == ["eval.metrics", "baselines.exact"]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_scripts_are_thin_entry_points(script):
    lines = (ROOT / "scripts" / script).read_text().splitlines()
    assert len(lines) <= SCRIPT_MAX_LINES, f"scripts/{script}: {len(lines)} lines; move the logic into a package"


@pytest.mark.parametrize("folder", ["coolsd", "baselines", "eval", "scripts"])
def test_every_module_opens_with_a_docstring(folder):
    missing = [str(p.relative_to(ROOT)) for p in python_files(folder)
               if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, missing
