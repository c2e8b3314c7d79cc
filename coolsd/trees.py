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
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from coolsd import validate
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


@dataclass(frozen=True)
class Expansion:
    """A request to a drafter: run the listed nodes and return the draft distributions of their children.

    ``nodes`` (F,) node indices (−1 = the root, i.e. the last committed token), ``tokens`` (F,),
    ``positions`` (F,) image positions, ``parents`` (F,) node index of each node's parent (−1 root, −2 for
    the root itself), ``mask`` (F, K) bool over the K drafter slots written since the tree started
    (earlier expansions in order, then these F nodes).
    """

    nodes: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    parents: torch.Tensor
    mask: torch.Tensor


ExpandFn = Callable[[Expansion], torch.Tensor]


class _Slots:
    """Bookkeeping of which drafter slot holds which node, to build the masks of later expansions."""

    def __init__(self) -> None:
        self.nodes: list[int] = []  # node index per slot (−1 = root)
        self.lineage: dict[int, set[int]] = {-1: {-1}}

    def request(self, nodes: list[int], tokens: list[int], parents: list[int], root_pos: int,
                depths: dict[int, int], device: torch.device) -> Expansion:
        for n, par in zip(nodes, parents):
            if n != -1:
                self.lineage[n] = self.lineage[par] | {n}
        slots = self.nodes + nodes
        mask = torch.tensor([[s in self.lineage[n] for s in slots] for n in nodes], dtype=torch.bool)
        self.nodes = slots
        return Expansion(
            nodes=torch.tensor(nodes, device=device),
            tokens=torch.tensor(tokens, device=device),
            positions=torch.tensor([root_pos + depths.get(n, 0) for n in nodes], device=device),
            parents=torch.tensor([par if n != -1 else -2 for n, par in zip(nodes, parents)], device=device),
            mask=mask.to(device),
        )


def draft_static_tree(shape: TreeShape, root_token: torch.Tensor, root_pos: int, expand: ExpandFn,
                      generator: torch.Generator | None) -> Draft:
    """Sample a static tree level by level (children without replacement, conditional q per child).

    Nodes whose parent distribution has fewer non-zero entries than the shape asks for are dropped (with
    their subtrees), so the returned tree may be a subset of ``shape``.
    """
    device = root_token.device
    slots = _Slots()
    shape_parents = shape.parents()
    kids = children_of(shape_parents)
    shape_depth = depths_of(shape_parents)
    kept: dict[int, int] = {}  # shape node -> draft node
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    parents: list[int] = []
    depth_of: dict[int, int] = {-1: 0}
    frontier = [-1]  # shape nodes (with children) to expand next; -1 = root
    forwards = 0
    while frontier:
        req_tokens = [int(root_token) if s == -1 else tokens[kept[s]] for s in frontier]
        req_nodes = [-1 if s == -1 else kept[s] for s in frontier]
        req_parents = [-1 if s == -1 else parents[kept[s]] for s in frontier]
        q = expand(slots.request(req_nodes, req_tokens, req_parents, root_pos,
                                 {n: depth_of[n] for n in req_nodes}, device))  # (F, V)
        forwards += 1
        next_frontier = []
        positive = (q > 0).sum(-1).tolist()  # non-zero entries per row: one host sync per level, not per node
        for row, s in enumerate(frontier):
            children = kids[s + 1]
            dist = q[row].float()
            count = min(len(children), positive[row])
            if count == 0:
                continue
            picks = torch.multinomial(dist, count, replacement=False, generator=generator)
            remaining = dist.clone()
            for child, x in zip(children[:count], picks.tolist()):
                kept[child] = len(tokens)
                depth_of[len(tokens)] = shape_depth[child]
                tokens.append(x)
                parents.append(-1 if s == -1 else kept[s])
                qs.append(remaining / remaining.sum())  # a new tensor: zeroing `remaining` leaves it intact
                remaining[x] = 0.0
                if kids[child + 1]:
                    next_frontier.append(child)
        frontier = next_frontier
    return _tree_draft(tokens, qs, parents, forwards, device, q_dim=q.shape[-1])


def draft_dynamic_tree(spec: DynamicTree, max_depth: int, root_token: torch.Tensor, root_pos: int,
                       expand: ExpandFn) -> Draft:
    """EAGLE-2: grow by cumulative log q, keep the ``total_tokens`` best nodes; q one-hot (deterministic).

    Every expanded node proposes its ``top_k`` children (all scored); the global ``top_k`` of those become
    the next frontier. After ``min(depth + 1, max_depth)`` draft levels the best ``total_tokens`` candidates
    form the tree (ancestors score at least as high as their descendants, and win ties by depth).
    """
    device = root_token.device
    slots = _Slots()
    levels = min(spec.depth + 1, max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depth: list[int] = []
    frontier: list[int] = [-1]
    forwards = 0
    v = 0
    for level in range(1, levels + 1):
        q = expand(slots.request(frontier, [int(root_token) if n == -1 else tokens[n] for n in frontier],
                                 [-1 if n == -1 else parents[n] for n in frontier], root_pos,
                                 {n: 0 if n == -1 else depth[n] for n in frontier}, device))  # (F, V)
        forwards += 1
        v = q.shape[-1]
        # the frontier's cumulative scores, rounded to float32 as before; children add Python-float logs
        # (one tensor op per level instead of three per candidate, and no device sync per candidate)
        base = torch.tensor([0.0 if n == -1 else scores[n] for n in frontier]).tolist()
        new: list[int] = []
        for row, node in enumerate(frontier):
            dist = q[row].float()
            top = torch.topk(dist, min(spec.top_k, int((dist > 0).sum())))
            for prob, x in zip(top.values.tolist(), top.indices.tolist()):
                new.append(len(tokens))
                tokens.append(x)
                parents.append(node)
                scores.append(base[row] + math.log(prob))
                depth.append(level)
        frontier = sorted(new, key=lambda n: -scores[n])[: spec.top_k]
    if not tokens:
        return _tree_draft([], [], [], forwards, device, q_dim=v)
    chosen = sorted(range(len(tokens)), key=lambda n: (-scores[n], depth[n], n))[: spec.total_tokens]
    order = sorted(chosen, key=lambda n: (depth[n], parents[n], -scores[n], n))  # siblings best first
    index = {n: i for i, n in enumerate(order)}
    picked = torch.tensor([tokens[n] for n in order], device=device)
    one_hot = torch.nn.functional.one_hot(picked, v).float()  # (M, V): q ≡ 1 on each drafted token
    return _tree_draft([tokens[n] for n in order], list(one_hot),
                       [-1 if parents[n] == -1 else index[parents[n]] for n in order], forwards, device, q_dim=v)


def _tree_draft(tokens: list[int], qs: list[torch.Tensor], parents: list[int], forwards: int,
                device: torch.device, q_dim: int) -> Draft:
    if not tokens:
        return Draft(tokens=torch.empty(0, dtype=torch.long, device=device), q=torch.empty(0, q_dim, device=device),
                     forwards=forwards, parents=torch.empty(0, dtype=torch.long, device=device))
    return Draft(tokens=torch.tensor(tokens, device=device), q=torch.stack(qs), forwards=forwards,
                 parents=torch.tensor(parents, device=device))
