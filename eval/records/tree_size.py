"""What travels with the checkout: the tracked files and the untracked ones git does not ignore (a copy of the
working tree to an offline GPU node takes these, within 64 MiB), their total size and the largest of them.

``scripts/tree_size.py`` prints both and fails above ``LIMIT`` (56 MiB, headroom below the 64 MiB a copy may
take); ``.ci/run`` runs it before the tests.
"""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

#: the most that may travel: 56 MiB
LIMIT = 56 * 2**20


def travelling_files(root: str | os.PathLike) -> dict[str, int]:
    """path (relative to ``root``) -> size in bytes of every file that travels: ``git ls-files`` and ``git ls-files
    --others --exclude-standard``; a tracked file deleted from the working tree counts nothing, a link its own
    size."""
    def listed(*args: str) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=root, capture_output=True, check=True).stdout
        return [p for p in out.decode(errors="surrogateescape").split("\0") if p]

    sizes = {}
    for path in dict.fromkeys(listed() + listed("--others", "--exclude-standard")):
        try:
            info = os.lstat(Path(root) / path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
            sizes[path] = info.st_size
    return sizes


def check(root: str | os.PathLike, limit: int = LIMIT, top: int = 10) -> tuple[bool, list[str]]:
    """(whether what travels from ``root`` is at most ``limit`` bytes, lines that say its total and its ``top``
    largest files)."""
    sizes = travelling_files(root)
    total = sum(sizes.values())
    ok = total <= limit
    lines = [f"{'ok' if ok else 'TOO LARGE'}: {total:,} bytes ({total / 2**20:.1f} MiB) in {len(sizes):,} files "
             f"travel with the checkout; the limit is {limit:,} bytes ({limit / 2**20:.1f} MiB)",
             f"the {min(top, len(sizes))} largest:"]
    for path, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        lines.append(f"  {size:>12,}  {path}")
    return ok, lines
