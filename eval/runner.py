"""What one ``run.py`` invocation does: build the model and decoders, generate, measure, record, report.

One run = one model, one prompt set, one or more decoders compared in the same process, with ``ar`` always
measured as the speedup denominator on the same prompts and seeds. Decoders are interleaved per prompt
(prompt 0 with every decoder, then prompt 1, ...) so slow drifts of the machine hit all of them alike.
Per-image records are appended to ``records/<decoder>.jsonl`` as they finish; rerunning with the same
output folder (``hydra.run.dir=<folder>``) skips the finished ones, so a long run resumes after a crash.

Example: ``python run.py decoder=sd eval.num_prompts=32``.
"""
from __future__ import annotations

import datetime as dt
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from coolsd.decoding import Decoder
from eval.records import JsonlLog, atomic_write_bytes, atomic_write_json, environment, git_commit, save_png
from eval.report import markdown_table, one_line_summary

WARMUP_SEED = 2**31 - 1


@dataclass
class EvalSuite:
    """Settings of the generation-and-measurement pass (``configs/eval/*.yaml``).

    ``num_prompts`` images per decoder; ``warmup`` untimed generations per decoder before measuring;
    ``seed`` + prompt index seeds each image (identical for every decoder); ``threads`` sets torch's CPU
    threads (None keeps torch's default).
    """

    num_prompts: int = 8
    warmup: int = 1
    seed: int = 0
    save_images: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0:
            raise ValueError(f"eval.warmup must be >= 0, got {self.warmup}")


def select_decoders(cfg: DictConfig, decoder_overridden: bool) -> dict[str, DictConfig]:
    """The decoder configs this run compares, AR first; ``cfg.decoder`` (with its overrides) wins its name.

    ``compare``: ``auto`` (every suite decoder when no ``decoder=`` was given on the command line, else
    none), ``all``, ``none``, or a list of suite names.
    """
    suite = cfg.suite
    mode = cfg.compare
    if mode == "auto":
        mode = "none" if decoder_overridden else "all"
    if mode == "all":
        names = list(suite)
    elif mode == "none":
        names = []
    elif OmegaConf.is_list(mode) or isinstance(mode, list):
        names = list(mode)
        unknown = [n for n in names if n not in suite]
        if unknown:
            raise ValueError(f"compare lists unknown decoders {unknown}; allowed: {list(suite)}")
    else:
        raise ValueError(f"compare must be auto, all, none or a list of {list(suite)}; got {mode!r}")
    if "ar" not in suite:
        raise ValueError("suite.ar (the AR baseline) is missing from the config")
    chosen: dict[str, DictConfig] = {"ar": suite.ar}
    for name in names:
        chosen[name] = suite[name]
    chosen[cfg.decoder.name] = cfg.decoder
    return chosen


def summarize(records: list[dict], ar_latency: float | None) -> dict[str, float]:
    """Flat metrics of one decoder over its images (pooled accepted length, mean latency, speedup)."""
    n = len(records)
    stats = [r["stats"] for r in records]
    committed = sum(s["num_tokens"] - 1 for s in stats)  # the prefill's token is not a verify commit
    iterations = sum(s["iterations"] for s in stats)
    latency = sum(s["latency_s"] for s in stats) / n
    var = sum((s["latency_s"] - latency) ** 2 for s in stats) / max(n - 1, 1)
    out = {
        "num_images": n,
        "mean_accepted_length": committed / max(iterations, 1),
        "latency_s": latency,
        "latency_std_s": math.sqrt(var),
        "target_forwards_per_image": sum(s["target_forwards"] for s in stats) / n,
        "drafter_forwards_per_image": sum(s["drafter_forwards"] for s in stats) / n,
        "tv_per_step": sum(s["tv_per_step"] for s in stats) / n,
    }
    for phase in ("prefill_s", "draft_s", "verify_s", "accept_s", "observe_s", "diagnostics_s"):
        out[phase] = sum(s[phase] for s in stats) / n
    if ar_latency is not None:
        out["speedup"] = ar_latency / latency
    return out


def run_experiment(cfg: DictConfig, output_dir: str | Path, decoder_overridden: bool = True,
                   choices: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate and measure; write ``run.json``, ``table.md``, images and records under ``output_dir``."""
    started = dt.datetime.now(dt.timezone.utc)
    wall0 = time.perf_counter()
    out_dir = Path(output_dir)
    suite: EvalSuite = instantiate(cfg.eval)
    if suite.threads:
        torch.set_num_threads(int(suite.threads))
    torch.manual_seed(suite.seed)

    model = instantiate(cfg.model)
    decoder_cfgs = select_decoders(cfg, decoder_overridden)
    decoders: dict[str, Decoder] = {name: instantiate(dc, model=model) for name, dc in decoder_cfgs.items()}
    prompts = instantiate(cfg.data).load(model, suite.num_prompts)

    logs = {name: JsonlLog(out_dir / "records" / f"{name}.jsonl", key="index") for name in decoders}
    todo = [(i, name) for i in range(len(prompts)) for name in decoders if i not in logs[name].done]
    for name, dec in decoders.items():
        if any(n == name for _, n in todo):
            for w in range(suite.warmup):
                dec.generate(prompts[0], WARMUP_SEED - w)

    for i, name in tqdm(todo, desc=f"generating ({len(prompts)} prompts x {len(decoders)} decoders)",
                        unit="img", dynamic_ncols=True):
        gen = decoders[name].generate(prompts[i], suite.seed + i)
        image_path = None
        if suite.save_images:
            image_path = out_dir / "images" / name / f"{i:05d}.png"
            save_png(image_path, model.decode_image(gen.tokens))
        logs[name].append({
            "index": i,
            "prompt": prompts[i],
            "seed": suite.seed + i,
            "tokens": gen.tokens.tolist(),
            "image": str(image_path.relative_to(out_dir)) if image_path else None,
            "stats": gen.stats.as_dict(),
        })

    ar_metrics = summarize(sorted(logs["ar"].records(), key=lambda r: r["index"]), None)
    per_decoder = {}
    for name in decoders:
        recs = [logs[name].done[i] for i in range(len(prompts))]
        per_decoder[name] = summarize(recs, ar_metrics["latency_s"])
    if suite.save_images:
        for name in decoders:
            save_grid(out_dir / f"grid_{name}.png", out_dir, [logs[name].done[i] for i in range(len(prompts))])

    selected = cfg.decoder.name
    record = {
        "decoder": selected,
        "model": (choices or {}).get("model"),
        "metrics": per_decoder[selected],
        "per_decoder": per_decoder,
        "num_prompts": len(prompts),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git": git_commit(),
        "environment": environment(),
        "started": started.isoformat(),
        "wall_s": time.perf_counter() - wall0,
        "output_dir": str(out_dir),
    }
    table = markdown_table(per_decoder)
    atomic_write_json(out_dir / "run.json", record)
    atomic_write_bytes(out_dir / "table.md", (table + "\n").encode())
    logger = instantiate(cfg.logger)
    logger.log_run(record, out_dir)
    print(table)
    print(one_line_summary(record))
    return record


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
