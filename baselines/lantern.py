"""LANTERN (arXiv 2410.03355) and LANTERN++ (arXiv 2502.06352): latent-neighbour relaxed acceptance.

For a draft ``x`` with latent neighbours ``n_1, n_2, ...`` (``coolsd.neighbours``), ``S_m = Σ_{j≤m} p(n_j)``,
``m*`` = the largest ``m ≤ k`` with ``S_m ≤ τ(x)``, and the relaxed target probability
``p̃(x) = p(x) + S_{m*}``; accept with ``min(1, p̃(x)/q(x))``.
LANTERN: additive budget ``τ = δ`` (δ ∈ [0, 1]); LANTERN++: multiplicative ``τ = (λ − 1)·p(x)`` (λ ≥ 1).

Resampling after rejecting ``x`` (``resample``):

* ``reference`` — the published LANTERN behaviour (jadohu/LANTERN ``ea_model_llamagen.py:
  evaluate_posterior``): when ``m* ≥ 1`` the ``k + 1`` nearest neighbours of ``x`` are zeroed in ``p``, then
  ``norm([p − q]_+)`` (with deterministic drafts, q one-hot on x, this is exactly the published "zero p(x)
  and the neighbours, renormalise"); uniform if nothing is left, as in the reference.
* ``reference_q`` — the published LlamaGen static-tree path (``evaluate_posterior_v1``): the neighbours are
  zeroed in ``q`` instead (not renormalised), then ``norm([p − q]_+)``.
* ``optimal`` — COOL-SD's ``G* = norm([p − q·f]_+)``, an ablation of the COOL-SD paper. Because
  ``p̃ ≥ p``, ``G*`` here equals the vanilla residual ``norm([p − q]_+)``.

The one-step TV of the reference residuals, which depend on the rejected token, is computed exactly by
summing the per-token residuals with scatter-adds over the neighbour table (O(V·k)). The residual entries
are the ones ``residual()`` samples from (same dtype, same operations); their masses and sums are taken in
float64, where the subtraction ``R − Σ_{y∈Z(x)} r(y)`` cannot leave float32 rounding (~6e-8) in place of an
empty residual, and a residual counts as empty by ``residual()``'s own test (``coolsd.sampling.EMPTY_MASS``).

Example: ``python run.py decoder=lantern decoder.k=1000 decoder.delta=0.1``;
``python run.py decoder=lantern_pp decoder.k=10 decoder.lam=5``;
``python run.py decoder=lantern_sjd decoder.sv.enabled=true`` (LANTERN-SV in the Jacobi loop, ``baselines/sv.py``).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from baselines.sv import sv_verifier
from coolsd import validate
from coolsd.acceptance import AcceptanceRule, ratio_acceptance, unclipped_ratio, vanilla_residual
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.neighbours import METRICS, latent_neighbours
from coolsd.sampling import EMPTY_MASS

RESAMPLE = ("reference", "reference_q", "optimal")
MODES = ("additive", "multiplicative")


class LanternRule(AcceptanceRule):
    """Relaxed acceptance over latent neighbourhoods; ``neighbours`` is (V, ≥ k+1) sorted by distance.

    Every method works on rows (N, V) of distributions, one row per image (or per test), with drafted
    tokens and depths (N,).
    """

    #: the one-step TV gathers (rows, V, k) neighbour masses; rows are processed in chunks of at most this many
    TV_CHUNK = 1 << 24
    #: codebooks up to this size sum over the zeroing sets with a dense (V, V) membership matrix
    DENSE_MEMBERSHIP = 4096
    #: ``relaxed(p, None)`` gathers its (rows, V, k) neighbour masses in row chunks of at most this many
    #: elements: a chunk that stays in the CPU's cache is 2-3x faster than one pass (per-row ops, same bits)
    RELAX_CHUNK = 1 << 21

    def __init__(self, neighbours: torch.Tensor, k: int, mode: str, budget: float,
                 resample: str = "reference") -> None:
        if mode not in MODES:
            raise ValueError(f"LANTERN mode must be one of {MODES}, got {mode!r}")
        if resample not in RESAMPLE:
            raise ValueError(f"decoder.resample must be one of {RESAMPLE}, got {resample!r}")
        if mode == "additive" and not 0.0 <= budget <= 1.0:
            raise ValueError(f"decoder.delta must be in [0, 1], got {budget}")
        if mode == "multiplicative" and budget < 1.0:
            raise ValueError(f"decoder.lam must be >= 1, got {budget}")
        if neighbours.shape[1] < k + 1:
            raise ValueError(f"the neighbour table has {neighbours.shape[1]} columns; k = {k} needs k + 1")
        self.neighbours = neighbours.long()
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._last_relaxed: tuple | None = None  # (p, x, relaxed(p, x)) of the last call with drafts
        self.k, self.mode, self.budget, self.resample = k, mode, budget, resample
        self.lossless = budget == (0.0 if mode == "additive" else 1.0) and resample == "optimal"

    def relaxed(self, p: torch.Tensor, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(p̃(x), m*(x))`` for drafts ``x`` (N,) under rows ``p`` (N, V), or for every code at once when
        ``x`` is None (each row's whole codebook) -> (N,) or (N, V).

        A test asks twice for the same drafts (``accept_prob``, then ``residual`` after a rejection): the last
        ``(p, x)`` pair's result is kept and returned for the same two tensor objects (held, so their ids
        cannot be reused). A caller that writes into a tested distribution in place must ask with another tensor
        object afterwards: the static path's parallel walk overwrites its residual rows after their rank's two
        calls and slices them anew for the next rank."""
        if x is not None:
            last = self._last_relaxed
            if last is not None and last[0] is p and last[1] is x:
                return last[2]
            out = self._relaxed(p, x)
            self._last_relaxed = (p, x, out)
            return out
        return self._relaxed(p, x)

    def _relaxed(self, p: torch.Tensor, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if x is None:  # one neighbour table for every row: a column gather, no per-row index tensor
            rows = max(1, self.RELAX_CHUNK // max(1, p.shape[-1] * self.k))
            if p.dim() == 2 and p.shape[0] > rows:
                parts = [self.relaxed(p[i: i + rows], None) for i in range(0, p.shape[0], rows)]
                return torch.cat([a for a, _ in parts]), torch.cat([m for _, m in parts])
            nb = self.table(p.device)[:, : self.k]  # (V, k)
            mass = p.index_select(-1, nb.flatten()).view(*p.shape, self.k)  # (N, V, k)
            px = p
        else:
            both = p.gather(-1, self._tables(p.device)[1].index_select(0, x))  # (N, k + 1): p(x), its k neighbours
            mass, px = both[:, 1:], both[:, 0]
        # S_0 = 0, S_1..S_k: the prefix sums, non-decreasing, with a zero in front (a copy of the values)
        prefix = torch.nn.functional.pad(mass.cumsum(-1), (1, 0))
        tau = torch.full_like(px, self.budget) if self.mode == "additive" else (self.budget - 1.0) * px
        # feasible prefixes form a prefix (S is non-decreasing): m* counts the S_m <= tau for m >= 1 (tau >= 0,
        # so S_0 always counts: the search gives m* + 1), and S_{m*} is what moves onto x
        m_star = torch.searchsorted(prefix, tau.unsqueeze(-1), right=True) - 1
        return px + prefix.gather(-1, m_star).squeeze(-1), m_star.squeeze(-1)

    def membership(self, device: torch.device) -> torch.Tensor | None:
        """(V, V) float64 with row x marking the zeroing set Z(x) (the k + 1 nearest neighbours), cached, or
        None for codebooks too large to hold it densely (sums then gather the table)."""
        v = self.neighbours.shape[0]
        if v > self.DENSE_MEMBERSHIP:
            return None
        if getattr(self, "_membership", None) is None or self._membership.device != device:
            z = self._tables(device)[2]
            self._membership = torch.zeros(v, v, dtype=torch.float64, device=device).scatter_(1, z, 1.0)
        return self._membership

    def table(self, device: torch.device) -> torch.Tensor:
        """The neighbour table on ``device`` (moved once)."""
        return self._tables(device)[0]

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the neighbour table, each code followed by its k nearest neighbours (V, k + 1), each code's zeroing
        set Z(x) = its k + 1 nearest (V, k + 1)) on ``device``, built once per device."""
        tables = self._on.get(device)
        if tables is None:
            table = self.neighbours.to(device)
            codes = torch.arange(table.shape[0], device=device)[:, None]
            tables = self._on[device] = (table, torch.cat([codes, table[:, : self.k]], 1),
                                         table[:, : self.k + 1].contiguous())
        return tables

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        p_tilde, _ = self.relaxed(p, None)  # (N, V)
        return ratio_acceptance(p_tilde, q)

    def accept_prob(self, p, q, x, depth) -> torch.Tensor:
        p_tilde, _ = self.relaxed(p, x)  # (N,)
        return ratio_acceptance(p_tilde, q.gather(-1, x[:, None]).squeeze(-1))

    def ratio(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """``p̃(x)/q(x)`` (N,), not clipped: ``accept_prob`` is its ``min(1, ·)``."""
        p_tilde, _ = self.relaxed(p, x)  # (N,)
        return unclipped_ratio(p_tilde, q.gather(-1, x[:, None]).squeeze(-1))

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        if self.resample == "optimal" or x is None:
            return vanilla_residual(p, q)
        _, m_star = self.relaxed(p, x)
        z = self._tables(p.device)[2].index_select(0, x)  # (N, k+1): Z(x)
        zeroing = (m_star >= 1)[:, None]
        if self.resample == "reference":
            p = torch.where(zeroing, p.scatter(-1, z, 0.0), p)
        else:
            q = torch.where(zeroing, q.scatter(-1, z, 0.0), q)
        # the uniform fallback as one broadcast value (the same float32 1/V in every entry of the result)
        return vanilla_residual(p, q, fallback=p.new_full((1,), 1.0 / p.shape[-1]))

    def one_step_tv(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Exact TV (N,) of ``q f + Σ_x q(x)(1 − f(x)) G_x`` to ``p``, with the token-dependent ``G_x``.

        ``f`` and ``m*`` in ``p``'s dtype (as the sampler computes them), the rest in float64 with
        ``residual``'s 1e-12 threshold: each ``G_x``'s mass is the residual mass
        outside ``Z(x)`` (exact to ~1e-16 in float64, where float32 subtraction left ~6e-8 of an empty
        residual) plus what ``Z(x)`` contributes, so a residual that ``residual`` finds empty (and replaces
        by uniform) is empty here too."""
        rows = max(1, self.TV_CHUNK // max(1, p.shape[-1] * (self.k + 1)))
        return torch.cat([self._one_step_tv(p[i: i + rows], q[i: i + rows]) for i in range(0, p.shape[0], rows)])

    def _one_step_tv(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        v = p.shape[-1]
        p_tilde, m_star = self.relaxed(p, None)  # (N, V), in p's dtype as the sampler computes it
        f = ratio_acceptance(p_tilde, q)
        p, q, f = p.double(), q.double(), f.double()
        out = q * f
        reject = q * (1.0 - f)  # (N, V) probability of drafting x and rejecting it
        r = (p - q).clamp_min(0.0)
        if self.resample == "optimal":
            out = out + reject.sum(-1, keepdim=True) * vanilla_residual(p, q)
            return 0.5 * (out - p).abs().sum(-1)
        zeroing = m_star >= 1  # (N, V) which rejected tokens zero their neighbourhood
        # G_x's numerator is r with its entries on Z(x) replaced: by 0 (reference: p zeroed there) or by p
        # (reference_q: q zeroed there)
        inside = p if self.resample == "reference_q" else torch.zeros_like(p)
        member = self.membership(p.device)  # (V, V): row x marks Z(x)
        if member is not None:
            on_z = lambda a: a @ member.T  # noqa: E731  (N, V): Σ_{y ∈ Z(x)} a(y) for every x
        else:
            z = self._tables(p.device)[2]
            on_z = lambda a: a.index_select(-1, z.flatten()).view(*a.shape, -1).sum(-1)  # noqa: E731
        total = r.sum(-1, keepdim=True)
        outside = (total - on_z(r)).clamp_min(0.0)  # (N, V): Σ_{y ∉ Z(x)} r(y), exact to ~1e-16
        mass = torch.where(zeroing, outside + on_z(inside), total)  # (N, V) normaliser of each G_x
        ok = mass > EMPTY_MASS
        c = torch.where(ok, reject / mass.clamp_min(1e-300), torch.zeros_like(mass))
        cz = c * zeroing
        if member is not None:
            hits = cz @ member  # (N, V): Σ_{x: y ∈ Z(x)} c_x
        else:
            hits = torch.zeros_like(p).scatter_add_(-1, z.flatten()[None].expand(p.shape[0], -1),
                                                    cz.repeat_interleave(z.shape[1], dim=-1))
        change = inside - r  # per-token change of G_x's numerator on Z(x)
        out = out + c.sum(-1, keepdim=True) * r + hits * change
        out = out + (reject * ~ok).sum(-1, keepdim=True) / v  # empty residual: uniform, as in the reference
        return 0.5 * (out - p).abs().sum(-1)


def check_options(name, draft_len, k, resample, neighbour_metric, tree, dynamic_tree, track_tv, sync_phases) -> None:
    """Types and ranges of the options LANTERN and LANTERN++ share (their budgets are checked by each)."""
    validate.decoder_options(name=name, draft_len=draft_len, tree=tree, dynamic_tree=dynamic_tree,
                             track_tv=track_tv, sync_phases=sync_phases)
    validate.integer("decoder.k", k, minimum=1)
    validate.choice("decoder.resample", resample, RESAMPLE)
    validate.choice("decoder.neighbour_metric", neighbour_metric, METRICS)


def lantern_rule(model: ImageARModel, k: int, mode: str, budget: float, resample: str,
                 neighbour_metric: str, neighbour_cache: str | None) -> LanternRule:
    """Build the rule with the model's neighbour table (k + 1 columns for the reference zeroing)."""
    v = model.codebook_size
    if k > v - 2:
        warnings.warn(f"decoder.k={k} exceeds the {v - 2} neighbours a {v}-code codebook allows with the "
                      f"reference zeroing set; using k={v - 2}", stacklevel=3)
        k = v - 2
    if k < 1:
        raise ValueError(f"decoder.k must be >= 1, got {k}")
    table = latent_neighbours(model.codebook(), k + 1, neighbour_metric, neighbour_cache)
    return LanternRule(table, k=k, mode=mode, budget=budget, resample=resample)


class Lantern(Decoder):
    """LANTERN: additive budget δ over the k nearest latent neighbours. With the Jacobi window as its drafter
    (``configs/decoder/lantern_sjd.yaml``) it is LANTERN inside the Jacobi loop, as GSD's and SJD-SV's papers run
    it (no drafter network); ``sv.enabled`` puts its relaxed ratio ``p̃/q`` in SJD-SV's subsequence test
    (LANTERN-SV, ``baselines.sv``; chains only)."""

    def __init__(self, name: str, model: ImageARModel, draft_len: int, drafter: Callable[..., Drafter],
                 k: int = 1000, delta: float = 0.1, resample: str = "reference",
                 neighbour_metric: str = "l2_raw", neighbour_cache: str | None = None,
                 tree: str | None = None, dynamic_tree: dict | None = None, sv: Mapping[str, Any] | None = None,
                 track_tv: bool = True, sync_phases: bool = False, path: str = "eager",
                 refill: bool = False) -> None:
        check_options(name, draft_len, k, resample, neighbour_metric, tree, dynamic_tree, track_tv, sync_phases)
        validate.number("decoder.delta", delta, minimum=0.0, maximum=1.0)
        rule = lantern_rule(model, k, "additive", delta, resample, neighbour_metric, neighbour_cache)
        super().__init__(name=name, model=model, rule=rule, draft_len=draft_len, drafter=drafter, tree=tree,
                         dynamic_tree=dynamic_tree, track_tv=track_tv, sync_phases=sync_phases,
                         verifier=sv_verifier(sv, rule), path=path, refill=refill)


class LanternPP(Decoder):
    """LANTERN++: multiplicative budget p̃(x) ≤ λ·p(x) over the k nearest latent neighbours."""

    def __init__(self, name: str, model: ImageARModel, draft_len: int, drafter: Callable[..., Drafter],
                 k: int = 10, lam: float = 5.0, resample: str = "reference",
                 neighbour_metric: str = "l2_raw", neighbour_cache: str | None = None,
                 tree: str | None = None, dynamic_tree: dict | None = None,
                 track_tv: bool = True, sync_phases: bool = False, path: str = "eager",
                 refill: bool = False) -> None:
        check_options(name, draft_len, k, resample, neighbour_metric, tree, dynamic_tree, track_tv, sync_phases)
        validate.number("decoder.lam", lam, minimum=1.0)
        rule = lantern_rule(model, k, "multiplicative", lam, resample, neighbour_metric, neighbour_cache)
        super().__init__(name=name, model=model, rule=rule, draft_len=draft_len, drafter=drafter, tree=tree,
                         dynamic_tree=dynamic_tree, track_tv=track_tv, sync_phases=sync_phases, path=path,
                         refill=refill)
