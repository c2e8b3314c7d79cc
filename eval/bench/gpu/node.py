"""What the offline GPU nodes' Python holds, and how to rehearse on a CPU as if this machine were one of them.

The nodes this harness is measured on have no network and a Python of the site's own (``node_packages.txt``
beside this file, dated: torch 2.11 with CUDA 13, transformers, numpy, pandas, ... but not hydra-core, omegaconf,
ftfy, open_clip_torch, torch-fidelity or wandb). The GPU command's default plan imports only what they hold;
this module proves it on a CPU:

* ``missing_modules()``: the top-level import names of every distribution installed here that the node lacks
  (from ``importlib.metadata``; the project's own packages and the standard library always pass);
* ``block_imports(names)``: importing any of them fails with ``ModuleNotFoundError`` and probing for it finds
  nothing, as on the node. ``scripts/gpu.py --dry-run`` installs it before the
  project's modules load (``--no-block`` turns it off);
* ``fetch_wheels(folder)``: the few wheels a step that composes configs with Hydra needs there (``WHEELS``), for
  CPython 3.12 on manylinux x86_64: binary wheels downloaded, source-only archives built here with
  ``pip wheel``; at most ``WHEEL_BUDGET`` bytes in all, into a folder that git ignores (``.gpu-wheels/``) and
  the GPU call carries. The node installs them with ``pip install --no-index --no-deps --target``
  (``INSTALL_LINE``).

Example: ``python scripts/gpu.py --dry-run`` (the CPU rehearsal), ``python scripts/gpu.py --fetch-wheels``.
"""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tempfile
from pathlib import Path

NODE_PACKAGES = Path(__file__).with_name("node_packages.txt")
#: the project's own top-level packages and entry points (always importable: they travel with the tree)
PROJECT_MODULES = frozenset({"coolsd", "baselines", "eval", "scripts", "tests", "run"})
#: what a step that composes configs (``bench_*``, ``smoke``) needs on the node and the node lacks:
#: (requirement, whether PyPI has only a source archive, which is then built here with ``pip wheel``)
WHEELS = (("hydra-core==1.3.8", False), ("omegaconf==2.3.1", False), ("antlr4-python3-runtime==4.9.3", True),
          ("ftfy==6.3.1", False), ("wcwidth==0.9.5", False))
WHEEL_BUDGET = 10 * 2**20
WHEEL_FOLDER = ".gpu-wheels"
#: the node's line that makes the wheels importable (the folder carried with the working tree)
INSTALL_LINE = (f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {WHEEL_FOLDER}/*.whl"
                " && export PYTHONPATH=/tmp/site")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def wheel_names() -> tuple[str, ...]:
    """The distributions of ``WHEELS``."""
    return tuple(req.split("==")[0] for req, _ in WHEELS)


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Hydra_Core`` -> ``hydra-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: distributions of the node that install the same modules as another one here (the node's name: ours)
SAME_MODULES = {"opencv-python-headless": "opencv-python"}


def node_distributions(path: Path = NODE_PACKAGES) -> frozenset[str]:
    """The normalised distribution names the node's Python holds (comment lines skipped), with the names here of
    those that install the same modules under another name (``SAME_MODULES``)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    names = {normalise(line) for line in lines if line}
    return frozenset(names | {SAME_MODULES[n] for n in names if n in SAME_MODULES})


def with_requirements(names: frozenset[str]) -> frozenset[str]:
    """``names`` and every distribution they require as installed here, transitively (extras left out): a
    package on the node brings what its own version needs, which may be named otherwise here (a newer release's
    new dependency), so those are not blocked."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(normalise(req.name))
    return frozenset(seen)


def missing_modules(node: frozenset[str] | None = None, present: tuple[str, ...] = ()) -> frozenset[str]:
    """Top-level modules installed here whose every distribution is missing on the node and required by none
    of the node's (``with_requirements``; ``present``: extra distributions to count as installed there, e.g. the
    carried wheels)."""
    have = with_requirements((node_distributions() if node is None else node) | {normalise(p) for p in present})
    out = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in PROJECT_MODULES or module in sys.stdlib_module_names or module.startswith("__editable__"):
            continue
        if not any(normalise(d) in have for d in dists):
            out.add(module)
    return frozenset(out)


#: what ``block_imports`` blocked in this process (a step that starts a subprocess blocks the same there)
BLOCKED: frozenset[str] = frozenset()


def block_imports(names: frozenset[str]) -> list[str]:
    """Make ``names`` (top-level modules) unimportable, as on a Python without them: each is set to ``None`` in
    ``sys.modules``, so ``import name`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec(name)``
    returns None (how packages probe for optional ones: they then take their path without it). Returns those
    already imported, which are dropped first (a caller that must start clean refuses them)."""
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in names and sys.modules[m] is not None)
    for module in loaded:
        del sys.modules[module]
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]  (the import system's "known missing")
    global BLOCKED
    BLOCKED = BLOCKED | names
    return loaded


def as_node(script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` with ``args`` in a fresh Python with this process's blocked
    imports blocked too (``python -m eval.bench.gpu.node``), or plainly when nothing is blocked."""
    if not BLOCKED:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "eval.bench.gpu.node", "--block", ",".join(sorted(BLOCKED)), script, *args]


def main(argv: list[str]) -> None:
    """``python -m eval.bench.gpu.node --block a,b SCRIPT ARGS...``: run SCRIPT as ``__main__`` with ``a`` and
    ``b`` unimportable."""
    import runpy

    if len(argv) < 3 or argv[0] != "--block":
        raise SystemExit("usage: python -m eval.bench.gpu.node --block MODULE[,MODULE...] SCRIPT [ARGS...]")
    block_imports(frozenset(filter(None, argv[1].split(","))))
    sys.argv = argv[2:]
    runpy.run_path(argv[2], run_name="__main__")


def fetch_wheels(folder: str | Path = WHEEL_FOLDER) -> list[Path]:
    """Download (or build, for source-only archives) ``WHEELS`` for CPython 3.12 manylinux x86_64 into
    ``folder``; refuse when they take more than ``WHEEL_BUDGET`` bytes. Needs the package registry."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    binary = [req for req, source_only in WHEELS if not source_only]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *binary],
                   check=True)
    for req, source_only in WHEELS:
        if source_only:  # pure-Python source archives build to a py3-none-any wheel that runs on 3.12
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp, req],
                               check=True)
                for wheel in Path(tmp).glob("*.whl"):
                    if not wheel.name.endswith("-py3-none-any.whl"):
                        raise RuntimeError(f"{req} built {wheel.name}, not a pure-Python wheel: it may not run on "
                                           "the node's CPython 3.12")
                    wheel.replace(folder / wheel.name)
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > WHEEL_BUDGET:
        raise RuntimeError(f"the wheels in {folder} take {size / 2**20:.1f} MiB, over the "
                           f"{WHEEL_BUDGET / 2**20:.0f} MiB budget of what travels with the tree")
    return wheels


if __name__ == "__main__":
    main(sys.argv[1:])
