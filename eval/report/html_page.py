"""The report of a run or sweep folder as a person reads it: one static page, ``report.html``, and the
qualitative figure of a paper (prompts × decoders).

The page is one HTML file beside the folder's own files, openable offline (inline CSS and JavaScript, no
network): the run's table with 95 % intervals and its paired comparisons (``eval.report.run_table``'s cells), the
trade-off plots (a run's ``speed_quality.png``; a sweep's ``figures/`` from ``scripts/make_tables.py``), the
evaluation card (``run.json["evaluation_card"]``), the exactness and claims verdicts found in the folder, the
rows that are missing or incomplete (states from ``eval.report.sweep_status``, plus decoders with fewer records
than prompts), and a gallery: prompts as rows, decoders as columns, the same seed across a row (image ``i`` is
prompt ``i`` with seed ``eval.seed + i`` for every decoder), each image with its accepted length (committed
tokens ÷ verify forwards, ``coolsd.types.DecodeStats.mean_accepted_length``) and TV per step (``tv_sum /
tv_steps``). The gallery's data is one JSON block that a small script pages through (20 prompts a page by
default), filters by decoder and prompt text and renders with lazily loaded images, so a run of thousands of
images stays fast; images are the run's own files, referenced by relative path, never copied. The script also
writes what it saw into the page (``<html data-images-loaded data-images-failed data-js-errors>``, shown under
the gallery): a browser test reads it (``tests/test_html_report.py``), a person sees which image files did not
load.

In a sweep the gallery's columns are the rows' decoders; a column's id is the decoder's name, or
``<decoder>@<job number>`` where several rows ran that decoder with other images or options (rows whose images of
a decoder are token for token the same and whose decoder has the same label, e.g. AR in a sweep of a decoder
option, share one column). The figure
takes these ids.

Examples::

    python scripts/report.py outputs/2026-12-04/21-20-00            # -> outputs/.../report.html
    python scripts/report.py results/runs/sweep_coolsd_delta         # a sweep: one page for all its rows
    python scripts/report.py --figure outputs/2026-12-04/21-20-00 --prompts 0 5 12 --decoders ar sd coolsd --out fig
"""
from __future__ import annotations

import datetime as dt
import io
import json
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from coolsd.io import atomic_write_bytes
from eval.records.image_records import load_records
from eval.records.run_json import read_run
from eval.report.run_table import (BIAS_NOTE, FID_KEYS, INTERVAL_NOTE, MIXED_MARK, MIXED_NOTE,
                                   comparison_table, fid_is_biased, mixed_numerics, table_cells)
from eval.report.sweep_status import RowStatus, StatusError, record_counts, sweep_status, total_line

REPORT_NAME = "report.html"
TEMPLATES = Path(__file__).resolve().parent / "templates"
PAGE_SIZE = 20
NO_CARD = "no evaluation card (run made before it existed)"
#: folders of a row that hold no verdicts (searched no further for them)
NOT_SEARCHED = {"images", "records", "ranks", ".hydra", ".submitit", "figures", "tables"}
#: the longest text of a verdict file shown inline
MAX_INLINE_CHARS = 20_000


class ReportError(Exception):
    """The folder holds nothing to report, or a figure asks for a prompt or decoder that it does not hold."""


# -- what a folder holds -------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One run folder of the report: its state (``eval.report.sweep_status``), ``run.json`` (None until
    written), per-image records per decoder, the overrides that tell it from the other rows, and what is missing
    (``flags``)."""

    status: RowStatus
    record: dict[str, Any] | None = None
    records: dict[str, dict[int, dict]] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    expected: int | None = None
    flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The row's short name: its varying overrides, else its folder's label."""
        return ", ".join(self.overrides) or self.status.label

    @property
    def labels(self) -> dict[str, str]:
        return dict((self.record or {}).get("labels") or {})


@dataclass
class Column:
    """A gallery column: one decoder of one row (or of several rows that made the same images)."""

    id: str
    decoder: str
    label: str
    row: Row
    also: list[Row] = field(default_factory=list)

    @property
    def records(self) -> dict[int, dict]:
        return self.row.records[self.decoder]


@dataclass
class Folder:
    root: Path
    rows: list[Row]
    statuses: list[RowStatus]
    columns: list[Column]

    @property
    def is_sweep(self) -> bool:
        return len(self.statuses) > 1 or self.statuses[0].folder != self.root

    @property
    def num_prompts(self) -> int:
        counts = [r.expected or 0 for r in self.rows]
        counts += [max(c.records, default=-1) + 1 for c in self.columns]
        return max(counts, default=0)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None


def _row_overrides(folder: Path, record: dict[str, Any] | None) -> list[str]:
    """The Hydra overrides a row was made with (``.hydra/overrides.yaml``, else ``run.json`` job)."""
    listed = _read_yaml(folder / ".hydra" / "overrides.yaml")
    if isinstance(listed, list):
        return [str(o) for o in listed]
    dirname = ((record or {}).get("job") or {}).get("override_dirname")
    return [dirname] if dirname else []


def _expected(folder: Path, record: dict[str, Any] | None) -> int | None:
    if record and isinstance(record.get("num_prompts"), int):
        return record["num_prompts"]
    config = _read_yaml(folder / ".hydra" / "config.yaml") or {}
    n = (config.get("eval") or {}).get("num_prompts") if isinstance(config, dict) else None
    return n if isinstance(n, int) else None


def _load_row(status: RowStatus) -> Row:
    row = Row(status)
    folder = status.folder
    if folder is None or not folder.is_dir():
        row.flags.append(f"{status.state}: {status.detail}")
        return row
    run_json = folder / "run.json"
    if status.state == "done":
        row.record = read_run(run_json)
    else:
        row.flags.append(f"{status.state}: {status.detail}")
    names = list((row.record or {}).get("per_decoder") or {})
    names += [n for n in record_counts(folder) if n not in names]
    row.records = {name: load_records(folder / "records", name) for name in names}
    row.overrides = _row_overrides(folder, row.record)
    row.expected = _expected(folder, row.record)
    if row.record is not None and row.expected is not None:
        short = [f"{name} {len(recs)}/{row.expected}" for name, recs in row.records.items()
                 if len(recs) < row.expected]
        if short:
            row.flags.append("records fewer than the run's prompts: " + ", ".join(short))
    missing = sum(1 for recs in row.records.values() for r in recs.values()
                  if r.get("image") and not (folder / r["image"]).is_file())
    if missing:
        row.flags.append(f"{missing} image file{'s' if missing > 1 else ''} named in the records not on disk")
    return row


def _varying(rows: Sequence[Row]) -> None:
    """Keep in each row's ``overrides`` only those that not every row shares."""
    if len(rows) < 2:
        for row in rows:
            row.overrides = []
        return
    common = set.intersection(*(set(r.overrides) for r in rows))
    for row in rows:
        row.overrides = [o for o in row.overrides if o not in common]


def _same_images(a: dict[int, dict], b: dict[int, dict]) -> bool:
    return a.keys() == b.keys() and all(a[i].get("tokens") == b[i].get("tokens") for i in a)


def _columns(rows: Sequence[Row]) -> list[Column]:
    """One column per (row, decoder); rows whose images of a decoder agree token for token and whose decoder has
    the same label (its defining options: a lossless decoder's draft lengths give the same images with other
    accepted lengths) share one."""
    columns: list[Column] = []
    for row in rows:
        for name in row.records:
            label = row.labels.get(name, name)
            same = next((c for c in columns if c.decoder == name and c.label == label
                         and _same_images(c.records, row.records[name])), None)
            if same is not None:
                same.also.append(row)
                continue
            columns.append(Column(id=name, decoder=name, label=label, row=row))
    for name in {c.decoder for c in columns}:
        several = [c for c in columns if c.decoder == name]
        if len(several) > 1:
            for k, column in enumerate(several):
                num = column.row.status.num
                column.id = f"{name}@{num if num is not None else k}"
    return columns


def load_folder(folder: str | os.PathLike) -> Folder:
    """Every row of a run or sweep folder (``eval.report.sweep_status.sweep_status``), its ``run.json`` and
    records."""
    root = Path(folder)
    try:
        statuses = sweep_status(root)
    except StatusError as err:
        raise ReportError(str(err)) from err
    rows = [_load_row(s) for s in statuses if s.folder is not None and s.folder.is_dir()]
    _varying(rows)
    return Folder(root=root, rows=rows, statuses=statuses, columns=_columns(rows))


# -- tables --------------------------------------------------------------------------------------------------------
@dataclass
class Table:
    """Cell texts: ``headers``, ``rows``, the ``notes`` under the table; the columns from ``numeric`` on are
    numbers (right-aligned)."""

    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    numeric: int | None = None


SEPARATOR = re.compile(r"^\|[-:| ]+\|$")


def _markdown_rows(text: str) -> Table:
    """A markdown table of ``eval.report.run_table`` (``comparison_table``) as cells, and the lines under it as
    notes."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines
             if ln.startswith("|") and not SEPARATOR.match(ln)]
    return Table(headers=cells[0] if cells else [], rows=cells[1:], notes=[ln for ln in lines if not ln.startswith("|")],
                 numeric=2)


def results_table(rows: Sequence[Row], sweep: bool) -> Table | None:
    """Every decoder of every finished row: value ± half its 95 % interval
    (``eval.report.run_table.table_cells``)."""
    entries = [(row, name, metrics) for row in rows if row.record
               for name, metrics in (row.record.get("per_decoder") or {}).items()]
    if not entries:
        return None
    titles, cells = table_cells({str(k): m for k, (_, _, m) in enumerate(entries)})
    out = []
    for (row, name, metrics), line in zip(entries, cells):
        decoder = name + (MIXED_MARK if mixed_numerics(metrics) else "")
        out.append(([row.name] if sweep else []) + [decoder, row.labels.get(name, name)] + line[1:])
    notes = [INTERVAL_NOTE]
    if any(k in m and fid_is_biased(m) for _, _, m in entries for k in FID_KEYS):
        notes.append(BIAS_NOTE)
    if any(mixed_numerics(m) for _, _, m in entries):
        notes.append(MIXED_NOTE)
    return Table(headers=(["row"] if sweep else []) + ["decoder", "method"] + titles[1:], rows=out, notes=notes,
                 numeric=3 if sweep else 2)


def comparisons(row: Row) -> Table | None:
    text = comparison_table((row.record or {}).get("per_decoder") or {})
    return _markdown_rows(text) if text else None


def _card_value(value: Any) -> str:
    if value is None:
        return "— (does not apply)"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def card_table(rows: Sequence[Row], sweep: bool) -> Table | None:
    """The evaluation card, field by field: one value column, or one per row where the rows' cards differ; a
    field that differs between rows is marked (its first cell starts with ``≠ ``)."""
    cards = [(row, row.record["evaluation_card"]) for row in rows
             if row.record and isinstance(row.record.get("evaluation_card"), dict)]
    without = [row.name for row in rows if row.record and not isinstance(row.record.get("evaluation_card"), dict)]
    notes = [NO_CARD + (": " + "; ".join(without) if sweep else "")] if without else []
    if not cards:
        return Table(headers=[], rows=[], notes=notes or [NO_CARD])
    fields = list(dict.fromkeys(f for _, card in cards for f in card))
    texts = [[_card_value(card.get(f)) if f in card else "–" for f in fields] for _, card in cards]
    if all(t == texts[0] for t in texts):
        card = cards[0][1]
        shown = [[f, v] for f, v in zip(fields, texts[0]) if card.get(f) is not None]
        if len(shown) < len(fields):
            notes.append("Fields that do not apply to " + ("these runs" if sweep else "this run") + " are left out: "
                         + ", ".join(f for f in fields if card.get(f) is None) + ".")
        return Table(headers=["field", "value"], rows=shown, notes=notes)
    body = []
    for k, f in enumerate(fields):
        values = [t[k] for t in texts]
        body.append([("≠ " if len(set(values)) > 1 else "") + f, *values])
    notes.insert(0, "≠ marks the fields that differ between rows.")
    return Table(headers=["field", *[row.name for row, _ in cards]], rows=body, notes=notes)


# -- verdicts ------------------------------------------------------------------------------------------------------
@dataclass
class Verdicts:
    """A verdict file of the folder: ``kind`` (``claims`` or ``exactness``), its path relative to the page, a
    table when its JSON has one, else its text."""

    kind: str
    path: str
    table: Table | None = None
    text: str | None = None


def _verdict_files(root: Path) -> list[Path]:
    found = []
    for folder, subfolders, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        subfolders[:] = sorted(d for d in subfolders if d not in NOT_SEARCHED and depth < 2)
        for name in sorted(files):
            low = name.lower()
            if ("claims" in low or "exact" in low) and low.endswith((".json", ".md")):
                found.append(Path(folder) / name)
    return found


def _claims_table(claims: dict[str, list[dict]]) -> Table:
    regimes = list(claims)
    keys = list(dict.fromkeys(c["key"] for cs in claims.values() for c in cs))
    texts = {c["key"]: c.get("text", "") for cs in claims.values() for c in cs}
    rows = []
    for key in keys:
        cells = []
        for regime in regimes:
            c = next((c for c in claims[regime] if c["key"] == key), None)
            cells.append("—" if c is None else c["verdict"] + (f" ({c['note']})" if c.get("note") else ""))
        rows.append([f"{key}: {texts[key]}" if texts[key] and not texts[key].startswith(key) else texts[key] or key,
                     *cells])
    return Table(headers=["claim", *regimes], rows=rows)


def _json_table(data: Any) -> Table | None:
    """A verdict file's JSON as a table: a list of objects one row each, an object one row per key."""
    def text(v: Any) -> str:
        s = v if isinstance(v, str) else json.dumps(v, default=str)
        return s if len(s) <= 300 else s[:299] + "…"

    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        keys = list(dict.fromkeys(k for d in data for k in d))
        return Table(headers=keys, rows=[[text(d.get(k, "")) for k in keys] for d in data[:500]])
    if isinstance(data, dict):
        return Table(headers=["key", "value"], rows=[[str(k), text(v)] for k, v in data.items()])
    return None


def verdicts(root: Path) -> list[Verdicts]:
    """The exactness and claims verdict files in the folder and two levels below it (``scripts/claims.py``
    writes ``embedded_claims.json`` with its ``.md`` page; a file named ``*exact*`` is shown as it is)."""
    out = []
    for path in _verdict_files(root):
        kind = "claims" if "claims" in path.name.lower() else "exactness"
        rel = quote(path.relative_to(root).as_posix(), safe="/")
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                out.append(Verdicts(kind, rel, text=f"not readable JSON: {err}"))
                continue
            if kind == "claims" and isinstance(data, dict) and isinstance(data.get("claims"), dict):
                out.append(Verdicts(kind, rel, table=_claims_table(data["claims"])))
            elif kind == "exactness":
                out.append(Verdicts(kind, rel, table=_json_table(data)))
        elif kind == "exactness" or path.name.endswith("claims_summary.md"):
            text = path.read_text(errors="replace")
            out.append(Verdicts(kind, rel, text=text[:MAX_INLINE_CHARS] + ("\n…" if len(text) > MAX_INLINE_CHARS else "")))
    return out


# -- the gallery ---------------------------------------------------------------------------------------------------
def accepted_length(stats: dict[str, Any]) -> float | None:
    """An image's accepted length: committed image tokens ÷ verify forwards (``DecodeStats``)."""
    hist = stats.get("accepted_hist")
    iterations = stats.get("iterations")
    if not iterations:
        return None
    if hist is not None:
        return sum((k + 1) * c for k, c in enumerate(hist)) / iterations
    return (stats["num_tokens"] - 1) / iterations if "num_tokens" in stats else None


def tv_per_step(stats: dict[str, Any]) -> float | None:
    """An image's mean one-step TV (``tv_sum / tv_steps``), None where the run did not track it."""
    if stats.get("tv_steps") and stats.get("tv_sum") is not None:
        return stats["tv_sum"] / stats["tv_steps"]
    return None


def _src(root: Path, folder: Path, image: str) -> str:
    return quote(Path(os.path.relpath(folder / image, root)).as_posix(), safe="/")


def gallery_data(folder: Folder, page_size: int = PAGE_SIZE) -> dict[str, Any]:
    """The gallery as the page's script reads it: columns, then per prompt index its prompt, seed and one cell
    per column (None where that image is not recorded)."""
    root = folder.root
    columns = []
    for c in folder.columns:
        rows = [c.row, *c.also]
        incomplete = any(r.expected is None or len(c.records) < r.expected or r.record is None for r in rows)
        columns.append({"id": c.id, "label": c.label, "incomplete": incomplete,
                        "rows": "; ".join(r.name for r in rows) if folder.is_sweep else ""})
    prompts = []
    for i in range(folder.num_prompts):
        recs = [c.records.get(i) for c in folder.columns]
        first = next((r for r in recs if r is not None), None)
        prompt, seed = (first.get("prompt"), first.get("seed")) if first else (None, None)
        cells = []
        for column, rec in zip(folder.columns, recs):
            if rec is None:
                cells.append(None)
                continue
            stats = rec.get("stats") or {}
            image = rec.get("image")
            cell: dict[str, Any] = {
                "src": _src(root, column.row.status.folder, image) if image else None,
                "a": accepted_length(stats), "t": tv_per_step(stats),
                "n": stats.get("num_tokens"), "k": stats.get("iterations")}
            if image and not (column.row.status.folder / image).is_file():
                cell["missing"] = image
            if rec.get("prompt") != prompt:
                cell["p"] = rec.get("prompt")
            if rec.get("seed") != seed:
                cell["s"] = rec.get("seed")
            cells.append(cell)
        prompts.append({"i": i, "p": prompt, "s": seed, "c": cells})
    return {"columns": columns, "prompts": prompts, "page_size": page_size}


# -- the page ------------------------------------------------------------------------------------------------------
def _environment() -> Environment:
    return Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True,
                       default_for_string=True), undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _figures(folder: Folder) -> tuple[list[dict[str, str]], str | None]:
    """The trade-off figures to show, and what to run where there are none."""
    root = folder.root
    if not folder.is_sweep:
        path = root / "speed_quality.png"
        if path.is_file():
            return [{"src": "speed_quality.png", "caption": "speed vs quality (speed_quality.png; PDF beside it)"}], None
        return [], "no speed_quality.png: the run measured no quality metric to plot, or it has not finished"
    figures = [{"src": quote(p.relative_to(root).as_posix(), safe="/"), "caption": p.name}
               for p in sorted((root / "figures").glob("*.png"))]
    hint = None if figures else (f"no trade-off figures in {root}/figures: `python scripts/make_tables.py {root}` "
                                 "draws them (and the tables) there, and writes this page again")
    return figures, hint


def _paper_tables(root: Path) -> list[dict[str, str]]:
    """The folder's paper-style tables (``scripts/make_tables.py`` writes ``tables/<name>.{md,tex,csv}``)."""
    out = []
    for md in sorted((root / "tables").glob("*.md")):
        text = md.read_text(errors="replace")
        out.append({"name": md.stem, "src": quote(md.relative_to(root).as_posix(), safe="/"),
                    "others": [quote(o.relative_to(root).as_posix(), safe="/") for o in
                               (md.with_suffix(".tex"), md.with_suffix(".csv")) if o.is_file()],
                    "text": text[:MAX_INLINE_CHARS] + ("\n…" if len(text) > MAX_INLINE_CHARS else "")})
    return out


def _summary(folder: Folder) -> list[tuple[str, str]]:
    """A few facts about the run(s) for the page's head."""
    records = [r.record for r in folder.rows if r.record]
    if not records:
        return []
    first = records[0]
    facts = [("model", ", ".join(dict.fromkeys(str(r.get("model")) for r in records))),
             ("prompts per decoder", ", ".join(dict.fromkeys(str(r.get("num_prompts")) for r in records)))]
    if not folder.is_sweep:
        git = first.get("git") or {}
        facts += [("selected decoder", str(first.get("decoder"))), ("started", str(first.get("started"))),
                  ("wall time", f"{first['wall_s']:.1f} s" if isinstance(first.get("wall_s"), (int, float)) else "–"),
                  ("git commit", f"{git.get('commit') or '–'}" + (" (uncommitted changes)" if git.get("dirty") else ""))]
    return facts


def environments(folder: Folder) -> list[dict[str, str]]:
    """Each row's ``environment.txt`` (``eval.records.environment.write_environment``: Python, torch, CUDA, driver,
    GPU, every package version, git commit and dirty-diff digest): one entry per distinct text, naming its rows."""
    texts: dict[str, list[str]] = {}
    for row in folder.rows:
        path = row.status.folder / "environment.txt" if row.status.folder is not None else None
        if path is not None and path.is_file():
            texts.setdefault(path.read_text(errors="replace"), []).append(row.name)
    return [{"rows": ", ".join(names), "text": text} for text, names in texts.items()]


def render(folder: Folder, page_size: int = PAGE_SIZE) -> str:
    """The page's HTML."""
    sweep = folder.is_sweep
    figures, figure_hint = _figures(folder)
    flagged = [r for r in folder.rows if r.flags]
    unrun = [s for s in folder.statuses if s.folder is None or not s.folder.is_dir()]
    rows = [{"name": r.name, "label": r.status.label, "state": r.status.state, "flags": r.flags,
             "comparisons": comparisons(r),
             "plot": (_src(folder.root, r.status.folder, "speed_quality.png")
                      if (r.status.folder / "speed_quality.png").is_file() else None)} for r in folder.rows]
    return _environment().get_template("report.html.j2").render(
        title=folder.root.resolve().name, root=str(folder.root), sweep=sweep,
        generated=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        total=total_line(folder.statuses), statuses=folder.statuses, summary=_summary(folder),
        flagged=flagged, unrun=unrun, rows=rows, results=results_table(folder.rows, sweep),
        card=card_table(folder.rows, sweep), environments=environments(folder), figures=figures,
        figure_hint=figure_hint,
        verdicts=verdicts(folder.root), paper_tables=_paper_tables(folder.root), gallery=gallery_data(folder, page_size),
        command=f"python scripts/report.py {folder.root}")


def write_report(folder: str | os.PathLike, page_size: int = PAGE_SIZE) -> Path:
    """Write ``<folder>/report.html`` for a run or sweep folder; returns its path."""
    loaded = load_folder(folder)
    path = loaded.root / REPORT_NAME
    atomic_write_bytes(path, render(loaded, page_size).encode())
    return path


# -- the paper figure ----------------------------------------------------------------------------------------------
FIGURE_FONT = 7  # points: a caption-size font in a two-column paper


def _pick_columns(folder: Folder, ids: Sequence[str] | None) -> list[Column]:
    by_id = {c.id: c for c in folder.columns}
    if not ids:
        return list(folder.columns)
    unknown = [d for d in ids if d not in by_id]
    if unknown:
        known = "; ".join(f"{c.id} ({c.label})" for c in folder.columns) or "none"
        raise ReportError(f"no decoder {', '.join(unknown)} in {folder.root}: give --decoders from {known}")
    return [by_id[d] for d in ids]


def _column_titles(columns: Sequence[Column]) -> list[str]:
    """Labels from run.json; the row's overrides added where two chosen columns share a label."""
    titles = []
    for c in columns:
        twin = sum(1 for o in columns if o.label == c.label) > 1
        titles.append(c.label + (f"\n({c.row.name})" if twin and c.row.name else ""))
    return titles


def write_figure(folder: str | os.PathLike, prompts: Sequence[int], decoders: Sequence[str] | None, out: str | os.PathLike,
                 width_in: float = 7.0, dpi: int = 300, stats: bool = False) -> list[Path]:
    """A grid of the chosen prompts (rows, by image index) × decoders (columns, gallery ids), with the decoders'
    labels on top and each prompt under its row, as PDF (images at their own resolution) and PNG at ``dpi``;
    ``width_in`` inches wide (7: a two-column paper's text width). ``stats``: each image's accepted length (and
    TV per step where tracked) under it. Returns the two paths (``out`` with ``.pdf`` and ``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    loaded = load_folder(folder)
    columns = _pick_columns(loaded, decoders)
    if not columns:
        raise ReportError(f"{loaded.root} holds no decoder's records: nothing to draw")
    n = loaded.num_prompts
    bad = [p for p in prompts if not 0 <= p < n]
    if bad or not prompts:
        raise ReportError(f"prompt indices {bad or '(none)'} not in {loaded.root}: give --prompts from 0 to {n - 1}")
    images = [[None] * len(columns) for _ in prompts]
    texts = []
    for r, index in enumerate(prompts):
        prompt = None
        for k, c in enumerate(columns):
            rec = c.records.get(index)
            if rec is None:
                continue
            prompt = prompt or rec.get("prompt")
            path = c.row.status.folder / rec["image"] if rec.get("image") else None
            if path is not None and path.is_file():
                images[r][k] = (Image.open(path).convert("RGB"), rec.get("stats") or {})
        texts.append(prompt or f"prompt {index}: not recorded")
    first = next((im for line in images for im in line if im is not None), None)
    aspect = first[0].height / first[0].width if first else 1.0

    margin, gap = 0.04, 0.04  # inches
    cell = (width_in - 2 * margin - (len(columns) - 1) * gap) / len(columns)
    line_in = FIGURE_FONT * 1.25 / 72
    chars = max(int((width_in - 2 * margin) * 72 / (FIGURE_FONT * 0.5)), 20)
    # characters per line in a column (bold titles are wider than the average glyph, 0.62 em)
    titles = [textwrap.fill(t, max(int(cell * 72 / ((FIGURE_FONT + 0.5) * 0.62)), 6)) for t in _column_titles(columns)]
    stat_chars = int(cell * 72 / ((FIGURE_FONT - 1) * 0.55))  # "τ = 2.09, TV 0.218" on one line where it fits
    head = max(t.count("\n") + 1 for t in titles) * line_in + 0.06
    prompt_lines = [textwrap.wrap(f"“{t}”", chars)[:3] for t in texts]
    stat_lines = 2 if stats and stat_chars < len("τ = 0.00, TV 0.000") else 1
    stat_h = stat_lines * line_in + 0.02 if stats else 0.0
    row_h = [cell * aspect + stat_h + 0.03 + len(lines) * line_in + 0.08 for lines in prompt_lines]
    height = head + sum(row_h) + margin
    fig = plt.figure(figsize=(width_in, height), dpi=dpi)
    y = height - margin - head
    for k, title in enumerate(titles):
        x = margin + k * (cell + gap) + cell / 2
        fig.text(x / width_in, (y + 0.04) / height, title, ha="center", va="bottom", fontsize=FIGURE_FONT + 0.5,
                 fontweight="bold", linespacing=1.1)
    for r, lines in enumerate(prompt_lines):
        top = y
        for k in range(len(columns)):
            ax = fig.add_axes(((margin + k * (cell + gap)) / width_in, (top - cell * aspect) / height,
                               cell / width_in, cell * aspect / height))
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_linewidth(0.3)
                spine.set_color("0.6")
            entry = images[r][k]
            if entry is None:
                ax.set_facecolor("0.93")
                ax.text(0.5, 0.5, "not generated", ha="center", va="center", fontsize=FIGURE_FONT - 1, color="0.4",
                        transform=ax.transAxes)
                continue
            ax.imshow(entry[0], interpolation="none" if entry[0].width < 128 else "antialiased")
            if stats:
                acc, tv = accepted_length(entry[1]), tv_per_step(entry[1])
                sep = "\n" if stat_lines == 2 else ", "
                note = (f"τ = {acc:.2f}" if acc is not None else "") + (f"{sep}TV {tv:.3f}" if tv else "")
                fig.text((margin + k * (cell + gap) + cell / 2) / width_in, (top - cell * aspect - 0.02) / height, note,
                         ha="center", va="top", fontsize=FIGURE_FONT - 1, color="0.25")
        text_top = top - cell * aspect - stat_h - 0.03
        fig.text(0.5, text_top / height, "\n".join(lines), ha="center", va="top", fontsize=FIGURE_FONT,
                 style="italic", linespacing=1.15)
        y -= row_h[r]
    out = Path(out)
    stem = out.with_suffix("") if out.suffix.lower() in (".pdf", ".png") else out
    paths = [stem.with_name(stem.name + ".pdf"), stem.with_name(stem.name + ".png")]
    for path, fmt in zip(paths, ("pdf", "png")):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=dpi, metadata={"Software": None} if fmt == "png" else {"Creator": None})
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
    plt.close(fig)
    return paths

