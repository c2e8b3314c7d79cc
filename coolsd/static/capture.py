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

A replayed graph is correct only if every tensor the step reads or writes that outlives the call keeps its
storage: the graph holds device addresses, not Python names, so a step that rebinds an attribute to a new tensor
(``self.lengths = self.starts + counts``) or reads a tensor made anew between calls would replay against the old
memory and silently compute with stale values. ``StorageLedger`` records, per call, the storages a step touches
that it did not allocate itself; ``stable_storage`` checks that they are the same from call to call
(``tests/test_static_capture.py`` runs it over AR, chain, tree and Jacobi steps across iterations and batches of
one size, and shows it failing on a planted allocation).

Example: ``Runner(lambda: step(ws), "graph")()`` once per iteration.
"""
from __future__ import annotations

import contextlib
import itertools
import types
from typing import Callable

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StorageLedger(TorchDispatchMode):
    """A dispatch mode that records which storages the ops inside it read and write, apart from those the ops
    allocated themselves (``calls``: one ``(read, written)`` pair of address sets per ``call()`` block).

    An op's output whose storage is none of its inputs' was allocated inside the call (an intermediate, which a
    graph keeps in its own pool); every other tensor an op touches existed before the call: parameters, the
    workspace, the cache, a drafter's buffers, constants. In-place and ``out=`` ops write their inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[frozenset[int], frozenset[int]]] = []
        self._made: set[int] = set()
        self._read: set[int] = set()
        self._written: set[int] = set()

    @contextlib.contextmanager
    def call(self):
        """Record one step call."""
        self._made, self._read, self._written = set(), set(), set()
        with self:
            yield
        self.calls.append((frozenset(self._read), frozenset(self._written)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (the dispatch protocol)
        kwargs = kwargs or {}
        inputs = {_storage(t) for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self._read |= inputs - self._made
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                address = _storage(t)
                if address not in inputs:
                    self._made.add(address)
                elif address not in self._made:
                    self._written.add(address)
        return out


def stable_storage(calls: list[tuple[frozenset[int], frozenset[int]]]) -> str | None:
    """None when every call read and wrote the same outside storages as the first; else what changed (the
    condition under which one captured graph or compiled function serves every call)."""
    if not calls:
        return "no step call was recorded"
    read, written = calls[0]
    for i, (r, w) in enumerate(calls[1:], start=1):
        if r != read or w != written:
            return (f"call {i} touched other storages than call 0: {len(r - read)} read and {len(w - written)} "
                    f"written that call 0 did not, {len(read - r)} read and {len(written - w)} written by call 0 "
                    "only (a tensor made anew between calls, or an attribute rebound)")
    return None
