"""Human-readable views of a run: the markdown table of every compared decoder and a one-line summary.

Example: ``python run.py`` prints both at the end and writes the table to ``table.md``.
"""
from __future__ import annotations

import io
from typing import Any

from coolsd.io import atomic_write_bytes

COLUMNS = (
    ("decoder", "decoder", "{}"),
    ("num_images", "N", "{:d}"),
    ("mean_accepted_length", "accepted length", "{:.2f}"),
    ("latency_s", "latency (s/img, batch 1)", "{:.3f}"),
    ("num_timed", "N timed", "{:d}"),
    ("speedup", "speedup vs AR", "{:.2f}x"),
    ("throughput_img_s", "throughput (img/s)", "{:.1f}"),
    ("target_forwards_per_image", "target fwd/img", "{:.1f}"),
    ("drafter_forwards_per_image", "drafter fwd/img", "{:.1f}"),
    ("tv_per_step", "TV/step", "{:.4f}"),
    ("fid", "FID", "{:.2f}"),
    ("kid", "KID", "{:.4f}"),
    ("clip_score", "CLIP score", "{:.4f}"),
    ("image_reward", "ImageReward", "{:.4f}"),
    ("hps_v2", "HPSv2.1", "{:.4f}"),
    ("fid_classifier", "FID (classifier features)", "{:.2f}"),
    ("kid_classifier", "KID (classifier features)", "{:.4f}"),
    ("fid_random_conv", "FID (random-conv features, not FID)", "{:.3f}"),
    ("class_accuracy", "class accuracy", "{:.3f}"),
)


def markdown_table(per_decoder: dict[str, dict[str, Any]]) -> str:
    """One row per decoder; columns that no decoder reports are left out."""
    cols = [c for c in COLUMNS if c[0] == "decoder" or any(c[0] in m for m in per_decoder.values())]
    lines = ["| " + " | ".join(title for _, title, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for name, metrics in per_decoder.items():
        row = {"decoder": name, **metrics}
        cells = [fmt.format(int(row[key]) if fmt == "{:d}" else row[key]) if row.get(key) is not None else "–"
                 for key, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def one_line_summary(record: dict[str, Any]) -> str:
    m = record["metrics"]
    ar = record["per_decoder"]["ar"]
    return (f"{record['decoder']} on {record.get('model') or 'model'}: accepted length "
            f"{m['mean_accepted_length']:.2f}, {m['latency_s']:.3f} s/img vs AR {ar['latency_s']:.3f} s/img "
            f"= {m.get('speedup', float('nan')):.2f}x, TV/step {m['tv_per_step']:.4f}, "
            f"{record['num_prompts']} prompts -> {record['output_dir']}/run.json")


QUALITY_AXES = (("fid", "FID (lower is better)"), ("kid", "KID (lower is better)"),
                ("fid_classifier", "FID, classifier features (lower is better)"),
                ("clip_score", "CLIP score (cosine)"), ("image_reward", "ImageReward"), ("hps_v2", "HPSv2.1"),
                ("class_accuracy", "class accuracy"),
                ("tv_per_step", "TV per step"))


def speed_quality_plot(per_decoder: dict[str, dict[str, Any]], path_png, n_images: int) -> bool:
    """One panel per quality metric the run measured: speedup over AR (x) against quality (y), one labelled
    point per decoder; PNG and PDF. Returns False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    axes_keys = [(k, t) for k, t in QUALITY_AXES if any(m.get(k) is not None for m in per_decoder.values())]
    if not axes_keys:
        return False
    fig, axes = plt.subplots(1, len(axes_keys), figsize=(4.2 * len(axes_keys), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], axes_keys):
        for name, m in per_decoder.items():
            if m.get(key) is None or m.get("speedup") is None:
                continue
            ax.scatter(m["speedup"], m[key], s=30)
            ax.annotate(name, (m["speedup"], m[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("speedup over AR (×)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"speed vs quality, {n_images} images per decoder", fontsize=10)
    fig.tight_layout()
    path_png = Path(path_png)
    for path, options in ((path_png, {"format": "png", "dpi": 120}), (path_png.with_suffix(".pdf"), {"format": "pdf"})):
        buf = io.BytesIO()
        fig.savefig(buf, **options)
        atomic_write_bytes(path, buf.getvalue())
    plt.close(fig)
    return True
