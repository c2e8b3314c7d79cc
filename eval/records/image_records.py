"""Per-image records of a run folder: each image's PNG (``images/<decoder>/``, written atomically) and its record,
one JSON line of ``records/<decoder>[.rank<r>].jsonl`` appended as the image finishes, read back on resume.

Per-image records are appended one JSON line at a time and flushed; on restart an unterminated last line (a
crash mid-write) is ignored and the image is generated again. A complete line that is not a JSON record with the
log's key (a damaged disk block, a hand edit) is reported with its file and line number and skipped: that image
counts as unfinished and is generated again, every other record is kept. Images go through
``coolsd.io.atomic_write_bytes``, so a crash never leaves a half-written one.

Example: every ``python run.py`` writes ``records/<decoder>.jsonl`` and ``images/<decoder>/*.png`` in its output
folder; ``load_records(Path("outputs/<run>/records"), "sd")`` reads every rank's records of decoder ``sd``.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch

from coolsd.io import atomic_write_bytes, remove_stale_temps

#: a record file's name: ``<decoder>.jsonl`` (one process) or ``<decoder>.rank<r>.jsonl`` (rank r of several)
RECORD_FILE = re.compile(r"^(?P<name>.+?)(\.rank(?P<rank>\d+))?\.jsonl$")


def record_file(records_dir: Path, name: str, rank: int = 0, world: int = 1) -> Path:
    """Where rank ``rank`` of ``world`` appends decoder ``name``'s records (``RECORD_FILE``)."""
    return Path(records_dir) / (f"{name}.rank{rank}.jsonl" if world > 1 else f"{name}.jsonl")


def save_png(path: str | os.PathLike, image: torch.Tensor) -> None:
    """Save a uint8 image (3, H, W) or (1, H, W) as PNG, atomically."""
    import io

    from PIL import Image

    arr = image.detach().cpu()
    if arr.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 image, got {arr.dtype}")
    arr = arr.permute(1, 2, 0).numpy()
    pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


class JsonlLog:
    """Append-only JSON-lines file of finished items; ``done`` maps a key to its record.

    ``repair``: the process that appends to the file (its owner) also cuts an unterminated tail off the
    file and clears stale temporaries of its folder; a reader of another process's file (``repair=False``,
    e.g. rank 0 reading a live rank's records) only ignores that tail, as the owner may be writing it.
    """

    def __init__(self, path: str | os.PathLike, key: str, repair: bool = True) -> None:
        self.path = Path(path)
        self.key = key
        self.done: dict[Any, dict] = {}
        if repair:
            remove_stale_temps(self.path.parent)
        if self.path.exists():
            self._load(repair)

    def _load(self, repair: bool) -> None:
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]  # drop an unterminated tail left by a crash
        if repair and len(complete) != len(raw):
            atomic_write_bytes(self.path, complete)
        for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                problem = f"is not JSON ({e})"
            else:
                if isinstance(rec, dict) and isinstance(rec.get(self.key), (int, str)):
                    self.done[rec[self.key]] = rec
                    continue
                problem = f"is not a record with an {self.key!r} key"
            # one location for every caller, so a process reports each damaged line once
            warnings.warn(f"{self.path}:{number}: this line {problem}; skipping it, so its item counts as "
                          "unfinished and is generated again (the other records are kept)", stacklevel=1)

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[record[self.key]] = record

    def records(self) -> Iterable[dict]:
        return self.done.values()


def load_records(records_dir: Path, name: str) -> dict[int, dict]:
    """Every finished record of a decoder, from the single-process file and all rank files. Where two files
    hold an image's record (a resume with another number of ranks), the later one wins unless only the earlier
    names an image file (a record whose image was restored from its tokens keeps it)."""
    done: dict[int, dict] = {}
    for path in sorted(records_dir.glob(f"{name}.jsonl")) + sorted(records_dir.glob(f"{name}.rank*.jsonl")):
        for index, rec in JsonlLog(path, key="index", repair=False).done.items():
            if not (index in done and done[index].get("image") and not rec.get("image")):
                done[index] = rec
    return done


def timed_records(folder: Path, name: str, num_timed: int) -> list[dict] | None:
    """Decoder ``name``'s timed records (batch 1) in the run folder ``folder``, once every prompt of the timed
    subset (``0 .. num_timed - 1``) has one; None before (a row still timing, or a folder not here)."""
    records = load_records(Path(folder) / "records", name) if (Path(folder) / "records").is_dir() else {}
    timed = [r for i, r in sorted(records.items()) if i < num_timed and r.get("timed")]
    return timed if len(timed) == num_timed else None


def record_signatures(ordered: dict[str, list[dict]]) -> dict[str, int]:
    """How many of the run's records were made under each numerics signature (older records: ``unknown``)."""
    counts: dict[str, int] = {}
    for recs in ordered.values():
        for r in recs:
            key = r.get("numerics") or "unknown"
            counts[key] = counts.get(key, 0) + 1
    return counts
