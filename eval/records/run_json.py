"""``run.json``: the record of one finished run (every decoder's metrics with their intervals, the comparisons, the
resolved config, the evaluation card, the machine), written by rank 0 at the end of ``eval.run.experiment`` and read
back by the paper tables, the report page, the sweep status, the claims and the check for a finished row.

``read_run`` reads it as this version composes its config: the stored config's ``_target_`` paths of earlier
versions become today's and decoder keys added since are filled in (``eval.records.legacy``), so a run folder from
before a move or a new option still matches and groups with new ones.

Example: ``read_run(Path("outputs/<run>/run.json"))["per_decoder"]["sd"]["speedup"]``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from eval.records.legacy import current_config


def current_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its ``config`` as this version composes it (``current_config``: today's class paths, keys
    added since filled in with the value the run behaved as)."""
    if isinstance(record, dict) and isinstance(record.get("config"), dict):
        record = {**record, "config": current_config(record["config"])}
    return record


def read_run(path: str | os.PathLike) -> dict[str, Any]:
    """The ``run.json`` at ``path`` (``current_record``); raises ``OSError`` or ``json.JSONDecodeError`` as
    ``json.loads`` of the file would."""
    with open(path, encoding="utf-8") as fh:
        return current_record(json.load(fh))
