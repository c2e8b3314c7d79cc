"""The COOL-SD paper's claims, decided on the runs of ``experiment=embedded_claims`` (or ``_quick``).

Input: the multirun folder, one sub-folder per drafter regime (``configs/regime/``), each a ``run.py`` run whose
suite holds every method point, all generating the same prompts and seeds. Everything here is recomputed from
the per-image records and images of those runs, so every comparison is **paired**: one set of bootstrap
resamples of the prompts (seeded, ``resamples`` replicates) is applied to every method point of a regime, and a
statistic that combines several points (an interpolated frontier, a difference) is computed on each replicate.

Per point: accepted length (committed tokens ÷ verify forwards, pooled), TV per committed token (pooled),
FID in the shipped classifier's feature space (reference fixed, generated features resampled; the same
statistics code as the runs, ``eval.stats.fid_replicates``) and, over the timed subset, speedup over AR (paired
by prompt). An interval of a difference is the re-centred percentile interval of its replicates
(``eval.stats.bootstrap_difference``), its p-value the two-sided bootstrap one.

The claims (``shared/docs/algorithms.md``; the paper's tables):

* **C1** COOL-SD's frontier dominates LANTERN++'s. At each LANTERN++ point (its reference resampling) whose
  accepted length lies inside COOL-SD's curve (exponential schedule, ``mu: mean``, points joined in order of
  δ, linear in accepted length), ΔFID = FID of COOL-SD interpolated there − FID of the LANTERN++ point.
* **C2** At matched accepted length the exponential schedule gives lower TV per token and FID than the uniform
  one (UniformRSD), and is at least as good as the linear one: the same interpolation, at each uniform (linear)
  point, for TV per token and FID.
* **C3** COOL-SD's resampling G* improves LANTERN++ over its reference resampling (ΔTV, ΔFID at the same k, λ),
  more at larger k (the difference of those differences between the largest and smallest k at each λ).
* **C4** COOL-SD at δ = 1.1 is faster than vanilla SD at comparable quality: Δ speedup (paired over the timed
  prompts) and Δ accepted length > 0, with ΔFID not significantly > 0.

Verdict of a claim over its comparisons (each oriented so that < 0 favours the claim): **held** when at least
one is significantly in its favour at 95 % and none significantly against it; **not held** when any is
significantly against it; **inconclusive** otherwise (every interval contains 0) or when no comparison could be
made (e.g. no LANTERN++ point inside COOL-SD's range). Several comparisons are tested without a multiplicity
correction; the page lists every one of them with its interval.

**The μ question** (weak-drafter regime): every exponential COOL-SD point, whatever its ``mu``, lies on one curve
of R = accepted length ÷ vanilla SD's against ω₁ = δ·exp(−ν − μ) (μ only rescales ω). Interpolating R in
log ω₁ gives the ω₁ at which R equals the paper's LlamaGen ratios (×1.13 at δ = 1.1, ×1.38 at δ = 2), hence the
fitted μ = ln(δ·e^(−ν)/ω₁) for each δ, with bootstrap intervals; one μ fits both when the interval of
μ(δ=2) − μ(δ=1.1) contains 0. A ratio outside the measured range is reported as such (no extrapolation).
The page then prints the command of the follow-up run (``regime=weak_tree_fitted``: COOL-SD at δ = 1.1 and 2,
each with its fitted μ, same prompts and seeds, into the same sweep folder); once it is there its points join
weak_tree's, labelled "(μ fitted)", with their measured R, and C1 and C4 are decided with them too
("C1 (fitted μ)", "C4 (fitted μ)"). The fitted points' speedups are against their own run's AR.

Example: ``python scripts/claims.py results/runs/embedded_claims --out results``.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from coolsd.io import atomic_write_bytes
from coolsd.schedules import omega_table
from eval import stats
from eval.labels import STRENGTH
from eval.records import load_records
from eval.report import error_bar

PAPER_RATIOS = {1.1: 2.73 / 2.42, 2.0: 3.34 / 2.42}  # COOL-SD / vanilla SD accepted length, LlamaGen (paper)
HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
LEVEL = 0.95


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


def load_regime(folder: Path, features: bool = True, device: str = "cpu") -> Regime:
    """A regime's run: its ``run.json``, every point's per-image records and (``features``) the classifier
    features of its images, taken with the run's own FID metric config."""
    record = json.loads((folder / "run.json").read_text())
    config = record["config"]
    labels = record.get("labels", {})
    points: dict[str, Point] = {}
    for name in record["per_decoder"]:
        recs = load_records(folder / "records", name)
        decoder_cfg = config["suite"].get(name) or config["decoder"]
        if name == config["decoder"]["name"]:
            decoder_cfg = config["decoder"]
        idx = sorted(recs)
        points[name] = Point(
            name=name, label=labels.get(name, name), config=decoder_cfg, indices=idx,
            committed=_per_image(recs, "num_tokens") - 1, iterations=_per_image(recs, "iterations"),
            tv_sum=_per_image(recs, "tv_sum"),
            latency={i: recs[i]["stats"]["latency_s"] for i in idx if recs[i].get("timed")})
        if features:
            points[name].features = _features(config, folder, [recs[i] for i in idx], device)
    indices = {tuple(p.indices) for p in points.values()}
    if len(indices) != 1:
        raise ValueError(f"{folder}: the method points did not generate the same prompts; rerun the regime")
    return Regime(folder.name, folder, record, points)


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
    boot = stats.Bootstrap(resamples=resamples, seed=seed)
    n = regime.num_images
    w = boot.weights(n, "images")  # (B, N), the same for every point: paired
    ar = regime.points.get("ar")
    timed = sorted(set.intersection(*(set(p.latency) for p in regime.points.values()))) if ar else []
    wt = boot.weights(len(timed), "timed") if len(timed) >= 2 else None
    metric = fid_metric(regime.record["config"]) if any(p.features is not None for p in regime.points.values()) else None
    reference = ref_stats = None
    if metric is not None:
        reference = metric.reference_features(torch.device(device))
        ref_stats = stats.ReferenceStats.of(reference, device)  # S_r^1/2 once per regime
    for p in regime.points.values():
        p.est["tau"] = p.committed.sum() / max(p.iterations.sum(), 1)
        p.reps["tau"] = (w @ p.committed) / np.maximum(w @ p.iterations, 1)
        p.est["tv"] = p.tv_sum.sum() / max(p.tokens.sum(), 1)
        p.reps["tv"] = (w @ p.tv_sum) / np.maximum(w @ p.tokens, 1)
        if p.features is not None:
            p.est["fid"] = stats.fid_value(p.features, reference)
            p.reps["fid"] = stats.fid_replicates(p.features, ref_stats, w, device)
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
        return stats.shifted_interval(p.est[key], p.reps[key], LEVEL)
    return stats.percentile_interval(p.reps[key], LEVEL)


# ------------------------------------------------------------------------------------------- frontiers


def strength(p: Point) -> float:
    """The option a method's curve is ordered by (``eval.labels.STRENGTH``: δ for COOL-SD and LANTERN, λ for
    LANTERN++); 0 for methods without one."""
    return float(p.config.get(STRENGTH.get(p.method, ""), 0.0))


def curve(points: Sequence[Point]) -> list[Point]:
    return sorted(points, key=strength)


def interpolate(curve_points: Sequence[Point], x: np.ndarray | float, key: str, which: str) -> np.ndarray | float:
    """``key`` of the curve at accepted length ``x`` (linear in accepted length between the curve's points,
    ordered by accepted length), NaN outside the curve's range. ``which``: ``est`` or ``reps`` (per replicate)."""
    if which == "est":
        xs = np.array([p.est["tau"] for p in curve_points])
        ys = np.array([p.est[key] for p in curve_points])
        order = np.argsort(xs)
        xs, ys = xs[order], ys[order]
        return float(np.interp(x, xs, ys)) if xs[0] <= x <= xs[-1] else math.nan
    xs = np.stack([p.reps["tau"] for p in curve_points], 1)  # (B, P)
    ys = np.stack([p.reps[key] for p in curve_points], 1)
    out = np.full(len(xs), math.nan)
    for b in range(len(xs)):
        order = np.argsort(xs[b])
        xb, yb = xs[b][order], ys[b][order]
        if xb[0] <= x[b] <= xb[-1]:
            out[b] = np.interp(x[b], xb, yb)
    return out


def pareto(points: Sequence[Point], key: str) -> list[Point]:
    """Points not dominated in (higher accepted length, lower ``key``), by accepted length."""
    front = [p for p in points if not any(q.est["tau"] >= p.est["tau"] and q.est[key] <= p.est[key]
                                          and (q.est["tau"], q.est[key]) != (p.est["tau"], p.est[key])
                                          for q in points)]
    return sorted(front, key=lambda p: p.est["tau"])


# -------------------------------------------------------------------------------------------- verdicts


@dataclass
class Comparison:
    what: str  # e.g. "FID: COOL-SD − LANTERN++ k=10, λ=5 at accepted length 4.31"
    difference: float
    ci: list[float] | None
    p: float | None
    favours: str | None  # "claim" | "against" | None (interval contains 0)


def compare(what: str, estimate: float, replicates: np.ndarray, sign: float = 1.0) -> Comparison:
    """A difference oriented so that ``sign * difference < 0`` favours the claim."""
    if not math.isfinite(estimate):
        return Comparison(what + " (outside the curve's range)", estimate, None, None, None)
    d = stats.bootstrap_difference(estimate, replicates, LEVEL)
    ci = d["ci"]
    favours = None
    if ci is not None:
        lo, hi = sorted((sign * ci[0], sign * ci[1]))
        favours = "claim" if hi < 0 else "against" if lo > 0 else None
    return Comparison(what, estimate, ci, d["p"], favours)


def verdict(comparisons: Sequence[Comparison]) -> str:
    made = [c for c in comparisons if c.ci is not None]
    if any(c.favours == "against" for c in made):
        return NOT_HELD
    if any(c.favours == "claim" for c in made):
        return HELD
    return INCONCLUSIVE


def combine(*verdicts: str) -> str:
    if NOT_HELD in verdicts:
        return NOT_HELD
    return HELD if all(v == HELD for v in verdicts) else INCONCLUSIVE


@dataclass
class Claim:
    key: str
    text: str
    verdict: str
    comparisons: list[Comparison]
    note: str = ""


def select(regime: Regime, method: str, **options: Any) -> list[Point]:
    def matches(p: Point) -> bool:
        c = p.config
        return p.method == method and all(str(c.get(k, v if k != "mu" else "mean")) == str(v) for k, v in options.items())
    return [p for p in regime.points.values() if matches(p)]


def frontier_claim(ours: list[Point], theirs: list[Point], key: str, name: str) -> list[Comparison]:
    """At each of ``theirs`` points: ``key`` of ``ours`` interpolated at its accepted length minus its own."""
    out = []
    if len(ours) < 2:
        return out
    for q in theirs:
        est = interpolate(ours, q.est["tau"], key, "est") - q.est[key]
        reps = interpolate(ours, q.reps["tau"], key, "reps") - q.reps[key]
        out.append(compare(f"{name}: {label_of(ours)} − {q.label} at accepted length {q.est['tau']:.2f}", est, reps))
    return out


def label_of(points: Sequence[Point]) -> str:
    p = points[0]
    text = p.label.split(" δ=")[0].split(" k=")[0]
    schedule = p.config.get("schedule")
    return f"{text} ({schedule})" if p.method == "coolsd" and schedule else text


def decide(regime: Regime) -> list[Claim]:
    """C1–C4 on one regime; with fitted-μ points (``merge_fitted``) also C1 and C4 with COOL-SD at the fitted μ."""
    cool = curve(select(regime, "coolsd", schedule="exponential", mu="mean"))
    claims = [frontier_c1(regime, cool, "C1", "COOL-SD's frontier (accepted length vs FID) dominates LANTERN++'s"),
              *schedule_c2(regime, cool), *resampling_c3(regime),
              speed_c4(regime, cool, "C4", "COOL-SD at δ = 1.1 is faster than vanilla SD at comparable quality")]
    fit = curve([p for p in regime.points.values() if p.method == "coolsd"
                 and p.config.get("schedule") == "exponential" and fitted(p)])
    if fit:
        claims.append(frontier_c1(regime, fit, "C1 (fitted μ)",
                                  "C1 with COOL-SD at the fitted μ (δ = 1.1 and 2, each with its own μ)"))
        claims.append(speed_c4(regime, fit, "C4 (fitted μ)", "C4 with COOL-SD at δ = 1.1 and its fitted μ"))
    return claims


def lantern_pp_reference(regime: Regime) -> list[Point]:
    return [p for p in select(regime, "lantern_pp") if p.config.get("resample") == "reference"]


def frontier_c1(regime: Regime, cool: list[Point], key: str, text: str) -> Claim:
    c1 = frontier_claim(cool, lantern_pp_reference(regime), "fid", "FID")
    return Claim(key, text, verdict(c1), c1, "" if len(cool) >= 2 else "needs two COOL-SD points")


def schedule_c2(regime: Regime, cool: list[Point]) -> list[Claim]:
    uniform = curve(select(regime, "coolsd", schedule="uniform"))
    linear = curve(select(regime, "coolsd", schedule="linear"))
    c2u = frontier_claim(cool, uniform, "tv", "TV/token") + frontier_claim(cool, uniform, "fid", "FID")
    c2l = frontier_claim(cool, linear, "tv", "TV/token") + frontier_claim(cool, linear, "fid", "FID")
    tv_u = verdict([c for c in c2u if c.what.startswith("TV")])
    fid_u = verdict([c for c in c2u if c.what.startswith("FID")])
    return [Claim("C2a", "at matched accepted length the exponential schedule gives lower TV and FID than "
                  "the uniform one (UniformRSD)", combine(tv_u, fid_u), c2u, f"TV: {tv_u}; FID: {fid_u}"),
            Claim("C2b", "exponential ≥ linear at matched accepted length (TV and FID)", verdict(c2l), c2l)]


def resampling_c3(regime: Regime) -> list[Claim]:
    c3, c3k = [], []
    lpp_ref = lantern_pp_reference(regime)
    gstar = [p for p in select(regime, "lantern_pp") if p.config.get("resample") == "optimal"]
    pairs = []
    for g in gstar:
        ref = [p for p in lpp_ref if p.config.get("k") == g.config.get("k") and p.config.get("lam") == g.config.get("lam")]
        if ref:
            pairs.append((g, ref[0]))
            for key, name in (("tv", "TV/token"), ("fid", "FID")):
                c3.append(compare(f"{name}: {g.label} − reference resampling", g.est[key] - ref[0].est[key],
                                  g.reps[key] - ref[0].reps[key]))
    for lam in sorted({g.config.get("lam") for g, _ in pairs}):
        at = sorted([(g, r) for g, r in pairs if g.config.get("lam") == lam], key=lambda gr: gr[0].config.get("k"))
        if len(at) >= 2:
            (g0, r0), (g1, r1) = at[0], at[-1]
            for key, name in (("tv", "TV/token"), ("fid", "FID")):
                est = (g1.est[key] - r1.est[key]) - (g0.est[key] - r0.est[key])
                reps = (g1.reps[key] - r1.reps[key]) - (g0.reps[key] - r0.reps[key])
                c3k.append(compare(f"{name}: G* gain at k={g1.config.get('k')} − at k={g0.config.get('k')} "
                                   f"(λ={lam:g})", est, reps))
    return [Claim("C3a", "G* improves LANTERN++ over its reference resampling (TV, FID)", verdict(c3), c3),
            Claim("C3b", "G*'s improvement grows with k", verdict(c3k), c3k, "" if c3k else "needs two k at one λ")]


def speed_c4(regime: Regime, cool: list[Point], key: str, text: str) -> Claim:
    """Vanilla SD vs the δ = 1.1 point of ``cool``: speed (speedup, accepted length) and FID."""
    c4 = []
    sd, c11 = regime.points.get("sd"), [p for p in cool if abs(strength(p) - 1.1) < 1e-9]
    if sd is not None and c11:
        p = c11[0]
        if "speedup" in p.est and "speedup" in sd.est:
            c4.append(compare("speedup: vanilla SD − COOL-SD δ=1.1", sd.est["speedup"] - p.est["speedup"],
                              sd.reps["speedup"] - p.reps["speedup"]))
        c4.append(compare("accepted length: vanilla SD − COOL-SD δ=1.1", sd.est["tau"] - p.est["tau"],
                          sd.reps["tau"] - p.reps["tau"]))
    quality = []
    if sd is not None and c11 and "fid" in sd.est:
        quality.append(compare("FID: COOL-SD δ=1.1 − vanilla SD", c11[0].est["fid"] - sd.est["fid"],
                               c11[0].reps["fid"] - sd.reps["fid"]))
    speed = verdict(c4)
    worse = any(c.favours == "against" for c in quality)
    v4 = NOT_HELD if worse or speed == NOT_HELD else speed
    side = {"claim": "for", "against": "against", None: "n.s."}
    note = "; ".join(f"{c.what.split(':')[0]}: {side[c.favours]}" for c in c4 + quality)
    return Claim(key, text, v4, c4 + quality, note)


# ----------------------------------------------------------------------------------------------- μ fit

FITTED_REGIME = "weak_tree_fitted"  # the follow-up run with the fitted μ (configs/regime/weak_tree_fitted.yaml)


def fitted(p: Point) -> bool:
    """An exponential COOL-SD point run with a numeric μ (the fitted one)."""
    mu = p.config.get("mu", "mean")
    return not isinstance(mu, bool) and isinstance(mu, (int, float))


def merge_fitted(weak: Regime, extra: Regime) -> list[str]:
    """Add the fitted-μ points of ``extra`` (the weak_tree_fitted run: same prompts and seeds) to ``weak``,
    labelled "(μ fitted)"; their replicates use the same bootstrap weights (same seed, same images), so they
    pair with weak's points. Their speedups are against ``extra``'s own AR. Returns the added names."""
    if extra.indices != weak.indices:
        raise ValueError(f"{extra.folder}: the fitted-μ run did not generate weak_tree's prompts; rerun it with "
                         "the same eval.num_prompts (claims_num_prompts) into the same sweep folder")
    added = []
    for name, p in extra.points.items():
        if p.method != "coolsd" or not fitted(p):
            continue
        p.label = f"{p.label} (μ fitted)"
        weak.points[name] = p
        added.append(name)
    return added


def omega1(p: Point) -> float:
    c = p.config
    depth = _depth(c)
    return float(omega_table("exponential", float(c.get("delta", 1.1)), depth, float(c.get("nu", 0.7)),
                             c.get("mu", "mean"))[0])


def _depth(c: dict[str, Any]) -> int:
    from coolsd.trees import TreeShape, resolve_tree

    levels = resolve_tree(c.get("tree"), c.get("dynamic_tree"))
    if levels is None:
        return int(c.get("draft_len", 4))
    return levels.depth if isinstance(levels, TreeShape) else levels.depth + 1


def fitted_command(weak: Regime, mu: dict[str, Any], folder: Path) -> str | None:
    """The run.py command that adds COOL-SD at δ = 1.1 and 2 with their fitted μ (None without both fits)."""
    fits = mu.get("fits", {})
    values = [fits.get(k, {}).get("mu") for k in ("1.1", "2")]
    if any(v is None for v in values):
        return None
    experiment = weak.record.get("config", {}).get("experiment_name") or "embedded_claims"
    return (f"python run.py -m experiment={experiment} regime={FITTED_REGIME} claims.fitted_mu.d1_1={values[0]:.4f} "
            f"claims.fitted_mu.d2={values[1]:.4f} hydra.sweep.dir={folder}")


def fitted_points(weak: Regime, names: Sequence[str], extra: Regime) -> list[dict[str, Any]]:
    """Each fitted-μ point: δ, μ, its measured R (÷ weak_tree's vanilla SD, paired) against the paper's."""
    sd = weak.points.get("sd")
    out = []
    for name in names:
        p = weak.points[name]
        delta = float(p.config.get("delta", 1.1))
        row = {"label": p.label, "delta": delta, "mu": float(p.config["mu"]), "omega1": omega1(p),
               "paper_ratio": PAPER_RATIOS.get(round(delta, 6)), "folder": str(extra.folder)}
        if sd is not None:
            row["ratio"] = float(p.est["tau"] / sd.est["tau"])
            row["ratio_ci"] = stats.percentile_interval(p.reps["tau"] / sd.reps["tau"], LEVEL)
        out.append(row)
    return out


def fit_mu(regime: Regime) -> dict[str, Any]:
    """Fitted μ for each of the paper's two ratios, with intervals, and whether one μ fits both."""
    sd = regime.points.get("sd")
    exp = [p for p in select(regime, "coolsd", schedule="exponential")]
    if sd is None or len(exp) < 2:
        return {"note": "needs vanilla SD and at least two exponential COOL-SD points"}
    exp.sort(key=omega1)
    x = np.log([omega1(p) for p in exp])
    nu = float(exp[0].config.get("nu", 0.7))

    def solve(ratios: np.ndarray, target: float) -> float:
        order = np.argsort(ratios)  # R is increasing in ω₁ when the curve is monotone
        r, xx = ratios[order], x[order]
        if not (r[0] <= target <= r[-1]):
            return math.nan
        return float(np.interp(target, r, xx))

    est_r = np.array([p.est["tau"] / sd.est["tau"] for p in exp])
    rep_r = np.stack([p.reps["tau"] / sd.reps["tau"] for p in exp], 1)  # (B, P)
    out: dict[str, Any] = {"points": [{"label": p.label, "omega1": omega1(p), "ratio": float(r)}
                                      for p, r in zip(exp, est_r)], "fits": {}}
    mus = {}
    for delta, target in PAPER_RATIOS.items():
        base = math.log(delta) - nu
        est = base - solve(est_r, target)
        reps = np.array([base - solve(rb, target) for rb in rep_r])
        mus[delta] = (est, reps)
        finite = reps[np.isfinite(reps)]
        out["fits"][f"{delta:g}"] = {
            "paper_ratio": target, "mu": est if math.isfinite(est) else None,
            "ci": stats.shifted_interval(est, finite, LEVEL) if math.isfinite(est) and len(finite) else None,
            "replicates_in_range": int(len(finite)), "resamples": int(len(reps))}
    (e1, r1), (e2, r2) = mus[1.1], mus[2.0]
    if math.isfinite(e1) and math.isfinite(e2):
        c = compare("μ(δ=2) − μ(δ=1.1)", e2 - e1, r2 - r1)
        out["difference"] = {"value": c.difference, "ci": c.ci, "p": c.p,
                             "one_mu_fits_both": c.ci is not None and c.ci[0] <= 0 <= c.ci[1]}
    else:
        out["difference"] = {"value": None, "ci": None, "p": None, "one_mu_fits_both": None,
                             "note": "a paper ratio lies outside the measured range of R: no extrapolation"}
    return out


# --------------------------------------------------------------------------------------------- figures


FAMILIES: list[tuple[str, Callable[[Point], bool]]] = [
    ("COOL-SD (exponential, μ=mean)", lambda p: p.method == "coolsd" and p.config.get("schedule") == "exponential"
     and str(p.config.get("mu", "mean")) == "mean"),
    ("COOL-SD (exponential, μ=first)", lambda p: p.method == "coolsd" and p.config.get("schedule") == "exponential"
     and str(p.config.get("mu")) == "first"),
    ("COOL-SD (exponential, μ fitted)", lambda p: p.method == "coolsd" and p.config.get("schedule") == "exponential"
     and fitted(p)),
    ("UniformRSD", lambda p: p.method == "coolsd" and p.config.get("schedule") == "uniform"),
    ("COOL-SD (linear)", lambda p: p.method == "coolsd" and p.config.get("schedule") == "linear"),
    ("LANTERN++ (reference resampling)", lambda p: p.method == "lantern_pp" and p.config.get("resample") == "reference"),
    ("LANTERN++ (G* resampling)", lambda p: p.method == "lantern_pp" and p.config.get("resample") == "optimal"),
    ("LANTERN", lambda p: p.method == "lantern"),
    ("vanilla SD", lambda p: p.method == "sd"),
    ("SJD", lambda p: p.method == "sjd"),
    ("AR", lambda p: p.method == "ar"),
]


def _errorbar(ax, p: Point, key: str, **kw) -> None:
    x, y = p.est["tau"], p.est[key]
    xerr, yerr = error_bar(x, interval(p, "tau")), error_bar(y, interval(p, key))
    ax.errorbar([x], [y], xerr=[[xerr[0]], [xerr[1]]], yerr=[[yerr[0]], [yerr[1]]], capsize=2, elinewidth=0.8, **kw)


def frontier_figure(regimes: Sequence[Regime], key: str, ylabel: str, path: Path,
                    families: Sequence[str] | None = None) -> Path:
    """``key`` vs accepted length, one panel per regime, every family's points with 95 % intervals joined in order
    of their strength, and each family's Pareto front (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = [(k, n, f) for k, (n, f) in enumerate(FAMILIES) if families is None or n in families]  # k: its colour
    fig, axes = plt.subplots(1, len(regimes), figsize=(max(11.0, 6.2 * len(regimes)), 4.8), squeeze=False)
    markers = "osD^vP*Xph<"
    colors = [f"C{i}" for i in range(10)] + ["black"]  # one per family (FAMILIES has 11)
    for ax, regime in zip(axes[0], regimes):
        shown = [p for _, _, test in fams for p in regime.points.values() if test(p) and key in p.est]
        cap = off_axes_cap([p.est[key] for p in shown])
        for k, fam, test in fams:
            pts = curve([p for p in regime.points.values() if test(p) and key in p.est])
            if not pts:
                continue
            color, marker = colors[k % len(colors)], markers[k % len(markers)]
            inside = [p for p in pts if cap is None or p.est[key] <= cap]
            for j, p in enumerate(inside):
                _errorbar(ax, p, key, fmt=marker, ms=5, color=color, label=fam if j == 0 else None)
            for p in pts:
                if p not in inside:  # far above the rest: drawn at the top edge with its value
                    ax.plot([p.est["tau"]], [cap], marker="^", ms=7, color=color, label=None if inside else fam)
                    ax.annotate(f"{p.label}: {p.est[key]:.3g} (off the axes)", (p.est["tau"], cap), fontsize=7,
                                xytext=(-4, -12), textcoords="offset points", ha="right", color=color)
            if len(inside) > 1:
                ax.plot([p.est["tau"] for p in inside], [p.est[key] for p in inside], "-", lw=0.8, color=color,
                        alpha=0.6)
                front = pareto(inside, key)
                if len(front) > 1:
                    ax.plot([p.est["tau"] for p in front], [p.est[key] for p in front], "--", lw=1.8, color=color,
                            alpha=0.5)
        if cap is not None:
            lo = ax.get_ylim()[0]
            ax.set_ylim(lo, cap + 0.04 * (cap - lo))
        ax.set_title(f"{regime.name} ({regime.num_images:,} images per point)", fontsize=10)
        ax.set_xlabel("accepted length (tokens per target forward)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, names = [], []
    for ax in axes[0]:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=8, frameon=False)
    fig.suptitle("bars: 95 % bootstrap intervals (paired over prompts); thin line: a method in order of its "
                 "strength; dashed: its Pareto front", fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * math.ceil(len(names) / 5), 1, 0.96))
    return _save(fig, path)


def off_axes_cap(values: Sequence[float], factor: float = 2.5) -> float | None:
    """The top of a panel's y axis when some values lie far above the rest (above ``factor`` × the median):
    the largest value below that, with room for its interval; None when nothing is that far out."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    if len(v) < 3 or np.median(v) <= 0:
        return None
    limit = factor * float(np.median(v))
    rest = v[v <= limit]
    if len(rest) == len(v) or not len(rest):
        return None
    return float(rest.max()) * 1.25


def gstar_figure(regimes: Sequence[Regime], path: Path) -> Path:
    """G* − reference resampling (TV per token and FID) by k, per λ and regime, with 95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ks: set[float] = set()
    for r, regime in enumerate(regimes):
        lpp = select(regime, "lantern_pp")
        for g in [p for p in lpp if p.config.get("resample") == "optimal"]:
            ref = [p for p in lpp if p.config.get("resample") == "reference" and p.config.get("k") == g.config.get("k")
                   and p.config.get("lam") == g.config.get("lam")]
            if not ref:
                continue
            for ax, key in zip(axes, ("tv", "fid")):
                c = compare("", g.est[key] - ref[0].est[key], g.reps[key] - ref[0].reps[key])
                ks.add(float(g.config["k"]))
                x = float(g.config["k"]) * (1.06 if r else 0.94)  # regimes side by side
                yerr = [[c.difference - c.ci[0]], [c.ci[1] - c.difference]] if c.ci else None
                ax.errorbar([x], [c.difference], yerr=yerr, fmt="os"[r], color=f"C{int(g.config['lam']) % 10}",
                            capsize=2, label=f"{regime.name}, λ={g.config['lam']:g}")
    for ax, title in zip(axes, ("Δ TV per token (G* − reference)", "Δ FID, classifier features (G* − reference)")):
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.minorticks_off()
        if ks:
            ax.set_xticks(sorted(ks), [f"{k:g}" for k in sorted(ks)])
            ax.set_xlim(min(ks) / 1.6, max(ks) * 1.6)
        ax.set_xlabel("LANTERN++ neighbourhood size k")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        uniq = dict(zip(names, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    for p, fmt in ((path.with_suffix(".png"), "png"), (path.with_suffix(".pdf"), "pdf")):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=120)
        atomic_write_bytes(p, buf.getvalue())
    plt.close(fig)
    return path.with_suffix(".png")


# ------------------------------------------------------------------------------------------------ page


def _ci_text(value: float, ci: list[float] | None, fmt: str = "{:.3f}") -> str:
    if value is None or not math.isfinite(value):
        return "—"
    text = fmt.format(value)
    return text + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")


def page(regimes: Sequence[Regime], claims: dict[str, list[Claim]], mu: dict[str, Any], figures: dict[str, Path],
         out: Path, command: str, seconds: dict[str, float] | None = None) -> str:
    """The claims page: verdict table, figures, μ fit, every point with its intervals, every comparison."""
    experiment = regimes[0].record.get("config", {}).get("experiment_name") or "?"
    quick = experiment.endswith("_quick")
    lines = ["# The COOL-SD paper's claims on the embedded model" + (" (quick version)" if quick else ""), "",
             f"Experiment: `python run.py -m experiment={experiment}`"
             + (" — the quick version: few images per point, so wide intervals and mostly inconclusive verdicts; "
                "the claims are decided by `experiment=embedded_claims`." if quick else "."), "",
             f"Regenerate: `{command}`. Every number comes from the runs under the input folder; 95 % intervals "
             f"are paired bootstrap intervals over prompts ({regimes[0].resamples} resamples, seed 0). "
             "FID is in the shipped classifier's feature space (not an Inception FID).", ""]
    lines.append("Regimes: " + "; ".join(
        f"**{r.name}** ({r.num_images:,} images per point, drafter `{Path(str(r.record['config']['drafter'].get('checkpoint', ''))).name}`, "
        f"tree `{r.record['config'].get('claims', {}).get('tree')}`)" for r in regimes) + ".")
    if seconds:
        lines.append("Wall time of each run's last `run.py` invocation (`run.json` `wall_s`; a resumed run counts only "
                     "what it generated and scored): " + "; ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
                     + ".")
    lines += ["", "| claim | " + " | ".join(r.name for r in regimes) + " |",
              "|---|" + "---|" * len(regimes)]
    keys: dict[str, str] = {}
    for r in regimes:
        for c in claims[r.name]:
            keys.setdefault(c.key, c.text)
    for key, text in keys.items():
        row = [f"{key}: {text}"]
        for r in regimes:
            c = next((c for c in claims[r.name] if c.key == key), None)
            row.append("—" if c is None else f"**{c.verdict}**" + (f" ({c.note})" if c.note else ""))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Verdicts: held = at least one comparison significantly in the claim's favour and none against "
              "it; not held = one significantly against it; inconclusive = every interval contains 0 (or nothing "
              "could be compared). No multiplicity correction; every comparison is listed below.", ""]
    for name, path in figures.items():
        lines += [f"![{name}]({path.relative_to(out).as_posix() if path.is_relative_to(out) else path})", ""]
    lines += ["## The μ question", ""]
    if "fits" in mu:
        lines.append("R = accepted length of exponential COOL-SD ÷ vanilla SD's, against ω₁ (μ only rescales ω):")
        lines.append("")
        lines += ["| point | ω₁ | R |", "|---|--:|--:|"]
        lines += [f"| {p['label']} | {p['omega1']:.3f} | {p['ratio']:.3f} |" for p in mu["points"]]
        lines.append("")
        for delta, fit in mu["fits"].items():
            target = f"×{fit['paper_ratio']:.3f}"
            if fit["mu"] is None:
                lines.append(f"- δ = {delta} ({target}): outside the measured range of R, not fitted.")
            else:
                lines.append(f"- δ = {delta} ({target}): fitted μ = {_ci_text(fit['mu'], fit['ci'])} "
                             f"({fit['replicates_in_range']} of {fit['resamples']} replicates in range).")
        d = mu.get("difference", {})
        if d.get("value") is not None:
            lines.append(f"- μ(δ=2) − μ(δ=1.1) = {_ci_text(d['value'], d['ci'])}: one μ "
                         + ("fits both ratios." if d["one_mu_fits_both"] else
                            "does **not** fit both: the exponential form with this reading of μ cannot match the paper's two ratios on this model."))
        elif d.get("note"):
            lines.append(f"- {d['note']}")
        if mu.get("fitted_points"):
            lines += ["", "COOL-SD run with the fitted μ (its own run, same prompts and seeds; R paired with "
                      "weak_tree's vanilla SD):", "", "| point | δ | μ (fitted) | ω₁ | R measured | R paper |",
                      "|---|--:|--:|--:|--:|--:|"]
            for f in mu["fitted_points"]:
                lines.append(f"| {f['label']} | {f['delta']:g} | {f['mu']:.3f} | {f['omega1']:.3f} | "
                             f"{_ci_text(f.get('ratio', math.nan), f.get('ratio_ci'))} | "
                             + (f"{f['paper_ratio']:.3f}" if f.get("paper_ratio") else "—") + " |")
            lines.append("")
            lines.append("C1 and C4 with these points are the rows marked (fitted μ) of the table above.")
        elif mu.get("command"):
            lines += ["", f"Not yet run with the fitted μ: `{mu['command']}`, then rerun this page's command."]
    else:
        lines.append(mu.get("note", "not computed"))
    lines += ["", "## Every point", ""]
    for r in regimes:
        lines += [f"### {r.name}", "", "| point | N | accepted length | TV per token | FID (classifier features) | speedup (batch 1) |",
                  "|---|--:|--:|--:|--:|--:|"]
        for p in r.points.values():
            lines.append(f"| {p.label} | {len(p.indices)} | {_ci_text(p.est['tau'], interval(p, 'tau'), '{:.2f}')} | "
                         f"{_ci_text(p.est['tv'], interval(p, 'tv'), '{:.4f}')} | "
                         f"{_ci_text(p.est.get('fid', math.nan), interval(p, 'fid'), '{:.2f}')} | "
                         f"{_ci_text(p.est.get('speedup', math.nan), interval(p, 'speedup'), '{:.2f}')} |")
        lines.append("")
    lines += ["## Every comparison", "", "Differences oriented as written; [95 % interval], two-sided bootstrap p.", ""]
    for r in regimes:
        lines.append(f"### {r.name}")
        lines.append("")
        for c in claims[r.name]:
            lines.append(f"- **{c.key}** ({c.verdict})")
            for comp in c.comparisons:
                side = {"claim": "for the claim", "against": "against the claim", None: "not significant"}[comp.favours]
                p_text = "" if comp.p is None else f", p = {comp.p:.3f}"
                lines.append(f"  - {comp.what}: {_ci_text(comp.difference, comp.ci, '{:.4f}')}{p_text} ({side})")
            if not c.comparisons:
                lines.append("  - no comparison could be made")
        lines.append("")
    return "\n".join(lines) + "\n"


def run(folder: Path, out: Path, resamples: int = 1000, command: str | None = None,
        device: str = "cpu") -> dict[str, Any]:
    """Load every regime below ``folder``, decide the claims, write ``<out>/embedded_claims.md``, its figures
    (``<out>/figures/embedded_claims_*``) and ``<out>/embedded_claims.json``; returns the JSON record."""
    folders = sorted(p.parent for p in Path(folder).glob("*/run.json"))
    if (Path(folder) / "run.json").is_file():
        folders = [Path(folder)]
    if not folders:
        raise FileNotFoundError(f"no run.json below {folder}: run `python run.py -m experiment=embedded_claims` first")
    regimes, extra = [], None
    for f in folders:
        regime = load_regime(f, device=device)
        compute(regime, resamples=resamples, device=device)
        if f.name == FITTED_REGIME:
            extra = regime
        else:
            regimes.append(regime)
    if not regimes:
        raise FileNotFoundError(f"{folder}: only the {FITTED_REGIME} run is here; it adds points to weak_tree's")
    weak = next((r for r in regimes if r.name == "weak_tree"), None)  # the μ fit is about the paper's regime
    mu = fit_mu(weak) if weak else {"note": "not fitted: the weak_tree regime (the paper's) is not among the runs "
                                            "(python run.py -m experiment=<this experiment> regime=weak_tree)"}
    if weak is not None:
        mu["command"] = fitted_command(weak, mu, Path(folder))
        if extra is not None:
            mu["fitted_points"] = fitted_points(weak, merge_fitted(weak, extra), extra)
            mu["fitted_folder"] = str(extra.folder)
    elif extra is not None:
        raise ValueError(f"{extra.folder}: a {FITTED_REGIME} run needs the weak_tree run beside it")
    claims = {r.name: decide(r) for r in regimes}
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    figures = {
        "FID vs accepted length": frontier_figure(regimes, "fid", "FID, classifier features (lower is better)",
                                                  figs / "embedded_claims_fid"),
        "TV per token vs accepted length": frontier_figure(regimes, "tv", "TV per committed token",
                                                           figs / "embedded_claims_tv"),
        "schedule ablation": frontier_figure(regimes, "tv", "TV per committed token", figs / "embedded_claims_schedules",
                                             families=["COOL-SD (exponential, μ=mean)", "COOL-SD (exponential, μ=first)",
                                                       "UniformRSD", "COOL-SD (linear)", "vanilla SD"]),
        "G* vs reference resampling by k": gstar_figure(regimes, figs / "embedded_claims_gstar"),
    }
    seconds = {r.name: float(r.record["wall_s"]) for r in regimes + ([extra] if extra else []) if r.record.get("wall_s")}
    text = page(regimes, claims, mu, figures, out, command or f"python scripts/claims.py {folder} --out {out}", seconds)
    atomic_write_bytes(out / "embedded_claims.md", text.encode())
    record = {"claims": {r: [{"key": c.key, "text": c.text, "verdict": c.verdict, "note": c.note,
                              "comparisons": [vars(x) for x in c.comparisons]} for c in cs] for r, cs in claims.items()},
              "mu": mu, "regimes": {r.name: {"folder": str(r.folder), "num_images": r.num_images,
                                            "points": {p.name: {"label": p.label, **p.est} for p in r.points.values()}}
                                    for r in regimes}}
    atomic_write_bytes(out / "embedded_claims.json", (json.dumps(record, indent=2, default=float) + "\n").encode())
    return record
