"""Content fingerprints: what a generated image (or a stored sample) depends on, as short digests.

A record is only reused when everything that determines its tokens is unchanged: the model's weights
(``weights_digest``), the model, sampling and decoder configs, the prompt, the seed, and the version of the
code paths that turn those into tokens (``TOKEN_CODE_VERSION``; bump it whenever a change alters any
decoder's tokens for the same inputs). Since issue 59 every record also carries a digest of the source of the
``coolsd``/``baselines`` modules its decoder reaches (``eval/records/code_digest.py``), which catches an edit
without a bump; the version stays as its backup, for what the digest cannot see (the harness around the decoders,
a library's kernels, records made before digests).

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
#: in a batch are bitwise equal (where the start-up self-check passes, ``coolsd.numerics``); 0–3 % of the default run's
#: images changed tokens. (``model.row_block`` and the machine's numerics signature are fingerprinted beside it.)
TOKEN_CODE_VERSION = 3


def tensor_digest(tensor: torch.Tensor, chunk_bytes: int = 1 << 28) -> bytes:
    """SHA-1 of every byte of a tensor (its values in memory order, any dtype), read in chunks of at most
    ``chunk_bytes`` so a GPU tensor is copied to the host piece by piece."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_zeros(0, dtype=torch.uint8)
    digest = hashlib.sha1()
    for start in range(0, raw.numel(), chunk_bytes):
        digest.update(raw[start: start + chunk_bytes].cpu().numpy().data)
    return digest.digest()


def weights_digest(module: torch.nn.Module, threads: int | None = None) -> str:
    """A content fingerprint of a model's weights: SHA-1 over every parameter's and buffer's name, shape, dtype
    and **every byte** of its values (a checkpoint that differs anywhere gives another digest).

    Tensors are hashed in parallel threads (``hashlib`` releases the GIL), at most ``threads`` (default: the
    CPU count, up to 16). Measured on the 2-core VM: 1.6 GB/s per core (SHA-1 with the CPU's SHA extensions);
    the embedded model's 28 MB take about 20 ms, a 7B model's 14 GB of bfloat16 weights about 5 s there
    (README, "Records and resuming")."""
    from concurrent.futures import ThreadPoolExecutor

    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            raise ValueError(f"cannot fingerprint {name}: the tensor is on the meta device (no weights)")
    workers = max(1, min(threads or os.cpu_count() or 1, 16, len(tensors) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(lambda item: tensor_digest(item[1]), tensors))
    digest = hashlib.sha1()
    for (name, tensor), part in zip(tensors, parts):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(part)
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
