"""The shared cache of AR images: the AR images of every run with the same AR settings and code, reused; and who
times AR for a table (``eval.ar_timing=table``).

A table's rows compare their decoders against the same AR images (same model, prompts and seeds); each row's run
takes them from ``$COOLSD_CACHE/ar/<AR key>/`` where an earlier or concurrent row made them (``eval.reuse_ar``).
The AR key (``ar_key``) is the digest of AR's fingerprint without the machine's numerics signature, and of the
code that makes AR's tokens (``eval.records.code_digest``): an edited loop or sampler gets a new key, another GPU
kind does not (its images are reused and marked, as a requeue onto another GPU kind marks its records: every cached
record keeps the ``numerics`` signature and ``hardware`` it was made on; ``eval.numerics_mismatch=refuse`` takes
only this machine's). Every cached record carries the digest of the code that made its tokens (``code``).

Example: ``python run.py eval.num_prompts=100`` twice: the second run copies AR's batched images from the cache.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from coolsd.fingerprint import json_digest
from coolsd.io import atomic_write_bytes
from eval.records.image_records import JsonlLog


class CacheLockError(RuntimeError):
    """The cache's file system does not enforce the lock the rows of a table share."""


def ar_key(fingerprint: dict[str, Any], code_digest: str | None) -> str:
    """The cache folder of AR's images: AR's fingerprint without the ``numerics`` signature, and its code."""
    return json_digest({**{k: v for k, v in fingerprint.items() if k != "numerics"}, "code": code_digest})


def slug(text: str) -> str:
    """A file-name-safe form of a hardware name (``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "unknown"


def check_lock(folder: Path, timeout_s: float = 0.5) -> None:
    """Check, on ``folder``'s own file system, that a file lock held by one handle keeps out another (the rows of
    a table run on several nodes: a file system that ignores locks, as some NFS mounts without a lock daemon do,
    would let two rows write the cache at once). Raises ``CacheLockError`` naming the folder and what to do."""
    from filelock import FileLock, Timeout

    path = folder / f".lockcheck.{socket.gethostname()}.{os.getpid()}.lock"
    first, second = FileLock(str(path)), FileLock(str(path), timeout=0)
    try:
        with first.acquire(timeout=timeout_s):
            try:
                second.acquire(timeout=0)
            except Timeout:
                return
            second.release()
            raise CacheLockError(f"file locks are not enforced on the file system of {folder}: a second handle took "
                                 "a held lock, so rows sharing AR's images could write the cache at once")
    except (OSError, Timeout) as err:
        raise CacheLockError(f"file locks do not work on the file system of {folder} ({type(err).__name__}: {err}); "
                             "the rows of a table share AR's images there under a lock") from None
    finally:
        path.unlink(missing_ok=True)


class ARCache:
    """AR images of earlier runs with the same AR key (module doc), reused for the batched quality set.

    ``$COOLSD_CACHE/ar/<AR key>/``: ``records.jsonl`` (keyed by each image's ``image_key``: the AR key, prompt and
    seed) and ``images/<key>.png``; ``timing.<hardware>.<timed>.json`` names the row that times AR for that
    hardware and timed subset (``claim_timing``). At start the lock is checked on the cache's own file system
    (``check_lock``): a cache on a file system without working locks stops the run with the fix.

    Concurrent jobs share it: ``records.jsonl.lock`` (``filelock``) serialises loading (whose repair may
    rewrite the file) and every append, so a record written by one job is never cut off or interleaved by
    another (``tests/test_cache_lock.py``: two writer processes, no entry lost).

    Concurrent rows of one table make the AR images once (``producer``): the rank of the first job that needs
    images the cache lacks holds ``generate.<world>.<rank>.lock`` while it makes them; the same rank of another
    job with the same AR key makes its other decoders' images first, then shares the rest of the work
    (``eval.run.generator.Generator``): it takes what the producer has cached and makes the rest from the end of
    its list while the producer skips what is cached. The operating system releases the lock of a job that dies.
    """

    def __init__(self, root: Path, digest: str, lock_timeout_s: float = 600.0) -> None:
        from filelock import FileLock

        self.key = digest
        self.dir = root / "ar" / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            check_lock(self.dir)
        except CacheLockError as err:
            raise CacheLockError(f"{err}. Put COOLSD_CACHE on a file system every node shares that supports locks "
                                 "(a parallel file system, NFSv4 with locking), or give eval.reuse_ar=false (each row "
                                 "then makes its own AR images). Nothing was generated") from None
        self.lock = FileLock(str(self.dir / "records.jsonl.lock"), timeout=lock_timeout_s)
        self._offset = 0
        self.reload()

    def image_key(self, prompt: str, seed: int) -> str:
        """The cache key of AR's image of ``prompt`` and ``seed`` (the same on every machine)."""
        return json_digest([self.key, prompt, seed])

    def reload(self) -> None:
        """Read ``records.jsonl`` again (what other jobs appended since)."""
        with self.lock:
            self.log = JsonlLog(self.dir / "records.jsonl", key="fingerprint")
            path = self.dir / "records.jsonl"
            self._offset = path.stat().st_size if path.exists() else 0

    def refresh(self) -> None:
        """Read only the lines other jobs appended since the last read (cheap: called before every AR batch)."""
        path = self.dir / "records.jsonl"
        if not path.exists() or path.stat().st_size == self._offset:
            return
        with open(path, "rb") as fh:
            fh.seek(self._offset)
            raw = fh.read()
        complete = raw[: raw.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.split(b"\n"):
            try:
                rec = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("fingerprint"), str):
                self.log.done[rec["fingerprint"]] = rec

    def producer(self, world: int, rank: int):
        """The lock that the job making this cache's AR images for shard ``rank`` of ``world`` holds
        (``filelock.FileLock``; shards of the same world size cover the same prompts)."""
        from filelock import FileLock

        return FileLock(str(self.dir / f"generate.{world}.{rank}.lock"))

    def claim_chunk(self, world: int, rank: int, indices: list[int]) -> bool:
        """Whether this job may make AR's images ``indices`` of shard ``rank`` of ``world`` while sharing the work
        with their producer: the first job to ask gets them (``chunks/<world>.<rank>.<first>.<n>``, created
        exclusively), so two sharing jobs never make one chunk twice."""
        folder = self.dir / "chunks"
        folder.mkdir(exist_ok=True)
        try:
            os.close(os.open(folder / f"{world}.{rank}.{indices[0]}.{len(indices)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def get(self, image_key: str) -> dict | None:
        rec = self.log.done.get(image_key)
        if rec is None or (rec.get("image") and not (self.dir / rec["image"]).is_file()):
            return None
        return rec

    def put(self, record: dict, image_file: Path | None, image_key: str | None = None) -> None:
        """Add an AR record (and its image) under ``image_key`` (default: the record's own ``fingerprint``)."""
        image_key = image_key or record["fingerprint"]
        rec = {**record, "fingerprint": image_key}
        if image_file is not None:
            rec["image"] = f"images/{image_key}.png"
            atomic_write_bytes(self.dir / rec["image"], image_file.read_bytes())
        with self.lock:  # one whole line per record, whatever the other jobs append meanwhile
            self.log.append(rec)  # (``refresh`` reads it back with the others' lines: harmless)

    # -- AR's timing, once per table and hardware (eval.ar_timing=table) -------------------------------------------
    def timing_file(self, hardware: str, timed: int) -> Path:
        return self.dir / f"timing.{slug(hardware)}.{timed}.json"

    def claim_timing(self, hardware: str, timed: int, out_dir: Path) -> dict[str, Any]:
        """The row that times AR's ``timed`` images on ``hardware`` for this AR key: this one (``out_dir``) if no
        row has claimed it, or the claiming row's folder no longer exists; else the claiming row. Returns the
        claim (``out_dir``, ``host``, ``claimed``)."""
        path = self.timing_file(hardware, timed)
        mine = {"out_dir": str(Path(out_dir).resolve()), "host": socket.gethostname(), "hardware": hardware,
                "timed": timed, "claimed": dt.datetime.now(dt.timezone.utc).isoformat()}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                try:
                    held = json.loads(path.read_text())
                except (OSError, ValueError):
                    held = None
                if isinstance(held, dict) and held.get("out_dir") and Path(held["out_dir"]).is_dir():
                    return held
                path.unlink(missing_ok=True)  # its row folder is gone: claim it again
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(mine, fh)
            return mine
        return mine
