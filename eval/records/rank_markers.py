"""Rank markers: ``<out_dir>/ranks/rank<k>.json``, each rank's state on disk (``running`` with a heartbeat,
``done`` with its record counts, ``failed`` with the error), and the waits that read them.

Every rank writes its marker beside the records, atomically (``coolsd.io``): ``running`` at start-up and again
every ``dist.poll_s`` seconds while it works (a heartbeat), then ``done`` or ``failed``; a meeting point adds the
value the rank brings (``publish``). A waiting rank polls the others' markers (``wait_for``) and reports a rank
whose heartbeat has not changed for ``dist.stale_min`` minutes (measured on the waiting rank's clock, so clocks of
other nodes do not matter) as dead, naming its host and process. Markers of an earlier attempt (a requeued or
resumed job) carry another attempt id and are ignored. ``RankMarkers.latest`` reads a folder's markers without
taking part (``scripts/status.py`` tells a failed or silent run from a running one by them).

Example: ``eval.run.shards.Shards.begin`` starts this rank's marker; ``RankMarkers.latest(Path("runs/x"))`` lists
the markers of that run's latest attempt.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from coolsd.io import atomic_write_json

log = logging.getLogger("coolsd")

#: ``dist.*`` keys (configs/config.yaml) of the markers and their defaults: the heartbeat interval and the
#: silence after which a waiting rank reports another dead
MARKER_DEFAULTS = {"poll_s": 10.0, "stale_min": 30.0}


def marker_time(marker: dict[str, Any]) -> float | None:
    """A marker's ``time`` (written in ISO format) in seconds since the epoch; None where it is not readable."""
    try:
        return dt.datetime.fromisoformat(str(marker.get("time"))).timestamp()
    except ValueError:
        return None


class RankMarkers:
    """``<out_dir>/ranks/rank<k>.json`` of one attempt: each rank's state (``running`` with a heartbeat count,
    ``done`` with its record counts, ``failed`` with the error), and the wait for other ranks' markers."""

    def __init__(self, out_dir: Path, rank: int, world: int, attempt: str,
                 poll_s: float = MARKER_DEFAULTS["poll_s"], stale_min: float = MARKER_DEFAULTS["stale_min"]) -> None:
        self.dir = Path(out_dir) / "ranks"
        self.rank, self.world, self.attempt = rank, world, attempt
        self.poll_s, self.stale_s = poll_s, 60.0 * stale_min
        self._beats = 0
        self._state = "running"
        self._published: dict[str, Any] = {}  # start-up values the other ranks wait for (``publish``)
        self._lock = threading.RLock()  # re-entrant: a requeue signal may land in the main thread's _end
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json"

    @staticmethod
    def latest(out_dir: Path) -> list[dict[str, Any]]:
        """The markers of ``out_dir``'s latest attempt (the attempt of the newest marker), in rank order, each
        with ``_t``: its time in seconds (its file's modification time where its ``time`` is not readable)."""
        found = []
        for path in sorted((Path(out_dir) / "ranks").glob("rank*.json")):
            try:
                marker = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(marker, dict) and isinstance(marker.get("rank"), int):
                marker["_t"] = marker_time(marker) or path.stat().st_mtime
                found.append(marker)
        if not found:
            return []
        latest = max(found, key=lambda m: m["_t"]).get("attempt")
        return sorted((m for m in found if m.get("attempt") == latest), key=lambda m: m["rank"])

    def _write(self, **extra: Any) -> None:
        atomic_write_json(self.path(self.rank), {
            "attempt": self.attempt, "rank": self.rank, "world": self.world, "state": self._state,
            "beat": self._beats, "host": socket.gethostname(), "pid": os.getpid(),
            "time": dt.datetime.now(dt.timezone.utc).isoformat(), "published": self._published, **extra})

    def publish(self, key: str, value: Any) -> None:
        """Add ``key: value`` (JSON) to this rank's marker now and in every later write; ``wait_for`` with
        ``published=key`` waits for it on the other ranks."""
        with self._lock:
            self._published[key] = value
            self._write()

    def start(self) -> None:
        """Write ``running`` now and again every ``poll_s`` seconds (a daemon thread) until ``finish``/``fail``."""
        self._write()
        self._thread = threading.Thread(target=self._beat, name=f"coolsd-heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if self._state != "running":
                    return
                self._beats += 1
                try:
                    self._write()
                except OSError as e:  # a full or briefly unreachable disk: the next beat tries again
                    log.warning(f"rank {self.rank}: could not write its heartbeat {self.path(self.rank)}: {e}")

    def _end(self, state: str, **extra: Any) -> None:
        self._stop.set()
        with self._lock:
            if self._state != "running":
                return
            self._state = state
            self._write(**extra)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def stop(self) -> None:
        """End the heartbeat without a final state (what a killed rank leaves: a ``running`` marker)."""
        self._stop.set()

    def finish(self, records: dict[str, int] | None = None) -> None:
        """This rank's records are on disk: say so (``done``, with how many records of each decoder it holds)."""
        self._end("done", records=records or {})

    def fail(self, error: BaseException) -> None:
        self._end("failed", error=f"{type(error).__name__}: {error}"[:4000])

    def read(self, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s marker of this attempt (None: none yet, or one of an earlier attempt)."""
        try:
            status = json.loads(self.path(rank).read_text())
        except (OSError, ValueError):
            return None
        return status if isinstance(status, dict) and status.get("attempt") == self.attempt else None

    def wait_for(self, ranks: list[int], raise_on_failure: bool = True, published: str | None = None,
                 timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Poll every ``poll_s`` s until the markers of ``ranks`` say ``done`` (``published``: until they carry
        that published key) or ``failed`` (when not ``raise_on_failure``); returns them. Raises on a ``failed``
        marker (``raise_on_failure``), on a rank whose marker has not changed for ``stale_min`` minutes (it died:
        out of memory, a lost node; or hangs), and after ``timeout_s`` (None: no limit), naming the ranks."""
        def reached(status: dict[str, Any]) -> bool:
            return published in (status.get("published") or {}) if published else status.get("state") == "done"

        seen: dict[int, tuple[Any, float]] = {}
        done: dict[int, dict[str, Any]] = {}
        start = last_report = time.monotonic()
        while True:
            now = time.monotonic()
            for k in ranks:
                if k in done:
                    continue
                status = self.read(k)
                # reached before failed: a rank that published this meeting's value and failed right after
                # (between two polls of this rank) did come to the meeting; its failure stops the next wait
                if status is not None and reached(status):
                    done[k] = status
                    continue
                if status is not None and status.get("state") == "failed" and not raise_on_failure:
                    done[k] = status
                    continue
                if status is not None and status.get("state") == "failed":
                    raise RuntimeError(
                        f"rank {k} of {self.world} failed on {status.get('host')} (pid {status.get('pid')}): "
                        f"{status.get('error')}. Every finished image of every rank is kept in {self.dir.parent}; "
                        "fix the cause and rerun the same command with the same output folder (hydra.run.dir, or "
                        "hydra.sweep.dir for a sweep) to generate only the missing ones")
                sign = None if status is None else (status.get("beat"), status.get("time"))
                if k not in seen or seen[k][0] != sign:
                    seen[k] = (sign, now)
                elif now - seen[k][1] > self.stale_s:
                    last = "no marker of this attempt" if status is None else \
                        f"its last heartbeat, at {status.get('time')} from {status.get('host')} pid {status.get('pid')}"
                    raise RuntimeError(
                        f"rank {k} of {self.world} has given no sign of life for {self.stale_s / 60:g} min "
                        f"(dist.stale_min; {last} in {self.path(k)}): it died (out of memory, a lost node) or "
                        f"hangs. Its finished images are kept in {self.dir.parent}; rerun the same command with the "
                        "same output folder (hydra.run.dir, or hydra.sweep.dir for a sweep) to generate the rest")
            pending = [k for k in ranks if k not in done]
            if not pending:
                return done
            if timeout_s is not None and now - start > timeout_s:
                raise RuntimeError(
                    f"rank {self.rank}: ranks {pending} of {self.world} are alive but have not reached "
                    f"{published or 'the end of their shards'} after {timeout_s / 60:g} min (dist.timeout_min; their "
                    f"markers: {[str(self.path(k)) for k in pending]}). Nothing is lost: rerun the same command with "
                    "the same output folder once they can keep up (a slow filesystem, an overloaded node)")
            if now - last_report > 300:
                log.info(f"rank {self.rank}: its shard is done; waiting for ranks {pending} (ranks/rank<k>.json)")
                last_report = now
            time.sleep(self.poll_s)
