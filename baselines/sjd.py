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

from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.sampling import sample
from coolsd.types import Draft, TargetOutput, Verdict

INITS = ("auto", "random", "repeat_horizon")


class JacobiDrafter(Drafter):
    """The Jacobi window of SJD: drafts are last iteration's samples plus freshly initialised tokens."""

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
        self.committed: torch.Tensor | None = None  # (N,) committed image tokens, valid up to `length`
        self.length = 0
        self.q: torch.Tensor | None = None  # (K, V) p_{t−1} at the K positions after the last committed token

    def begin(self, prompt: str, prefill: TargetOutput, first_token: torch.Tensor) -> None:
        device = first_token.device
        self.committed = torch.empty(self.target.num_image_tokens, dtype=torch.long, device=device)
        self.committed[0] = first_token
        self.length = 1
        self.q = torch.empty(0, self.vocab, device=device)

    def propose(self, last_token, position, draft_len, generator, tree=None) -> Draft:
        if tree is not None:
            raise ValueError("SJD drafts a Jacobi window (a chain); remove decoder.tree for decoder=sjd")
        if position != self.length - 1:
            raise RuntimeError(f"JacobiDrafter holds {self.length} committed tokens but was asked to draft "
                               f"after image index {position}; call begin() for every new image")
        carried = min(int(self.q.shape[0]), draft_len)
        q_carried = self.q[:carried]  # (K, V)
        x_carried = self.jacobi_update(q_carried, generator)  # (K,)
        fresh = self.initial_tokens(x_carried, position, draft_len - carried, generator)  # (L - K,)
        q_fresh = torch.nn.functional.one_hot(fresh, self.vocab).to(q_carried.dtype)  # (L - K, V)
        return Draft(tokens=torch.cat([x_carried, fresh]), q=torch.cat([q_carried, q_fresh]), forwards=0)

    def jacobi_update(self, q: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The carried drafts: one sample from each stored distribution ``q`` (K, V) -> (K,)."""
        if q.shape[0] == 0:
            return torch.empty(0, dtype=torch.long, device=q.device)
        return sample(q, generator)

    def initial_tokens(self, carried: torch.Tensor, position: int, count: int,
                       generator: torch.Generator | None) -> torch.Tensor:
        """``count`` fresh tokens for image indices ``position + 1 + len(carried)`` on -> (count,)."""
        device = self.committed.device
        uniform = torch.randint(self.vocab, (count,), generator=generator, device=device)  # (count,)
        if self.init == "random" or count == 0:
            return uniform
        first = position + 1 + int(carried.shape[0])  # image index of the first fresh token
        left = carried[-1] if carried.shape[0] else self.committed[position]
        tokens = []
        for k in range(count):
            token = uniform[k] if (first + k) % self.width == 0 else left
            tokens.append(token)
            left = token
        return torch.stack(tokens)

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        n, L = verdict.num_accepted, draft.draft_len
        self.committed[self.length : self.length + n] = draft.tokens[:n]
        self.committed[self.length + n] = verdict.next_token
        self.length += n + 1
        # p[i] is the distribution of the token after input i of [last, d_1..d_L]; the committed block ends
        # at p[n], so p[n+1..L] (conditioned on the rejected draft d_{n+1}) are the next drafts' p_{t−1}
        self.q = p[n + 1 : L + 1]
