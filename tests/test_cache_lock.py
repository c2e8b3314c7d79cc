"""The shared AR image cache (``eval.ar_cache.ARCache``) under concurrent writers: two processes that append
records and reopen the cache meanwhile (a new job's load, whose repair may rewrite the file) leave a file in
which every line parses and no entry is lost.

On a local Linux disk one ``O_APPEND`` write is atomic, so unlocked appends rarely tear there; on NFS (a
cluster's shared cache) they are not. The writers therefore append each line in pieces with a pause between
them (``_torn_append``), as a non-atomic file system may: without the lock the lines interleave and the test
fails (checked by hand with the lock replaced by a no-op: 15 of 74 lines parsed, 80 written)."""
from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

from eval.ar_cache import ARCache

PER_WRITER = 40
TOKENS = 6000  # ~30 kB per JSON line: several write() calls each, so unlocked appends can interleave


def _torn_append(self, record: dict) -> None:
    """``JsonlLog.append`` as a file system without atomic appends may perform it: several writes, a pause."""
    import os
    import time

    line = (json.dumps(record) + "\n").encode()
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        for k in range(0, len(line), len(line) // 4 + 1):
            os.write(fd, line[k : k + len(line) // 4 + 1])
            time.sleep(0.001)
    finally:
        os.close(fd)
    self.done[record[self.key]] = record


def _writer(root: str, name: str, start_event) -> None:
    from eval.records import JsonlLog

    JsonlLog.append = _torn_append
    start_event.wait()
    cache = ARCache(Path(root), "digest")
    for k in range(PER_WRITER):
        cache.put({"fingerprint": f"{name}-{k}", "index": k, "tokens": list(range(TOKENS))}, None)
        if k % 8 == 7:
            cache = ARCache(Path(root), "digest")  # another job starts: it loads (and repairs) the file


def test_two_concurrent_writers_lose_nothing(tmp_path):
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), name, start)) for name in ("a", "b")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    raw = (tmp_path / "ar" / "digest" / "records.jsonl").read_text()
    lines = raw.splitlines()
    assert raw.endswith("\n")
    records = [json.loads(line) for line in lines]  # a torn or interleaved line would not parse
    keys = [r["fingerprint"] for r in records]
    assert sorted(keys) == sorted(f"{n}-{k}" for n in ("a", "b") for k in range(PER_WRITER))
    assert all(r["tokens"] == list(range(TOKENS)) for r in records)
    reopened = ARCache(tmp_path, "digest")
    assert set(reopened.log.done) == set(keys)


def _open_and_put(root: str) -> None:
    from filelock import Timeout

    try:
        ARCache(Path(root), "digest", lock_timeout_s=0.2).put({"fingerprint": "x", "index": 0}, None)
    except Timeout:
        raise SystemExit(3)


def test_writer_waits_for_the_lock(tmp_path):
    """While another job holds the cache's lock, a writer waits for it (here: times out) and appends nothing."""
    from filelock import FileLock

    cache = ARCache(tmp_path, "digest")
    with FileLock(str(cache.dir / "records.jsonl.lock")):
        p = mp.get_context("spawn").Process(target=_open_and_put, args=(str(tmp_path),))
        p.start()
        p.join(timeout=60)
        assert p.exitcode == 3
    assert not (cache.dir / "records.jsonl").exists()
    _open_and_put(str(tmp_path))  # the lock released: the same write goes through
    assert set(ARCache(tmp_path, "digest").log.done) == {"x"}
