"""The machine and checkout a number was measured on: the ``git`` and ``environment`` blocks of ``run.json``, of
the benchmark's and the peer bench's records, and of the GPU smoke test's.

A timing means little without the hardware, the software versions and the commit it was made with; every
writer of a measured record takes these two blocks from here, so they carry the same keys everywhere.

Example: ``python run.py`` stores ``environment()`` under ``run.json["environment"]`` and ``git_commit()`` under
``run.json["git"]``; ``scripts/bench_peers.py`` adds ``environment(packages=("transformers",))`` to its meta.
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import torch

from coolsd.numerics import cpu_name

ROOT = Path(__file__).resolve().parents[2]


def git_commit(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (None outside a git checkout)."""
    cwd = cwd or ROOT
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True,
                               check=True, timeout=10).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(packages: Sequence[str] = ()) -> dict[str, Any]:
    """Hardware and software facts that a timing is only meaningful with; ``packages``: also their installed
    versions (``none`` where one is not installed)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": f"{cpu_name()}, {os.cpu_count()} cores",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda_version"] = torch.version.cuda
    for name in packages:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "none"
    return env
