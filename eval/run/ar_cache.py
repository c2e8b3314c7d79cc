"""The shared cache of AR images: the batched AR images of every run with the same AR fingerprint, reused.

A table's rows compare their decoders against the same AR images (same model, prompts and seeds); each row's run
takes them from ``$COOLSD_CACHE/ar/<AR fingerprint digest>/`` where an earlier or concurrent row made them
(``eval.reuse_ar``). Only the batched quality set is shared: latency is measured in every run.

Example: ``python run.py eval.num_prompts=100`` twice: the second run copies AR's batched images from the cache.
"""
from __future__ import annotations

from pathlib import Path

from coolsd.io import atomic_write_bytes
from eval.records.image_records import JsonlLog


class ARCache:
    """AR images of earlier runs with the same fingerprint, reused for the batched quality set.

    ``$COOLSD_CACHE/ar/<fingerprint digest>/``: ``records.jsonl`` (keyed by each image's digest of prompt and
    seed) and ``images/<digest>.png``. Latency is never reused: the timed subset is generated in every run.

    Concurrent jobs share it: ``records.jsonl.lock`` (``filelock``) serialises loading (whose repair may
    rewrite the file) and every append, so a record written by one job is never cut off or interleaved by
    another (``tests/test_cache_lock.py``: two writer processes, no entry lost).

    Concurrent rows of one table make the AR images once (``producer``): the rank of the first job that needs
    images the cache lacks holds ``generate.<world>.<rank>.lock`` while it makes them; the same rank of another
    job with the same AR fingerprint makes its other decoders' images first, then waits for that lock, reloads the
    cache and takes them. The operating system releases the lock of a job that dies, so the waiting job then
    makes what is still missing itself.
    """

    def __init__(self, root: Path, digest: str, lock_timeout_s: float = 600.0) -> None:
        from filelock import FileLock

        self.dir = root / "ar" / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.dir / "records.jsonl.lock"), timeout=lock_timeout_s)
        self.reload()

    def reload(self) -> None:
        """Read ``records.jsonl`` again (what other jobs appended since)."""
        with self.lock:
            self.log = JsonlLog(self.dir / "records.jsonl", key="fingerprint")

    def producer(self, world: int, rank: int):
        """The lock that the job making this cache's AR images for shard ``rank`` of ``world`` holds
        (``filelock.FileLock``; shards of the same world size cover the same prompts)."""
        from filelock import FileLock

        return FileLock(str(self.dir / f"generate.{world}.{rank}.lock"))

    def get(self, image_digest: str) -> dict | None:
        rec = self.log.done.get(image_digest)
        if rec is None or (rec.get("image") and not (self.dir / rec["image"]).is_file()):
            return None
        return rec

    def put(self, record: dict, image_file: Path | None) -> None:
        rec = dict(record)
        if image_file is not None:
            rec["image"] = f"images/{record['fingerprint']}.png"
            atomic_write_bytes(self.dir / rec["image"], image_file.read_bytes())
        with self.lock:  # one whole line per record, whatever the other jobs append meanwhile
            self.log.append(rec)
