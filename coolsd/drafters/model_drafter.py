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
from coolsd.drafters.base import Drafter, empty_draft
from coolsd.models.base import ImageARModel
from coolsd.rng import DRAFT, sample
from coolsd.sampling import finite_images, stream_probs
from coolsd.trees import DraftRows, Expansion, TreeShape, draft_dynamic_tree, draft_static_tree
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
        self.streams = None
        self.pending: list[list[int]] = []  # per image: committed tokens not yet run through the draft model
        self.next_position: list[int] = []  # per image: image index of the first pending token
        self.after_feed: list[int] = []  # cache lengths after the pending block
        self.fed: list[int] | None = None
        self.tree_mode = False  # whether the current draft was drafted as a tree

    def begin(self, prompts, prefill: TargetOutput, first_tokens: torch.Tensor, streams) -> None:
        self.cache, _ = self.model.prefill(list(prompts), extra_slots=self.tree_slots)
        self.streams = streams
        self.device = first_tokens.device
        self.pending = [[int(x)] for x in first_tokens.tolist()]
        self.next_position = [0] * len(self.pending)
        self.fed = None

    def select(self, images) -> None:
        self.cache.select(list(images))
        self.pending = [self.pending[i] for i in images]
        self.next_position = [self.next_position[i] for i in images]

    def _feed_pending(self, device: torch.device) -> DraftRows:
        """Run every image's pending tokens as one block (padded), keep each image's own count; return the
        draft distribution after each image's last pending token (B, 1, V)."""
        counts = [len(p) for p in self.pending]
        width = max(counts)
        feed = torch.tensor([p + [p[-1]] * (width - len(p)) for p in self.pending], device=device)
        positions = torch.tensor(self.next_position, device=device)[:, None] + torch.arange(width, device=device)
        out = self.model.forward_block(self.cache, feed, self._clamp(positions))
        last = torch.tensor(counts, device=device) - 1
        logits = out.logits.gather(2, last.view(1, -1, 1, 1).expand(out.logits.shape[0], -1, 1, out.logits.shape[-1]))
        self.cache.keep(counts)
        self.fed, self.after_feed = counts, list(self.cache.lengths)
        return DraftRows(q=stream_probs(logits, self.target.sampling), finite=finite_images(logits))

    def iteration_draws(self, depth, tree):
        return ((DRAFT, depth),) if tree is None and depth else ()

    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        b = last_tokens.shape[0]
        device = last_tokens.device
        self.fed = None
        self.tree_mode = tree is not None
        if depth == 0:
            return empty_draft(b, self.target.codebook_size, device)
        if tree is not None:
            if isinstance(tree, TreeShape):
                return draft_static_tree(tree, t - 1, limit, self._expand, self.streams, t)
            return draft_dynamic_tree(tree, t - 1, limit, self._expand)
        rows = self._feed_pending(device)
        finite = rows.finite
        q = rows.q[:, -1]
        u = self.streams.uniform(t, DRAFT, depth)
        tokens, qs = [], []
        for i in range(depth):
            if i:
                out = self.model.forward_block(self.cache, tokens[-1][:, None], self._clamp(t - 1 + i)[:, None])
                finite = finite & finite_images(out.logits)
                q = stream_probs(out.logits, self.target.sampling)[:, -1]  # (B, V)
            tokens.append(sample(q, u[:, i]))
            qs.append(q)
        valid = torch.arange(depth, device=device)[None, :] < limit[:, None]
        return Draft(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1), valid=valid,
                     forwards=limit.clamp(max=depth).tolist(), finite=finite)

    def _expand(self, request: Expansion) -> DraftRows:
        """Draft distributions (B, F, V) of the children of the requested tree nodes."""
        if request.root:  # feed the pending committed tokens (the root is the last)
            return self._feed_pending(self.device)
        out = self.model.forward_block(self.cache, request.tokens, self._clamp(request.positions),
                                       tree_mask=request.mask)
        return DraftRows(q=stream_probs(out.logits, self.target.sampling), finite=finite_images(out.logits))

    def _clamp(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions past the image (padding nodes of images whose drafts stop earlier) are clamped; their
        outputs are never used."""
        return positions.clamp(max=self.target.num_image_tokens - 1)

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        n = verdict.num_accepted.tolist()
        path = verdict.path.tolist()
        drafted = draft.tokens.tolist()
        nxt = verdict.next_token.tolist()
        committed = [[drafted[i][j] for j in path[i][: n[i]]] + [nxt[i]] for i in range(len(n))]
        if self.fed is None:  # nothing was run through the draft model
            for i, c in enumerate(committed):
                self.pending[i] += c
            return
        self.next_position = [pos + k for pos, k in zip(self.next_position, self.fed)]
        if self.tree_mode:  # drop the tree's slots; the accepted path is fed again with the next token
            self.cache.rollback(self.after_feed)
            self.pending = committed
            return
        # the cache holds pending + d_1..d_{L-1}; keep the accepted drafts among them
        forwarded = draft.draft_len - 1
        in_cache = [min(k, forwarded) for k in n]
        self.cache.rollback([a + k for a, k in zip(self.after_feed, in_cache)])
        self.next_position = [pos + k for pos, k in zip(self.next_position, in_cache)]
        self.pending = [c[k:] for c, k in zip(committed, in_cache)]

