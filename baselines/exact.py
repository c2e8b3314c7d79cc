"""Vanilla speculative sampling: the exact (lossless) acceptance rule.

Accept ``x`` with ``min(1, p(x)/q(x))``; after a rejection sample from ``norm([p − q]_+)``
(Leviathan et al. 2023; Chen et al. 2023; the "EAGLE-1" rows of the papers). It satisfies, for every y,
``q(y)·a(y) + (1 − Σ_z q(z)·a(z))·r(y) = p(y)``.

Example: ``python run.py decoder=sd``.
"""
from __future__ import annotations

import torch

from coolsd.acceptance import AcceptanceRule, ratio_acceptance, vanilla_residual


class ExactRule(AcceptanceRule):
    """The lossless rule of vanilla speculative decoding."""

    lossless = True

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return ratio_acceptance(p, q)

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        return vanilla_residual(p, q)
