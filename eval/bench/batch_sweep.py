"""Where speculative decoding stops paying: speedup against batch size, each decode path against its own AR.

``run_sweep`` (``python scripts/bench.py bench=embedded_batch_sweep``) decodes, in one process, every decoder of
``decoders`` on both paths, the eager loop uncompiled (the papers' setting) and the static path compiled whole
(``model.compile=true`` on a CPU; captured in CUDA graphs on a GPU), at every batch size of ``sweep.batch_sizes``:

1. per batch size, one untimed batch of every (path, decoder) (a compiled or captured step is built for its batch
   size here), then ``sweep.repeats`` rounds in which every (path, decoder) decodes the same prompts and seeds, the
   order rotated from round to round so that a drift of the machine's speed spreads over all of them;
2. per (path, decoder, B): images per second and the latency an image sees, the batch's wall time (means over
   rounds, 95 % t-intervals), the
   speedup over AR on the same path and B (the geometric mean of the per-round paired ratios of AR's batch time to
   the decoder's, with its t-interval: ``eval.metrics.intervals.geometric_ratio``), the speedup over the fastest AR
   of either path at that B (the honest baseline), the mean accepted length, and the lock-step waste: a batch runs
   until its slowest image finishes, so ``1 − mean(iterations) / max(iterations)`` of its rows' iterations decode an
   image that has already finished (the static path keeps such rows in its fixed-shape step; the eager loop drops
   them, and runs narrower);
3. ``sweep.memory``: one more batch per (path, decoder, B) with the peak memory sampled: on a GPU
   ``max_memory_allocated``; on a CPU the most tensor memory the decode held at once, from the profiler's
   allocation events (``allocated_peak_mb``: the process's resident memory cannot tell one decode from the last),
   plus, on the static path, the workspace it keeps for the batch size (``kept_mb``);
4. ``sweep.anatomy``: one more batch per (path, decoder, B) on the uncompiled path with the target's forwards
   timed (``eval.bench.call_counts.PhaseCounter``): the share of the batch spent in verify forwards. A compiled
   step has no phase clock, so the static rows' share is its uncompiled step's (said in the table);
5. ``crossover``: per (path, decoder), the smallest B from which the speedup's interval lies below 1.

Writes ``<out_dir>/<name>.{md,json}`` and two figures (``<out_dir>/<name>_speedup.png``: speedup against B on a
log₂ axis, eager dashed, static solid, a line at 1; ``<name>_throughput.png``: images per second against the
seconds an image waits, the batch's wall time, one curve per decoder and path, points labelled by B), and the page
with its tables and figures, ``<name>.html`` (``eval.report.bench_page``).

Example: ``python scripts/bench.py bench=embedded_batch_sweep`` (about an hour on 2 CPU cores).
"""
from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from coolsd.decoding import Decoder
from coolsd.io import atomic_write_bytes
from eval.bench.call_counts import PhaseCounter, phase_hooks
from eval.bench.crossover import crossover, lockstep_waste
from eval.bench.efficiency import STATIC, Timer, build_decoders, progress
from eval.metrics.intervals import geometric_ratio, t_interval
from eval.records.environment import environment, git_commit
from eval.run.suite import WARMUP_SEED


def allocated_peak_mb(fn: Callable[[], Any]) -> float:
    """The most tensor memory ``fn`` held at once on the CPU, in MiB: the CPU's counterpart of CUDA's
    ``max_memory_allocated``, read from the profiler's allocation events (each carries the allocator's running total
    since profiling began). A sampler of the resident memory cannot see it: after the first batch the allocator
    serves a decode from pages the process already holds, so its resident size no longer grows."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            peak = max(peak, node.extra_fields.total_allocated)
        stack.extend(node.children)
    return peak / 2**20


def sweep_models(cfg: DictConfig) -> dict[str, Any]:
    """The target for each path: the eager loop's uncompiled, the static path's compiled on a CPU (a CUDA graph
    on a GPU needs no compilation; ``sweep.compile=false`` keeps it uncompiled, for a quick look); the same weights
    (the same config and seed)."""
    eager = instantiate(OmegaConf.merge(cfg.model, {"compile": False}))
    static = instantiate(OmegaConf.merge(cfg.model, {"compile": eager.device.type == "cpu" and cfg.sweep.compile}))
    return {"eager": eager, "static": static}


def run_sweep(cfg: DictConfig, model_name: str) -> dict[str, Any]:
    """The study (module doc); returns the JSON record."""
    started = dt.datetime.now(dt.timezone.utc)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    sweep = cfg.sweep
    sizes = [int(b) for b in sweep.batch_sizes]
    models = sweep_models(cfg)
    refused: dict[str, str] = {}
    decoders = {**build_decoders(cfg, models["eager"], "eager"),
                **build_decoders(cfg, models["static"], "static", refused)}
    static_sizes = [int(b) for b in (sweep.static_batch_sizes or sizes)]
    uncompiled = build_decoders(cfg, models["eager"], "static") if sweep.anatomy else {}
    timer = Timer(models["eager"].device)
    prompts = instantiate(cfg.data).load(models["eager"], max(sizes) * int(sweep.repeats), key="images")
    cells: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in decoders}
    name = cfg.name or f"{model_name}_batch_sweep"
    with torch.inference_mode():
        for b in sizes:
            keys = [k for k in decoders if not k.endswith(STATIC) or b in static_sizes]
            for key in keys:  # untimed: builds (compiles, captures) the step of this batch size
                decoders[key].generate_batch(prompts[:b], [WARMUP_SEED - j for j in range(b)])
            walls: dict[str, list[float]] = {k: [] for k in keys}
            stats: dict[str, list[Any]] = {k: [] for k in keys}
            for r in range(int(sweep.repeats)):
                chunk = [prompts[(r * b + j) % len(prompts)] for j in range(b)]
                seeds = [cfg.seed + r * b + j for j in range(b)]
                order = keys[r % len(keys):] + keys[:r % len(keys)]
                for key in order:
                    gens: list = []
                    walls[key].append(timer.once(lambda k=key, g=gens: g.extend(
                        decoders[k].generate_batch(chunk, seeds))))
                    stats[key].append([g.stats for g in gens])
                progress(f"sweep B={b} round {r + 1}/{sweep.repeats}")
            for key in keys:
                cells[key][b] = _cell(key, b, walls, stats)
            _speedups(cells, b)
            if sweep.memory:
                for key in keys:
                    cells[key][b]["peak_memory_mb"], cells[key][b]["kept_memory_mb"] = _peak(
                        decoders[key], prompts[:b], timer.cuda)
            if sweep.anatomy:
                for key in keys:
                    anatomy = uncompiled.get(key, decoders[key]) if key.endswith(STATIC) else decoders[key]
                    cells[key][b]["verify_share"] = verify_share(anatomy, prompts[:b])
            _write(cfg, name, model_name, models, cells, sizes, static_sizes, refused, started)
    return _write(cfg, name, model_name, models, cells, sizes, static_sizes, refused, started, figures=True)


def _cell(key: str, b: int, walls: dict[str, list[float]], stats: dict[str, list[Any]]) -> dict[str, Any]:
    rates = [b / w for w in walls[key]]
    iterations = [[s.iterations for s in batch] for batch in stats[key]]
    return {"batch": b, "walls_s": walls[key], "images_per_s": statistics.fmean(rates),
            "images_per_s_ci": t_interval(rates), "latency_s": statistics.fmean(walls[key]),
            "latency_s_ci": t_interval(walls[key]),
            "accepted_length": statistics.fmean(s.mean_accepted_length for batch in stats[key] for s in batch),
            "lockstep_waste": statistics.fmean(lockstep_waste(it) for it in iterations)}


def _speedups(cells: dict[str, dict[int, dict[str, Any]]], b: int) -> None:
    """Each cell's speedup at ``b`` over AR on its path, and over the fastest AR of either path."""
    ars = {key: cells[key][b] for key in ("ar", "ar" + STATIC) if b in cells.get(key, {})}
    fastest = min(ars, key=lambda k: statistics.median(ars[k]["walls_s"])) if ars else None
    for key, by_b in cells.items():
        if b not in by_b:
            continue
        own = "ar" + STATIC if key.endswith(STATIC) else "ar"
        cell = by_b[b]
        if own in ars:
            r = geometric_ratio(ars[own]["walls_s"], cell["walls_s"])
            cell["speedup"], cell["speedup_ci"] = r["ratio"], r["interval"]
        if fastest:
            r = geometric_ratio(ars[fastest]["walls_s"], cell["walls_s"])
            cell["speedup_vs_fastest_ar"], cell["speedup_vs_fastest_ar_ci"] = r["ratio"], r["interval"]
            cell["fastest_ar"] = fastest


def tensor_mb(*roots: Any, depth: int = 4) -> float:
    """The bytes, in MiB, of the distinct tensor storages reachable from ``roots`` through dataclass fields,
    attributes, tuples, lists and dicts (``depth`` levels; modules, whose tensors are weights, are not entered)."""
    seen: dict[int, int] = {}

    def walk(obj: Any, level: int) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif level < depth and not isinstance(obj, torch.nn.Module):
            if isinstance(obj, (tuple, list)):
                items = obj
            elif isinstance(obj, dict):
                items = obj.values()
            else:
                items = getattr(obj, "__dict__", {}).values()
            for item in items:
                walk(item, level + 1)

    for root in roots:
        walk(root, 0)
    return sum(seen.values()) / 2**20


def kept_mb(decoder: Decoder, b: int) -> float:
    """What the static path keeps between batches of size ``b`` (its workspace: the KV cache and the decode state,
    and the drafter's fixed buffers), allocated once at the size's first batch and so outside a later batch's
    allocations; 0 on the eager path, which allocates a batch's state inside its decode."""
    loop = getattr(decoder, "static", None)
    if loop is None or b not in loop._workspaces:
        return 0.0
    return tensor_mb(loop._workspaces[b][0], getattr(decoder.drafter, "static", None))


def _peak(decoder: Decoder, prompts: list[str], cuda: bool) -> tuple[float, float]:
    """(peak MiB, of which kept): on a GPU ``max_memory_allocated`` (every live tensor, weights included); on a CPU
    the batch's own allocations at their peak plus what the static path keeps for the size (weights not included)."""
    seeds = list(range(len(prompts)))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        decoder.generate_batch(prompts, seeds)
        return torch.cuda.max_memory_allocated() / 2**20, kept_mb(decoder, len(prompts))
    kept = kept_mb(decoder, len(prompts))
    return allocated_peak_mb(lambda: decoder.generate_batch(prompts, seeds)) + kept, kept


def verify_share(decoder: Decoder, prompts: list[str]) -> float:
    """The share of one batch's wall time spent in the target's forwards (verify, or AR's step forward)."""
    counter = PhaseCounter()
    restores = [counter.wrap_method(*spec) for spec in phase_hooks(decoder)]
    try:
        start = time.perf_counter()
        decoder.generate_batch(prompts, list(range(len(prompts))))
        total = time.perf_counter() - start
    finally:
        for restore in reversed(restores):
            restore()
    return counter.seconds["target"] / total


def _curve(by_b: dict[int, dict[str, Any]]) -> dict[int, tuple[float, float, float]]:
    return {b: (c["speedup"], *(c["speedup_ci"] or (c["speedup"], c["speedup"]))) for b, c in by_b.items()
            if "speedup" in c}


def _write(cfg: DictConfig, name: str, model_name: str, models: dict[str, Any], cells: dict[str, dict[int, Any]],
           sizes: list[int], static_sizes: list[int], refused: dict[str, str], started: dt.datetime,
           figures: bool = False) -> dict[str, Any]:
    from coolsd.numerics import cpu_name

    crossings = {key: crossover(_curve(by_b)) for key, by_b in cells.items() if not key.startswith("ar")}
    record = {"setup": {"name": name, "model": model_name, "device": str(models["eager"].device),
                        "batch_sizes": sizes, "static_batch_sizes": static_sizes, "repeats": int(cfg.sweep.repeats),
                        "threads": torch.get_num_threads(),
                        "static_steps": "captured in CUDA graphs" if models["static"].device.type == "cuda"
                        else "compiled whole", "refused": refused, "cpu": cpu_name(),
                        "command": "python scripts/bench.py " + " ".join(sys.argv[1:]), "note": cfg.note},
              "cells": {k: {str(b): c for b, c in v.items()} for k, v in cells.items()},
              "crossover": crossings, "git": git_commit(), "environment": environment(),
              "started": started.isoformat(timespec="seconds"), "complete": figures,
              "wall_min": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds() / 60, 1)}
    out = Path(cfg.out_dir)
    atomic_write_bytes(out / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    if figures:
        from eval.report.batch_sweep_figures import speedup_figure, throughput_figure

        speedup_figure(record, out / f"{name}_speedup.png")
        throughput_figure(record, out / f"{name}_throughput.png")
    atomic_write_bytes(out / f"{name}.md", markdown(record).encode())
    if figures:
        from eval.report.bench_page import write_bench_page

        write_bench_page(out / f"{name}.md")
    return record


def _ci(c: dict[str, Any], key: str, digits: int = 2) -> str:
    value, ci = c.get(key), c.get(f"{key}_ci")
    if value is None:
        return "—"
    return f"{value:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def markdown(record: dict[str, Any]) -> str:
    """The study's page: the crossover table first, then every cell."""
    setup, cells = record["setup"], record["cells"]
    git = record["git"]
    lines = [f"# Speedup against batch size: {setup['model']}, both decode paths", "",
             f"`{setup['command']}`; {setup['cpu']}, {setup['threads']} torch thread(s), {setup['device']}; "
             f"git {git.get('commit')}{' (uncommitted changes)' if git.get('dirty') else ''}; {record['started']}"
             + (f", {record['wall_min']} min in all (compilation, anatomy and memory passes included)."
                if "wall_min" in record else "; its total time was not recorded.")
             + f"{'' if record['complete'] else ' **Incomplete**: the run was still going when this was written.'}",
             "", f"Batch sizes {setup['batch_sizes']} (static path: {setup['static_batch_sizes']}), "
             f"{setup['repeats']} rounds each, every (path, decoder) on the same prompts and seeds in a rotated order; "
             "eager = the papers' loop, uncompiled; static = every decode state on the device, one fixed-shape step "
             f"per iteration, {setup['static_steps']}. ± and [ ] = 95 % intervals over the rounds.", "",
             "## Where speculation stops paying", "",
             "The smallest batch size from which the speedup over AR on the same path lies below 1 with its whole "
             "interval (and stays there):", "", "| decoder | eager | static |", "|---|---|---|"]
    labels = sorted({k.removesuffix(STATIC) for k in cells if not k.startswith("ar")}, key=list(cells).index)
    sizes = setup["batch_sizes"]
    for label in labels:
        row = []
        for key in (label, label + STATIC):
            if key not in cells:
                row.append("not run")
                continue
            b = record["crossover"].get(key)
            largest = max(int(x) for x in cells[key])
            row.append(f"none up to {largest}" if b is None else
                       f"B = {b} ({_ci(cells[key][str(b)], 'speedup')})")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "## Ragged batches", "",
              "Every batch advances in lock-step: it ends when its slowest image has finished. The eager loop drops "
              "an image's row as it finishes (the batch runs narrower); the static path keeps the row in its "
              "fixed-shape step, where it costs what a decoding row costs. Refilling a finished row's slot with the "
              "next prompt could save at most that waste: on the static path at most 1 / (1 − waste) more images "
              "per second, less the refills' own prefills (a ceiling from the measured iteration counts, not a "
              "timing of refilling, which is not built). Static path, lock-step waste (ceiling):", "",
              "| decoder | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for label in labels:
        by_b = cells.get(label + STATIC, {})
        row = [f"{by_b[str(b)]['lockstep_waste']:.0%} ({1 / (1 - by_b[str(b)]['lockstep_waste']):.2f}×)"
               if str(b) in by_b else "—" for b in sizes]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "## Every cell", "",
              "| decoder | path | B | img/s | latency (s) | speedup over its path's AR | over the fastest AR | τ | "
              "verify share | lock-step waste | peak memory (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, by_b in cells.items():
        path = "static" if key.endswith(STATIC) else "eager"
        for b in sizes:
            c = by_b.get(str(b))
            if c is None:
                continue
            share = c.get("verify_share")
            lines.append(
                f"| {key.removesuffix(STATIC)} | {path} | {b} | {_ci(c, 'images_per_s', 1)} | {_ci(c, 'latency_s', 3)} | "
                f"{_ci(c, 'speedup')} | {_ci(c, 'speedup_vs_fastest_ar')} ({c.get('fastest_ar', '—')}) | "
                f"{c['accepted_length']:.2f} | {'—' if share is None else f'{share:.0%}'} | "
                f"{c['lockstep_waste']:.0%} | "
                f"{'—' if c.get('peak_memory_mb') is None else format(c['peak_memory_mb'], '.0f')} |")
    lines += ["", "Latency: the batch's wall time, which every image of the batch waits. Verify share: the target's forwards in one more batch of the uncompiled path (the static rows' from "
              "their uncompiled step: a compiled step has no phase clock). Lock-step waste: the share of the batch's "
              "row-iterations spent on images already finished (1 − mean ÷ max iterations). Peak memory: "
              + ("`max_memory_allocated` per batch." if setup["device"].startswith("cuda") else
                 "the most tensor memory one batch held at once, the weights not counted: its own allocations at "
                 "their peak (the profiler's allocation events; the CPU's counterpart of `max_memory_allocated`), "
                 "plus, on the static path, the workspace it keeps for the batch size (KV cache, decode state, the "
                 "drafter's buffers), allocated once at the size's first batch.")]
    if setup.get("refused"):
        lines += ["", "Not on the static path: " + "; ".join(f"{k} ({v})" for k, v in setup["refused"].items())]
    if record["complete"]:
        lines += ["", f"![speedup against batch size]({setup['name']}_speedup.png)",
                  f"![images per second against seconds per image]({setup['name']}_throughput.png)"]
    if setup.get("note"):
        lines += ["", str(setup["note"])]
    return "\n".join(lines) + "\n"
