"""``run.json``: the record of one finished run (every decoder's metrics with their intervals, the comparisons, the
resolved config, the evaluation card, the machine), written by rank 0 at the end of ``eval.run.experiment`` and read
back by the paper tables, the report page, the sweep status, the claims and the check for a finished row.

``read_run`` reads it as this version names its classes: the stored config's ``_target_`` paths of earlier
versions become today's (``eval.records.legacy``), so a run folder from before a move still matches and groups
with new ones.

Example: ``read_run(Path("outputs/<run>/run.json"))["per_decoder"]["sd"]["speedup"]``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from eval.records.legacy import current_targets


def current_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its ``config`` as this version names its classes (``current_targets``)."""
    if isinstance(record, dict) and isinstance(record.get("config"), dict):
        record = {**record, "config": current_targets(record["config"])}
    return record


def read_run(path: str | os.PathLike) -> dict[str, Any]:
    """The ``run.json`` at ``path`` (``current_record``); raises ``OSError`` or ``json.JSONDecodeError`` as
    ``json.loads`` of the file would."""
    with open(path, encoding="utf-8") as fh:
        return current_record(json.load(fh))
