"""Links in the documentation lead to files the repository has.

* Markdown links ``[text](path)`` (and images) in ``README.md`` and every page under ``docs/`` resolve, relative
  to the page's folder, to an existing file or folder; web addresses (``http(s)://``, ``mailto:``) and anchors
  (``#...``, also the part after ``#`` of a path) are not checked.
* Repository paths written as inline code in ``README.md`` and the topic pages ``docs/*.md`` (a span such as
  ``coolsd/orders.py`` whose first folder is one of the repository's own) exist, relative to the repository root.
  Spans with placeholders or globs (``<name>``, ``*``, ``{md,json}``) and paths under git-ignored run outputs
  (``results/runs/``, ``outputs/``) are not checked; ``docs/reference/`` holds notes on other projects' code, whose
  file names are theirs.
* No file of the repository (``.py``, ``.yaml``, ``.csv``, ``.md``, ``.tex``; not ``.git``, ``.peers``, git-ignored
  folders or this file) mentions the team's private specification folder: users cannot follow such a link. The
  project's own pages are ``docs/algorithms.md`` (the rules and metrics) and ``docs/reference-behaviour.md`` (what
  the authors' code does).

Example: ``python -m pytest -q -n 0 tests/test_doc_links.py``.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]  # markdown links: every page
TOPIC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # inline-code paths: our own pages
SCANNED_SUFFIXES = (".py", ".yaml", ".csv", ".md", ".tex")
PRIVATE_SPEC = re.compile(r"shared/docs|\.\./shared")
FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of nested brackets
                  r"\(\s*<?([^()\s<>]+(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")  # (target "title")
PLACEHOLDER = re.compile(r"[<>*{}$\[\]]")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def ignore_rules() -> tuple[list[str], list[str]]:
    """(.gitignore's name patterns, its root-anchored path prefixes), plus ``.git`` and ``.peers``."""
    names, prefixes = [".git", ".peers"], []
    for line in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        pattern = line.rstrip("/")
        if "/" in pattern:
            prefixes.append(pattern.lstrip("/"))
        else:
            names.append(pattern)
    return names, prefixes


IGNORED_NAMES, IGNORED_PREFIXES = ignore_rules()


def ignored(path: str) -> bool:
    """Whether a repository-relative path is git-ignored by one of .gitignore's plain patterns."""
    parts = path.strip("/").split("/")
    if any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in IGNORED_NAMES):
        return True
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in IGNORED_PREFIXES)


def repository_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*")):
        if path.is_file() and path.suffix in SCANNED_SUFFIXES and not ignored(rel(path)):
            out.append(path)
    return out


TOP_FOLDERS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not ignored(p.name))


def prose(text: str) -> str:
    """A page without its fenced code blocks."""
    return FENCE.sub("", text)


def markdown_links(text: str) -> list[str]:
    """Link targets of a page's prose (code spans and fenced blocks removed)."""
    return LINK.findall(INLINE_CODE.sub("", prose(text)))


def local_target(target: str) -> str | None:
    """The file part of a link target, or None for a web address or a pure anchor."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def code_paths(text: str) -> list[str]:
    """Repository paths written as inline code in a page's prose."""
    out = []
    for span in INLINE_CODE.findall(prose(text)):
        span = span.strip()
        if not span or any(c.isspace() for c in span) or PLACEHOLDER.search(span) or "/" not in span:
            continue
        path = re.split(r"::|:|#", span, maxsplit=1)[0].rstrip(".,;)")
        if path.split("/", 1)[0] not in TOP_FOLDERS or ignored(path):
            continue
        out.append(path)
    return out


def broken_links() -> list[str]:
    problems = []
    for page in PAGES:
        for target in markdown_links(page.read_text(encoding="utf-8")):
            local = local_target(target)
            if local is not None and not (page.parent / local).exists():
                problems.append(f"{rel(page)}: link to {target} (no {rel((page.parent / local).resolve())})"
                                if (page.parent / local).resolve().is_relative_to(ROOT)
                                else f"{rel(page)}: link to {target} (outside the repository)")
    return problems


def broken_code_paths() -> list[str]:
    return [f"{rel(page)}: `{path}` does not exist" for page in TOPIC_PAGES
            for path in code_paths(page.read_text(encoding="utf-8")) if not (ROOT / path).exists()]


def private_spec_mentions() -> list[str]:
    this = Path(__file__).resolve()
    hits = []
    for path in repository_files():
        if path.resolve() == this:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if PRIVATE_SPEC.search(line):
                hits.append(f"{rel(path)}:{number}: {line.strip()[:120]}")
    return hits


def test_markdown_links_resolve():
    problems = broken_links()
    assert not problems, "links to files the repository does not have:\n" + "\n".join(problems)


def test_repository_paths_in_the_pages_exist():
    problems = broken_code_paths()
    assert not problems, "inline-code paths the repository does not have:\n" + "\n".join(problems)


def test_nothing_points_to_the_private_specification():
    """Fails with the list of every file:line that still names the team's private specification; point each to
    docs/algorithms.md or docs/reference-behaviour.md."""
    hits = private_spec_mentions()
    assert not hits, (f"{len(hits)} mention(s) of the private specification, which users cannot open "
                      "(use docs/algorithms.md or docs/reference-behaviour.md):\n" + "\n".join(hits))


# -- the checks themselves ----------------------------------------------------------------------------------------
def test_the_checks_find_what_they_should(tmp_path):
    text = ("See [a](algorithms.md#notation), [b](https://example.com/x), [c](#top), ![d](images/report.png), "
            "[e](no-such-page.md), `coolsd/orders.py:RowWindow`, `coolsd/no_such.py`, `configs/decoder/*.yaml`, "
            "`results/runs/x/table.md`, `gpt.py`, `python run.py decoder=sd`, `model=<m>`.\n"
            "```python\nx = [f](g)  # `coolsd/in_a_code_block.py`\n```\n")
    assert markdown_links(text) == ["algorithms.md#notation", "https://example.com/x", "#top", "images/report.png",
                                    "no-such-page.md"]
    assert [local_target(t) for t in markdown_links(text)] == ["algorithms.md", None, None, "images/report.png",
                                                               "no-such-page.md"]
    assert code_paths(text) == ["coolsd/orders.py", "coolsd/no_such.py"]
    assert PRIVATE_SPEC.search("(``" + "shared" + "/docs/algorithms.md``)") and PRIVATE_SPEC.search("../" + "shared")
    assert not PRIVATE_SPEC.search("export HF_HOME=/shared/$USER/hf")
    assert ignored("results/runs/table/x.md") and ignored(".peers/x.py") and not ignored("results/tables/x.md")


@pytest.mark.parametrize("page", ["algorithms.md", "reference-behaviour.md", "extending.md"])
def test_the_pages_that_replace_the_private_specification_exist(page):
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert text.startswith("# ") and text.splitlines()[2].startswith("What you do here:")  # the house style
