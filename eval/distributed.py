"""Several processes of one run: where the ranks come from, the process group, and the end-of-run wait.

Where the rank comes from (``launch_environment``), first match wins:

* **torchrun** (``torch.distributed.run``) sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``PORT``:
  torch's own ``env://`` initialisation reads them (also ``srun torchrun ...`` inside a SLURM job).
* **a submitit task**: the SLURM tasks of a job submitted by the Hydra submitit launcher with
  ``tasks_per_node>1`` (``hydra/launcher=slurm``), the tasks of submitit's local executor, or the tasks of a
  plain ``srun python run.py``: ``submitit.helpers.TorchDistributedEnvironment`` (rank, world size, local
  rank, the job's first node as master, a port drawn from the job id unless ``MASTER_PORT`` is set).
* otherwise one process (nothing is initialised).

Shards stay fixed by prompt index (``eval.generator.Generator``: rank r of K takes ``index % K == r``), so an
image does not depend on the number of ranks.

The process group carries one collective only, at start-up, before any model loads, when every rank is at the
same point: the output folder and this attempt's id (``begin``). It runs under ``dist.startup_timeout_min``
(default 10 min): a task that died before joining stops the others within that time. Every later meeting point
goes through the markers below, not the process group, because ranks may differ by many minutes in loading a 7B
model from a network filesystem: the numerics self-check (``gather``) and the records check (``barrier``) wait
for every rank's marker to publish its value, up to ``dist.timeout_min`` (default 720 min) for a rank that is
alive but slow, and no longer than ``dist.stale_min`` for one whose heartbeat stopped (it died while loading: out
of memory, a lost node), or at once for one that failed. At the end a rank that finishes early
does not wait in a collective (an uneven shard, a resume where the shards were unevenly done, would time it
out): every rank writes ``ranks/rank<k>.json`` beside the records, a heartbeat every ``dist.poll_s``
seconds while it works, then ``done`` (with its record counts) or ``failed`` (with the error), atomically
(``coolsd.io``). Rank 0, once its own shard is done, polls those markers (``wait_for_ranks``) and reports a
rank whose heartbeat has not changed for ``dist.stale_min`` minutes (measured on the waiting rank's clock, so
clocks of other nodes do not matter) as dead, naming its host and process. The other ranks, their records
written, poll rank 0's marker in the same way (``wait_for_rank_zero``) until it has written ``run.json``, so
all ranks leave the process group together; rank 0 failing (or being requeued) ends their wait at once.
Markers of an earlier attempt (a requeued or resumed job) carry another attempt id and are ignored.

Example: ``torchrun --nproc_per_node=8 run.py model=janus_pro_7b decoder=coolsd eval=coco5k hydra.run.dir=runs/x``;
``python run.py -m hydra/launcher=slurm hydra.launcher.tasks_per_node=8 hydra.launcher.gpus_per_node=8 ...``.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from coolsd import validate
from coolsd.launch import join_error, launch_environment
from eval.records import atomic_write_json

log = logging.getLogger("coolsd")

#: ``dist.*`` keys (configs/config.yaml) and their defaults
DIST_DEFAULTS = {"startup_timeout_min": 10.0, "timeout_min": 720.0, "poll_s": 10.0, "stale_min": 30.0}


def dist_options(cfg: Any) -> dict[str, float]:
    """The ``dist`` block of a run config (None or missing: the defaults), checked."""
    given = validate.mapping("dist", {} if cfg is None else dict(cfg), tuple(DIST_DEFAULTS))
    out = {**DIST_DEFAULTS, **given}
    return {key: validate.number(f"dist.{key}", out[key], minimum=0, min_open=True) for key in DIST_DEFAULTS}


class RankMarkers:
    """``<out_dir>/ranks/rank<k>.json`` of one attempt: each rank's state (``running`` with a heartbeat count,
    ``done`` with its record counts, ``failed`` with the error), and the wait for other ranks' markers."""

    def __init__(self, out_dir: Path, rank: int, world: int, attempt: str, poll_s: float = 10.0,
                 stale_min: float = 30.0) -> None:
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


class Shards:
    """The processes of one run (``launch_environment``); a no-op for one process.

    ``startup_timeout_min``: the process group's timeout, which bounds joining it and ``begin`` (a rank that died
    before either stops the others); ``timeout_min``: the longest wait for a rank that is alive but slow at a later
    meeting point (``gather``, ``barrier``); ``poll_s``, ``stale_min``: the heartbeat interval and the silence after
    which a waiting rank reports another dead (``RankMarkers``).
    """

    def __init__(self, startup_timeout_min: float = DIST_DEFAULTS["startup_timeout_min"],
                 timeout_min: float = DIST_DEFAULTS["timeout_min"], poll_s: float = DIST_DEFAULTS["poll_s"],
                 stale_min: float = DIST_DEFAULTS["stale_min"]) -> None:
        opts = dist_options({"startup_timeout_min": startup_timeout_min, "timeout_min": timeout_min,
                             "poll_s": poll_s, "stale_min": stale_min})
        self.startup_timeout = dt.timedelta(minutes=opts["startup_timeout_min"])
        self.timeout_s = 60.0 * opts["timeout_min"]
        self.poll_s, self.stale_min = opts["poll_s"], opts["stale_min"]
        env = launch_environment()
        self.source = env.source
        self.world, self.rank, self.local_rank = env.world, env.rank, env.local_rank
        self.markers: RankMarkers | None = None
        self._meetings = 0
        if self.world > 1:
            import torch.distributed as dist

            if torch.cuda.is_available():  # one GPU per task, whether the task sees all of the node's or one
                torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
            if not dist.is_initialized():
                log.info(f"rank {self.rank} of {self.world} ({self.source}): joining the process group at "
                         f"{env.init_method}")
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                kwargs = {} if env.init_method == "env://" else {"rank": self.rank, "world_size": self.world}
                try:
                    dist.init_process_group(backend, init_method=env.init_method, timeout=self.startup_timeout,
                                            **kwargs)
                except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
                    raise join_error(env, env.init_method, opts["startup_timeout_min"], "dist.startup_timeout_min",
                                     "Nothing was loaded or generated", err) from err
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def begin(self, output_dir: str | os.PathLike) -> Path:
        """Rank 0's output folder on every rank (Hydra names it per process: the clock may differ), and this
        attempt's id; starts this rank's heartbeat marker. Every rank calls it once, at start-up."""
        folder, attempt = self.broadcast((str(output_dir), uuid.uuid4().hex))
        out_dir = Path(folder)
        # one process too: its marker is how scripts/status.py tells a failed or silent run from a running one
        self.markers = RankMarkers(out_dir, self.rank, self.world, attempt, self.poll_s, self.stale_min)
        self.markers.start()
        return out_dir

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a start-up collective)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order (``[value]`` for one process), through the markers: each
        rank publishes its value and waits for the others' (``RankMarkers.wait_for``: a failed rank stops the
        wait at once, a silent one after ``dist.stale_min``, a slow one after ``dist.timeout_min``)."""
        if self.world == 1:
            return [value]
        self._meetings += 1
        key = f"meeting{self._meetings}"
        self.markers.publish(key, value)
        got = self.markers.wait_for(list(range(self.world)), published=key, timeout_s=self.timeout_s)
        return [got[k]["published"][key] for k in range(self.world)]

    def barrier(self) -> None:
        """Every rank waits until every rank has come here (``gather``: markers, not the process group)."""
        self.gather(None)

    def finish(self, records: dict[str, int] | None = None) -> None:
        """This rank's records are written: its marker says ``done`` (no collective)."""
        if self.markers is not None:
            self.markers.finish(records)

    def fail(self, error: BaseException) -> None:
        """This rank stopped on ``error`` (or was requeued: ``SystemExit``): its marker says so, and the ranks
        waiting for it stop waiting."""
        if self.markers is not None:
            self.markers.fail(error)

    def wait_for_ranks(self) -> dict[int, dict[str, Any]]:
        """On rank 0: wait (polling the markers, no collective) until every other rank is done; {} for one
        process. Raises if one failed or went silent."""
        if self.markers is None or self.rank != 0:
            return {}
        return self.markers.wait_for([k for k in range(self.world) if k != 0])

    def wait_for_rank_zero(self) -> None:
        """On ranks > 0, their records written: wait (polling, no collective) until rank 0 has finished the run,
        so every rank leaves the process group together (NCCL's communicator teardown expects the ranks of a
        node to take part; a cluster's srun ``WaitTime`` would end rank 0 when the first task exits). Rank 0
        failing or being requeued ends the wait at once; its going silent raises after ``dist.stale_min``."""
        if self.markers is None or self.rank == 0:
            return
        status = self.markers.wait_for([0], raise_on_failure=False)[0]
        if status.get("state") == "failed":
            log.warning(f"rank {self.rank}: rank 0 stopped ({status.get('error')}); this rank's records are kept")

    def close(self) -> None:
        if self.markers is not None:
            self.markers.stop()
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
