"""Refilling finished rows against lock-step batches on the static path: images per second at a fixed width.

A lock-step batch runs until its slowest image has finished, its finished rows idling in the fixed-shape step
(``eval.bench.batch_sweep`` measures that waste); with refilling (``decoder.refill``,
``coolsd.static.StaticLoop.generate_stream``) a finished row takes the next prompt of the queue at once.
``refill_study`` (``python scripts/bench.py bench=embedded_refill``) times both, in one process, on the static path
(compiled whole on a CPU with ``refill.compile``, as ``eval.bench.batch_sweep.sweep_models`` builds it; captured in
CUDA graphs on a GPU), for every decoder of ``decoders`` and every width of ``refill.widths``:

1. per width, untimed: one lock-step batch and one refilled queue of two widths per decoder (the step of that
   batch size is compiled or captured here);
2. ``refill.rounds`` rounds over a queue of ``refill.queue × width`` prompts (new prompts and seeds each round):
   every decoder decodes it lock-step (``generate_batch`` over consecutive chunks of ``width``) and refilled
   (``generate_stream`` with ``width`` rows), the two in alternating order from round to round and the decoders in
   a rotated order, so a drift of the machine's speed falls on both;
3. per (decoder, width): images per second each way (means over rounds, 95 % t-intervals), the ratio refill ÷
   lock-step of images per second (the geometric mean of the per-round paired ratios of lock-step's wall time to
   refilling's, with its t-interval: ``eval.metrics.intervals.geometric_ratio``), the lock-step waste measured in
   the lock-step rounds (``eval.bench.crossover.lockstep_waste`` per chunk) with its ceiling ``1 / (1 − waste)``,
   the step calls each way, and how many images had the same tokens and iteration count both ways.

Writes ``<out_dir>/<name>.{md,json}`` (atomically, after every width) with the machine and the git description.

Example: ``python scripts/bench.py bench=embedded_refill`` (widths 16 and 64, K = 4, 3 rounds).
"""
from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from coolsd.decoding import Decoder
from coolsd.io import atomic_write_bytes
from coolsd.static.loop import lock_step_batches
from eval.bench.batch_sweep import sweep_models
from eval.bench.crossover import lockstep_waste
from eval.bench.efficiency import Timer, build_decoders, progress
from eval.metrics.intervals import geometric_ratio, t_interval
from eval.records.environment import environment, git_commit
from eval.run.suite import WARMUP_SEED


def lock_step(decoder: Decoder, prompts: list[str], seeds: list[int], width: int) -> list[Any]:
    """The queue decoded in consecutive lock-step batches of ``width`` (``generate_batch``)."""
    return lock_step_batches(decoder.generate_batch, prompts, seeds, list(range(len(prompts))), width)[0]


def refilled(decoder: Decoder, prompts: list[str], seeds: list[int], width: int) -> list[Any]:
    """The queue decoded with ``width`` rows, each refilled as its image finishes (``generate_stream``)."""
    return decoder.static.generate_stream(prompts, seeds, list(range(len(prompts))), width)


def refill_study(cfg: DictConfig, model_name: str) -> dict[str, Any]:
    """The study (module doc); returns the JSON record, also written to ``<out_dir>/<name>.{md,json}``.

    ``cfg`` is a composed ``configs/bench.yaml`` whose ``refill`` block names ``widths``, ``queue`` (K: a queue of
    K × width prompts), ``rounds`` and ``compile``; ``decoders`` and ``variants`` as for every bench.

    Example: ``refill_study(compose("bench", ["bench=embedded_refill"]), "embedded")``."""
    started = dt.datetime.now(dt.timezone.utc)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    study = cfg.refill
    widths = [int(w) for w in study.widths]
    k, rounds = int(study.queue), int(study.rounds)
    model = sweep_models(OmegaConf.merge(cfg, {"sweep": {"compile": bool(study.compile)}}))["static"]
    refused: dict[str, str] = {}
    decoders = build_decoders(cfg, model, "static", refused)
    timer = Timer(model.device)
    prompts = instantiate(cfg.data).load(model, max(widths) * k * rounds, key="images")
    name = cfg.name or f"{model_name}_refill"
    cells: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in decoders}
    keys = list(decoders)
    with torch.inference_mode():
        for width in widths:
            n = k * width
            for key in keys:  # untimed: builds (compiles, captures) the step of this batch size
                warm = [prompts[j % len(prompts)] for j in range(2 * width)]
                seeds = [WARMUP_SEED - j for j in range(2 * width)]
                decoders[key].generate_batch(warm[:width], seeds[:width])
                refilled(decoders[key], warm, seeds, width)
            runs: dict[str, dict[str, list]] = {key: {"lock": [], "refill": [], "steps_lock": [], "steps_refill": [],
                                                      "waste": [], "agree": []} for key in keys}
            for r in range(rounds):
                queue = [prompts[(r * n + j) % len(prompts)] for j in range(n)]
                seeds = [int(cfg.seed) + r * n + j for j in range(n)]
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    _round(decoders[key], queue, seeds, width, r % 2 == 1, timer, runs[key])
                progress(f"refill width={width} round {r + 1}/{rounds}")
            for key in keys:
                cells[key][width] = _cell(width, n, runs[key])
            _write(cfg, name, model_name, model, cells, widths, k, rounds, refused, started)
    return _write(cfg, name, model_name, model, cells, widths, k, rounds, refused, started, complete=True)


def _round(decoder: Decoder, queue: list[str], seeds: list[int], width: int, refill_first: bool, timer: Timer,
           run: dict[str, list]) -> None:
    """One decoder's round: the queue lock-step and refilled (in the order given), timed, with their step calls."""
    runner = decoder.static._workspaces[width][1]
    out: dict[str, list] = {}
    for way in (("refill", "lock") if refill_first else ("lock", "refill")):
        before = runner.calls
        fn = refilled if way == "refill" else lock_step
        run[way].append(timer.once(lambda f=fn, w=way: out.__setitem__(w, f(decoder, queue, seeds, width))))
        run[f"steps_{way}"].append(runner.calls - before)
    lock, stream = out["lock"], out["refill"]
    for s0 in range(0, len(lock), width):
        run["waste"].append(lockstep_waste([g.stats.iterations for g in lock[s0:s0 + width]]))
    run["agree"].append(sum(torch.equal(a.tokens, b.tokens) and a.stats.iterations == b.stats.iterations
                            for a, b in zip(lock, stream)))


def _cell(width: int, images: int, run: dict[str, list]) -> dict[str, Any]:
    rates = {way: [images / w for w in run[way]] for way in ("lock", "refill")}
    ratio = geometric_ratio(run["lock"], run["refill"])
    waste = statistics.fmean(run["waste"])
    return {"width": width, "images": images, "lockstep_walls_s": run["lock"], "refill_walls_s": run["refill"],
            "lockstep_images_per_s": statistics.fmean(rates["lock"]),
            "lockstep_images_per_s_ci": t_interval(rates["lock"]),
            "refill_images_per_s": statistics.fmean(rates["refill"]),
            "refill_images_per_s_ci": t_interval(rates["refill"]),
            "ratio": ratio["ratio"], "ratio_ci": ratio["interval"], "lockstep_waste": waste,
            "ceiling": 1 / (1 - waste) if waste < 1 else None,
            "lockstep_steps": statistics.fmean(run["steps_lock"]),
            "refill_steps": statistics.fmean(run["steps_refill"]),
            "images_agreeing": min(run["agree"])}


def _write(cfg: DictConfig, name: str, model_name: str, model: Any, cells: dict[str, dict[int, Any]],
           widths: list[int], k: int, rounds: int, refused: dict[str, str], started: dt.datetime,
           complete: bool = False) -> dict[str, Any]:
    from coolsd.numerics import cpu_name

    record = {"setup": {"name": name, "model": model_name, "device": str(model.device), "decoders": list(cells),
                        "widths": widths, "queue": k, "rounds": rounds, "threads": torch.get_num_threads(),
                        "static_steps": "captured in CUDA graphs" if model.device.type == "cuda" else
                        ("compiled whole" if cfg.refill.compile else "uncompiled"), "refused": refused,
                        "cpu": cpu_name(), "command": "python scripts/bench.py " + " ".join(sys.argv[1:]),
                        "note": cfg.note},
              "cells": {key: {str(w): c for w, c in by_w.items()} for key, by_w in cells.items()},
              "git": git_commit(), "environment": environment(), "started": started.isoformat(timespec="seconds"),
              "complete": complete}
    out = Path(cfg.out_dir)
    atomic_write_bytes(out / f"{name}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(out / f"{name}.md", markdown(record).encode())
    return record


def _ci(value: float | None, ci: list[float] | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def markdown(record: dict[str, Any]) -> str:
    """The study's page: one row per (decoder, width)."""
    setup, git = record["setup"], record["git"]
    lines = [f"# Refilling finished rows against lock-step batches: {setup['model']}, static path", "",
             f"`{setup['command']}`; {setup['cpu']}, {setup['threads']} torch thread(s), {setup['device']}; "
             f"git {git.get('commit')}{' (uncommitted changes)' if git.get('dirty') else ''}; {record['started']}."
             f"{'' if record['complete'] else ' **Incomplete**: the run was still going when this was written.'}",
             "", f"A queue of {setup['queue']} × width prompts per round, {setup['rounds']} rounds, new prompts and "
             "seeds each round; every decoder decodes it lock-step (consecutive batches of the width, each until its "
             "slowest image ends) and refilled (the width's rows, a finished row taking the next prompt), the two "
             f"in alternating order; static steps {setup['static_steps']}. [ ] = 95 % intervals over the rounds.",
             "", "| decoder | width | lock-step img/s | refilled img/s | refilled ÷ lock-step | lock-step waste "
             "(ceiling) | step calls (lock-step → refilled) | images agreeing |", "|---|---|---|---|---|---|---|---|"]
    for key, by_w in record["cells"].items():
        for width in setup["widths"]:
            c = by_w.get(str(width))
            if c is None:
                continue
            ceiling = "—" if c["ceiling"] is None else f"{c['ceiling']:.2f}×"
            lines.append(
                f"| {key.removesuffix('@static')} | {width} | "
                f"{_ci(c['lockstep_images_per_s'], c['lockstep_images_per_s_ci'], 1)} | "
                f"{_ci(c['refill_images_per_s'], c['refill_images_per_s_ci'], 1)} | {_ci(c['ratio'], c['ratio_ci'])} | "
                f"{c['lockstep_waste']:.0%} ({ceiling}) | {c['lockstep_steps']:.0f} → {c['refill_steps']:.0f} | "
                f"{c['images_agreeing']} of {c['images']} |")
    lines += ["", "Refilled ÷ lock-step: images per second refilled over lock-step, the geometric mean of the rounds' "
              "paired ratios. Lock-step waste: the share of a lock-step batch's row-iterations spent on images already "
              "finished (1 − mean ÷ max iterations), whose ceiling 1 / (1 − waste) bounds what refilling can gain "
              "before its own prefills. Step calls: per round. Images agreeing: the fewest, over the rounds, whose "
              "tokens and iteration count were the same both ways (all of them where the forwards are "
              "batch-invariant). AR takes N − 1 steps for every image: it runs lock-step batches either way."]
    if setup.get("refused"):
        lines += ["", "Not on the static path: " + "; ".join(f"{k} ({v})" for k, v in setup["refused"].items())]
    if setup.get("note"):
        lines += ["", str(setup["note"])]
    return "\n".join(lines) + "\n"
