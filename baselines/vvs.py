"""VVS: speculative decoding with partial verification skipping (Dong et al., arXiv 2511.13587, CVPR 2026).

Written after studying HyattDD/VVS @ 7790173 (``models/skip_utils_llamagen.py``, ``models/ea_llamagen.py``,
``run_vvs.sh``); nothing is copied. VVS is LANTERN's relaxed acceptance on an EAGLE-2 dynamic tree (the existing
drafters, no new training) in which some rounds make **no target forward**:

* **When to skip** (per image, per round; never while ≤ 5 tokens are generated, i.e. ``t − 1 ≤ 5`` with ``t``
  the committed tokens including the last one, which the reference keeps apart as the tree's root).
  ``uniform``: skip when ``step % skip_interval == 1``, ``step`` = rounds since the prefill (verified and skipped,
  0-based) minus the rounds of the first image row; ``skip_interval = 1024`` never skips. ``dynamic``: skip when
  the mean pairwise cosine similarity of the candidate paths' codebook embeddings, depth-weighted by
  ``similarity_decay^d`` (``path_similarity``), is ≥ ``similarity_threshold``; never two skips in a row.
* **A skipped round** commits one leaf path of the draft tree chosen uniformly at random (draw kind
  ``coolsd.rng.SKIP``), truncated to ``a = min(its length, ⌊mean path length⌋)`` drafts (the reference's
  ``min(last index, ⌊mean length with the root⌋ − 1)``), without a target forward. The drafter is fed the last
  ``a`` cached target features in place of the missing ones (``reuse_feature: reuse_prev``).
* **The next verified round** runs the skipped tokens through the target as a causal chain before the new tree
  (``BlockPrefix``): they get their KV entries and features there and are never tested. The paper calls this round
  "post verification", which implies that the skipped tokens are checked there; the released code only encodes
  them, and this module follows the code (no test, no rollback of a skipped token).

Options where the released code and the method's description differ (both kept, by name):

* ``first_row``: the code subtracts ``steps_in_first_row``, initialised to 0 and never updated
  (``reference_code``: the step is the round index); ``measured`` counts the rounds the first image row took and
  skips nothing before it is complete.
* ``skip_bonus``: the code's skipped round commits the truncated path only; its last token becomes the next
  tree's root (``reference_code``; the "reuse_logits" distribution it computes is never sampled on that path).
  ``reuse_logits``, the description's, commits one more token sampled from the previous verification's ``p``
  at its accepted path's end (the code reads row [0, −1] of its path logits, another stale row).
* ``similarity_paths``: the code compares every other candidate path (``candidates[::2]``, ``every_other``) in
  the lexicographic order of their node indices (here, the harness's tree numbering); ``all`` compares every
  leaf path.
The released code's behaviour is ``reference_code`` in both. Its run script (``run_vvs.sh``: uniform skipping every 5
rounds, LANTERN δ = 0.2) cannot run as released (it loops over ``skip_policies``, ``select_token_policies``,
``reuse_feature_policies`` but passes the unset ``$skip_policy``, ``$select_token_policy``, ``$reuse_feature_policy``);
the published rows' settings come from a note on the paper (a secondary description; the paper's text was not
read): stage I interval 4 at δ = 0.2, stage II interval 2 at δ = 0.1, dynamic threshold 0.65 (``row=vvs_uniform``,
``row=vvs_dynamic``; the script's 5 and the earlier 0.70 are ``row=vvs_uniform5``, ``row=vvs_dynamic070``).
The code as released calls ``skip_verify`` with one positional argument too many (it fails); this module follows
the evident intent (the loop index as the step).

VVS is lossy by construction: skipped tokens are never tested. The TV diagnostic counts, besides the tests of the
verified rounds (as LANTERN's), one step per skipped token, measured when the next verified round's forward
gives its ``p``: the TV between ``p`` and the law the token was drawn from (the leaf-count-weighted children of
its parent in the tree, for the uniform path choice; the cached ``p`` for a ``reuse_logits`` token). Tokens an
image commits by a skip at its very end are never run through the target and stay unmeasured.

In a batch, an image that skips while others verify rides along in the batch's forward (its rows are discarded
and its cache block dropped); a round in which every image skips makes no forward. Each image's result is the
same as alone.

Example: ``python run.py decoder=vvs``; ``python run.py decoder=vvs decoder.skip_policy=dynamic``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from baselines.lantern import check_options, lantern_rule
from coolsd import validate
from coolsd.decoding import Batch, Decoder
from coolsd.drafters.base import Drafter
from coolsd.drafters.eagle import EagleDrafter
from coolsd.models.base import ImageARModel
from coolsd.rng import SAMPLE, SKIP, Streams, sample
from coolsd.trees import ancestor_masks
from coolsd.types import Draft, StatsRecorder, TargetOutput, Verdict

SKIP_POLICIES = ("uniform", "dynamic")
SIMILARITY_PATHS = ("every_other", "all")
SELECT_TOKEN = ("random",)
REUSE_FEATURE = ("reuse_prev",)
FIRST_ROW = ("reference_code", "measured")
SKIP_BONUS = ("reference_code", "reuse_logits")
NEVER = 1024  # the reference's skip interval that disables skipping
MIN_GENERATED = 5  # no skip while at most this many tokens are generated (the reference's ``new_token <= 5``)


# -- what the round hooks return (coolsd.decoding.Decoder.plan_skips / block_prefix) ----------------------
@dataclass(frozen=True)
class Skips:
    """Images that commit this round without a target forward, as VVS plans them (``VVS.plan_skips``).

    ``images[b]`` (host) says whether image ``b`` skips. For those images ``verdict`` is what they commit, in a
    verification's terms (``num_accepted`` drafts along ``path``, then ``next_token``; no tests), and ``hidden``
    (S, B, M + 1, H) the features their drafter reads in place of the target's, at the rows the drafter reads
    for that verdict (row 0 the last committed token, node j at row j + 1). Other images' rows are ignored.
    """

    images: tuple[bool, ...]
    verdict: Verdict
    hidden: torch.Tensor

    def merge(self, verdict: Verdict, out: TargetOutput) -> tuple[Verdict, TargetOutput]:
        """The verification's verdict and the output the drafter reads, with the skipping images' replaced (their
        tests dropped: nothing of theirs was tested)."""
        mask = torch.tensor(self.images, device=verdict.next_token.device)  # (B,)
        skip = self.verdict
        tests = tuple((res, q, d, made & ~mask.view(-1, *[1] * (made.dim() - 1)))
                      for res, q, d, made in verdict.tests)
        merged = Verdict(num_accepted=torch.where(mask, skip.num_accepted, verdict.num_accepted),
                         next_token=torch.where(mask, skip.next_token, verdict.next_token),
                         path=torch.where(mask[:, None], skip.path, verdict.path), tests=tests)
        hidden = torch.where(mask[None, :, None, None], self.hidden.to(out.hidden.dtype), out.hidden)
        return merged, dataclasses.replace(out, hidden=hidden)


@dataclass(frozen=True)
class BlockPrefix:
    """Committed tokens the target has not run yet (a skipped round's), fed as a causal chain before an image's
    block (``VVS.block_prefix``): they get their KV entries and features there and are never tested.

    ``counts[b]`` tokens of image ``b`` (its image positions ``t_b − 1 − counts[b] .. t_b − 2``), right-aligned in
    ``C = max(counts)`` slots; the padding slots in front see only themselves and are never kept.
    """

    counts: tuple[int, ...]
    tokens: torch.Tensor  # (B, C)
    positions: torch.Tensor  # (B, C)

    @classmethod
    def of(cls, tokens: torch.Tensor, t: list[int], counts: list[int]) -> "BlockPrefix":
        width = max(counts)
        cols = [[ti - 1 - width + j if j >= width - c else ti - 1 for j in range(width)]
                for ti, c in zip(t, counts)]  # padding slots sit at the last committed token's position
        index = torch.tensor(cols, device=tokens.device)  # (B, C)
        pad = torch.tensor([[j < width - c for j in range(width)] for c in counts], device=tokens.device)
        return cls(counts=tuple(counts), tokens=torch.where(pad, 0, tokens.gather(1, index)), positions=index)

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def prepend(self, inputs: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block ``[prefix, inputs]`` (B, C + T), its positions and its (B, C + T, C + T) mask: the prefix
        causal, the block as ``tree_mask`` (None: causal) after every prefix token of its image."""
        b, t = inputs.shape
        c = self.width
        device = inputs.device
        counts = torch.tensor(self.counts, device=device)
        real = torch.arange(c, device=device)[None, :] >= (c - counts)[:, None]  # (B, C)
        mask = torch.zeros(b, c + t, c + t, dtype=torch.bool, device=device)
        mask[:, :c, :c] = torch.ones(c, c, dtype=torch.bool, device=device).tril() & real[:, None, :]
        mask[:, :c, :c] |= torch.eye(c, dtype=torch.bool, device=device)  # a padding slot sees itself only
        mask[:, c:, :c] = real[:, None, :]
        block = torch.ones(t, t, dtype=torch.bool, device=device).tril() if tree_mask is None else tree_mask
        mask[:, c:, c:] = block
        return (torch.cat([self.tokens, inputs], 1), torch.cat([self.positions, positions], 1), mask)

    def split(self, out: TargetOutput) -> tuple[TargetOutput, TargetOutput]:
        """The forward's output over the prefix slots (S, B, C, ·) and over the block."""
        c = self.width
        return (TargetOutput(logits=out.logits[:, :, :c], hidden=out.hidden[:, :, :c]),
                TargetOutput(logits=out.logits[:, :, c:], hidden=out.hidden[:, :, c:]))

    def keep(self, kept: list[int], index: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
        """``cache.keep`` arguments for the block's kept entries (``kept``, block ``index`` or None: the first
        ones) with each image's prefix tokens in front."""
        c = self.width
        b = len(kept)
        device = self.tokens.device
        if index is None:
            index = torch.arange(max(kept), device=device).expand(b, -1)
        counts = torch.tensor(self.counts, device=device)[:, None]
        w = index.shape[1]
        k = torch.arange(c + w, device=device)[None, :]
        block = index.gather(1, (k - counts).clamp(0, max(w - 1, 0)).expand(b, -1)) + c if w else k.expand(b, -1)
        return [x + y for x, y in zip(kept, self.counts)], torch.where(k < counts, c - counts + k, block)


# -- the rule's steps, on plain tensors ----------------------------------------------------------------------
def uniform_skip(step: int, first_row_steps: int, interval: int) -> bool:
    """The uniform schedule: skip when the step counted after the first row is 1 modulo ``interval``."""
    return interval != NEVER and (step - first_row_steps) % interval == 1


def leaf_paths(parents: torch.Tensor, valid: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image's root-to-leaf paths over its valid nodes: ``(nodes (B, M, depth), leaves (B,))``.

    ``nodes[b, i, d]`` is the node at depth ``d + 1`` of image b's i-th leaf path (−1 past the leaf); the leaf
    paths come first, in the lexicographic order of their node sequences (the reference's sorted
    ``retrieve_indices``), then rows of −1.
    """
    b, m = parents.shape
    device = parents.device
    anc = ancestor_masks(parents)[:, 1:, 1:]  # (B, M, M): node j is node i or an ancestor of it
    node_depth = anc.sum(-1)  # (B, M), 1-based
    children = torch.zeros(b, m + 1, dtype=torch.long, device=device).scatter_add_(1, parents + 1, valid.long())
    leaf = valid & (children[:, 1:] == 0)
    levels = torch.arange(1, depth + 1, device=device)
    at = anc[:, :, None, :] & (node_depth[:, None, None, :] == levels[None, None, :, None])  # (B, M, D, M)
    nodes = torch.where(at.any(-1), at.float().argmax(-1), -1)  # (B, M, D)
    order = torch.arange(m, device=device).expand(b, -1)
    for d in reversed(range(depth)):  # lexicographic: stable sorts from the last key to the first
        key = torch.where(nodes[:, :, d] >= 0, nodes[:, :, d], m).gather(1, order)
        order = order.gather(1, torch.argsort(key, dim=1, stable=True))
    order = order.gather(1, torch.argsort((~leaf).gather(1, order).long(), dim=1, stable=True))
    nodes = nodes.gather(1, order[:, :, None].expand(-1, -1, depth))
    count = leaf.sum(1)
    nodes = torch.where(torch.arange(m, device=device)[None, :, None] < count[:, None, None], nodes, -1)
    return nodes, count


def path_similarity(codes: torch.Tensor, lengths: torch.Tensor, chosen: torch.Tensor, codebook: torch.Tensor,
                    decay: float = 0.9) -> torch.Tensor:
    """Mean pairwise cosine similarity (B,) of the ``chosen`` paths (B, P) of draft codes (B, P, D) (valid up
    to ``lengths``), the root excluded: per depth ``l`` the cosine of the two codes' codebook embeddings (0 where
    either path has ended), weighted by ``decay^l`` normalised over the longest chosen path, averaged over
    the pairs; 0 with fewer than two paths (the reference's ``compute_similarity_pytorch_jit``)."""
    b, n, d = codes.shape
    device = codes.device
    emb = F.normalize(codebook.float()[codes.clamp_min(0)], p=2.0, dim=-1)  # (B, P, D, E)
    here = (torch.arange(d, device=device) < lengths[..., None]) & chosen[..., None]  # (B, P, D)
    emb = emb * here[..., None]
    sims = torch.einsum("bpde,bqde->bdpq", emb, emb)  # (B, D, P, P); 0 where either path has ended
    longest = (lengths * chosen).max(1).values  # (B,)
    w = decay ** torch.arange(d, device=device, dtype=torch.float32)
    w = w * (torch.arange(d, device=device) < longest[:, None])  # (B, D)
    w = w / w.sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    pair_sim = torch.einsum("bd,bdpq->bpq", w, sims)
    pairs = chosen[:, :, None] & chosen[:, None, :] & torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    total = pairs.sum((1, 2))
    return torch.where(total > 0, (pair_sim * pairs).sum((1, 2)) / total.clamp_min(1), 0.0)


def truncation(lengths: torch.Tensor, count: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """Drafts a skipped round commits (B,): ``min(L_pick, ⌊Σ_i (L_i + 1) / P⌋ − 1)`` over the P leaf paths
    (lengths without the root, (B, P)), 0 without a path."""
    rows = torch.arange(lengths.shape[1], device=lengths.device)[None, :] < count[:, None]  # the leaf paths
    mean = ((lengths + 1) * rows).sum(1) // count.clamp_min(1) - 1
    return torch.where(count > 0, torch.minimum(lengths.gather(1, pick[:, None])[:, 0], mean), 0)


def stale_rows(count: torch.Tensor, held: torch.Tensor, size: int, width: int) -> torch.Tensor:
    """Indices (B, width) into a right-aligned feature buffer of ``size`` slots holding ``held`` (B,) features:
    the last ``count`` (B,) of them in order, or, when fewer are held, all of them then the last one repeated
    (the reference's ``retrieve_features``, ``reuse_prev``)."""
    j = torch.arange(width, device=count.device)[None, :]
    held = held[:, None].clamp_min(1)
    count = count[:, None]
    return torch.where(count <= held, size - count + j, size - held + torch.minimum(j, held - 1)).clamp(0, size - 1)


def leaf_weighted_children(parents: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor, nodes: torch.Tensor,
                           count: torch.Tensor, path: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, D, V): the law of the token a skipped round commits at each depth of ``path`` (B, D) (node per depth,
    −1 past its end) given the nodes above it: the children of its parent weighted by their leaf counts (a
    uniform leaf path's choice)."""
    b, m = parents.shape
    leaves = torch.arange(m, device=parents.device)[None, :] < count[:, None]  # (B, M) rows of ``nodes`` in use
    under = torch.zeros(b, m + 1, device=parents.device)
    flat = (nodes + 1).clamp_min(0).flatten(1)  # (B, M·D): node + 1 of each leaf path's entries (0: none)
    under.scatter_add_(1, flat, (leaves[:, :, None] & (nodes >= 0)).flatten(1).float())
    under = under[:, 1:]  # (B, M): leaf paths through each node
    rows = []
    up = torch.full((b,), -1, dtype=torch.long, device=parents.device)
    for d in range(path.shape[1]):
        w = under * (valid & (parents == up[:, None]))
        r = torch.zeros(b, vocab, device=parents.device).scatter_add_(1, tokens, w)
        rows.append(r / r.sum(-1, keepdim=True).clamp_min(1.0))
        up = path[:, d]
    return torch.stack(rows, 1)


class VVS(Decoder):
    """LANTERN on an EAGLE-2 tree with partial verification skipping (module doc)."""

    def __init__(self, name: str, model: ImageARModel, draft_len: int, drafter: Callable[..., Drafter],
                 k: int = 1000, delta: float = 0.2, resample: str = "reference",
                 neighbour_metric: str = "l2_raw", neighbour_cache: str | None = None,
                 tree: str | None = "dynamic", dynamic_tree: dict | None = None,
                 skip_policy: str = "uniform", skip_interval: int = 5, similarity_threshold: float = 0.70,
                 similarity_decay: float = 0.9, similarity_paths: str = "every_other", select_token: str = "random",
                 reuse_feature: str = "reuse_prev", first_row: str = "reference_code",
                 skip_bonus: str = "reference_code", track_tv: bool = True, sync_phases: bool = False,
                 path: str = "eager",
                 refill: bool = False) -> None:
        check_options(name, draft_len, k, resample, neighbour_metric, tree, dynamic_tree, track_tv, sync_phases)
        validate.number("decoder.delta", delta, minimum=0.0, maximum=1.0)
        validate.choice("decoder.skip_policy", skip_policy, SKIP_POLICIES)
        validate.integer("decoder.skip_interval", skip_interval, minimum=2)
        validate.number("decoder.similarity_threshold", similarity_threshold, minimum=-1.0, maximum=1.0)
        validate.number("decoder.similarity_decay", similarity_decay, minimum=0.0, maximum=1.0)
        validate.choice("decoder.similarity_paths", similarity_paths, SIMILARITY_PATHS)
        validate.choice("decoder.select_token", select_token, SELECT_TOKEN)
        validate.choice("decoder.reuse_feature", reuse_feature, REUSE_FEATURE)
        validate.choice("decoder.first_row", first_row, FIRST_ROW)
        validate.choice("decoder.skip_bonus", skip_bonus, SKIP_BONUS)
        if tree is None:
            raise ValueError(f"decoder {name!r} (VVS) skips verification on a draft tree: set decoder.tree=dynamic "
                             "(the EAGLE-2 tree VVS is published with) or a static tree shape")
        rule = lantern_rule(model, k, "additive", delta, resample, neighbour_metric, neighbour_cache)
        super().__init__(name=name, model=model, rule=rule, draft_len=draft_len, drafter=drafter, tree=tree,
                         dynamic_tree=dynamic_tree, track_tv=track_tv, sync_phases=sync_phases, path=path,
                         refill=refill)
        if not isinstance(self.drafter, EagleDrafter):
            raise ValueError(f"decoder {name!r} (VVS) feeds stale target features to an EAGLE drafter; "
                             f"{type(self.drafter).__name__} reads none: use drafter=<an EAGLE drafter config>")
        self.skip_policy, self.skip_interval = skip_policy, skip_interval
        self.similarity_threshold, self.similarity_decay = similarity_threshold, similarity_decay
        self.similarity_paths, self.first_row, self.skip_bonus = similarity_paths, first_row, skip_bonus
        self.bonus = int(skip_bonus == "reuse_logits")
        self.prefix_room = self.max_depth + self.bonus  # a skipped round's tokens, fed before the next block
        self.held = self.max_depth + self.bonus  # stale features kept per image (the most a skip reads)
        self._codebook: torch.Tensor | None = None
        self.begin_rounds(0)

    # -- per-image state ---------------------------------------------------------------------------------------
    def begin_rounds(self, batch: int) -> None:
        self.rounds = [0] * batch  # rounds since the prefill, skipped ones included (the reference's ``idx``)
        self.first_row_rounds: list[int | None] = [None] * batch  # ``first_row: measured``
        self.last_skipped = [False] * batch
        self.chain = [0] * batch  # committed tokens not yet run through the target
        self.features: torch.Tensor | None = None  # (S, B, held, H) last target features, right-aligned
        self.features_held = [0] * batch
        self.last_p: torch.Tensor | None = None  # (B, V) the previous verification's p at its path end
        self.unmeasured: torch.Tensor | None = None  # (B, held, V) laws of the chain's tokens (TV diagnostic)

    def select_rounds(self, images: list[int]) -> None:
        for key in ("rounds", "first_row_rounds", "last_skipped", "chain", "features_held"):
            setattr(self, key, [getattr(self, key)[i] for i in images])
        index = None
        for key in ("features", "last_p", "unmeasured"):
            value = getattr(self, key)
            if value is not None:
                if index is None:
                    index = torch.tensor(images, device=value.device)
                setattr(self, key, value[:, index] if key == "features" else value[index])

    def codebook(self, device: torch.device) -> torch.Tensor:
        if self._codebook is None or self._codebook.device != device:
            self._codebook = self.model.codebook().detach().to(device=device, dtype=torch.float32)
        return self._codebook

    # -- 1. when to skip, and what a skipped round commits -------------------------------------------------------
    def eligible(self, t: list[int]) -> list[bool]:
        """The host-side conditions (before any similarity): enough tokens, the schedule, no two skips in a row
        (dynamic), features to reuse."""
        width = self.model.grid[1]
        out = []
        for i, ti in enumerate(t):
            if self.first_row_rounds[i] is None and ti - 1 >= width:
                self.first_row_rounds[i] = self.rounds[i]
            ok = ti - 1 > MIN_GENERATED and self.features_held[i] > 0
            if self.skip_policy == "uniform":
                first = self.first_row_rounds[i] if self.first_row == "measured" else 0
                ok = ok and first is not None and uniform_skip(self.rounds[i], first, self.skip_interval)
            else:
                ok = ok and not self.last_skipped[i]
            out.append(ok)
        return out

    def plan_skips(self, draft: Draft, t: list[int], t_dev: torch.Tensor, streams: Streams) -> Skips | None:
        eligible = self.eligible(t)
        if not any(eligible) or draft.draft_len == 0:
            return None
        device = t_dev.device
        b, m = draft.tokens.shape
        nodes, count = leaf_paths(draft.parents, draft.valid, self.max_depth)  # (B, M, D), (B,)
        lengths = (nodes >= 0).sum(-1)  # (B, M) drafts per leaf path (0 past the leaves)
        pick = (streams.uniform(t_dev, SKIP, 1)[:, 0] * count).long().clamp(max=(count - 1).clamp_min(0))
        a = truncation(lengths, count, pick)  # (B,)
        host = [a]
        if self.skip_policy == "dynamic":
            rank = torch.arange(m, device=device)[None, :]
            chosen = (rank < count[:, None]) & ((rank % 2 == 0) if self.similarity_paths == "every_other" else True)
            codes = draft.tokens.gather(1, nodes.clamp_min(0).flatten(1)).view(b, m, -1)
            sim = path_similarity(codes, lengths, chosen, self.codebook(device), self.similarity_decay)
            host.append((sim >= self.similarity_threshold).long())
        host = torch.stack(host).tolist()
        images = tuple(e and x >= 1 and (self.skip_policy == "uniform" or bool(host[1][i]))
                       for i, (e, x) in enumerate(zip(eligible, host[0])))
        if not any(images):
            return None
        path = nodes.gather(1, pick[:, None, None].expand(-1, 1, nodes.shape[-1]))[:, 0]  # (B, D)
        accepted = a - 1 + self.bonus  # drafts before the next token
        at_a = path.gather(1, (a - 1).clamp_min(0)[:, None])[:, 0].clamp_min(0)
        if self.bonus:
            next_token = sample(self.last_p, streams.uniform(t_dev, SAMPLE, 1)[:, 0])
        else:
            next_token = draft.tokens.gather(1, at_a[:, None])[:, 0]
        full = torch.zeros(b, m, dtype=torch.long, device=device)
        width = min(path.shape[1], m)  # a path never has more nodes than the tree
        full[:, :width] = path[:, :width].clamp_min(0)
        verdict = Verdict(num_accepted=accepted, next_token=next_token, path=full)
        hidden = self.stale_hidden(accepted + 1, full, m)
        if self.track_tv:  # the law each committed token was drawn from, for the TV measured later
            laws = leaf_weighted_children(draft.parents, draft.valid, draft.tokens, nodes, count, path,
                                          self.model.codebook_size)  # (B, D, V)
            if self.bonus:
                laws = torch.cat([laws, torch.zeros_like(laws[:, :1])], 1)
                laws[torch.arange(b, device=device), a] = self.last_p.to(laws.dtype)
            self._laws = laws
        return Skips(images=images, verdict=verdict, hidden=hidden)

    def unverified_round(self, batch: Batch, draft: Draft, skips: Skips, now: float, t1: float) -> float:
        """A round in which every image skips verification: commit ``skips.verdict`` with no target forward (no
        cache block is opened) and let the drafter read ``skips.hidden``."""
        tokens, t, recs, phases, rows = batch.tokens, batch.t, batch.recs, batch.phases, batch.rows
        verdict = skips.verdict
        host = [verdict.num_accepted]
        forwards = draft.forwards
        if isinstance(forwards, torch.Tensor):
            host.append(forwards)
        host = torch.stack(host).tolist()
        n = host[0]
        if isinstance(forwards, torch.Tensor):
            forwards = host[-1]
        verdict = dataclasses.replace(verdict, accepted=tuple(n))
        t3 = self._clock()
        self._write_tokens(tokens, t, draft, verdict, n)
        seen = TargetOutput(logits=skips.hidden.new_zeros(0), hidden=skips.hidden)
        self.drafter.observe(seen, None, draft, verdict)
        diagnostics = self.end_round(None, None, None, draft, verdict, skips, None, t, rows, recs)
        t4 = self._clock()
        for i, r in enumerate(rows):
            recs[r].unverified(n[i] + 1)
            recs[r].drafter_forwards += forwards[i]
            t[i] += n[i] + 1
        phases.diagnostics_s += diagnostics
        phases.draft_s += t1 - now
        phases.accept_s += t3 - t1
        phases.observe_s += t4 - t3 - diagnostics
        return t4

    def stale_hidden(self, pairs: torch.Tensor, path: torch.Tensor, m: int) -> torch.Tensor:
        """(S, B, M + 1, H): the last ``pairs`` (B,) held features at the rows the drafter reads for a verdict
        along ``path`` (row 0, then path node j at row j + 1)."""
        s, b, held, h = self.features.shape
        width = int(pairs.max())
        idx = stale_rows(pairs, torch.tensor(self.features_held, device=pairs.device), held, width)
        stale = self.features.gather(2, idx[None, :, :, None].expand(s, -1, -1, h))  # (S, B, W, H)
        j = torch.arange(width, device=pairs.device)[None, :]
        rows = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=pairs.device), path[:, : width - 1] + 1], 1)
        rows = torch.where(j < pairs[:, None], rows, m + 1)  # unused entries go to a spare row
        hidden = self.features.new_zeros(s, b, m + 2, h)
        return hidden.scatter(2, rows[None, :, :, None].expand(s, -1, -1, h), stale)[:, :, : m + 1]

    # -- 2. the next verified round feeds the skipped tokens first ------------------------------------------------
    def block_prefix(self, tokens: torch.Tensor, t: list[int]) -> BlockPrefix | None:
        return BlockPrefix.of(tokens, t, self.chain) if any(self.chain) else None

    # -- 3. after the commit: features, cached p, counters, and the skipped tokens' TV ---------------------------
    def end_round(self, out: TargetOutput | None, before: TargetOutput | None, p: torch.Tensor | None,
                  draft: Draft, verdict: Verdict, skips: Skips | None, prefix: BlockPrefix | None, t: list[int],
                  rows: list[int], recs: list[StatsRecorder]) -> float:
        n = list(verdict.accepted)
        b = len(n)
        skipped = skips.images if skips is not None else (False,) * b
        diagnostics = 0.0
        if out is not None:
            verified = [not s for s in skipped]
            chain = [c if v else 0 for c, v in zip(prefix.counts if prefix is not None else (0,) * b, verified)]
            if prefix is not None and self.track_tv and any(chain):
                start = self._clock()
                self.measure_chain(before, prefix, chain, rows, recs)
                diagnostics = self._clock() - start
            self.append_features(out, before, verdict, n, chain, verified)
            if self.bonus:
                end = torch.zeros_like(verdict.num_accepted)
                if verdict.path.shape[1]:
                    end = torch.where(verdict.num_accepted > 0, verdict.path.gather(
                        1, (verdict.num_accepted - 1).clamp_min(0)[:, None])[:, 0] + 1, 0)
                here = p[torch.arange(b, device=p.device), end]  # (B, V)
                keep = torch.tensor(verified, device=p.device)[:, None]
                self.last_p = here if self.last_p is None else torch.where(keep, here, self.last_p)
        if skips is not None and self.track_tv:
            self.unmeasured = self._laws if self.unmeasured is None else torch.where(
                torch.tensor(skipped, device=self._laws.device)[:, None, None], self._laws, self.unmeasured)
        for i in range(b):
            self.rounds[i] += 1
            self.last_skipped[i] = skipped[i]
            self.chain[i] = self.chain[i] + n[i] + 1 if skipped[i] else 0
        return diagnostics

    def append_features(self, out: TargetOutput, before: TargetOutput | None, verdict: Verdict, n: list[int],
                        chain: list[int], verified: list[bool]) -> None:
        """Append each verified image's new target features in order (its prefix tokens', its last committed
        token's, its accepted nodes') to its buffer of the last ``held``."""
        s, b, _, h = out.hidden.shape
        width = max(n) + 1
        rows = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=out.hidden.device),
                          verdict.path[:, : width - 1] + 1], 1)
        block = out.hidden.gather(2, rows[None, :, :, None].expand(s, -1, -1, h))  # (S, B, W, H)
        if self.features is None:
            self.features = out.hidden.new_zeros(s, b, self.held, h)
        parts = [self.features] + ([before.hidden] if before is not None else []) + [block]
        c = before.hidden.shape[2] if before is not None else 0
        index = []
        for i in range(b):
            seq = list(range(self.held - self.features_held[i], self.held))
            if verified[i]:
                seq += [self.held + c - chain[i] + j for j in range(chain[i])]
                seq += [self.held + c + j for j in range(n[i] + 1)]
            seq = seq[-self.held:]
            self.features_held[i] = len(seq)
            index.append([0] * (self.held - len(seq)) + seq)
        index = torch.tensor(index, device=out.hidden.device)
        self.features = torch.cat(parts, 2).gather(2, index[None, :, :, None].expand(s, -1, -1, h))

    def measure_chain(self, before: TargetOutput, prefix: BlockPrefix, chain: list[int], rows: list[int],
                      recs: list[StatsRecorder]) -> None:
        """One TV step per skipped token: TV(its law, the target's ``p`` there), now that the prefix's forward
        gave ``p`` (slot j of the prefix is the distribution of the token after it)."""
        p_chain = self.model.probs(before)  # (B, C, V)
        c = prefix.width
        laws = self.unmeasured  # (B, held, V) left-aligned
        j = torch.arange(c, device=p_chain.device)[None, :]
        counts = torch.tensor(chain, device=p_chain.device)[:, None]
        slot = (j - (c - counts)).clamp(0, laws.shape[1] - 1)  # the law of prefix slot j (right-aligned)
        law = laws.gather(1, slot[:, :, None].expand(-1, -1, laws.shape[-1]))
        tv = 0.5 * (law.double() - p_chain.double()).abs().sum(-1)  # (B, C)
        tv = (tv * (j >= c - counts)).sum(1).tolist()
        for i, r in enumerate(rows):
            if chain[i]:
                recs[r].tv_sum += tv[i]
                recs[r].tv_steps += chain[i]
