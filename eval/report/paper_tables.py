"""Paper-style tables from run records (``run.json``), beside the published numbers.

Reads every ``run.json`` under the given result folders (a Hydra multirun folder, ``outputs/``, …) or the
runs of a W&B project, turns each decoder a run measured (its ``per_decoder`` entries, AR included) into one
row of a pandas frame (``measured_frame``; ``eval.report.paper_plots`` draws the same frame), and writes, for a
table name ``<name>``, ``<out>/tables/<name>.md``, ``.tex`` (booktabs) and ``.csv``: rows = methods grouped by
model, columns = N (images / timed images), CLIP score, FID (KID, ImageReward, HPSv2.1, class accuracy when
measured), accepted length, latency, speedup, TV per step and per token; every value ± half its 95 % interval
(the CSV: ``<key>_lo``, ``<key>_hi``); images per method, hardware, torch version and the FID/KID protocol
(``fid_protocol`` of the runs: ``clean`` is the paper's) in the caption.

``<out>`` is the input folder (several: their common folder) unless ``--out`` is given; nothing is written
into the repository's ``results/`` unless asked.

Bold. The best value of a column within a model is bold only when it is significantly better than the
runner-up: their 95 % intervals do not overlap (a conservative test: for equal widths it rejects at about
p < 0.006). A row without an interval (published numbers, runs made before intervals) is never bold.
FIDs over fewer than 1,000 images (``eval.metrics.intervals.FID_MIN_IMAGES``) are marked † (strongly biased;
read KID).

Rules. A row is one (model, decoder, decoder options, drafter); when several runs measured the same row the
newest (by ``started``) is kept and a note names the dropped runs — AR is measured in every run (it is each
run's speedup denominator), so the AR row is the newest AR measurement. A method measured on one model but
not on another, and a metric a row lacks, show as "—"; nothing is filled in. Columns no row reports are left
out. The method label is the paper's name plus its defining options (δ, k, λ, the tree of vanilla SD) and any
other option that differs between rows of the same decoder (tree, schedule, resampling, …), each once
(``eval/report/labels.py``).

Evaluation cards. Every row carries the card of its run (``eval.report.evaluation_card.record_card``: prompts,
images, seeds, the FID/KID reference, resize and extractor, the other scorers, sampling, precision, device), and
the table's notes state it: once for every row where the rows agree, per model where they differ between models
(each model's rows are compared with each other: bold marks and speedups are per model and run, and sampling is
the model's). Rows of one model whose cards differ in a field of ``eval.report.evaluation_card.card_key`` are
refused (``ProtocolMismatch`` names the fields and the runs) unless ``mixed_protocols`` is set
(``--mixed-protocols``): then the caption says so and a note per row lists its values of the differing
fields. The published rows carry their notes instead and are not checked.

``--published`` adds the numbers of the COOL-SD paper's main table (``eval/report/published_numbers.csv``; the
metric protocol behind them: ``docs/algorithms.md``) as a separate table marked "published"; they are never mixed
into the measured rows or their bold marks. The CSV holds two kinds of rows: rows of methods the harness reproduces
(a ``decoder`` and no ``reason``; kept only for the decoders measured in the folder, all of them when nothing
is), and rows of methods it cannot implement faithfully from what is public (a ``reason``, no decoder; always
printed, in a third table marked "reported", with their venue, benchmark, source table and reason). A number a
paper does not give (or that could not be read) stays "—".

Examples::

    python run.py -m experiment=table_llamagen
    python scripts/make_tables.py results/runs/table_llamagen --published
    python scripts/make_tables.py --wandb my-entity/coolsd --name wandb_table
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from coolsd.io import atomic_write_bytes
from eval.metrics.intervals import FID_MIN_IMAGES, Bootstrap, paired_speedup
from eval.records.image_records import timed_records
from eval.records.legacy import current_config
from eval.records.run_json import read_run
from eval.report.evaluation_card import (FIELDS, KEY_FIELDS, NOT_RECORDED, conflicts, field_text, known,
                                         record_card, value_text)
from eval.report.labels import (ALWAYS_NOTED, DECODER_LABELS, HEADLINE, STRENGTH, SWEEP_KEYS, canonical,
                                decoder_options, method_label)
from eval.report.run_table import CODE_MARK, CODE_NOTE, FID_KEYS, MIXED_MARK, MIXED_NOTE, TV_NOTE, marks

PUBLISHED_CSV = Path(__file__).resolve().parent / "published_numbers.csv"
PUBLISHED_TITLE = ("Published: COOL-SD paper (arXiv 2601.09212) main table, as reported; not measured here "
                   "(FID: LANTERN's evaluation code, i.e. the clean protocol)")
REPORTED_TITLE = ("Reported, not reproduced: methods this harness cannot implement faithfully from what is public, "
                  "with their papers' numbers as reported (never measured here; each paper against its own AR)")
MISSING = "—"


@dataclass(frozen=True)
class Column:
    """A metric column: ``key`` in ``per_decoder``, its title (with unit), format, and which way is better."""

    key: str
    title: str
    fmt: str
    better: str | None  # "max", "min" or None (a diagnostic: never bold)


COLUMNS = (
    Column("num_images", "N (timed)", "count", None),
    Column("clip_score", "CLIP score", "{:.4f}", "max"),
    Column("fid", "FID", "{:.2f}", "min"),
    Column("kid", "KID", "{:.4f}", "min"),
    Column("image_reward", "ImageReward", "{:.4f}", "max"),
    Column("hps_v2", "HPSv2.1", "{:.4f}", "max"),
    Column("fid_classifier", "FID (classifier features)", "{:.2f}", "min"),
    Column("kid_classifier", "KID (classifier features)", "{:.4f}", "min"),
    Column("fid_random_conv", "FID (random-conv features, not FID)", "{:.3f}", "min"),
    Column("class_accuracy", "class accuracy", "{:.3f}", "max"),
    Column("mean_accepted_length", "accepted length (tokens/forward)", "{:.2f}", "max"),
    Column("latency_s", "latency (s/image)", "latency", "min"),
    Column("speedup", "speedup (×)", "{:.2f}×", "max"),
    Column("tv_per_step", "TV per step", "{:.4f}", None),
    Column("tv_per_token", "TV per token", "{:.4f}", None),
    Column("throughput_img_s", "throughput (images/s, batched)", "{:.2f}", "max"),
    Column("batch_speedup", "speedup at batch > 1 (×)", "{:.2f}×", "max"),
    Column("peak_mem_mb", "peak GPU memory (MiB)", "{:.0f}", None),
)
#: columns shown only when asked for (``--columns``): what a paper's systems table needs beside the main one
OPTIONAL_COLUMNS = ("throughput_img_s", "batch_speedup", "peak_mem_mb")
#: the text columns of the "reported" table (``published_numbers.csv`` rows with a ``reason``), around its metrics
REPORTED_BEFORE = (Column("venue", "venue / arXiv", "text", None), Column("benchmark", "benchmark", "text", None))
REPORTED_AFTER = (Column("source_table", "source", "text", None), Column("reason", "why not reproduced", "text", None))
REPORTED_TEXT = tuple(c.key for c in (*REPORTED_BEFORE, *REPORTED_AFTER))
BIASED = "†"
INTERVAL_KEYS = tuple(c.key for c in COLUMNS if c.fmt != "count")
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
DEFAULT_COLUMN_KEYS = tuple(k for k in COLUMN_KEYS if k not in OPTIONAL_COLUMNS)
PROTOCOLS = {  # fid_protocol of a run (eval.metrics.FIDKID) -> what the caption says
    "clean": "clean protocol (LANTERN's evaluation, the paper's: centre crop, LANCZOS to 256 px, clean-fid "
             "mode=\"clean\")",
    "torch_fidelity": "torch_fidelity protocol (bicubic crop, torch-fidelity's resize; not comparable with the "
                      "paper's clean protocol)",
}

MODEL_LABELS = {  # config name -> the paper's name; the order is the tables' model order
    "lumina_mgpt_768": "Lumina-mGPT 7B (768 px)",
    "anole_7b": "Anole 7B (512 px)",
    "llamagen_t2i_512": "LlamaGen-XL (T2I, 512 px)",
    "llamagen_t2i_512_lantern": "LlamaGen-XL (T2I, 512 px, LANTERN sampling)",
    "llamagen_t2i_256": "LlamaGen-XL (T2I, 256 px)",
    "llamagen_t2i_256_lantern": "LlamaGen-XL (T2I, 256 px, LANTERN sampling)",
    "janus_pro_7b": "Janus-Pro-7B",
    "janus_pro_1b": "Janus-Pro-1B",
    "tiny": "tiny LlamaGen (random weights)",
    "lookup": "lookup model (synthetic)",
}

@dataclass(frozen=True)
class Measurement:
    """One decoder measured by one run (a ``per_decoder`` entry) with what identifies it."""

    model: str
    decoder: str
    options: dict[str, Any]  # the decoder's config minus bookkeeping (drafter included)
    metrics: dict[str, Any]
    started: str
    source: str  # the run's folder relative to the scanned root, or wandb:<entity>/<project>/<id>
    environment: dict[str, Any]
    world_size: int
    experiment: str | None
    card: dict[str, Any] = field(default_factory=dict)  # the run's evaluation card (eval.report.evaluation_card)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.model, self.decoder, canonical(self.options)


# ----------------------------------------------------------------------------------------------- reading


def find_records(roots: Sequence[str | Path]) -> list[tuple[dict[str, Any], str]]:
    """(record, source) for every ``run.json`` under each root (searched recursively), in path order."""
    found = []
    for root in map(Path, roots):
        if not root.exists():
            raise FileNotFoundError(f"result folder not found: {root} (a run.py output or multirun folder)")
        name = root.resolve().name
        if root.is_file():
            items = [(root, root.resolve().parent.name)]
        else:
            paths = [p for p in sorted(root.rglob("run.json"))  # not W&B's local copies of them
                     if "wandb" not in p.relative_to(root).parts]
            items = [(p, f"{name}/{p.parent.relative_to(root).as_posix()}".removesuffix("/.")) for p in paths]
        for path, source in items:
            try:
                record = read_run(path)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}); delete it or rerun that run") from err
            record["_folder"] = str(path.resolve().parent)  # where its records are (shared_speedups)
            found.append((record, source))
    return found


def shared_speedups(records: Sequence[tuple[dict[str, Any], str]]) -> None:
    """Fill in the speedup of every row whose AR was timed in another row of its table (``eval.ar_timing=table``)
    and whose own run ended before that row had timed AR: AR's per-prompt latencies from the timing row's records
    (found among the folders read, else at the path the row recorded) over the row's own, paired by prompt
    (``eval.metrics.intervals.paired_speedup``, the row's bootstrap settings). ``speedup_ar_from`` names the
    timing row; a row whose timing row is not here or not done keeps no speedup (``speedup_pending``)."""
    timing_rows = {}
    for record, _ in records:
        t = record.get("ar_timing") or {}
        if t.get("mode") == "table" and t.get("timed_here") and record.get("_folder"):
            timing_rows[(t.get("key"), t.get("hardware"), t.get("num_timed"))] = Path(record["_folder"])
    for record, _ in records:
        t = record.get("ar_timing") or {}
        if t.get("mode") != "table" or t.get("timed_here", True) or not record.get("_folder"):
            continue
        folder = timing_rows.get((t.get("key"), t.get("hardware"), t.get("num_timed")))
        if folder is None and t.get("timing_row") and Path(t["timing_row"]).is_dir():
            folder = Path(t["timing_row"])
        ar = timed_records(folder, "ar", int(t["num_timed"])) if folder is not None else None
        settings = record.get("uncertainty") or {}
        boot = Bootstrap(**{k: settings[k] for k in ("resamples", "seed", "level") if k in settings})
        for name, metrics in (record.get("per_decoder") or {}).items():
            if name == "ar":
                continue
            if ar is None:
                metrics.setdefault("speedup_pending", str(folder or t.get("timing_row")))
                continue
            mine = timed_records(Path(record["_folder"]), name, int(t["num_timed"]))
            if "speedup" not in metrics and mine:
                metrics.update(paired_speedup({r["index"]: r["stats"]["latency_s"] for r in ar},
                                              {r["index"]: r["stats"]["latency_s"] for r in mine}, boot))
            metrics["speedup_ar_from"] = str(folder)


def wandb_records(project: str, api: Any = None) -> list[tuple[dict[str, Any], str]]:
    """(record, source) for every run of a W&B project (``entity/project``).

    A run's own ``run.json`` (saved by ``eval.run.loggers.WandbLogger``) is used when present; otherwise the
    record is rebuilt from the run's config, the ``metrics/*`` summary and the logged ``per_decoder`` table.
    """
    if api is None:
        import wandb

        api = wandb.Api()
    found = []
    for run in api.runs(project):
        source = "wandb:" + "/".join(run.path)
        names = {f.name for f in run.files()}
        with tempfile.TemporaryDirectory() as tmp:
            if "run.json" in names:
                run.file("run.json").download(root=tmp, replace=True).close()
                found.append((read_run(Path(tmp) / "run.json"), source))
                continue
            found.append((record_from_wandb_summary(run, Path(tmp)), source))
    return found


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """W&B's scalar columns back to ``run.json`` keys: ``<key>_ci_lo``/``_ci_hi`` -> ``<key>_ci`` (the
    comparisons ``vs_<b>/...`` stay flat: the tables do not read them)."""
    out = {k: v for k, v in flat.items() if not k.endswith(("_ci_lo", "_ci_hi"))}
    for key in flat:
        if key.endswith("_ci_lo") and "/" not in key:
            base = key.removesuffix("_lo")
            lo, hi = flat[key], flat.get(base + "_hi")
            out[base] = [lo, hi] if lo is not None and hi is not None else None
    return out


def record_from_wandb_summary(run: Any, tmp: Path) -> dict[str, Any]:
    """A ``run.json``-like record from a W&B run that has no ``run.json`` file."""
    summary, config = dict(run.summary), dict(run.config)
    decoder = summary.get("decoder") or config.get("decoder", {}).get("name", "unknown")
    metrics = unflatten({k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("metrics/")})
    per_decoder = {decoder: metrics}
    table = summary.get("per_decoder")
    if isinstance(table, dict) and table.get("path"):
        run.file(table["path"]).download(root=str(tmp), replace=True).close()
        data = json.loads((tmp / table["path"]).read_text())
        columns = data["columns"]
        per_decoder = {row[0]: unflatten({c: v for c, v in zip(columns[1:], row[1:]) if v is not None})
                       for row in data["data"]}
    model_target = str(config.get("model", {}).get("_target_", "unknown"))
    metadata = getattr(run, "metadata", None) or {}
    return {
        "decoder": decoder,
        "model": summary.get("model") or model_target.rsplit(".", 1)[-1],
        "metrics": metrics,
        "per_decoder": per_decoder,
        "config": current_config(config),
        "environment": {"gpu": metadata.get("gpu"), "processor": metadata.get("cpu"),
                        "cpu_count": metadata.get("cpu_count"), "torch": None},
        "started": str(getattr(run, "created_at", "") or ""),
        "world_size": 1,
    }


def compare_overrides(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The overrides a run's ``compare`` set gave suite entry ``name`` (``eval.run.suite.select_decoders``: e.g.
    ``compare=jacobi`` runs SJD at the family's window, not the suite's), {} for none."""
    mode = config.get("compare")
    sets = config.get("compare_sets") or {}
    if mode == "auto":
        mode = "all"
    chosen = sets.get(mode) if isinstance(mode, str) else None
    return dict((chosen or {}).get(name) or {}) if isinstance(chosen, dict) else {}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dictionaries key by key (OmegaConf.merge's rule)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def measurements(records: Iterable[tuple[dict[str, Any], str]]) -> list[Measurement]:
    """One ``Measurement`` per ``per_decoder`` entry of every record."""
    out = []
    for record, source in records:
        missing = [k for k in ("decoder", "per_decoder", "config") if k not in record]
        if missing:
            raise ValueError(f"run record {source} lacks {missing}: not a run.json written by run.py")
        config = record["config"]
        card = record_card(record)
        for name, metrics in record["per_decoder"].items():
            if name == record["decoder"]:
                decoder_cfg = config.get("decoder", {})
            else:
                decoder_cfg = merged(config.get("suite", {}).get(name, {"name": name}),
                                     compare_overrides(config, name))
            out.append(Measurement(
                model=record.get("model") or "unknown",
                decoder=str(decoder_cfg.get("name") or name),  # the method: suite entries name variants of it
                options=decoder_options(decoder_cfg),
                metrics=dict(metrics),
                started=str(record.get("started") or ""),
                source=source,
                environment=dict(record.get("environment") or {}),
                world_size=int(record.get("world_size") or 1),
                experiment=config.get("experiment_name"),
                card=card,
            ))
    return out


def started_at(m: Measurement) -> dt.datetime:
    """``started`` as an aware datetime (records without one sort first)."""
    try:
        t = dt.datetime.fromisoformat(m.started)
    except ValueError:
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def deduplicate(rows: Sequence[Measurement]) -> tuple[list[Measurement], list[str]]:
    """Keep the newest measurement of each row; notes say what was dropped."""
    groups: dict[tuple, list[Measurement]] = {}
    for m in rows:
        groups.setdefault(m.key, []).append(m)
    varying = varying_options(rows)  # duplicates share their options, so these are the table's labels
    kept, notes = [], []
    for group in groups.values():  # AR: the newest with a latency (a row that did not time AR has none)
        group = sorted(group, key=lambda m: (m.decoder != "ar" or "latency_s" in m.metrics, started_at(m), m.source))
        newest = group[-1]
        kept.append(newest)
        if len(group) == 1:
            continue
        label = method_label(newest.decoder, newest.options, varying[newest.decoder])
        where = f"{model_label(newest.model)}, {label}"
        if newest.decoder == "ar":
            timed = sum("latency_s" in m.metrics for m in group)
            of = f"{len(group)} AR measurements" if timed in (0, len(group)) else \
                f"{timed} AR measurements that timed AR (of {len(group)}: eval.ar_timing=table times it in one row)"
            notes.append(f"{where}: every run measures AR as its speedup denominator; the AR row is the "
                         f"newest of {of} ({newest.source}).")
        else:
            dropped = ", ".join(m.source for m in group[:-1])
            notes.append(f"{where}: {len(group)} runs of the same configuration; kept the newest "
                         f"({newest.source}), dropped {dropped}.")
    return kept, notes


# ------------------------------------------------------------------------------------------------ labels


def model_label(model: str) -> str:
    return MODEL_LABELS.get(model, model)


def model_order(model: str) -> tuple[int, str]:
    names = list(MODEL_LABELS)
    return (names.index(model), "") if model in names else (len(names), model)


def sort_value(value: Any) -> tuple:
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, canonical(value))


def varying_options(rows: Sequence[Measurement]) -> dict[str, list[str]]:
    """For each decoder: the non-headline options whose values differ between its rows of some model.

    Taken per model, then united over models, so that one method keeps one label in every model group
    (LANTERN++ on its per-model published tree is "LANTERN++ k=10, λ=5" for LlamaGen and Lumina-mGPT alike).
    """
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in rows:
        groups.setdefault((m.model, m.decoder), []).append(m)
    varying: dict[str, set[str]] = {}
    for (_, decoder), group in groups.items():
        shown = {*HEADLINE.get(decoder, ()), *ALWAYS_NOTED.get(decoder, ())}
        keys = {k for m in group for k in m.options} - shown
        varying.setdefault(decoder, set()).update(
            k for k in keys if len({canonical(m.options.get(k)) for m in group}) > 1)
    return {decoder: sorted(keys) for decoder, keys in varying.items()}


# ----------------------------------------------------------------------------------------------- frames


def sweep_keys(rows: Sequence[Measurement]) -> dict[str, str | None]:
    """For each decoder: the option its rows sweep — the first of δ, λ, k, draft length (``SWEEP_KEYS``) whose
    value differs between its rows of some model — else its relaxation strength (δ, λ), else None. A curve
    joins the rows that agree on every other option, in the order of this one."""
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in rows:
        groups.setdefault((m.model, m.decoder), []).append(m)
    varying: dict[str, set[str]] = {}
    for (_, decoder), group in groups.items():
        varying.setdefault(decoder, set()).update(
            k for k in SWEEP_KEYS if len({canonical(m.options.get(k)) for m in group}) > 1)
    out = {}
    for decoder in {m.decoder for m in rows}:
        swept = [k for k in SWEEP_KEYS if k in varying.get(decoder, set())]
        out[decoder] = swept[0] if swept else STRENGTH.get(decoder)
    return out


def measured_frame(rows: Sequence[Measurement]) -> pd.DataFrame:
    """One row per kept measurement: labels, raw metrics and their intervals, provenance, in table order."""
    varying = varying_options(rows)
    swept = sweep_keys(rows)
    records = []
    order = list(DECODER_LABELS)
    for m in rows:
        noted = varying[m.decoder]
        labelled = (*HEADLINE.get(m.decoder, ()), *ALWAYS_NOTED.get(m.decoder, ()), *noted)
        key = swept[m.decoder]
        strength = m.options.get(key) if key else None
        records.append({
            "kind": "measured",
            "model": m.model,
            "model_label": model_label(m.model),
            "method": method_label(m.decoder, m.options, noted) + marks(m.metrics),
            "curve": method_label(m.decoder, m.options, noted, skip=(key,) if key else ()),
            "decoder": m.decoder,
            "strength": strength if isinstance(strength, (int, float)) and not isinstance(strength, bool) else None,
            "strength_key": key,
            "_order": (model_order(m.model), order.index(m.decoder) if m.decoder in order else len(order),
                       m.decoder, tuple(sort_value(m.options.get(k)) for k in labelled)),
            **{k: m.metrics.get(k) for k in COLUMN_KEYS},
            **{f"{k}_ci": interval(m.metrics.get(f"{k}_ci")) for k in INTERVAL_KEYS},
            "fid_protocol": m.metrics.get("fid_protocol"),
            "speedup_ar_from": m.metrics.get("speedup_ar_from"),
            "fid_num_images": m.metrics.get("fid_num_images"),
            "num_timed": m.metrics.get("num_timed"),
            "tv_measured": m.metrics.get("tv_measured") is not False,  # False: no analytic TV (SJD-SV, PathRelax)
            "hardware": hardware(m.environment, m.world_size),
            "torch": m.environment.get("torch"),
            "started": m.started,
            "source": m.source,
            "experiment": m.experiment,
            "options": json.dumps(m.options, sort_keys=True, default=str),
            "card": json.dumps(m.card),
        })
    frame = pd.DataFrame.from_records(records)
    if frame.empty:
        return frame
    clash = frame.duplicated(["model", "method"], keep=False)  # e.g. two drafters whose folders share a name
    frame.loc[clash, "method"] = frame.loc[clash, "method"] + " [" + frame.loc[clash, "source"] + "]"
    return frame.sort_values("_order", kind="stable").reset_index(drop=True)


def interval(value: Any) -> tuple[float, float] | None:
    """A ``run.json`` interval ``[lo, hi]`` as a tuple (None when missing or not finite)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or any(v is None for v in value):
        return None
    lo, hi = float(value[0]), float(value[1])
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def published_frame(path: Path = PUBLISHED_CSV) -> pd.DataFrame:
    """The published numbers (one row per model and method), in the measured frame's columns; ``kind`` is
    "published" (a method the harness reproduces: it names a ``decoder``) or "reported" (it gives a ``reason``
    why the method is not reproduced)."""
    table = pd.read_csv(path, keep_default_na=True)
    order = list(DECODER_LABELS)
    for key in ("decoder", *REPORTED_TEXT):
        if key not in table:
            table[key] = None
    reported = table["reason"].notna()
    if (reported & table["decoder"].notna()).any() or (~reported & table["decoder"].isna()).any():
        bad = table.loc[reported == table["decoder"].notna(), "method"].tolist()
        raise ValueError(f"{path}: a row names either a decoder (a reproduced method) or a reason (reported only), "
                         f"never both or neither: {bad}")
    table["kind"] = ["reported" if r else "published" for r in reported]
    table["model_label"] = table["model"]
    decoders = table["decoder"].fillna("")
    table["_order"] = [(i, order.index(d) if d in order else len(order), d, (j,) if r else ())  # reported: CSV order
                       for j, (i, d, r) in enumerate(zip(pd.factorize(table["model"])[0], decoders, reported))]
    for key in (*COLUMN_KEYS, *(f"{k}_ci" for k in INTERVAL_KEYS), "num_timed", "fid_num_images"):
        if key not in table:
            table[key] = None
    table = table.astype(object).where(table.notna(), None)
    return table.sort_values("_order", kind="stable").reset_index(drop=True)


def hardware(env: dict[str, Any], world_size: int = 1) -> str:
    """``NVIDIA H100 80GB HBM3`` (``8× …`` for torchrun jobs) or ``CPU x86_64, 1 thread``."""
    if env.get("gpu"):
        return f"{world_size}× {env['gpu']}" if world_size > 1 else str(env["gpu"])
    threads = env.get("torch_threads")
    cpu = f"CPU {env.get('processor') or 'unknown'}"
    return f"{cpu}, {threads} thread{'s' if threads != 1 else ''}" if threads else cpu


# ------------------------------------------------------------------------------------------------ tables


def missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def number_text(column: Column, value: float, like: float | None = None) -> str:
    """A number in the column's format (latency: 3 decimals under 1 s, else 2, decided by ``like``)."""
    if column.fmt == "latency":
        return f"{value:.3f}" if (value if like is None else like) < 1 else f"{value:.2f}"
    return column.fmt[: column.fmt.rindex("}") + 1].format(value)


def fid_biased(row: Any) -> bool:
    """FID over fewer than ``FID_MIN_IMAGES`` images (its images, else the row's)."""
    n = row.get("fid_num_images")
    n = row.get("num_images") if missing(n) else n
    return not missing(n) and n < FID_MIN_IMAGES


def format_value(column: Column, row: Any) -> str:
    """``3.33 ± 0.02``, ``2.73 ± 0.03×``, ``21.03 ± 0.31†``, ``5,000 (1,000)`` or "—"."""
    value = row.get(column.key)
    if missing(value):
        return MISSING
    if column.fmt == "text":
        return str(value)
    if column.fmt == "count":
        timed = row.get("num_timed")
        text = f"{int(value):,}"
        return text if missing(timed) or int(timed) == int(value) else f"{text} ({int(timed):,})"
    text = number_text(column, value)
    ci = interval(row.get(f"{column.key}_ci"))
    if ci is not None:
        half = (ci[1] - ci[0]) / 2
        shown = number_text(column, half, like=value)
        text += " ± " + (f"{half:.1g}" if half > 0 and float(shown) == 0 else shown)
    text += "" if column.fmt == "latency" else column.fmt[column.fmt.rindex("}") + 1:]
    return text + BIASED if column.key in FID_KEYS and fid_biased(row) else text


def significantly_best(values: dict[str, float], intervals: dict[str, tuple[float, float] | None],
                       better: str) -> set[str]:
    """{the best method} if its interval and the runner-up's do not overlap, else {} (also on ties and when
    either has no interval)."""
    if len(values) < 2:
        return set()
    ranked = sorted(values, key=lambda m: values[m], reverse=better == "max")
    best, runner_up = ranked[0], ranked[1]
    a, b = intervals.get(best), intervals.get(runner_up)
    if values[best] == values[runner_up] or a is None or b is None:
        return set()
    return {best} if (a[0] > b[1] if better == "max" else a[1] < b[0]) else set()


@dataclass(frozen=True)
class Cell:
    text: str
    bold: bool


@dataclass(frozen=True)
class TableRow:
    model_label: str
    method: str
    cells: tuple[Cell, ...]
    first_of_model: bool


def layout(frame: pd.DataFrame, columns: Sequence[Column], every_method: bool = True) -> list[TableRow]:
    """Rows grouped by model, every method of any model in every group ("—" where not measured; with
    ``every_method=False``, as for published numbers, only a model's own rows); bold the best value of a column
    when it is significantly better than the runner-up (``significantly_best``)."""
    if frame.empty:
        return []
    methods = frame.drop_duplicates("method").sort_values("_order", kind="stable")
    method_rank = {m: order[1:] for m, order in zip(methods["method"], methods["_order"])}
    rows = []
    for model, group in frame.groupby("model_label", sort=False):
        by_method = {r["method"]: r for _, r in group.iterrows()}
        texts = {m: [format_value(c, row) for c in columns] for m, row in by_method.items()}
        best = []
        for j, column in enumerate(columns):
            present = [m for m in by_method if texts[m][j] != MISSING]
            if column.better is None:
                best.append(set())
                continue
            best.append(significantly_best({m: float(by_method[m][column.key]) for m in present},
                                           {m: interval(by_method[m].get(f"{column.key}_ci")) for m in present},
                                           column.better))
        ordered = sorted(set(by_method) | (set(method_rank) if every_method else set()),
                         key=lambda m: (method_rank[m], m))
        for i, method in enumerate(ordered):
            cells = tuple(Cell(texts[method][j], method in best[j]) if method in by_method
                          else Cell(MISSING, False) for j in range(len(columns)))
            rows.append(TableRow(model, method, cells, i == 0))
    return rows


def present_columns(frames: Sequence[pd.DataFrame], wanted: Sequence[str]) -> list[Column]:
    """The wanted columns that at least one row of the frames reports."""
    by_key = {c.key: c for c in COLUMNS}
    unknown = [k for k in wanted if k not in by_key]
    if unknown:
        raise ValueError(f"--columns: unknown {unknown}; allowed: {', '.join(COLUMN_KEYS)}")
    return [by_key[k] for k in wanted
            if any(not f.empty and k in f and f[k].notna().any() for f in frames)]


def caption(frame: pd.DataFrame, name: str) -> str:
    """Images per method, latency sample, hardware and torch version, per model when they differ."""
    parts = []
    for model, group in frame.groupby("model_label", sort=False):
        images = sorted({int(n) for n in group["num_images"].dropna()})
        timed = sorted({int(n) for n in group["num_timed"].dropna()})
        text = f"{span(images)} image{'s' if images != [1] else ''} per method"
        if timed and timed != images:
            text += f" (latency over the first {span(timed)})"
        hw = " / ".join(sorted({h for h in group["hardware"].dropna()}))
        versions = " / ".join(sorted({str(t) for t in group["torch"].dropna()}))
        text += f", {hw or 'unknown hardware'}, torch {versions or 'unknown'}"
        parts.append((model, text))
    runs = frame["source"].nunique()
    if len({t for _, t in parts}) == 1:
        body = parts[0][1][0].upper() + parts[0][1][1:]
    else:
        body = "; ".join(f"{m}: {t}" for m, t in parts)
    across = " (rows come from different runs: compare speedups, not latencies)" if runs > 1 else ""
    return (f"{name}: measured with this harness ({runs} run{'s' if runs != 1 else ''}). {body}. "
            f"Speedup = AR latency / method latency, both from the same run{across}.{protocol_text(frame)}")


def protocol_text(frame: pd.DataFrame) -> str:
    """The FID/KID protocol of the rows that report FID or KID ("" when none does)."""
    quality = [c for c in ("fid", "kid") if c in frame]
    rows = frame[frame[quality].notna().any(axis=1)] if quality else frame.iloc[0:0]
    if rows.empty:
        return ""
    recorded = rows["fid_protocol"] if "fid_protocol" in rows else pd.Series([None] * len(rows), dtype=object)
    counts = recorded.fillna("not recorded").value_counts(sort=False)
    if len(counts) > 1:
        parts = ", ".join(f"{p} ({n} row{'s' if n != 1 else ''})" for p, n in counts.items())
        return f" FID/KID protocols differ between rows: {parts}; their FIDs are not comparable."
    protocol = counts.index[0]
    if protocol == "not recorded":
        return " FID/KID protocol not recorded by these runs (runs that predate fid_protocol used torch_fidelity's)."
    return f" FID/KID: {PROTOCOLS.get(protocol, protocol)}."


class UsageError(ValueError):
    """A request that cannot be served as given; the message says what to pass instead."""


class ProtocolMismatch(UsageError):
    """Rows of one model measured under different evaluation protocols (their cards' ``card_key`` differ)."""


@dataclass(frozen=True)
class CardRow:
    """A measured row's evaluation card and what names the row in notes and errors."""

    model: str
    method: str
    source: str
    card: dict[str, Any]


def card_rows(frame: pd.DataFrame) -> list[CardRow]:
    """The card of every row of a measured frame (rows without one, e.g. frames built by hand, are left out)."""
    if frame.empty or "card" not in frame:
        return []
    return [CardRow(r["model_label"], r["method"], r["source"], json.loads(r["card"]))
            for _, r in frame.iterrows() if isinstance(r["card"], str)]


def by_model(rows: Sequence[CardRow]) -> dict[str, list[CardRow]]:
    groups: dict[str, list[CardRow]] = {}
    for row in rows:
        groups.setdefault(row.model, []).append(row)
    return groups


def protocol_conflicts(rows: Sequence[CardRow]) -> dict[str, list[str]]:
    """{model: the ``card_key`` fields on which some of its rows disagree} (models without any left out)."""
    out = {}
    for model, group in by_model(rows).items():
        fields = {f for a in group for b in group for f in conflicts(a.card, b.card)}
        if fields:
            out[model] = [f for f in KEY_FIELDS if f in fields]
    return out


def mismatch_message(rows: Sequence[CardRow], found: dict[str, list[str]]) -> str:
    """Which fields differ, with each value's runs and rows, and what to do."""
    parts = []
    for model, fields in found.items():
        group = by_model(rows)[model]
        for f in fields:
            where: dict[str, dict[str, list[str]]] = {}
            for row in group:
                if known(row.card.get(f)):
                    where.setdefault(value_text(row.card[f]), {}).setdefault(row.source, []).append(row.method)
            values = "; ".join(f"{value!r} in " + ", ".join(f"{src} ({', '.join(methods)})"
                                                              for src, methods in runs.items())
                               for value, runs in where.items())
            parts.append(f"{model}, {f}: {values}")
    return ("rows measured under different evaluation protocols would share a table (their evaluation cards differ; "
            "eval/report/evaluation_card.py says which fields must agree): " + " | ".join(parts) + ". Rerun the "
            "odd runs with the others' protocol, make separate tables of them (scripts/make_tables.py <their folders> --name <name>), "
            "or pass --mixed-protocols to keep them in one table with each row's differing fields in its notes"
            + ("; rows that differ only in their GPU: --mixed-hardware keeps them, and the caption says that their "
               "latencies come from different GPUs." if any("GPU" in fs for fs in found.values()) else "."))


def check_protocols(frame: pd.DataFrame, mixed: bool = False, mixed_hardware: bool = False) -> dict[str, list[str]]:
    """The fields on which each model's rows disagree ({} when they agree); raises ``ProtocolMismatch`` on any
    unless ``mixed`` (any field) or, for the ``GPU`` field alone, ``mixed_hardware``: a latency column of two GPU
    models is refused unless told."""
    rows = card_rows(frame)
    found = protocol_conflicts(rows)
    blocking = {model: [f for f in fields if not (mixed_hardware and f == "GPU")] for model, fields in found.items()}
    blocking = {model: fields for model, fields in blocking.items() if fields}
    if blocking and not mixed:
        raise ProtocolMismatch(mismatch_message(rows, blocking))
    return found


def values_text(f: str, values: Sequence[Any]) -> str | None:
    """The rows' values of one field: each known value once (``a / b``), noting rows that lack it; None when
    the field applies to no row."""
    stated = [v for v in values if known(v)]
    if not stated:
        return None if all(v is None for v in values) else field_text(f, NOT_RECORDED)
    shown = list(dict.fromkeys(value_text(v) for v in stated))
    text = field_text(f, stated[0]) if len(shown) == 1 else f"{f}: " + " / ".join(shown)
    return text + (" (not every row)" if len(stated) < len(values) else "")


def card_notes(frame: pd.DataFrame, mixed: dict[str, list[str]] | None = None) -> list[str]:
    """The table's evaluation card: the fields every row shares, then per model the fields that differ between
    models, then (``mixed``: {model: differing key fields}) each such row's values of them."""
    rows = card_rows(frame)
    if not rows:
        return []
    mixed = mixed or {}
    shared, unrecorded = [], []
    for f in FIELDS:
        values = [r.card.get(f) for r in rows]
        if any(v != values[0] for v in values):
            continue
        if values[0] == NOT_RECORDED:
            unrecorded.append(f)
        elif values[0] is not None:
            shared.append(field_text(f, values[0]))
    common = {f for f in FIELDS if all(r.card.get(f) == rows[0].card.get(f) for r in rows)}
    notes = []
    text = "; ".join(shared)
    if unrecorded:
        text += ("; " if text else "") + ("not recorded by these runs (their run.json lacks the eval or model "
                                          "config): ") + ", ".join(unrecorded)
    if text:
        notes.append(f"Evaluation card of every row (eval/report/evaluation_card.py; run.json `evaluation_card`): "
                     f"{text}.")
    for model, group in by_model(rows).items():
        own = [values_text(f, [r.card.get(f) for r in group]) for f in FIELDS
               if f not in common and f not in mixed.get(model, ())]
        own = [t for t in own if t]
        if own:
            notes.append(f"Evaluation card, {model}: " + "; ".join(own) + ".")
        for row in group if model in mixed else ():
            own = [field_text(f, row.card.get(f)) for f in mixed[model]]
            notes.append(f"Evaluation card, {model}, {row.method} ({row.source}): " + "; ".join(own) + ".")
    return notes


def span(values: Sequence[int]) -> str:
    if not values:
        return "?"
    return f"{values[0]:,}" if len(values) == 1 else f"{values[0]:,}–{values[-1]:,}"


def arrow(column: Column) -> str:
    return {"max": " ↑", "min": " ↓"}.get(column.better or "", "")


def markdown(rows: Sequence[TableRow], columns: Sequence[Column], title: str, notes: Sequence[str]) -> str:
    lines = [f"**{title}**", "",
             "| model | method | " + " | ".join(c.title + arrow(c) for c in columns) + " |",
             "|:--|:--|" + "|".join(":--" if c.fmt == "text" else "--:" for c in columns) + "|"]
    for row in rows:
        cells = [f"**{c.text}**" if c.bold else c.text for c in row.cells]
        model = row.model_label if row.first_of_model else ""
        lines.append(f"| {model} | {row.method} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def tex_escape(text: str) -> str:
    """Plain text -> LaTeX: escape specials, then typeset the Greek letters and symbols the labels use."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append(r"\textbackslash{}")
        elif ch in "_%&#${}":
            out.append("\\" + ch)
        else:
            out.append(ch)
    text = "".join(out)
    for plain, tex in (("G*", "$G^*$"), ("δ", r"$\delta$"), ("λ", r"$\lambda$"), ("ν", r"$\nu$"),
                       ("μ", r"$\mu$"), ("×", r"$\times$"), ("—", "---"), ("–", "--"), ("↑", r"$\uparrow$"),
                       ("↓", r"$\downarrow$"), ("÷", r"$\div$"),
                       ("±", r"$\pm$"), ("†", r"$^\dagger$")):
        text = text.replace(plain, tex)
    return text


def latex(rows: Sequence[TableRow], columns: Sequence[Column], title: str, notes: Sequence[str],
          label: str) -> str:
    n = len(columns) + 1
    lines = ["% Generated by scripts/make_tables.py from run.json records; regenerate it, do not edit.",
             r"% Needs \usepackage{booktabs}.",
             r"\begin{table}[t]", r"\centering", r"\small",
             rf"\caption{{{tex_escape(title)}}}", rf"\label{{tab:{label}}}",
             rf"\begin{{tabular}}{{l{''.join('p{3cm}' if c.fmt == 'text' else 'r' for c in columns)}}}", r"\toprule",
             "Method & " + " & ".join(tex_escape(c.title + arrow(c)) for c in columns) + r" \\"]
    for row in rows:
        if row.first_of_model:
            group = rf"\multicolumn{{{n}}}{{l}}{{\textit{{{tex_escape(row.model_label)}}}}} \\"
            lines += [r"\midrule", group]
        cells = [rf"\textbf{{{tex_escape(c.text)}}}" if c.bold else tex_escape(c.text) for c in row.cells]
        lines.append(tex_escape(row.method) + " & " + " & ".join(cells) + r" \\")
    lines.append(r"\bottomrule")
    lines.append(r"\end{tabular}")
    if notes:
        lines += [r"\par\smallskip\footnotesize", *(tex_escape(n) + r"\par" for n in notes)]
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Tables:
    markdown: str
    latex: str
    csv: str


INTERVAL_NOTE = ("± = half the width of the 95 % interval (the CSV holds its ends; see eval/metrics/intervals.py for "
                 "which interval each metric gets); N = images per method (timed images for latency and speedup).")
BOLD_NOTE = ("Bold: the best value of its column and model, only where its 95 % interval does not overlap the "
             "runner-up's (a conservative test); values without an interval are never bold.")
BIAS_NOTE = (f"† FID over fewer than {FID_MIN_IMAGES:,} images: strongly biased upwards (the bias falls like "
             "1/N, so FIDs of different N are not comparable); compare KID, which is unbiased.")


def csv_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with every ``<key>_ci`` split into ``<key>_lo`` and ``<key>_hi`` beside its value."""
    out = frame.copy()
    for key in INTERVAL_KEYS:
        cis = [interval(v) for v in out[f"{key}_ci"]] if f"{key}_ci" in out else [None] * len(out)
        out[f"{key}_lo"] = [c[0] if c else None for c in cis]
        out[f"{key}_hi"] = [c[1] if c else None for c in cis]
    return out


def build_tables(measured: pd.DataFrame, notes: Sequence[str], name: str, wanted: Sequence[str],
                 published: pd.DataFrame | None = None, mixed_protocols: bool = False,
                 mixed_hardware: bool = False) -> Tables:
    """The measured table (and the published one beside it) as markdown, LaTeX and CSV text. Rows of one model
    with different evaluation cards raise ``ProtocolMismatch`` unless ``mixed_protocols`` (module doc)."""
    md, tex, frames = [], [], []
    if not measured.empty:
        mixed = check_protocols(measured, mixed_protocols, mixed_hardware)
        columns = present_columns([measured], wanted)
        rows = layout(measured, columns)
        all_notes = [*notes, INTERVAL_NOTE, BOLD_NOTE]
        if any(c.text.endswith(BIASED) for r in rows for c in r.cells):
            all_notes.append(BIAS_NOTE)
        if measured["method"].str.contains(MIXED_MARK.strip(), regex=False).any():
            all_notes.append(MIXED_NOTE)
        if measured["method"].str.contains(CODE_MARK.strip(), regex=False).any():
            all_notes.append(CODE_NOTE)
        if "tv_measured" in measured and not measured["tv_measured"].all():
            all_notes.append(TV_NOTE)
        shared = sorted({str(f) for f in measured.get("speedup_ar_from", pd.Series(dtype=object)).dropna()})
        if shared:
            all_notes.append("AR timed once per table and GPU kind (eval.ar_timing=table): the speedups of the rows "
                             "that did not time AR divide the AR latency timed in " + ", ".join(shared)
                             + " (same prompts, seeds and GPU kind; paired by prompt).")
        if any(c.text == MISSING for r in rows for c in r.cells):
            all_notes.append("— = not measured (no run of that method on that model, or the metric was not "
                             "computed); no value is filled in.")
        all_notes += card_notes(measured, mixed)
        title = caption(measured, name)
        gpus = {model: sorted({value_text(r.card.get("GPU")) for r in group if known(r.card.get("GPU"))})
                for model, group in by_model(card_rows(measured)).items() if "GPU" in mixed.get(model, ())}
        if gpus:
            title += (" Mixed hardware (--mixed-hardware): the latencies of one model's rows come from different GPUs ("
                      + "; ".join(f"{model}: {' / '.join(values)}" for model, values in gpus.items())
                      + "); compare speedups (each within its run), not latencies.")
        others = {model: [f for f in fields if f != "GPU"] for model, fields in mixed.items()}
        if any(others.values()):
            fields = ", ".join(dict.fromkeys(f for fs in others.values() for f in fs))
            title += (f" Mixed evaluation protocols (--mixed-protocols): rows of one model differ in {fields}; "
                      "the notes give each row's values, and those rows are not comparable in those respects.")
        md.append(markdown(rows, columns, title, all_notes))
        tex.append(latex(rows, columns, title, all_notes, name))
        frames.append(measured)
    if published is not None:
        reported = published[published["kind"] == "reported"]
        published = published[published["kind"] != "reported"]
        if not published.empty:
            columns = present_columns([published], wanted)
            rows = layout(published, columns, every_method=False)
            pub_notes = sorted({str(n) for n in published["note"].dropna()}) if "note" in published else []
            pub_notes.append("No intervals were published, so nothing is bold.")
            pub_notes.append("— = not reported in the paper.")
            md.append(markdown(rows, columns, PUBLISHED_TITLE, pub_notes))
            tex.append(latex(rows, columns, PUBLISHED_TITLE, pub_notes, f"{name}_published"))
            frames.append(published)
        if not reported.empty:
            columns = [*REPORTED_BEFORE, *present_columns([reported], wanted), *REPORTED_AFTER]
            rows = layout(reported, columns, every_method=False)
            rep_notes = sorted({str(n) for n in reported["note"].dropna()}) if "note" in reported else []
            rep_notes.append("— = not published, or not readable (abstract only); no value is filled in.")
            md.append(markdown(rows, columns, REPORTED_TITLE, rep_notes))
            tex.append(latex(rows, columns, REPORTED_TITLE, rep_notes, f"{name}_reported"))
            frames.append(reported)
    values = [c for k in COLUMN_KEYS for c in ((k,) if k == "num_images" else (k, f"{k}_lo", f"{k}_hi"))]
    keep = ["kind", "model", "model_label", "method", "decoder", "strength_key", "strength", *values,
            "num_timed", "fid_num_images", "fid_protocol", "hardware", "torch", "started", "source", "experiment",
            "options", "note", *REPORTED_TEXT]
    table = pd.concat([csv_frame(f).reindex(columns=keep) for f in frames], ignore_index=True)
    table = table.dropna(axis=1, how="all")
    return Tables("\n".join(md), "\n".join(tex), table.to_csv(index=False, lineterminator="\n"))


def output_folder(paths: Sequence[str | Path], out: str | Path | None) -> Path | None:
    """``--out`` if given, else the input folder (a ``run.json``: its folder; several: their deepest common
    folder); None without either."""
    if out is not None:
        return Path(out)
    if not paths:
        return None
    folders = [Path(p).resolve() if Path(p).is_dir() else Path(p).resolve().parent for p in paths]
    return Path(os.path.commonpath([str(f) for f in folders]))


def default_name(rows: Sequence[Measurement]) -> str:
    names = {m.experiment for m in rows if m.experiment}
    return names.pop() if len(names) == 1 else "table"


# --------------------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Written:
    """What ``write_tables`` wrote: the tables, the frame of measured rows (for ``eval.report.paper_plots``),
    counts."""

    tables: Tables
    measured: pd.DataFrame
    name: str
    out: Path
    records: int
    rows: int


def write_tables(paths: Sequence[str | Path], wandb: str | None = None, name: str | None = None,
                 out: str | Path | None = None, published: bool = False,
                 published_file: str | Path = PUBLISHED_CSV, columns: Sequence[str] = DEFAULT_COLUMN_KEYS,
                 mixed_protocols: bool = False, mixed_hardware: bool = False) -> Written:
    """Read the run records under ``paths`` (and of the W&B project ``wandb``), build the tables and write
    ``<out>/tables/<name>.{md,tex,csv}`` (``out`` defaults to the input folder, see ``output_folder``).
    ``mixed_protocols``: allow rows of one model with different evaluation cards (``build_tables``);
    ``mixed_hardware``: allow only their GPU to differ (the caption says so)."""
    records = find_records(paths)
    if wandb:
        records += wandb_records(wandb)
    shared_speedups(records)
    if not records and not published:
        raise UsageError(f"no run.json found under {list(paths) or '(no paths given)'}; run e.g. "
                         "`python run.py -m experiment=tiny_table` first, or pass --published for the "
                         "published table")
    kept, notes = deduplicate(measurements(records))
    name = name or default_name(kept)
    measured = measured_frame(kept)
    published_rows = published_frame(Path(published_file)) if published else None
    if published_rows is not None and not measured.empty:  # the published rows of the methods measured here,
        # and every reported-only row (a method the harness does not reproduce has no measured decoder)
        keep = published_rows["decoder"].isin(set(measured["decoder"])) | (published_rows["kind"] == "reported")
        published_rows = published_rows[keep].reset_index(drop=True)
    tables = build_tables(measured, notes, name, columns, published_rows, mixed_protocols, mixed_hardware)
    folder = output_folder(paths, out)
    if folder is None:
        raise UsageError("no result folder was given (--wandb or --published alone): say where to write with --out")
    for ext, text in (("md", tables.markdown), ("tex", tables.latex), ("csv", tables.csv)):
        atomic_write_bytes(folder / "tables" / f"{name}.{ext}", text.encode())
    return Written(tables=tables, measured=measured, name=name, out=folder, records=len(records), rows=len(kept))
