"""How a static step runs: eagerly, compiled whole (``torch.compile(fullgraph=True, dynamic=False)``, on a CPU
with ``model.compile=true``) or from a CUDA graph (on a GPU).

A step reads and writes only the tensors of its workspace (``coolsd.static.loop.Workspace``), which live as long
as the workspace and are updated in place, so one compiled function or one captured graph serves every iteration
of every batch of that size. The first call always runs eagerly: it is a real iteration of the decode that fills
the lazily built constants a step reads (draw indices, column ranges), so that what is compiled or captured
never changes afterwards. Capture follows ``torch.cuda.graphs``: that first call runs on a side stream (the
warm-up CUDA graphs need), the second captures the step (capturing runs nothing) and replays it, every later
call replays. Compiling traces at the second call.

Every step compiles with inductor, the tree steps too: their earlier form (a level-by-level descent of the
parallel walk) made inductor's CPU code fail its own index bounds check with torch 2.14.1 and ran under
``aot_eager``, which was slower than no compilation; the walk as it is now compiles, and the compiled tree step
gives the eager path's tokens (``tests/test_static_path.py``).

Example: ``Runner(lambda: step(ws), "graph")()`` once per iteration.
"""
from __future__ import annotations

import itertools
import types
from typing import Callable

import torch

MODES = ("eager", "compiled", "graph")


def mode_for(device: torch.device, compile: bool) -> str:
    """The step mode of a model on ``device``: a CUDA graph on a GPU, compiled on a CPU with ``model.compile``,
    else eager."""
    if device.type == "cuda":
        return "graph"
    return "compiled" if compile else "eager"


class Runner:
    """One step function, run in ``mode`` (``MODES``); ``calls`` counts its calls, ``captures`` its captures."""

    def __init__(self, fn: Callable[[], None], mode: str, backend: str = "inductor") -> None:
        if mode not in MODES:
            raise ValueError(f"static step mode must be one of {MODES}, got {mode!r}")
        self.fn = fn
        self.mode = mode
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._compiled = torch.compile(_own_code(fn), fullgraph=True, dynamic=False, backend=backend) \
            if mode == "compiled" else None

    def __call__(self) -> None:
        self.calls += 1
        if self.mode == "eager" or (self.mode == "compiled" and self.calls == 1):
            self.fn()  # a compiled step's first call fills the caches it reads (draw indices, ...) before tracing
        elif self.mode == "compiled":
            self._compiled()
        elif self.graph is not None:
            self.graph.replay()
        elif self.calls == 1:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream().wait_stream(side)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.fn()
            self.graph = graph
            graph.replay()


_IDS = itertools.count()


def _own_code(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with a code object of its own: dynamo keeps compiled graphs per code object, so the steps of several
    decoders and batch sizes (one closure's code) would otherwise share one cache and its recompilation limit."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
