"""Generation of one rank's images: the timed subset at batch 1 (decoders interleaved per prompt), the rest in
batches (decoders interleaved per batch), every image recorded as it finishes (``records/<decoder>.jsonl``).

Before the timed phase (``eval.preflight``, on by default) every decoder makes its first batch of the batched set
at ``eval.batch_size`` (recorded: it is real work, not an extra), so an out-of-memory shows in the first minutes:
the run then stops naming the largest batch size that fits (halving down, with untimed warm-up seeds); and every
metric of ``eval.metrics`` scores those images once (its model built, its weights read, its pipeline run), then
is moved off the GPU until scoring.

A decoder with ``decoder.refill=true`` on the static path makes its batched set (after the pre-flight batch) as one
queue through ``eval.batch_size`` rows (``Decoder.generate_stream``: a row whose image finishes takes the next
prompt), recorded when the queue is done; its records share one ``batch_id`` whose ``batch_s`` is the queue's wall
time and ``batch_images`` its number of images (throughput: images ÷ seconds, as for a batch).

AR's timed images (``eval.ar_timing=table``): only the row that claimed AR's timing for this AR configuration and
GPU kind (``ARCache.claim_timing``) times AR, interleaved per prompt with its own decoder; the other rows time
their decoder alone and make AR's timed-subset images with the batched set (or take them from the cache).

AR's batched images shared through the cache: a row whose AR images another row is making (its producer lock is
held) makes its own decoders' images first; then, instead of waiting idle for that lock, it takes what the cache
holds and makes the rest from the end of its list, one batch at a time, each batch put in the cache, while the
producer skips what the cache already holds: the two meet in the middle.

Example: ``eval.run.experiment`` builds a ``Generator`` per run and calls ``run`` with the finished records.
"""
from __future__ import annotations

import logging
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

log = logging.getLogger("coolsd")


class BatchSizeError(RuntimeError):
    """``eval.batch_size`` does not fit in the device's memory; the message names the size that does."""


def _offload(metric: Any) -> None:
    """Move a metric's built models (``nn.Module`` attributes, or in a tuple) to the CPU until scoring, which
    moves them back (every metric calls ``.to(device)`` on use)."""
    for value in vars(metric).values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, torch.nn.Module):
                item.cpu()


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
    hardware: str | None = None  # the GPU (or CPU) the images are made on, stored in every record
    time_ar: bool = True  # False: another row times AR for this table and GPU kind (eval.ar_timing=table)

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
        timers = [name for name in self.decoders if name != "ar" or self.time_ar]
        # the timed subset must have been timed (a batched record of it has no latency). A prompt that some
        # decoder has not timed yet is timed again for every decoder, AR included, so each speedup divides
        # latencies measured in one invocation (a decoder added to a finished run is not divided by an AR
        # latency of another process, machine load or clock)
        untimed = {i for i in timed for name in timers if not (i in done[name] and done[name][i].get("timed"))}
        todo_timed = [(i, name) for i in timed if i in untimed for name in timers]
        todo_rest = {name: [i for i in rest if i not in done[name]] for name in self.decoders}
        if not self.time_ar:  # AR's timed-subset images come with its batched set (another row times AR)
            todo_rest["ar"] = [i for i in timed if i not in done["ar"]] + todo_rest["ar"]
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
            batches = {name: self._chunks(name, idx) for name, idx in todo_rest.items()}
            if suite.preflight:
                self._preflight(batches, done, bar)
            for name in {n for _, n in todo_timed}:
                for w in range(suite.warmup):
                    self.decoders[name].generate(prompts[0], WARMUP_SEED - w, label="warm-up")
            for i, name in todo_timed:
                self._generate(name, [i], timed=True)
                bar.update(1)
            for round_ in range(max((len(b) for b in batches.values()), default=0)):  # decoders interleaved
                for name, chunks in batches.items():
                    if round_ < len(chunks):
                        bar.update(self._generate_batch(name, chunks[round_]))
            if deferred:  # another job is making these AR images: share the rest of the work with it
                tqdm.write(f"AR's batched images are being made by another job with the same AR settings (lock "
                           f"{producer.lock_file}); taking what it has made from {self.ar_cache.dir} and making the "
                           "rest from the end of the list, so neither job waits idle")
                self._share_deferred(deferred, producer, bar)
            bar.close()
        finally:
            if producer is not None and producer.is_locked:
                producer.release()
        if self.progress is not None:
            self.progress.finish()

    def _refills(self, name: str) -> bool:
        """Whether the decoder decodes a list as one queue (``decoder.refill`` on the static path; plain AR never
        needs it: its images all finish together)."""
        decoder = self.decoders[name]
        return bool(getattr(decoder, "refill", False)) and decoder.static is not None and not decoder.plain_ar

    def _chunks(self, name: str, indices: list[int]) -> list[list[int]]:
        """The batches of ``indices``: ``eval.batch_size`` each, or for a refilling decoder (``_refills``) the
        pre-flight batch (one plain batch, ``eval.preflight``) and then every other index as one stream of that
        width (``Decoder.generate_stream``: a row whose image finishes takes the next prompt)."""
        size = self.suite.batch_size
        if not self._refills(name) or len(indices) <= size:
            return [indices[k: k + size] for k in range(0, len(indices), size)]
        head = [indices[:size]] if self.suite.preflight else []
        rest = indices[size:] if head else indices
        return head + [rest]

    def _generate_batch(self, name: str, indices: list[int], cold: bool = False) -> int:
        """One untimed batch; AR's indices that another job has put in the cache meanwhile are taken from it
        instead. ``cold``: the decoder's first call (the pre-flight batch), left out of the throughput. Returns the
        images done."""
        if name == "ar" and self.ar_cache is not None:
            self.ar_cache.refresh()
            left = self._reuse_ar(indices)
            if left:
                self._generate(name, left, timed=False, cold=cold)
            return len(indices)
        self._generate(name, indices, timed=False, cold=cold)
        return len(indices)

    def _share_deferred(self, deferred: list[int], producer: Any, bar: Any) -> None:
        """AR's images another job was making when this one started: take what the cache holds; while that job
        still holds its producer lock, make one unclaimed batch from the end of what is left (``ARCache.claim_chunk``:
        jobs sharing the work never make one batch twice; each is put in the cache), polling only when every batch
        left is claimed by another job; once the lock is free, make all that is left."""
        size = self.suite.batch_size
        left = list(deferred)
        while left:
            self.ar_cache.refresh()
            before = len(left)
            left = self._reuse_ar(left)
            bar.update(before - len(left))
            if not left:
                return
            try:
                producer.acquire(timeout=0)
            except Timeout:
                chunks = [left[max(k - size, 0): k] for k in range(len(left), 0, -size)]
                mine = next((c for c in chunks if self.ar_cache.claim_chunk(self.shards.world, self.shards.rank, c)),
                            None)
                if mine is None:  # every batch left is being made by another job: it ends soon
                    time.sleep(self.shards.poll_s)
                    continue
                self._generate("ar", mine, timed=False)
                bar.update(len(mine))
                left = [i for i in left if i not in set(mine)]
                continue
            for k in range(0, len(left), size):
                bar.update(self._generate_batch("ar", left[k: k + size]))
            return

    def _preflight(self, batches: dict[str, list[list[int]]], done: dict[str, dict[int, dict]], bar: Any) -> None:
        """Before the timed phase: every decoder's first batch at ``eval.batch_size`` (recorded, and taken off
        ``batches``), stopping with the batch size that fits on an out-of-memory (``BatchSizeError``); then every
        metric scores those images once and is moved off the GPU (module doc)."""
        images: list[tuple[Path, str]] = []
        for name, chunks in batches.items():
            if not chunks:
                continue
            chunk = chunks.pop(0)
            try:
                bar.update(self._generate_batch(name, chunk, cold=True))
            except torch.OutOfMemoryError as err:
                self._free()
                raise BatchSizeError(self._fitting_message(name, len(chunk), err)) from None
            images += [(self.out_dir / "images" / name / f"{i:05d}.png", self.prompts[i]) for i in chunk]
        images = [(p, t) for p, t in images if p.is_file()]
        if not images:  # nothing batched left: the finished records' images
            images = [(self.out_dir / r["image"], r["prompt"]) for recs in done.values() for r in recs.values()
                      if r.get("image") and (self.out_dir / r["image"]).is_file()]
        metrics = list(self.suite.metrics)
        if not metrics:
            return
        need = max(getattr(m, "min_images", 1) for m in metrics)
        if len(images) < need:
            log.info(f"the metrics were not tried before the timed phase ({len(images)} image(s) to score, they need "
                     f"{need}); they run after generation")
            return
        sample = images[: max(need, min(len(images), self.suite.batch_size))]
        for metric in metrics:
            try:
                metric.per_image([p for p, _ in sample], [t for _, t in sample], self.model.device)
            except torch.OutOfMemoryError as err:
                self._free()
                raise BatchSizeError(f"{type(metric).__name__} ran out of memory scoring one batch of {len(sample)} "
                                     f"images before the timed phase ({str(err).splitlines()[0][:200]}); lower its "
                                     "batch_size (eval.metrics.<i>.batch_size). Nothing was timed") from None
            _offload(metric)
        self._free()

    def _free(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fitting_message(self, name: str, size: int, err: BaseException) -> str:
        """The error of a batch that ran out of memory, with the largest batch size that fits (halving down,
        warm-up seeds, nothing recorded)."""
        fits = None
        trial = size // 2
        while trial >= 1:
            try:
                self.decoders[name].generate_batch([self.prompts[0]] * trial,
                                                   [WARMUP_SEED - k for k in range(trial)],
                                                   labels=["batch-size check"] * trial)
                fits = trial
                break
            except torch.OutOfMemoryError:
                self._free()
                trial //= 2
        device = self.hardware or str(self.model.device)
        said = str(err).splitlines()[0][:200] if str(err) else "out of memory"
        tail = (f"eval.batch_size={fits} fits: rerun with it (an image does not depend on the batch size; "
                "finished images are kept)") if fits else \
            "not even one image fits at once besides the model: use a GPU with more memory or model.dtype=bfloat16"
        return (f"eval.batch_size={size} does not fit on {device} for decoder {name!r} ({said}), found before the "
                f"timed phase; {tail}")

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
        """Copy cached AR records (and images) into this run; returns the indices still to generate.

        A cached image made on another GPU kind (or CPU) is reused and keeps its ``numerics`` and ``hardware``, so
        the row is marked as a requeue onto another machine is (‡; ``eval.numerics_mismatch=refuse`` takes only
        this machine's); its batch timing is kept only where it was made on this hardware (throughput)."""
        left = []
        for i in indices:
            cached = self.ar_cache.get(self.ar_cache.image_key(self.prompts[i], self.suite.seed + i))
            if cached is None or (self.suite.save_images and not cached.get("image")) or (
                    self.suite.numerics_mismatch == "refuse" and cached.get("numerics") != self.signature):
                left.append(i)
                continue
            record = {**cached, "index": i, "reused": True, "timed": False,
                      "fingerprint": self.records.image_digest("ar", self.prompts[i], self.suite.seed + i)}
            if cached.get("timed") or cached.get("hardware") != self.hardware:
                record["batch_id"], record["batch_s"] = None, None  # no batch of this machine to time
            if cached.get("image"):
                path = self.out_dir / "images" / "ar" / f"{i:05d}.png"
                atomic_write_bytes(path, (self.ar_cache.dir / cached["image"]).read_bytes())
                record["image"] = str(path.relative_to(self.out_dir))
            self.logs["ar"].append(record)
        return left

    def _generate(self, name: str, indices: list[int], timed: bool, cold: bool = False) -> None:
        """Make, save and record one batch (``timed``: a batch-1 image of the timed subset; ``cold``: a decoder's
        first call, whose wall time is not a throughput sample: no ``batch_id``)."""
        self.shards.check_lease()  # another attempt took this row over: stop before writing
        suite, model = self.suite, self.model
        cuda = model.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prompts = [self.prompts[i] for i in indices]
        seeds = [suite.seed + i for i in indices]
        decoder = self.decoders[name]
        stream = not timed and self._refills(name) and len(indices) > suite.batch_size
        if stream:  # one queue through eval.batch_size rows; its wall time is the throughput's batch time
            gens = decoder.generate_stream(prompts, seeds, labels=indices, width=suite.batch_size)
            batch_s = decoder.stream_s
        else:
            gens = decoder.generate_batch(prompts, seeds, labels=indices)
            batch_s = max(g.stats.latency_s for g in gens)
        batch_id = None if timed or cold else uuid.uuid4().hex[:12]
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
                **({"batch_images": len(gens)} if stream else {}),  # a stream holds more images than its width
                "numerics": self.signature,
                "hardware": self.hardware,
                "code": self.records.code_digest(name),
                "stats": stats,
            }
            self.logs[name].append(record)
            if name == "ar" and self.ar_cache is not None:  # timed ones too: other rows take them untimed
                self.ar_cache.put(record, images[k], self.ar_cache.image_key(prompts[k], seeds[k]))
        if self.progress is not None:
            self.progress.add(name, [g.stats for g in gens], batch_s)
