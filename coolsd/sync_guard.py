"""Host reads: the torch calls that make the host wait for the device, and a guard that fails on them.

A decode step that is captured in a CUDA graph (or compiled with ``fullgraph=True``) must not read a tensor's
contents on the host: the read blocks until the device has caught up, a captured graph cannot contain it, and a
Python value that depends on it changes the step from one iteration to the next. ``host_read`` names the kind of
read one torch API call makes, or returns None:

* ``item``/``tolist``/``numpy``/``cpu`` and a Python ``bool``, ``int``, ``float`` or index of a tensor;
* ``nonzero`` (also ``torch.where`` with one argument, ``masked_select``, ``unique``, ``argwhere``), whose result
  shape depends on the contents, and ``torch.equal``/``allclose``, which return a Python bool;
* indexing with a boolean tensor (a hidden ``nonzero``) or with a Python list (copied to the device);
* a tensor built from Python data (``torch.tensor([...])``, ``as_tensor`` of a list): a host-to-device copy;
* ``.to(device)``/``.cuda()``: a copy between devices when the tensor is elsewhere; counted whenever a device is
  named, also on a machine with one device, where it marks code that would copy on a GPU (the static path never
  moves a tensor);
* ``repeat_interleave`` with tensor repeats and no ``output_size`` (its output length is read back).

``SyncGuard`` is a torch function mode that counts these calls, or raises ``HostReadError`` on the first one
(``strict=True``): tests run a static decode step inside it (``tests/test_static_path.py``), and
``eval.bench.call_counts`` counts the same reads per phase of an eager decode.

Example::

    with SyncGuard(strict=True):
        step()          # raises HostReadError at the first host read, naming the call
"""
from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: calls whose result is a host value or a shape that depends on the contents
READ_FUNCTIONS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero",
    "cuda",
})
#: factories that copy Python data into a tensor
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray"})


def _is_python_data(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in x)


def host_read(func: Any, args: tuple, kwargs: dict | None, moves: str = "named") -> str | None:
    """The kind of host read one torch API call makes (module doc), or None. ``moves``: which ``.to(device)`` calls
    count, ``named`` (any that names a device: the guard's rule) or ``across`` (only those whose tensor is on
    another device: a real copy, as ``eval.bench.call_counts`` counts an eager decode's)."""
    name = getattr(func, "__name__", "")
    kwargs = kwargs or {}
    if name in READ_FUNCTIONS:
        return name
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where (one argument: nonzero)"
    if name in _FROM_DATA and args and _is_python_data(args[0]):
        return f"{name} from Python data"
    if name == "to":
        devices = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (str, torch.device))]
        if devices and (moves == "named" or (isinstance(args[0], torch.Tensor)
                                             and any(torch.device(d) != args[0].device for d in devices))):
            return "to (a device)"
        return None
    if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
            and args[1].numel() > 1 and kwargs.get("output_size") is None:
        return "repeat_interleave (tensor repeats)"
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        for i in index:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                return f"{name} (boolean mask)"
            if isinstance(i, list):
                return f"{name} (Python list)"
    return None


class HostReadError(RuntimeError):
    """A host read inside a guarded region (``SyncGuard(strict=True)``)."""


class SyncGuard(TorchFunctionMode):
    """Counts the host reads (``host_read``) made inside it; ``strict``: raises ``HostReadError`` at the first.

    ``reads`` counts them by kind; ``where`` keeps the innermost project frame of each (for messages)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict
        self.reads: collections.Counter[str] = collections.Counter()
        self.where: list[str] = []

    @property
    def total(self) -> int:
        return sum(self.reads.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = host_read(func, args, kwargs)
        if kind is not None:
            self.reads[kind] += 1
            self.where.append(f"{kind} at {_caller()}")
            if self.strict:
                raise HostReadError(f"host read inside a guarded decode step: {self.where[-1]}")
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame of this repository's code (file:line in function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("sync_guard.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in " \
                   f"{frame.name}"
    return "?"
