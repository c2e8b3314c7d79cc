"""Speculative Jacobi decoding and its training-free family as slots of one window drafter on the shared loop.

SJD (Teng et al., arXiv 2410.01699) lets the target draft for itself: a window of ``W = draft_len + 1`` tokens
after the last committed one is refined by Jacobi iteration; every iteration runs the target once over
``[last committed, d_1..d_{W−1}]`` and accepts a prefix of the drafts with ``min(1, p_t(d)/q(d))``, where ``q``
is the distribution ``d`` was drawn from. That is vanilla speculative sampling with a drafter that remembers
the target's own outputs, so every method below is this drafter (``JacobiDrafter``) with one or two slots
changed, run by ``coolsd.decoding.Decoder`` with ``baselines.exact.ExactRule`` or GSD's
``baselines.gsd.GroupedRule`` (``docs/algorithms.md``, "The Jacobi family"):

* **(A) ``init``, a fresh window slot**: ``random`` (a uniform code, stored q one-hot on it: SJD),
  ``random_uniform_q`` (a uniform code, stored q uniform over the codes, so it is accepted with
  ``min(1, V·p(x))``: SJD-PAC), ``repeat_horizon`` (the token one column to the left, q one-hot; at column 0 a
  uniform code), ``auto`` (the model adapter's ``sjd_init``).
* **(B) ``carry``, the drafts right of the committed block** (the target's outputs there, computed in the
  verify forward conditioned on the rejected drafts: the Jacobi update):
  ``independent`` (SJD: a fresh sample of ``p_t``, stored q = ``p_t``);
  ``maximal`` (SCD-MC, SJD-PAC's adaptive continuation): the maximal coupling of the old draft with ``p_t``,
  i.e. keep the old draft ``x`` with probability ``min(1, p_t(x)/q(x))``, else draw ``norm([p_t − q]_+)``, with
  stored q = ``p_t`` (``carried_q: exact``, the marginal of the coupled token) or, as SCD's published code does,
  the old q for a kept draft (``carried_q: reference_code``; see the README for what the exactness test
  finds); ``gumbel`` (SCD-GS): every absolute image position keeps one Gumbel noise vector ``g`` over the
  codes for the whole decode and a carried draft is ``argmax_v(log p_t(v) + g(v))``, stored q = ``p_t``.
* **(D) ``tree_width`` K, ``tree_depth`` D: SJD-PAC's proactive drafting.** After a rejection the window is a
  K-ary tree rooted at the committed token with ``D − 1`` branching levels (D counts the root, as the reference
  code's ``tree_depth`` does): level ``l`` holds the coupled carried draft of window slot ``l`` first and
  ``K − 1`` more tokens drawn from that slot's stored q **without replacement**, each node storing q with the
  earlier siblings removed and renormalised; every node of level ``l − 1`` has these same ``K`` children (the
  reference's Cartesian tree); the rest of the window hangs as one chain under the first-child path. The loop
  verifies it with the shared multi-draft walk (``coolsd.acceptance.verify_tree``). ``K = 1`` or ``D = 1`` is a
  chain.

Carried drafts for the next iteration always come from the path the walk stopped on: below the last
accepted node ``c``, the first child (the rejected draft, whose position is committed as the resampled token),
its first child and so on; each becomes a carried slot with the target's distribution at its position (the
output at its parent) and, for ``maximal``, its old token and q. One more slot takes the distribution after
the last such node (no old draft: a fresh sample, or Gumbel for ``gumbel``). For a chain this is SJD's own
rule: positions ``n + 2 .. W`` of the old window.

Differences from the reference code, on purpose (``README``, "The Jacobi family"):

* Every image token is decoded inside the window, which shrinks at the grid's end; the references decode a few
  tokens plainly autoregressively at the start and end (Lumina-mGPT's structural tokens are forced by the
  adapter here).
* ``gumbel``: the noise is keyed by absolute image position throughout (the reference reuses one noise row for
  the plain autoregressive steps, which is not exact); the committed token after a rejection is drawn from the
  residual with its own uniform, as there, and the bonus token by the loop's sampler (same distribution).
* SJD-PAC: the reference draws the K siblings of a level from the residual ``(p − q)_+`` and verifies them as
  if drawn from ``p_t``, picks the path with the longest accepted prefix, and commits a uniform random token when
  every draft passes; by our reading (and a distribution test of its sampler run outside this repository) that
  is not exact. Here siblings come from the stored q without replacement and the walk takes the first accepted
  sibling, which the chi-square tests check (``tests/test_jacobi.py``).
* ``repeat_horizon`` for a fresh token whose left neighbour is also fresh copies that neighbour (the reference
  copies the last token it already holds); the reference's LlamaGen path never applies it (use ``random``).

Written after tyshiwo1/Accelerating-T2I-AR-with-SJD ``scheduler/jacobi_iteration_lumina_mgpt.py``,
junhyukso/SCD ``lumina1/scheduler/jacobi_iteration_lumina_mgpt_{SCDMC,GS}.py`` and ``janus_pro/scheduler/``,
KangJialiang/SJD-PAC ``scheduler/sjd_pac_iteration_lumina_mgpt.py``; studied, not copied.

Example: ``python run.py decoder=scd_mc``; ``python run.py decoder=sjd decoder.drafter.init=random``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from coolsd import validate
from coolsd.acceptance import ratio_acceptance, vanilla_residual
from coolsd.drafters.base import Drafter, chain_valid, empty_draft
from coolsd.models.base import ImageARModel
from coolsd.rng import COUPLE, GUMBEL, INIT, JACOBI, TREE, sample

_COLUMN_CACHE: dict[tuple[int, torch.device, int], torch.Tensor] = {}


def _columns(length: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """(1, length) int64 ``start .. start + length − 1`` on ``device`` (cached; never modified)."""
    key = (length, device, start)
    if key not in _COLUMN_CACHE:
        _COLUMN_CACHE[key] = torch.arange(start, start + length, device=device)[None, :]
    return _COLUMN_CACHE[key]
from coolsd.types import Draft, TargetOutput, Verdict

INITS = ("auto", "random", "random_uniform_q", "repeat_horizon")
CARRIES = ("independent", "maximal", "gumbel")
CARRIED_Q = ("exact", "reference_code")


@dataclass(frozen=True)
class TreeTemplate:
    """SJD-PAC's window as a fixed node layout: ``levels`` branching levels of ``width`` siblings (every node of a
    level has the same children), then a chain under the first-child path, ``nodes`` draft nodes in all.

    ``parents[j]`` (−1 = the root), ``slot[j]`` the window slot (= depth − 1) and ``rank[j]`` the sibling rank of
    node j; ``first_chain[r]`` lists the first-child path below row ``r`` of ``p`` (0 = the root, j + 1 = node j),
    −1 padded; ``carry_path[r]``: that path, continued at the depths below its end by the root's first-child
    path (the chain), one node per depth: where the next window's carried drafts come from after the walk stopped
    at row ``r`` (as the reference carries the chain on whichever path was accepted)."""

    width: int
    levels: int
    nodes: int
    parents: torch.Tensor
    slot: torch.Tensor
    rank: torch.Tensor
    first_chain: torch.Tensor
    carry_path: torch.Tensor
    depth: int  # window slots the layout spans (the first-child path's length)

    @classmethod
    def build(cls, width: int, levels: int, nodes: int) -> "TreeTemplate":
        parents, slot, rank = [], [], []
        previous = [-1]
        for level in range(levels):
            current = []
            for par in previous:
                for r in range(width):
                    if len(parents) == nodes:
                        break
                    parents.append(par)
                    slot.append(level)
                    rank.append(r)
                    current.append(len(parents) - 1)
            previous = current
        tip = next((j for j in range(len(parents) - 1, -1, -1) if all(
            rank[a] == 0 for a in _ancestry(parents, j))), -1)  # the deepest all-first-child node
        depth = slot[tip] + 1 if tip >= 0 else 0
        while len(parents) < nodes:  # the chain under the first-child path
            parents.append(tip)
            slot.append(depth)
            rank.append(0)
            tip, depth = len(parents) - 1, depth + 1
        m = len(parents)
        first_child = [-1] * (m + 1)
        for j in range(m - 1, -1, -1):
            if rank[j] == 0:
                first_child[parents[j] + 1] = j
        chains = []
        for row in range(m + 1):
            chain, node = [], first_child[row]
            while node >= 0:
                chain.append(node)
                node = first_child[node + 1]
            chains.append(chain)
        main = chains[0]  # the root's first-child path: one node per depth
        carries = []
        for row, chain in enumerate(chains):
            start = (slot[row - 1] + 1 if row else 0) + len(chain)  # the depth index after the chain's end
            carries.append(chain + main[start:])
        def table(lists: list[list[int]]) -> torch.Tensor:
            out = torch.full((m + 1, max(max((len(c) for c in lists), default=0), 1)), -1, dtype=torch.long)
            for row, items in enumerate(lists):
                out[row, : len(items)] = torch.tensor(items, dtype=torch.long)
            return out

        return cls(width=width, levels=levels, nodes=m, parents=torch.tensor(parents, dtype=torch.long),
                   slot=torch.tensor(slot, dtype=torch.long), rank=torch.tensor(rank, dtype=torch.long),
                   first_chain=table(chains), carry_path=table(carries), depth=max(slot) + 1 if m else 0)


def _ancestry(parents: list[int], j: int) -> list[int]:
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out


class JacobiDrafter(Drafter):
    """The Jacobi window of a batch of images with the family's slots as options (module doc)."""

    drafts_trees = False  # its own window (chain or SJD-PAC tree); decoder.tree is refused when the decoder is built
    self_drafting = True  # the window holds the target's own outputs

    def __init__(self, target: ImageARModel, init: str = "auto", carry: str = "independent",
                 carried_q: str = "exact", tree_width: int = 1, tree_depth: int = 1) -> None:
        validate.choice("decoder.drafter.init", init, INITS)
        if init == "auto":
            init = getattr(target, "sjd_init", "random")
            if init not in INITS[1:]:
                raise ValueError(f"{type(target).__name__}.sjd_init must be one of {INITS[1:]}, got {init!r}")
        self.target = target
        self.init = init
        self.carry = validate.choice("decoder.drafter.carry", carry, CARRIES)
        self.carried_q = validate.choice("decoder.drafter.carried_q", carried_q, CARRIED_Q)
        if carried_q == "reference_code" and carry != "maximal":
            raise ValueError("decoder.drafter.carried_q=reference_code is SCD's maximal-coupling code; set "
                             "decoder.drafter.carry=maximal or carried_q=exact")
        self.tree_width = validate.integer("decoder.drafter.tree_width", tree_width, minimum=1)
        self.tree_depth = validate.integer("decoder.drafter.tree_depth", tree_depth, minimum=1)
        self.vocab = target.codebook_size
        self.width = target.grid[1]
        self.streams = None
        self.q: torch.Tensor | None = None  # (B, C, V) stored q of the carried slots
        self.x: torch.Tensor | None = None  # (B, C) coupled carried tokens (maximal), −1 = draw at propose
        self.batch, self.device = 0, torch.device("cpu")  # set by begin
        self.carried: torch.Tensor | None = None  # (B,) per image: how many of the C slots are carried
        self._templates: dict[int, TreeTemplate] = {}
        self._device_templates: dict[tuple[int, torch.device], TreeTemplate] = {}
        self._draft_len = 0
        self._t: torch.Tensor | None = None

    @property
    def is_tree(self) -> bool:
        return self.tree_width > 1 and self.tree_depth > 1

    def template(self, nodes: int) -> TreeTemplate:
        """The SJD-PAC layout of ``nodes`` draft nodes (cached)."""
        if nodes not in self._templates:
            self._templates[nodes] = TreeTemplate.build(self.tree_width, self.tree_depth - 1, nodes)
        return self._templates[nodes]

    def template_on(self, nodes: int, device: torch.device) -> TreeTemplate:
        """``template(nodes)`` with its tensors on ``device``, copied there once (no copy inside a decode step)."""
        key = (nodes, device)
        if key not in self._device_templates:
            tmpl = self.template(nodes)
            self._device_templates[key] = dataclasses.replace(
                tmpl, parents=tmpl.parents.to(device), slot=tmpl.slot.to(device), rank=tmpl.rank.to(device),
                first_chain=tmpl.first_chain.to(device), carry_path=tmpl.carry_path.to(device))
        return self._device_templates[key]

    def block_shape(self, draft_len: int) -> tuple[int, int]:
        self._draft_len = draft_len
        if not self.is_tree:
            return draft_len, draft_len
        return self.template(draft_len).depth, draft_len

    def iteration_draws(self, depth, tree):
        if not depth or self.is_tree:
            return ()
        draws = ((JACOBI, depth),) if self.carry != "gumbel" else ()
        draws += ((INIT, depth),)
        return draws + ((COUPLE, 2 * depth),) if self.carry == "maximal" else draws

    # -- the loop's calls ---------------------------------------------------------------------------------
    def begin(self, prompts, prefill: TargetOutput, first_tokens: torch.Tensor, streams) -> None:
        b = first_tokens.shape[0]
        self.streams = streams
        device = first_tokens.device
        self.batch, self.device = b, device  # host facts, read without torch calls
        self.q = torch.zeros(b, 0, self.vocab, device=device)
        self.x = torch.zeros(b, 0, dtype=torch.long, device=device)
        self.carried = torch.zeros(b, dtype=torch.long, device=device)

    def select(self, images) -> None:
        index = torch.tensor(list(images), device=self.q.device)
        self.q, self.carried = self.q[index], self.carried[index]
        self.x = None if self.x is None else self.x[index]
        self.batch = len(index)

    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        if tree is not None:
            raise ValueError("a Jacobi decoder drafts its own window (a chain or SJD-PAC's tree); remove "
                             "decoder.tree")
        b = self.batch
        if depth == 0:
            return empty_draft(b, self.vocab, self.device)
        self._t = t
        tokens, q = self.window(last_tokens, t, limit, depth)  # (B, L), (B, L, V)
        if not self.is_tree:
            return Draft(tokens=tokens, q=q, valid=chain_valid(limit, depth), forwards=[0] * b)
        return self.tree_draft(tokens, q, t, limit)

    def window(self, last_tokens: torch.Tensor, t: torch.Tensor, limit: torch.Tensor, depth: int):
        """The window slots 0..depth−1 of every image: carried drafts, then fresh initial tokens."""
        b, k, _ = self.q.shape
        carried = torch.minimum(self.carried, limit)[:, None]  # (B, 1)
        is_carried = _columns(depth, self.device) < carried  # (B, L)
        # the stored q of slots 0..k−1, zero rows after them (slots never carried there): a view, or padded
        q_carried = self.q[:, :depth] if k >= depth else torch.nn.functional.pad(self.q, (0, 0, 0, depth - k))
        x_carried = self.jacobi_update(q_carried, t)  # (B, L)
        if self.carry == "maximal":  # the coupled tokens observe fixed (−1: drawn here)
            x_fixed = torch.full((b, depth), -1, dtype=torch.long, device=self.device)
            x_fixed[:, : min(k, depth)] = self.x[:, :depth]
            x_carried = torch.where(x_fixed >= 0, x_fixed, x_carried)
        fresh = self.initial_tokens(x_carried, carried, last_tokens, t, depth, is_carried)  # (B, L)
        tokens = torch.where(is_carried, x_carried, fresh)
        if self.init == "random_uniform_q":
            q_fresh = torch.full_like(q_carried, 1.0 / self.vocab)
        else:
            q_fresh = torch.zeros_like(q_carried).scatter_(-1, fresh[..., None], 1.0)  # (B, L, V) one-hot
        return tokens, torch.where(is_carried[..., None], q_carried, q_fresh)

    def jacobi_update(self, q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Draws of the carried slots from their stored ``q`` (B, L, V) -> (B, L): ``independent`` and
        ``maximal`` by inverse CDF of the JACOBI uniforms (used by ``maximal`` only for the slot after the last
        old draft), ``gumbel`` as ``argmax(log q + g)`` with each absolute position's noise. Rows holding no
        carried distribution (all zero) give garbage that the caller discards."""
        depth = q.shape[1]
        if self.carry != "gumbel":
            return sample(q, self.streams.uniform(t, JACOBI, depth))  # (B, L)
        positions = t[:, None] + torch.arange(depth, device=t.device)  # (B, L) absolute image positions
        g = self.gumbel(positions)  # (B, L, V)
        return torch.where(q > 0, q.clamp_min(torch.finfo(q.dtype).tiny).log() + g, -torch.inf).argmax(-1)

    def gumbel(self, positions: torch.Tensor) -> torch.Tensor:
        """The Gumbel noise (B, L, V) of absolute image positions (B, L): a pure function of (seed, position)."""
        u = self.streams.uniform_grid(positions, GUMBEL, self.vocab)  # (B, L, V) in [0, 1)
        return -torch.log(-torch.log(u.clamp_min(2.0**-25)))  # u = 0 (one code in 2^24) as the smallest one

    def initial_tokens(self, carried_tokens: torch.Tensor, carried: torch.Tensor, last_tokens: torch.Tensor,
                       t: torch.Tensor, depth: int, is_carried: torch.Tensor) -> torch.Tensor:
        """Fresh tokens (B, L) for the window slots from each image's ``carried`` count (B, 1) on (earlier
        slots, ``is_carried`` (B, L), are ignored): uniform codes, or ``repeat_horizon`` copies of the left
        neighbour."""
        u = self.streams.uniform(t, INIT, depth)  # (B, L)
        uniform = (u * self.vocab).long().clamp_(max=self.vocab - 1)
        if self.init != "repeat_horizon":
            return uniform
        index = _columns(depth, self.device)  # (1, L)
        # a fresh slot (bool >: true and not carried) at column 0 starts a random run
        column0 = (((t[:, None] + index) % self.width) == 0) > is_carried
        source = torch.where(column0, index, -1).cummax(1).values  # the last column-0 slot so far (−1: none)
        # the left anchor of the fresh run: the last carried token (slot carried − 1), or the last committed one
        anchor = torch.cat([last_tokens[:, None], carried_tokens], 1).gather(1, carried)  # (B, 1)
        return torch.cat([anchor, uniform], 1).gather(1, source + 1)  # source −1 picks the anchor

    def tree_draft(self, tokens: torch.Tensor, q: torch.Tensor, t: torch.Tensor, limit: torch.Tensor) -> Draft:
        """SJD-PAC's tree over the window slots ``tokens``/``q`` (B, S) / (B, S, V) (module doc, (D))."""
        b, s = tokens.shape
        device = tokens.device
        tmpl = self.template_on(self._draft_len, device)
        slot, rank = tmpl.slot, tmpl.rank
        levels = min(tmpl.levels, s)
        # K candidates per branching level: rank 0 = the window slot's draft, ranks 1.. without replacement
        picks = tokens[:, :levels, None].expand(-1, -1, self.tree_width).clone()  # (B, Lv, K)
        conds = q[:, :levels, None].expand(-1, -1, self.tree_width, -1).clone()  # (B, Lv, K, V)
        enough = torch.ones(b, levels, self.tree_width, dtype=torch.bool, device=device)
        if levels:
            remaining = q[:, :levels].scatter(-1, tokens[:, :levels, None], 0.0)  # (B, Lv, V)
            u = self.streams.uniform(t, TREE, levels * self.tree_width).view(b, levels, self.tree_width)
            for r in range(1, self.tree_width):
                mass = remaining.sum(-1, keepdim=True)
                enough[:, :, r] = mass[..., 0] > 0
                conds[:, :, r] = remaining / mass.clamp_min(torch.finfo(q.dtype).tiny)
                picks[:, :, r] = sample(remaining, u[:, :, r])
                remaining = remaining.scatter(-1, picks[:, :, r, None], 0.0)
        lv = slot.clamp(max=max(levels - 1, 0))
        in_tree = slot < levels
        node_tokens = torch.where(in_tree, picks[:, lv, rank], tokens[:, slot.clamp(max=s - 1)])  # (B, M)
        node_q = torch.where(in_tree[None, :, None], conds[:, lv, rank], q[:, slot.clamp(max=s - 1)])
        ok = torch.where(in_tree, enough[:, lv, rank], True) & (slot[None, :] < limit[:, None])
        parents = tmpl.parents
        valid = ok.clone()
        for _ in range(tmpl.depth):  # a node is valid only under a valid parent
            valid = valid & torch.where(parents >= 0, valid[:, parents.clamp_min(0)], True)
        return Draft(tokens=node_tokens, q=node_q, valid=valid, forwards=[0] * b,
                     parents=parents.expand(b, -1))

    # -- the static decode path (coolsd.static): a window of exactly ``depth`` slots, state in fixed buffers ----
    static_path = True

    def static_begin(self, prefill, first_tokens, streams, depth, room=None) -> None:
        """``begin`` with persistent (B, depth) buffers: nothing carried, so the first window is all fresh."""
        b = first_tokens.shape[0]
        self.begin(None, prefill, first_tokens, streams)
        key = (b, depth)
        self._static = getattr(self, "_static", {})
        if key not in self._static:
            device = first_tokens.device
            self._static[key] = (torch.zeros(b, depth, self.vocab, device=device),
                                 torch.full((b, depth), -1, dtype=torch.long, device=device),
                                 torch.zeros(b, dtype=torch.long, device=device))
        self.q, self.x, self.carried = self._static[key]
        self.carried.zero_()

    def static_refill(self, rows, prefill, first_tokens, streams, depth, room=None) -> None:
        """``static_begin`` for the images of ``rows`` only (``Drafter.static_refill``): nothing carried there, so
        their next window is all fresh (their stale stored q and tokens are never read)."""
        if self.carried is None or getattr(self, "_static", {}).get((self.carried.shape[0], depth)) is None:
            raise RuntimeError("JacobiDrafter.static_refill: no static batch of this depth is running (call "
                               "static_begin first)")
        self.streams = streams
        self.carried.index_fill_(0, rows, 0)

    def static_propose(self, last_tokens, t, limit, depth, tree=None, cache=None) -> Draft:
        return self.propose(last_tokens, t, limit, depth, tree)

    def static_observe(self, out, p, draft, verdict, active) -> None:
        """``observe``, its results copied into the fixed buffers (a finished image's are stale and never read)."""
        buffers = (self.q, self.x, self.carried)
        self.observe(out, p, draft, verdict)
        for buffer, value in zip(buffers, (self.q, self.x, self.carried)):
            if value is not None and value is not buffer:
                buffer.copy_(value)
        self.q, self.x, self.carried = buffers

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        # the carry path: one node per depth below the last accepted node (the first is the rejected draft,
        # whose position is now committed); each further node is a carried slot with the target's distribution
        # at its position (the output at its parent), plus one slot after the path's last node
        b = p.shape[0]
        device = p.device
        m = draft.draft_len
        n = verdict.num_accepted
        if m == 0:  # an empty draft (the image's last token): nothing is carried
            self.q, self.x = p.new_zeros(b, 0, p.shape[-1]), torch.zeros(b, 0, dtype=torch.long, device=device)
            self.carried = torch.zeros(b, dtype=torch.long, device=device)
            return
        if draft.is_chain and self.carry != "maximal":  # the path's nodes are n, n + 1, ... (below)
            self._observe_chain(p, draft, n, m)
            return
        if draft.is_chain:  # below node n − 1 (the root for n = 0): nodes n, n + 1, ... of the drafted prefix
            path = n[:, None] + torch.arange(m, device=device)  # (B, m)
            path = torch.where(path < draft.valid.sum(-1, keepdim=True), path, -1)
            parents = torch.arange(-1, m - 1, device=device)  # node j's parent: j − 1
        else:
            tmpl = self.template_on(m, device)
            last = verdict.path.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0]
            path = tmpl.carry_path[torch.where(n > 0, last + 1, 0)]  # (B, C)
            path = torch.where((path >= 0) & draft.valid.gather(1, path.clamp_min(0)), path, -1)
            path = torch.where(path.lt(0).long().cummax(1).values.bool(), -1, path)  # stop at the first gap
            parents = tmpl.parents
        carried = (path >= 0).sum(-1)  # (B,): the path's 2nd..last nodes + one slot after its last node
        width = path.shape[1]  # a bound on every image's carried count, known without a host sync; slots past
        # an image's count are garbage that ``window`` never reads (slot k's draws do not depend on the width)
        k = torch.arange(width, device=device)
        pad = torch.full((b, width + 1), -1, dtype=torch.long, device=device)
        pad[:, : min(path.shape[1], width + 1)] = path[:, : width + 1]
        old_node = pad[:, 1:]  # (B, width) the old draft of carried slot k: path[k + 1] (−1: the last slot)
        has_old = old_node >= 0
        p_rows = torch.where(has_old, parents[old_node.clamp_min(0)] + 1, pad[:, :width] + 1)  # output at the parent
        p_rows = torch.where(k[None, :] < carried[:, None], p_rows, 0)
        q_new = p.gather(1, p_rows[..., None].expand(-1, -1, p.shape[-1]))  # (B, width, V)
        x_new = torch.full((b, width), -1, dtype=torch.long, device=device)
        if self.carry == "maximal":
            j = old_node.clamp_min(0)
            x_old = draft.tokens.gather(1, j)
            q_old = draft.q.gather(1, j[..., None].expand(-1, -1, draft.q.shape[-1]))
            u = self.streams.uniform(self._t, COUPLE, 2 * width).view(b, width, 2)
            keep = u[..., 0] < ratio_acceptance(q_new.gather(-1, x_old[..., None])[..., 0],
                                                q_old.gather(-1, x_old[..., None])[..., 0])
            resampled = sample(vanilla_residual(q_new, q_old), u[..., 1])
            x_new = torch.where(has_old, torch.where(keep, x_old, resampled), -1)
            if self.carried_q == "reference_code":  # SCD's code: a kept draft keeps its old q
                q_new = torch.where((has_old & keep)[..., None], q_old, q_new)
        self.q, self.x, self.carried = q_new, x_new, carried

    def _observe_chain(self, p: torch.Tensor, draft: Draft, n: torch.Tensor, m: int) -> None:
        """``observe`` of a chain without coupled tokens, in closed form: the carry path is nodes n .. d − 1 (d
        = the image's drafted count), so slot k (k < d − n) is carried with the target's output at row
        n + k + 1 (its old node's parent's output, or after the last node the output at that node); the
        general construction's values, fewer calls. Slots past an image's count hold row 0 (never read)."""
        carried = draft.valid.sum(-1) - n  # (B,)
        rows = torch.where(_columns(m, self.device) < carried[:, None], n[:, None] + _columns(m, self.device, 1), 0)
        self.q = p.gather(1, rows[..., None].expand(-1, -1, self.vocab))  # (B, m, V)
        self.x, self.carried = None, carried  # x: only the maximal carry couples tokens
