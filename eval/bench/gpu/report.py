"""The GPU command's report: the goals, each met, not met or not measured, and the page (``gpu.md``).

Goals (``GOALS``), judged from the measurements alone:

* AR at most 2 s per image at XL 512 on the captured path (aim 1 s);
* a chain's verify block (``L + 1`` tokens) at most 1.3× a 1-token forward (captured, the static path's kernel and
  span);
* SD and COOL-SD (EAGLE-1 tree) projected faster than AR on the captured path at the papers' accepted lengths;
* loop overhead at most 10 %: the captured AR step against the captured 1-token forward it contains.

Example: ``goal_lines(report)``, the last lines a GPU run prints.
"""
from __future__ import annotations

from typing import Any

GOALS = {"ar_s_per_image": 2.0, "verify_ratio": 1.3, "loop_overhead": 0.10}
#: the static path's attention in the goals' blocks (the kernel and span the static step runs today)
STATIC_KERNEL = "math/full"


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """Each goal with its value and whether it is met (None: not measured)."""
    out: dict[str, Any] = {}
    ar = results.get("ar")
    blocks = results.get("blocks", {}).get("ms", {})
    ratio = results.get("blocks", {}).get("ratio", {})
    proj = results.get("iterations", {}).get("projection", {})
    pre = results.get("preflight")
    out["preflight: captured = static = eager tokens"] = None if pre is None else {
        "value": f"{len(pre['pairs']) - len({m.split(':')[0] for m in pre['mismatches']})} of {len(pre['pairs'])} "
                 "pairs equal", "met": not pre["mismatches"]}
    out[f"AR <= {GOALS['ar_s_per_image']:g} s per image (captured)"] = None if not ar else {
        "value": f"{ar['s_per_image']:.3f} s", "met": ar["s_per_image"] <= GOALS["ar_s_per_image"]}
    chain = ratio.get(f"{STATIC_KERNEL}/verify_chain")
    out[f"verify chain <= {GOALS['verify_ratio']:g}x a 1-token forward"] = None if chain is None else {
        "value": f"{chain:.2f}x", "met": chain <= GOALS["verify_ratio"]}
    if "sd_tree" in proj and "coolsd_tree" in proj:
        values = {k: proj[k]["projected_speedup"] for k in ("sd_tree", "coolsd_tree")}
        out["SD and COOL-SD projected faster than AR (captured)"] = {
            "value": ", ".join(f"{k} {v:.2f}x" for k, v in values.items()), "met": min(values.values()) > 1.0}
    else:
        out["SD and COOL-SD projected faster than AR (captured)"] = None
    forward = blocks.get(f"{STATIC_KERNEL}/forward_1")
    out[f"loop overhead <= {GOALS['loop_overhead']:.0%}"] = None if not (ar and forward) else {
        "value": f"{1.0 - forward / ar['ms_per_step']:.1%}",
        "met": 1.0 - forward / ar["ms_per_step"] <= GOALS["loop_overhead"]}
    return out


def goal_lines(report: dict[str, Any]) -> list[str]:
    """The goals table, as the run's last lines on stdout."""
    rows = report.get("goals", {})
    lines = ["", "| goal | measured | verdict |", "|---|---|---|"]
    for goal, state in rows.items():
        lines.append(f"| {goal} | {'—' if state is None else state['value']} | "
                     f"{'not measured' if state is None else 'met' if state['met'] else 'not met'} |")
    if report.get("dry_run"):
        lines.append("(CPU dry run: tiny models, nothing captured; these verdicts test the command, not a GPU)")
    return lines


def _f(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: hardware, versions and command, the steps, each result, the goals."""
    hw, model = report["hardware"], report.get("model", {})
    lines = [f"# The GPU command: {model.get('name', 'no model built yet')}", "",
             f"Hardware: {hw.get('gpu') or 'CPU ' + str(hw.get('cpu'))}"
             + (f", {hw.get('memory_gb')} GiB, CUDA {hw.get('cuda')}, driver {hw.get('driver')}" if hw.get("gpu")
                else "") + "; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + f"; {report['date']}.",
             f"Command: `{report['command']}`; budget {report['budget_s']:.0f} s, plan estimate "
             f"{report['estimate_s']:.0f} s, ran {report.get('seconds', 0.0):.0f} s.", ""]
    if model:
        lines += [f"Model: {model['name']}, {model['dtype']}, {model['image_tokens']} image tokens, "
                  f"{model['weights']} weights; captions cleaned with {model['caption_cleaning']}.", ""]
    if report["dry_run"]:
        lines += ["**CPU dry run**: tiny models, nothing captured; these numbers only test the command.", ""]
    lines += ["| step | status | expected s | s |", "|---|---|---|---|"]
    for name, state in report["steps"].items():
        status = state.get("status", "running")
        if state.get("stopped"):
            status += f" ({state['stopped']})"
        lines.append(f"| {name} | {status} | {state['expected_s']:.0f} | {_f(state.get('seconds'), 1)} |")
    res = report["results"]
    if "preflight" in res:
        pre = res["preflight"]
        lines += ["", f"Preflight ({pre['dtype']}, TF32 {pre['tf32']}, {pre['images_per_pair']} images per pair, "
                  f"{'captured' if pre['captured'] else 'not captured (dry run)'}):", "",
                  "| model / decoder | captured = static | static = eager |", "|---|---|---|"]
        lines += [f"| {k} | {v['captured = static']} | {v['static = eager']} |" for k, v in pre["pairs"].items()]
    if "blocks" in res:
        b = res["blocks"]
        lines += ["", f"Forwards after {b['context_tokens']} image tokens, ms (× the 1-token forward of the same "
                  f"kernel and span); cache capacity {b.get('capacity')} slots, buckets {b.get('spans')}:", "",
                  "| kernel / span | 1 token | chain verify | tree verify (26) |", "|---|---|---|---|"]
        pairs = sorted({k.rsplit("/", 1)[0] for k in b["ms"]})
        for pair in pairs:
            cells = [f"{_f(b['ms'].get(f'{pair}/{n}'), 3)} ({_f(b['ratio'].get(f'{pair}/{n}'))}×)"
                     for n in ("forward_1", "verify_chain", "verify_tree_26")]
            lines.append(f"| {pair} | " + " | ".join(cells) + " |")
        for kernel, why in b.get("refused", {}).items():
            lines.append(f"\n{kernel} refused: {why}")
    for key, label in (("ar", "AR at batch 1"), ("eager_ar", "AR at batch 1, eager loop")):
        if key in res:
            r = res[key]
            lines += ["", f"{label} ({r['path']}, {r['images']} image(s)): {r['s_per_image']:.3f} s per image, "
                      f"{r['ms_per_step']:.2f} ms per step."]
    if "iterations" in res:
        it = res["iterations"]
        lines += ["", f"ms per iteration at batch 1 (captured; {it['count']} iterations each):", "",
                  "| decoder | ms / iteration |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in it["ms_per_iteration"].items()]
        if it.get("projection"):
            lines += ["", "Projected speedup over captured AR at the papers' accepted lengths (τ · AR ms per step ÷ "
                      "ms per iteration):", "", "| method | τ (source) | projected speedup |", "|---|---|---|"]
            lines += [f"| {k} | {v['tau']} ({v['source']}) | {v['projected_speedup']:.2f}× |"
                      for k, v in it["projection"].items()]
    if "throughput" in res:
        lines += ["", "AR throughput:", "", "| path / batch | images / s | s per batch | peak memory (GiB) |",
                  "|---|---|---|---|"]
        lines += [f"| {k} | {v['images_per_s']:.3f} | {v['s_per_batch']:.2f} | {_f(v['peak_memory_gb'], 1)} |"
                  for k, v in res["throughput"].items()]
    if "sweep" in res:
        lines += ["", "Batch sweep (captured; one batch per cell; speedup over AR at the same B, measured on random "
                  "weights and projected at the papers' accepted lengths):", "",
                  "| B | decoder | images / s | ms / iteration | measured speedup | projected speedup |",
                  "|---|---|---|---|---|---|"]
        for b, cells in res["sweep"]["batches"].items():
            lines += [f"| {b} | {n} | {c['images_per_s']:.3f} | {c['ms_per_iteration']:.2f} | {_f(c.get('speedup'))} | "
                      f"{_f(c.get('projected_speedup'))} |" for n, c in cells.items()]
    if "models_ar" in res:
        m = res["models_ar"]
        lines += ["", f"Captured AR of the other models at batch 1 ({m['count']} timed calls of the step each; random "
                  "weights; s per image projected as ms per step × tokens):", "",
                  "| model | path | image tokens | ms / step | s / image (projected) | peak memory (GiB) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {v['model']} | {v['path']} | {v['image_tokens']} | {v['ms_per_step']:.3f} | "
                  f"{v['projected_s_per_image']:.2f} | {_f(v['peak_memory_gb'], 1)} |"
                  for k, v in m.items() if k != "count"]
    shown = {"preflight", "blocks", "ar", "eager_ar", "iterations", "throughput", "sweep", "models_ar"}
    for name in sorted(set(res) - shown):
        lines += ["", f"{name}: see gpu.json (`results.{name}`)."]
    lines += ["", "Goals:", *goal_lines(report)[1:]]
    return "\n".join(lines) + "\n"
