"""A drafter that is itself an image AR model (a smaller model, or the target with layers skipped).

It decodes ``L`` tokens autoregressively with its own cache and the target's sampling pipeline, so ``q``
is processed exactly like ``p`` (CFG with the same scale, temperature, top-k, top-p). After verification
it rolls its cache back to the committed prefix and queues the committed tokens it has not yet seen.

Example: ``python run.py model=tiny decoder=sd drafter=tiny`` (layer-skip self-drafting).
"""
from __future__ import annotations

from typing import Callable

import torch

from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.sampling import sample, stream_probs
from coolsd.types import Draft, TargetOutput, Verdict


class ModelDrafter(Drafter):
    """Autoregressive drafting with a separate (cheaper) ``ImageARModel`` of the same codebook."""

    def __init__(self, target: ImageARModel, draft_model: Callable[..., ImageARModel] | ImageARModel) -> None:
        self.target = target
        self.model = draft_model if isinstance(draft_model, ImageARModel) else draft_model(target=target)
        if self.model.codebook_size != target.codebook_size:
            raise ValueError(f"draft model codebook ({self.model.codebook_size}) differs from the target's "
                             f"({target.codebook_size})")
        self.cache = None
        self.pending: list[torch.Tensor] = []  # committed tokens not yet run through the draft model
        self.next_position = 0  # image index of the first pending token
        self.block_start = 0  # cache length before the current draft's forwards

    def begin(self, prompt: str, prefill: TargetOutput, first_token: torch.Tensor) -> None:
        self.cache, _ = self.model.prefill(prompt, extra_slots=0)
        self.pending = [first_token.reshape(1)]
        self.next_position = 0

    def propose(self, last_token, position, draft_len, generator) -> Draft:
        v = self.target.codebook_size
        if draft_len == 0:
            return Draft(tokens=last_token.new_empty(0), q=torch.empty(0, v, device=last_token.device))
        self.block_start = self.cache.length
        feed = torch.cat(self.pending)
        positions = torch.arange(self.next_position, self.next_position + feed.shape[0], device=feed.device)
        tokens, qs = [], []
        for i in range(draft_len):
            out = self.model.forward_block(self.cache, feed, positions)
            q = stream_probs(out.logits[:, -1:], self.target.sampling)[0]  # (V,)
            x = sample(q, generator).reshape(1)
            tokens.append(x)
            qs.append(q)
            feed, positions = x, positions[-1:] + 1
        return Draft(tokens=torch.cat(tokens), q=torch.stack(qs), forwards=draft_len)

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        n, L = verdict.num_accepted, draft.draft_len
        committed = [draft.tokens[i : i + 1] for i in range(n)]
        committed.append(torch.tensor([verdict.next_token], device=draft.tokens.device))
        if L == 0:  # nothing was run through the draft model
            self.pending += committed
            return
        # the cache holds pending + d_1..d_{L-1}; keep pending and the accepted drafts among them
        in_cache = min(n, L - 1)
        self.next_position += len(self.pending) + in_cache
        self.cache.rollback(self.block_start + len(self.pending) + in_cache)
        self.pending = committed[in_cache:]
