"""A drafter that is itself an image AR model (a smaller model, or the target with layers skipped).

It decodes ``L`` tokens autoregressively with its own cache and the target's sampling pipeline, so ``q``
is processed exactly like ``p`` (CFG with the same scale, temperature, top-k, top-p). After verification
it rolls its cache back to the committed prefix and queues the committed tokens it has not yet seen.

Trees: ``expand`` runs the requested nodes as one block under the tree mask the shared tree-drafting code
(``coolsd.trees``) builds; after verification the tree's slots are dropped and the accepted path is fed
again with the next pending tokens.

Example: ``python run.py model=tiny decoder=sd drafter=tiny`` (layer-skip self-drafting).
"""
from __future__ import annotations

from typing import Callable

import torch

from coolsd import validate
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.sampling import sample, stream_probs
from coolsd.trees import Expansion, TreeShape, draft_dynamic_tree, draft_static_tree
from coolsd.types import Draft, TargetOutput, Verdict


class ModelDrafter(Drafter):
    """Autoregressive drafting with a separate (cheaper) ``ImageARModel`` of the same codebook."""

    def __init__(self, target: ImageARModel, draft_model: Callable[..., ImageARModel] | ImageARModel,
                 tree_slots: int = 256) -> None:
        """``tree_slots``: cache room beyond the image for the nodes of one draft tree (EAGLE-2: 58)."""
        self.tree_slots = validate.integer("drafter.tree_slots", tree_slots, minimum=1)
        self.target = target
        self.model = draft_model if isinstance(draft_model, ImageARModel) else draft_model(target=target)
        if self.model.codebook_size != target.codebook_size:
            raise ValueError(f"draft model codebook ({self.model.codebook_size}) differs from the target's "
                             f"({target.codebook_size})")
        self.cache = None
        self.pending: list[torch.Tensor] = []  # committed tokens not yet run through the draft model
        self.next_position = 0  # image index of the first pending token
        self.block_start = 0  # cache length before the current draft's forwards
        self.tree_mode = False  # whether the current draft was drafted as a tree

    def begin(self, prompt: str, prefill: TargetOutput, first_token: torch.Tensor) -> None:
        self.cache, _ = self.model.prefill(prompt, extra_slots=self.tree_slots)
        self.pending = [first_token.reshape(1)]
        self.next_position = 0

    def propose(self, last_token, position, draft_len, generator, tree=None) -> Draft:
        v = self.target.codebook_size
        self.tree_mode = tree is not None
        if tree is not None:
            self.block_start = self.cache.length
            if isinstance(tree, TreeShape):
                return draft_static_tree(tree, last_token, position, self._expand, generator)
            return draft_dynamic_tree(tree, draft_len, last_token, position, self._expand)
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

    def _expand(self, request: Expansion) -> torch.Tensor:
        """Draft distributions (F, V) of the children of the requested tree nodes."""
        if int(request.nodes[0]) == -1:  # the root: feed the pending committed tokens (the root is the last)
            feed = torch.cat(self.pending)
            positions = torch.arange(self.next_position, self.next_position + feed.shape[0], device=feed.device)
            out = self.model.forward_block(self.cache, feed, positions)
            return stream_probs(out.logits[:, -1:], self.target.sampling)  # (1, V)
        out = self.model.forward_block(self.cache, request.tokens, request.positions, tree_mask=request.mask)
        return stream_probs(out.logits, self.target.sampling)  # (F, V)

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        n, L = verdict.num_accepted, draft.draft_len
        if self.tree_mode:  # drop the tree's slots; the accepted path is fed again with the next token
            self.cache.rollback(self.block_start + len(self.pending))
            self.next_position += len(self.pending)
            path = verdict.path if verdict.path else tuple(range(1, n + 1))
            self.pending = [draft.tokens[j - 1 : j] for j in path]
            self.pending.append(torch.tensor([verdict.next_token], device=draft.tokens.device))
            return
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
