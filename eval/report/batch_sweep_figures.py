"""The batch-size study's two figures (``eval.bench.batch_sweep``): speedup against batch size, and images per
second against the seconds an image waits.

* ``speedup_figure``: one line per decoder, its speedup over AR on the same path against B on a log₂ axis, the
  eager path dashed and the static path solid, the 95 % intervals as bars, a line at 1 (below it speculation
  costs time);
* ``throughput_figure``: one curve per decoder and path, images per second against the seconds an image waits (the
  batch's wall time), each point labelled with its batch size (up and to the left is better).

Example: ``speedup_figure(record, Path("results/bench/embedded_batch_sweep_speedup.png"))``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

STATIC = "@static"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(record: dict[str, Any]) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """decoder -> path -> batch size -> cell."""
    out: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for key, by_b in record["cells"].items():
        path = "static" if key.endswith(STATIC) else "eager"
        out.setdefault(key.removesuffix(STATIC), {})[path] = {int(b): c for b, c in by_b.items()}
    return out


def _colours(names: list[str]) -> dict[str, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def speedup_figure(record: dict[str, Any], path: Path) -> None:
    plt = _plt()
    series = _series(record)
    names = [n for n in series if n != "ar"]
    colours = _colours(names)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        for decode_path, style in (("eager", "--"), ("static", "-")):
            cells = series[name].get(decode_path, {})
            sizes = sorted(b for b, c in cells.items() if "speedup" in c)
            if not sizes:
                continue
            y = [cells[b]["speedup"] for b in sizes]
            lo = [y[i] - (cells[b]["speedup_ci"] or [y[i], y[i]])[0] for i, b in enumerate(sizes)]
            hi = [(cells[b]["speedup_ci"] or [y[i], y[i]])[1] - y[i] for i, b in enumerate(sizes)]
            ax.errorbar(sizes, y, yerr=[lo, hi], linestyle=style, marker="o", markersize=3, capsize=2,
                        color=colours[name], label=f"{name} ({decode_path})")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    sizes = record["setup"]["batch_sizes"]
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(b) for b in sizes])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("speedup over AR on the same path")
    ax.set_title(f"{record['setup']['model']}: eager (dashed) and static (solid), 95 % intervals")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def throughput_figure(record: dict[str, Any], path: Path) -> None:
    plt = _plt()
    series = _series(record)
    colours = _colours(list(series))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, by_path in series.items():
        for decode_path, style in (("eager", "--"), ("static", "-")):
            cells = by_path.get(decode_path, {})
            sizes = sorted(cells)
            if not sizes:
                continue
            x = [cells[b]["latency_s"] for b in sizes]
            y = [cells[b]["images_per_s"] for b in sizes]
            ax.plot(x, y, linestyle=style, marker="o", markersize=3, color=colours[name],
                    label=f"{name} ({decode_path})")
            for b, xi, yi in zip(sizes, x, y):
                ax.annotate(str(b), (xi, yi), fontsize=6, xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("seconds an image waits (the batch's wall time)")
    ax.set_ylabel("images per second")
    ax.set_title(f"{record['setup']['model']}: throughput, points labelled by B (eager dashed, static solid)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
