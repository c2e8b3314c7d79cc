"""The machine and checkout a number was measured on: the ``git`` and ``environment`` blocks of ``run.json``, of
the benchmark's and the peer bench's records, and of the GPU smoke test's.

A timing means little without the hardware, the software versions and the commit it was made with; every
writer of a measured record takes these two blocks from here, so they carry the same keys everywhere.

Every run also writes ``environment.txt`` into its folder when it starts (``write_environment``): Python, torch,
CUDA and cuDNN, the NVIDIA driver, the GPUs, every installed package with its version, the git commit and a digest
of the uncommitted changes (``git diff HEAD`` and the untracked files' names), so a number can be traced to the
exact software (users ask for it: FoundationVision/LlamaGen#100, deepseek-ai/Janus#237).

Example: ``python run.py`` stores ``environment()`` under ``run.json["environment"]`` and ``git_commit()`` under
``run.json["git"]``; ``scripts/bench_peers.py`` adds ``environment(packages=("transformers",))`` to its meta.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import torch

from coolsd.numerics import cpu_name

ROOT = Path(__file__).resolve().parents[2]


def git_commit(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """The checkout's commit, whether it has uncommitted changes, and a digest of them (``dirty_diff_sha1``: SHA-1
    of ``git diff HEAD`` and of the untracked files' names; None when clean); None outside a git checkout."""
    cwd = cwd or ROOT
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                                  timeout=30).stdout

        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain").strip()
        digest = None
        if status:
            untracked = git("ls-files", "--others", "--exclude-standard")
            digest = hashlib.sha1((git("diff", "HEAD") + "\0" + untracked).encode()).hexdigest()
        return {"commit": commit, "dirty": status != "", "dirty_diff_sha1": digest}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "dirty_diff_sha1": None}


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


def hardware_name(device: Any = None) -> str:
    """What a timing was measured on: the GPU's name on a CUDA device (``NVIDIA H100 80GB HBM3``), else ``CPU
    <model>, <threads> threads``."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {cpu_name()}, {torch.get_num_threads()} threads"


def _driver() -> str:
    """The NVIDIA driver version (``nvidia-smi``), or why there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "none (no nvidia-smi)"
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else "none (nvidia-smi failed)"


def environment_text() -> str:
    """The ``environment.txt`` of a run (module doc): one ``key: value`` line per fact, then every installed
    distribution as ``name==version``, sorted."""
    import torch

    git = git_commit()
    lines = [f"python: {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
             f"platform: {platform.platform()}",
             f"cpu: {cpu_name()}, {os.cpu_count()} cores",
             f"torch: {torch.__version__}",
             f"cuda (torch built with): {torch.version.cuda or 'none'}",
             f"cudnn: {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}",
             f"nvidia driver: {_driver()}"]
    if torch.cuda.is_available():
        lines += [f"gpu {k}: {torch.cuda.get_device_name(k)}, "
                  f"{torch.cuda.get_device_properties(k).total_memory / 2**30:.1f} GiB"
                  for k in range(torch.cuda.device_count())]
    else:
        lines.append("gpu: none (torch.cuda.is_available() is False)")
    lines += [f"git commit: {git['commit']}", f"git dirty: {git['dirty']}",
              f"git dirty diff sha1: {git['dirty_diff_sha1']} (git diff HEAD and untracked names; none when clean)",
              *(f"env {k}: {os.environ[k]}" for k in ("CUDA_VISIBLE_DEVICES", "COOLSD_CACHE", "HF_HUB_OFFLINE")
                if k in os.environ),
              "", "packages (importlib.metadata):"]
    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    lines += [seen[k] for k in sorted(seen)]
    return "\n".join(lines) + "\n"


def write_environment(path: str | os.PathLike) -> Path:
    """Write ``environment_text()`` to ``path`` (atomically) and return it."""
    from coolsd.io import atomic_write_bytes

    atomic_write_bytes(Path(path), environment_text().encode())
    return Path(path)
