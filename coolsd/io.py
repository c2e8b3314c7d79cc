"""Crash-safe file writing: a temporary file in the same folder, fsync, then an atomic rename; and the
removal of temporaries that a crash left behind.

Every file the project writes (``run.json``, ``table.md``, images, grids, plots, drafter checkpoints, data
shards and their manifest, caches) goes through ``atomic_write_bytes``:

* **Mode**: the temporary file is created with mode ``0o666`` masked by the process umask, exactly as
  ``open(path, "w")`` would (0644 under the usual umask 022, 0600 under 077; a folder's default ACL applies
  too), so results on a shared cluster are as readable as the user's other files. (``tempfile.mkstemp``
  creates 0600 files, and a rename keeps the mode.) The per-image record files, appended line by line
  with ``open(path, "a")`` (``eval.records.image_records.JsonlLog``), follow the umask the same way.
* **Temporaries** are named ``.{name}.{8 hex digits}.tmp`` beside ``name``. While one is written its writer
  holds an exclusive ``flock`` on it; the kernel drops the lock when the writer exits, killed or not.
  ``remove_stale_temps(folder)`` deletes the temporaries of that pattern that no live writer holds (another
  torchrun rank writing into the same folder keeps its lock, so its file stays), and, on a filesystem
  without locks, only those older than ``STALE_AFTER_S``. ``atomic_write_bytes`` sweeps each folder once
  per process before its first write there, so the next run into a folder clears what a crash left.

Example: ``atomic_write_json("out/run.json", record)`` (``atomic_write_bytes`` of its JSON) never leaves a
half-written ``run.json``.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no locks, stale temporaries are recognised by age only
    fcntl = None  # type: ignore[assignment]

#: A temporary of ``atomic_write_bytes`` (and of its earlier ``mkstemp`` form): ``.{name}.{token}.tmp``.
TEMP_PATTERN = re.compile(r"^\.(?P<target>.+)\.(?P<token>[A-Za-z0-9_]+)\.tmp$")
#: Where locks are unavailable, a temporary this old (seconds since its last write) counts as abandoned.
STALE_AFTER_S = 3600.0

_writing: set[str] = set()  # temporaries this process is writing now (POSIX record locks, which NFS uses
#                             for flock, never conflict within one process)
_swept: set[str] = set()  # folders this process has swept already


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a locked temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = str(path.parent.resolve())
    if folder not in _swept:
        remove_stale_temps(path.parent)
        _swept.add(folder)
    fd, tmp = _create_temp(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.replace(tmp, path)  # renamed while still locked: a sweeper never sees an unlocked finished file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _writing.discard(str(tmp))
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented JSON (``default=str`` for paths and the like), through ``atomic_write_bytes``."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def remove_stale_temps(folder: str | os.PathLike, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete the abandoned temporaries of ``atomic_write_bytes`` in ``folder``; return what was removed.

    A temporary is abandoned when no live process holds its lock (its writer crashed). Where the
    filesystem cannot tell (no ``flock`` support), it must also be older than ``older_than_s`` seconds.
    Only regular files named ``.{name}.{token}.tmp`` are considered; anything else is left alone.
    """
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        if not TEMP_PATTERN.match(entry.name) or str(Path(entry.path)) in _writing:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if _remove_if_abandoned(Path(entry.path), older_than_s):
                removed.append(Path(entry.path))
        except OSError:  # finished (renamed) or removed meanwhile, or not ours to inspect: leave it
            continue
    return removed


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new temporary beside ``path``: created with mode 0o666 & ~umask and locked (where locks exist)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        _writing.add(str(tmp))
        if _try_lock(fd) is False or not _names(fd, tmp):
            # a sweeper in another process took it between our create and our lock (and unlinks it): retry
            _writing.discard(str(tmp))
            os.close(fd)
            continue
        return fd, tmp
    raise FileExistsError(f"could not create a temporary file beside {path}; check that folder's permissions")


def _remove_if_abandoned(path: Path, older_than_s: float) -> bool:
    """Remove ``path`` if no live writer holds it (see ``remove_stale_temps``); True if it was removed."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:  # another user's file: an exclusive POSIX lock (NFS) needs write access
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        locked = _try_lock(fd)
        if locked is False:  # a live writer holds it
            return False
        if locked is None and time.time() - os.fstat(fd).st_mtime < older_than_s:
            return False  # no locks here: only an old temporary counts as abandoned
        if not _names(fd, path):
            return False  # renamed into place (finished) since we opened it
        path.unlink()  # while holding the lock, so a writer that has not locked it yet will see it gone
        return True
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive non-blocking lock: True taken, False held by another, None locks unsupported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st, own = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
