"""The acceptance-rule interface and the verification steps every decoder shares (chains and trees).

A rule is a pair (acceptance function ``f``, resampling distribution ``G``) over the target distribution
``p`` and the draft distribution ``q`` (``docs/algorithms.md``, "Relaxed acceptance"): a draft
``x ~ q`` is accepted with probability ``f(x)``; after a rejection the next token is drawn from ``G``. One step
then outputs ``P̂(y) = q(y) f(y) + β G(y)`` with ``β = 1 − Σ q f``, and its total-variation distance to ``p``
is the quantity the COOL-SD paper bounds (``one_step_tv``).

Rules are small pure objects; they never see a model, a cache or a loop. They work on rows: ``p``, ``q``
(N, V), drafted tokens ``x`` (N,) and ``depth`` (N,), the 1-based position ``i`` inside the draft block (the
depth in a tree), so one call serves every image of a batch. The verification steps take every random
number from the caller (per-image counter-based uniforms, ``coolsd.rng``), so an image's outcome does not
depend on its batch neighbours.

``ExactRule`` (vanilla speculative sampling, lossless) lives here because the core itself needs it: plain AR
decoding (``draft_len = 0``) and the drafter training's validation (``coolsd.training``) run with it, and
``baselines`` re-export it under the name the decoder configs use (``baselines.exact.ExactRule``).

Example: ``python run.py decoder=sd`` uses ``ExactRule`` through ``verify_chain``.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coolsd.rng import sample
from coolsd.sampling import normalize
from coolsd.trees import _shaped, ancestor_masks, children_of
from coolsd.types import Draft, Verdict


def ratio_acceptance(p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``min(1, weight·p/q)`` elementwise; 1 where ``q == 0`` (such a token is never drafted).

    The arithmetic every rule shares (vanilla SD: weight 1; COOL-SD: ω_i; LANTERN: ``p̃`` in place of ``p``).
    """
    return torch.where(q > 0, _weighted_ratio(p, q, weight).clamp(max=1.0), 1.0)


def unclipped_ratio(p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``weight·p/q`` elementwise, not clipped at 1; 1 where ``q == 0`` (such a token is never drafted).

    ``ratio_acceptance`` is this clipped at 1, bit for bit (the same operations in the same order).
    """
    return torch.where(q > 0, _weighted_ratio(p, q, weight), 1.0)


def _weighted_ratio(p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
    """``weight·p / max(q, tiny)``; a weight of exactly 1.0 (a Python float) is not multiplied (``1.0·x`` is
    ``x``)."""
    num = p if isinstance(weight, float) and weight == 1.0 else weight * p
    return num / q.clamp_min(torch.finfo(q.dtype).tiny)


def vanilla_residual(p: torch.Tensor, q: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """``norm([p − q]_+)`` row-wise, falling back to ``fallback`` (default ``p``) where it has no mass."""
    return normalize((p - q).clamp_min(0.0), fallback=p if fallback is None else fallback)


class AcceptanceRule(abc.ABC):
    """A relaxed (or exact) speculative acceptance rule."""

    #: True when the rule reproduces ``p`` exactly (its one-step TV is 0 and need not be computed).
    lossless: bool = False

    @abc.abstractmethod
    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """``f(y)`` for every token: p, q (N, V), depth (N,) -> (N, V) in [0, 1]."""

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """``f(x)`` of the drafted tokens only: p, q (N, V), x (N,), depth (N,) -> (N,).

        A rule with a ratio gives ``min(1, r(x))`` from the drafted tokens' entries alone (the loop's per-test
        call: no pass over the codebook); one without takes ``acceptance`` at ``x``."""
        if self.has_ratio:
            return self.ratio(p, q, x, depth).clamp(max=1.0)
        return self.acceptance(p, q, depth).gather(-1, x[:, None]).squeeze(-1)

    def ratio(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """The unclipped ratio ``r(x)`` (N,) whose ``min(1, r)`` is ``accept_prob`` (p, q (N, V), x, depth (N,)).

        Joint tests over several tokens (``baselines.sv``) multiply these before clipping. A rule whose
        acceptance is not ``min(1, r)`` of a ratio does not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} has no unclipped acceptance ratio (AcceptanceRule.ratio)")

    @property
    def has_ratio(self) -> bool:
        """Whether the rule defines ``ratio`` (the unclipped ratio a joint test multiplies)."""
        return type(self).ratio is not AcceptanceRule.ratio

    @abc.abstractmethod
    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        """Resampling distributions ``G`` (N, V) after rejecting drafts ``x`` (N,) at ``depth`` (N,).

        ``x`` is None when a rule whose ``G`` does not depend on the rejected token is asked for it in general.
        """

    def one_step_tv(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Exact TV(P̂, p) (N,) of one acceptance step per row (p, q (N, V), depth (N,)).

        The default assumes ``G`` does not depend on the rejected token; rules whose ``G`` does override it.
        """
        if self.lossless:
            return torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)
        return 0.5 * (output_distribution(self, p, q, depth) - p).abs().sum(-1).double()


class ExactRule(AcceptanceRule):
    """The lossless rule of vanilla speculative sampling: accept ``min(1, p/q)``, resample ``norm([p − q]_+)``
    (Leviathan et al. 2023; Chen et al. 2023). For every y, ``q(y)·a(y) + (1 − Σ_z q(z)·a(z))·r(y) = p(y)``."""

    lossless = True

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return ratio_acceptance(p, q)

    def ratio(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        x = x[:, None]
        return unclipped_ratio(p.gather(-1, x), q.gather(-1, x)).squeeze(-1)

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
                 depth: torch.Tensor) -> torch.Tensor:
        return vanilla_residual(p, q)


def output_distribution(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """The analytic one-step output distributions ``q f + β G`` (N, V) of a rule with token-independent G."""
    f = rule.acceptance(p, q, depth)
    accepted = q * f
    beta = (1.0 - accepted.sum(-1, keepdim=True)).clamp_min(0.0)
    return accepted + beta * rule.residual(p, q, None, depth)


def verify_chain(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                 u_sample: torch.Tensor) -> Verdict:
    """Accept a prefix of every image's drafted chain and draw its next token.

    ``p`` (B, L + 1, V): the target's distributions at the L draft positions and the bonus position.
    ``draft.valid`` (B, L) marks each chain's drafted prefix (shorter at the end of an image). For
    ``i = 1..L``: accept ``x_i`` iff ``U_i < f_i(x_i)``; at the first rejection sample from the rule's
    residual and stop; if every drafted token passes, sample the bonus token from the next position's ``p``.
    ``u_accept`` (B, L) and ``u_sample`` (B,) are the images' uniforms; ``u_sample`` may also be a function of
    the accepted counts (B,) that returns them (a draw keyed by the cell the next token lands on).
    """
    b, L = draft.tokens.shape
    rows, depth, flat_depth, columns, path = _chain_indices(b, L, p.device)
    drafted = draft.valid.sum(-1)  # (B,)
    if L:
        p_drafts = p[:, :L]
        f = rule.accept_prob(p_drafts.reshape(b * L, -1), draft.q.reshape(b * L, -1), draft.tokens.reshape(-1),
                             flat_depth).view(b, L)
        ok = (u_accept < f) & draft.valid
        n = ok.long().cumprod(-1).sum(-1)  # (B,) accepted prefix
        at = n.clamp(max=L - 1)
        res = rule.residual(p[rows, at], draft.q[rows, at], draft.tokens[rows, at], n + 1)
        dist = torch.where((n < drafted)[:, None], res, p[rows, n])
        tested = columns < torch.minimum(n + 1, drafted)[:, None]  # (B, L)
        tests = ((p_drafts, draft.q, depth, tested),)
    else:
        n = torch.zeros(b, dtype=torch.long, device=p.device)
        dist, tests = p[:, 0], ()
    if callable(u_sample):
        u_sample = u_sample(n)
    return Verdict(num_accepted=n, next_token=sample(dist, u_sample), path=path, tests=tests)


_CHAIN_INDICES: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}


def _chain_indices(b: int, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``verify_chain``'s index tensors for ``b`` chains of ``length`` (cached; never modified): rows (B,),
    depths 1..L (B, L) and flattened (B·L,), columns (1, L) and the path 0..L−1 (B, L)."""
    key = (b, length, device)
    if key not in _CHAIN_INDICES:
        depth = torch.arange(1, length + 1, device=device).expand(b, length)
        columns = torch.arange(length, device=device)[None, :]
        _CHAIN_INDICES[key] = (torch.arange(b, device=device), depth, depth.reshape(-1), columns,
                               columns.expand(b, length))
    return _CHAIN_INDICES[key]


def verify_tree(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                u_sample: torch.Tensor) -> Verdict:
    """The multi-draft acceptance walk over every image's draft tree, for every rule (EAGLE-1 recursive
    rejection), all images in step.

    ``p`` (B, M + 1, V): the target's distributions at the root (row 0, the last committed token) and at every
    node (row j + 1). From the root, the valid children of the current node are tried in order: child ``x``
    with its conditional draft distribution ``q'`` (``draft.q``) is accepted iff ``U_x < f(x)`` under the
    current residual ``p'``; after a rejection ``p' ← rule.residual(p', q', x, depth)``. An accepted child
    becomes the current node (depth + 1); when every child fails, the next token is drawn from the final
    ``p'``; at a fully accepted leaf it is the bonus token from that leaf's ``p``. Node j's test uses
    ``u_accept[:, j]``, so a chain-shaped tree consumes the uniforms exactly like ``verify_chain``.

    One image (the timed, batch-1 path) takes ``_verify_one_tree``: the same tests on the same (1, V) rows,
    bitwise the same verdict, with the walk's bookkeeping on the host.
    """
    verify = _verify_one_tree if draft.tokens.shape[0] == 1 else _verify_tree_batch
    return verify(rule, p, draft, u_accept, u_sample)


def _verify_tree_batch(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                       u_sample: torch.Tensor) -> Verdict:
    """``verify_tree`` for any batch: the walk's state as (B,) tensors, one host read per test."""
    b, m = draft.tokens.shape
    device = p.device
    rows = torch.arange(b, device=device)
    kids = children_slots(draft.parents, draft.valid)
    width = kids.shape[-1]
    current = torch.zeros(b, dtype=torch.long, device=device)  # row of p of the current node
    rank = torch.zeros(b, dtype=torch.long, device=device)  # next child to try
    depth = torch.ones(b, dtype=torch.long, device=device)
    n = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.zeros(b, m + 1, dtype=torch.long, device=device)
    residual = p[:, 0]
    tests = []
    while True:
        child = torch.where(rank < width, kids[rows, current, rank.clamp(max=width - 1)], -1)  # (B,)
        testing = child >= 0
        if not bool(testing.any()):
            break
        j = child.clamp_min(0)
        q, x = draft.q[rows, j], draft.tokens[rows, j]
        accepted = testing & (u_accept[rows, j] < rule.accept_prob(residual, q, x, depth))
        rejected = testing & ~accepted
        tests.append((residual, q, depth, testing))
        residual = torch.where(rejected[:, None], rule.residual(residual, q, x, depth), residual)
        residual = torch.where(accepted[:, None], p[rows, j + 1], residual)
        path[rows, n] = torch.where(accepted, j, path[rows, n])
        n = n + accepted
        current = torch.where(accepted, j + 1, current)
        rank = torch.where(accepted, 0, rank + rejected)
        depth = depth + accepted
    return Verdict(num_accepted=n, next_token=sample(residual, u_sample), path=path[:, :m], tests=tuple(tests))


def _verify_one_tree(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                     u_sample: torch.Tensor) -> Verdict:
    """``verify_tree`` for a batch of one: the rule's calls, their (1, V) operands and the order of the tests are
    the batched walk's, so the verdict is bitwise the same (tests/test_trees.py); which child comes next, whether
    it was accepted (one host read per test, as the batched walk's ``any``; the uniforms are read once), the
    depth and the path are Python values instead of (B,) tensors updated by ``where``: the walk's own torch
    calls per test went from about 34 to about 4.5 (the rule's calls unchanged; the peer bench's EAGLE-2 tree)."""
    m = draft.tokens.shape[1]
    device = p.device
    # one host read: the tree's shape and the acceptance uniforms (float32 or float64 -> float64: exact)
    host = torch.cat([draft.parents[0].double(), draft.valid[0].double(), u_accept[0, :m].double()]).tolist()
    u = host[2 * m:]
    kids: list[list[int]] = [[] for _ in range(m + 1)]
    for j in range(m):
        if host[m + j]:
            kids[int(host[j]) + 1].append(j)  # valid children in node order: the batched walk's children_slots
    testing = torch.ones(1, dtype=torch.bool, device=device)
    depths: dict[int, torch.Tensor] = {}
    current, rank, depth, path = 0, 0, 1, []
    residual = p[:, 0]
    tests = []
    while rank < len(kids[current]):
        j = kids[current][rank]
        q, x = draft.q[:, j], draft.tokens[:, j]
        d = depths.get(depth)
        if d is None:
            d = depths[depth] = torch.full((1,), depth, dtype=torch.long, device=device)
        tests.append((residual, q, d, testing))
        if u[j] < float(rule.accept_prob(residual, q, x, d)):  # the batched walk's comparison, in float64
            residual, current, rank, depth = p[:, j + 1], j + 1, 0, depth + 1
            path.append(j)
        else:
            residual = rule.residual(residual, q, x, d)
            rank += 1
    return Verdict(num_accepted=torch.tensor([len(path)], device=device),
                   next_token=sample(residual, u_sample),
                   path=torch.tensor([path + [0] * (m - len(path))], dtype=torch.long, device=device),
                   tests=tuple(tests))


def children_slots(parents: torch.Tensor, valid: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """(B, M + 1, ``width``) node indices of the valid children of the root (row 0) and of node j (row j + 1), in
    node order, −1 padded. ``width`` fixed by the caller: no host read (the static path; children ranked ``width``
    or later are dropped, so it must be at least the widest node's count); None: the largest rank + 1, read."""
    b, m = parents.shape
    device = parents.device
    same = parents[:, :, None] == parents[:, None, :]  # (B, M, M)
    earlier = torch.ones(m, m, dtype=torch.bool, device=device).tril(-1)
    rank = (same & earlier & valid[:, None, :]).sum(-1)  # (B, M) rank among the valid earlier siblings
    if width is None:
        width = int(rank.max()) + 1 if rank.numel() else 1
    slot = torch.where(valid & (rank < width), (parents + 1) * width + rank, (m + 1) * width)  # else: a dump slot
    kids = torch.full((b, (m + 2) * width), -1, dtype=torch.long, device=device)
    kids.scatter_(1, slot, torch.arange(m, device=device).expand(b, m))
    return kids[:, : (m + 1) * width].view(b, m + 1, width)


@dataclass(frozen=True)
class TreePlan:
    """The parallel walk's row layout of one fixed tree shape, built on the host once (``verify_tree_parallel``).

    ``sizes[c]``: the number of rows with a c-th child (exact, where a dynamic tree only has the bound
    M // (c + 1)); ``order`` (M + 1,): the rows by their number of children, most first (stable), ``position`` its
    inverse; ``child`` (Σ sizes,): rank c's children of the first ``sizes[c]`` rows of ``order``, rank after rank
    (−1: none). A node the draft marks invalid is skipped where it sits (it is never tested, so the next sibling
    is tested with the same residual: the sequential walk's tests)."""

    sizes: tuple[int, ...]
    order: torch.Tensor
    position: torch.Tensor
    child: torch.Tensor

    @classmethod
    def of(cls, parents: Sequence[int]) -> TreePlan:
        kids = children_of(parents)
        order = sorted(range(len(kids)), key=lambda row: -len(kids[row]))  # stable: row order among equals
        width = max(len(k) for k in kids)
        sizes = tuple(sum(len(k) > c for k in kids) for c in range(width))
        child = [kids[row][c] for c in range(width) for row in order[: sizes[c]]]
        position = [0] * len(kids)
        for slot, row in enumerate(order):
            position[row] = slot
        return cls(sizes=sizes, order=torch.tensor(order), position=torch.tensor(position), child=torch.tensor(child))

    def to(self, device: torch.device) -> TreePlan:
        return TreePlan(self.sizes, self.order.to(device), self.position.to(device), self.child.to(device))


def _device_plan(draft: Draft, width: int, internal: int | None = None
                 ) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``TreePlan``'s layout of every image's own tree, on the device with no host read: (sizes, order (B, R),
    position (B, R), child (B, Σ sizes)), ``sizes[c]`` the bound M // (c + 1) on the rows with a c-th child, or
    ``internal`` (the most rows that have children) where smaller."""
    b, m = draft.tokens.shape
    rows = m + 1
    device = draft.tokens.device
    kids = children_slots(draft.parents, draft.valid, width)  # (B, M + 1, C) in row order
    order = torch.argsort((kids >= 0).sum(-1), dim=1, descending=True, stable=True)  # (B, M + 1)
    position = torch.empty_like(order).scatter_(1, order, torch.arange(rows, device=device).expand(b, rows))
    kids = kids.gather(1, order[..., None].expand(-1, -1, width))
    sizes = tuple(min(rows, m // (c + 1), rows if internal is None else internal) for c in range(width))
    return sizes, order, position, torch.cat([kids[:, :k, c] for c, k in enumerate(sizes)], 1)


def verify_tree_parallel(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                         u_sample: torch.Tensor, width: int, levels: int, tests: bool = True,
                         ancestors: torch.Tensor | None = None, plan: TreePlan | None = None,
                         internal: int | None = None, cache: dict | None = None) -> Verdict:
    """``verify_tree``'s verdict with no host read, in ``width`` rule steps over every node at once (the static
    path; vLLM's and SGLang's tree samplers walk on the device too).

    Each node's sibling walk starts from its own target row ``p[row]``, whatever path led there, so every node's
    walk is computed at once: for rank c = 0 .. width − 1, the c-th child of every row is tested with the row's
    current residual (the rule's ``accept_prob``), and a rejection updates that row's residual (the rule's
    ``residual``), as the walk would at that node. The rows are sorted by their number of children (most first):
    the rows with a c-th child are then a prefix (``TreePlan``: of exactly their number for a fixed shape, else of
    at most M // (c + 1) rows), held rank-major ((row, image) flattened), so rank c works on a slice of every
    tensor, updated in place: under ten torch calls per rank besides the rule's own, whatever the batch; each
    row's first acceptance is taken once, after the last rank (one scatter-min). A node is on the accepted path
    when it and each of its ancestors is its parent's first accepted child (one pass over the ancestor mask); the
    next token is drawn from the residual of the row where the path stops (its ``p`` at a
    leaf: the bonus token). The tests and their operands at every node are the sequential walk's, so the verdict
    (accepted count, path, next token) is bitwise ``_verify_tree_batch``'s (tests/test_trees.py).

    ``width``: at least the most children of a node; ``levels``: at least the tree's depth. ``ancestors``: the
    tree's (B or 1, M + 1, M + 1) ancestor mask over [root, nodes] when the caller has it (the verify block's
    attention mask), else built here. ``plan``: the fixed shape's layout (its parents must be ``draft.parents``).
    ``internal``: without a plan, at most this many rows have children (an EAGLE-2 tree: the root and ``top_k``
    expanded nodes per level), a tighter bound than M on the rows a rank works on. ``cache``: where its layout
    constants are kept (the static loop's own store: a compiled step guards on what it reads).
    ``tests``: report the tests, per rank over the rows the walk visited (B, levels + 1: the root, then the
    accepted path; ``made`` up to each row's accepted child), which ``summed_tv`` sums alike; False: none
    (``Verdict.tests`` empty, for a caller that counts no tests).
    """
    b, m = draft.tokens.shape
    rows, v = m + 1, p.shape[-1]
    device = p.device
    if m == 0:  # an empty tree: the next token from the root's p
        return Verdict(num_accepted=torch.zeros(b, dtype=torch.long, device=device),
                       next_token=sample(p[:, 0], u_sample), path=draft.tokens, tests=())
    if ancestors is None:
        ancestors = ancestor_masks(draft.parents, levels=levels + 1)
    ancestors = ancestors.expand(b, rows, rows)
    depth = ancestors.sum(-1)  # (B, M + 1): the depth of a row's children, as the rule sees them (root's: 1)
    image = torch.arange(b, device=device)
    if plan is None:
        sizes, order, position, child = _device_plan(draft, width, internal)
        child = child.t().reshape(-1)  # (Σ sizes · B,) rank-major: (slot, image)
    else:
        sizes, order, position = plan.sizes, plan.order.expand(b, rows), plan.position.expand(b, rows)
        child = plan.child.repeat_interleave(b)
    node_at = image.repeat(child.shape[0] // b) * m + child.clamp_min(0)  # flat (image, node) index
    exists = child >= 0
    if plan is not None:  # a fixed shape keeps its invalid nodes in place: they are skipped, never tested
        exists = exists & draft.valid.reshape(-1)[node_at]
    row_at = (order.t() + image * rows).reshape(-1)  # flat (image, row) index of each (slot, image)
    spans = [k * b for k in sizes]
    q_all = draft.q.reshape(b * m, v).index_select(0, node_at).split(spans)  # per rank (k·B, V)
    x_all = draft.tokens.reshape(-1)[node_at].split(spans)
    u_all = u_accept[:, :m].reshape(-1)[node_at].split(spans)
    child, exists = child.split(spans), exists.split(spans)
    sorted_depth = depth.reshape(-1)[row_at]  # (R·B,)
    residual = p.reshape(b * rows, v).index_select(0, row_at)  # (R·B, V): every row's residual, updated in place
    # A row's residual is updated at every rejection of one of its children, also after it has accepted an
    # earlier one: such a row is passed through, never sampled from (the path goes on to its accepted child), and
    # its residuals stay distributions; only the first acceptance counts (below), and the tests reported are
    # those made before it.
    accepted, seen = [], None
    made_tests = []
    for c, span in enumerate(spans):
        q, x, row_depth, row_residual = q_all[c], x_all[c], sorted_depth[:span], residual[:span]
        passed = u_all[c] < rule.accept_prob(row_residual, q, x, row_depth)
        accepted.append(exists[c] & passed)
        if tests:  # a test is made until the row's first acceptance
            testing = exists[c] if seen is None else exists[c] & ~seen[:span]
            made_tests.append((row_residual.clone(), q, row_depth, testing, sizes[c]))
            seen = accepted[-1].clone() if seen is None else torch.cat([seen[:span] | accepted[-1], seen[span:]])
        torch.where(torch.gt(exists[c], passed)[:, None], rule.residual(row_residual, q, x, row_depth),
                    row_residual, out=row_residual)
    # each row's first accepted child: children are ranked in node order, so the smallest accepted one
    chosen = torch.full((rows * b,), m, dtype=torch.long, device=device).scatter_reduce_(
        0, _shaped(("rank slots", tuple(spans), device),  # each rank's slots 0 .. span − 1, rank after rank
                   lambda: torch.cat([torch.arange(span, device=device) for span in spans]), cache), torch.where(torch.cat(accepted), torch.cat(child), m), "amin")
    # node j is accepted when its parent's first accepted child is j; on the path when it and every ancestor are
    node = torch.arange(m, device=device)
    chosen = chosen.view(rows, b).t().gather(1, position)  # (B, M + 1) in row order
    accepted_node = chosen.gather(1, draft.parents + 1) == node  # (B, M)
    on_path = ~(ancestors[:, 1:, 1:] & ~accepted_node[:, None, :]).any(-1)  # (B, M)
    n = on_path.sum(-1)
    # the path in depth order (a node at depth d is its d-th step; the rest: 0), the row where it stops (node
    # indices grow along a path: the deepest node on it is the largest)
    path = torch.zeros(b, rows, dtype=torch.long, device=device).scatter_(
        1, torch.where(on_path, depth[:, 1:] - 2, m), node.expand(b, m))[:, :m]
    current = torch.where(on_path, node + 1, 0).amax(-1)  # (B,) the row the walk stops at (0: the root)
    final = residual.index_select(0, position.gather(1, current[:, None])[:, 0] * b + image)  # (B, V)
    kept = []
    if tests:
        # the tests the walk made: at the rows it visited (the root, then the accepted path), up to each row's
        # accepted child; kept as (B, levels + 1) rows per rank, so the TV diagnostic reads no other row
        visited = torch.cat([torch.zeros_like(n[:, None]), path[:, :levels] + 1], 1)  # (B, levels + 1)
        reached = torch.arange(levels + 1, device=device)[None, :] <= n[:, None]
        slot = position.gather(1, visited)  # where each visited row sits in the sorted rows
        for r, q, d, made, k in made_tests:
            index = slot.clamp(max=k - 1) * b + image[:, None]  # (B, levels + 1) flat (slot, image)
            kept.append((r[index], q[index], d[index], made[index] & reached & (slot < k)))
    return Verdict(num_accepted=n, next_token=sample(final, u_sample), path=path, tests=tuple(kept))


def summed_tv(rule: AcceptanceRule, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image (B,): the summed exact one-step TV of every test the verification made, and the test count."""
    b = verdict.next_token.shape[0]
    device = verdict.next_token.device
    tv = torch.zeros(b, dtype=torch.float64, device=device)
    count = torch.zeros(b, dtype=torch.long, device=device)
    for residual, q, depth, made in verdict.tests:
        if residual.dim() == 3:  # a chain's tests: (B, L, V) at once
            count += made.sum(-1)
            if not rule.lossless:
                v = residual.shape[-1]
                step = rule.one_step_tv(residual.reshape(-1, v), q.reshape(-1, v), depth.reshape(-1))
                tv += (step.view(made.shape) * made).sum(-1)
        else:
            count += made.long()
            if not rule.lossless:
                tv += rule.one_step_tv(residual, q, depth) * made
    return tv, count
