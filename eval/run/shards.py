"""Several processes of one run: where the ranks come from, the process group, and the end-of-run wait.

Where the rank comes from (``launch_environment``), first match wins:

* **torchrun** (``torch.distributed.run``) sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``PORT``:
  torch's own ``env://`` initialisation reads them (also ``srun torchrun ...`` inside a SLURM job).
* **a submitit task**: the SLURM tasks of a job submitted by the Hydra submitit launcher with
  ``tasks_per_node>1`` (``hydra/launcher=slurm``), the tasks of submitit's local executor, or the tasks of a
  plain ``srun python run.py``: ``submitit.helpers.TorchDistributedEnvironment`` (rank, world size, local
  rank, the job's first node as master, a port drawn from the job id unless ``MASTER_PORT`` is set).
* otherwise one process (nothing is initialised).

Shards stay fixed by prompt index (``eval.run.generator.Generator``: rank r of K takes ``index % K == r``), so an
image does not depend on the number of ranks.

The process group carries one collective only, at start-up, before any model loads, when every rank is at the
same point: the output folder and this attempt's id (``begin``). It runs under ``dist.startup_timeout_min``
(default 10 min): a task that died before joining stops the others within that time. Every later meeting point
goes through the rank markers on disk (``eval.records.rank_markers``), not the process group, because ranks may
differ by many minutes in loading a 7B model from a network filesystem: the numerics self-check (``gather``) and
the records check (``barrier``) wait for every rank's marker to publish its value, up to ``dist.timeout_min``
(default 720 min) for a rank that is alive but slow, and no longer than ``dist.stale_min`` for one whose heartbeat
stopped (it died while loading: out of memory, a lost node), or at once for one that failed. At the end a rank
that finishes early does not wait in a collective (an uneven shard, a resume where the shards were unevenly done,
would time it out): every rank's marker says ``done`` (with its record counts) or ``failed`` (with the error).
Rank 0, once its own shard is done, polls those markers (``wait_for_ranks``); the other ranks, their records
written, poll rank 0's marker in the same way (``wait_for_rank_zero``) until it has written ``run.json``, so all
ranks leave the process group together; rank 0 failing (or being requeued) ends their wait at once.

Example: ``torchrun --nproc_per_node=8 run.py model=janus_pro_7b decoder=coolsd eval=coco5k hydra.run.dir=runs/x``;
``python run.py -m hydra/launcher=slurm hydra.launcher.tasks_per_node=8 hydra.launcher.gpus_per_node=8 ...``.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from coolsd import validate
from coolsd.launch import join_error, launch_environment
from eval.records.lease import Lease, LeaseHeld
from eval.records.rank_markers import MARKER_DEFAULTS, RankMarkers

log = logging.getLogger("coolsd")

#: ``dist.*`` keys (configs/config.yaml) and their defaults
DIST_DEFAULTS = {"startup_timeout_min": 10.0, "timeout_min": 720.0, **MARKER_DEFAULTS}


def dist_options(cfg: Any) -> dict[str, float]:
    """The ``dist`` block of a run config (None or missing: the defaults), checked."""
    given = validate.mapping("dist", {} if cfg is None else dict(cfg), tuple(DIST_DEFAULTS))
    out = {**DIST_DEFAULTS, **given}
    return {key: validate.number(f"dist.{key}", out[key], minimum=0, min_open=True) for key in DIST_DEFAULTS}


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
        self.lease: Lease | None = None
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
        attempt's id; rank 0 takes the folder's lease first (``eval.records.lease``: a second live attempt on the
        row stops here, on every rank, before anything is written); starts this rank's heartbeat marker. Every
        rank calls it once, at start-up."""
        attempt, refused = uuid.uuid4().hex, None
        if self.rank == 0:
            self.lease = Lease(Path(output_dir), stale_min=self.stale_min, poll_s=self.poll_s, owner=attempt)
            try:
                self.lease.acquire()
            except LeaseHeld as err:
                self.lease, refused = None, str(err)
        folder, attempt, refused = self.broadcast((str(output_dir), attempt, refused))
        if refused:
            raise LeaseHeld(refused)
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

    def check_lease(self) -> None:
        """Raise if another attempt took this row's lease (rank 0 holds it; a no-op on the other ranks)."""
        if self.lease is not None:
            self.lease.check()

    def close(self) -> None:
        if self.markers is not None:
            self.markers.stop()
        if self.lease is not None:
            self.lease.release()
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
