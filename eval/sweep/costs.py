"""GPU-hour estimate of a run before it is submitted: per-image latencies from a cited table, times its images.

The table (``eval/sweep/gpu_costs.csv``) gives one batch-1 latency per (basis, model config, decoder), each with its
``source``: ``paper`` = the papers' reported latencies (``eval/report/published_numbers.csv``; a decoder whose paper
gives only a speedup is the COOL-SD table's AR latency of that model divided by it), ``h200`` = this harness
measured eager on an H200 (``results/bench/h200/README.md``; LlamaGen-XL only), ``derived`` = no latency of the
model is published or measured, so its row scales another model's published time per forward by parameters and
forwards (GLM-Image; its source says how: a planning figure, not a GPU number). ``options`` narrows a row to
decoder configs with those values (``delta=2.0``); the most specific matching row wins. A decoder without a row
is costed at its model's AR latency (an upper bound for every speculative decoder with a trained drafter) and
named in the estimate.

One run generates every compared decoder's images (AR included), as README "Cost of a table" projects a table:
``warmup + timed`` images per decoder at batch 1, plus the other ``num_prompts - timed`` in batches at a
throughput gain ``g`` over batch 1 (``BATCH_GAIN``: AR's measured gain at batch 8 on the H200, taken for every
decoder and for ``eval.batch_size >= 8``; 1 below, an upper bound). With ``eval.reuse_ar`` AR's batched images
are made once per model, prompt set and seed: a sweep counts them in its first job only. With
``eval.ar_timing=table`` (the paper-table experiments) AR's timed images are made once per table (and GPU kind) as
well, in the row that claims them, so a sweep counts them in its first job only; the other rows make AR's
timed-subset images with its batched set (at the batched gain), or take them from the cache (``saved_hours``
says how much that saves). Model loading and
scoring (FID, CLIP, ImageReward) are not counted. An estimate, not a measurement.

Example: ``python scripts/prefetch.py --check -m experiment=table_llamagen`` prints one estimate per job.
"""
from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COSTS_CSV = Path(__file__).resolve().parent / "gpu_costs.csv"
BASES = ("paper", "h200", "derived")
#: images per second at batch >= BATCH_GAIN_FROM over batch 1, and where the number comes from
BATCH_GAIN = 7.4
BATCH_GAIN_FROM = 8
BATCH_GAIN_SOURCE = ("results/bench/h200/README.md: LlamaGen-XL AR at batch 8 made 7.4x its batch-1 images per "
                     "second (random weights, bf16, eager, H200); the drafters' gain on a GPU is not measured")


@dataclass(frozen=True)
class Cost:
    """One row of ``gpu_costs.csv``: a decoder's batch-1 seconds per image on one model, and its source."""

    basis: str
    models: tuple[str, ...]
    decoder: str
    options: tuple[tuple[str, str], ...]
    latency_s: float
    source: str


def load_costs(path: str | Path = COSTS_CSV) -> list[Cost]:
    """The cost table; each row must say its basis (``BASES``), a positive latency and a source."""
    rows = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            options = tuple(tuple(o.split("=", 1)) for o in row["options"].split(";") if o.strip())
            if row["basis"] not in BASES or not row["source"].strip() or float(row["latency_s"]) <= 0 \
                    or any(len(o) != 2 for o in options):
                raise ValueError(f"{path}:{i}: a row needs a basis in {BASES}, options key=value;..., a positive "
                                 f"latency_s and a source; got {row}")
            rows.append(Cost(row["basis"], tuple(row["models"].split("|")), row["decoder"], options,
                             float(row["latency_s"]), row["source"]))
    return rows


def _value(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _matches(config: Mapping[str, Any], options: Sequence[tuple[str, str]]) -> bool:
    for key, wanted in options:
        value = _value(config, key)
        try:
            if float(value) != float(wanted):
                return False
        except (TypeError, ValueError):
            if str(value) != wanted:
                return False
    return True


def latency(costs: Sequence[Cost], basis: str, model: str, decoder_cfg: Mapping[str, Any]) -> Cost | None:
    """The most specific row of ``basis`` for ``model`` (config name) and this decoder config, or None."""
    name = str(decoder_cfg.get("name"))
    rows = [c for c in costs if c.basis == basis and model in c.models and c.decoder == name
            and _matches(decoder_cfg, c.options)]
    return max(rows, key=lambda c: len(c.options), default=None)


@dataclass(frozen=True)
class Estimate:
    """GPU-hours of one job on one basis (``None``: no AR row for its model), the rows used, the decoders costed
    at AR's latency for want of a row; ``saved_hours``: what AR's timing once per table saved this job (0 where
    it times AR itself, or AR is timed in every row)."""

    basis: str
    gpu_hours: float | None
    used: dict[str, Cost] = field(default_factory=dict)
    at_ar: tuple[str, ...] = ()
    saved_hours: float = 0.0

    def text(self) -> str:
        if self.gpu_hours is None:
            return "-"
        return f"{self.gpu_hours:.1f}" + ("*" if self.at_ar else "")


def estimate(costs: Sequence[Cost], basis: str, model: str, decoder_cfgs: Mapping[str, Mapping[str, Any]],
             eval_cfg: Mapping[str, Any], ar_batched: bool = True, ar_timed: bool = True) -> Estimate:
    """GPU-hours of a run of ``decoder_cfgs`` (suite name -> plain config, AR included) on ``model`` with the
    images of ``eval_cfg`` (``num_prompts``, ``speed_prompts``, ``warmup``, ``batch_size``); ``ar_batched``:
    count AR's batched images (False when an earlier job of the sweep made them, ``eval.reuse_ar``); ``ar_timed``:
    count AR's timed images at batch 1 (False when an earlier job of the sweep times them for the table,
    ``eval.ar_timing=table``: this job then makes AR's timed-subset images batched, unless AR's batched images
    come from the cache too)."""
    ar = latency(costs, basis, model, {"name": "ar"})
    if ar is None:
        return Estimate(basis, None)
    n = int(eval_cfg.get("num_prompts", 1))
    timed = min(int(eval_cfg.get("speed_prompts") or n), n)
    gain = BATCH_GAIN if int(eval_cfg.get("batch_size", 1)) >= BATCH_GAIN_FROM else 1.0
    warmup = int(eval_cfg.get("warmup", 0))
    used, at_ar, seconds, saved = {}, [], 0.0, 0.0
    for name, cfg in decoder_cfgs.items():
        row = latency(costs, basis, model, cfg)
        if row is None:
            at_ar.append(name)
        used[name] = row or ar
        if str(cfg.get("name")) != "ar":
            seconds += used[name].latency_s * (warmup + timed + (n - timed) / gain)
            continue
        batched = (n - timed) if ar_batched else 0
        if ar_timed:
            seconds += ar.latency_s * (warmup + timed + batched / gain)
        else:  # its timed-subset images come batched (or from the cache, with the batched set)
            made = (batched + timed) / gain if ar_batched else 0.0
            seconds += ar.latency_s * made
            saved += ar.latency_s * (warmup + timed + batched / gain) - ar.latency_s * made
    return Estimate(basis, seconds / 3600.0, used, tuple(at_ar), saved / 3600.0)


def sources_text(estimates: Sequence[Estimate]) -> list[str]:
    """The lines that say where the numbers of ``estimates`` come from (each row used once)."""
    lines = [f"GPU-hours are an estimate: batch-1 latencies per image x images per decoder (eval/sweep/costs.py; table "
             f"{COSTS_CSV.name}); batched images at {BATCH_GAIN}x ({BATCH_GAIN_SOURCE}); model loading and scoring "
             "not counted; * = a decoder without a row, costed at its model's AR latency."]
    seen = set()
    for e in sorted(estimates, key=lambda e: BASES.index(e.basis)):  # stable: each basis's rows in job order
        for row in e.used.values():
            key = (row.basis, row.models, row.decoder, row.options)
            if key not in seen:
                seen.add(key)
                opts = "".join(f" {k}={v}" for k, v in row.options)
                lines.append(f"  [{row.basis}] {row.models[0]} {row.decoder}{opts}: {row.latency_s:g} s/image - "
                             f"{row.source}")
    return lines
