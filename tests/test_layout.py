"""The layout's rules, checked on the source: the core (``coolsd/``) imports nothing from ``baselines``,
``eval`` or ``scripts`` (also not inside functions), no modules of the project import each other in a circle,
``eval``'s sub-packages import only those listed before them (``EVAL_PACKAGES``), a file name says one thing
(no two modules of ``eval/`` share one, none is named like a standard-library module), scripts are thin entry
points, every module says what it is.

Reads the files with ``ast``; runs in well under a second.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE_THE_CORE = ("baselines", "eval", "scripts")
SCRIPT_MAX_LINES = 100
PACKAGES = ("coolsd", "baselines", "eval")
#: ``eval``'s sub-packages in the order they may import each other: each only those before it (and itself)
EVAL_PACKAGES = ("records", "metrics", "report", "run", "sweep", "bench", "studies")
#: modules named like a standard-library module that stay: inside the package they are only ever reached as
#: ``coolsd.io`` / ``coolsd.types`` (no script runs from ``coolsd/``); nothing new joins them
STDLIB_NAMED = {"coolsd/io.py", "coolsd/types.py"}


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


def module_name(path: Path) -> str:
    """The dotted name a file is imported as (``eval/run/suite.py`` -> ``eval.run.suite``; a package's
    ``__init__.py`` -> the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES for p in python_files(folder)}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth; ``from pkg import mod`` names the module
    ``pkg.mod`` where there is one, else ``pkg``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
                targets |= subs or {node.module}
                if len(subs) < len(node.names):
                    targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_of_the_project_import_each_other_in_a_circle():
    modules = project_modules()
    assert "eval.run.experiment" in modules and "coolsd.decoding" in modules
    assert circles(import_graph(modules)) == []


def test_the_circle_check_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_eval_packages_import_only_those_listed_before_them():
    found = {p.name for p in (ROOT / "eval").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert found == set(EVAL_PACKAGES), f"eval/ holds packages {sorted(found)}; list each in EVAL_PACKAGES"
    modules = project_modules()
    upward = []
    for name, targets in import_graph(modules).items():
        parts = name.split(".")
        if parts[0] != "eval" or len(parts) < 2:
            continue
        for target in targets:
            other = target.split(".")
            if other[0] == "eval" and len(other) > 1 and other[1] != parts[1] and \
                    EVAL_PACKAGES.index(other[1]) > EVAL_PACKAGES.index(parts[1]):
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_eval_keeps_few_files_at_its_top():
    assert len(list((ROOT / "eval").glob("*.py"))) <= 3  # __init__.py and at most two modules


def test_no_two_modules_under_eval_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path in python_files("eval"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: ps for n, ps in by_name.items() if len(ps) > 1} == {}


def test_no_module_is_named_like_a_standard_library_module():
    named = sorted(str(p.relative_to(ROOT)) for folder in (*PACKAGES, "scripts") for p in python_files(folder)
                   if p.stem in sys.stdlib_module_names and str(p.relative_to(ROOT)) not in STDLIB_NAMED)
    folders = sorted(str(p.relative_to(ROOT)) for folder in (*PACKAGES, "scripts") for p in (ROOT / folder).rglob("*")
                     if p.is_dir() and p.name in sys.stdlib_module_names)
    assert named + folders == []
