"""The claims page (``embedded_claims.md``), its JSON record, and ``run``: load, decide, draw, write."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from coolsd.io import atomic_write_bytes
from eval.report.labels import RESAMPLING
from eval.studies.claims.analysis import (
    FITTED_REGIME,
    Claim,
    POWER_TARGET,
    VERDICT_RULE,
    Comparison,
    decide,
    decide_extensions,
    lossless_calibration,
    fit_mu,
    fitted_command,
    fitted_points,
    merge_fitted,
)
from eval.studies.claims.data import (
    COMPACT_SUFFIX,
    INCONCLUSIVE,
    MARGIN_RATIONALE,
    MARGINS,
    NOT_HELD,
    UNDERPOWERED,
    Regime,
    _ci_text,
    compute,
    extend,
    interval,
    is_more,
    load_compact,
    load_regime,
    more_info,
    save_compact,
    subset,
)
from eval.studies.claims.figures import frontier_figure, gstar_figure, mu_figure

# ------------------------------------------------------------------------------------------------ page



def verdict_table(regimes: Sequence[Regime], claims: dict[str, list[Claim]], heads: Sequence[str],
                  numbers: bool = False) -> list[str]:
    """A markdown table, a row per claim and a column per regime: its verdict and note; with ``numbers`` also the
    comparisons that decide it (``_deciding``) with their intervals."""
    lines = ["| claim | " + " | ".join(heads) + " |", "|---|" + "---|" * len(regimes)]
    keys: dict[str, str] = {}
    for r in regimes:
        for c in claims[r.name]:
            keys.setdefault(c.key, c.text)
    for key, text in keys.items():
        row = [f"{key}: {text}"]
        for r in regimes:
            c = next((c for c in claims[r.name] if c.key == key), None)
            row.append("—" if c is None else f"**{c.verdict}**" + _at_text(c) + (f" ({c.note})" if c.note else "")
                       + _unrun_text(c) + ("".join(f"; {_comparison_text(x)}" for x in _deciding(c)) if numbers
                                           else ""))
        lines.append("| " + " | ".join(row) + " |")
    return lines


#: the most images per point this page gives a deciding point (issue 60: decide every verdict that 10,000 or fewer
#: images can decide); a test still underpowered that needs more says so and is not extended
MAX_IMAGES = 10_000
#: the seed regimes' note in "Every comparison": they compare the drafters at equal N and are not extended
SEED_NOTE = ("The drafters are compared at equal N (1,000 images per point, the \"Robustness across drafters\" "
             "table); a test underpowered here is not given more images, which would break that equality.")


def _unrun_text(c: Claim) -> str:
    """For a claim with an underpowered metric: why its deciding points were not given the images it needs (more
    than ``MAX_IMAGES`` per point), or the command that would (``experiment=embedded_claims_more``)."""
    low = sorted({x.metric for x in c.comparisons if x.made and x.kind == "difference" and x.power is not None
                  and x.power < POWER_TARGET and c.metric_verdicts.get(x.metric) == INCONCLUSIVE})
    against = [m for m, v in c.metric_verdicts.items() if v == NOT_HELD]
    if c.verdict == NOT_HELD and low and against:  # more images could not change the claim's verdict
        return (f" ({', '.join(low)} not given more images: the claim is not held on {', '.join(against)} whatever "
                f"{', '.join(low)} shows)")
    need = [x.n_80 for x in c.comparisons if x.made and x.n_80 is not None and x.power is not None
            and x.power < POWER_TARGET and x.favours is None
            and (x.kind == "non-inferiority" or c.metric_verdicts.get(x.metric) == INCONCLUSIVE)]
    if not need or not (UNDERPOWERED in c.metric_verdicts.values() or low):
        return ""
    if max(need) > MAX_IMAGES:
        return (f" (not given more images: power 0.8 needs N ≈ {max(need):,}, above the {MAX_IMAGES:,} images per "
                "point this page gives a deciding point)")
    return f" (power 0.8 needs N ≈ {max(need):,}: `python run.py -m experiment=embedded_claims_more` would decide it)"


def _at_text(c: Claim) -> str:
    """Where a claim decided on an extension was decided, and what its regime's own images had said."""
    if c.images is None or c.before is None:
        return ""
    was = c.before.verdict
    ni = [x for x in c.before.comparisons if x.made and x.kind == "non-inferiority" and x.power is not None]
    if ni:
        low = min(ni, key=lambda x: x.power)
        was += f", its {low.metric} test's power {low.power:.2f} at {low.n:,} images"
    return f" at {c.images:,} images per point (its deciding points extended, `{c.extension}`; before: {was})"


def page(regimes: Sequence[Regime], claims: dict[str, list[Claim]], mu: dict[str, Any], figures: dict[str, Path],
         out: Path, command: str, seconds: dict[str, float] | None = None,
         robustness: Sequence[dict[str, Any]] = (), seeds: Sequence[Regime] = (),
         calibration: dict[str, Any] | None = None, bias: dict[str, Any] | None = None,
         spread: Sequence[dict[str, Any]] = (), extended: Sequence[dict[str, Any]] = ()) -> str:
    """The claims page: verdict table, figures, μ fit, every point with its intervals, every comparison;
    ``extended`` (``decide_extensions``): the claims decided with more images of their deciding points."""
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
    if extended:
        lines += ["", EXTENSION_TEXT + " " + "; ".join(
            f"`{e['name']}`: {', '.join(e['points'])} at {e['images']:,} images per point (images "
            f"{e['offset']:,}–{e['images'] - 1:,} added), deciding {', '.join(e['decides'])} of {e['base']}"
            for e in extended) + "."]
    lines += ["", *verdict_table(regimes, claims, [r.name for r in regimes])]
    lines += ["", "**The verdict rule.** " + VERDICT_RULE + " τ ranges give where along the accepted length a "
              "frontier comparison is for, against or not significant (n.s.).", "",
              "**Tests, seeds and false alarms.** Every interval and test uses the same paired bootstrap "
              f"({regimes[0].resamples:,} resamples of the images, seed 0; `eval.metrics.intervals.Bootstrap`): "
              "differences and non-inferiority as the verdict rule says (5 % two-sided, Holm within each claim and regime); the "
              "direct dominance pairs of C1 are uncorrected (each pair: both 95 % intervals exclude 0; no "
              "multiplicity correction, so with many pairs some can be false alarms); the μ fit's intervals are 95 % "
              "percentile intervals (same seed). Powers are normal approximations from the replicates' standard "
              "deviation at the test's one-sided 2.5 % (Holm's correction left out). An inconclusive FID difference "
              "(C1, C2a, C3) gives its power to find a true difference of the FID margin (10 % of the baseline "
              "point's FID) by the same two-sided 5 % test, so \"inconclusive\" says whether a difference of that "
              "size would likely have been found.", "",
              "**Margins.** " + MARGIN_RATIONALE, ""]
    if calibration:
        cal = calibration
        lines += ["**What the FID non-inferiority test does at no difference.** The lossless decoders ("
                  + ", ".join(f"{k} {v:.2f}" for k, v in cal["decoders"].items())
                  + f"; the same {cal['n']:,} prompts) sample one distribution, yet their FIDs spread by "
                  f"{cal['spread']:.2f} ({cal['relative_spread']:.1%} of the lowest), against a margin of "
                  f"{cal['margin']:.0%}. Tested against each other as COOL-SD is against vanilla SD, "
                  f"{cal['shown']} of {len(cal['pairs'])} ordered pairs are shown non-inferior (mean power at no "
                  f"difference {cal['mean_power']:.2f}): at this N a failure to show non-inferiority is what the "
                  "test does most of the time when there is nothing to find, hence \"underpowered at N\".", "",
                  "| decoder ÷ baseline | FID ratio [95 %] | shown (upper end < "
                  f"{1 + cal['margin']:g}) | power at no difference |", "|---|--:|--:|--:|"]
        lines += [f"| {x['a']} ÷ {x['b']} | {_ci_text(x['ratio'], x['ci'])} | {'yes' if x['shown'] else 'no'} | "
                  f"{x['power']:.2f} |" for x in cal["pairs"]]
        lines.append("")
    if bias:
        lines += [f"**FID's bias at N.** FID is biased upward at finite N; by 1/N extrapolation from the first "
                  f"{bias['n_small']:,} images to all {bias['n']:,} (bias at {bias['n']:,} ≈ FID({bias['n_small']:,}) "
                  f"− FID({bias['n']:,})), it is about {bias['lo']:.1f}–{bias['hi']:.1f} at {bias['n']:,} images "
                  f"(median {bias['median']:.1f} over weak_tree's points), against a fixed reference of 2,000 test "
                  "images; a paired difference carries only the difference of its two points' biases (small beside "
                  "the intervals for points of similar FID), but no FID here is comparable with an FID at another N "
                  "or reference.", ""]
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
                         + ("fits both ratios." if d["one_mu_fits_both"] else "does **not** fit both on this model."))
        elif d.get("note"):
            lines.append(f"- {d['note']}")
        resp = mu.get("response", {})
        if resp.get("rise") is not None:
            weaker = resp.get("times_weaker")
            lines.append(
                f"- Why: at one μ the paper's δ = 1.1 and δ = 2 differ by the factor 2/1.1 in ω₁, over which the "
                f"paper's R rises by {resp['paper_rise']:.3f} (×1.128 → ×1.380). Here, from the ω₁ where R = 1.128, "
                f"R rises by {_ci_text(resp['rise'], resp['rise_ci'])} over the same factor"
                + (f": this model's acceptance responds {_ci_text(weaker, resp['times_weaker_ci'], '{:.1f}')}× less "
                   "to relaxation than the paper's LlamaGen. That is a property of the model and drafter, not of how "
                   "μ is defined: every reading of μ only moves the points along the same curve of R against ω₁."
                   if weaker else "."))
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
    if robustness:
        names = list(robustness[0]["verdicts"])
        lines += ["", "## Robustness across drafters", "",
                  "The decisive points (C1, C2 and C4 at δ = 1.1 and at the fitted μ) again with weak drafters trained "
                  "with other seeds (the same pipeline, `configs/regime/weak_tree_seed.yaml`; "
                  + "; ".join(f"{r.name}: {r.num_images:,} images per point, vanilla SD accepts "
                              f"{r.points['sd'].est['tau']:.2f}" for r in seeds if "sd" in r.points)
                  + f"). {SEED0} is the shipped drafter (seed 0, weak_tree's run) decided on exactly the seed runs' "
                  "images and points, so the three drafters are compared at equal N; weak_tree (all its images and "
                  "points) is shown beside them. Every column is decided by the same rule (Holm within each claim and "
                  "regime); \"the same for every drafter\" compares the three equal-N columns.", "",
                  "| claim | " + " | ".join(names) + " | the same for every drafter (equal N) |",
                  "|---|" + "---|" * (len(names) + 1)]
        for row in robustness:
            lines.append(f"| {row['claim']} | " + " | ".join(str(v) if v else "—" for v in row["verdicts"].values())
                         + f" | {'yes' if row['same'] else '**no**'} |")
        if spread:
            heads = list(spread[0]["values"])
            lines += ["", "The deciding comparison of each claim (chosen on seed 0 as in the summary; the same "
                      "comparison, at each drafter's own accepted length, for the others) with its estimate per "
                      "drafter, their spread and the mean half-width of their 95 % intervals:", "",
                      "| claim | comparison | " + " | ".join(heads) + " | spread (max − min) | mean 95 % half-width |",
                      "|---|---|" + "--:|" * (len(heads) + 2)]
            for x in spread:
                fmt = "{:.4f}" if x["metric"] != "FID" else "{:.3f}"
                lines.append(f"| {x['claim']} | {x['what']} | " + " | ".join(
                    _ci_text(v, ci, fmt) for v, ci in zip(x["values"].values(), x["cis"].values()))
                             + f" | {fmt.format(x['spread'])} | {fmt.format(x['half_width'])} |")
            lines += ["", robustness_conclusion(robustness, spread)]
    lines += ["", "## Every point", ""]
    for r in [*regimes, *seeds, *(e["regime"] for e in extended)]:
        lines += [f"### {r.name}", "", "| point | N | accepted length | TV per token | FID (classifier features) | speedup (batch 1) |",
                  "|---|--:|--:|--:|--:|--:|"]
        for p in r.points.values():
            lines.append(f"| {p.label} | {len(p.indices)} | {_ci_text(p.est['tau'], interval(p, 'tau'), '{:.2f}')} | "
                         f"{_ci_text(p.est['tv'], interval(p, 'tv'), '{:.4f}')} | "
                         f"{_ci_text(p.est.get('fid', math.nan), interval(p, 'fid'), '{:.2f}')} | "
                         f"{_ci_text(p.est.get('speedup', math.nan), interval(p, 'speedup'), '{:.2f}')} |")
        lines.append("")
    lines += ["## Every comparison", "", "Differences oriented as written; [95 % interval], two-sided bootstrap p "
              "(and Holm-adjusted within its claim; \"p ≤ 0.0002\": no replicate beyond the null, the floor of a "
              f"bootstrap p at {regimes[0].resamples:,} resamples); non-inferiority rows test Δ = margin (a ratio: "
              "the ratio = 1 + margin) and give the power at no difference, the smallest margin with power 0.8 at "
              "this N and the images that would give power 0.8 at the margin (normal approximation, standard error "
              "∝ 1/√N).", ""]
    for r in [*regimes, *seeds]:
        lines.append(f"### {r.name}")
        lines.append("")
        if r in seeds:
            lines += [SEED_NOTE, ""]
        for c in claims[r.name]:
            lines.append(f"- **{c.key}** ({c.verdict}{_at_text(c)}{'' if r in seeds else _unrun_text(c)})")
            earlier = {id(x) for x in c.before.comparisons} if c.before is not None else set()
            for comp in _with_before(c):
                words = ({"claim": "non-inferior: shown", "against": "worse than the margin", None: "not shown"}
                         if comp.kind == "non-inferiority" else
                         {"claim": "for the claim", "against": "against the claim", None: "not significant"})
                side = "not compared" if not comp.made else words[comp.favours]
                if comp.made and comp.kind == "non-inferiority" and comp.favours is None and comp.power < POWER_TARGET:
                    side = f"underpowered at N = {comp.n:,}"
                p_text = "" if comp.p is None else f", {_p('p', comp.p, comp.p_floor)}" + (
                    "" if comp.p_holm is None else f", Holm {_p('p', comp.p_holm, comp.p_floor)}")
                extra = f"; {_ni_text(comp)}" if comp.made and comp.kind == "non-inferiority" else ""
                if comp.made and comp.kind == "difference" and comp.power is not None:
                    extra = f"; {_power_text(comp)}"
                before = f" [on the regime's own {r.num_images:,} images, before]" if id(comp) in earlier else ""
                lines.append(f"  - {comp.what}{before}: {_ci_text(comp.difference, comp.ci, '{:.4f}')}{p_text}{extra} "
                             f"({side})")
            if not c.comparisons:
                lines.append("  - no comparison could be made")
            for d in c.dominance:
                lines.append(f"  - direct dominance: {d}")
        lines.append("")
    return "\n".join(lines) + "\n"


#: what the page says of the claims decided with more images of their deciding points (``decide_extensions``)
EXTENSION_TEXT = (
    "**Decided with more images.** Where a regime's own images left a claim's FID non-inferiority test "
    "underpowered (power below 0.8 at no difference), its deciding points were given the images the power "
    "calculation asked for, and nothing else: the regime's prompts and seeds continued (image i has seed 0 + i and "
    "class i mod 10, `python run.py -m experiment=embedded_claims_more`), joined to its first images "
    "(`scripts/claims.py --extend`), and the claim decided again on all of them by the same rule (one paired "
    "bootstrap over every image, its whole Holm family, the speedups still from the regime's own timed prompts). "
    "The lossless calibration, the equal-N drafter table and the figures stay on the regimes' own images. The "
    "extensions:")


def _with_before(c: Claim) -> list[Comparison]:
    """A claim's comparisons, and for one decided on an extension also those it made before on the regime's own
    images (their ``n`` says which)."""
    return [*c.comparisons, *(c.before.comparisons if c.before is not None else [])]


def _power_text(x: Comparison) -> str:
    """An inconclusive difference's power to find its effect (``analysis.compare``)."""
    return (f"power {x.power:.2f} to find a difference of ±{x.effect:.2f} ({x.effect_share:.0%} of the baseline's "
            f"{x.metric}); the difference found with power {POWER_TARGET:g} at this N: {x.margin_80:.2f}; power "
            f"{POWER_TARGET:g} at ±{x.effect:.2f} needs N ≈ {x.n_80:,}")


#: the README's block that ``run(..., readme=...)`` rewrites with ``summary``: everything between the markers
README_BEGIN = "<!-- claims summary: written by scripts/claims.py --readme; edits inside are overwritten -->"
README_END = "<!-- end of the claims summary -->"


def _deciding(c: Claim) -> list[Comparison]:
    """The comparisons that decide ``c``: of its differences, the first one against it, else the most significant
    one for it, else the one with the smallest p (Holm-adjusted where there is one); and its non-inferiority tests."""
    def p_of(x: Comparison) -> float:
        return x.p_holm if x.p_holm is not None else x.p if x.p is not None else 1.0
    made = [x for x in c.comparisons if x.made and x.kind != "non-inferiority"]
    pick = []
    for side in ("against", "claim", None):
        ranked = sorted((x for x in made if x.favours == side), key=p_of)
        if ranked:
            pick = [ranked[0]]
            break
    return pick + [x for x in c.comparisons if x.made and x.kind == "non-inferiority"]


def _p(name: str, p: float | None, floor: bool) -> str:
    """``p = 0.0123``, or ``p ≤ 0.0002`` where the bootstrap p is at its floor (no replicate beyond the null)."""
    return "" if p is None else f"{name} {'≤' if floor else '='} {p:.4f}"


def _ni_text(x: Comparison) -> str:
    """A non-inferiority test's numbers: estimate, its interval's upper end against the null, the power at no
    difference, the smallest margin with power 0.8, the images for power 0.8."""
    ratio = x.null > 0.5 and x.metric == "FID"
    fmt = "{:.3f}" if ratio else "{:+.4f}"
    unit = (lambda v: f"{v:.1%}") if ratio else (lambda v: f"{v:.4f}")
    return (f"{fmt.format(x.difference)} (95 % upper end {fmt.format(x.ci[1])} vs {x.null:g}); power at no "
            f"difference {x.power:.2f}; margin with power {POWER_TARGET:g} at this N: {unit(x.margin_80)}; "
            f"power {POWER_TARGET:g} at the margin needs N ≈ {x.n_80:,}")


def _comparison_text(x: Comparison) -> str:
    what = x.what
    if x.kind == "non-inferiority":
        return f"{what}: {_ni_text(x)}" + (f", Holm {_p('p', x.p_holm, x.p_floor)}" if x.p_holm is not None else "")
    fmt = "{:+.3f}" if abs(x.difference) < 0.1 else "{:+.2f}"
    text = f"{what}: {_ci_text(x.difference, x.ci, fmt)}"
    if x.power is not None and x.favours is None:
        text += f" (power {x.power:.2f} to find ±{x.effect:.2f}, {x.effect_share:.0%} of the baseline's {x.metric})"
    if x.p_holm is not None:
        return text + f", Holm {_p('p', x.p_holm, x.p_floor)}"
    return text + ("" if x.p is None else f", {_p('p', x.p, x.p_floor)}")


def magnitudes(regimes: Sequence[Regime], claims: dict[str, list[Claim]]) -> list[str]:
    """Per claim, regime, metric and side: how many differences are significant (Holm) and their range, from the
    comparisons the page prints (the text quotes no number by hand)."""
    out = []
    for r in regimes:
        for c in claims[r.name]:
            parts = []
            for metric in dict.fromkeys(x.metric for x in c.comparisons if x.made and x.kind == "difference"):
                for side, word in (("against", "against"), ("claim", "for")):
                    ds = sorted(x.difference for x in c.comparisons
                                if x.made and x.kind == "difference" and x.metric == metric and x.favours == side)
                    if ds:
                        fmt = "{:+.4f}" if metric == "TV/token" else "{:+.2f}"
                        parts.append(f"{metric} {word} ×{len(ds)}: " + (fmt.format(ds[0]) if len(ds) == 1 else
                                                                        f"{fmt.format(ds[0])} to {fmt.format(ds[-1])}"))
            if parts:
                out.append(f"{r.name} {c.key}: " + ", ".join(parts))
    return out


def summary(regimes: Sequence[Regime], claims: dict[str, list[Claim]], mu: dict[str, Any],
            figures: dict[str, Path], out: Path, robustness: Sequence[dict[str, Any]] = (),
            relative_to: Path | None = None, spread: Sequence[dict[str, Any]] = ()) -> str:
    """The page's verdicts in short (for the README): per claim and regime the verdict, where along the accepted
    length it holds or fails, and the comparison that decides it with its interval; the μ answer; whether the
    verdicts hold for every drafter; the FID and TV figures side by side. Paths are relative to ``relative_to``
    (the README's folder)."""
    base = relative_to or out
    lines = verdict_table(regimes, claims, [f"{r.name} ({r.num_images:,} images per point)" for r in regimes],
                          numbers=True)
    lines += ["", "Held / not held / inconclusive (compared, nothing significant) / underpowered at N (a "
              "non-inferiority test with power below 0.8 at no difference) / not compared (no overlap), per metric "
              "by one rule (the page's \"verdict rule\"): a claim is held only where every metric it names is held; "
              "5 % two-sided, Holm-corrected within each claim and regime, bootstrap seed 0. Non-inferiority: FID "
              f"as the ratio ≤ {1 + MARGINS['fid_relative']:g} on paired replicates (C4, C2b), TV per token within "
              f"{MARGINS['tv_per_token']:g} (C2b), one-sided false alarm 2.5 %. An inconclusive FID difference gives "
              "its power to find a difference of 10 % of the baseline's FID. τ: accepted length."
              + (" \"At N images per point\": decided on the claim's deciding points with the regime's prompts and "
                 "seeds continued to N (`experiment=embedded_claims_more`; the page's \"Decided with more images\")."
                 if any(c.images for cs in claims.values() for c in cs) else ""),
              "", "Every significant difference (Holm), by claim, regime, metric and side, with its range: "
              + "; ".join(magnitudes(regimes, claims)) + "."]
    pairs = []
    for r in regimes:
        for c in claims[r.name]:
            if c.dominance_counts:
                pairs.append(f"{r.name} {c.key}: " + ", ".join(
                    f"{m} COOL-SD {n['ours']}, LANTERN++ {n['theirs']}" for m, n in c.dominance_counts.items()))
    if pairs:
        lines += ["", "Direct dominance pairs (a point better on accepted length and on the metric than a point of "
                  "the other method, both paired 95 % intervals excluding 0; no interpolation; uncorrected for the "
                  "number of pairs), pairs won by each side: " + "; ".join(pairs) + ". The page lists them."]
    fits = mu.get("fits") or {}
    words = []
    for delta, fit in fits.items():
        words.append(f"δ = {delta} (×{fit['paper_ratio']:.2f}): " + (
            "outside the measured range" if fit["mu"] is None else f"μ = {_ci_text(fit['mu'], fit['ci'], '{:.2f}')}"))
    d = mu.get("difference", {})
    if words:
        lines += ["", "The μ fit (the paper's two LlamaGen ratios of accepted length): " + "; ".join(words) + (
            f"; μ(δ=2) − μ(δ=1.1) = {_ci_text(d['value'], d['ci'], '{:.2f}')}: one μ "
            + ("fits both." if d["one_mu_fits_both"] else "does **not** fit both.") if d.get("value") is not None else ".")]
        resp = mu.get("response", {})
        if resp.get("times_weaker") is not None:
            lines[-1] += (f" This model's acceptance responds {_ci_text(resp['times_weaker'], resp['times_weaker_ci'], '{:.1f}')}× "
                          "less to relaxation than the paper's LlamaGen.")
    if robustness:
        same = [r["claim"] for r in robustness if r["same"]]
        differ = [r["claim"] for r in robustness if not r["same"]]
        names = [n for n in robustness[0]["verdicts"] if n.startswith(SEED_REGIME)]  # seed 0 on the seeds' images, 1, 2
        numbers = [n[len(SEED_REGIME):] for n in names]
        lines += ["", f"Across {len(names)} weak drafters (seeds {', '.join(numbers)}) on the same images and points "
                  "(seed 0 decided on the seed runs' images): the same verdict for every drafter in "
                  + (", ".join(same) or "none") + (f"; different in {', '.join(differ)}" if differ else "") + "."]
        if spread:
            big = max(spread, key=lambda x: x["spread"] / max(x["half_width"], 1e-12))
            tail = robustness_conclusion(robustness, spread).split("; ", 1)[-1].rstrip(".")
            lines[-1] += (f" {tail[0].upper()}{tail[1:]} (largest relative to "
                          f"its interval: {big['claim']}, {big['what'].split(':')[0]}, spread {big['spread']:.4g} "
                          f"against a half-width of {big['half_width']:.4g}).")
    shown = [(n, f) for n, f in figures.items() if n in ("FID vs accepted length", "TV per token vs accepted length")]
    if shown:
        def rel(path: Path) -> str:
            path = path.with_suffix(".png") if path.suffix != ".png" else path
            return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()  # "../" where it must
        lines += ["", " ".join(f'<img src="{rel(f)}" alt="{n}" width="49%">' for n, f in shown)]
    return "\n".join(lines) + "\n"


def write_readme_block(readme: Path, text: str) -> None:
    """Replace what lies between ``README_BEGIN`` and ``README_END`` in ``readme`` by ``text`` (atomically)."""
    readme = Path(readme)
    old = readme.read_text()
    if old.count(README_BEGIN) != 1 or old.count(README_END) != 1 or old.index(README_BEGIN) > old.index(README_END):
        raise ValueError(f"{readme}: needs exactly one pair of the lines {README_BEGIN!r} and {README_END!r} "
                         "around the claims summary")
    head, rest = old.split(README_BEGIN)
    _, tail = rest.split(README_END)
    atomic_write_bytes(readme, (head + README_BEGIN + "\n" + text + README_END + tail).encode())


#: regimes named ``weak_tree_seed<k>`` (``configs/regime/weak_tree_seed.yaml``): weak_tree's decisive points with
#: a weak drafter trained with seed k; decided like weak_tree and reported in "Robustness across drafters"
SEED_REGIME = "weak_tree_seed"
#: the claims whose verdicts the drafter seeds repeat (the decisive points: C1, C2 and C4 at δ = 1.1 and the fitted μ)
ROBUST_CLAIMS = ("C1", "C1 (fitted μ)", "C2a", "C2b", "C4", "C4 (fitted μ)")


#: the shipped weak drafter (seed 0) on the seed runs' images and points (``run``: a ``subset`` of weak_tree)
SEED0 = SEED_REGIME + "0"


def robustness_rows(weak: Regime, seeds: Sequence[Regime], claims: dict[str, list[Claim]]) -> list[dict[str, Any]]:
    """Per decisive claim: its verdict with the shipped weak drafter (seed 0; weak_tree, and ``SEED0`` when given)
    and with each other seed's, and whether the seed regimes (equal N) agree."""
    rows = []
    for key in ROBUST_CLAIMS:
        verdicts = {r.name: next((c.verdict for c in claims[r.name] if c.key == key), None) for r in [weak, *seeds]}
        if verdicts[weak.name] is None:
            continue
        equal_n = [v for k, v in verdicts.items() if k.startswith(SEED_REGIME)] if any(
            r.name == SEED0 for r in seeds) else list(verdicts.values())
        rows.append({"claim": key, "verdicts": verdicts, "same": len(set(equal_n)) == 1})
    return rows


def drafter_spread(seeds: Sequence[Regime], claims: dict[str, list[Claim]]) -> list[dict[str, Any]]:
    """Per decisive claim and deciding comparison (``_deciding`` on the first of ``seeds``, seed 0): its estimate
    and interval with every drafter, their spread (max − min) and the mean half-width of the intervals."""
    out = []
    for key in ROBUST_CLAIMS:
        per = {r.name: next((c for c in claims[r.name] if c.key == key), None) for r in seeds}
        first = per[seeds[0].name]
        if first is None or any(c is None or len(c.comparisons) != len(first.comparisons) for c in per.values()):
            continue
        for x in _deciding(first):
            j = first.comparisons.index(x)
            comps = {n: c.comparisons[j] for n, c in per.items()}
            if not all(c.made for c in comps.values()):
                continue
            values = {n: c.difference for n, c in comps.items()}
            what = x.what.split(" at accepted length")[0]
            out.append({"claim": key, "what": what, "metric": x.metric, "values": values,
                        "cis": {n: c.ci for n, c in comps.items()},
                        "spread": max(values.values()) - min(values.values()),
                        "half_width": sum((c.ci[1] - c.ci[0]) / 2 for c in comps.values() if math.isfinite(c.ci[0]))
                        / len(comps) if all(math.isfinite(c.ci[0]) for c in comps.values())
                        else sum(c.ci[1] - c.difference for c in comps.values()) / len(comps)})
    return out


def robustness_conclusion(robustness: Sequence[dict[str, Any]], spread: Sequence[dict[str, Any]]) -> str:
    """The robustness section's conclusion, worded from its data."""
    differ = [r["claim"] for r in robustness if not r["same"]]
    # two independent drafters' estimates differ by chance within √2 × their 95 % half-width
    wide = [f"{x['claim']} ({x['what'].split(':')[0]})" for x in spread if x["spread"] > math.sqrt(2) * x["half_width"]]
    text = ("At equal N the verdicts " + (f"differ between drafters in {', '.join(differ)}" if differ else
                                         "are the same for every drafter"))
    if wide:
        text += ("; the deciding differences spread between drafters by more than the 95 % half-width of a "
                 "difference between two drafters (√2 × their own) in " + ", ".join(wide)
                 + ", so at equal N the drafter, not the sample size, moves them")
    else:
        text += ("; every deciding difference spreads between drafters by less than the 95 % half-width of a "
                 "difference between two drafters (√2 × their own), so these data do not separate the drafter's "
                 "effect from sampling")
    return text + "."


def load_regimes(folder: Path, device: str = "cpu") -> list[Regime]:
    """The regimes below ``folder``: its compact data (``*.claims.npz``, ``save_compact``) if it holds any, else
    the run folders (``*/run.json``, or ``folder`` itself), loaded with their images' classifier features."""
    folder = Path(folder)
    compact = sorted(folder.glob(f"*{COMPACT_SUFFIX}"))
    if compact:
        return [load_compact(p) for p in compact]
    folders = [folder] if (folder / "run.json").is_file() else sorted(p.parent for p in folder.glob("*/run.json"))
    if not folders:
        raise FileNotFoundError(f"no run.json or *{COMPACT_SUFFIX} below {folder}: run `python run.py -m "
                                "experiment=embedded_claims` first")
    return [load_regime(f, device=device) for f in folders]


def export_more(more: Path, compact: Path, device: str = "cpu") -> list[Path]:
    """Write each run of ``experiment=embedded_claims_more`` below ``more`` into ``compact`` as compact data,
    ``<regime>.more_<group>.claims.npz`` (only its own images: the page joins them to the regime's, ``extend``), AR's
    without features (the page takes nothing from AR's added images). Returns the files written."""
    more = Path(more)
    folders = [more] if (more / "run.json").is_file() else sorted(p.parent for p in more.glob("*/run.json"))
    if not folders:
        raise FileNotFoundError(f"no run.json below {more}: run `python run.py -m experiment=embedded_claims_more` "
                                "first")
    written = []
    for folder in folders:
        run_ = load_regime(folder, device=device)
        info = more_info(run_)
        run_.name = f"{info['regime']}.more_{info['group']}"
        if "ar" in run_.points:
            run_.points["ar"].features = None
        written.append(save_compact(run_, Path(compact)))
    return written


def build_extensions(bases: dict[str, Regime], runs: Sequence[Regime]) -> list[Regime]:
    """The regimes the runs of ``experiment=embedded_claims_more`` extend (``data.extend``): for each run, its regime
    with its points (and the points the regime's other runs cover, e.g. COOL-SD δ = 1.1 for C2b's curve) at the
    run's N; for weak_tree, also the fitted-μ run's points at the same N (``weak_tree_fitted.<group>``, joined on the
    page as the fitted run is). The regimes' own data must come first (``bases``)."""
    infos = [(more_info(r), r) for r in runs]
    out = []
    for info, run_ in infos:
        if info["regime"] == FITTED_REGIME:
            continue
        if info["regime"] not in bases:
            raise FileNotFoundError(f"{run_.folder}: extends {info['regime']}, whose data are not given")
        images = info["offset"] + info["added"]
        same = [r for i, r in infos if i["regime"] == info["regime"] and r is not run_]
        out.append(extend(bases[info["regime"]], [run_, *same], images, info["group"], info["decides"]))
        fitted = [r for i, r in infos if i["regime"] == FITTED_REGIME and i["added"] >= info["added"]]
        if fitted and FITTED_REGIME in bases and info["regime"] == "weak_tree":
            out.append(extend(bases[FITTED_REGIME], fitted, images, info["group"], []))
    return out


def run(folder: Path, out: Path, resamples: int = 10000, command: str | None = None,
        device: str = "cpu", export: Path | None = None, readme: Path | None = None) -> dict[str, Any]:
    """Load every regime below ``folder`` (runs or their compact data), decide the claims, write
    ``<out>/embedded_claims.md``, its figures (``<out>/figures/embedded_claims_*``) and
    ``<out>/embedded_claims.json``; returns the JSON record. ``export``: also write each regime's compact data
    there and decide from it (8-bit features), so the page is exactly what the exported data rebuild.
    ``readme``: also rewrite that file's claims summary (``summary``, between ``README_BEGIN`` and ``README_END``);
    the summary is written to ``<out>/embedded_claims_summary.md`` either way."""
    regimes, seeds, extra = [], [], None
    loaded = load_regimes(folder, device)
    runs = [r for r in loaded if is_more(r)]  # more images of deciding points (experiment=embedded_claims_more)
    for regime in (r for r in loaded if not is_more(r)):
        if export is not None:
            regime = load_compact(save_compact(regime, Path(export)))
        compute(regime, resamples=resamples, device=device)
        if regime.name == FITTED_REGIME:
            extra = regime
        elif regime.name.startswith(SEED_REGIME):
            seeds.append(regime)
        else:
            regimes.append(regime)
    if not regimes:
        raise FileNotFoundError(f"{folder}: only the {FITTED_REGIME} run is here; it adds points to weak_tree's")
    # the extended regimes, built before the fitted points join weak_tree (their labels stay the regimes' own)
    extensions = build_extensions({r.name: r for r in [*regimes, *([extra] if extra else [])]}, runs)
    for e in extensions:
        compute(e, resamples=resamples, device=device)
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
    for r in seeds:  # the seed runs' labels name LANTERN++'s resampling as weak_tree's do
        for p in r.points.values():
            if p.method == "lantern_pp" and "resampling" not in p.label:
                p.label += f" ({RESAMPLING.get(p.config.get('resample', 'reference'), 'reference resampling')})"
    bias = None
    if weak is not None and seeds:
        # the shipped drafter (seed 0) on exactly the seed runs' images and points: the drafters at equal N
        names = [n for n in seeds[0].points if n in weak.points]
        seed0 = subset(weak, names, seeds[0].indices, SEED0)
        if extra is not None:  # the fitted points with their own run's AR (as in weak_tree)
            fitted_names = [n for n in seeds[0].points if n in extra.points and n not in ("ar", "sd")]
            sub_extra = subset(extra, [n for n in extra.points if n in ("ar", "sd", *fitted_names)],
                               seeds[0].indices, extra.name)
            compute(sub_extra, resamples=resamples, device=device)
            for n in fitted_names:
                seed0.points.pop(n, None)
        compute(seed0, resamples=resamples, device=device)
        if extra is not None:
            merge_fitted(seed0, sub_extra)
        seeds = [seed0, *seeds]
        diffs = sorted(seed0.points[n].est["fid"] - weak.points[n].est["fid"] for n in seed0.points
                       if "fid" in seed0.points[n].est and "(μ fitted)" not in seed0.points[n].label)
        if diffs:
            bias = {"n": weak.num_images, "n_small": seed0.num_images, "lo": diffs[0], "hi": diffs[-1],
                    "median": float(np.median(diffs))}
    claims = {r.name: decide(r) for r in regimes + seeds}
    extended = decide_extensions(regimes, extensions, claims)
    robustness = robustness_rows(weak, seeds, claims) if weak is not None and seeds else []
    spread = drafter_spread(seeds, claims) if robustness else []
    calibration = lossless_calibration(regimes)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    figures = {
        "FID vs accepted length": frontier_figure(regimes, "fid", "FID, classifier features (lower is better)",
                                                  figs / "embedded_claims_fid"),
        "TV per token vs accepted length": frontier_figure(regimes, "tv", "TV per committed token",
                                                           figs / "embedded_claims_tv"),
        "schedule ablation": frontier_figure(regimes, "tv", "TV per committed token", figs / "embedded_claims_schedules",
                                             families=["COOL-SD (exponential, every μ)",
                                                       "UniformRSD", "COOL-SD (linear)", "vanilla SD"]),
        "G* vs the published resampling by k": gstar_figure(regimes, figs / "embedded_claims_gstar"),
    }
    r_figure = mu_figure(mu, figs / "embedded_claims_mu")
    if r_figure is not None:
        figures["R against ω₁ (the μ fit)"] = r_figure
    seconds = {r.name: float(r.record["wall_s"]) for r in regimes + ([extra] if extra else []) + seeds
               if r.record.get("wall_s")}
    for e in extended:  # each run of the extensions once (a run can serve several groups)
        for x in e["runs"]:
            if x.get("wall_s") and x["run"] not in seconds:
                seconds[x["run"]] = float(x["wall_s"])
    text = page(regimes, claims, mu, figures, out, command or f"python scripts/claims.py {folder} --out {out}", seconds,
                robustness, seeds, calibration, bias, spread, extended)
    atomic_write_bytes(out / "embedded_claims.md", text.encode())
    # the same summary twice: its figure paths relative to the file it is written into
    atomic_write_bytes(out / "embedded_claims_summary.md",
                       summary(regimes, claims, mu, figures, out, robustness, relative_to=out, spread=spread).encode())
    if readme is not None:
        write_readme_block(Path(readme), summary(regimes, claims, mu, figures, out, robustness,
                                                 relative_to=Path(readme).parent, spread=spread))
    record = {"claims": {r: [{"key": c.key, "text": c.text, "verdict": c.verdict, "note": c.note,
                              "comparisons": [vars(x) for x in c.comparisons], "dominance": c.dominance,
                              "dominance_counts": c.dominance_counts, "metric_verdicts": c.metric_verdicts,
                              **({"images": c.images, "extension": c.extension,
                                  "before": {"verdict": c.before.verdict, "note": c.before.note,
                                             "comparisons": [vars(x) for x in c.before.comparisons]}}
                                 if c.before is not None else {})}
                             for c in cs] for r, cs in claims.items()},
              "mu": mu, "robustness": robustness, "drafter_spread": spread, "lossless_calibration": calibration,
              "fid_bias": bias,
              "extensions": [{k: v for k, v in e.items() if k not in ("claims", "regime")} for e in extended],
              "regimes": {r.name: {"folder": str(r.folder), "num_images": r.num_images,
                                   "points": {p.name: {"label": p.label, **p.est} for p in r.points.values()}}
                          for r in regimes + seeds + [e["regime"] for e in extended]}}
    atomic_write_bytes(out / "embedded_claims.json", (json.dumps(record, indent=2, default=float) + "\n").encode())
    return record
