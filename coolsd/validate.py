"""Config values checked where they enter a constructor: type and range, with the key and what is allowed.

Hydra hands values over as written: ``decoder.delta=abc`` arrives as the string ``'abc'`` and
``decoder.draft_len=2.5`` as a float, and either would fail much later (a bare comparison ``TypeError``, or
a crash inside generation). Constructors call these checkers first, so the error names the key:
``decoder.draft_len must be an integer >= 0, got 2.5 (float)``. Integers are ``int`` (never ``bool``, never
``2.0``); numbers are finite ``int`` or ``float``; ``None`` passes only where ``optional=True``.

Example: ``draft_len = integer("decoder.draft_len", draft_len, minimum=0)``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Sequence


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def _range(minimum: float | None, maximum: float | None, min_open: bool, max_open: bool) -> str:
    lo = None if minimum is None else f"{'>' if min_open else '>='} {minimum:g}"
    hi = None if maximum is None else f"{'<' if max_open else '<='} {maximum:g}"
    if lo and hi:
        return f" in {'(' if min_open else '['}{minimum:g}, {maximum:g}{')' if max_open else ']'}"
    return f" {lo or hi}" if (lo or hi) else ""


def _check_range(key: str, kind: str, value: float, minimum: float | None, maximum: float | None,
                 min_open: bool, max_open: bool, original: Any) -> None:
    low = minimum is not None and (value <= minimum if min_open else value < minimum)
    high = maximum is not None and (value >= maximum if max_open else value > maximum)
    if low or high:
        raise ValueError(f"{key} must be {kind}{_range(minimum, maximum, min_open, max_open)}, {_got(original)}")


def integer(key: str, value: Any, minimum: int | None = None, maximum: int | None = None,
            optional: bool = False) -> int | None:
    """``value`` as an int within ``[minimum, maximum]`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    kind = "an integer" + (" or null" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be {kind}{_range(minimum, maximum, False, False)}, {_got(value)}")
    _check_range(key, kind, value, minimum, maximum, False, False, value)
    return int(value)


def number(key: str, value: Any, minimum: float | None = None, maximum: float | None = None,
           min_open: bool = False, max_open: bool = False, optional: bool = False) -> float | None:
    """``value`` as a finite float within the given bounds (open bounds exclude the end point)."""
    if value is None and optional:
        return None
    kind = "a number" + (" or null" if optional else "")
    bounds = _range(minimum, maximum, min_open, max_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{key} must be {kind}{bounds}, {_got(value)}")
    _check_range(key, kind, float(value), minimum, maximum, min_open, max_open, value)
    return float(value)


def boolean(key: str, value: Any) -> bool:
    """``value`` as a bool (true/false in YAML; not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, {_got(value)}")
    return value


def choice(key: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``."""
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, {_got(value)}")
    return value


def string(key: str, value: Any, optional: bool = False) -> str | None:
    """``value`` as a non-empty string (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{key} must be a non-empty string{' or null' if optional else ''}, {_got(value)}")
    return value


def mapping(key: str, value: Any, allowed_keys: Sequence[str], optional: bool = False) -> dict | None:
    """``value`` as a dict whose keys are among ``allowed_keys`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{key} must be a mapping with keys among {list(allowed_keys)}, {_got(value)}")
    unknown = sorted(str(k) for k in value if k not in allowed_keys)
    if unknown:
        raise ValueError(f"{key} must have keys among {list(allowed_keys)}, got unknown keys {unknown}")
    return dict(value)


DYNAMIC_TREE_KEYS = ("top_k", "depth", "total_tokens")  # coolsd.trees.DynamicTree's fields


def decoder_options(name: Any, draft_len: Any, tree: Any = None, dynamic_tree: Any = None,
                    track_tv: Any = True, sync_phases: Any = False) -> None:
    """The options every decoder shares (``configs/decoder/*.yaml``)."""
    string("decoder.name", name)
    integer("decoder.draft_len", draft_len, minimum=0)
    string("decoder.tree", tree, optional=True)
    spec = mapping("decoder.dynamic_tree", dynamic_tree, DYNAMIC_TREE_KEYS, optional=True) or {}
    for sub_key, value in spec.items():
        integer(f"decoder.dynamic_tree.{sub_key}", value, minimum=1)
    boolean("decoder.track_tv", track_tv)
    boolean("decoder.sync_phases", sync_phases)


def eval_options(num_prompts: Any, warmup: Any, seed: Any, save_images: Any, threads: Any,
                 speed_prompts: Any) -> None:
    """The numeric options of an evaluation pass (``configs/eval/*.yaml``, ``eval.run.suite.EvalSuite``)."""
    integer("eval.num_prompts", num_prompts, minimum=1)
    integer("eval.warmup", warmup, minimum=0)
    integer("eval.seed", seed, minimum=0)
    boolean("eval.save_images", save_images)
    integer("eval.threads", threads, minimum=1, optional=True)
    integer("eval.speed_prompts", speed_prompts, minimum=1, optional=True)
