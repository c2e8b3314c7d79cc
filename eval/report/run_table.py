"""Human-readable views of a run: the markdown table of every compared decoder (value ± half its 95 % interval,
N per row), the paired comparisons with the baselines, a one-line summary and the speed–quality plot.

Example: ``python run.py`` prints the tables and the summary at the end, writes them to ``table.md`` and the
plot to ``speed_quality.png`` / ``.pdf``.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Sequence

from coolsd.io import atomic_write_bytes
from eval.metrics.intervals import FID_MIN_IMAGES

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
    ("tv_per_token", "TV/token", "{:.4f}"),
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
FID_KEYS = ("fid", "fid_classifier", "fid_random_conv")  # marked † below FID_MIN_IMAGES images
BIASED = "†"
BIAS_NOTE = (f"{BIASED} FID over fewer than {FID_MIN_IMAGES:,} images: strongly biased upwards (the bias falls "
             "like 1/N, so FIDs of different N are not comparable); compare KID, which is unbiased.")
TV_NOTE = ("TV – = not measured: the decoder's verification is not a sequence of token tests (SJD-SV and its GSD / "
           "LANTERN variants verify subsequences jointly, baselines/sv.py; PathRelax commits the longest of "
           "parallel paths, baselines/pathrelax.py), so it has no analytic one-step TV; its distance to the target "
           "is measured by the chi-square test on the lookup model instead (docs/jacobi-and-spatial.md).")
INTERVAL_NOTE = ("± = half the width of the 95 % interval (run.json `<metric>_ci` holds its ends; intervals of "
                 "ratios, speedup and FID are asymmetric); no ± = fewer than 2 images, or not estimable.")


def split_format(fmt: str) -> tuple[str, str]:
    """``"{:.2f}x"`` -> (``"{:.2f}"``, ``"x"``): the number's format and the unit after it."""
    end = fmt.rindex("}") + 1
    return fmt[:end], fmt[end:]


def half_width_text(number: str, half: float) -> str:
    """Half an interval's width in the value's format, or to one significant digit where that shows 0."""
    text = number.format(half)
    return f"{half:.1g}" if half > 0 and float(text) == 0 else text


def value_with_interval(value: float, ci: Sequence[float] | None, fmt: str) -> str:
    """``2.27 ± 0.05x``: the value, half the interval's width, then the unit."""
    number, unit = split_format(fmt)
    text = number.format(value)
    if ci is not None and all(c is not None and math.isfinite(c) for c in ci):
        text += " ± " + half_width_text(number, (ci[1] - ci[0]) / 2)
    return text + unit


def fid_is_biased(metrics: dict[str, Any]) -> bool:
    n = metrics.get("fid_num_images", metrics.get("num_images"))
    return n is not None and n < FID_MIN_IMAGES


def cell_text(metrics: dict[str, Any], key: str, fmt: str) -> str:
    value = metrics.get(key)
    if value is None:
        return "–"
    if fmt == "{:d}":
        return fmt.format(int(value))
    if fmt == "{}":
        return str(value)
    text = value_with_interval(value, metrics.get(f"{key}_ci"), fmt)
    return text + BIASED if key in FID_KEYS and fid_is_biased(metrics) else text


def table_cells(per_decoder: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(column titles, one row of cell texts per decoder): value ± half its 95 % interval; columns that no
    decoder reports are left out."""
    cols = [c for c in COLUMNS if c[0] == "decoder" or any(c[0] in m for m in per_decoder.values())]
    rows = [[cell_text({"decoder": name + marks(metrics), **metrics}, key, fmt)
             for key, _, fmt in cols] for name, metrics in per_decoder.items()]
    return [title for _, title, _ in cols], rows


#: the mark of a row whose images were made under several arithmetics (``eval.numerics_mismatch=accept``)
MIXED_MARK = " ‡"
MIXED_NOTE = ("‡ this decoder's images were made under several float32 arithmetics (the start-up self-check's "
              "signatures differ: a requeue onto another GPU kind or CPU, or ranks on two kinds); images per signature "
              "in run.json `numerics.record_signatures`. Its numbers mix them; `eval.numerics_mismatch=refuse` forbids it.")


def mixed_numerics(metrics: dict[str, Any]) -> bool:
    """Whether a decoder's images come from more than one arithmetic (``numerics_signatures``)."""
    return len(metrics.get("numerics_signatures") or {}) > 1


#: the mark of a row whose images were kept across a change of the code that makes them (``eval.code_mismatch=accept``)
CODE_MARK = " §"
CODE_NOTE = ("§ this decoder's images were made by other code than the code named in run.json (its records were kept "
             "across an edit of the modules that make its tokens, eval.code_mismatch=accept, or mix images of several "
             "code versions): run.json `code.accepted_mismatch` names the files; eval.code_mismatch=rerun makes them again.")


def mixed_code(metrics: dict[str, Any]) -> bool:
    """Whether a decoder's images were kept across a code change (``code_accepted``) or come from several code
    digests (``code_digests``; records made before code digests, ``unknown``, do not count)."""
    known = [d for d in (metrics.get("code_digests") or {}) if d != "unknown"]
    return bool(metrics.get("code_accepted")) or len(known) > 1


def marks(metrics: dict[str, Any]) -> str:
    """The marks of a decoder's row: ‡ (several arithmetics), § (kept across a code change)."""
    return (MIXED_MARK if mixed_numerics(metrics) else "") + (CODE_MARK if mixed_code(metrics) else "")


def markdown_table(per_decoder: dict[str, dict[str, Any]]) -> str:
    """One row per decoder, value ± half its 95 % interval, N per row, and the notes that explain the marks."""
    titles, rows = table_cells(per_decoder)
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join("---" for _ in titles) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", INTERVAL_NOTE]
    if any(k in m and fid_is_biased(m) for m in per_decoder.values() for k in FID_KEYS):
        lines.append(BIAS_NOTE)
    if any(mixed_numerics(m) for m in per_decoder.values()):
        lines.append(MIXED_NOTE)
    if any(mixed_code(m) for m in per_decoder.values()):
        lines.append(CODE_NOTE)
    if any(m.get("tv_measured") is False for m in per_decoder.values()):
        lines.append(TV_NOTE)
    return "\n".join(lines)


def p_text(p: float | None) -> str:
    if p is None:
        return "p –"
    return "p<0.001" if p < 0.001 else f"p={p:.3f}"


def comparison_table(per_decoder: dict[str, dict[str, Any]]) -> str:
    """The paired comparisons (``vs_<baseline>``): difference [95 % interval] and p per metric; "" if none."""
    pairs = [(name, key[3:], m[key]) for name, m in per_decoder.items() for key in m if key.startswith("vs_")]
    if not pairs:
        return ""
    formats = {key: split_format(fmt)[0] for key, _, fmt in COLUMNS if fmt not in ("{}", "{:d}")}
    titles = {key: title for key, title, _ in COLUMNS}
    keys = [k for k, _, _ in COLUMNS if any(k in c for _, _, c in pairs)]
    lines = ["| decoder | vs | " + " | ".join(f"Δ {titles[k]}" for k in keys) + " |",
             "|" + "|".join("---" for _ in range(len(keys) + 2)) + "|"]
    for name, base, comp in pairs:
        cells = []
        for key in keys:
            c = comp.get(key)
            if not c or c.get("difference") is None:
                cells.append("–")
                continue
            number = formats[key].replace("{:", "{:+")
            text = number.format(c["difference"])
            if c.get("ci"):
                text += " [" + ", ".join(formats[key].format(v) for v in c["ci"]) + "]"
            cells.append(f"{text} {p_text(c.get('p'))}")
        lines.append(f"| {name} | {base} | " + " | ".join(cells) + " |")
    lines += ["", "Δ = decoder − baseline on the same prompts and seeds, [95 % interval], two-sided p: accepted "
                  "length by Welch's t-test on per-image accepted lengths (the COOL-SD paper's test), latency and "
                  "image metrics by a paired bootstrap over prompts (FID/KID: generated features resampled, "
                  "reference fixed)."]
    return "\n".join(lines)


def tv_text(metrics: dict[str, Any]) -> str:
    """A decoder's TV per step for one line: ``0.0123``, or ``– (not measured)`` for joint tests (``TV_NOTE``)."""
    value = metrics.get("tv_per_step")
    return "– (not measured)" if value is None else f"{value:.4f}"


def one_line_summary(record: dict[str, Any]) -> str:
    m = record["metrics"]
    ar = record["per_decoder"]["ar"]
    ci = m.get("speedup_ci")
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    steps = {"graph": "CUDA graphs", "compiled": "compiled", "eager": "uncaptured steps"}
    where = f" (static path, {steps.get(record.get('static_steps'), 'steps not recorded')})" \
        if record.get("decode_path") == "static" else ""
    timing = record.get("ar_timing") or {}
    if "speedup" in m:
        versus = (f"{m.get('latency_s', float('nan')):.3f} s/img vs AR {ar.get('latency_s', float('nan')):.3f} s/img "
                  f"= {m['speedup']:.2f}x{interval} (95 %)")
        if not timing.get("timed_here", True):
            versus += f" (AR timed in {timing.get('timing_row')})"
    elif not timing.get("timed_here", True):
        versus = (f"{m.get('latency_s', float('nan')):.3f} s/img; speedup pending: AR is timed in "
                  f"{timing.get('timing_row')} (scripts/make_tables.py computes it once that row has timed AR)")
    else:
        versus = f"{m.get('latency_s', float('nan')):.3f} s/img (no AR latency)"
    return (f"{record['decoder']} on {record.get('model') or 'model'}{where}: accepted length "
            f"{m['mean_accepted_length']:.2f}, {versus}, TV/step {tv_text(m)}, "
            f"{record['num_prompts']} prompts -> {record['output_dir']}/run.json")


QUALITY_AXES = (("fid", "FID (lower is better)"), ("kid", "KID (lower is better)"),
                ("fid_classifier", "FID, classifier features (lower is better)"),
                ("clip_score", "CLIP score (cosine)"), ("image_reward", "ImageReward"), ("hps_v2", "HPSv2.1"),
                ("class_accuracy", "class accuracy"),
                ("fid_random_conv", "FID (random-conv features, not FID)"), ("tv_per_step", "TV per step"))
NONNEGATIVE = ("tv_per_step", "tv_per_token", "tv_per_image")


def error_bar(value: float, ci: Sequence[float] | None) -> tuple[float, float]:
    """(below, above) distances from the value to its interval's ends (0, 0 without one)."""
    if not ci or any(c is None or not math.isfinite(c) for c in ci):
        return 0.0, 0.0
    return max(value - ci[0], 0.0), max(ci[1] - value, 0.0)


def nonnegative_axis(ax: Any, highs: Sequence[float], what: str = "TV") -> None:
    """A y axis from 0 for a quantity that cannot be negative; when every value is 0 (exact decoders only),
    a fixed 0–0.05 range and a note instead of matplotlib's ±0.05 around zero."""
    top = max(highs, default=0.0)
    if top <= 0:
        ax.set_ylim(-0.0025, 0.05)
        ax.text(0.5, 0.5, f"{what} = 0 for every decoder (exact)", transform=ax.transAxes, ha="center",
                va="center", fontsize=8, color="0.35")
    else:
        ax.set_ylim(-0.04 * top, 1.18 * top)
    ax.ticklabel_format(axis="y", useOffset=False)


def label_inside(ax: Any, points: Sequence[tuple[float, float, str]], fontsize: int = 8) -> None:
    """Write each point's label towards the inside of the axes (left of points in the right half, below
    points in the upper half), after the limits are final, so no label leaves the axes; a label that would
    cover an earlier one moves further inwards, one line at a time."""
    x0, x1 = ax.get_xlim()
    y0, y1 = ax.get_ylim()
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for x, y, text in points:
        right = (x - x0) > 0.55 * (x1 - x0)
        upper = (y - y0) > 0.6 * (y1 - y0)
        step = -1 if upper else 1
        for k in range(6):
            label = ax.annotate(text, (x, y), textcoords="offset points",
                                xytext=(-5 if right else 5, step * (5 + k * (fontsize + 2))),
                                ha="right" if right else "left", va="top" if upper else "bottom", fontsize=fontsize)
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed) or k == 5:
                placed.append(box)
                break
            label.remove()


MARKERS = "osD^vP*Xph<>"


def speed_quality_plot(per_decoder: dict[str, dict[str, Any]], path_png, n_images: int,
                       labels: dict[str, str] | None = None) -> bool:
    """One panel per quality metric the run measured: speedup over AR (x) against quality (y), one point per
    decoder with its 95 % intervals on both axes, in its own colour and marker; one legend under the panels names
    each with the method and its defining option (``labels``, e.g. "COOL-SD δ=1.1"; default the decoder name), so
    no label covers a point or another label however close the points are; PNG and PDF. Returns False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    labels = labels or {}
    axes_keys = [(k, t) for k, t in QUALITY_AXES if any(m.get(k) is not None for m in per_decoder.values())]
    if not axes_keys:
        return False
    fig, axes = plt.subplots(1, len(axes_keys), figsize=(max(5.6, 4.4 * len(axes_keys)), 4.3), squeeze=False)
    for ax, (key, title) in zip(axes[0], axes_keys):
        highs = []
        for k, (name, m) in enumerate(per_decoder.items()):
            if m.get(key) is None or m.get("speedup") is None:
                continue
            x, y = m["speedup"], m[key]
            xerr, yerr = error_bar(x, m.get("speedup_ci")), error_bar(y, m.get(f"{key}_ci"))
            ax.errorbar([x], [y], xerr=[[xerr[0]], [xerr[1]]], yerr=[[yerr[0]], [yerr[1]]],
                        fmt=MARKERS[k % len(MARKERS)], ms=6, capsize=2, elinewidth=0.8, color=f"C{k % 10}",
                        label=labels.get(name, name))
            highs.append(y + yerr[1])
        ax.set_xlabel("speedup over AR (×), 95 % intervals")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.margins(x=0.12, y=0.12)
        if key in NONNEGATIVE:
            nonnegative_axis(ax, highs)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    biased = any(k in m and fid_is_biased(m) for m in per_decoder.values() for k in FID_KEYS)
    fig.suptitle(f"speed vs quality, {n_images} images per decoder (bars: 95 % intervals)"
                 + (f"; FID over < {FID_MIN_IMAGES:,} images is biased upwards, compare KID" if biased else ""),
                 fontsize=10)
    rows = -(-len(names) // 6)  # legend rows under the panels
    fig.tight_layout(rect=(0, 0.03 + 0.05 * rows, 1, 1))
    path_png = Path(path_png)
    for path, options in ((path_png, {"format": "png", "dpi": 120}), (path_png.with_suffix(".pdf"), {"format": "pdf"})):
        buf = io.BytesIO()
        fig.savefig(buf, **options)
        atomic_write_bytes(path, buf.getvalue())
    plt.close(fig)
    return True


def save_grid(path: Path, out_dir: Path, records: list[dict], max_images: int = 64) -> None:
    """One PNG with up to ``max_images`` generated images of a decoder, in prompt order."""
    from PIL import Image

    images = [Image.open(out_dir / r["image"]) for r in records[:max_images] if r.get("image")]
    if not images:
        return
    w, h = images[0].size
    cols = min(8, len(images))
    rows = math.ceil(len(images) / cols)
    canvas = Image.new("RGB", (cols * w, rows * h), "white")
    for k, im in enumerate(images):
        canvas.paste(im.convert("RGB"), ((k % cols) * w, (k // cols) * h))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
