"""Latent-proximity neighbour tables of a VQ codebook (LANTERN, arXiv 2410.03355).

For every code, the other codes sorted by L2 distance between codebook vectors, the code itself excluded.
The reference (jadohu/LANTERN ``entrypoints/generate_codebook.py``) uses the raw, un-normalised codebook
weights and keeps every neighbour as uint16; this project keeps the first ``k`` neighbours as int32 and
caches the table on disk under a name that holds a hash of the codebook, the metric and ``k``, so it is
computed once per model.

Example: ``latent_neighbours(model.codebook(), k=1001, cache_dir="~/.cache/coolsd/neighbours")``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from coolsd.io import atomic_write_bytes

METRICS = ("l2_raw", "l2_normalized")


def codebook_hash(codebook: torch.Tensor) -> str:
    data = codebook.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


def compute_neighbours(codebook: torch.Tensor, k: int, metric: str = "l2_raw",
                       chunk: int = 1024) -> torch.Tensor:
    """(V, k) int64 table: row c lists the k codes nearest to c (ascending distance), c excluded."""
    if metric not in METRICS:
        raise ValueError(f"decoder.neighbour_metric must be one of {METRICS}, got {metric!r}")
    emb = codebook.detach().float()
    if metric == "l2_normalized":
        emb = torch.nn.functional.normalize(emb, dim=-1)
    v = emb.shape[0]
    if not 0 < k < v:
        raise ValueError(f"decoder.k must be in 1..{v - 1} for a codebook of {v} codes, got {k}")
    rows = []
    for start in range(0, v, chunk):
        d = torch.cdist(emb[start : start + chunk], emb)  # (chunk, V)
        idx = torch.arange(start, min(start + chunk, v), device=d.device)
        d[idx - start, idx] = float("inf")
        # a stable sort keeps ties in code order, so the table does not depend on the chunk size
        rows.append(torch.sort(d, dim=-1, stable=True).indices[:, :k])
    return torch.cat(rows)


def latent_neighbours(codebook: torch.Tensor, k: int, metric: str = "l2_raw",
                      cache_dir: str | None = None) -> torch.Tensor:
    """The (V, k) int64 neighbour table, read from / written to ``cache_dir`` when given."""
    if cache_dir is None:
        return compute_neighbours(codebook, k, metric)
    from safetensors.torch import load_file, save

    path = Path(cache_dir).expanduser() / f"neighbours_{codebook_hash(codebook)}_{metric}_k{k}.safetensors"
    if path.is_file():
        return load_file(str(path))["neighbours"].long()
    table = compute_neighbours(codebook, k, metric)
    atomic_write_bytes(path, save({"neighbours": table.to(torch.int32).contiguous()}))
    return table
