"""The claims' figures: frontiers per regime (one curve per method and k), the G* ablation, R(ω₁) for the μ fit."""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from coolsd.io import atomic_write_bytes
from eval.report.run_table import error_bar
from eval.studies.claims.analysis import compare, curve, lantern_pp_baseline, pareto, select
from eval.studies.claims.data import PAPER_RATIOS, Point, Regime, interval

# --------------------------------------------------------------------------------------------- figures


FAMILIES: list[tuple[str, Callable[[Point], bool]]] = [
    # every μ (mean, first, fitted) is one exponential family, as in the analysis
    ("COOL-SD (exponential, every μ)", lambda p: p.method == "coolsd"
     and p.config.get("schedule", "exponential") == "exponential"),
    ("UniformRSD", lambda p: p.method == "coolsd" and p.config.get("schedule") == "uniform"),
    ("COOL-SD (linear)", lambda p: p.method == "coolsd" and p.config.get("schedule") == "linear"),
    ("LANTERN++ (reference resampling)", lambda p: p.method == "lantern_pp" and p.config.get("resample") == "reference"),
    ("LANTERN++ (q-side resampling)", lambda p: p.method == "lantern_pp" and p.config.get("resample") == "reference_q"),
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


def _curves(regime: Regime, fams: Sequence[tuple[int, str, Callable[[Point], bool]]], key: str):
    """(colour index, curve index within its family, label, points by strength; the every-μ exponential family by
    accepted length) of every curve drawn: one per
    family, and one per (method, k) for LANTERN and LANTERN++, whose strength runs along a curve at fixed k."""
    for k, name, test in fams:
        members = curve([p for p in regime.points.values() if test(p) and key in p.est])
        if "every μ" in name:  # δ orders each μ's points, not the family: joined in τ, as the analysis interpolates
            members.sort(key=lambda p: p.est["tau"])
        ks = sorted({p.config.get("k") for p in members if p.method in ("lantern", "lantern_pp")} - {None})
        groups = [(f"{name}, k={kk}", [p for p in members if p.config.get("k") == kk]) for kk in ks] \
            if ks else [(name, members)]
        for g, (label, pts) in enumerate(groups):
            if pts:
                yield k, g, label, pts


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
    colors = [f"C{i}" for i in range(10)] + ["black"]  # one per family (FAMILIES has 10)
    for ax, regime in zip(axes[0], regimes):
        shown = [p for _, _, test in fams for p in regime.points.values() if test(p) and key in p.est]
        cap = off_axes_cap([p.est[key] for p in shown])
        for k, g, fam, pts in _curves(regime, fams, key):
            color, marker = colors[k % len(colors)], markers[(k + g) % len(markers)]
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
    fig.suptitle("bars: each point's own 95 % bootstrap interval (the comparisons' paired intervals are on the "
                 "page); thin line: a curve in order of its "
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
        lpp, published = select(regime, "lantern_pp"), lantern_pp_baseline(regime)
        for g in [p for p in lpp if p.config.get("resample") == "optimal"]:
            ref = [p for p in published if p.config.get("k") == g.config.get("k")
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
    for ax, title in zip(axes, ("Δ TV per token (G* − published resampling)",
                                "Δ FID, classifier features (G* − published resampling)")):
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.minorticks_off()
        if ks:
            ax.set_xticks(sorted(ks), [f"{k:g}" for k in sorted(ks)])
            ax.set_xlim(min(ks) / 1.6, max(ks) * 1.6)
        ax.set_xlabel("LANTERN++ neighbourhood size k")
        ax.set_ylabel(title.split(" (")[0] + " (< 0: G* better)")
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


def mu_figure(mu: dict[str, Any], path: Path) -> Path | None:
    """R = accepted length ÷ vanilla SD's against ω₁ (log axis) for every exponential point, with 95 % intervals,
    the paper's two LlamaGen ratios as horizontal lines and the fitted ω₁ where R meets them."""
    if not mu.get("points"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, which in enumerate(sorted({p["mu"] for p in mu["points"]})):
        pts = sorted((p for p in mu["points"] if p["mu"] == which), key=lambda p: p["omega1"])
        x, y = [p["omega1"] for p in pts], [p["ratio"] for p in pts]
        yerr = [[p["ratio"] - (p["ratio_ci"] or [p["ratio"]] * 2)[0] for p in pts],
                [(p["ratio_ci"] or [p["ratio"]] * 2)[1] - p["ratio"] for p in pts]]
        ax.errorbar(x, y, yerr=yerr, fmt="os^Dv"[k % 5] + "-", lw=0.8, capsize=2, color=f"C{k}",
                    label=f"exponential COOL-SD, μ = {which}")
    for delta, target in PAPER_RATIOS.items():
        ax.axhline(target, color="0.4", ls="--", lw=0.9)
        ax.text(0.01, target, f" paper's LlamaGen ratio at δ = {delta:g}: ×{target:.3f}", fontsize=8, color="0.3",
                va="bottom", transform=ax.get_yaxis_transform())
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter(""))
    ax.set_xlabel("ω₁ = δ·exp(−ν − μ)  (log scale)")
    ax.set_ylabel("R = accepted length ÷ vanilla SD's")
    ax.set_title("The μ question: R against ω₁ (weak_tree)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)
