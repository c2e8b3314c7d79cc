"""The claims' statistics: frontiers interpolated in accepted length, paired comparisons with Holm's correction
within each claim, non-inferiority, crossings along τ, direct dominance, the verdicts C1–C4, and the μ fit."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from coolsd.schedules import omega_table
from eval import stats
from eval.claims.data import (
    HELD,
    INCONCLUSIVE,
    LEVEL,
    MARGINS,
    NOT_COMPARED,
    NOT_HELD,
    PAPER_RATIOS,
    Point,
    Regime,
    _ci_text,
)
from eval.labels import STRENGTH

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
    favours: str | None  # "claim" | "against" | None (not significant after Holm, or not compared)
    sign: float = 1.0  # sign * difference < 0 favours the claim
    tau: float | None = None  # the accepted length it was made at (frontier comparisons)
    p_holm: float | None = None  # Holm-adjusted within its claim (``holm_family``)
    kind: str = "difference"  # or "non-inferiority" (favours: "claim" = shown, "against" = shown worse)

    @property
    def made(self) -> bool:
        return self.ci is not None


def compare(what: str, estimate: float, replicates: np.ndarray, sign: float = 1.0,
            tau: float | None = None) -> Comparison:
    """A difference oriented so that ``sign * difference < 0`` favours the claim. ``favours`` here is the
    uncorrected call (interval excludes 0); ``holm_family`` replaces it by the Holm-corrected one."""
    if not math.isfinite(estimate):
        return Comparison(what + " (outside the curve's range: not compared)", estimate, None, None, None, sign, tau)
    d = stats.bootstrap_difference(estimate, replicates, LEVEL)
    ci = d["ci"]
    favours = None
    if ci is not None:
        lo, hi = sorted((sign * ci[0], sign * ci[1]))
        favours = "claim" if hi < 0 else "against" if lo > 0 else None
    return Comparison(what, estimate, ci, d["p"], favours, sign, tau)


def holm_family(comparisons: Sequence[Comparison]) -> list[Comparison]:
    """Holm's correction over one claim's comparisons in one regime (the family; ``eval.stats.holm``): a
    comparison counts for or against the claim only when its adjusted p is below 1 − LEVEL, in the direction
    of its estimate. Comparisons that could not be made stay out of the family."""
    adjusted = stats.holm([c.p if c.made else None for c in comparisons])
    for c, p in zip(comparisons, adjusted):
        c.p_holm = p
        if p is None:
            c.favours = None
        else:
            c.favours = None if p >= 1 - LEVEL else "claim" if c.sign * c.difference < 0 else "against"
    return list(comparisons)


def verdict(comparisons: Sequence[Comparison]) -> str:
    """held: one comparison significantly for the claim (Holm) and none against; not held: one against;
    inconclusive: compared, none significant; not compared: no comparison could be made."""
    made = [c for c in comparisons if c.made]
    if not made:
        return NOT_COMPARED
    if any(c.favours == "against" for c in made):
        return NOT_HELD
    if any(c.favours == "claim" for c in made):
        return HELD
    return INCONCLUSIVE


def combine(*verdicts: str) -> str:
    if NOT_HELD in verdicts:
        return NOT_HELD
    if all(v == NOT_COMPARED for v in verdicts):
        return NOT_COMPARED
    return HELD if all(v == HELD for v in verdicts) else INCONCLUSIVE


def regions(comparisons: Sequence[Comparison]) -> str:
    """Where along the accepted length a frontier claim holds, fails or is undecided: the made comparisons
    ordered by accepted length, runs of the same outcome joined, e.g. ``τ 2.72–3.31: for; τ 3.80: against``."""
    made = sorted((c for c in comparisons if c.made and c.tau is not None), key=lambda c: c.tau)
    if not made:
        return ""
    word = {"claim": "for", "against": "against", None: "n.s."}
    runs: list[list[Any]] = []
    for c in made:
        if runs and runs[-1][0] == c.favours:
            runs[-1][2] = c.tau
        else:
            runs.append([c.favours, c.tau, c.tau])
    return "; ".join(f"τ {lo:.2f}" + (f"–{hi:.2f}" if hi > lo else "") + f": {word[f]}" for f, lo, hi in runs)


@dataclass
class Claim:
    key: str
    text: str
    verdict: str
    comparisons: list[Comparison]
    note: str = ""
    dominance: list[str] = field(default_factory=list)  # direct dominance between points (C1)
    #: how many direct dominance pairs each side wins, per metric (C1): {"TV/token": {"ours": n, "theirs": m}, ...}
    dominance_counts: dict[str, dict[str, int]] = field(default_factory=dict)


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
        out.append(compare(f"{name}: {label_of(ours)} − {q.label} at accepted length {q.est['tau']:.2f}", est, reps,
                           tau=q.est["tau"]))
    return out


def dominance(ours: Sequence[Point], theirs: Sequence[Point], key: str, name: str) -> list[tuple[str, str]]:
    """Direct dominance, no interpolation: a point of one side with a significantly higher accepted length and a
    significantly lower ``key`` than a point of the other (both paired 95 % intervals exclude 0; uncorrected).
    Each pair as (the winning side, "ours" or "theirs"; its text)."""
    out = []
    for a in ours:
        for b in theirs:
            for x, y, side in ((a, b, "ours"), (b, a, "theirs")):
                dt = stats.bootstrap_difference(x.est["tau"] - y.est["tau"], x.reps["tau"] - y.reps["tau"], LEVEL)
                dk = stats.bootstrap_difference(x.est[key] - y.est[key], x.reps[key] - y.reps[key], LEVEL)
                if dt["ci"] and dk["ci"] and dt["ci"][0] > 0 and dk["ci"][1] < 0:
                    out.append((side, f"{x.label} dominates {y.label} (accepted length "
                                      f"{_ci_text(dt['difference'], dt['ci'], '{:+.2f}')}, {name} "
                                      f"{_ci_text(dk['difference'], dk['ci'], '{:+.3f}' if key == 'tv' else '{:+.2f}')})"))
    return out


def label_of(points: Sequence[Point]) -> str:
    p = points[0]
    text = p.label.split(" δ=")[0].split(" k=")[0]
    schedule = p.config.get("schedule")
    return f"{text} ({schedule})" if p.method == "coolsd" and schedule else text


def decide(regime: Regime) -> list[Claim]:
    """C1–C4 on one regime; with fitted-μ points (``merge_fitted``) also C1 and C4 with COOL-SD at the fitted μ."""
    # every exponential point, whatever its μ (mean, first, a fitted number), is a point of the one exponential
    # family: the curve joins them all (the fitted μ's claims below use the fitted points alone as well)
    cool = curve([p for p in regime.points.values() if p.method == "coolsd"
                  and p.config.get("schedule", "exponential") == "exponential"])
    claims = [frontier_c1(regime, cool, "C1", "COOL-SD's frontier (accepted length vs TV per token and FID) dominates LANTERN++'s"),
              *schedule_c2(regime, cool), *resampling_c3(regime),
              speed_c4(regime, cool, "C4", "COOL-SD at δ = 1.1 is faster than vanilla SD at comparable quality")]
    fit = curve([p for p in cool if fitted(p)])
    if fit:
        claims.append(frontier_c1(regime, fit, "C1 (fitted μ)",
                                  "C1 with COOL-SD at the fitted μ (δ = 1.1 and 2, each with its own μ)"))
        claims.append(speed_c4(regime, fit, "C4 (fitted μ)", "C4 with COOL-SD at δ = 1.1 and its fitted μ"))
    return claims


def lantern_pp_baseline(regime: Regime) -> list[Point]:
    """LANTERN++'s published points: the resampling its published code uses on the regime's path
    (``claims.lantern_pp_resample``: ``reference_q`` on LlamaGen-style static trees, ``reference`` on chains);
    ``reference`` when the config names none."""
    path = regime.record.get("config", {}).get("claims", {}).get("lantern_pp_resample", "reference")
    return [p for p in select(regime, "lantern_pp") if p.config.get("resample", "reference") == path]


def frontier_c1(regime: Regime, cool: list[Point], key: str, text: str) -> Claim:
    """C1 on TV per token and FID (one Holm family over both metrics' comparisons), with the crossings along τ and the
    direct dominance pairs."""
    theirs = lantern_pp_baseline(regime)
    tv = frontier_claim(cool, theirs, "tv", "TV/token")
    fid = frontier_claim(cool, theirs, "fid", "FID") if all("fid" in p.est for p in [*cool, *theirs]) else []
    holm_family(tv + fid)  # one family: the claim's comparisons in this regime
    v_tv, v_fid = verdict(tv), verdict(fid)
    note = f"TV: {v_tv}" + (f" ({regions(tv)})" if regions(tv) else "") + f"; FID: {v_fid}" + (
        f" ({regions(fid)})" if regions(fid) else "")
    if len(cool) < 2:
        note = "needs two COOL-SD points"
    pairs = {"TV/token": dominance(cool, theirs, "tv", "TV/token")}
    if fid:
        pairs["FID"] = dominance(cool, theirs, "fid", "FID")
    counts = {m: {side: sum(s == side for s, _ in ps) for side in ("ours", "theirs")} for m, ps in pairs.items()}
    return Claim(key, text, combine(v_tv, v_fid) if fid else v_tv, tv + fid, note,
                 [t for ps in pairs.values() for _, t in ps], counts)


def schedule_c2(regime: Regime, cool: list[Point]) -> list[Claim]:
    uniform = curve(select(regime, "coolsd", schedule="uniform"))
    linear = curve(select(regime, "coolsd", schedule="linear"))
    tu, fu = (frontier_claim(cool, uniform, k, n) for k, n in (("tv", "TV/token"), ("fid", "FID")))
    tl, fl = (frontier_claim(cool, linear, k, n) for k, n in (("tv", "TV/token"), ("fid", "FID")))
    holm_family(tu + fu), holm_family(tl + fl)  # a family per claim
    tv_u, fid_u, tv_l, fid_l = verdict(tu), verdict(fu), verdict(tl), verdict(fl)

    def where(c: list[Comparison]) -> str:
        return f" ({regions(c)})" if regions(c) else ""
    return [Claim("C2a", "at matched accepted length the exponential schedule gives lower TV and FID than "
                  "the uniform one (UniformRSD)", combine(tv_u, fid_u), tu + fu,
                  f"TV: {tv_u}{where(tu)}; FID: {fid_u}{where(fu)}"),
            Claim("C2b", "exponential ≥ linear at matched accepted length (TV and FID)", verdict(tl + fl),
                  tl + fl, f"TV: {tv_l}{where(tl)}; FID: {fid_l}{where(fl)}")]


def resampling_c3(regime: Regime) -> list[Claim]:
    c3, c3k = [], []
    lpp_ref = lantern_pp_baseline(regime)
    gstar = [p for p in select(regime, "lantern_pp") if p.config.get("resample") == "optimal"]
    pairs = []
    for g in gstar:
        ref = [p for p in lpp_ref if p.config.get("k") == g.config.get("k") and p.config.get("lam") == g.config.get("lam")]
        if ref:
            pairs.append((g, ref[0]))
            for key, name in (("tv", "TV/token"), ("fid", "FID")):
                c3.append(compare(f"{name}: {g.label} − its published resampling", g.est[key] - ref[0].est[key],
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
    c3, c3k = holm_family(c3), holm_family(c3k)
    return [Claim("C3a", "G* improves LANTERN++ over its published resampling (TV, FID)", verdict(c3), c3),
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
    c4 = holm_family(c4)
    # "comparable quality": non-inferiority with the margins fixed before the run (MARGINS, claims.margins)
    margins = {**MARGINS, **regime.record.get("config", {}).get("claims", {}).get("margins", {})}
    quality: list[Comparison] = []
    if sd is not None and c11:
        p = c11[0]
        # FID only: vanilla SD is lossless, so any relaxation has TV > 0 against it; the TV margin serves
        # statements between two relaxed methods
        tests = [("FID", "fid", margins["fid_relative"] * sd.est["fid"])] if "fid" in sd.est and "fid" in p.est else []
        for name, k, margin in tests:
            ni = stats.non_inferiority(p.est[k] - sd.est[k], p.reps[k] - sd.reps[k], margin, LEVEL)
            two_sided = stats.bootstrap_difference(ni["difference"], p.reps[k] - sd.reps[k], LEVEL)["ci"]
            # shown comparable (upper bound below the margin), shown worse (the whole interval above it), or neither
            ok = ni["non_inferior"]
            if ok is False and not (two_sided and two_sided[0] > margin):
                ok = None
            quality.append(Comparison(
                f"{name} non-inferiority: COOL-SD δ=1.1 − vanilla SD < margin {margin:.4g} (one-sided upper "
                f"{LEVEL:.0%} bound {ni['upper']:.4g})" if ni["upper"] is not None else f"{name}: not compared",
                ni["difference"], None if ni["upper"] is None else [-math.inf, ni["upper"]], ni["p"],
                None if ok is None else "claim" if ok else "against", kind="non-inferiority"))
    speed = verdict(c4)
    comparable = all(c.favours == "claim" for c in quality) and bool(quality)
    if speed == NOT_COMPARED:
        v4 = NOT_COMPARED
    elif speed == NOT_HELD:
        v4 = NOT_HELD
    elif speed == HELD:
        v4 = HELD if comparable else NOT_HELD if any(c.favours == "against" for c in quality) else INCONCLUSIVE
    else:
        v4 = INCONCLUSIVE
    side = {"claim": "for", "against": "against", None: "n.s."}
    note = "; ".join(f"{c.what.split(':')[0]}: {side[c.favours]}" for c in c4) + "; " + "; ".join(
        f"{c.what.split(':')[0]}: {'shown' if c.favours == 'claim' else 'not shown'}" for c in quality)
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
    out: dict[str, Any] = {"points": [{"label": p.label, "omega1": omega1(p), "ratio": float(r),
                                       "ratio_ci": stats.percentile_interval(rep_r[:, j], LEVEL),
                                       "mu": str(p.config.get("mu", "mean")), "delta": strength(p)}
                                      for j, (p, r) in enumerate(zip(exp, est_r))], "fits": {}}
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
    # how strongly acceptance responds to relaxation: the rise of R over the factor 2/1.1 in ω₁ that separates
    # the paper's two δ at one μ, from the ω₁ where R matches the paper's δ = 1.1 ratio (paper: 1.380 − 1.128)
    step = math.log(2.0 / 1.1)

    def rise(ratios: np.ndarray) -> float:
        start = solve(ratios, PAPER_RATIOS[1.1])
        if not math.isfinite(start) or start + step > x[-1]:
            return math.nan
        return float(np.interp(start + step, x, ratios)) - PAPER_RATIOS[1.1]

    paper_rise = PAPER_RATIOS[2.0] - PAPER_RATIOS[1.1]
    est_rise = rise(est_r)
    rep_rise = np.array([rise(rb) for rb in rep_r])
    ok = rep_rise[np.isfinite(rep_rise) & (rep_rise > 0)]
    out["response"] = {"paper_rise": paper_rise, "rise": est_rise if math.isfinite(est_rise) else None,
                       "rise_ci": stats.percentile_interval(rep_rise[np.isfinite(rep_rise)], LEVEL)
                       if math.isfinite(est_rise) and np.isfinite(rep_rise).sum() >= 2 else None,
                       "times_weaker": paper_rise / est_rise if math.isfinite(est_rise) and est_rise > 0 else None,
                       "times_weaker_ci": stats.percentile_interval(paper_rise / ok, LEVEL)
                       if math.isfinite(est_rise) and est_rise > 0 and len(ok) >= 2 else None}
    (e1, r1), (e2, r2) = mus[1.1], mus[2.0]
    if math.isfinite(e1) and math.isfinite(e2):
        c = compare("μ(δ=2) − μ(δ=1.1)", e2 - e1, r2 - r1)
        out["difference"] = {"value": c.difference, "ci": c.ci, "p": c.p,
                             "one_mu_fits_both": c.ci is not None and c.ci[0] <= 0 <= c.ci[1]}
    else:
        out["difference"] = {"value": None, "ci": None, "p": None, "one_mu_fits_both": None,
                             "note": "a paper ratio lies outside the measured range of R: no extrapolation"}
    return out
