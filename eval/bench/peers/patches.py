"""Run-time replacements of a peer's CUDA-only calls, for running its code on a CPU: device placement only.

A peer's code is never edited. Where it asks for CUDA (``x.cuda()``, ``module.cuda()``, ``torch.cuda.synchronize()``,
``device="cuda"`` in a tensor factory or ``.to("cuda")``), the patches below send the call to the CPU instead and
count it, so the table can say what was patched and how often it was hit while their decode was timed. Each patch
is installed only for the peers that name it (``PeerSpec.patches``) and only around their calls: our decoders never
run under it. The wrappers cost a Python call each; the hit counts show how many calls that was.

Example::

    patches = DevicePatches(["tensor_cuda", "cuda_sync"])
    with patches:
        their_generate(...)
    patches.hits   # {"tensor_cuda": 3, "cuda_sync": 64}
"""
from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Any, Callable, Iterable

import torch

#: what each patch replaces, as the table says it
PATCHES: dict[str, str] = {
    "tensor_cuda": "Tensor.cuda() returns the tensor on the CPU",
    "module_cuda": "nn.Module.cuda() leaves the module on the CPU",
    "cuda_sync": "torch.cuda.synchronize() / empty_cache() do nothing",
    "to_cuda": "Tensor.to / nn.Module.to with a CUDA device go to the CPU",
    "factory_cuda": "device='cuda' in torch tensor factories (zeros, ones, empty, full, arange, tensor, eye, "
                    "rand*, *_like) becomes the CPU",
    "autocast_cuda": "torch.autocast('cuda', ...) / torch.cuda.amp.autocast become a no-op context",
    "cuda_event": "torch.cuda.Event timers record the host clock (record, synchronize, elapsed_time in ms)",
}

_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "tensor", "eye", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "as_tensor",
              "linspace")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)   # .to(0) means cuda:0


class _NoContext:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "_NoContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __call__(self, fn: Callable) -> Callable:   # used as a decorator
        return fn


class _HostEvent:
    """A ``torch.cuda.Event`` stand-in for a peer's own timers: ``record`` reads the host clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 hits: Counter | None = None) -> None:
        self.time: float | None = None
        self._hits = hits

    def record(self, stream: Any = None) -> None:
        if self._hits is not None:
            self._hits["cuda_event"] += 1
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.time - self.time) * 1e3


class DevicePatches:
    """A context manager installing the named patches (re-entrant: nested entries install once)."""

    def __init__(self, names: Iterable[str]) -> None:
        names = list(names)
        unknown = [n for n in names if n not in PATCHES]
        if unknown:
            raise ValueError(f"unknown device patches {unknown}; known: {sorted(PATCHES)}")
        self.names = names
        self.hits: Counter = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _set(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def reset(self) -> None:
        """Forget the hits so far (the comparison resets after the untimed build and warm-up)."""
        self.hits.clear()

    def describe(self) -> list[str]:
        """One line per installed patch: what it replaces and how often it was hit since the last reset."""
        return [f"{PATCHES[n]} ({self.hits.get(n, 0)} calls)" for n in self.names]

    # -- installing -------------------------------------------------------------------------------------------
    def __enter__(self) -> "DevicePatches":
        self._depth += 1
        if self._depth == 1:
            for name in self.names:
                getattr(self, f"_install_{name}")()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            while self._saved:
                owner, attr, value = self._saved.pop()
                setattr(owner, attr, value)

    def _install_tensor_cuda(self) -> None:
        def cuda(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.hits["tensor_cuda"] += 1
            return tensor
        self._set(torch.Tensor, "cuda", cuda)

    def _install_module_cuda(self) -> None:
        def cuda(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            self.hits["module_cuda"] += 1
            return module
        self._set(torch.nn.Module, "cuda", cuda)

    def _install_cuda_sync(self) -> None:
        def nothing(*args: Any, **kwargs: Any) -> None:
            self.hits["cuda_sync"] += 1
        self._set(torch.cuda, "synchronize", nothing)
        self._set(torch.cuda, "empty_cache", nothing)

    def _install_to_cuda(self) -> None:
        hits = self.hits

        def redirect(original: Callable) -> Callable:
            @functools.wraps(original)
            def to(obj: Any, *args: Any, **kwargs: Any) -> Any:
                if args and _is_cuda(args[0]):
                    hits["to_cuda"] += 1
                    args = ("cpu", *args[1:])
                if _is_cuda(kwargs.get("device")):
                    hits["to_cuda"] += 1
                    kwargs["device"] = "cpu"
                return original(obj, *args, **kwargs)
            return to
        self._set(torch.Tensor, "to", redirect(torch.Tensor.to))
        self._set(torch.nn.Module, "to", redirect(torch.nn.Module.to))

    def _install_factory_cuda(self) -> None:
        hits = self.hits

        def redirect(original: Callable) -> Callable:
            @functools.wraps(original)
            def factory(*args: Any, **kwargs: Any) -> Any:
                if _is_cuda(kwargs.get("device")):
                    hits["factory_cuda"] += 1
                    kwargs["device"] = "cpu"
                return original(*args, **kwargs)
            return factory
        for name in _FACTORIES:
            self._set(torch, name, redirect(getattr(torch, name)))

    def _install_cuda_event(self) -> None:
        hits = self.hits
        self._set(torch.cuda, "Event", lambda *args, **kwargs: _HostEvent(*args, **kwargs, hits=hits))

    def _install_autocast_cuda(self) -> None:
        original = torch.autocast
        hits = self.hits

        def autocast(device_type: str = "cuda", *args: Any, **kwargs: Any) -> Any:
            if str(device_type).startswith("cuda"):
                hits["autocast_cuda"] += 1
                return _NoContext()
            return original(device_type, *args, **kwargs)
        self._set(torch, "autocast", autocast)
        self._set(torch.cuda.amp, "autocast", lambda *a, **k: (hits.update(["autocast_cuda"]), _NoContext())[1])
