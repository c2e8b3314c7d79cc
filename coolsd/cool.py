"""COOL-SD: annealed relaxed speculative decoding (arXiv 2601.09212, AAAI 2026) — the paper's method.

Acceptance at draft position i: ``f_i(x) = min(1, ω_i · p_i(x) / q_i(x))`` with ω from
``coolsd.schedules``; on rejection resample from the optimal distribution
``G*_i = norm([p_i − q_i · f_i]_+) = norm([p_i − min(q_i, ω_i p_i)]_+)`` (the general formula, valid for
ω < 1 too; for ω ≥ 1 it equals the vanilla residual). If G* has no mass (numerically) sample from p.
With G* the one-step TV distance to p is exactly ``Σ_y [q(y) f(y) − p(y)]_+`` (zero whenever ω ≤ 1).

Example: ``python run.py decoder=coolsd decoder.delta=2.0 decoder.schedule=exponential decoder.mu=mean``.
"""
from __future__ import annotations

from typing import Callable

import torch

from coolsd import validate
from coolsd.acceptance import AcceptanceRule, ratio_acceptance, unclipped_ratio
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.sampling import normalize
from coolsd.schedules import omega_table
from coolsd.trees import TreeShape, resolve_tree


def optimal_residual(p: torch.Tensor, q: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """COOL-SD's G* = norm([p − q·f]_+) row-wise (N, V), falling back to p where it has no mass."""
    return normalize((p - q * f).clamp_min(0.0), fallback=p)


class CoolSDRule(AcceptanceRule):
    """Annealed relaxed acceptance ``min(1, ω_depth p/q)`` with the optimal resampling distribution G*."""

    def __init__(self, delta: float, draft_len: int, schedule: str = "exponential", nu: float = 0.7,
                 mu: str | float = "mean") -> None:
        self.delta, self.draft_len, self.schedule, self.nu, self.mu = delta, draft_len, schedule, nu, mu
        self.omega = omega_table(schedule, delta, draft_len, nu, mu)  # (L,) float64
        self.lossless = bool((self.omega == 1.0).all())
        self._omega_on: dict[tuple, torch.Tensor] = {}  # the table per (device, dtype), moved once

    def weight(self, depth: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ω at 1-based depths (...,); depths past the schedule's length reuse its last value."""
        key = (depth.device, dtype)
        if key not in self._omega_on:
            self._omega_on[key] = self.omega.to(device=depth.device, dtype=dtype)
        return self._omega_on[key][(depth.long() - 1).clamp(0, self.draft_len - 1)]

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return ratio_acceptance(p, q, self.weight(depth, p.dtype).unsqueeze(-1))

    def ratio(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        x = x[:, None]
        return unclipped_ratio(p.gather(-1, x), q.gather(-1, x), self.weight(depth, p.dtype)[:, None]).squeeze(-1)

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        return optimal_residual(p, q, self.acceptance(p, q, depth))


class CoolSD(Decoder):
    """The COOL-SD decoder: an EAGLE-style drafter, ``draft_len`` drafts, ``CoolSDRule``."""

    def __init__(self, name: str, model: ImageARModel, draft_len: int, delta: float, drafter: Callable[..., Drafter],
                 schedule: str = "exponential", nu: float = 0.7, mu: str | float = "mean",
                 tree: str | None = None, dynamic_tree: dict | None = None,
                 track_tv: bool = True, sync_phases: bool = False, path: str = "eager",
                 refill: bool = False) -> None:
        validate.decoder_options(name=name, draft_len=draft_len, tree=tree, dynamic_tree=dynamic_tree,
                                 track_tv=track_tv, sync_phases=sync_phases)
        # ω_i runs over draft positions, i.e. tree depths: its length is the chain length or the tree's depth
        levels = resolve_tree(tree, dynamic_tree)
        length = draft_len if levels is None else (levels.depth if isinstance(levels, TreeShape) else levels.depth + 1)
        rule = CoolSDRule(delta=delta, draft_len=max(length, 1), schedule=schedule, nu=nu, mu=mu)
        super().__init__(name=name, model=model, rule=rule, draft_len=draft_len, drafter=drafter, tree=tree,
                         dynamic_tree=dynamic_tree, track_tv=track_tv, sync_phases=sync_phases, path=path,
                         refill=refill)
