"""What one ``run.py`` invocation does: build the model and decoders, generate, measure, score, record.

One run = one model, one prompt set, one or more decoders compared in the same process, with ``ar`` always
measured as the speedup denominator on the same prompts and seeds (``seed + prompt index``, so results do
not depend on sharding). Decoders are interleaved per prompt (prompt 0 with every decoder, then prompt 1,
...) so slow drifts of the machine hit all of them alike.

Resumable: per-image records are appended to ``records/<decoder>[.rank<r>].jsonl`` as they finish and images
are written atomically; rerunning with the same output folder (``hydra.run.dir=<folder>``) skips every
finished (decoder, prompt), whichever process finished it.

Sharded: launched by ``torchrun --nproc_per_node=K run.py ...`` every rank takes the prompts with
``index % K == rank`` (on GPU rank r uses ``cuda:LOCAL_RANK``); rank 0 waits for all, gathers the records,
computes the metrics and writes ``run.json``. On SLURM use the Hydra submitit launcher (one job per
override set), with torchrun inside a job for several GPUs.

Example: ``python run.py decoder=sd eval.num_prompts=32``;
``torchrun --nproc_per_node=8 run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k hydra.run.dir=runs/x``.
"""
from __future__ import annotations

import datetime as dt
import io
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from coolsd.decoding import Decoder
from coolsd.io import atomic_write_bytes
from eval.records import JsonlLog, atomic_write_json, environment, git_commit, load_records, save_png
from eval.report import markdown_table, one_line_summary, speed_quality_plot

WARMUP_SEED = 2**31 - 1


@dataclass
class EvalSuite:
    """Settings of the generation-and-measurement pass (``configs/eval/*.yaml``).

    ``num_prompts`` images per decoder; ``warmup`` untimed generations per decoder before measuring;
    ``seed`` + prompt index seeds each image (identical for every decoder); ``speed_prompts`` limits the
    latency statistics to the first prompts (the protocol: 1,000 of 5,000; None = all); ``threads`` sets
    torch's CPU threads (None keeps torch's default); ``metrics`` are image-quality metrics
    (``eval.metrics``) computed on each decoder's images.
    """

    num_prompts: int = 8
    warmup: int = 1
    seed: int = 0
    save_images: bool = True
    threads: int | None = None
    speed_prompts: int | None = None
    metrics: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0:
            raise ValueError(f"eval.warmup must be >= 0, got {self.warmup}")
        if self.metrics and not self.save_images:
            raise ValueError("eval.metrics score the saved images: set eval.save_images=true or eval.metrics=[]")


class Shards:
    """torch.distributed context when launched by torchrun (WORLD_SIZE > 1); a no-op otherwise."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1:
            import torch.distributed as dist

            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)
            if not dist.is_initialized():
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (e.g. the output folder, which Hydra names per process)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


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


def summarize(records: list[dict], ar_latency: float | None, speed_prompts: int | None = None) -> dict[str, float]:
    """Flat metrics of one decoder over its images (pooled accepted length, mean latency, speedup).

    Latency, phase times and speedup use the first ``speed_prompts`` prompts; counts use every image.
    """
    n = len(records)
    stats = [r["stats"] for r in records]
    timed = stats[: speed_prompts or n]
    committed = sum(s["num_tokens"] - 1 for s in stats)  # the prefill's token is not a verify commit
    iterations = sum(s["iterations"] for s in stats)
    latency = sum(s["latency_s"] for s in timed) / len(timed)
    var = sum((s["latency_s"] - latency) ** 2 for s in timed) / max(len(timed) - 1, 1)
    out: dict[str, float] = {
        "num_images": n,
        "num_timed": len(timed),
        "mean_accepted_length": committed / max(iterations, 1),
        "latency_s": latency,
        "latency_std_s": math.sqrt(var),
        "target_forwards_per_image": sum(s["target_forwards"] for s in stats) / n,
        "drafter_forwards_per_image": sum(s["drafter_forwards"] for s in stats) / n,
        "tv_per_step": sum(s["tv_per_step"] for s in stats) / n,
    }
    for phase in ("prefill_s", "draft_s", "verify_s", "accept_s", "observe_s", "diagnostics_s", "decode_s"):
        if all(phase in s for s in timed):
            out[phase] = sum(s[phase] for s in timed) / len(timed)
    peaks = [s["peak_mem_mb"] for s in timed if s.get("peak_mem_mb") is not None]
    if peaks:
        out["peak_mem_mb"] = max(peaks)
    if ar_latency is not None:
        out["speedup"] = ar_latency / latency
    return out


def generate_shard(decoders: dict[str, Decoder], prompts: list[str], suite: EvalSuite, out_dir: Path,
                   shards: Shards) -> None:
    """Generate this rank's missing (prompt, decoder) pairs, appending records as they finish."""
    model = next(iter(decoders.values())).model
    suffix = f".rank{shards.rank}" if shards.world > 1 else ""
    logs = {name: JsonlLog(out_dir / "records" / f"{name}{suffix}.jsonl", key="index") for name in decoders}
    done = {name: set(load_records(out_dir / "records", name)) for name in decoders}
    mine = [i for i in range(len(prompts)) if i % shards.world == shards.rank]
    todo = [(i, name) for i in mine for name in decoders if i not in done[name]]
    for name in {n for _, n in todo}:
        for w in range(suite.warmup):
            decoders[name].generate(prompts[0], WARMUP_SEED - w)
    cuda = model.device.type == "cuda"
    bar = tqdm(todo, desc=f"generating ({len(prompts)} prompts x {len(decoders)} decoders"
               + (f", rank {shards.rank}/{shards.world})" if shards.world > 1 else ")"),
               unit="img", dynamic_ncols=True, disable=shards.rank != 0 and shards.world > 1)
    for i, name in bar:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        gen = decoders[name].generate(prompts[i], suite.seed + i)
        stats = gen.stats.as_dict()
        stats["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        image_path = None
        if suite.save_images:
            t0 = time.perf_counter()
            image = model.decode_image(gen.tokens)
            if cuda:
                torch.cuda.synchronize()
            stats["decode_s"] = time.perf_counter() - t0
            image_path = out_dir / "images" / name / f"{i:05d}.png"
            save_png(image_path, image)
        logs[name].append({
            "index": i,
            "prompt": prompts[i],
            "seed": suite.seed + i,
            "tokens": gen.tokens.tolist(),
            "image": str(image_path.relative_to(out_dir)) if image_path else None,
            "stats": stats,
        })


def run_experiment(cfg: DictConfig, output_dir: str | Path, decoder_overridden: bool = True,
                   choices: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate, measure and score; rank 0 writes ``run.json``, ``table.md``, grids; returns the record."""
    started = dt.datetime.now(dt.timezone.utc)
    wall0 = time.perf_counter()
    shards = Shards()
    out_dir = Path(shards.broadcast(str(output_dir)))
    suite: EvalSuite = instantiate(cfg.eval)
    for metric in suite.metrics:  # every weight, reference and tokenizer file before the first image
        metric.preflight()
    if suite.threads:
        torch.set_num_threads(int(suite.threads))
    torch.manual_seed(suite.seed)

    model = instantiate(cfg.model)
    decoder_cfgs = select_decoders(cfg, decoder_overridden)
    decoders: dict[str, Decoder] = {name: instantiate(dc, model=model) for name, dc in decoder_cfgs.items()}
    prompts = instantiate(cfg.data).load(model, suite.num_prompts)

    generate_shard(decoders, prompts, suite, out_dir, shards)
    shards.barrier()
    if shards.rank != 0:
        shards.close()
        return {}

    records = {name: load_records(out_dir / "records", name) for name in decoders}
    missing = {name: [i for i in range(len(prompts)) if i not in recs] for name, recs in records.items()}
    if any(missing.values()):
        raise RuntimeError(f"records missing after generation: {missing}")
    ordered = {name: [records[name][i] for i in range(len(prompts))] for name in decoders}
    ar_latency = summarize(ordered["ar"], None, suite.speed_prompts)["latency_s"]
    per_decoder = {name: summarize(recs, ar_latency, suite.speed_prompts) for name, recs in ordered.items()}
    for metric in suite.metrics:
        for name, recs in tqdm(ordered.items(), desc=f"scoring {type(metric).__name__}", unit="decoder"):
            per_decoder[name].update(metric.compute([out_dir / r["image"] for r in recs],
                                                    [r["prompt"] for r in recs], model.device))
    if suite.save_images:
        for name, recs in ordered.items():
            save_grid(out_dir / f"grid_{name}.png", out_dir, recs)

    selected = cfg.decoder.name
    record = {
        "decoder": selected,
        "model": (choices or {}).get("model"),
        "metrics": per_decoder[selected],
        "per_decoder": per_decoder,
        "num_prompts": len(prompts),
        "world_size": shards.world,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git": git_commit(),
        "environment": environment(),
        "started": started.isoformat(),
        "wall_s": time.perf_counter() - wall0,
        "output_dir": str(out_dir),
    }
    table = markdown_table(per_decoder)
    speed_quality_plot(per_decoder, out_dir / "speed_quality.png", len(prompts))
    atomic_write_json(out_dir / "run.json", record)
    atomic_write_bytes(out_dir / "table.md", (table + "\n").encode())
    logger = instantiate(cfg.logger)
    logger.log_run(record, out_dir)
    print(table)
    print(one_line_summary(record))
    shards.close()
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
