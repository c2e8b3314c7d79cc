"""Speculative Jacobi decoding (SJD, Teng et al., arXiv 2410.01699): the training-free baseline.

The model drafts for itself. A window of ``W`` tokens after the last committed one is refined by Jacobi
iteration: every iteration runs the target once over ``[last committed, d_1..d_{W−1}]`` and accepts a prefix
of the drafts with ``min(1, p_t(d)/p_{t−1}(d))``, where ``p_{t−1}`` is the distribution ``d`` was drawn from
in the previous iteration (one-hot for a freshly initialised token). After the first rejection it samples
from ``norm([p_t − p_{t−1}]_+)``. This is vanilla speculative sampling with ``q := p_{t−1}``, so SJD is just
a drafter (``JacobiDrafter``) run by the shared loop with ``baselines.exact.ExactRule`` and
``draft_len = W − 1``; the loop already shrinks the window at the end of the grid, drops the KV entries of
the rejected suffix, and commits the sample at the last window position when every draft passes.

The drafter carries between iterations the target distributions at the positions right of the newly
committed token (computed in the verify forward, conditioned on the rejected drafts: that *is* the Jacobi
update). At the next ``propose`` it draws the new drafts from them (the reference draws them inside the
verify forward; drawing later with the loop's generator has the same distribution) and tops the window up
with fresh initial tokens whose ``q`` is one-hot:

* ``random``: uniform over the image codebook ``[0, V)`` (the Lumina-mGPT demo default);
* ``repeat_horizon``: the token one column to the left in the image grid (committed, carried or just
  initialised). At column 0 there is no left neighbour and the token is uniform random, as in the reference.
* ``auto`` (config default): the model adapter's ``sjd_init`` (``repeat_horizon`` for LlamaGen, as the
  reference's LlamaGen demo; ``random`` otherwise).

Written after tyshiwo1/Accelerating-T2I-AR-with-SJD ``scheduler/jacobi_iteration_lumina_mgpt.py``
(``JacobiSampler._sample``, ``SpeculativeSampler``, ``get_multi_token_for_preparation``). Differences:

* The reference decodes plainly autoregressively outside a range of sequence positions: to emit Lumina's
  structural tokens, and for the last ``W + 2`` LlamaGen tokens. Model adapters here force structural tokens
  themselves, so every image token is decoded inside the window, which just shrinks to the grid's end.
* ``repeat_horizon`` for a fresh token whose left neighbour is also fresh copies that neighbour; the
  reference copies the last token it already holds. The two agree except right after a fresh column-0
  token: here the row continues from that random token, there from the previous row's last token.
* In the reference's LlamaGen path ``repeat_horizon`` never takes effect (the row width is read from a
  Lumina-only logits processor, so every fresh token stays random). Here it does what its name says; use
  ``decoder.drafter.init=random`` to reproduce the reference's LlamaGen behaviour.

The window length is ``W = decoder.draft_len + 1`` (16 by default, the reference's ``max_num_new_tokens``).
SJD has no drafter network, so ``Draft.forwards`` is 0.

Example: ``python run.py decoder=sjd decoder.drafter.init=random decoder.draft_len=15``.
"""
from __future__ import annotations

import torch

from coolsd.drafters.base import Drafter, empty_draft
from coolsd.models.base import ImageARModel
from coolsd.rng import INIT, JACOBI, sample
from coolsd.types import Draft, TargetOutput, Verdict

INITS = ("auto", "random", "repeat_horizon")


class JacobiDrafter(Drafter):
    """The Jacobi window of SJD for a batch of images: drafts are last iteration's samples plus freshly
    initialised tokens."""

    def __init__(self, target: ImageARModel, init: str = "auto") -> None:
        if init not in INITS:
            raise ValueError(f"decoder.drafter.init must be one of {INITS}, got {init!r}")
        if init == "auto":
            init = getattr(target, "sjd_init", "random")
            if init not in INITS[1:]:
                raise ValueError(f"{type(target).__name__}.sjd_init must be one of {INITS[1:]}, got {init!r}")
        self.target = target
        self.init = init
        self.vocab = target.codebook_size
        self.width = target.grid[1]
        self.streams = None
        self.q: torch.Tensor | None = None  # (B, K, V) p_{t−1} at the positions after the last committed token
        self.carried: list[int] = []  # per image: how many of the K rows are carried

    def begin(self, prompts, prefill: TargetOutput, first_tokens: torch.Tensor, streams) -> None:
        b = first_tokens.shape[0]
        self.streams = streams
        self.q = torch.zeros(b, 0, self.vocab, device=first_tokens.device)
        self.carried = [0] * b

    def select(self, images) -> None:
        self.q = self.q[torch.tensor(list(images), device=self.q.device)]
        self.carried = [self.carried[i] for i in images]

    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        if tree is not None:
            raise ValueError("SJD drafts a Jacobi window (a chain); remove decoder.tree for decoder=sjd")
        b = last_tokens.shape[0]
        device = last_tokens.device
        if depth == 0:
            return empty_draft(b, self.vocab, device)
        k = self.q.shape[1]
        carried = torch.minimum(torch.tensor(self.carried, device=device), limit)  # (B,)
        index = torch.arange(depth, device=device)
        is_carried = index[None, :] < carried[:, None]  # (B, L)
        q_carried = torch.zeros(b, depth, self.vocab, device=device, dtype=self.q.dtype)
        if k:
            q_carried[:, : min(k, depth)] = self.q[:, :depth]
        x_carried = self.jacobi_update(q_carried, t)  # (B, L)
        fresh = self.initial_tokens(x_carried, carried, last_tokens, t, depth)  # (B, L)
        tokens = torch.where(is_carried, x_carried, fresh)
        q_fresh = torch.nn.functional.one_hot(fresh, self.vocab).to(q_carried.dtype)  # (B, L, V)
        q = torch.where(is_carried[..., None], q_carried, q_fresh)
        valid = index[None, :] < limit[:, None]
        return Draft(tokens=tokens, q=q, valid=valid, forwards=[0] * b)

    def jacobi_update(self, q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The carried drafts: one sample from each stored distribution ``q`` (B, L, V) -> (B, L).

        Rows that hold no carried distribution (all zero) give garbage that the caller discards."""
        u = self.streams.uniform(t, JACOBI, q.shape[1])  # (B, L)
        return sample(q, u)

    def initial_tokens(self, carried_tokens: torch.Tensor, carried: torch.Tensor, last_tokens: torch.Tensor,
                       t: torch.Tensor, depth: int) -> torch.Tensor:
        """Fresh tokens (B, L) for the window slots from each image's ``carried`` count on (earlier slots
        are ignored): uniform codes, or ``repeat_horizon`` copies of the left neighbour."""
        device = last_tokens.device
        u = self.streams.uniform(t, INIT, depth)  # (B, L)
        uniform = (u * self.vocab).long().clamp_(max=self.vocab - 1)
        if self.init == "random":
            return uniform
        index = torch.arange(depth, device=device)
        fresh = index[None, :] >= carried[:, None]
        column0 = fresh & ((t[:, None] + index[None, :]) % self.width == 0)  # a fresh token at column 0 is random
        source = torch.where(column0, index[None, :], -1).cummax(1).values  # the last column-0 slot so far
        # the left anchor of the fresh run: the last carried token, or the last committed one
        anchor = torch.where(carried > 0, carried_tokens.gather(1, (carried - 1).clamp_min(0)[:, None])[:, 0],
                             last_tokens)
        return torch.where(source >= 0, uniform.gather(1, source.clamp_min(0)), anchor[:, None])

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        # p[b, i] is the distribution of the token after input i of [last, d_1..d_L]; the committed block
        # ends at p[b, n], so p[b, n+1 .. L_b] (conditioned on the rejected draft d_{n+1}) are the next
        # drafts' p_{t−1}, L_b = the image's own window (its valid drafts)
        n = verdict.num_accepted
        drafted = draft.valid.sum(-1)
        width = draft.draft_len
        index = (n[:, None] + 1 + torch.arange(width, device=p.device)).clamp(max=p.shape[1] - 1)  # (B, L)
        self.q = p.gather(1, index[..., None].expand(-1, -1, p.shape[-1]))
        self.carried = (drafted - n).clamp_min(0).tolist()
