"""GSD — grouped speculative decoding (So, Shin, Kook & Park, arXiv 2508.07747, ICCV 2025): SJD's window with a
lossy acceptance test over a dynamic group of codes.

A draft ``x`` is accepted with ``f(x) = min(1, Σ_{g∈G(x)} p(g) / Σ_{g∈G(x)} q(g))``, where the group ``G(x)`` is
built per test from the target ``p``: sort the codes by ``p`` (ascending), take the codes nearest to ``x`` in
rank, keep those with ``|p(g) − p(x)| < δ_p`` (``delta_p``) and squared L2 distance ``‖E_g − E_x‖² < d``
(``max_distance``) between their embeddings ``E``. ``x`` is always in its group, so ``f ≥ min(1, p/q)``. On a
rejection the next token comes from the token-level residual ``norm([p − q]_+)``. With a fresh one-hot draft
(``q = δ_x``) the test is ``min(1, p(G(x)))``. GSD is lossy; its knob is the group size.

Options that differ between the paper and its published code (junhyukso/GSD
``scheduler/jacobi_iteration_lumina_mgpt.py``, studied, not copied):

* ``window``: ``paper`` = ``x`` and ``⌊G/2⌋`` codes on each side in rank (``group_size`` G; the paper's Table 1
  uses G = 25 on MS-COCO, 50 on PartiPrompts), cut at the ends of the ranking; ``reference_code`` = the code's
  fixed slice of ranks ``[k − 7, k + 7)`` around ``x``'s rank ``k`` (7 less probable codes, ``x``, 6 more
  probable; ``group_size`` is ignored) and, where ``k < 7`` (the slice would be empty), the plain ratio
  ``min(1, p(x)/q(x))``, as the code's exception path does.
* ``embedding``: ``input`` = the target's input embedding of the image codes (``model.embed``; the code uses
  Lumina-mGPT's ``embed_tokens``), ``codebook`` = the VQ codebook vectors (``model.codebook()``; the paper's
  wording, ``docs/algorithms.md``). The thresholds ``δ_p = 0.15`` and ``d = 0.5`` are the code's, tuned for
  Lumina-mGPT's embedding table; another model's embeddings have another scale (``max_distance`` is a knob).
  Distances are computed in float32 (the code: in the model's bf16).

Example: ``python run.py decoder=gsd decoder.group_size=25``;
``python run.py decoder=gsd decoder.window=reference_code`` (the published code's ±7 window);
``python run.py decoder=gsd_sv`` (GSD-SV: the grouped ratio in SJD-SV's subsequence test, ``baselines/sv.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from coolsd import validate
from baselines.sv import sv_verifier
from coolsd.acceptance import AcceptanceRule, unclipped_ratio, vanilla_residual
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel

WINDOWS = ("paper", "reference_code")
EMBEDDINGS = ("input", "codebook")
#: the published code's rank slice around x: [k − REFERENCE_BELOW, k + REFERENCE_ABOVE)
REFERENCE_BELOW, REFERENCE_ABOVE = 7, 7


class GroupedRule(AcceptanceRule):
    """GSD's grouped acceptance over code embeddings ``embeddings`` (V, D) (module doc)."""

    lossless = False
    #: codebooks up to this size keep the (V, V) squared distances in memory (8,192 codes: 268 MB); larger ones
    #: gather embeddings per chunk
    DENSE_DISTANCES = 8192
    #: ``acceptance`` for every code gathers (rows, V, window) candidates in chunks of at most this many elements
    CHUNK = 1 << 22

    def __init__(self, embeddings: torch.Tensor, group_size: int = 25, window: str = "paper",
                 delta_p: float = 0.15, max_distance: float = 0.5) -> None:
        self.window = validate.choice("decoder.window", window, WINDOWS)
        self.group_size = validate.integer("decoder.group_size", group_size, minimum=1)
        self.delta_p = validate.number("decoder.delta_p", delta_p, minimum=0.0, min_open=True)
        self.max_distance = validate.number("decoder.max_distance", max_distance, minimum=0.0, min_open=True)
        self.embeddings = embeddings.detach().float()
        self._dense: dict[torch.device, torch.Tensor] = {}
        self._copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if window == "paper":
            half = self.group_size // 2
            self.offsets = torch.arange(-half, half + 1)
        else:
            self.offsets = torch.arange(-REFERENCE_BELOW, REFERENCE_ABOVE)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings and the rank offsets on ``device``, copied there once (no copy inside a decode step)."""
        if device not in self._copies:
            self._copies[device] = (self.embeddings.to(device), self.offsets.to(device))
        return self._copies[device]

    def distances(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Squared L2 distances between the embeddings of codes ``a`` (...) and ``b`` (..., W) -> (..., W)."""
        device = a.device
        e = self._on(device)[0]
        if e.shape[0] <= self.DENSE_DISTANCES:
            if device not in self._dense:
                sq = (e * e).sum(-1)
                self._dense[device] = (sq[:, None] + sq[None, :] - 2.0 * e @ e.T).clamp_min(0.0)  # (V, V)
            return self._dense[device][a[..., None], b]
        return ((e[a][..., None, :] - e[b]) ** 2).sum(-1)

    def group_ratio(self, p: torch.Tensor, q: torch.Tensor, y: torch.Tensor, clip: bool = True) -> torch.Tensor:
        """``min(1, p(G(y)) / q(G(y)))`` for codes ``y`` (N, C) of rows ``p``, ``q`` (N, V) -> (N, C); with
        ``clip=False`` the ratio itself (what ``ratio`` gives a joint test; clipped, it is the same bits)."""
        v = p.shape[-1]
        order = torch.sort(p, dim=-1, stable=True).indices  # (N, V) ascending
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(v, device=p.device).expand_as(order))
        k = rank.gather(-1, y)  # (N, C)
        slots = k[..., None] + self._on(p.device)[1]  # (N, C, W)
        inside = (slots >= 0) & (slots < v)
        g = order.gather(-1, slots.clamp(0, v - 1).flatten(1)).view(slots.shape)  # (N, C, W) codes
        p_g = p.gather(-1, g.flatten(1)).view(g.shape)
        q_g = q.gather(-1, g.flatten(1)).view(g.shape)
        p_y = p.gather(-1, y)
        keep = inside & ((p_g - p_y[..., None]).abs() < self.delta_p)
        keep &= self.distances(y, g) < self.max_distance
        num = (p_g * keep).sum(-1)
        den = (q_g * keep).sum(-1)
        ratio = torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.ones_like(num))
        if self.window == "reference_code":  # the code's empty slice (rank below 7): the plain SJD ratio
            plain = unclipped_ratio(p_y, q.gather(-1, y))
            ratio = torch.where(k < REFERENCE_BELOW, plain, ratio)
        return ratio.clamp(max=1.0) if clip else ratio

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return self.group_ratio(p, q, x[:, None])[:, 0]

    def ratio(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return self.group_ratio(p, q, x[:, None], clip=False)[:, 0]

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        n, v = p.shape
        codes = torch.arange(v, device=p.device)
        per_code = n * len(self.offsets) * (1 if v <= self.DENSE_DISTANCES else self.embeddings.shape[-1])
        step = max(1, self.CHUNK // max(per_code, 1))
        parts = [self.group_ratio(p, q, codes[i: i + step].expand(n, -1)) for i in range(0, v, step)]
        return torch.cat(parts, dim=-1)

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        return vanilla_residual(p, q)


def code_embeddings(model: ImageARModel, embedding: str) -> torch.Tensor:
    """The (V, D) vectors GSD's distance filter compares: ``input`` (``model.embed``) or ``codebook``."""
    validate.choice("decoder.embedding", embedding, EMBEDDINGS)
    with torch.inference_mode():
        if embedding == "codebook":
            return model.codebook().float()
        return model.embed(torch.arange(model.codebook_size, device=model.device)).float()


class GSD(Decoder):
    """GSD: the Jacobi window (``drafter``, a ``baselines.jacobi.JacobiDrafter``) with ``GroupedRule``; with
    ``sv.enabled`` GSD-SV, the grouped ratio in SJD-SV's subsequence test (``baselines.sv``)."""

    def __init__(self, name: str, model: ImageARModel, draft_len: int, drafter: Callable[..., Drafter],
                 group_size: int = 25, window: str = "paper", delta_p: float = 0.15, max_distance: float = 0.5,
                 embedding: str = "input", sv: Mapping[str, Any] | None = None, track_tv: bool = True,
                 sync_phases: bool = False, path: str = "eager",
                 refill: bool = False) -> None:
        rule = GroupedRule(code_embeddings(model, embedding), group_size, window, delta_p, max_distance)
        super().__init__(name, model, rule, draft_len=draft_len, drafter=drafter, track_tv=track_tv,
                         sync_phases=sync_phases, verifier=sv_verifier(sv, rule), path=path, refill=refill)
