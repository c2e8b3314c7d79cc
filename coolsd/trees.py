"""Draft trees: static shapes loaded from data files (EAGLE-1), dynamic trees (EAGLE-2), tree masks, and
the generic tree-drafting procedures every drafter shares.

A static shape is a list of paths (EAGLE's "choices"): ``[a, b]`` is the b-th child of the a-th child of
the root, child ranks being the order in which the drafter proposes them. Shapes live in
``coolsd/trees/<name>.json`` (``naive_extend_57`` for LlamaGen, ``mc_sim_7b_63`` — EAGLE-1's 25-node tree — for
Lumina-mGPT, ``chain``); a user adds one by adding a file, or passes a path.

Nodes are numbered 0..M−1 in (depth, path) order, so parents come before children and siblings appear in
rank order; ``parents[j] = −1`` marks a child of the root (the last committed token).

Drafting (``draft_static_tree``, ``draft_dynamic_tree``) is written once; a drafter only supplies
``expand(request) -> q``: the draft distributions (F, V) of the children of the requested nodes.

* Static (EAGLE-1): each node's children are sampled **without replacement** from the node's processed
  draft distribution; child i keeps its conditional distribution ``q`` with the earlier siblings removed
  and renormalised (that is the ``q'`` of the multi-draft acceptance walk).
* Dynamic (EAGLE-2, after SafeAILab/EAGLE ``cnets.py: topK_genrate`` and jadohu/LANTERN): expand the
  top-k frontier by cumulative draft log-probability for ``depth`` levels, then keep the ``total_tokens``
  best nodes. Drafts are deterministic, so each node's ``q`` is one-hot on its token (q ≡ 1).

Example: ``python run.py decoder=sd decoder.tree=mc_sim_7b_63``; ``decoder.tree=dynamic``.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from coolsd import validate
from coolsd.rng import DRAFT, sample
from coolsd.types import Draft

TREE_DIR = Path(__file__).resolve().parent / "trees"


@dataclass(frozen=True)
class TreeShape:
    """A static draft tree: ``paths`` sorted by (depth, path)."""

    name: str
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def load(cls, name_or_path: str) -> "TreeShape":
        path = Path(name_or_path)
        if not path.suffix:
            path = TREE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in TREE_DIR.glob("*.json"))
            raise ValueError(f"decoder.tree={name_or_path!r} is neither a known shape {known + ['dynamic']} "
                             f"nor a JSON file")
        fix = 'a tree file is {"name": "<name>", "paths": [[0], [1], [0, 0], ...]} (see coolsd/trees/*.json)'
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"decoder.tree file {path} is not valid JSON ({e}); {fix}") from None
        if not isinstance(data, dict) or "paths" not in data:
            raise ValueError(f"decoder.tree file {path} has no `paths` list; {fix}")
        try:
            return cls.from_paths(str(data.get("name", path.stem)), data["paths"])
        except ValueError as e:
            raise ValueError(f"decoder.tree file {path}: {e}; {fix}") from None

    @classmethod
    def from_paths(cls, name: str, paths: Sequence[Sequence[int]]) -> "TreeShape":
        """Validate and order ``paths``: non-empty lists of child ranks (integers >= 0), each path once,
        every parent and every lower-ranked sibling present."""
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ValueError(f"tree {name!r}: `paths` must be a non-empty list of paths, got {paths!r}")
        parsed = []
        for p in paths:
            if (not isinstance(p, (list, tuple)) or not p
                    or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in p)):
                raise ValueError(f"tree {name!r}: path {p!r} is not a non-empty list of child ranks "
                                 "(integers >= 0)")
            parsed.append(tuple(p))
        ordered = tuple(sorted(parsed, key=lambda p: (len(p), p)))
        duplicates = sorted(p for p, n in Counter(parsed).items() if n > 1)
        if duplicates:
            raise ValueError(f"tree {name!r}: paths {[list(p) for p in duplicates]} are listed more than once")
        known = set(ordered)
        for p in ordered:
            if p[:-1] and p[:-1] not in known:
                raise ValueError(f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
                raise ValueError(f"tree {name!r}: path {list(p)} skips a sibling rank")
        return cls(name=name, paths=ordered)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, max_depth: int) -> "TreeShape":
        return TreeShape(self.name, tuple(p for p in self.paths if len(p) <= max_depth))

    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: frontier ``top_k``, ``depth`` expansion levels, ``total_tokens`` kept nodes."""

    top_k: int = 10
    depth: int = 5
    total_tokens: int = 58

    def __post_init__(self) -> None:
        for key in ("top_k", "depth", "total_tokens"):
            validate.integer(f"decoder.dynamic_tree.{key}", getattr(self, key), minimum=1)


def resolve_tree(tree: str | None, dynamic_tree: dict | None) -> TreeShape | DynamicTree | None:
    """The decoder's ``tree`` option: None (a chain of ``draft_len``), ``dynamic`` or a static shape."""
    if tree is None:
        return None
    if tree == "dynamic":
        spec = validate.mapping("decoder.dynamic_tree", dynamic_tree, validate.DYNAMIC_TREE_KEYS, optional=True)
        return DynamicTree(**(spec or {}))
    return TreeShape.load(tree)


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """(M+1, M+1) bool over [root, nodes...]: entry (i, j) is True iff j is i itself or an ancestor of i."""
    rows = [[True] + [False] * len(parents)]  # built as Python lists: one tensor op instead of 2 per node
    for j, par in enumerate(parents):
        row = list(rows[par + 1])  # the parent's ancestors (parents come before children); the root is row 0
        row[j + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def depths_of(parents: Sequence[int]) -> list[int]:
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Children (node indices, in order) of the root (entry 0) and of every node j (entry j + 1)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, par in enumerate(parents):
        kids[par + 1].append(j)
    return kids


def ancestor_masks(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """Per-image (B, M+1, M+1) bool over [root, nodes...] from parents (B, M) (−1 = root): entry (i, j) is
    True iff j is i itself or an ancestor of i. Pointer jumping: one gather per tree level, until every pointer
    has reached the root (a host read per level), or exactly ``levels`` times (no host read: the static path,
    with ``levels`` at least the tree's depth)."""
    b, m = parents.shape
    device = parents.device
    up = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), parents + 1], dim=1)  # (B, M+1)
    mask = torch.eye(m + 1, dtype=torch.bool, device=device).expand(b, -1, -1).clone()
    ptr = up
    for _ in range(m + 1 if levels is None else levels):
        mask.scatter_(-1, ptr[:, :, None], True)
        nxt = up.gather(1, ptr)
        if levels is None and torch.equal(nxt, ptr):  # every pointer has reached the root
            return mask
        ptr = nxt
    return mask


@dataclass(frozen=True)
class Expansion:
    """A request to a drafter: run the listed nodes of every image and return the draft distributions of
    their children.

    ``root``: the request for the last committed token (the drafter feeds what it has pending instead and
    returns one row). Otherwise ``tokens`` (B, F) and ``positions`` (B, F) (image positions) of the nodes,
    ``parent_index`` (B, F) the row of each node's parent in the previous request (whose outputs the drafter
    kept), and ``mask`` (F, K) shared or (B, F, K) per image, bool over the K drafter slots written since
    the tree started (the root, earlier requests in order, then these F nodes).
    """

    root: bool
    tokens: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    parent_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftRows:
    """What an expansion returns: draft distributions (B, F, V) and, per image, whether the drafter's logits
    were finite (B,) (None: not checked)."""

    q: torch.Tensor
    finite: torch.Tensor | None = None


ExpandFn = Callable[[Expansion], DraftRows]


@dataclass(frozen=True)
class _Level:
    """One level of a static shape's plan: the frontier (shape nodes to expand), each frontier node's parent
    row in the previous request, its children (shape node per rank, −1 padded) and the request mask."""

    frontier: tuple[int, ...]
    parent_row: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    mask: torch.Tensor  # (F, K)


def _static_plan(shape: TreeShape) -> tuple[_Level, ...]:
    """The expansion plan of a static shape (same for every image), computed once per shape."""
    cached = _PLANS.get(shape)
    if cached is not None:
        return cached
    parents = shape.parents()
    kids = children_of(parents)
    depth = depths_of(parents)
    levels = []
    slot: dict[int, int] = {-1: 0}  # shape node -> drafter slot since the tree started (the root is slot 0)
    lineage: dict[int, list[int]] = {-1: [0]}
    frontier = [-1]
    previous: list[int] = []
    next_slot = 1
    while frontier:
        if frontier != [-1]:
            for node in frontier:
                slot[node] = next_slot
                lineage[node] = lineage[parents[node]] + [next_slot]
                next_slot += 1
        width = max(len(kids[node + 1]) for node in frontier)
        mask = torch.zeros(len(frontier), next_slot, dtype=torch.bool)
        for f, node in enumerate(frontier):
            mask[f, lineage[node]] = True
        levels.append(_Level(
            frontier=tuple(frontier),
            parent_row=tuple(previous.index(parents[node]) if node != -1 and parents[node] != -1 else 0
                             for node in frontier),
            children=tuple(tuple(kids[node + 1]) + (-1,) * (width - len(kids[node + 1])) for node in frontier),
            mask=mask))
        previous = frontier
        frontier = [c for node in frontier for c in kids[node + 1] if kids[c + 1]]
        frontier.sort(key=lambda c: (depth[c], c))
    plan = tuple(levels)
    _PLANS[shape] = plan
    return plan


_PLANS: dict[TreeShape, tuple[_Level, ...]] = {}
DRAW_STRIDE = 1024  # draw-index stride between a level's (frontier, rank) slots: more than any tree depth
_SHAPED: dict[tuple, Any] = {}


def _shaped(key: tuple, make: Callable[[], Any], cache: dict | None = None) -> Any:
    """A value of the tree code that depends only on shapes (``key``: what it is, its sizes, the device), made once;
    the callers only read it (they gather, concatenate and repeat it into new tensors). ``cache``: the caller's own
    store instead of the module's (the static path's: a compiled step guards on the store it reads, so a store
    that other decoders also fill would recompile it)."""
    store = _SHAPED if cache is None else cache
    out = store.get(key)
    if out is None:
        if len(store) > 4096:  # many batch sizes over a long mixed run: start again
            store.clear()
        out = store[key] = make()
    return out


def _draw_index(shape: TreeShape, levels: int, device: torch.device, cache: dict | None = None
                ) -> tuple[torch.Tensor, list[int]]:
    """The draw indices of the first ``levels`` levels of ``shape``'s plan, concatenated, and where each level's
    (F·C) block starts: (frontier f, rank r) at level l draws l + STRIDE·(f·C + r)."""
    def make() -> tuple[torch.Tensor, list[int]]:
        blocks, offsets = [torch.zeros(0, dtype=torch.long, device=device)], [0]
        for level, plan in enumerate(_static_plan(shape)[:levels]):
            n = len(plan.frontier) * len(plan.children[0])
            blocks.append(level + DRAW_STRIDE * torch.arange(n, device=device))
            offsets.append(offsets[-1] + n)
        return torch.cat(blocks), offsets

    return _shaped(("draw index", shape, levels, device), make, cache)


@dataclass(frozen=True)
class _LevelTensors:
    """A static plan level's constants on a device (``_level_tensors``): the frontier nodes, their parent rows, the
    request mask, and the created children as index tensors (no boolean-mask indexing: no host read)."""

    frontier: torch.Tensor  # (F,)
    parent_row: torch.Tensor  # (F,)
    mask: torch.Tensor  # (F, K)
    width: int  # C: the most children of a frontier node
    slots: torch.Tensor  # (n,) positions in the level's flattened (F·C) picks that create a node
    nodes: torch.Tensor  # (n,) the shape node each of them creates


def _level_tensors(shape: TreeShape, level: int, device: torch.device, cache: dict | None = None) -> _LevelTensors:
    def make() -> _LevelTensors:
        plan = _static_plan(shape)[level]
        flat = [c for row in plan.children for c in row]
        slots = [i for i, c in enumerate(flat) if c >= 0]
        return _LevelTensors(frontier=torch.tensor(plan.frontier, device=device),
                             parent_row=torch.tensor(plan.parent_row, device=device), mask=plan.mask.to(device),
                             width=len(plan.children[0]), slots=torch.tensor(slots, device=device),
                             nodes=torch.tensor([flat[i] for i in slots], device=device))

    return _shaped(("level", shape, level, device), make, cache)


def draft_static_tree(shape: TreeShape, root_pos: torch.Tensor, limit: torch.Tensor, expand: ExpandFn,
                      streams, key_pos: torch.Tensor, static: bool = False, cache: dict | None = None) -> Draft:
    """Sample a static tree for every image, level by level (children without replacement, conditional q).

    ``root_pos`` (B,) image position of each root (the last committed token), ``limit`` (B,) how many more
    draft levels fit in each image; ``streams`` (``coolsd.rng.Streams``) and ``key_pos`` (B,) key the draws. A
    node is invalid (never tested) when its parent's distribution has fewer non-zero entries than its rank, when
    its parent is invalid, or when it lies deeper than the image's limit. ``static``: every level of the shape
    is drafted whatever the limits (the static path's fixed shapes; nodes past a limit are invalid) and the
    forward counts stay on the device: no host read. ``cache``: where its shape constants are kept (``_shaped``).
    """
    device = root_pos.device
    b = root_pos.shape[0]
    parents_list = shape.parents()
    m = len(parents_list)
    depth = _shaped(("depths", shape, device), lambda: torch.tensor(depths_of(parents_list), device=device), cache)
    levels_needed = shape.depth if static else min(shape.depth, int(limit.max()) if b else 0)
    tokens = torch.zeros(b, m, dtype=torch.long, device=device)
    valid = torch.zeros(b, m, dtype=torch.bool, device=device)
    qs: torch.Tensor | None = None
    finite = None
    # every level's draws in one call (the hash is elementwise: the same uniforms as one call per level)
    index, offsets = _draw_index(shape, levels_needed, device, cache)
    u_all = streams.uniform_at(key_pos, DRAFT, index) if levels_needed else None
    for level in range(levels_needed):
        plan = _level_tensors(shape, level, device, cache)
        if level == 0:
            request = Expansion(root=True)
        else:
            front = plan.frontier
            request = Expansion(root=False, tokens=tokens[:, front], positions=root_pos[:, None] + depth[front],
                                parent_index=plan.parent_row.expand(b, -1), mask=plan.mask)
        rows = expand(request)
        finite = rows.finite if finite is None or rows.finite is None else finite & rows.finite
        q = rows.q.float()  # (B, F, V)
        v = q.shape[-1]
        if qs is None:
            qs = torch.zeros(b, m, v, device=device)
        width = plan.width
        f = plan.frontier.shape[0]
        # children without replacement, one rank at a time: rank r is drawn from what ranks < r left; the
        # draw index of (frontier f, rank r) at level l is l + STRIDE·(f·C + r) (``_draw_index``), so a
        # one-path tree draws exactly what a chain does
        u = u_all[:, offsets[level]: offsets[level + 1]].view(b, f, width).unbind(-1)
        remaining = q.clone()
        picks, cond = [], []
        for r in range(width):
            cond.append(remaining / remaining.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny))
            picks.append(sample(remaining, u[r]))
            if r + 1 < width:  # what the next rank draws from
                remaining = remaining.scatter(-1, picks[-1][..., None], 0.0)
        picks, cond = torch.stack(picks, 2), torch.stack(cond, 2)  # (B, F, C), (B, F, C, V)
        enough = _shaped(("ranks", width, device), lambda: torch.arange(width, device=device), cache) \
            < (q > 0).sum(-1, keepdim=True)  # (B, F, C)
        parent_ok = valid[:, plan.frontier] if level else torch.ones(b, 1, dtype=torch.bool, device=device)
        node = plan.nodes  # (n,) shape nodes created at this level
        tokens[:, node] = picks.flatten(1)[:, plan.slots]
        qs[:, node] = cond.flatten(1, 2)[:, plan.slots]
        ok = (enough & parent_ok[:, :, None]).flatten(1)[:, plan.slots] & (depth[node] <= limit[:, None])
        valid[:, node] = ok
    if qs is None:  # nothing fits: an empty tree
        qs = torch.zeros(b, m, 1, device=device)
    forwards = torch.clamp(limit, max=levels_needed)
    return Draft(tokens=tokens, q=qs, valid=valid, forwards=forwards if static else forwards.tolist(),
                 parents=_shaped(("parents", shape, b, device), lambda: torch.tensor(
                     parents_list, device=device).expand(b, -1), cache), finite=finite)


def draft_dynamic_tree(spec: DynamicTree, root_pos: torch.Tensor, limit: torch.Tensor, expand: ExpandFn,
                       static: bool = False, cache: dict | None = None) -> Draft:
    """EAGLE-2 for every image: grow by cumulative log q, keep the ``total_tokens`` best nodes; q one-hot.

    Every expanded node proposes its ``top_k`` children (all scored); each image's ``top_k`` best new
    candidates become its next frontier. After ``min(depth + 1, limit)`` draft levels the best
    ``total_tokens`` candidates form the tree (ancestors score at least as high as their descendants, and
    win ties by depth); siblings are ordered best first. Candidates of zero draft probability, or deeper
    than an image's limit, are invalid. ``static``: all ``depth + 1`` levels whatever the limits, forward counts
    on the device (the static path: no host read). ``cache``: where its shape constants are kept (``_shaped``).
    """
    device = root_pos.device
    b = root_pos.shape[0]
    k = spec.top_k
    levels = spec.depth + 1 if static else min(spec.depth + 1, int(limit.max()) if b else 0)
    tok, par, score, depth, front_row = [], [], [], [], []  # per level, (B, n_level)
    frontier = None  # (B, F) candidate ids of the current frontier
    lineage = _shaped(("lineage", b, device),  # (B, F, K)
                      lambda: torch.ones(b, 1, 1, dtype=torch.bool, device=device), cache)
    finite = None
    v = 1
    for level in range(1, levels + 1):
        if level == 1:
            request = Expansion(root=True)
        else:
            all_tok, all_rows = torch.cat(tok, 1), torch.cat(front_row, 1)
            request = Expansion(root=False, tokens=all_tok.gather(1, frontier),
                                positions=(root_pos[:, None] + (level - 1)).expand_as(frontier),
                                parent_index=all_rows.gather(1, frontier), mask=lineage)
        rows = expand(request)
        finite = rows.finite if finite is None or rows.finite is None else finite & rows.finite
        q = rows.q.float()  # (B, F, V)
        f, v = q.shape[1], q.shape[-1]
        top = torch.topk(q, min(k, v), dim=-1)  # (B, F, k)
        kk = top.indices.shape[-1]
        base = _shaped(("root score", b, device), lambda: torch.zeros(b, 1, device=device), cache) \
            if frontier is None else torch.cat(score, 1).gather(1, frontier)
        new_score = (base[:, :, None] + top.values.log()).flatten(1)  # (B, F·k); log 0 = -inf: invalid
        tok.append(top.indices.flatten(1))
        par.append(_shaped(("root parent", b, kk, device), lambda: torch.full((b, kk), -1, device=device), cache)
                   if frontier is None else frontier.repeat_interleave(kk, dim=1))
        score.append(new_score)
        depth.append(_shaped(("depth", b, f * kk, level, device),
                             lambda: torch.full((b, f * kk), level, dtype=torch.long, device=device), cache))
        front_row.append(_shaped(("frontier row", b, f, kk, device),  # each candidate's row in this request
                                 lambda: torch.arange(f, device=device).repeat_interleave(kk).expand(b, -1), cache))
        offset = sum(x.shape[1] for x in tok[:-1])
        best = torch.topk(new_score, min(k, new_score.shape[1]), dim=-1).indices  # (B, F')
        if level < levels:  # the next frontier's slots: this request's slots plus one block of F' new ones
            f_next = best.shape[1]
            parent_pos = front_row[-1].gather(1, best)  # row of each new frontier node's parent in this request
            old = lineage.gather(1, parent_pos[:, :, None].expand(-1, -1, lineage.shape[-1]))  # (B, F', K)
            own = _shaped(("eye", b, f_next, device),
                          lambda: torch.eye(f_next, dtype=torch.bool, device=device).expand(b, -1, -1), cache)
            lineage = torch.cat([old, own], dim=-1)
        frontier = best + offset
    if not tok:
        empty = torch.zeros(b, 0, dtype=torch.long, device=device)
        return Draft(tokens=empty, q=torch.zeros(b, 0, v, device=device), valid=empty.bool(),
                     forwards=[0] * b, parents=empty, finite=finite)
    tok, par, score, depth = (torch.cat(x, 1) for x in (tok, par, score, depth))
    score = torch.where(depth <= limit[:, None], score, float("-inf"))
    n = tok.shape[1]
    m = min(spec.total_tokens, n)
    # best first: by score, ties by depth, then by candidate index (stable sorts, least significant first)
    order = torch.argsort(depth, dim=1, stable=True)
    order = order.gather(1, torch.argsort(-score.gather(1, order), dim=1, stable=True))
    chosen = order[:, :m].sort(dim=1).values  # (B, M) candidate ids, ascending
    # tree order: by depth, parent candidate, best first, candidate id
    for key in (-score, par, depth):
        chosen = chosen.gather(1, torch.argsort(key.gather(1, chosen), dim=1, stable=True))
    index = torch.full((b, n + 1), -1, dtype=torch.long, device=device)  # candidate id + 1 -> node index
    index.scatter_(1, chosen + 1, torch.arange(m, device=device).expand(b, -1))
    parents = index.gather(1, par.gather(1, chosen) + 1)
    valid = torch.isfinite(score.gather(1, chosen))
    tokens = tok.gather(1, chosen)
    q = torch.zeros(b, m, v, device=device).scatter_(-1, tokens[..., None], 1.0)  # (B, M, V): q ≡ 1 on each draft
    forwards = torch.clamp(limit, max=levels)
    return Draft(tokens=tokens, q=q, valid=valid, forwards=forwards if static else forwards.tolist(), parents=parents,
                 finite=finite)
