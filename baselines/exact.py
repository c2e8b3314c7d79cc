"""Vanilla speculative sampling: the exact (lossless) acceptance rule.

Accept ``x`` with ``min(1, p(x)/q(x))``; after a rejection sample from ``norm([p − q]_+)``
(Leviathan et al. 2023; Chen et al. 2023; the "EAGLE-1" rows of the papers). It satisfies, for every y,
``q(y)·a(y) + (1 − Σ_z q(z)·a(z))·r(y) = p(y)``.

Example: ``python run.py decoder=sd``.
"""
from __future__ import annotations

import torch

from coolsd.acceptance import AcceptanceRule
from coolsd.sampling import normalize


def ratio_acceptance(p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``min(1, weight·p/q)`` elementwise; 1 where ``q == 0`` (such a token is never drafted)."""
    ratio = weight * p / q.clamp_min(torch.finfo(q.dtype).tiny)
    return torch.where(q > 0, ratio.clamp(max=1.0), torch.ones_like(p))


class ExactRule(AcceptanceRule):
    """The lossless rule of vanilla speculative decoding."""

    lossless = True

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return ratio_acceptance(p, q)

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: int | None, depth: int) -> torch.Tensor:
        return normalize((p - q).clamp_min(0.0), fallback=p)
