"""Experiment loggers: Weights & Biases (online, offline or disabled) or none.

W&B mirrors ``run.json``; nothing downstream reads W&B back. Offline runs are uploaded later with
``wandb sync <output_dir>/wandb/offline-run-*``.

Example: ``python run.py logger=wandb logger.mode=online logger.project=coolsd``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

MODES = ("online", "offline", "disabled")


def sample_rows(record: dict[str, Any], out_dir: Path, per_decoder: int = 8) -> list[tuple]:
    """(decoder, index, prompt, image path) of the first images of every decoder, from the records."""
    from eval.records import load_records

    rows = []
    for name in record["per_decoder"]:
        recs = load_records(out_dir / "records", name)
        for r in [recs[i] for i in sorted(recs)][:per_decoder]:
            if r.get("image"):
                rows.append((name, r["index"], r["prompt"], out_dir / r["image"]))
    return rows


class NullLogger:
    """Logs nothing."""

    def log_run(self, record: dict[str, Any], out_dir: Path) -> None:
        return None


class WandbLogger:
    """Log a run's metrics (flat), per-decoder table and image grids to W&B."""

    def __init__(self, project: str = "coolsd", mode: str = "offline", entity: str | None = None,
                 tags: Sequence[str] = (), name: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"logger.mode must be one of {MODES}, got {mode!r}")
        self.project, self.mode, self.entity = project, mode, entity
        self.tags, self.name = list(tags), name

    def log_run(self, record: dict[str, Any], out_dir: Path) -> None:
        import wandb

        run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(out_dir),
                         tags=self.tags, name=self.name, config=record["config"], reinit="finish_previous",
                         settings=wandb.Settings(silent=True, console="off"))
        try:
            run.log({f"metrics/{k}": v for k, v in record["metrics"].items()})
            columns = ["decoder", *sorted({k for m in record["per_decoder"].values() for k in m})]
            rows = [[name, *[m.get(c) for c in columns[1:]]] for name, m in record["per_decoder"].items()]
            run.log({"per_decoder": wandb.Table(columns=columns, data=rows)})
            samples = sample_rows(record, Path(out_dir))
            if samples:
                table = wandb.Table(columns=["decoder", "index", "prompt", "image"])
                for name, index, prompt, path in samples:
                    table.add_data(name, index, prompt, wandb.Image(str(path)))
                run.log({"samples": table})
            grids = sorted(Path(out_dir).glob("grid_*.png"))
            if grids:
                run.log({f"images/{g.stem}": wandb.Image(str(g)) for g in grids})
            run.summary.update({"git_commit": record["git"].get("commit"), "decoder": record["decoder"],
                                "model": record.get("model")})
            record_file = (Path(out_dir) / "run.json").resolve()
            if record_file.is_file():  # scripts/make_tables.py --wandb reads it back
                run.save(str(record_file), base_path=str(record_file.parent), policy="now")
        finally:
            run.finish()
