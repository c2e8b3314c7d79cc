"""The claims page (``embedded_claims.md``), its JSON record, and ``run``: load, decide, draw, write."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from coolsd.io import atomic_write_bytes
from eval.claims.data import (
    COMPACT_SUFFIX,
    MARGINS,
    Regime,
    _ci_text,
    compute,
    interval,
    load_compact,
    load_regime,
    save_compact,
)
from eval.claims.figures import frontier_figure, gstar_figure, mu_figure
from eval.claims.statistics import (
    FITTED_REGIME,
    Claim,
    Comparison,
    decide,
    fit_mu,
    fitted_command,
    fitted_points,
    merge_fitted,
)

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
            row.append("—" if c is None else f"**{c.verdict}**" + (f" ({c.note})" if c.note else "") + (
                "".join(f"; {_comparison_text(x)}" for x in _deciding(c)) if numbers else ""))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def page(regimes: Sequence[Regime], claims: dict[str, list[Claim]], mu: dict[str, Any], figures: dict[str, Path],
         out: Path, command: str, seconds: dict[str, float] | None = None,
         robustness: Sequence[dict[str, Any]] = (), seeds: Sequence[Regime] = ()) -> str:
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
    lines += ["", *verdict_table(regimes, claims, [r.name for r in regimes])]
    lines += ["", "Verdicts: held = at least one comparison significantly in the claim's favour and none against "
              "it; not held = one significantly against it; inconclusive = compared, none significant; not compared "
              "= no comparison could be made (e.g. no point inside the other curve's range). Significance is "
              "Holm-corrected at 5 % within each claim and regime (the family: that claim's comparisons listed "
              "below; C1 and C2 on TV per token and FID together). \"Comparable quality\" (C4) is a one-sided "
              "non-inferiority test with a margin fixed before the run: ΔFID < "
              f"{MARGINS['fid_relative']:.0%} of vanilla SD's FID (`eval/claims/data.py` MARGINS says why). τ ranges give where along the accepted length a frontier "
              "comparison is for, against or not significant (n.s.).", ""]
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
                  + "). The claims with fewer points are decided as in weak_tree (same rules, Holm within each claim "
                  "and regime).", "", "| claim | " + " | ".join(names) + " | the same for every drafter |",
                  "|---|" + "---|" * (len(names) + 1)]
        for row in robustness:
            lines.append(f"| {row['claim']} | " + " | ".join(str(v) if v else "—" for v in row["verdicts"].values())
                         + f" | {'yes' if row['same'] else '**no**'} |")
    lines += ["", "## Every point", ""]
    for r in [*regimes, *seeds]:
        lines += [f"### {r.name}", "", "| point | N | accepted length | TV per token | FID (classifier features) | speedup (batch 1) |",
                  "|---|--:|--:|--:|--:|--:|"]
        for p in r.points.values():
            lines.append(f"| {p.label} | {len(p.indices)} | {_ci_text(p.est['tau'], interval(p, 'tau'), '{:.2f}')} | "
                         f"{_ci_text(p.est['tv'], interval(p, 'tv'), '{:.4f}')} | "
                         f"{_ci_text(p.est.get('fid', math.nan), interval(p, 'fid'), '{:.2f}')} | "
                         f"{_ci_text(p.est.get('speedup', math.nan), interval(p, 'speedup'), '{:.2f}')} |")
        lines.append("")
    lines += ["## Every comparison", "", "Differences oriented as written; [95 % interval], two-sided bootstrap p "
              "(and Holm-adjusted within its claim); non-inferiority rows give the one-sided upper bound and the "
              "p of Δ ≥ margin.", ""]
    for r in [*regimes, *seeds]:
        lines.append(f"### {r.name}")
        lines.append("")
        for c in claims[r.name]:
            lines.append(f"- **{c.key}** ({c.verdict})")
            for comp in c.comparisons:
                words = ({"claim": "non-inferior: shown", "against": "worse by more than the margin", None: "not shown"}
                         if comp.kind == "non-inferiority" else
                         {"claim": "for the claim", "against": "against the claim", None: "not significant"})
                side = "not compared" if not comp.made else words[comp.favours]
                p_text = "" if comp.p is None else f", p = {comp.p:.4f}" + (
                    "" if comp.p_holm is None else f", Holm p = {comp.p_holm:.4f}")
                lines.append(f"  - {comp.what}: {_ci_text(comp.difference, comp.ci, '{:.4f}')}{p_text} ({side})")
            if not c.comparisons:
                lines.append("  - no comparison could be made")
            for d in c.dominance:
                lines.append(f"  - direct dominance: {d}")
        lines.append("")
    return "\n".join(lines) + "\n"


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


def _comparison_text(x: Comparison) -> str:
    what = x.what.split(" (one-sided")[0]
    if x.kind == "non-inferiority":
        return f"{what}: Δ {x.difference:+.2f}, one-sided upper bound {x.ci[1]:.2f}"
    fmt = "{:+.3f}" if abs(x.difference) < 0.1 else "{:+.2f}"
    text = f"{what}: {_ci_text(x.difference, x.ci, fmt)}"
    if x.p_holm is not None:
        return text + f", Holm p = {x.p_holm:.4f}"
    return text + ("" if x.p is None else f", p = {x.p:.4f}")


def summary(regimes: Sequence[Regime], claims: dict[str, list[Claim]], mu: dict[str, Any],
            figures: dict[str, Path], out: Path, robustness: Sequence[dict[str, Any]] = (),
            relative_to: Path | None = None) -> str:
    """The page's verdicts in short (for the README): per claim and regime the verdict, where along the accepted
    length it holds or fails, and the comparison that decides it with its interval; the μ answer; whether the
    verdicts hold for every drafter; the FID and TV figures side by side. Paths are relative to ``relative_to``
    (the README's folder)."""
    base = relative_to or out
    lines = verdict_table(regimes, claims, [f"{r.name} ({r.num_images:,} images per point)" for r in regimes],
                          numbers=True)
    lines += ["", "Held / not held / inconclusive (compared, nothing significant) / not compared (no overlap); "
              "Holm-corrected within each claim and regime; C4's quality is a non-inferiority test (ΔFID below "
              f"{MARGINS['fid_relative']:.0%} of vanilla SD's FID). τ: accepted length."]
    pairs = []
    for r in regimes:
        for c in claims[r.name]:
            if c.dominance_counts:
                pairs.append(f"{r.name} {c.key}: " + ", ".join(
                    f"{m} COOL-SD {n['ours']}, LANTERN++ {n['theirs']}" for m, n in c.dominance_counts.items()))
    if pairs:
        lines += ["", "Direct dominance pairs (a point better on accepted length and on the metric than a point of "
                  "the other method, both paired 95 % intervals excluding 0; no interpolation), pairs won by each "
                  "side: " + "; ".join(pairs) + ". The page lists them."]
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
        names = list(robustness[0]["verdicts"])  # weak_tree (the shipped drafter, seed 0), then the seed regimes
        numbers = ["0"] + [n[len(SEED_REGIME):] for n in names[1:]]
        lines += ["", f"Across {len(names)} weak drafters (seeds {', '.join(numbers)}): the same verdict for every "
                  "drafter in " + (", ".join(same) or "none") + (f"; different in {', '.join(differ)}" if differ else "") + "."]
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


def robustness_rows(weak: Regime, seeds: Sequence[Regime], claims: dict[str, list[Claim]]) -> list[dict[str, Any]]:
    """Per decisive claim: its verdict with the shipped weak drafter (seed 0) and with each other seed's, and
    whether all agree."""
    rows = []
    for key in ROBUST_CLAIMS:
        verdicts = {r.name: next((c.verdict for c in claims[r.name] if c.key == key), None) for r in [weak, *seeds]}
        if verdicts[weak.name] is None:
            continue
        rows.append({"claim": key, "verdicts": verdicts, "same": len(set(verdicts.values())) == 1})
    return rows


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


def run(folder: Path, out: Path, resamples: int = 10000, command: str | None = None,
        device: str = "cpu", export: Path | None = None, readme: Path | None = None) -> dict[str, Any]:
    """Load every regime below ``folder`` (runs or their compact data), decide the claims, write
    ``<out>/embedded_claims.md``, its figures (``<out>/figures/embedded_claims_*``) and
    ``<out>/embedded_claims.json``; returns the JSON record. ``export``: also write each regime's compact data
    there and decide from it (float16 features), so the page is exactly what the exported data rebuild.
    ``readme``: also rewrite that file's claims summary (``summary``, between ``README_BEGIN`` and ``README_END``);
    the summary is written to ``<out>/embedded_claims_summary.md`` either way."""
    regimes, seeds, extra = [], [], None
    for regime in load_regimes(folder, device):
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
    claims = {r.name: decide(r) for r in regimes + seeds}
    robustness = robustness_rows(weak, seeds, claims) if weak is not None and seeds else []
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
    text = page(regimes, claims, mu, figures, out, command or f"python scripts/claims.py {folder} --out {out}", seconds,
                robustness, seeds)
    atomic_write_bytes(out / "embedded_claims.md", text.encode())
    # the same summary twice: its figure paths relative to the file it is written into
    atomic_write_bytes(out / "embedded_claims_summary.md",
                       summary(regimes, claims, mu, figures, out, robustness, relative_to=out).encode())
    if readme is not None:
        write_readme_block(Path(readme), summary(regimes, claims, mu, figures, out, robustness,
                                                 relative_to=Path(readme).parent))
    record = {"claims": {r: [{"key": c.key, "text": c.text, "verdict": c.verdict, "note": c.note,
                              "comparisons": [vars(x) for x in c.comparisons], "dominance": c.dominance,
                              "dominance_counts": c.dominance_counts} for c in cs] for r, cs in claims.items()},
              "mu": mu, "robustness": robustness,
              "regimes": {r.name: {"folder": str(r.folder), "num_images": r.num_images,
                                   "points": {p.name: {"label": p.label, **p.est} for p in r.points.values()}}
                          for r in regimes + seeds}}
    atomic_write_bytes(out / "embedded_claims.json", (json.dumps(record, indent=2, default=float) + "\n").encode())
    return record
