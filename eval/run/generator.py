"""Generation of one rank's images: the timed subset at batch 1 (decoders interleaved per prompt), the rest in
batches (decoders interleaved per batch), every image recorded as it finishes (``records/<decoder>.jsonl``).

Example: ``eval.run.experiment`` builds a ``Generator`` per run and calls ``run`` with the finished records.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import Timeout
from tqdm import tqdm

from coolsd.decoding import Decoder
from coolsd.io import atomic_write_bytes
from eval.records.image_records import JsonlLog, record_file, save_png
from eval.run.ar_cache import ARCache
from eval.run.loggers import Progress
from eval.run.resume import RunRecords
from eval.run.shards import Shards
from eval.run.suite import WARMUP_SEED, EvalSuite


@dataclass
class Generator:
    """Generates and records images of one rank: the timed subset at batch 1, the rest in batches."""

    decoders: dict[str, Decoder]
    prompts: list[str]
    suite: EvalSuite
    out_dir: Path
    shards: Shards
    records: RunRecords
    ar_cache: ARCache | None
    signature: str | None = None  # this machine's numerics signature, stored in every record
    progress: Progress | None = None  # live progress (console + logger), rank 0 only

    def __post_init__(self) -> None:
        self.logs = {name: JsonlLog(record_file(self.out_dir / "records", name, self.shards.rank, self.shards.world),
                                    key="index") for name in self.decoders}
        self.model = next(iter(self.decoders.values())).model

    def run(self, done: dict[str, dict[int, dict]]) -> None:
        suite, prompts = self.suite, self.prompts
        mine = [i for i in range(len(prompts)) if i % self.shards.world == self.shards.rank]
        self._restore_images(done, set(mine))
        timed = [i for i in mine if i < suite.num_timed]
        rest = [i for i in mine if i >= suite.num_timed]
        # the timed subset must have been timed (a batched record of it has no latency). A prompt that some
        # decoder has not timed yet is timed again for every decoder, AR included, so each speedup divides
        # latencies measured in one invocation (a decoder added to a finished run is not divided by an AR
        # latency of another process, machine load or clock)
        untimed = {i for i in timed for name in self.decoders if not (i in done[name] and done[name][i].get("timed"))}
        todo_timed = [(i, name) for i in timed if i in untimed for name in self.decoders]
        todo_rest = {name: [i for i in rest if i not in done[name]] for name in self.decoders}
        producer, deferred = None, []
        try:
            if self.ar_cache is not None and "ar" in todo_rest:
                todo_rest["ar"], deferred, producer = self._claim_ar(todo_rest["ar"])
            counts = {name: sum(n == name for _, n in todo_timed) + len(todo_rest.get(name, []))
                      + (len(deferred) if name == "ar" else 0) for name in self.decoders}
            if self.progress is not None:
                self.progress.start(counts)
            bar = tqdm(total=sum(counts.values()), desc=f"generating ({len(prompts)} prompts x "
                       f"{len(self.decoders)} decoders" + (f", rank {self.shards.rank}/{self.shards.world})"
                                                           if self.shards.world > 1 else ")"),
                       unit="img", dynamic_ncols=True, disable=self.shards.rank != 0 and self.shards.world > 1)
            for name in {n for _, n in todo_timed}:
                for w in range(suite.warmup):
                    self.decoders[name].generate(prompts[0], WARMUP_SEED - w, label="warm-up")
            for i, name in todo_timed:
                self._generate(name, [i], timed=True)
                bar.update(1)
            batches = {name: [idx[k: k + suite.batch_size] for k in range(0, len(idx), suite.batch_size)]
                       for name, idx in todo_rest.items()}
            for round_ in range(max((len(b) for b in batches.values()), default=0)):  # decoders interleaved
                for name, chunks in batches.items():
                    if round_ < len(chunks):
                        self._generate(name, chunks[round_], timed=False)
                        bar.update(len(chunks[round_]))
            if deferred:  # another job was making these AR images: wait for it, take them, make what is left
                tqdm.write(f"AR's batched images are being made by another job with the same AR settings (lock "
                           f"{producer.lock_file}); waiting for it, to take them from {self.ar_cache.dir}")
                producer.acquire()
                self.ar_cache.reload()
                left = self._reuse_ar(deferred)
                bar.update(len(deferred) - len(left))
                for k in range(0, len(left), suite.batch_size):
                    self._generate("ar", left[k: k + suite.batch_size], timed=False)
                    bar.update(len(left[k: k + suite.batch_size]))
            bar.close()
        finally:
            if producer is not None and producer.is_locked:
                producer.release()
        if self.progress is not None:
            self.progress.finish()

    def _claim_ar(self, todo: list[int]) -> tuple[list[int], list[int], Any]:
        """AR's batched images of this rank: (those to make now, those another job is making now, the producer
        lock or None). Takes what the cache has; if images are left, makes them here (holding the producer
        lock, ``ARCache.producer``) unless another job with the same AR settings holds it: then they are
        deferred until that job is done."""
        todo = self._reuse_ar(todo)
        if not todo:
            return todo, [], None
        producer = self.ar_cache.producer(self.shards.world, self.shards.rank)
        try:
            producer.acquire(timeout=0)
        except Timeout:
            return [], todo, producer
        self.ar_cache.reload()  # what a job that held the lock until now has added
        return self._reuse_ar(todo), [], producer

    def _restore_images(self, done: dict[str, dict[int, dict]], mine: set[int]) -> None:
        """Finished records of this rank that have no image file (made with ``eval.save_images=false``, or the
        file was deleted) get their image decoded from their recorded tokens, before any generation, so every
        image metric finds one image per record (the tokens are the image; nothing is regenerated)."""
        if not self.suite.save_images:
            return
        for name, recs in done.items():
            lacking = sorted(i for i, r in recs.items() if i in mine
                             and not (r.get("image") and (self.out_dir / r["image"]).is_file()))
            for k in range(0, len(lacking), 64):
                chunk = lacking[k: k + 64]
                pixels = self.model.decode_images(torch.tensor([recs[i]["tokens"] for i in chunk],
                                                               device=self.model.device))
                for i, image in zip(chunk, pixels):
                    path = self.out_dir / "images" / name / f"{i:05d}.png"
                    save_png(path, image)
                    recs[i] = {**recs[i], "image": str(path.relative_to(self.out_dir))}
                    self.logs[name].append(recs[i])

    def _reuse_ar(self, indices: list[int]) -> list[int]:
        """Copy cached AR records (and images) into this run; returns the indices still to generate."""
        left = []
        for i in indices:
            digest = self.records.image_digest("ar", self.prompts[i], self.suite.seed + i)
            cached = self.ar_cache.get(digest)
            if cached is None or (self.suite.save_images and not cached.get("image")):
                left.append(i)
                continue
            record = {**cached, "index": i, "reused": True, "timed": False}
            if cached.get("image"):
                path = self.out_dir / "images" / "ar" / f"{i:05d}.png"
                atomic_write_bytes(path, (self.ar_cache.dir / cached["image"]).read_bytes())
                record["image"] = str(path.relative_to(self.out_dir))
            self.logs["ar"].append(record)
        return left

    def _generate(self, name: str, indices: list[int], timed: bool) -> None:
        suite, model = self.suite, self.model
        cuda = model.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prompts = [self.prompts[i] for i in indices]
        seeds = [suite.seed + i for i in indices]
        gens = self.decoders[name].generate_batch(prompts, seeds, labels=indices)
        batch_s = max(g.stats.latency_s for g in gens)
        batch_id = None if timed else uuid.uuid4().hex[:12]
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        images = [None] * len(gens)
        decode_s = 0.0
        if suite.save_images:
            t0 = time.perf_counter()
            pixels = model.decode_images(torch.stack([g.tokens for g in gens]))
            if cuda:
                torch.cuda.synchronize()
            decode_s = (time.perf_counter() - t0) / len(gens)
            for k, i in enumerate(indices):
                images[k] = self.out_dir / "images" / name / f"{i:05d}.png"
                save_png(images[k], pixels[k])
        for k, (i, gen) in enumerate(zip(indices, gens)):
            stats = gen.stats.as_dict()
            stats["peak_mem_mb"] = peak
            if suite.save_images:
                stats["decode_s"] = decode_s
            record = {
                "index": i,
                "prompt": prompts[k],
                "seed": seeds[k],
                "fingerprint": self.records.image_digest(name, prompts[k], seeds[k]),
                "tokens": gen.tokens.tolist(),
                "image": str(images[k].relative_to(self.out_dir)) if images[k] else None,
                "timed": timed,
                "batch_id": batch_id,
                "batch_s": batch_s,
                "numerics": self.signature,
                "stats": stats,
            }
            self.logs[name].append(record)
            if name == "ar" and self.ar_cache is not None and not timed:
                self.ar_cache.put(record, images[k])
        if self.progress is not None:
            self.progress.add(name, [g.stats for g in gens], batch_s)
