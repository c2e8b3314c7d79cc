"""Where this process stands in a job of several processes: torchrun's variables, a SLURM task (read through
submitit), or one process. One answer for every entry point: ``run.py`` (``eval.run.shards.Shards``) and the
drafter training (``coolsd.training.drafter``) both ask ``launch_environment``.

First match wins:

* **torchrun** (``torch.distributed.run``) sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``PORT``
  (also ``srun torchrun ...`` inside a SLURM job);
* **a submitit task**: the SLURM tasks of a job submitted by the Hydra submitit launcher with
  ``tasks_per_node>1``, the tasks of submitit's local executor, or the tasks of a plain
  ``srun python run.py``: ``submitit.helpers.TorchDistributedEnvironment`` (rank, world size, local rank, the
  job's first node as master, a port drawn from the job id unless ``MASTER_PORT`` is set);
* otherwise one process.

A batch script that starts ``python run.py`` without ``srun`` in a job of several tasks is one process that SLURM
describes as task 0 of many: the other tasks would never come, so it stops at once (``BatchStepError``) and says
how to start them.

``submitit`` (the ``launchers`` extra: ``pip install -e ".[launchers]"``, or ``requirements.txt``) is imported only
where a SLURM task or a submitit job is read (``submitit_helpers``); without it such a process stops with the install
line, and one process or torchrun never needs it.

Example: ``launch_environment()`` -> ``LaunchEnvironment(source='torchrun', rank=3, world=8, local_rank=3,
init_method='env://')`` inside ``torchrun --nproc_per_node=8``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: the environment variables by which torchrun (torch.distributed.run) tells a worker its place
TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


class BatchStepError(RuntimeError):
    """A SLURM job of several tasks ran this process in its batch step, without ``srun``."""


#: how to install what the cluster path imports (docs/cluster.md)
LAUNCHERS_INSTALL = 'pip install -e ".[launchers]"'


def submitit_helpers():
    """``submitit.helpers``, or an ``ImportError`` naming the extra that installs it."""
    try:
        from submitit import helpers
    except ImportError as err:
        raise ImportError(f"this process is a SLURM task or a submitit job, whose place is read through submitit, "
                          f"which is not installed ({err}). Install the cluster extra: {LAUNCHERS_INSTALL} "
                          "(docs/cluster.md, step 1), or pip install -r requirements.txt") from None
    return helpers


@dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in the run: ``source`` is ``torchrun``, ``submitit`` or ``single``; ``init_method``
    the process group's rendezvous (None for one process)."""

    source: str
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    init_method: str | None = None


def launch_environment() -> LaunchEnvironment:
    """Ranks from torchrun's variables, else from submitit's job environment (SLURM or its local executor),
    else one process. See the module docstring."""
    if all(k in os.environ for k in TORCHRUN_VARS):
        world = int(os.environ["WORLD_SIZE"])
        return LaunchEnvironment("torchrun", int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                                 "env://" if world > 1 else None)
    if "SUBMITIT_EXECUTOR" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        check_not_batch_step()
        # a SLURM task that submitit did not start (srun python run.py): submitit's SLURM environment reads it
        os.environ["SUBMITIT_EXECUTOR"] = "slurm"
    if "SUBMITIT_EXECUTOR" in os.environ:
        env = submitit_helpers().TorchDistributedEnvironment()
        if env.world_size == 1:
            return LaunchEnvironment("submitit")
        addr = os.environ.get("MASTER_ADDR", env.master_addr)
        return LaunchEnvironment("submitit", env.rank, env.world_size, env.local_rank,
                                 f"tcp://{addr}:{env.master_port}")
    return LaunchEnvironment("single")


def in_slurm_step() -> bool:
    """Whether this process is a task of a SLURM job step (``srun``): steps number themselves in
    ``SLURM_STEP_ID`` (``SLURM_STEPID`` before Slurm 20); the batch script and the ``extern`` step do not."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID", ""))
    return step.isdigit()


def check_not_batch_step() -> None:
    """Stop at once when a job of several SLURM tasks runs this process outside ``srun``: SLURM's variables say
    task 0 of ``SLURM_NTASKS``, but the other tasks were never started, so the first collective would wait for
    them until its timeout."""
    tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0].endswith(".py") else "run.py"
    if tasks > 1 and not in_slurm_step():
        raise BatchStepError(
            f"this SLURM job has {tasks} tasks (SLURM_NTASKS={tasks}) but this process runs in its batch script, "
            "not in a job step, so only one of them exists and the others would be waited for until the timeout. "
            f"Start one process per task with srun: `srun --kill-on-bad-exit=1 python {script} ...` (or `srun "
            f"--kill-on-bad-exit=1 torchrun --nproc_per_node=<gpus> {script} ...` with one task per node), or ask "
            "for one task (#SBATCH --ntasks=1) to run a single process. Nothing was started")


#: what torchrun tells a worker, which libraries that know only torchrun read (Hugging Face ``accelerate``, torch's
#: ``env://`` rendezvous)
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def export_for_torch(env: LaunchEnvironment) -> dict[str, str]:
    """Write torchrun's variables (``TORCH_VARS``) for a process that submitit placed (a SLURM task, a task of the
    Hydra submitit launcher or of submitit's local executor), from ``env``: its rank, world and local rank, the host
    and port of its ``init_method`` (``tcp://host:port``), and submitit's tasks per node as ``LOCAL_WORLD_SIZE``.
    Returns what it wrote; nothing for torchrun (which set them) or one process. Afterwards
    ``launch_environment()`` reads the same place through torchrun's variables.

    Example: ``export_for_torch(launch_environment())`` in task 5 of ``srun --ntasks=8 --ntasks-per-node=4`` ->
    ``{'RANK': '5', 'WORLD_SIZE': '8', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '4', 'MASTER_ADDR': 'gpu07', ...}``.
    """
    if env.source != "submitit" or env.world == 1:
        return {}
    from urllib.parse import urlsplit

    TorchDistributedEnvironment = submitit_helpers().TorchDistributedEnvironment

    address = urlsplit(env.init_method or "")
    if address.scheme != "tcp" or not address.hostname or address.port is None:
        raise ValueError(f"expected a tcp://host:port rendezvous for rank {env.rank} of {env.world}, got "
                         f"{env.init_method!r}")
    values = {"RANK": env.rank, "WORLD_SIZE": env.world, "LOCAL_RANK": env.local_rank,
              "LOCAL_WORLD_SIZE": TorchDistributedEnvironment().local_world_size, "MASTER_ADDR": address.hostname,
              "MASTER_PORT": address.port}
    written = {key: str(values[key]) for key in TORCH_VARS}
    os.environ.update(written)
    return written


def join_error(env: LaunchEnvironment, address: str, minutes: float, key: str, done: str,
               err: BaseException) -> RuntimeError:
    """The error of a rank that could not join its process group within ``minutes`` (the config ``key``), with
    what to look for; ``done`` says what was done before (e.g. "Nothing was loaded")."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return RuntimeError(
        f"rank {env.rank} of {env.world} ({env.source}) could not join the process group at {address} within "
        f"{minutes:g} min ({key}): another task died or was never started (read the other tasks' logs: an error "
        f"at start-up, or a batch script without srun), or the address is unreachable. {done} "
        f"({type(err).__name__}: {first})")
