"""Trade-off plots of the paper tables' rows (``eval.report.paper_tables.measured_frame``), with their uncertainty.

``make_plots`` writes ``<out>/figures/<name>_*.png`` and ``.pdf``: FID, CLIP and ImageReward vs speedup with
95 % error bars on both axes, each method's sweep joined in the order of its swept option (δ, λ, k, draft
length) as one curve and its Pareto front drawn over it; accepted length vs the swept option; TV per step vs
accepted length; when several methods sweep their draft length (the Jacobi family's window), their accepted
lengths against the window W = draft_len + 1 (the Jacobi papers' L) in one panel per model. Points are named
inside the axes (``eval.report.run_table.label_inside``), the legend sits below.
(``eval.report.run_table`` keeps the per-run plot of one ``run.json``.)

Example: ``python scripts/make_tables.py results/runs/sweep_coolsd_delta results/runs/sweep_lantern --name
tradeoff`` (without ``--no-plots``).
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coolsd.io import atomic_write_bytes
from eval.report.labels import DECODER_LABELS, SWEEP_NAMES, point_label
from eval.report.paper_tables import interval
from eval.report.run_table import error_bar, nonnegative_axis


def pareto_front(points: Sequence[tuple[float, float]], lower_is_better: bool) -> list[tuple[float, float]]:
    """The non-dominated (speedup, quality) points, by increasing speedup (higher speedup is better)."""
    front = []
    for x, y in points:
        dominated = any((x2 >= x and (y2 <= y if lower_is_better else y2 >= y)) and (x2, y2) != (x, y)
                        for x2, y2 in points)
        if not dominated:
            front.append((x, y))
    return sorted(set(front))


def sweep_curves(frame: pd.DataFrame, x: str, y: str) -> list[tuple[str, str, pd.DataFrame]]:
    """(model label, curve label, its rows) for the rows that report ``x`` and ``y``: one curve per method and
    options other than the swept one (``sweep_keys``), its rows in the order of the swept option (of ``x``
    when a row has none)."""
    if frame.empty or x not in frame or y not in frame:
        return []
    data = frame.dropna(subset=[x, y])
    out = []
    for (model, curve), group in data.groupby(["model_label", "curve"], sort=False):
        by = "strength" if group["strength"].notna().all() else x
        out.append((model, curve, group.sort_values(by, kind="stable")))
    return out


def errors(group: pd.DataFrame, key: str) -> np.ndarray:
    """(2, n) distances below and above each value to its interval's ends (0 without one)."""
    ci = group[f"{key}_ci"] if f"{key}_ci" in group else [None] * len(group)
    return np.array([error_bar(float(v), interval(c)) for v, c in zip(group[key], ci)]).T.reshape(2, len(group))


def draw_curve(ax: Any, group: pd.DataFrame, x: str, y: str, color: str, label: str,
               lower_is_better: bool | None = None, marker: str = "o") -> dict[str, Any]:
    """One method's sweep: 95 % error bars on both axes at every point, the points joined in sweep order (thin
    line) and, for a trade-off (``lower_is_better`` given), its Pareto front over them (thick line). Returns
    the drawn lines ({"sweep": …, "front": …}) and the labels for ``label_inside``."""
    xs, ys = group[x].astype(float).to_numpy(), group[y].astype(float).to_numpy()
    xerr = errors(group, x) if x != "strength" else None
    ax.errorbar(xs, ys, xerr=xerr, yerr=errors(group, y), fmt=marker, ms=4, color=color, elinewidth=0.7,
                capsize=2, zorder=3)
    drawn: dict[str, Any] = {"points": [(px, py, point_label(k, v)) for px, py, k, v
                                        in zip(xs, ys, group["strength_key"], group["strength"])
                                        if point_label(k, v) and x != "strength"]}
    if len(group) > 1:
        drawn["sweep"], = ax.plot(xs, ys, "-", lw=0.9, alpha=0.55, color=color, zorder=2)
    if lower_is_better is not None and len(group) > 1:
        front = pareto_front(list(zip(xs, ys)), lower_is_better)
        if len(front) > 1:
            drawn["front"], = ax.plot([p[0] for p in front], [p[1] for p in front], "-", lw=2.4, alpha=0.8,
                                      color=color, solid_capstyle="round", zorder=2)
    ax.plot([], [], "-" + marker, ms=4, color=color, label=label)  # the legend's entry
    return drawn


def make_plots(frame: pd.DataFrame, figures: Path, name: str) -> list[Path]:
    """The trade-off figures the data allows (PNG and PDF each); returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.report.run_table import label_inside

    written: list[Path] = []
    if frame.empty:
        return written

    def save(fig, stem: str) -> None:
        for ext in ("png", "pdf"):
            path = figures / f"{name}_{stem}.{ext}"
            metadata = {"CreationDate": None} if ext == "pdf" else None  # reproducible PDFs
            buf = io.BytesIO()
            fig.savefig(buf, format=ext, dpi=150, bbox_inches="tight", metadata=metadata)
            atomic_write_bytes(path, buf.getvalue())
            written.append(path)
        plt.close(fig)

    def finish(ax, points, xlabel: str, ylabel: str, title: str) -> None:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.margins(x=0.12, y=0.12)
        label_inside(ax, points, fontsize=6)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below: never on data

    models = list(dict.fromkeys(frame["model_label"]))
    names = list(dict.fromkeys(frame["curve"]))
    if len(names) <= 10:  # the default cycle; beyond it 20 distinct colours (tab20), so no two curves share one
        colors = {c: f"C{i}" for i, c in enumerate(names)}  # same in all panels
    else:
        palette = plt.get_cmap("tab20").colors
        colors = {c: palette[(2 * i) % 20 + (2 * i) // 20 % 2] for i, c in enumerate(names)}
    for metric, ylabel, lower, stem in (("fid", "FID (lower is better)", True, "fid"),
                                        ("fid_classifier", "FID, classifier features (lower is better)", True,
                                         "fid_classifier"),
                                        ("clip_score", "CLIP score (cosine, higher is better)", False, "clip"),
                                        ("image_reward", "ImageReward (higher is better)", False, "image_reward")):
        curves = sweep_curves(frame, "speedup", metric)
        if not curves:
            continue
        # a panel grows with its points (up to twice), so their labels stay beside them
        scale = min(2.0, max(1.0, max(sum(len(g) for m, _, g in curves if m == model) for model in models) / 12))
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models) * scale, 4.6 * scale), squeeze=False,
                                 layout="constrained")
        for ax, model in zip(axes[0], models):
            points = []
            for _, curve, group in (c for c in curves if c[0] == model):
                points += draw_curve(ax, group, "speedup", metric, colors[curve], curve, lower)["points"]
            finish(ax, points, "speedup over AR (×)", ylabel, model)
        fig.suptitle("error bars: 95 % intervals; thin line: a sweep in order of its option; thick: its Pareto "
                     "front", fontsize=8)
        save(fig, f"{stem}_vs_speedup")

    swept = frame.dropna(subset=["strength", "mean_accepted_length"])
    if not swept.empty:
        panels = list(dict.fromkeys(zip(swept["decoder"], swept["strength_key"])))
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False,
                                 layout="constrained")
        for ax, (decoder, key) in zip(axes[0], panels):
            rows = swept[(swept["decoder"] == decoder) & (swept["strength_key"] == key)]
            for model, curve, group in sweep_curves(rows, "strength", "mean_accepted_length"):
                draw_curve(ax, group, "strength", "mean_accepted_length", colors[curve],
                           f"{curve}, {model}" if len(models) > 1 else curve, marker="osD^v"[models.index(model) % 5])
            finish(ax, [], SWEEP_NAMES.get(key, key),
                   "mean accepted length (tokens per target forward)", DECODER_LABELS.get(decoder, decoder))
        save(fig, "accepted_length_vs_strength")

    window = frame[frame["strength_key"] == "draft_len"].dropna(subset=["strength", "mean_accepted_length"])
    if window["decoder"].nunique() >= 2:  # several methods swept over their draft length: one panel per model
        window = window.assign(window=window["strength"].astype(float) + 1)
        wmodels = list(dict.fromkeys(window["model_label"]))
        fig, axes = plt.subplots(1, len(wmodels), figsize=(6.4 * len(wmodels), 4.8), squeeze=False,
                                 layout="constrained")
        for ax, model in zip(axes[0], wmodels):
            rows = window[window["model_label"] == model]
            for _, curve, group in sweep_curves(rows, "strength", "mean_accepted_length"):
                draw_curve(ax, group.sort_values("window"), "window", "mean_accepted_length", colors[curve], curve)
            ticks = sorted(set(rows["window"]))
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            finish(ax, [], "window W = draft_len + 1 (the Jacobi papers' L; tokens per verify forward)",
                   "step compression: mean accepted length (tokens per target forward)", model)
        fig.suptitle("error bars: 95 % bootstrap intervals over images", fontsize=8)
        save(fig, "accepted_length_vs_window")

    tv = sweep_curves(frame, "mean_accepted_length", "tv_per_step")
    if tv:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False,
                                 layout="constrained")
        for ax, model in zip(axes[0], models):
            points, highs = [], []
            for _, curve, group in (c for c in tv if c[0] == model):
                points += draw_curve(ax, group, "mean_accepted_length", "tv_per_step", colors[curve], curve)["points"]
                highs += list(group["tv_per_step"].astype(float) + errors(group, "tv_per_step")[1])
            nonnegative_axis(ax, highs)
            finish(ax, points, "mean accepted length (tokens per target forward)",
                   "TV distance to p per step (exact, one-step)", model)
        save(fig, "tv_vs_accepted_length")
    return written
