"""Code identity: a digest of the source that turns a decoder's inputs into tokens, stored beside its records.

A record is reused only while the code that made its tokens is unchanged. The modules that count are those of the
core (``coolsd/``) and of ``baselines/`` that a decoder and its model reach: the module of every ``_target_`` in
the model and decoder configs (decoder, rule, drafter, schedule, generation order, ...), the shared loop
(``coolsd.decoding``), and every ``coolsd``/``baselines`` module these import, at any depth and inside functions
too (a static walk of the source with ``ast``, nothing is imported), with the ``__init__.py`` of every package on
the way. The static path's package (``coolsd.static``, imported by the loop only when ``decoder.path=static``)
counts for a decoder on that path only.

Each file's digest is the SHA-1 of ``ast.dump`` of its syntax tree **without docstrings** (module, class and
function docstrings are removed before the dump): comments, docstrings, blank lines and formatting do not count,
every other change does (a renamed variable too, even where it would not change a token: the digest is
conservative). ``ast.dump`` depends on the Python minor version (3.12 added fields), so the stored identity holds
the version and a mismatch under another Python says so.

``TOKEN_CODE_VERSION`` (``coolsd.fingerprint``) is kept as its backup, for what the digest cannot see: the
harness around the decoders (``eval/run/generator.py``: which seeds and batches an image gets), a third-party
library's change of its kernels, and records made before code digests existed (they carry none and are judged by
that version alone).

Example: ``decoder_code(cfg.model, cfg.decoder).files`` -> ``{"baselines/lantern.py": "3f2a...", ...}``.
"""
from __future__ import annotations

import ast
import hashlib
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the packages whose source counts
PACKAGES = ("coolsd", "baselines")
#: always part of a decoder's code: the shared decoding loop (it names most of the core)
ALWAYS = ("coolsd.decoding",)
#: the static path's package: part of a decoder's code only on that path (``decoder.path=static``)
STATIC = "coolsd.static"

_FILE_CACHE: dict[tuple[str, int, int], tuple[str, tuple[str, ...]]] = {}


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    """The tree without module, class and function docstrings (an emptied body gets ``pass``)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The source file of a dotted module of ``PACKAGES`` under ``root`` (a package: its ``__init__.py``), or None."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names a module's source imports, at any depth; ``from a import b`` gives ``a`` and ``a.b``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append(base)
            out += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return out


def file_identity(path: Path) -> tuple[str, tuple[str, ...]]:
    """(digest of the docstring-free syntax tree, the dotted names it imports) of one source file, cached by
    modification time and size."""
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _FILE_CACHE:
        tree = ast.parse(path.read_text(), filename=str(path))
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts) if path.is_relative_to(ROOT) else path.stem
        is_package = path.name == "__init__.py"
        if is_package:
            module = module.removesuffix(".__init__")
        imports = tuple(_imports(tree, module, is_package))
        digest = hashlib.sha1(ast.dump(_strip_docstrings(tree), annotate_fields=True,
                                       include_attributes=False).encode()).hexdigest()
        _FILE_CACHE[key] = (digest, imports)
    return _FILE_CACHE[key]


def targets(node: Any) -> list[str]:
    """Every ``_target_`` string of a nested plain config (dicts and lists)."""
    found = []
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "_target_" and isinstance(value, str):
                found.append(value)
            else:
                found += targets(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            found += targets(value)
    return found


def target_module(target: str, root: Path = ROOT) -> str | None:
    """The module of a ``_target_`` (``baselines.lantern.LanternRule`` -> ``baselines.lantern``), if it is one of
    ``PACKAGES``; None otherwise."""
    parts = target.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        if module_file(name, root) is not None:
            return name
    return None


def closure(modules: Iterable[str], static: bool = False, root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``PACKAGES`` that ``modules`` reach through their imports (at any depth), with the
    ``__init__.py`` of each package on the way; ``coolsd.static`` only when ``static``."""
    seen: dict[str, Path] = {}
    todo = list(modules) + (list([STATIC]) if static else [])
    while todo:
        name = todo.pop()
        if name in seen or (not static and (name == STATIC or name.startswith(STATIC + "."))):
            continue
        path = module_file(name, root)
        if path is None:
            continue
        seen[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:k]) for k in range(1, len(parts))]  # the packages it lives in
        todo += [m for m in file_identity(path)[1] if m.split(".")[0] in PACKAGES]
    return seen


@dataclass(frozen=True)
class CodeIdentity:
    """The code of one decoder: ``files`` (path relative to the checkout -> digest), ``digest`` (of them all, in
    path order) and the ``python`` version whose ``ast`` made them."""

    files: dict[str, str] = field(default_factory=dict)
    python: str = ""

    @property
    def digest(self) -> str:
        return hashlib.sha1("".join(f"{p}:{d}\n" for p, d in sorted(self.files.items())).encode()).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "python": self.python, "files": dict(sorted(self.files.items()))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CodeIdentity":
        return cls(dict(data.get("files") or {}), str(data.get("python") or ""))

    def changed(self, old: "CodeIdentity") -> list[str]:
        """The files that differ from ``old``: edited, added (``+``) or no longer used (``-``)."""
        out = [p for p in sorted(set(self.files) & set(old.files)) if self.files[p] != old.files[p]]
        out += [f"+{p}" for p in sorted(set(self.files) - set(old.files))]
        out += [f"-{p}" for p in sorted(set(old.files) - set(self.files))]
        return out


def python_version() -> str:
    return ".".join(platform.python_version_tuple()[:2])


def code_of(modules: Iterable[str], static: bool = False, root: Path = ROOT) -> CodeIdentity:
    """The identity of the code ``modules`` reach (``closure``)."""
    found = closure(modules, static, root)
    return CodeIdentity({str(path.relative_to(root)): file_identity(path)[0] for path in found.values()},
                        python_version())


def decoder_code(model_cfg: Mapping[str, Any], decoder_cfg: Mapping[str, Any], root: Path = ROOT) -> CodeIdentity:
    """The code of a decoder on a model (plain resolved configs): the modules of their ``_target_``s and the loop (``ALWAYS``), closed over
    their imports; the static path's when ``decoder_cfg.path`` is ``static``."""
    names = [m for t in targets(model_cfg) + targets(decoder_cfg) if (m := target_module(t, root))]
    path = decoder_cfg.get("path", "eager")
    return code_of([*ALWAYS, *names], static=path == "static", root=root)


def current_files(files: Iterable[str], root: Path = ROOT) -> CodeIdentity:
    """Today's digests of the files an earlier identity listed (a file gone: left out, so it reads as changed)."""
    out = {}
    for rel in files:
        path = root / rel
        if path.is_file():
            try:
                out[rel] = file_identity(path)[0]
            except SyntaxError:
                out[rel] = "unparsable"
    return CodeIdentity(out, python_version())


def mismatch_text(name: str, changed: list[str], old: CodeIdentity, new: CodeIdentity) -> str:
    """One line naming the files whose code changed since a decoder's records were made."""
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    python = (f" (they were digested under Python {old.python}, now {new.python}: ast.dump differs between "
              "minor versions)") if old.python and new.python and old.python != new.python else ""
    return f"decoder {name!r}: its code changed since its records were made: {shown}{python}"
