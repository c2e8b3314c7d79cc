"""Relaxation schedules ω_i over draft positions i = 1..L for COOL-SD (arXiv 2601.09212).

The schedule restarts every iteration: ``i`` is the position inside the draft block (the depth in a tree),
not the image position.

* ``exponential`` (the paper's annealed schedule): ``ω_i = δ · exp(−ν·i − μ)`` with
  ``μ = mean`` (default: μ chosen so the mean of ω over the L positions is δ,
  ``μ = ln((1/L)·Σ_j e^{−ν j})``), ``μ = first`` (μ = −ν, so ω_1 = δ) or a number.
  The paper's definition of μ could not be confirmed; ``mean`` is the default because it reproduces the
  paper's ordering of accepted lengths (see ``docs/algorithms.md``, "COOL-SD").
* ``linear``: ``ω_i = δ · 2(L + 1 − i)/(L + 1)`` — a linear decay to zero just past the last position,
  with the same mean δ (this project's choice; the paper's exact linear form could not be confirmed).
* ``uniform``: ``ω_i = δ`` (the paper's UniformRSD ablation).

Example: ``python run.py decoder=coolsd decoder.schedule=linear decoder.delta=2``.
"""
from __future__ import annotations

import math

import torch

from coolsd import validate

SCHEDULES = ("exponential", "linear", "uniform")


def resolve_mu(mu: str | float, nu: float, draft_len: int) -> float:
    """The offset μ of the exponential schedule for ``mu`` in {``mean``, ``first``, a number}."""
    if isinstance(mu, bool) or not isinstance(mu, (str, int, float)):
        raise TypeError(f"decoder.mu must be 'mean', 'first' or a number, got {mu!r} ({type(mu).__name__})")
    if isinstance(mu, str):
        if mu == "mean":
            return math.log(sum(math.exp(-nu * j) for j in range(1, draft_len + 1)) / draft_len)
        if mu == "first":
            return -nu
        try:
            mu = float(mu)
        except ValueError:
            raise ValueError(f"decoder.mu must be 'mean', 'first' or a number, got {mu!r}") from None
    return validate.number("decoder.mu", mu)


def omega_table(schedule: str, delta: float, draft_len: int, nu: float = 0.7,
                mu: str | float = "mean") -> torch.Tensor:
    """ω_1..ω_L as a float64 tensor (L,)."""
    validate.choice("decoder.schedule", schedule, SCHEDULES)
    delta = validate.number("decoder.delta", delta, minimum=0.0, min_open=True)
    draft_len = validate.integer("decoder.draft_len", draft_len, minimum=1)
    nu = validate.number("decoder.nu", nu)
    i = torch.arange(1, draft_len + 1, dtype=torch.float64)
    if schedule == "uniform":
        return torch.full_like(i, delta)
    if schedule == "linear":
        return delta * 2.0 * (draft_len + 1 - i) / (draft_len + 1)
    return delta * torch.exp(-nu * i - resolve_mu(mu, nu, draft_len))
