"""The peer's side of ``scripts/bench_peers.py``: a process that runs one peer's own decoding code.

Started by ``eval.bench.peers.comparison.PeerWorker`` with the peer's interpreter (``--python NAME=...`` where
the peer pins other package versions than ours; ours otherwise). It reads pickled requests on stdin and answers
on its own copy of the original stdout; everything the peer's code prints goes to stderr, so it cannot corrupt
the channel.

Requests::

    ("build", glue_module, checkout, payload, pair, threads) -> ("ok", {"python": ..., "versions": {...}})
    ("run", inputs, seed)                                     -> ("ok", PeerImage)
    ("anatomy", inputs, seed)                                 -> ("ok", anatomy_record(...)) of one untimed decode
    ("hits",)                                                 -> ("ok", {patch: calls since the last reset})
    ("reset",)                                                -> ("ok", None)
    ("quit",)                                                 -> the process exits

Any exception answers ``("error", traceback text)``. The worker needs only torch and this package's
``eval.bench.peers`` modules (the project root is put on ``sys.path`` by the comparison's environment).

Run by hand (for a glue module's author)::

    python -m eval.bench.peers.worker < requests.pkl
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, BinaryIO, Callable

from eval.bench.peers.patches import DevicePatches


def check_requirements(pins: tuple[str, ...]) -> None:
    """Refuse to run a peer whose pinned packages are not what this interpreter has (``name==version``)."""
    wrong = []
    for pin in pins:
        name, _, version = pin.partition("==")
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            wrong.append(f"{name} {have or 'missing'} (needs {version})")
    if wrong:
        raise RuntimeError(
            f"this interpreter ({sys.executable}) has {', '.join(wrong)}; make the peer venv over the project's "
            f"packages and pass it with --python NAME=.peers/venv/bin/python: python -m venv --system-site-packages "
            f".peers/venv && .peers/venv/bin/pip install -r eval/bench/peers/requirements.txt")


def phase_pass(timer: Any, decode: Callable[[], Any], hooks: Callable[[Any], list[Callable[[], None]]],
               count: bool = False) -> Any:
    """Run ``decode()`` with ``hooks(timer)`` installed (they return their undo functions): a timing pass, or with
    ``count`` a pass under the torch-function counter (whose per-call cost would distort the timing pass)."""
    undo = hooks(timer)
    try:
        if not count:
            return decode()
        with timer:
            return decode()
    finally:
        for fn in reversed(undo):
            fn()


def anatomy_record(timed: Any, counted: Any, image: Any, hooked: bool = True) -> dict[str, Any]:
    """Where one decode's time and torch calls went: seconds per phase from the timing pass (target forwards,
    drafter forwards, the loop = the rest) and torch API calls per phase from the counting pass, with the image's
    tokens and forwards."""
    target_s = timed.seconds.get("target", 0.0)
    drafter_s = timed.seconds.get("drafter", 0.0)
    return {"seconds": image.seconds, "tokens": image.tokens, "target_forwards": image.target_forwards,
            "target_s": target_s if hooked else None, "drafter_s": drafter_s,
            "loop_s": image.seconds - target_s - drafter_s if hooked else None,
            "calls": dict(counted.calls), "syncs": dict(counted.syncs)}


class Worker:
    def __init__(self) -> None:
        self.call = None
        self.patches = DevicePatches([])

    def build(self, glue_name: str, checkout: str, payload: dict, pair: Any, threads: int | None) -> dict:
        import torch

        if threads:
            torch.set_num_threads(threads)
        glue = importlib.import_module(glue_name)
        check_requirements(glue.SPEC.requirements)
        self.patches = DevicePatches(glue.SPEC.patches)
        with self.patches:
            self.call = glue.build(Path(checkout), payload, pair)
        versions = {}
        for name in ("torch", "transformers"):
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return {"python": sys.executable, "versions": versions, "threads": torch.get_num_threads()}

    def run(self, inputs: Any, seed: int) -> Any:
        if self.call is None:
            raise RuntimeError("run before build")
        with self.patches:
            return self.call(inputs, seed)

    def anatomy(self, inputs: Any, seed: int) -> dict[str, Any]:
        """The glue's ``call.target`` (and ``call.drafter``) modules' forwards are their phases, everything else
        the loop: one decode timed by phase, one more counted by phase (``anatomy_record``)."""
        from eval.bench.call_counts import PhaseCounter

        timed, counted = PhaseCounter(), PhaseCounter()
        hooked = any(getattr(self.call, phase, None) is not None for phase in ("target", "drafter"))
        with self.patches:
            image = phase_pass(timed, lambda: self.run(inputs, seed), self._hooks)
            phase_pass(counted, lambda: self.run(inputs, seed), self._hooks, count=True)
        return anatomy_record(timed, counted, image, hooked=hooked)

    def _hooks(self, timer: Any) -> list[Callable[[], None]]:
        undo = []
        for phase in ("target", "drafter"):
            module = getattr(self.call, phase, None)
            if module is not None:
                undo += [h.remove for h in timer.hook_module(module, phase)]
        return undo

    def handle(self, request: tuple) -> Any:
        kind, *args = request
        if kind == "build":
            return self.build(*args)
        if kind == "run":
            return self.run(*args)
        if kind == "anatomy":
            return self.anatomy(*args)
        if kind == "hits":
            return dict(self.patches.hits)
        if kind == "reset":
            self.patches.reset()
            return None
        raise ValueError(f"unknown request {kind!r}")


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    worker = Worker()
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request[0] == "quit":
            return
        try:
            answer = ("ok", worker.handle(request))
        except Exception:   # noqa: BLE001 - every failure goes back to the comparison, which raises it
            answer = ("error", traceback.format_exc())
        pickle.dump(answer, answers)
        answers.flush()


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())   # the peer's prints go to stderr
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
