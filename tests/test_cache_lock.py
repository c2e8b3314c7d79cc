"""The shared AR image cache (``eval.run.ar_cache.ARCache``) under concurrent writers: two processes that append
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

import pytest

from eval.run.ar_cache import ARCache

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
    from eval.records.image_records import JsonlLog

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


# -- two rows of one table make AR's images once --------------------------------------------------------------------
ROW = ("import pathlib, runpy, sys, time\n"
       "import eval.run.generator as g\n"
       "here, other = pathlib.Path(sys.argv.pop(1)), pathlib.Path(sys.argv.pop(1))\n"
       "run, make = g.Generator.run, g.Generator._generate\n"
       "def met(self, done):\n"  # both rows start generating together (a file barrier)
       "    here.touch()\n"
       "    while not other.exists():\n"
       "        time.sleep(0.05)\n"
       "    run(self, done)\n"
       "def slow(self, name, indices, timed, **kw):\n"  # AR's batches take long enough for the other row to come
       "    if name == 'ar' and not timed:\n"
       "        time.sleep(0.3)\n"
       "    make(self, name, indices, timed, **kw)\n"
       "g.Generator.run, g.Generator._generate = met, slow\n"
       "sys.argv = ['run.py', *sys.argv[1:]]\n"
       "runpy.run_path('run.py', run_name='__main__')\n")


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_two_concurrent_rows_make_ar_once(tmp_path):
    """Two rows of a table (the same AR settings, other decoders) started together with one AR cache: one makes
    AR's 22 batched images while the other makes its own decoder's; the other then shares the rest of AR's work
    instead of waiting idle for the first (it takes what the cache holds and makes unclaimed batches from the end,
    the first skips what the cache holds): AR's batched images are made once in all, save at most the one batch
    the two may start at the same moment where they meet."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "COOLSD_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    common = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=none",
              "eval.num_prompts=24", "eval.speed_prompts=2", "eval.batch_size=2", "eval.warmup=0", "eval.threads=1",
              "dist.poll_s=1"]
    rows = {"sd2": ["decoder=sd", "decoder.draft_len=2"], "sd3": ["decoder=sd", "decoder.draft_len=3"]}
    procs = {name: subprocess.Popen([sys.executable, "-c", ROW, str(tmp_path / f"{name}.ready"),
                                     str(tmp_path / f"{other}.ready"), *common, *extra,
                                     f"hydra.run.dir={tmp_path / name}"],
                                    cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for (name, extra), other in zip(rows.items(), reversed(list(rows)))}
    out = {name: p.communicate(timeout=300) for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, out[name][1][-3000:]
    made, reused, shared = 0, 0, []
    for name in rows:
        records = [json.loads(line) for line in (tmp_path / name / "records" / "ar.jsonl").read_text().splitlines()]
        assert sorted(r["index"] for r in records) == list(range(24))
        made += sum(not r["timed"] and not r.get("reused") for r in records)
        reused += sum(bool(r.get("reused")) for r in records)
        if "being made by another job" in out[name][0] + out[name][1]:
            shared.append(name)
    assert 22 <= made <= 24 and made + reused == 44 and len(shared) == 1, (made, reused, shared)
    helper = [json.loads(line) for line in (tmp_path / shared[0] / "records" / "ar.jsonl").read_text().splitlines()]
    assert any(not r["timed"] and not r.get("reused") for r in helper)  # it made some itself: it did not wait idle
    run = json.loads((tmp_path / shared[0] / "run.json").read_text())
    assert run["per_decoder"]["ar"]["num_images"] == 24


def test_the_cache_lock_is_checked_on_the_caches_file_system(tmp_path, monkeypatch):
    """A file system that does not enforce locks (a second handle takes a held lock, as on an NFS mount without a
    lock daemon) stops the run at the cache's creation, naming the folder and the fix; a working one passes."""
    import filelock
    import pytest

    from eval.run.ar_cache import CacheLockError, check_lock

    check_lock(tmp_path)  # this disk enforces them

    class Ignored:  # what such a file system gives: every handle gets the lock
        def __init__(self, *args, **kwargs) -> None:
            pass

        def acquire(self, timeout=None):
            return self

        def release(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(filelock, "FileLock", Ignored)
    with pytest.raises(CacheLockError, match="not enforced on the file system of .*eval.reuse_ar=false"):
        ARCache(tmp_path / "cache", "digest")
