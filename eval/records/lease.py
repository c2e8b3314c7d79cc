"""One attempt per row: the lease of a run folder (``<out_dir>/lease.json``), held by the attempt that writes there.

Two attempts writing one row folder interleave its ``records/*.jsonl``, clobber its rank markers and double the
GPU-hours (a sweep command rerun while its rows still run, a second ``python run.py hydra.run.dir=<folder>``).
The first attempt takes the lease before it writes anything: ``owner`` (the attempt id), ``host``, ``pid``, the
SLURM ``job_id`` where there is one, ``started`` and a ``heartbeat`` time it rewrites every ``dist.poll_s`` seconds.
A second attempt that finds a live lease stops at once and names the first; one whose heartbeat is older than
``dist.stale_min`` (the holder died without a word: out of memory, a lost node, ``scancel``) is taken over, and
the new attempt says so; so, at once, is one whose holder ran on this host and whose process has ended (a local run
killed and started again, ``holder_gone``). A requeue of the same SLURM job (the same ``SLURM_JOB_ID``: SLURM never runs one job id
twice at once) takes its own lease over at once. The lease is released (deleted) when the attempt ends, whether it
finished, failed or was requeued.

Creation is atomic on local disks and NFS alike: the lease is written to a temporary file and hard-linked to
``lease.json`` (``os.link`` fails when the name exists, as ``O_EXCL`` may not over NFS). A takeover renames the
stale file away first, so of two attempts taking over at once one gets the lease and the other finds it live.

Example: ``Lease(Path("results/runs/table_llamagen/row=sjd")).acquire()`` in ``eval.run.shards.Shards.begin``;
``Lease.read(folder)`` is what ``scripts/status.py`` shows.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("coolsd")

LEASE_FILE = "lease.json"
#: the environment variables that name a cluster job (the first one set wins)
JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


class LeaseHeld(RuntimeError):
    """Another live attempt holds the row folder's lease."""


def job_id() -> str | None:
    """This process's cluster job id (``SLURM_JOB_ID``, a job array's ``<array id>_<task>``), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return next((os.environ[k] for k in JOB_VARS if os.environ.get(k)), None)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def lease_age_s(lease: dict[str, Any], now: dt.datetime | None = None) -> float | None:
    """Seconds since a lease's last heartbeat (None where its time is not readable)."""
    try:
        beat = dt.datetime.fromisoformat(str(lease.get("heartbeat")))
    except ValueError:
        return None
    return ((now or _now()) - beat).total_seconds()


def describe(lease: dict[str, Any], now: dt.datetime | None = None) -> str:
    """``job 4242 on gpu07 (pid 311), started ..., last heartbeat 12 s ago``."""
    age = lease_age_s(lease, now)
    job = f"job {lease['job_id']} " if lease.get("job_id") else ""
    beat = f"{age:.0f} s ago" if age is not None else "at an unreadable time"
    return (f"{job}on {lease.get('host')} (pid {lease.get('pid')}, attempt {str(lease.get('owner'))[:8]}), started "
            f"{lease.get('started')}, last heartbeat {beat}")


def holder_gone(lease: dict[str, Any]) -> bool:
    """Whether a lease's holder ran on this host and its process has ended (a local run killed by Ctrl-C, SIGKILL or
    the out-of-memory killer): such a lease is taken over at once, not after ``dist.stale_min``. A process of
    another user counts as alive; a reused pid makes a dead holder look alive (then the heartbeat decides)."""
    pid = lease.get("pid")
    if lease.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, as another user's
        return False
    return False


class Lease:
    """The lease of one row folder (module doc). ``stale_min``: a heartbeat older than this is a dead holder's;
    ``poll_s``: how often the holder rewrites it."""

    def __init__(self, folder: Path, stale_min: float = 30.0, poll_s: float = 10.0, owner: str | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LEASE_FILE
        self.stale_s, self.poll_s = 60.0 * stale_min, poll_s
        self.owner = owner or uuid.uuid4().hex
        self.took_over: dict[str, Any] | None = None  # the stale lease this attempt replaced
        self.lost: dict[str, Any] | None = None  # set when another attempt took this one's lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = _now().isoformat()

    @staticmethod
    def read(folder: Path) -> dict[str, Any] | None:
        """The lease of a folder (None: none, or not readable)."""
        try:
            lease = json.loads((Path(folder) / LEASE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return lease if isinstance(lease, dict) else None

    def _content(self) -> dict[str, Any]:
        return {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id(),
                "started": self._started, "heartbeat": _now().isoformat(), "stale_min": self.stale_s / 60.0}

    def _create(self) -> bool:
        """Create the lease if the name is free (atomic: a hard link of a written temporary file)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{LEASE_FILE}.{self.owner}.tmp"
        tmp.write_text(json.dumps(self._content()))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> "Lease":
        """Take the lease (module doc), or raise ``LeaseHeld`` naming the live holder and what to do."""
        for _ in range(3):
            if self._create():
                self.start()
                return self
            held = self.read(self.folder)
            if held is None:  # removed (released, or taken over) between the two steps: try again
                continue
            age = lease_age_s(held)
            same_job = held.get("job_id") is not None and held.get("job_id") == job_id()
            if held.get("owner") == self.owner:
                self.start()
                return self
            gone = holder_gone(held)
            if not same_job and not gone and age is not None and age <= self.stale_s:
                raise LeaseHeld(
                    f"{self.folder} is being written by another attempt: {describe(held)}. This attempt stops now, "
                    "before writing anything, so the row is not done twice. Wait for it (python scripts/status.py "
                    f"{self.folder.parent}), or stop it first (scancel <its job id>); a holder that died without a word "
                    f"is taken over once its heartbeat is older than dist.stale_min ({self.stale_s / 60:g} min).")
            aside = self.folder / f".{LEASE_FILE}.stale.{self.owner}"
            try:
                os.replace(self.path, aside)  # one taker wins the rename; the other finds the name free or live
            except FileNotFoundError:
                continue
            self.took_over = held
            aside.unlink(missing_ok=True)
            why = ("the same cluster job, requeued" if same_job else
                   f"its process (pid {held.get('pid')}) on this host has ended" if gone else
                   f"its heartbeat is {age / 60 if age is not None else float('nan'):.0f} min old (> dist.stale_min)")
            log.warning(f"{self.folder}: taking over the lease of an earlier attempt ({describe(held)}): {why}")
        raise LeaseHeld(f"{self.folder}: could not take the lease after 3 tries (attempts racing for it); rerun")

    def start(self) -> None:
        """Rewrite the heartbeat every ``poll_s`` seconds (a daemon thread) until ``release``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="coolsd-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.poll_s):
            held = self.read(self.folder)
            if held is not None and held.get("owner") != self.owner:
                self.lost = held
                log.error(f"{self.folder}: another attempt took this attempt's lease ({describe(held)}); this one "
                          "stops at its next image")
                return
            try:
                tmp = self.folder / f".{LEASE_FILE}.{self.owner}.beat"
                tmp.write_text(json.dumps(self._content()))
                os.replace(tmp, self.path)
            except OSError as e:  # a full or briefly unreachable disk: the next beat tries again
                log.warning(f"could not rewrite the lease {self.path}: {e}")

    def check(self) -> None:
        """Raise ``LeaseHeld`` if another attempt took this lease (this one was judged dead while it lived)."""
        if self.lost is not None:
            raise LeaseHeld(f"{self.folder}: another attempt took this attempt's lease ({describe(self.lost)}); this "
                            "one stops so the two do not write the same records. Its finished images are kept.")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this attempt's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        held = self.read(self.folder)
        if held is not None and held.get("owner") == self.owner:
            self.path.unlink(missing_ok=True)
