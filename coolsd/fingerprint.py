"""Content fingerprints: what a generated image (or a stored sample) depends on, as short digests.

A record is only reused when everything that determines its tokens is unchanged: the model's weights
(``weights_digest``), the model, sampling and decoder configs, the prompt, the seed, and the version of the
code paths that turn those into tokens (``TOKEN_CODE_VERSION``; bump it whenever a change alters any
decoder's tokens for the same inputs).

Example: ``weights_digest(model)`` -> a 40-hex-digit SHA-1.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

#: version of the token-producing code (sampling streams, acceptance walks, drafting); part of every record
#: fingerprint. 2: per-image counter-based streams (coolsd.rng) and batched decoding. 3: batch-invariant
#: float32 arithmetic on CPU (column-major linear weights, ``padding_invariant_attention``): an image alone and
#: in a batch are bitwise equal; 0–3 % of the default run's images changed tokens.
TOKEN_CODE_VERSION = 3


def weights_digest(module: torch.nn.Module, per_tensor: int = 4096) -> str:
    """A cheap content fingerprint of a model's weights: SHA-1 over every parameter's and buffer's name,
    shape, dtype and first ``per_tensor`` values (any retraining changes those; reading all of a 7B model
    would not be cheap)."""
    digest = hashlib.sha1()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type == "meta":
            raise ValueError(f"cannot fingerprint {name}: the tensor is on the meta device (no weights)")
        head = tensor.detach().reshape(-1)[:per_tensor].float().cpu().numpy()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(head.tobytes())
    return digest.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """SHA-1 of a file's bytes."""
    digest = hashlib.sha1()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def json_digest(obj: Any) -> str:
    """SHA-1 of a JSON-serialisable object in canonical form (sorted keys)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def differing_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts (missing keys count as different)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing_keys(a, b, name + ".")
        elif a != b:
            keys.append(name)
    return keys
