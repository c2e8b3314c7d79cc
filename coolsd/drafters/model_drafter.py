"""A drafter that is itself an image AR model (a smaller model, or the target with layers skipped).

It decodes ``L`` tokens autoregressively with its own cache and the target's sampling pipeline, so ``q``
is processed exactly like ``p`` (CFG with the same scale, temperature, top-k, top-p). After verification
it rolls its cache back to the committed prefix and queues the committed tokens it has not yet seen.

Trees: ``expand`` runs the requested nodes as one block under the tree mask the shared tree-drafting code
(``coolsd.trees``) builds; after verification the tree's slots are dropped and the accepted path is fed
again with the next pending tokens.

The static decode path (``coolsd.static``, ``decoder.path=static``) runs the same drafts, q and draws with fixed
shapes and no host read, where the draft model has a static forward (``ImageARModel.static_forward``): its own
prefill (``static_prefill``, outside the decode contexts as the eager ``begin``'s, at the capacity one iteration
needs) is copied into its static cache of the batch size (``ImageARModel.static_cache``: a ``DeviceKVCache``), the
pending committed tokens live in a fixed (B, W) buffer with each image's count and first position (W = 2 for a
chain: the eager chain leaves one or two; ``depth + 1`` for a tree: the accepted path and the next token), and
``static_observe`` rolls the cache back by moving each image's length (a chain's to the length recorded after its
last kept draft, so draft models whose blocks add structural slots, Lumina-mGPT's and Emu3's, roll back alike). A
chain drafts all ``depth`` levels (those past an image's ``limit`` are invalid), a static or EAGLE-2 tree every
level of its shape (``draft_static_tree`` / ``draft_dynamic_tree`` with ``static``); over a draft model with
structural slots a tree level's mask is carried over to the model slots of the levels before it
(``RowEndKVCache.tree_mask``), and a tree's slots are dropped by the same length move.

Example: ``python run.py model=tiny decoder=sd drafter=tiny`` (layer-skip self-drafting);
``python run.py model=tiny decoder=sd decoder.path=static`` (the same drafter on the static path).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from coolsd import validate
from coolsd.drafters.base import Drafter, chain_valid, empty_draft
from coolsd.kv_cache import DeviceKVCache, padding_invariant_attention
from coolsd.models.base import ImageARModel
from coolsd.rng import DRAFT, sample
from coolsd.sampling import finite_images, stream_probs
from coolsd.trees import DraftRows, DynamicTree, Expansion, TreeShape, draft_dynamic_tree, draft_static_tree
from coolsd.types import Draft, TargetOutput, Verdict


@dataclass(frozen=True)
class StaticPending:
    """The static path's drafter state of one batch size and pending width, in buffers updated in place: the draft
    model's cache, the committed tokens it has not run yet (padded to the width W) with each image's count and the
    image position of the first, and the cache lengths after the latest feed."""

    cache: DeviceKVCache
    tokens: torch.Tensor  # (B, W)
    count: torch.Tensor  # (B,)
    start: torch.Tensor  # (B,)
    after: torch.Tensor  # (B,)
    #: (B, L) a chain's cache lengths after the feed and after each of its L − 1 draft forwards (the rollback of
    #: k accepted drafts is to column k, whatever slots the draft model's blocks hold beyond their tokens)
    marks: torch.Tensor
    columns: torch.Tensor  # (W,) 0 .. W − 1

    @classmethod
    def new(cls, cache: DeviceKVCache, width: int, depth: int) -> StaticPending:
        """Buffers for a static cache's batch (``ImageARModel.static_cache`` over the draft model's prefill)."""
        device = cache.device
        long = {"dtype": torch.long, "device": device}
        b = cache.batch
        return cls(cache=cache, tokens=torch.zeros(b, width, **long), count=torch.zeros(b, **long),
                   start=torch.zeros(b, **long), after=torch.zeros(b, **long),
                   marks=torch.zeros(b, depth, **long), columns=torch.arange(width, device=device))


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
        #: the static path: the state per (batch, pending width, capacity), the current batch's, and the draft
        #: model's prefill of the images the next ``static_begin`` or ``static_refill`` starts (``static_prefill``)
        self._static: dict[tuple[int, int, int], StaticPending] = {}
        self.static: StaticPending | None = None
        self._prefilled = None

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

    # -- the static decode path (coolsd.static): fixed shapes, the pending tokens and lengths in fixed buffers ---
    def static_reason(self, tree: TreeShape | DynamicTree | None) -> str | None:
        """Why this drafter cannot run on the static path with ``tree`` (``Drafter.static_reason``; None: it can): a
        draft model without a static forward, one whose forwards would run in another attention kernel than the
        target's (the static step runs every forward inside the target's decode context). Chains and trees run
        over every draft model with a static forward, those whose blocks add structural slots included."""
        model = type(self.model).__name__
        if not self.model.static_path:
            return f"has no static form: its draft model ({model}) has no static forward"
        mine, target = (getattr(m, "attention_kernel", None) for m in (self.model, self.target))
        if mine != target:
            return (f"has no static form: its draft model's attention kernel ({mine}) is not the target's "
                    f"({target}), in whose decode context the static step runs")
        return None

    @property
    def static_path(self) -> bool:
        return self.static_reason(None) is None

    @property
    def structural(self) -> bool:
        """Whether the draft model adds structural slots to its static blocks (its own ``static_cache``:
        Lumina-mGPT's and Emu3's end-of-row slots, a ``RowEndKVCache``)."""
        return type(self.model).static_cache is not ImageARModel.static_cache

    @staticmethod
    def static_width(depth: int, tree: TreeShape | DynamicTree | None) -> int:
        """The pending buffer's width: a chain leaves one or two committed tokens unfed (the next token, after the
        last draft when every draft was accepted), a tree the accepted path and the next token."""
        return 2 if tree is None else depth + 1

    def static_prefill(self, prompts: Sequence[str], depth: int, tree: TreeShape | DynamicTree | None) -> None:
        """The draft model's prefill of the images the next ``static_begin`` or ``static_refill`` starts, as the
        eager ``begin`` runs it (padding-invariant attention on a batch-invariant target, no decode context, no
        piecewise compiled layers), at the capacity one iteration needs beyond the image: the pending block, then
        the chain's ``depth − 1`` draft forwards or every node of the tree (with its structural slot)."""
        from coolsd.static.loop import _piecewise_off

        if isinstance(tree, TreeShape):
            nodes = len(tree.paths)
        elif tree is not None:
            nodes = tree.depth * tree.top_k
        else:
            nodes = depth - 1
        if tree is not None and self.structural:  # a level reserves a structural slot for each node
            nodes *= 2
        room = self.static_width(depth, tree) + nodes
        with _piecewise_off(self.model), padding_invariant_attention(self.target.batch_invariant):
            cache, _ = self.model.static_prefill(list(prompts), extra_slots=room)
        self._prefilled = (cache, self.static_width(depth, tree), depth)

    def _take_prefilled(self, batch: int, what: str):
        """The cache ``static_prefill`` made for ``batch`` images, the pending width and the depth (used once)."""
        prefilled, self._prefilled = self._prefilled, None
        if prefilled is None or prefilled[0].batch != batch:
            raise RuntimeError(f"ModelDrafter.{what}: the draft model was not prefilled for these {batch} image(s) "
                               "(the static loop calls static_prefill with their prompts first)")
        return prefilled

    def static_begin(self, prefill, first_tokens, streams, depth, room=None) -> None:
        """Persistent buffers for this batch size (``StaticPending``), refilled: the draft model's prefilled cache
        copied in, ``x_0`` pending at image position 0."""
        b = first_tokens.shape[0]
        cache, width, depth = self._take_prefilled(b, "static_begin")
        key = (b, width, depth, cache.max_len)
        state = self._static.get(key)
        if state is None:
            state = self._static[key] = StaticPending.new(self.model.static_cache(cache), width, depth)
        else:
            state.cache.load(cache)
        self.static = state
        self.cache = state.cache
        self.streams = streams
        self.device = first_tokens.device
        state.tokens.zero_()
        state.tokens[:, 0] = first_tokens
        state.count.fill_(1)
        state.start.zero_()
        state.after.copy_(state.cache.lengths)

    def static_refill(self, rows, prefill, first_tokens, streams, depth, room=None) -> None:
        """``static_begin`` for the images of ``rows`` only (``Drafter.static_refill``): the draft model's prefill of
        the new images copied into their cache rows, ``x_0`` pending at position 0, in the current batch's
        buffers."""
        state = self.static
        cache, width, depth = self._take_prefilled(first_tokens.shape[0], "static_refill")
        if state is None or self._static.get((state.tokens.shape[0], width, depth, cache.max_len)) is not state:
            raise RuntimeError("ModelDrafter.static_refill: no static batch of this shape is running (call "
                               "static_begin first, with the same depth and tree)")
        self.streams = streams
        state.cache.load_rows(rows, cache)
        tokens = torch.zeros(rows.shape[0], width, dtype=torch.long, device=state.tokens.device)
        tokens[:, 0] = first_tokens
        state.tokens.index_copy_(0, rows, tokens)
        state.count.index_fill_(0, rows, 1)
        state.start.index_fill_(0, rows, 0)
        state.after.index_copy_(0, rows, state.cache.lengths.index_select(0, rows))

    def _static_feed(self) -> DraftRows:
        """The fixed pending block (each image's own count; a finished image has none): the draft distribution
        after each image's last pending token (B, 1, V); the cache keeps each image's pending tokens."""
        state = self.static
        out = self.model.static_forward(self.cache, state.tokens, self._clamp(state.start[:, None] + state.columns))
        s, b, _, v = out.logits.shape
        last = (state.count - 1).clamp_min(0)
        logits = out.logits.gather(2, last.view(1, b, 1, 1).expand(s, b, 1, v))
        self.cache.keep(state.count)
        state.after.copy_(self.cache.lengths)
        return DraftRows(q=stream_probs(logits, self.target.sampling), finite=finite_images(logits))

    def _static_expand(self, request: Expansion) -> DraftRows:
        """``_expand`` of the static path: the root request feeds the fixed pending block. Over a draft model
        with structural slots (a ``RowEndKVCache``) the levels are recorded from the root on, and each level's
        mask in image units is carried over to the model slots of the levels before it
        (``RowEndKVCache.tree_mask``)."""
        slots = self.structural
        if request.root:
            rows = self._static_feed()
            if slots:
                self.cache.open_tree()
            return rows
        mask = self.cache.tree_mask(request.mask) if slots else request.mask
        out = self.model.static_forward(self.cache, request.tokens, self._clamp(request.positions), mask)
        if slots:
            self.cache.record_tree()
        return DraftRows(q=stream_probs(out.logits, self.target.sampling), finite=finite_images(out.logits))

    def static_propose(self, last_tokens, t, limit, depth, tree=None, cache=None) -> Draft:
        """The pending block, then ``depth − 1`` one-token forwards of a chain, or every level of a tree."""
        if tree is not None:
            return self.static_tree_draft(tree, t, limit, cache)
        state = self.static
        rows = self._static_feed()
        state.marks[:, 0].copy_(state.after)
        finite, q = rows.finite, rows.q[:, -1]
        u = self.streams.uniform(t, DRAFT, depth)  # (B, L)
        tokens, qs = [], []
        for i in range(depth):
            if i:
                out = self.model.static_forward(self.cache, tokens[-1][:, None], self._clamp(t - 1 + i)[:, None])
                state.marks[:, i].copy_(self.cache.lengths)
                finite = finite & finite_images(out.logits)
                q = stream_probs(out.logits, self.target.sampling)[:, -1]  # (B, V)
            tokens.append(sample(q, u[:, i]))
            qs.append(q)
        return Draft(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1), valid=chain_valid(limit, depth),
                     forwards=limit.clamp(max=depth), finite=finite)

    def static_observe(self, out, p, draft, verdict, active) -> None:
        """``observe`` by length moves: a chain keeps its accepted drafts among the ``L − 1`` it ran and leaves the
        rest of the committed tokens pending; a tree drops its slots and leaves the accepted path and the next token
        pending. A finished image keeps nothing."""
        state = self.static
        n = verdict.num_accepted  # (B,)
        width = state.tokens.shape[1]
        if draft.is_chain:
            accepted = draft.tokens
            kept = torch.where(active, n.clamp(max=draft.tokens.shape[1] - 1), 0)  # accepted drafts in the cache
            self.cache.rollback(state.marks.gather(1, kept[:, None])[:, 0])
        else:
            accepted = draft.tokens.gather(1, verdict.path[:, : width - 1])
            kept = torch.zeros_like(n)
            self.cache.rollback(state.after)
        state.start.add_(torch.where(active, state.count + kept, 0))
        committed = torch.cat([accepted, accepted[:, :1]], 1).scatter(1, n[:, None], verdict.next_token[:, None])
        columns = (kept[:, None] + state.columns).clamp(max=committed.shape[1] - 1)
        state.tokens.copy_(committed.gather(1, columns))  # the committed tokens not in the cache, then stale
        state.count.copy_(torch.where(active, n + 1 - kept, 0))
