"""The claims experiment's data: method points with their per-image values, loaded from the runs' records, and
their bootstrap replicates (paired over prompts: one set of resampled prompt sets for every point of a regime)."""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from coolsd.io import atomic_write_bytes
from eval.metrics import intervals
from eval.records.image_records import load_records
from eval.records.run_json import current_record, read_run

PAPER_RATIOS = {1.1: 2.73 / 2.42, 2.0: 3.34 / 2.42}  # COOL-SD / vanilla SD accepted length, LlamaGen (paper)
HELD, NOT_HELD, INCONCLUSIVE, NOT_COMPARED = "held", "not held", "inconclusive", "not compared"
#: a metric whose non-inferiority tests had power below 0.8 at no difference (``statistics.verdict``)
UNDERPOWERED = "underpowered"
LEVEL = 0.95
#: non-inferiority margins of "no worse" statements, fixed in this file before the runs (``MARGIN_RATIONALE``):
#: FID within 10 % of the baseline's (C4, C2b; tested as the ratio FID_method ≤ 1.1 · FID_baseline on paired
#: replicates) and TV per token within 0.01 (C2b). ``claims.margins`` of the experiment config overrides them.
MARGINS = {"fid_relative": 0.10, "tv_per_token": 0.01}
#: why these margins (printed on the page); they were set before the data and are not tuned to it
MARGIN_RATIONALE = (
    "The margins were fixed in `eval/studies/claims/data.py` before the runs and are not tuned to the data. FID: the "
    "method's FID at most 10 % above the baseline's, tested as a ratio on paired replicates so that the baseline's "
    "own sampling error is carried (a fixed margin of 10 % of the baseline's *estimated* FID would be random, and "
    "biased: a low baseline estimate raises ΔFID and lowers the margin); relative because FID's scale depends on "
    "the feature space (here the shipped classifier's, not Inception's); 10 % as the stated order of the smallest "
    "FID gap the default run's 1,000-image intervals resolve (±2 on FID ≈ 10). TV per token: 0.01, a fifth of "
    "COOL-SD δ = 1.1's TV per token on the chain, for statements between two relaxed methods (C2b's \"≥\"; not C4, "
    "whose baseline is lossless).")



# --------------------------------------------------------------------------------------------- loading


@dataclass
class Point:
    """One method point of a regime: its config, per-image values and bootstrap replicates."""

    name: str
    label: str
    config: dict[str, Any]
    indices: list[int]
    committed: np.ndarray  # (N,) committed image tokens (num_tokens - 1)
    iterations: np.ndarray  # (N,) verify forwards
    tv_sum: np.ndarray  # (N,) summed one-step TV
    latency: dict[int, float]  # timed index -> seconds (batch 1)
    features: np.ndarray | None = None  # (N, D) classifier features
    est: dict[str, float] = field(default_factory=dict)
    reps: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def tokens(self) -> np.ndarray:
        """(N,) committed tokens including the first (the denominator of TV per token)."""
        return self.committed + 1

    @property
    def method(self) -> str:
        return str(self.config.get("name", self.name))


@dataclass
class Regime:
    name: str
    folder: Path
    record: dict[str, Any]
    points: dict[str, Point]
    resamples: int = 0

    @property
    def indices(self) -> list[int]:
        """The images every point generated (``load_regime`` checks that they are the same)."""
        return next(iter(self.points.values())).indices

    @property
    def num_images(self) -> int:
        return len(self.indices)


def _per_image(records: dict[int, dict], key: str, default: float = 0.0) -> np.ndarray:
    return np.array([float(records[i]["stats"].get(key, default)) for i in sorted(records)], dtype=np.float64)


def point_config(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The decoder config of point ``name`` in a run's config: the chosen decoder's, else its suite entry."""
    if name == config["decoder"]["name"]:
        return config["decoder"]
    return config["suite"].get(name) or config["decoder"]


def load_regime(folder: Path, features: bool = True, device: str = "cpu") -> Regime:
    """A regime's run: its ``run.json``, every point's per-image records and (``features``) the classifier
    features of its images, taken with the run's own FID metric config."""
    record = read_run(folder / "run.json")
    config = record["config"]
    labels = record.get("labels", {})
    points: dict[str, Point] = {}
    for name in record["per_decoder"]:
        recs = load_records(folder / "records", name)
        idx = sorted(recs)
        points[name] = Point(
            name=name, label=labels.get(name, name), config=point_config(config, name), indices=idx,
            committed=_per_image(recs, "num_tokens") - 1, iterations=_per_image(recs, "iterations"),
            tv_sum=_per_image(recs, "tv_sum"),
            latency={i: recs[i]["stats"]["latency_s"] for i in idx if recs[i].get("timed")})
        if features:
            points[name].features = _features(config, folder, [recs[i] for i in idx], device)
    indices = {tuple(p.indices) for p in points.values()}
    if len(indices) != 1:
        raise ValueError(f"{folder}: the method points did not generate the same prompts; rerun the regime")
    return Regime(folder.name, folder, record, points)


#: a regime's compact per-image data (``save_compact``, ``load_compact``): what the page needs, no images
COMPACT_SUFFIX = ".claims.npz"
#: the run record's keys the page reads (``per_decoder`` only for its point names; ``extension`` for ``extend``'s)
RECORD_KEYS = ("config", "labels", "wall_s", "extension")


def _rebase_assets(value: Any) -> Any:
    """Paths into another checkout's ``coolsd/assets/`` (a run's resolved ``${asset:...}``) -> this checkout's."""
    from coolsd import ASSET_DIR

    if isinstance(value, dict):
        return {k: _rebase_assets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase_assets(v) for v in value]
    if isinstance(value, str) and "/coolsd/assets/" in value:
        return str(ASSET_DIR / value.split("/coolsd/assets/", 1)[1])
    return value


#: the classifier features in compact data: unsigned integers of this many bits (uint8 up to 8, uint16 up to 16),
#: per point and column an affine map back (offset = the column's minimum, scale = its range ÷ (2^bits − 1)),
#: dequantised on load (``quantise``, ``dequantise``). Files of the earlier format hold float16 features instead
#: (``<point>/features``); ``load_compact`` reads both and ``convert_compact`` turns one into the other.
FEATURE_BITS = 8


def quantise(features: np.ndarray, bits: int = FEATURE_BITS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, offset, scale) of (N, D) ``features``: codes = round((x − offset) ÷ scale), per column; a constant
    column (e.g. a ReLU feature that is 0 on every image) has scale 0 and comes back exactly, as does each column's
    minimum (0 for the classifier's non-negative features)."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits {bits}: 1 to 16")
    x = np.asarray(features, dtype=np.float64)
    offset = x.min(axis=0) if len(x) else np.zeros(x.shape[1:])
    scale = ((x.max(axis=0) if len(x) else offset) - offset) / (2**bits - 1)
    codes = np.rint((x - offset) / np.where(scale > 0, scale, 1.0))
    return codes.astype(np.uint8 if bits <= 8 else np.uint16), offset, scale


def dequantise(codes: np.ndarray, offset: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The features (float64) of ``quantise``'s output: offset + codes · scale."""
    return offset + codes.astype(np.float64) * scale


def _feature_arrays(name: str, features: np.ndarray, bits: int = FEATURE_BITS) -> dict[str, np.ndarray]:
    codes, offset, scale = quantise(features, bits)
    return {f"{name}/feature_codes": codes, f"{name}/feature_offset": offset, f"{name}/feature_scale": scale}


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())


def save_compact(regime: Regime, folder: Path) -> Path:
    """Write ``<folder>/<regime>.claims.npz``: the trimmed run record (JSON) and, per point, the image indices,
    committed tokens and verify forwards (int16), summed TV (float64), the timed latencies and the classifier
    features quantised to ``FEATURE_BITS`` bits per column (compressed). ``load_compact`` gives the regime back;
    the page is made from it."""
    record = {k: regime.record[k] for k in RECORD_KEYS if k in regime.record}
    record["points"] = list(regime.points)
    arrays: dict[str, np.ndarray] = {"record": np.frombuffer(json.dumps(record).encode(), dtype=np.uint8)}
    for name, p in regime.points.items():
        timed = sorted(p.latency)
        arrays.update({
            f"{name}/indices": np.asarray(p.indices, dtype=np.int32),
            f"{name}/committed": p.committed.astype(np.int16), f"{name}/iterations": p.iterations.astype(np.int16),
            f"{name}/tv_sum": p.tv_sum, f"{name}/timed": np.asarray(timed, dtype=np.int32),
            f"{name}/latency": np.asarray([p.latency[i] for i in timed], dtype=np.float64)})
        if p.features is not None:
            arrays.update(_feature_arrays(name, p.features))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{regime.name}{COMPACT_SUFFIX}"
    _write_npz(path, arrays)
    return path


def _load_features(data: Any, name: str) -> np.ndarray | None:
    """A point's features (float64) from compact data: quantised (``quantise``) or, in files of the earlier
    format, float16; None where the point has none."""
    if f"{name}/feature_codes" in data:
        return dequantise(data[f"{name}/feature_codes"], data[f"{name}/feature_offset"], data[f"{name}/feature_scale"])
    if f"{name}/features" in data:
        return data[f"{name}/features"].astype(np.float64)
    return None


def load_compact(path: Path) -> Regime:
    """A regime from its compact data (``save_compact``, or a file of the earlier float16 format); features come
    back as float64 (their stored values, dequantised)."""
    with np.load(path) as data:
        record = current_record(json.loads(data["record"].tobytes().decode()))
        record["config"] = _rebase_assets(record["config"])
        points: dict[str, Point] = {}
        for name in record.pop("points"):
            points[name] = Point(
                name=name, label=record.get("labels", {}).get(name, name), config=point_config(record["config"], name),
                indices=data[f"{name}/indices"].tolist(), committed=data[f"{name}/committed"].astype(np.float64),
                iterations=data[f"{name}/iterations"].astype(np.float64), tv_sum=data[f"{name}/tv_sum"],
                latency=dict(zip(data[f"{name}/timed"].tolist(), data[f"{name}/latency"].tolist())),
                features=_load_features(data, name))
    if len({tuple(p.indices) for p in points.values()}) > 1:
        raise ValueError(f"{path}: the method points do not share the same image indices; the comparisons pair "
                         "images by position, so every point must hold the same images")
    return Regime(path.name[: -len(COMPACT_SUFFIX)], path, record, points)


def convert_compact(path: Path, bits: int = FEATURE_BITS) -> tuple[int, int]:
    """Rewrite compact data of the earlier format (float16 ``<point>/features``) in place, atomically, with its
    features quantised to ``bits`` bits (``quantise``); every other array is kept as it is (the record too: its
    asset paths are not rebased). A file already quantised is left alone. Returns its size before and after."""
    path = Path(path)
    before = path.stat().st_size
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    old = [k for k in arrays if k.endswith("/features")]
    if not old:
        return before, before
    for key in old:
        arrays.update(_feature_arrays(key[: -len("/features")], arrays.pop(key), bits))
    _write_npz(path, arrays)
    return before, path.stat().st_size


def subset(regime: Regime, names: list[str], indices: list[int], name: str) -> Regime:
    """``regime`` restricted to the points ``names`` and the images ``indices`` (a prefix-free subset of its own,
    in its order): the same per-image values, so a point's estimate on those images is what it would be had the
    run generated only them. Estimates and replicates are not copied (``compute`` again)."""
    where = {i: k for k, i in enumerate(regime.indices)}
    missing = [i for i in indices if i not in where]
    if missing:
        raise ValueError(f"{regime.name}: images {missing[:3]} are not in the regime")
    rows = np.array([where[i] for i in indices])
    keep = set(indices)
    points = {}
    for n in names:
        if n not in regime.points:
            raise ValueError(f"{regime.name}: no point {n!r}")
        p = regime.points[n]
        points[n] = Point(n, p.label, p.config, list(indices), p.committed[rows], p.iterations[rows], p.tv_sum[rows],
                          {i: t for i, t in p.latency.items() if i in keep},
                          None if p.features is None else p.features[rows])
    return Regime(name, regime.folder, regime.record, points)


# ------------------------------------------------------------------------------------------ extensions


def _options(config: dict[str, Any]) -> dict[str, Any]:
    """What makes a point's images: its decoder options without the decode path (records made before
    ``decoder.path`` have none; both paths give the same tokens on a CPU)."""
    from eval.report.labels import decoder_options

    options = decoder_options(config)
    options.pop("path", None)
    return {k: v for k, v in options.items() if v is not None}  # an option left off: None where it is given


def is_more(regime: Regime) -> bool:
    """A run of ``experiment=embedded_claims_more`` (more images of a regime's deciding points), not a regime."""
    return bool(regime.record.get("config", {}).get("claims_more"))


def more_info(run: Regime) -> dict[str, Any]:
    """A run of ``experiment=embedded_claims_more``: its regime, group, key, offset, added images and the claims its
    group decides (``claims_more`` of its config)."""
    cfg = run.record["config"]
    info = cfg.get("claims_more") or {}
    if not info:
        raise ValueError(f"{run.folder}: not a run of experiment=embedded_claims_more (no claims_more block)")
    key = str(info["key"])
    return {"regime": str(cfg["claims"]["regime"]), "group": str(info["group"]), "key": key,
            "offset": int(info["offset"]), "added": run.num_images,
            "decides": list((info.get("decides") or {}).get(key) or [])}


def extend(base: Regime, runs: Sequence[Regime], images: int, group: str, decides: Sequence[str]) -> Regime:
    """``base`` (a regime's compact data, images 0..offset−1) extended to ``images`` images for the points that
    ``runs`` generated. Each run is a run of ``experiment=embedded_claims_more``
    (``configs/experiment/embedded_claims_more.yaml``) whose image i is image ``offset + i`` of a longer run of the
    regime: its ``eval.seed`` is base's + ``offset``, and with class prompts cycled and ``offset`` a multiple of
    their number, the prompt is the same too. A point is taken from the first run that has it and covers
    ``images`` (a longer run's first images only); it keeps base's timed latencies only, so the page's speedups
    stay those of the regime's own timed prompts. AR comes along (every run has it). The record's ``extension``
    names the base regime, the group, the claims it decides, the offset, the images and each run used (its
    folder, images and wall time); the name is ``<base>.<group>``. Refuses runs whose images do not continue
    base's, or whose points, model or drafter differ from base's."""
    from coolsd.fingerprint import TOKEN_CODE_VERSION

    cfg = base.record["config"]
    offset = len(base.indices)
    if base.indices != list(range(offset)):
        raise ValueError(f"{base.folder}: its images are not 0..{offset - 1}; the extension starts after them")
    points: dict[str, Point] = {}
    used = []
    for run in runs:
        info, more_cfg = more_info(run), run.record["config"]
        if info["offset"] != offset or info["regime"] != cfg["claims"]["regime"]:
            raise ValueError(f"{run.folder}: extends {info['regime']} from image {info['offset']}, not "
                             f"{cfg['claims']['regime']} from {offset}")
        classes = len(more_cfg["model"].get("class_names") or [])
        if not str(more_cfg["data"].get("_target_", "")).endswith("ClassPrompts") or not classes or offset % classes:
            raise ValueError(f"{run.folder}: its prompts continue base's only with class prompts and an offset that is "
                             f"a multiple of the number of classes ({classes}); offset {offset}")
        if int(more_cfg["eval"]["seed"]) != int(cfg["eval"]["seed"]) + offset:
            raise ValueError(f"{run.folder}: eval.seed {more_cfg['eval']['seed']} is not base's seed "
                             f"{cfg['eval']['seed']} + {offset}: these are other images")
        for part in ("model", "drafter"):
            a, b = _rebase_assets(cfg.get(part)) or {}, _rebase_assets(more_cfg.get(part)) or {}
            # a key one side lacks and the other leaves off (False, None: e.g. model.compile, added later) is the same
            diff = sorted(k for k in {*a, *b} if a.get(k) != b.get(k) and not ((k not in a and not b.get(k))
                                                                             or (k not in b and not a.get(k))))
            if diff:
                raise ValueError(f"{run.folder}: its {part} differs from the base regime's in {diff}")
        foreign = [n for n in run.points if n not in base.points]
        if foreign:
            raise ValueError(f"{run.folder}: points {foreign} are not in the base regime {base.name}")
        need = images - offset
        if run.num_images < need:
            continue
        taken = []
        for n, b in run.points.items():
            if n in points:
                continue
            a = base.points[n]
            if _options(a.config) != _options(b.config):
                raise ValueError(f"{run.folder}: point {n!r} is configured differently from the base regime's: "
                                 f"{_options(b.config)} vs {_options(a.config)}")
            features = None if a.features is None or b.features is None else \
                np.concatenate([a.features, b.features[:need]])
            points[n] = Point(n, a.label, a.config, [*a.indices, *(offset + i for i in b.indices[:need])],
                              np.concatenate([a.committed, b.committed[:need]]),
                              np.concatenate([a.iterations, b.iterations[:need]]),
                              np.concatenate([a.tv_sum, b.tv_sum[:need]]), dict(a.latency), features)
            taken.append(n)
        used.append({"run": run.name, "images": run.num_images, "points": taken,
                     "wall_s": run.record.get("wall_s")})
    if not [n for n in points if n != "ar"]:
        raise ValueError(f"{base.name}: no run covers {images:,} images")
    record = json.loads(json.dumps({k: base.record[k] for k in RECORD_KEYS if k in base.record}))
    record["config"]["eval"]["num_prompts"] = images
    record.pop("wall_s", None)
    record["extension"] = {"base": base.name, "group": group, "decides": list(decides), "offset": offset,
                           "images": images, "runs": used, "token_code_version": TOKEN_CODE_VERSION}
    return Regime(f"{base.name}.{group}", Path(str(runs[0].folder)).parent if runs else base.folder, record, points)


def extension(regime: Regime) -> dict[str, Any] | None:
    """An extended regime's ``extension`` record (``extend``), or None for a regime's own run."""
    return regime.record.get("extension")


_METRICS: dict[str, Any] = {}


def fid_metric(config: dict[str, Any]):
    """The run's FID/KID metric (its first ``eval.metrics`` entry of ``eval.metrics.FIDKID``), built once."""
    from hydra.utils import instantiate

    spec = next((m for m in config["eval"].get("metrics", []) if m.get("_target_", "").endswith("FIDKID")), None)
    if spec is None:
        raise ValueError("the claims need FID: the runs' eval.metrics has no eval.metrics.FIDKID entry")
    key = json.dumps(spec, sort_keys=True)
    if key not in _METRICS:
        _METRICS[key] = instantiate(spec)
    return _METRICS[key]


def _features(config: dict[str, Any], folder: Path, recs: list[dict], device: str) -> np.ndarray:
    metric = fid_metric(config)
    missing = [r["index"] for r in recs if not r.get("image")]
    if missing:
        raise ValueError(f"{folder}: records without images (eval.save_images=false?) e.g. {missing[:3]}")
    return np.asarray(metric.per_image([folder / r["image"] for r in recs], [r["prompt"] for r in recs],
                                       torch.device(device)), dtype=np.float64)


# ------------------------------------------------------------------------------------------ replicates


def compute(regime: Regime, resamples: int = 1000, seed: int = 0, device: str = "cpu") -> None:
    """Point estimates and paired replicates of every point's accepted length, TV per token, FID, speedup."""
    boot = intervals.Bootstrap(resamples=resamples, seed=seed)
    n = regime.num_images
    w = boot.weights(n, "images")  # (B, N), the same for every point: paired
    ar = regime.points.get("ar")
    timed = sorted(set.intersection(*(set(p.latency) for p in regime.points.values()))) if ar else []
    wt = boot.weights(len(timed), "timed") if len(timed) >= 2 else None
    metric = fid_metric(regime.record["config"]) if any(p.features is not None for p in regime.points.values()) else None
    reference = ref_stats = None
    if metric is not None:
        reference = metric.reference_features(torch.device(device))
        ref_stats = intervals.ReferenceStats.of(reference, device)  # S_r^1/2 once per regime
    for p in regime.points.values():
        p.est["tau"] = p.committed.sum() / max(p.iterations.sum(), 1)
        p.reps["tau"] = (w @ p.committed) / np.maximum(w @ p.iterations, 1)
        p.est["tv"] = p.tv_sum.sum() / max(p.tokens.sum(), 1)
        p.reps["tv"] = (w @ p.tv_sum) / np.maximum(w @ p.tokens, 1)
        if p.features is not None:
            p.est["fid"] = intervals.fid_value(p.features, reference)
            p.reps["fid"] = intervals.fid_replicates(p.features, ref_stats, w, device)
        if wt is not None:
            a = np.array([ar.latency[i] for i in timed])
            m = np.array([p.latency[i] for i in timed])
            p.est["speedup"] = a.mean() / m.mean()
            p.reps["speedup"] = (wt @ a) / (wt @ m)
    regime.resamples = resamples


def interval(p: Point, key: str) -> list[float] | None:
    if key not in p.reps:
        return None
    if key == "fid":
        return intervals.shifted_interval(p.est[key], p.reps[key], LEVEL)
    return intervals.percentile_interval(p.reps[key], LEVEL)
def _ci_text(value: float, ci: list[float] | None, fmt: str = "{:.3f}") -> str:
    if value is None or not math.isfinite(value):
        return "—"
    text = fmt.format(value)
    return text + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")

