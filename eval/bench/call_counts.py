"""Torch API calls and host synchronisations: where a decode's per-op overhead comes from
(``eval.bench.efficiency`` section 5 and ``tests/test_call_counts.py``; ``eval.bench.peers`` counts a peer's
decode with the same ``PhaseCounter``).

``CallCounter`` attributes each torch call (function, tensor method or attribute) to the innermost function of
this repository that made it; ``PhaseCounter`` counts calls and host synchronisations into the phase that is
current (a host synchronisation is any host read of ``coolsd.sync_guard.host_read``, blocking copies included);
``decode_counts`` decodes under it with the phases set by hooks on the model and drafter. Only torch and
``coolsd.sync_guard`` are imported at module level (a peer's worker process imports this module too).

Example::

    counts = decode_counts(decoder, "a red bus", seed=0)
    counts.summary()   # calls per token in the target, drafter and loop; host syncs per iteration
"""
from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from coolsd.sync_guard import host_read

if TYPE_CHECKING:
    from coolsd.decoding import Decoder

#: the repository root: torch calls are attributed to the innermost function of a file below it
ROOT = str(Path(__file__).resolve().parents[2])


class CallCounter(TorchFunctionMode):
    """Counts torch API calls (functions, tensor methods and attributes) by the innermost function of this
    repository that made them: where a forward's per-op overhead (on GPU: its kernel launches) comes from."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(ROOT):
            frame = frame.f_back
        self.counts[getattr(frame.f_code, "co_qualname", frame.f_code.co_name) if frame else "other"] += 1
        return func(*args, **(kwargs or {}))


def call_anatomy(fn: Callable[[], Any], top: int = 8) -> dict[str, Any]:
    """Torch API calls of one ``fn()``: the total and the ``top`` functions that make most of them."""
    with CallCounter() as counter:
        fn()
    return {"total": sum(counter.counts.values()), "by_function": dict(counter.counts.most_common(top))}


# -- torch calls and host synchronisations of a decode, by phase -------------------------------------------
#: the phases of ``decode_counts``: ``prefill`` (the target's prefill and the drafter's ``begin``), ``target``
#: (``forward_block`` of the target: its network forwards), ``drafter`` (the drafter's network: an EAGLE head's
#: forward and output head, a draft model's ``forward_block``) and ``loop`` (everything else an iteration does:
#: draft bookkeeping, sampling pipelines, acceptance, commit, observe)
PHASES = ("prefill", "target", "drafter", "loop")


def _is_sync(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether one torch API call makes the host wait for the device: ``coolsd.sync_guard.host_read`` (``.item()``,
    ``.tolist()``, ``bool()`` of a tensor, ``nonzero``, ``torch.equal``, boolean-mask and list indexing, tensors
    built from Python lists, copies between devices), so the blocking copies are counted too."""
    return host_read(func, args, kwargs, moves="across") is not None


class PhaseCounter(TorchFunctionMode):
    """Counts torch API calls (functions, tensor methods and attributes, as ``CallCounter``) and host
    synchronisations (``_is_sync``) into the phase that is current (``phase``), and sums the wall seconds spent
    in each phase. Phases are entered through ``enter``/``leave``, or by the calls that ``wrap_method`` and
    ``hook_module`` attribute to a phase (nested phases count for the innermost one only; time in no entered
    phase is the caller's to attribute). Used as a context manager it counts; outside one it only times (the
    counting's per-call cost would distort the times)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "loop"
        self.calls: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.entries: collections.Counter[str] = collections.Counter()  # network forwards per phase
        self.seconds: collections.Counter[str] = collections.Counter()
        self._stack: list[tuple[str, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[self.phase] += 1
        if _is_sync(func, args, kwargs):
            self.syncs[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def enter(self, phase: str, forward: bool = True) -> None:
        """Enter ``phase`` (``forward``: the call is one network forward, counted in ``entries``)."""
        now = time.perf_counter()
        if self._stack:   # pause the enclosing phase
            outer, since = self._stack[-1]
            self.seconds[outer] += now - since
        self._stack.append((phase, now))
        if forward:
            self.entries[phase] += 1
        self.phase = phase

    def leave(self) -> None:
        now = time.perf_counter()
        phase, since = self._stack.pop()
        self.seconds[phase] += now - since
        if self._stack:
            outer, _ = self._stack[-1]
            self._stack[-1] = (outer, now)
            self.phase = outer
        else:
            self.phase = "loop"

    def hook_module(self, module: torch.nn.Module, phase: str) -> list[Any]:
        """Every forward of ``module`` counts for ``phase``; returns the hook handles."""
        return [module.register_forward_pre_hook(lambda *_: self.enter(phase)),
                module.register_forward_hook(lambda *_: self.leave())]

    def wrap_method(self, obj: Any, name: str, phase: str, forward: bool = True) -> Callable[[], None]:
        """Every call of ``obj.name`` counts for ``phase``; returns the function that restores it."""
        original = getattr(obj, name)
        own = name in vars(obj)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.enter(phase, forward)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        object.__setattr__(obj, name, wrapper)
        return (lambda: object.__setattr__(obj, name, original)) if own else (lambda: object.__delattr__(obj, name))


def phase_hooks(decoder: Decoder) -> list[tuple[Any, str, str, bool]]:
    """(object, method name, phase, whether a call is one network forward) of the calls ``decode_counts``
    attributes to a phase; calls made inside them belong to that phase (the innermost hook wins)."""
    from coolsd.drafters.eagle import EagleDrafter
    from coolsd.drafters.model_drafter import ModelDrafter

    model, drafter = decoder.model, decoder.drafter
    static = getattr(decoder, "static", None) is not None  # the static path: its own forward and drafter begin
    hooks = [(model, "prefill", "prefill", False),
             (drafter, "static_begin" if static else "begin", "prefill", False),
             (model, "static_forward" if static else "forward_block", "target", True)]
    if isinstance(drafter, EagleDrafter):
        hooks += [(drafter.head, "forward", "drafter", True), (drafter.head, "logits", "drafter", False)]
    elif isinstance(drafter, ModelDrafter):
        hooks += [(drafter.model, "prefill", "prefill", False), (drafter.model, "forward_block", "drafter", True)]
    return hooks


@dataclass(frozen=True)
class DecodeCounts:
    """Torch API calls and host synchronisations of one decode, by phase (``PHASES``); ``forwards`` counts the
    network forwards of the target and drafter phases; ``tokens`` = image tokens committed by the iterations
    (the prefill's first token excluded)."""

    decoder: str
    seed: int
    batch: int
    tokens: int
    iterations: int
    calls: dict[str, int]
    syncs: dict[str, int]
    forwards: dict[str, int]

    def per_token(self, phase: str) -> float:
        return self.calls[phase] / max(self.tokens, 1)

    def per_forward(self, phase: str) -> float:
        return self.calls[phase] / max(self.forwards[phase], 1)

    @property
    def loop_per_iteration(self) -> float:
        return self.calls["loop"] / max(self.iterations, 1)

    @property
    def syncs_per_iteration(self) -> float:
        """Host synchronisations of the iterations (prefill excluded) per iteration."""
        return sum(v for k, v in self.syncs.items() if k != "prefill") / max(self.iterations, 1)

    def summary(self) -> dict[str, float]:
        """The figures the bench reports and ``tests/test_call_counts.py`` holds under ceilings."""
        return {
            "target_per_token": self.per_token("target"), "drafter_per_token": self.per_token("drafter"),
            "loop_per_token": self.per_token("loop"), "target_per_forward": self.per_forward("target"),
            "drafter_per_forward": self.per_forward("drafter"), "loop_per_iteration": self.loop_per_iteration,
            "syncs_per_iteration": self.syncs_per_iteration,
        }


def decode_counts(decoder: Decoder, prompt: str, seed: int, batch: int = 1, warm: bool = True) -> DecodeCounts:
    """Count the torch calls and host synchronisations of ``decoder`` generating ``batch`` images of ``prompt``
    (seeds ``seed..seed + batch − 1``), by phase. Counts are deterministic for fixed tokens; ``warm`` decodes
    the same images once uncounted first, so lazily built tables (device copies, masks) are not counted."""
    prompts, seeds = [prompt] * batch, list(range(seed, seed + batch))
    if warm:
        decoder.generate_batch(prompts, seeds)
    counter = PhaseCounter()
    restores = [counter.wrap_method(*spec) for spec in phase_hooks(decoder)]
    try:
        with counter:
            gens = decoder.generate_batch(prompts, seeds)
    finally:
        for restore in reversed(restores):
            restore()
    return DecodeCounts(
        decoder=decoder.name, seed=seed, batch=batch,
        tokens=sum(g.stats.num_tokens - 1 for g in gens), iterations=max(g.stats.iterations for g in gens),
        calls={p: counter.calls[p] for p in PHASES}, syncs={p: counter.syncs[p] for p in PHASES},
        forwards={p: counter.entries[p] for p in PHASES})
