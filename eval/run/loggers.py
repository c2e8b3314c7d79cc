"""Experiment loggers: Weights & Biases (online, offline or disabled) or none.

W&B mirrors ``run.json``; nothing downstream reads W&B back but ``scripts/make_tables.py --wandb``, which takes
the run's copy of ``run.json``. One W&B run per ``run.py`` job (row), named after the experiment and the overrides
that make the job (``sweep_coolsd_delta[decoder.delta=1.1]``; Hydra's ``hydra.job.override_dirname``) and
grouped by experiment (or sweep folder), unless ``logger.name`` / ``logger.group`` say otherwise. It logs the
flat metrics with their interval ends (``metrics/<key>_ci_lo``, ``_ci_hi``) and paired comparisons
(``metrics/vs_sd/fid/difference``, ``.../p``), the per-decoder table twice (numbers with interval ends, and
the printed ``value ± half-width`` cells), the speed–quality plot, image grids and a samples table.

Self-contained run folder: every file the run logs lives under ``<output_dir>/wandb/``. ``run.json`` and
``table.md`` are copied (not symlinked) into the run's ``files/``; images logged one by one are copied by W&B
into ``files/media/``; the samples table's images, which W&B stages as artifact files in its data folder
(``~/.local/share/wandb/artifacts/staging`` by default, outside the run), are staged under
``<output_dir>/wandb/artifacts/staging`` (``WANDB_DATA_DIR`` is pointed there while the run logs) and also
logged as image lists ``samples/<decoder>`` in ``files/media/``. Offline runs are uploaded later with
``wandb sync <output_dir>/wandb/offline-run-*`` (from where they were made: W&B records the staged artifact
files by absolute path; the ``files/`` folder is found relative to the run).

**One W&B run per row, across requeues**: the run's id is ``run_id(<output_dir>)``, the first 16 hex digits of
the SHA-1 of the output folder's resolved absolute path, and it is opened with ``resume="allow"``, so a requeued
or resumed job (the same folder: ``hydra.sweep.dir``/``hydra.run.dir``) appends to the run its first attempt
opened (online: the run continues at its last step). Offline, each attempt writes its own
``offline-run-<time>-<id>`` folder with the row's id; ``wandb sync`` syncs folders of one run one after the other
in the order they were made (``wandb sync --help``, W&B 0.31; not tried against a server here, and older W&B
versions replaced an earlier folder's history with a later one's: wandb/wandb#3841). The id follows the
folder's path, not its content: a folder moved or renamed (or reached through another mount point, whose
resolved path differs) opens a new run on its next attempt, and the run of its old path stays as it was; moving
it back continues the old one. Two runs of one folder with other settings (``eval.resume=overwrite``) share a
W&B run too.

**Live progress** (``Progress``): while the run generates, every ``logger.progress_every`` batches or
``logger.progress_every_s`` seconds (whichever comes first) the console (a line above the progress bar) and
W&B (``progress/<decoder>/images``, ``.../accepted_length``, ``.../img_per_s``, ``progress/images``) show the
images done, the running pooled accepted length and the images per second of generation of every decoder;
the W&B run is opened when generation starts (``begin``) and the final summary is logged into the same run
when it ends (``log_run``). With several ranks rank 0 reports its own shard.

Example: ``python run.py logger=wandb logger.mode=online logger.project=coolsd``.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

MODES = ("online", "offline", "disabled")


def sample_rows(record: dict[str, Any], out_dir: Path, per_decoder: int = 8) -> list[tuple]:
    """(decoder, index, prompt, image path) of the first images of every decoder, from the records."""
    from eval.records.image_records import load_records

    rows = []
    for name in record["per_decoder"]:
        recs = load_records(out_dir / "records", name)
        for r in [recs[i] for i in sorted(recs)][:per_decoder]:
            if r.get("image"):
                rows.append((name, r["index"], r["prompt"], out_dir / r["image"]))
    return rows


def flatten(metrics: dict[str, Any]) -> dict[str, Any]:
    """Scalars only: ``<key>_ci`` -> ``<key>_ci_lo``/``_ci_hi``; ``vs_<b>`` -> ``vs_<b>/<key>/<field>``."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key.endswith("_ci"):
            lo, hi = value if value is not None else (None, None)
            out[f"{key}_lo"], out[f"{key}_hi"] = lo, hi
        elif isinstance(value, dict):
            for sub, comp in value.items():
                if isinstance(comp, dict):
                    for field in ("difference", "p", "t", "df"):
                        if comp.get(field) is not None:
                            out[f"{key}/{sub}/{field}"] = comp[field]
                    if comp.get("ci"):
                        out[f"{key}/{sub}/ci_lo"], out[f"{key}/{sub}/ci_hi"] = comp["ci"]
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


def run_name(record: dict[str, Any]) -> str:
    """``<experiment or decoder>[<overrides of this job>]``, e.g. ``sweep_coolsd_delta[decoder.delta=1.1]``."""
    job = record.get("job") or {}
    base = (record.get("config") or {}).get("experiment_name") or record["decoder"]
    overrides = job.get("override_dirname")
    return f"{base}[{overrides}]" if overrides else base


def run_id(out_dir: str | os.PathLike) -> str:
    """The W&B run id of an output folder: the first 16 hex digits of the SHA-1 of its resolved absolute path
    (W&B ids allow letters, digits, ``-`` and ``_``), the same for every attempt of a job that writes there; a
    moved folder gets another (see the module doc)."""
    return hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]


def run_group(record: dict[str, Any]) -> str | None:
    """The experiment's name, else the sweep folder of a multirun, else None (a single run)."""
    experiment = (record.get("config") or {}).get("experiment_name")
    if experiment:
        return str(experiment)
    sweep = (record.get("job") or {}).get("sweep_dir")
    return f"sweep {sweep}" if sweep else None


@contextlib.contextmanager
def staging_inside(folder: Path) -> Iterator[None]:
    """Point W&B's data folder (where it stages artifact files, e.g. a table's images) into ``folder``."""
    old = os.environ.get("WANDB_DATA_DIR")
    os.environ["WANDB_DATA_DIR"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WANDB_DATA_DIR", None)
        else:
            os.environ["WANDB_DATA_DIR"] = old


class Progress:
    """Running totals of the generation loop, reported to the console and the logger (see the module doc).

    ``add`` takes each generated batch's ``DecodeStats`` and its wall time; a report goes out every ``every``
    batches or ``every_s`` seconds. ``img_per_s`` is a decoder's images over its own generation seconds (the
    batches' wall times), so decoders interleaved in one loop are not charged for each other. The accepted
    length is pooled: committed image tokens over verify forwards, summed (``coolsd.types``).
    """

    def __init__(self, logger: Any = None, every: int = 10, every_s: float = 60.0,
                 write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if every < 1 or every_s <= 0:
            raise ValueError("logger.progress_every must be >= 1 and logger.progress_every_s > 0, got "
                             f"{every}, {every_s}")
        if write is None:
            from tqdm import tqdm

            write = tqdm.write  # above the progress bar, not through it
        self.logger, self.every, self.every_s, self.write, self.clock = logger, every, every_s, write, clock
        self.totals: dict[str, int] = {}
        self.images: dict[str, int] = {}
        self.committed: dict[str, int] = {}
        self.iterations: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.batches = 0
        self.reports = 0
        self._last = clock()

    def start(self, totals: dict[str, int]) -> None:
        """The images each decoder has to generate in this run (what is already recorded is not counted)."""
        self.totals = dict(totals)
        for name in totals:
            self.images.setdefault(name, 0)
            self.committed.setdefault(name, 0)
            self.iterations.setdefault(name, 0)
            self.seconds.setdefault(name, 0.0)
        self._last = self.clock()

    def add(self, name: str, stats: Sequence[Any], seconds: float) -> None:
        """One generated batch of decoder ``name``: its images' ``DecodeStats`` and its wall time."""
        for counter, zero in ((self.images, 0), (self.committed, 0), (self.iterations, 0), (self.seconds, 0.0)):
            counter.setdefault(name, zero)
        self.images[name] += len(stats)
        self.committed[name] += sum(s.num_tokens - 1 for s in stats)
        self.iterations[name] += sum(s.iterations for s in stats)
        self.seconds[name] += seconds
        self.batches += 1
        if self.batches % self.every == 0 or self.clock() - self._last >= self.every_s:
            self.report()

    def snapshot(self) -> dict[str, float]:
        """The flat metrics of a report: ``progress/<decoder>/{images,accepted_length,img_per_s}``, totals."""
        out: dict[str, float] = {}
        for name in self.images:
            out[f"progress/{name}/images"] = self.images[name]
            out[f"progress/{name}/accepted_length"] = self.committed[name] / max(self.iterations[name], 1)
            seconds = self.seconds[name]
            out[f"progress/{name}/img_per_s"] = self.images[name] / seconds if seconds else 0.0
        out["progress/images"] = sum(self.images.values())
        out["progress/total"] = sum(self.totals.values()) if self.totals else sum(self.images.values())
        return out

    def line(self, final: bool = False) -> str:
        parts = []
        for name in self.images:
            total = self.totals.get(name)
            done = f"{self.images[name]}/{total}" if total is not None else str(self.images[name])
            rate = self.images[name] / self.seconds[name] if self.seconds[name] else 0.0
            if not self.images[name]:
                parts.append(f"{name} {done} img")
                continue
            parts.append(f"{name} {done} img, accepted length "
                         f"{self.committed[name] / max(self.iterations[name], 1):.2f}, {rate:.2f} img/s")
        return ("generation done: " if final else "progress: ") + "; ".join(parts)

    def report(self, final: bool = False) -> None:
        self.reports += 1
        self._last = self.clock()
        if not self.images:
            return
        self.write(self.line(final))
        log = getattr(self.logger, "log_progress", None)
        if log is not None:
            log(self.snapshot())

    def finish(self) -> None:
        """The last report, once generation ends (the final metrics follow with ``log_run``)."""
        self.report(final=True)


class NullLogger:
    """Logs nothing (the console still shows the progress lines)."""

    def __init__(self, progress_every: int = 10, progress_every_s: float = 60.0) -> None:
        self.progress_every, self.progress_every_s = progress_every, progress_every_s

    def begin(self, record: dict[str, Any], out_dir: Path) -> None:
        return None

    def log_progress(self, metrics: dict[str, Any]) -> None:
        return None

    def log_run(self, record: dict[str, Any], out_dir: Path) -> None:
        return None


class WandbLogger:
    """Log a run's metrics with intervals, per-decoder tables, plots and images to W&B (see the module doc): one
    W&B run per output folder (``run_id``), resumed by every later attempt of the job."""

    def __init__(self, project: str = "coolsd", mode: str = "offline", entity: str | None = None,
                 tags: Sequence[str] = (), name: str | None = None, group: str | None = None,
                 progress_every: int = 10, progress_every_s: float = 60.0) -> None:
        """``name``/``group``: None takes them from the experiment and the job's overrides (``run_name``,
        ``run_group``). ``progress_every``/``progress_every_s``: live progress every so many batches or
        seconds."""
        if mode not in MODES:
            raise ValueError(f"logger.mode must be one of {MODES}, got {mode!r}")
        self.project, self.mode, self.entity = project, mode, entity
        self.tags, self.name, self.group = list(tags), name, group
        self.progress_every, self.progress_every_s = progress_every, progress_every_s
        self._run: Any = None

    def _init(self, record: dict[str, Any], out_dir: Path) -> Any:
        import wandb

        return wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(out_dir),
                          id=run_id(out_dir), resume="allow", tags=self.tags, name=self.name or run_name(record),
                          group=self.group or run_group(record), job_type=record["decoder"],
                          config=record["config"], reinit="finish_previous",
                          settings=wandb.Settings(silent=True, console="off"))

    def begin(self, record: dict[str, Any], out_dir: Path) -> None:
        """Open the W&B run when generation starts (``record``: ``decoder``, ``config``, ``job``), so progress
        shows during the run."""
        out_dir = Path(out_dir)
        with staging_inside(out_dir / "wandb"):
            self._run = self._init(record, out_dir)

    def log_progress(self, metrics: dict[str, Any]) -> None:
        if self._run is not None:
            self._run.log(dict(metrics))

    def log_run(self, record: dict[str, Any], out_dir: Path) -> None:
        import wandb

        from eval.report.run_table import table_cells

        out_dir = Path(out_dir)
        with staging_inside(out_dir / "wandb"):
            run = self._run if self._run is not None else self._init(record, out_dir)
            self._run = None
            try:
                run.config.update(record["config"], allow_val_change=True)
                self._log(wandb, run, record, out_dir, table_cells)
            finally:
                run.finish()

    def _log(self, wandb: Any, run: Any, record: dict[str, Any], out_dir: Path, table_cells: Any) -> None:
        run.log({f"metrics/{k}": v for k, v in flatten(record["metrics"]).items() if v is not None})
        flat = {name: flatten(m) for name, m in record["per_decoder"].items()}
        columns = ["decoder", *sorted({k for m in flat.values() for k in m})]
        rows = [[name, *[m.get(c) for c in columns[1:]]] for name, m in flat.items()]
        titles, cells = table_cells(record["per_decoder"])
        run.log({"per_decoder": wandb.Table(columns=columns, data=rows),
                 "per_decoder_table": wandb.Table(columns=titles, data=cells)})
        samples = sample_rows(record, out_dir)
        if samples:
            table = wandb.Table(columns=["decoder", "index", "prompt", "image"])
            by_decoder: dict[str, list] = {}
            for name, index, prompt, path in samples:
                table.add_data(name, index, prompt, wandb.Image(str(path)))
                by_decoder.setdefault(name, []).append(wandb.Image(str(path), caption=f"{index}: {prompt}"))
            run.log({"samples": table, **{f"samples/{name}": images for name, images in by_decoder.items()}})
        images = {f"images/{g.stem}": wandb.Image(str(g)) for g in sorted(out_dir.glob("grid_*.png"))}
        if (out_dir / "speed_quality.png").is_file():
            images["plots/speed_quality"] = wandb.Image(str(out_dir / "speed_quality.png"))
        if images:
            run.log(images)
        run.summary.update({"git_commit": record["git"].get("commit"), "decoder": record["decoder"],
                            "model": record.get("model")})
        files = Path(run.dir)  # the run's files/ folder: copies, so a moved run keeps them
        for name in ("run.json", "table.md"):  # scripts/make_tables.py --wandb reads run.json back
            source = out_dir / name
            if source.is_file():
                shutil.copyfile(source, files / name)
                run.save(str(files / name), base_path=str(files), policy="now")
