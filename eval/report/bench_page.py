"""A benchmark study's page (``<name>.html`` beside ``<name>.md``): the study's markdown, with its tables as tables and
its figures shown, in the run report's style (``templates/report.css``, inlined; the figures by relative path, so the
page opens offline from its folder).

``eval.bench.batch_sweep`` writes it with its figures; ``python scripts/report.py results/bench/<name>.md`` writes
it again for any benchmark page.
"""
from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

from coolsd.io import atomic_write_bytes

IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
SEPARATOR = re.compile(r"^\|[-:| ]+\|$")


def blocks(markdown: str) -> tuple[str, list[dict[str, Any]]]:
    """The page's title (its ``#`` heading) and its blocks in order: ``heading`` (``##``), ``table`` (header and
    rows), ``figure`` (``![alt](src)``) and ``text`` (a paragraph: consecutive other lines)."""
    title, out = "", []
    for line in markdown.splitlines():
        line = line.strip()
        last = out[-1] if out else None
        if not line:
            if last and last["kind"] == "text":
                out.append({"kind": "break"})
            continue
        if line.startswith("# ") and not title:
            title = line[2:]
        elif line.startswith("#"):
            out.append({"kind": "heading", "text": line.lstrip("#").strip()})
        elif line.startswith("|"):
            if SEPARATOR.match(line):
                continue
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if last and last["kind"] == "table":
                last["rows"].append(cells)
            else:
                out.append({"kind": "table", "headers": cells, "rows": []})
        elif IMAGE.match(line):
            out.append({"kind": "figure", "missing": False, **IMAGE.match(line).groupdict()})
        elif last and last["kind"] == "text":
            last["text"] += " " + line
        else:
            out.append({"kind": "text", "text": line})
    return title, [b for b in out if b["kind"] != "break"]


def write_bench_page(markdown_path: str | os.PathLike) -> Path:
    """Write ``<name>.html`` beside the benchmark page ``<name>.md``; returns its path."""
    from eval.report.html_page import _environment

    path = Path(markdown_path)
    title, body = blocks(path.read_text())
    for block in body:
        if block["kind"] == "figure":
            block["missing"] = not (path.parent / block["src"]).is_file()
    html = _environment().get_template("bench.html.j2").render(
        title=title or path.stem, blocks=body, source=path.name,
        generated=dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    out = path.with_suffix(".html")
    atomic_write_bytes(out, html.encode())
    return out
