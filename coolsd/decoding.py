"""The decoding loop every decoder runs (AR, SD, LANTERN, LANTERN++, COOL-SD, the Jacobi family, ZipAR, PJD, VVS),
for a batch of images at once: the papers' eager path (``decoder.path=eager``), and the entry to the static path.

A decoder is a drafter + an acceptance rule + a draft length (and optionally a tree, a verifier, a generation
order or round hooks: ``docs/extending.md``). Which kind of round it runs is decided once, when it is built
(``Decoder._round``): plain AR to the end of the image, a whole image in a spatial generation order, one forward
of a dynamic order, or the speculative iteration; nothing in a round branches on the method's name. Per
speculative iteration (the algorithm box of speculative sampling, Leviathan et al. 2023; loop shape after Hugging
Face ``generation/utils.py: _assisted_decoding`` and gpt-fast ``generate.py: speculative_decode``):

1. draft   — the drafter proposes up to ``L`` tokens per image with their draft distributions ``q``;
2. verify  — one target forward over ``[last committed token, x_1..x_L]`` of every image gives ``p``;
3. accept/resample — the rule accepts a prefix (a path) of ``n_b`` drafts of image ``b`` and draws one more;
4. commit  — append ``n_b + 1`` tokens per image, keep their KV entries, drop the rest;
5. observe — the drafter sees the verified block and updates its own state.

Every image of a batch runs the same algorithm as alone (``docs/algorithms.md``, "Batched decoding"): its own
acceptance, positions and cache length; images that finish leave the batch. All randomness comes from per-image
counter-based streams (``coolsd.rng``) keyed by the image's seed and position, so an image depends only on its
prompt, seed and config, not on the batch. ``generate`` is the same loop with a batch of one.

``draft_len = 0`` with the null drafter is plain autoregressive decoding (the speedup denominator).

A decoder that changes what a round does overrides the round hooks (``plan_skips``, ``block_prefix``,
``end_round``, ``unverified_round``, ``begin_rounds``, ``select_rounds``; the defaults are the plain round): VVS
(``baselines/vvs.py``) lets some images commit a draft path without a target forward and feeds those tokens to
the target before its next block, untested; the objects its hooks return are its own.

``decoder.path=static`` hands every batch to ``coolsd.static`` (fixed shapes on the device, compiled or captured;
the same tokens in float32 on the embedded model); with ``decoder.refill=true`` a list of prompts is decoded there
as a queue (``generate_stream``): a row whose image finishes takes the next prompt instead of idling.

Example: ``python run.py decoder=sd decoder.draft_len=4``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from coolsd import validate
from coolsd.acceptance import AcceptanceRule, summed_tv, verify_chain, verify_tree
from coolsd.drafters.base import Drafter, NullDrafter
from coolsd.kv_cache import padding_invariant_attention, swap_remove
from coolsd.models.base import ImageARModel
from coolsd.rng import ACCEPT, SAMPLE, Streams, sample
from coolsd.sampling import finite_images
from coolsd.trees import DynamicTree, TreeShape, ancestor_mask, ancestor_masks, depths_of, resolve_tree
from coolsd.types import Draft, Generation, StatsRecorder, TargetOutput, Verdict


#: ``decoder.path``: the papers' eager loop, or the static path (``coolsd.static``)
PATHS = ("eager", "static")


@dataclass
class Batch:
    """The eager loop's state between rounds: the cache and tokens of the images still decoding, their committed
    counts ``t`` (host) and original indices ``rows``, their streams, the statistics of every image of the batch
    (``recs``, by original index) and of its phases, the names that error messages give, and a dynamic order's
    state."""

    cache: Any
    tokens: torch.Tensor  # (B, N + room)
    t: list[int]
    rows: list[int]
    streams: Streams
    recs: list[StatsRecorder]
    phases: StatsRecorder
    labels: list
    prompts: list[str]
    seeds: list[int]
    state: Any = None

    def names(self) -> tuple[list, list[str], list[int]]:
        """(labels, prompts, seeds) of the images still decoding, in batch order (for ``Decoder._check``)."""
        return ([self.labels[r] for r in self.rows], [self.prompts[r] for r in self.rows],
                [self.seeds[r] for r in self.rows])

    def select(self, keep: list[int]) -> None:
        """Keep the listed images (positions in the batch), in order (the decoder's own state is selected by
        the loop)."""
        if keep:
            index = torch.tensor(keep, device=self.tokens.device)
            self.cache.select(keep)
            self.streams.select(index)
            self.tokens = self.tokens[index]
            if self.state is not None:
                self.state.select(keep, index)
        self.t = [self.t[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]


class NonFiniteError(FloatingPointError):
    """A model produced NaN or infinite logits; the message names the model, decoder, image and position."""


class Decoder:
    """A decoding method: ``drafter`` proposes, ``rule`` accepts, ``draft_len`` tokens per iteration."""

    def __init__(
        self,
        name: str,
        model: ImageARModel,
        rule: AcceptanceRule,
        draft_len: int = 0,
        drafter: Callable[..., Drafter] | Drafter | None = None,
        tree: str | None = None,
        dynamic_tree: dict | None = None,
        track_tv: bool = True,
        sync_phases: bool = False,
        order: Callable[..., Any] | Any | None = None,
        verifier: Callable[..., Verdict] | None = None,
        path: str = "eager",
        refill: bool = False,
    ) -> None:
        validate.decoder_options(name=name, draft_len=draft_len, tree=tree, dynamic_tree=dynamic_tree,
                                 track_tv=track_tv, sync_phases=sync_phases)
        if draft_len < 0:
            raise ValueError(f"decoder.draft_len must be >= 0, got {draft_len}")
        if draft_len > 0 and drafter is None:
            raise ValueError(f"decoder {name!r} has draft_len={draft_len} but no drafter; set decoder.drafter")
        self.name = name
        self.model = model
        self.rule = rule
        self.draft_len = draft_len
        if drafter is None:
            drafter = NullDrafter()
        self.drafter = drafter if isinstance(drafter, Drafter) else drafter(target=model)
        self.tree: TreeShape | DynamicTree | None = resolve_tree(tree, dynamic_tree)
        if self.tree is not None and isinstance(self.drafter, NullDrafter):
            raise ValueError(f"decoder {name!r} has decoder.tree={tree} but no drafter")
        if self.tree is not None and not self.drafter.drafts_trees:
            raise ValueError(f"decoder {name!r} has decoder.tree={tree}, but its drafter "
                             f"({type(self.drafter).__name__}) drafts chains only; remove decoder.tree "
                             "(decoder.tree=null)")
        if isinstance(self.tree, TreeShape):
            self.max_depth, self.max_nodes = self.tree.depth, len(self.tree.paths)
            parents = self.tree.parents()
            self._static_mask = ancestor_mask(parents)  # (M+1, M+1), the same for every image
            self._static_depth = [0] + depths_of(parents)  # node depths, the root's 0 first
        elif isinstance(self.tree, DynamicTree):
            self.max_depth, self.max_nodes = self.tree.depth + 1, self.tree.total_tokens
        else:
            self.max_depth, self.max_nodes = self.drafter.block_shape(draft_len)
        self.plain_ar = self.max_depth == 0 and isinstance(self.drafter, NullDrafter)
        self.max_commit = self.max_depth + 1  # the most tokens one forward commits per image
        self.order = None  # a generation order other than raster (coolsd.orders), run by ``_order_round``
        if order is not None:
            if not self.plain_ar:
                raise ValueError(f"decoder {name!r} has decoder.order, which decodes without drafts: set "
                                 "decoder.draft_len=0 and decoder.drafter=null")
            if not getattr(model, "spatial_orders", False):
                raise ValueError(f"decoder {name!r} (decoder.order) does not run on {type(model).__name__}: "
                                 "spatial orders are wired for the LlamaGen adapters, Janus-Pro and Lumina-mGPT; "
                                 "pick another model or decoder")
            self.order = order(grid=model.grid) if callable(order) else order
            self.max_nodes = self.order.max_feeds  # cache room for one forward's inputs
            self.max_commit = getattr(self.order, "max_commit", self.order.rows)
        #: an order whose forwards depend on each image's acceptances (``order.iteration``), else a static schedule
        self.dynamic_order = bool(getattr(self.order, "dynamic", False))
        self._order_plans: dict[torch.device, list[tuple]] = {}
        self.track_tv = track_tv
        self.sync_phases = sync_phases and model.device.type == "cuda"
        #: cache room for committed tokens fed before a block (``block_prefix``; a skipped round's tokens)
        self.prefix_room = 0
        #: the verification of chain drafts (``verify_chain``'s signature; None: ``verify_chain``), e.g. SJD-SV's
        #: subsequence test (``baselines.sv``); a joint test without an analytic one-step TV sets ``analytic_tv``
        self.verifier = verifier
        self.tv_measured = bool(getattr(verifier, "analytic_tv", True))
        #: whether the verifier also verifies the drafter's own trees (PathRelax's paths), not chains only
        self.verifies_trees = bool(getattr(verifier, "verifies_trees", False))
        if verifier is not None and (self.tree is not None or (self.max_depth != self.max_nodes
                                                               and not self.verifies_trees)):
            raise ValueError(self._tree_refusal())
        #: the eager loop's round, chosen once: plain AR to the end of the image, a whole image in a spatial order,
        #: one forward of a dynamic order, or the speculative iteration
        self._round = (self._dynamic_order_round if self.dynamic_order else self._order_round if self.order
                       is not None else self._ar_round if self.plain_ar else self._iteration)
        #: ``decoder.path``: ``eager`` (this loop, the papers' setting) or ``static`` (``coolsd.static``: fixed
        #: shapes on the device, compiled or captured), chosen once here
        self.path = validate.choice("decoder.path", path, PATHS)
        #: whether a subclass changes what a round does (the round hooks below: verification skipping)
        self.changes_rounds = any(getattr(type(self), hook) is not getattr(Decoder, hook)
                                  for hook in ("plan_skips", "block_prefix", "end_round"))
        #: ``decoder.refill``: on the static path, a finished image's row takes the next prompt of the list
        #: (``generate_stream``) instead of idling in the fixed-shape step until its batch's slowest image ends
        self.refill = validate.boolean("decoder.refill", refill)
        if refill and path == "eager":
            raise ValueError(f"decoder {name!r}: decoder.refill=true needs decoder.path=static (the eager loop "
                             "already drops finished images from its batch); set decoder.path=static or "
                             "decoder.refill=false")
        if refill and not self.plain_ar and self.drafter.static_path and not self.drafter.static_refills:
            raise ValueError(f"decoder {name!r}: decoder.refill=true, but its drafter "
                             f"({type(self.drafter).__name__}) cannot restart chosen rows of a static batch (no "
                             "static_refill); set decoder.refill=false")
        self.static = None
        #: the wall time of the latest ``generate_stream`` (diagnostics excluded): its images per second's denominator
        self.stream_s: float | None = None
        if path == "static":
            from coolsd.static import StaticLoop

            self.static = StaticLoop(self)

    def _tree_refusal(self) -> str:
        option = getattr(self.verifier, "option", "decoder.verifier")
        return (f"decoder {self.name!r} has {option} ({type(self.verifier).__name__}), which verifies chain drafts "
                f"only, but it drafts a tree: turn {option} off or draft a chain (decoder.tree=null; a Jacobi "
                "window: decoder.drafter.tree_width=1)")

    def _clock(self) -> float:
        if self.sync_phases:
            torch.cuda.synchronize()
        return time.perf_counter()

    def generate(self, prompt: str, seed: int, label: object = None) -> Generation:
        """Generate one image for ``prompt``; all randomness comes from the stream of ``seed``."""
        return self.generate_batch([prompt], [seed], labels=None if label is None else [label])[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[str], seeds: Sequence[int],
                       labels: Sequence[object] | None = None) -> list[Generation]:
        """Generate one image per prompt, all in one batch; image ``b`` depends only on ``prompts[b]``,
        ``seeds[b]`` and the config. ``labels`` name the images in error messages (e.g. prompt indices).

        Statistics are per image; ``latency_s`` is the wall time from the start of the batch to the image's
        last token (minus diagnostics), the phase times are the batch's until then.
        """
        model = self.model
        b = len(prompts)
        if b == 0:
            return []
        if len(seeds) != b:
            raise ValueError(f"{b} prompts but {len(seeds)} seeds")
        labels = list(labels) if labels is not None else list(range(b))
        if self.static is not None:
            return self.static.generate_batch(prompts, seeds, labels)
        n_tokens = model.num_image_tokens
        device = model.device
        streams = Streams(seeds, device)
        recs = [StatsRecorder(max_accept=self.max_commit, tv_measured=self.tv_measured) for _ in range(b)]
        phases = StatsRecorder(max_accept=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()

        cache, out = model.prefill(list(prompts), extra_slots=self.max_nodes + 1 + self.prefix_room,
                                   streams=streams)
        self._check(finite_images(out.logits).tolist(), "target", labels, prompts, seeds, [0] * b)
        tokens = torch.zeros(b, n_tokens + self.max_nodes + 2, dtype=torch.long, device=device)  # room to write
        zero = torch.zeros(b, dtype=torch.long, device=device)
        tokens[:, 0] = sample(model.probs(out)[:, -1], streams.uniform(zero, SAMPLE, 1)[:, 0])
        for rec in recs:
            rec.target_forwards += 1
        with padding_invariant_attention(model.batch_invariant and (self.dynamic_order or not self.plain_ar)):
            self.drafter.begin(list(prompts), out, tokens[:, 0], streams)  # (bits batch-independent)
            self.begin_rounds(b)
            batch = Batch(cache=cache, tokens=tokens, t=[1] * b, rows=list(range(b)), streams=streams, recs=recs,
                          phases=phases, labels=labels, prompts=list(prompts), seeds=list(seeds),
                          state=self.order.begin(b, model.codebook_size, device) if self.dynamic_order else None)
            done: dict[int, Generation] = {}
            now = self._clock()
            phases.prefill_s = now - start

            while batch.rows:
                now = self._round(batch, now)  # the decoder's round, chosen when it was built
                finished = [i for i, ti in enumerate(batch.t) if ti >= n_tokens]
                if not finished:
                    continue
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start - phases.diagnostics_s
                for i in finished:
                    r = batch.rows[i]
                    rec = recs[r]
                    for phase in ("prefill_s", "draft_s", "verify_s", "accept_s", "observe_s", "diagnostics_s"):
                        setattr(rec, phase, getattr(phases, phase))
                    done[r] = Generation(tokens=batch.tokens[i, :n_tokens].clone(),
                                         stats=rec.freeze(n_tokens, elapsed, b))
                keep = swap_remove(len(batch.t), finished)  # the last images take the finished ones' places
                if keep:
                    self.drafter.select(keep)
                    self.select_rounds(keep)
                batch.select(keep)
            return [done[r] for r in range(b)]

    @torch.inference_mode()
    def generate_stream(self, prompts: Sequence[str], seeds: Sequence[int], labels: Sequence[object] | None = None,
                        width: int = 1) -> list[Generation]:
        """Generate one image per prompt, at most ``width`` at a time; the images and their statistics are
        ``generate_batch``'s, in prompt order. With ``decoder.refill`` (static path) a row whose image finishes takes
        the next prompt at once (``coolsd.static.StaticLoop.generate_stream``: each image's ``latency_s`` runs from
        its own prefill to its last token); otherwise consecutive lock-step batches of ``width``
        (``generate_batch``). ``stream_s`` then holds the wall time of the whole list (diagnostics excluded).

        Example: ``decoder.generate_stream(prompts, list(range(len(prompts))), width=16)``."""
        k = len(prompts)
        if len(seeds) != k:
            raise ValueError(f"{k} prompts but {len(seeds)} seeds")
        validate.integer("width", width, minimum=1)
        labels = list(labels) if labels is not None else list(range(k))
        if self.refill and self.static is not None:
            gens = self.static.generate_stream(list(prompts), list(seeds), labels, width)
            self.stream_s = self.static.stream_s
            return gens
        from coolsd.static.loop import lock_step_batches

        gens, self.stream_s = lock_step_batches(self.generate_batch, list(prompts), list(seeds), labels, width)
        return gens

    def _check(self, finite: list[bool], source: str, labels, prompts, seeds, positions: list[int]) -> None:
        """Raise ``NonFiniteError`` for the first image whose ``source`` logits were not finite."""
        for i, ok in enumerate(finite):
            if not ok:
                model = type(self.model).__name__ if source == "target" else type(self.drafter).__name__
                raise NonFiniteError(
                    f"non-finite (NaN or infinite) logits from the {source} ({model}) while decoding with "
                    f"decoder {self.name!r}: image {labels[i]} (prompt {prompts[i]!r}, seed {seeds[i]}) at image "
                    f"position {positions[i]}; check the model weights and dtype (model.dtype) before rerunning")

    def _ar_round(self, batch: Batch, now: float) -> float:
        """Plain AR to the end of the image, every image in step: forward the last token, draw the next.

        The same draws as the general loop with empty drafts (the sample of ``p`` keyed at each position),
        but the tokens stay on the device and finiteness is checked once at the end: no host sync per token
        (LlamaGen's own ``generate`` has none either), so this is the AR baseline of the published speedups.
        """
        model = self.model
        cache, tokens, streams, phases = batch.cache, batch.tokens, batch.streams, batch.phases
        b = tokens.shape[0]
        n_tokens = model.num_image_tokens
        device = tokens.device
        t = batch.t[0]
        batch.t = [n_tokens] * b
        for r in batch.rows:
            batch.recs[r].hist[0] += n_tokens - t
            batch.recs[r].iterations += n_tokens - t
            batch.recs[r].target_forwards += n_tokens - t
        if t >= n_tokens:
            return now
        # every SAMPLE uniform of the image at once: draw 0 at positions t..N−1 (uniform_grid = uniform per column)
        u = streams.uniform_grid(torch.arange(t, n_tokens, device=device).expand(b, -1), SAMPLE, 1)  # (B, N−t, 1)
        finite = []  # per position: (B,) whether every logit of each image was finite
        for pos in range(t, n_tokens):
            position = torch.full((b, 1), pos - 1, dtype=torch.long, device=device)
            out = model.forward_block(cache, tokens[:, pos - 1 : pos], position)
            finite.append(finite_images(out.logits))
            p = model.probs(out)[:, 0]  # (B, V)
            t2 = self._clock()
            tokens[:, pos] = sample(p, u[:, pos - t, 0])
            cache.keep(1)
            t3 = self._clock()
            phases.verify_s += t2 - now
            phases.accept_s += t3 - t2
            now = t3
        ok = torch.stack(finite, 1)  # (B, N − t)
        first = torch.where(ok.all(1), n_tokens, (~ok).long().argmax(1) + t).tolist()  # first non-finite position
        self._check([f == n_tokens for f in first], "target", *batch.names(), first)
        return now

    def _order_plan(self, device: torch.device) -> list[tuple]:
        """The order's schedule as device tensors, built once per device: per forward (the input cells (1, T),
        the source cells, the (T, K) visibility or None, the sampled feeds' indices, the block indices kept in
        the cache or None for all, the offset of its output cells in the image's sampled cells)."""
        if device not in self._order_plans:
            plan, offset, slots = [], 0, 0
            for step in self.order.schedule():
                feeds, outs = step.feeds, step.outputs
                kept = [i for i, f in enumerate(feeds) if f.keep]
                visible = step.visible
                stand_ins = [i for i, f in enumerate(feeds) if not f.keep and f.source != f.cell]
                if stand_ins and self.model.stand_in_is_end_of_row:  # hide a stand-in from its end of row (the
                    t = len(feeds)  # adapter's token after it, whose output is the query's)
                    visible = torch.ones(t, slots + t, dtype=torch.bool).tril(slots) if visible is None \
                        else visible.clone()
                    for i in stand_ins:
                        visible[i, slots + i] = False
                slots += len(kept)
                plan.append((torch.tensor([[f.cell for f in feeds]], device=device), [f.source for f in feeds],
                             None if visible is None else visible.to(device), outs,
                             None if len(kept) == len(feeds) else (len(kept), torch.tensor([kept], device=device)),
                             offset))
                offset += len(outs)
            self._order_plans[device] = plan
        return self._order_plans[device]

    def _order_round(self, batch: Batch, now: float) -> float:
        """A whole image in the generation order of ``self.order`` (``coolsd.orders``), every image in step:
        each forward feeds its inputs at their grid cells with the order's attention mask and samples the cells
        it names, each from its own SAMPLE draw keyed by the cell (the draw plain AR takes there); the tokens stay
        on the device and finiteness is checked at the end, as in ``_ar_round``."""
        model = self.model
        cache, tokens, streams, phases = batch.cache, batch.tokens, batch.streams, batch.phases
        b = tokens.shape[0]
        device = tokens.device
        plan = self._order_plan(device)
        out_cells = [self.order.schedule()[i].feeds[j].out for i in range(len(plan)) for j in plan[i][3]]
        u = streams.uniform_grid(torch.tensor(out_cells, device=device).expand(b, -1), SAMPLE, 1)[..., 0]
        finite, committed = [], []
        for (cells, sources, visible, outs, kept, offset), step in zip(plan, self.order.schedule()):
            out = model.forward_block(cache, tokens[:, sources], cells.expand(b, -1), visible)
            finite.append(finite_images(out.logits))
            p = model.probs(out)[:, outs]  # (B, A, V)
            t2 = self._clock()
            cols = [step.feeds[i].out for i in outs]
            tokens[:, cols] = sample(p, u[:, offset: offset + len(outs)])
            if kept is None:
                cache.keep(len(sources))
            else:
                cache.keep(kept[0], kept[1].expand(b, -1))
            t3 = self._clock()
            phases.verify_s += t2 - now
            phases.accept_s += t3 - t2
            now = t3
            committed.append(len(outs))
        ok = torch.stack(finite, 1)  # (B, forwards)
        first = torch.where(ok.all(1), -1, (~ok).long().argmax(1)).tolist()  # the first non-finite forward
        self._check([f < 0 for f in first], "target", *batch.names(),
                    [0 if f < 0 else plan[f][0][0, 0].item() for f in first])
        for r in batch.rows:
            for k in committed:
                batch.recs[r].iteration(k)
        batch.t = [model.num_image_tokens] * b
        return now

    def _dynamic_order_round(self, batch: Batch, now: float) -> float:
        """One forward of a dynamic order (``order.iteration``: its inputs, verification and commits for every
        image, one host sync); updates ``batch.t`` (committed tokens per image) in place."""
        committed, finite = self.order.iteration(self.model, self.rule, batch.cache, batch.tokens, batch.streams,
                                                 batch.state)
        self._check(finite, "target", *batch.names(), batch.t)
        for i, r in enumerate(batch.rows):
            batch.recs[r].iteration(committed[i])
            batch.t[i] += committed[i]
        end = self._clock()
        batch.phases.verify_s += end - now
        return end

    def _iteration(self, batch: Batch, now: float) -> float:
        """One speculative iteration for every image in the batch; updates ``batch.t`` and ``batch.tokens`` in
        place.

        Index tensors are built from the host lists (``t``, and ``n`` after the one host sync) in single calls."""
        model, rule = self.model, self.rule
        cache, tokens, t, streams, recs, phases = batch.cache, batch.tokens, batch.t, batch.streams, batch.recs, \
            batch.phases
        labels, prompts, seeds, rows = batch.labels, batch.prompts, batch.seeds, batch.rows
        device = tokens.device
        b = len(t)
        n_tokens = model.num_image_tokens
        limits = [min(self.max_depth, n_tokens - ti - 1) for ti in t]  # drafts that still fit in each image
        depth = max(limits)
        t_dev = torch.tensor(t, device=device)
        limit = torch.tensor(limits, device=device)
        images = list(range(b))
        last = tokens[images, [ti - 1 for ti in t]]  # (B,)
        # 1. draft
        tree = self.tree
        if isinstance(tree, TreeShape) and depth < self.max_depth:
            tree = tree.truncated(depth)
        # every uniform of the iteration in one call: the drafter's draws, ACCEPT 0..M−1 and SAMPLE 0 (the
        # drafter's are served from it by ``streams.uniform`` at ``t_dev``; values as if drawn one by one)
        tree = tree if depth else None
        drafter_draws = self.drafter.iteration_draws(depth, tree)
        u_all = streams.prefetch(t_dev, *drafter_draws, (ACCEPT, self.max_nodes), (SAMPLE, 1))
        draft = self.drafter.propose(last, t_dev, limit, depth, tree=tree)
        skips = self.plan_skips(draft, t, t_dev, streams)  # images that commit without the target (None: none)
        t1 = self._clock()
        if skips is not None and all(skips.images):
            return self.unverified_round(batch, draft, skips, now, t1)
        # 2. verify: the last committed token and the drafts; a tree uses per-node positions and its
        #    ancestor mask (node at depth d sits at image position t - 1 + d)
        inputs = torch.cat([last[:, None], draft.tokens], dim=1)  # (B, M+1)
        m = draft.draft_len
        if draft.is_chain or isinstance(self.tree, TreeShape):
            offsets = range(m + 1) if draft.is_chain else self._static_depth[: m + 1]
            positions = torch.tensor([[min(ti - 1 + d, n_tokens - 1) for d in offsets] for ti in t],
                                     device=device)  # (B, M+1); invalid nodes clamped
            tree_mask = None if draft.is_chain else self._static_mask[: m + 1, : m + 1].to(device)
        else:
            tree_mask = ancestor_masks(draft.parents)
            offsets = tree_mask.sum(-1) - 1  # a node's depth = its number of proper ancestors
            positions = (t_dev[:, None] - 1 + offsets).clamp(max=n_tokens - 1)  # (B, M+1)
        prefix = self.block_prefix(tokens, t)  # committed tokens the target has not run yet (None: none)
        before = None
        if prefix is not None:
            inputs, positions, tree_mask = prefix.prepend(inputs, positions, tree_mask)
        out = model.forward_block(cache, inputs, positions, tree_mask)
        if prefix is not None:
            before, out = prefix.split(out)
        p = model.probs(out)  # (B, M+1, V)
        t2 = self._clock()
        # 3. accept / resample, with each image's own uniforms (ACCEPT draws 0..m−1 and SAMPLE draw 0, one call)
        if m > self.max_nodes:
            raise RuntimeError(f"{type(self.drafter).__name__} drafted {m} nodes, more than its block shape's "
                               f"{self.max_nodes}")
        a0 = sum(count for _, count in drafter_draws)
        u_accept, u_sample = u_all[:, a0: a0 + m], u_all[:, a0 + self.max_nodes]
        if not draft.is_chain and self.verifier is not None and not self.verifies_trees:
            raise ValueError(self._tree_refusal())
        verify = (self.verifier or verify_chain) if draft.is_chain or self.verifies_trees else verify_tree
        verdict = verify(rule, p, draft, u_accept, u_sample)
        seen = out  # what the drafter reads: the target's output, the skipping images' features in their rows
        if skips is not None:
            verdict, seen = skips.merge(verdict, out)
        flags = [verdict.num_accepted, finite_images(out.logits)]  # stack promotes the bools to int64
        if draft.finite is not None:
            flags.append(draft.finite)
        forwards = draft.forwards
        if isinstance(forwards, torch.Tensor):
            flags.append(forwards)
        host = torch.stack(flags).tolist()  # the iteration's one host sync
        n = host[0]
        if isinstance(forwards, torch.Tensor):
            forwards = host[-1]
        self._check([bool(x) for x in host[1]], "target", [labels[r] for r in rows], [prompts[r] for r in rows],
                    [seeds[r] for r in rows], t)
        if draft.finite is not None:
            self._check([bool(x) for x in host[2]], "drafter", [labels[r] for r in rows],
                        [prompts[r] for r in rows], [seeds[r] for r in rows], t)
        verdict = dataclasses.replace(verdict, accepted=tuple(n))
        t3 = self._clock()
        # 4. commit: the accepted path and the next token; keep (and compact) the path's KV entries
        self._write_tokens(tokens, t, draft, verdict, n)
        kept = [x + 1 for x in n]
        index = None if draft.is_chain else \
            torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), verdict.path + 1], 1)
        if prefix is not None:
            kept, index = prefix.keep(kept, index)
        if skips is not None:  # a skipping image ran no token of its own through the target
            kept = [0 if s else k for k, s in zip(kept, skips.images)]
        cache.keep(kept, index)
        # 5. observe
        self.drafter.observe(seen, p, draft, verdict)
        diagnostics = self.end_round(out, before, p, draft, verdict, skips, prefix, t, rows, recs)
        t4 = self._clock()
        # diagnostics (not part of the method's latency): the exact one-step TV of the tests made
        if self.track_tv:
            tv, count = summed_tv(rule, verdict)
            tv, count = tv.tolist(), count.tolist()
        else:
            tv, count = [0.0] * b, [0] * b
        t5 = self._clock()
        for i, r in enumerate(rows):
            if skips is not None and skips.images[i]:
                recs[r].unverified(n[i] + 1)
            else:
                recs[r].iteration(n[i] + 1, tv[i], count[i])
            recs[r].drafter_forwards += forwards[i]
            t[i] += n[i] + 1
        phases.diagnostics_s += t5 - t4 + diagnostics
        phases.draft_s += t1 - now
        phases.verify_s += t2 - t1
        phases.accept_s += t3 - t2
        phases.observe_s += t4 - t3 - diagnostics
        return t5

    def _write_tokens(self, tokens: torch.Tensor, t: list[int], draft: Draft, verdict: Verdict, n: list[int]) -> None:
        """Commit every image's accepted path and next token at its positions ``t_b ..`` (step 4)."""
        images = list(range(len(t)))
        width = verdict.path.shape[1]
        if width:  # garbage past n is overwritten; a chain's path is 0..m−1
            accepted = draft.tokens if draft.is_chain else draft.tokens.gather(1, verdict.path)
            tokens[[[i] for i in images], [[ti + j for j in range(width)] for ti in t]] = accepted
        tokens[images, [ti + ni for ti, ni in zip(t, n)]] = verdict.next_token

    # -- hooks of a decoder that changes what a round does (verification skipping: baselines/vvs.py); the
    #    defaults are the plain round ------------------------------------------------------------------------
    def begin_rounds(self, batch: int) -> None:
        """A new batch of ``batch`` images starts (after the prefill and the drafter's ``begin``)."""

    def select_rounds(self, images: list[int]) -> None:
        """Keep the per-image state of the listed images (positions in the current batch), in order."""

    def plan_skips(self, draft: Draft, t: list[int], t_dev: torch.Tensor, streams: Streams) -> Any:
        """After the draft: the images that commit this round without a target forward, or None (every image is
        verified). ``t`` (host) and ``t_dev`` are the images' first uncommitted positions. The object returned
        has ``images`` (host bools, one per image) and ``merge(verdict, out) -> (verdict, out the drafter
        reads)``, which puts the skipping images' commits in place of the verification's; when every image
        skips, ``unverified_round`` runs instead of the verification."""
        return None

    def block_prefix(self, tokens: torch.Tensor, t: list[int]) -> Any:
        """Committed tokens to run through the target before each image's block, or None. The object returned
        has ``prepend(inputs, positions, tree_mask)`` (the longer block, its positions and mask), ``split(out)``
        (the outputs over the prefix and over the block) and ``keep(kept, index)`` (the cache's ``keep``
        arguments with the prefix's tokens in front)."""
        return None

    def unverified_round(self, batch: Batch, draft: Draft, skips: Any, now: float, t1: float) -> float:
        """A round in which every image skips verification (``plan_skips``): commit with no target forward and
        return the clock. Only a decoder whose ``plan_skips`` can skip every image implements it."""
        raise NotImplementedError(f"{type(self).__name__}.plan_skips skipped every image but it has no "
                                  "unverified_round")

    def end_round(self, out: TargetOutput | None, before: TargetOutput | None, p: torch.Tensor | None,
                  draft: Draft, verdict: Verdict, skips: Any, prefix: Any, t: list[int],
                  rows: list[int], recs: list[StatsRecorder]) -> float:
        """After the commit: ``out`` / ``p`` the forward over the block (None when no image was verified), ``before``
        its output over ``prefix``; ``verdict.accepted`` the host counts, ``t`` the positions before the commit.
        Returns the seconds spent on diagnostics (not part of the method's latency)."""
        return 0.0
