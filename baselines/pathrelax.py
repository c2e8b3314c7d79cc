"""PathRelax — parallel-path relaxed speculative Jacobi decoding (Lei, Wang, Dai & Zhou, arXiv 2606.10492):
SJD's window drafted as ``K`` parallel chains from the last committed token, each tested with SJD's ratio test,
the longest accepted chain committed. **Lossy.**

Read from the authors' code, ``Haodong-Lei-Ray/PathSpec`` at 8a3df48 (the paper's text could not be read here):
``main.py`` with ``script/mscoco2017_pathspec.sh``'s settings (``--method speculative_jacobi --isp random
--static_tree --tree_choices Grouped_Tree_2``), ``scheduler/jacobi_iteration_lumina_mgpt.py``
(``renew_static_tree_sampler``: ``prefix_matching_next_tree_tokens`` and the window rebuild after it in
``_sample``) and ``scheduler/tree_until.py`` (``SpeculativeSampler.__call__``). ``Grouped_Tree_2``
(``lumina_mgpt/data/drafters/choices.py``) is two disjoint chains of 12 nodes under the root: ``paths = 2``,
``draft_len = 24``. One iteration, per image (``docs/algorithms.md``, "PathRelax"):

1. **Draft.** Path ``k`` holds ``D = draft_len / K`` window slots. Slot ``d`` of path ``k`` is a carried draft
   (a sample of its stored ``q``, the target's distribution there in the last iteration) or a fresh uniform
   image code with ``q`` one-hot on it (their ``random`` init, SJD's).
2. **Verify.** One target forward over the tree ``[last committed, path 0, path 1, ...]`` (each path sees only
   its own ancestors). Every path is tested on its own, as an SJD chain: node ``d`` of path ``k`` passes iff
   ``u_{k,d} < min(1, p_k,d(x) / q_k,d(x))``, where ``p_k,d`` is the target's output at the node's parent; a
   path's count ``n_k`` is its passing prefix.
3. **Commit the longest.** ``k* = argmax_k n_k`` (the first path on ties), ``n = n_{k*}``: commit its ``n``
   drafts, then the next token from ``norm([p − q]_+)`` at its first failure (``q`` the failing node's), or from
   ``p`` after its last node when it passed whole.
4. **Carry.** Every path, the losers included, shifts left by the winner's ``n + 1``: its slot ``j`` becomes the
   target's output at its own node of depth ``n + 1 + j`` (the Jacobi update of that path, conditioned on its own
   drafts); the slots left at the end are fresh.

``K = 1`` is SJD (``tests/test_pathrelax.py`` checks the tokens are the same). The selection of the longest of
``K`` independently tested chains is what makes it lossy: a draft that passes on one path of two is committed
more often than ``p`` allows, and the residual at a failure removes only the winning path's ``q``. The verdict
has no token tests (no analytic one-step TV: the selection is not a token test), so the run's TV shows as not
measured; the distance to the target is measured on the enumerable lookup models (``tests/test_pathrelax.py``).
The verification reproduces the authors' acceptance on their own inputs (``tests/golden/pathrelax_acceptance.json``,
made by running their ``SpeculativeSampler`` with ``python -m eval.bench.peers.pathrelax fixtures``).

Differences from the authors' code, on purpose:

* Their code decodes the first image token (and, on Lumina-mGPT, the end-of-row tokens, drafted inside the window
  and always rejected there) by the same loop; here every image token is decoded in the window and the model
  adapter places structural tokens for free, as for SJD.
* Their per-path uniforms are indexed by (path, depth, token) and the correction token is drawn from the residual
  with ``torch.multinomial``; here one uniform per node and inverse-CDF sampling (the same distributions).
* Their non-default ``*_replace`` schemes (which swap unmatched drafts between paths by total variation) are not
  built; the published script does not use them.

Example: ``python run.py decoder=pathrelax``; ``python run.py decoder=pathrelax decoder.drafter.paths=3
decoder.draft_len=36`` (their ``Grouped_Tree_3``).
"""
from __future__ import annotations

from typing import Callable

import torch

from coolsd import validate
from coolsd.acceptance import AcceptanceRule
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter, empty_draft
from coolsd.models.base import ImageARModel
from coolsd.rng import INIT, JACOBI, sample
from coolsd.types import Draft, TargetOutput, Verdict

INITS = ("random", "random_uniform_q")
_LAYOUTS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def path_layout(paths: int, depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The node layout of ``paths`` chains of ``depth`` slots: node ``k·depth + d`` is slot ``d`` of path ``k``.
    Returns ``parents`` (M,) (−1 = the root), ``parent_rows`` (K, D) (the row of ``p``, 0 = the root and
    ``j + 1`` = node ``j``, at which node (k, d)'s distribution is read: its parent's output) and ``depths`` (K, D)
    (1-based); cached per device, never modified."""
    key = (paths, depth, device)
    if key not in _LAYOUTS:
        d = torch.arange(depth, device=device)
        nodes = torch.arange(paths, device=device)[:, None] * depth + d  # (K, D)
        parents = torch.where(d == 0, -1, nodes - 1).reshape(-1)
        parent_rows = torch.where(d == 0, 0, nodes)  # node j − 1's row is j
        _LAYOUTS[key] = (parents, parent_rows, (d + 1).expand(paths, depth))
    return _LAYOUTS[key]


class PathVerifier:
    """PathRelax's verification (module doc, steps 2–3): every path an SJD chain under the decoder's rule, the
    longest passing prefix committed. ``verify_chain``'s signature and Verdict, for the drafter's ``K``-path trees."""

    #: the config key a refusal names (``coolsd.decoding.Decoder``)
    option = "decoder.drafter.paths"
    #: the selection is not a token test: the loop records the TV as not measured
    analytic_tv = False
    #: it verifies the drafter's path trees (a chain verifier's tree drafts are refused)
    verifies_trees = True
    #: fixed-shape tensors throughout, no host read: the static path runs it as it is
    static_path = True

    def __init__(self, paths: int) -> None:
        self.paths = validate.integer("decoder.drafter.paths", paths, minimum=1)

    def counts(self, rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor) -> torch.Tensor:
        """Every path's passing prefix ``n_k`` (B, K): ``p`` (B, M + 1, V), ``draft`` the K-path tree, ``u_accept``
        (B, M) one uniform per node."""
        b, m = draft.tokens.shape
        k = self.paths
        depth = m // k
        _, rows, depths = path_layout(k, depth, p.device)
        v = p.shape[-1]
        f = rule.accept_prob(p[:, rows.reshape(-1)].reshape(-1, v), draft.q.reshape(-1, v),
                             draft.tokens.reshape(-1), depths.reshape(-1).repeat(b)).view(b, k, depth)
        ok = (u_accept.view(b, k, depth) < f) & draft.valid.view(b, k, depth)
        return ok.long().cumprod(-1).sum(-1)

    def __call__(self, rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                 u_sample: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]) -> Verdict:
        b, m = draft.tokens.shape
        device = p.device
        k = self.paths
        if m % k:
            raise ValueError(f"PathVerifier: a draft of {m} nodes is not {k} paths of equal depth")
        depth = m // k
        if depth == 0:
            n = torch.zeros(b, dtype=torch.long, device=device)
            u = u_sample(n) if callable(u_sample) else u_sample
            return Verdict(num_accepted=n, next_token=sample(p[:, 0], u),
                           path=torch.zeros(b, 0, dtype=torch.long, device=device), tests=())
        _, rows, depths = path_layout(k, depth, device)
        counts = self.counts(rule, p, draft, u_accept)  # (B, K)
        best = counts.argmax(-1)  # the first longest path
        n = counts.gather(1, best[:, None])[:, 0]  # (B,)
        drafted = draft.valid.view(b, k, depth).sum(-1).gather(1, best[:, None])[:, 0]
        image = torch.arange(b, device=device)
        at = best * depth + n.clamp(max=depth - 1)  # the winner's first failing node (if it failed)
        residual = rule.residual(p[image, rows.reshape(-1)[at]], draft.q[image, at], draft.tokens[image, at], n + 1)
        after = torch.where(n > 0, best * depth + n, 0)  # the row after its last passing node (the root: 0)
        dist = torch.where((n < drafted)[:, None], residual, p[image, after])
        if callable(u_sample):
            u_sample = u_sample(n)
        path = best[:, None] * depth + torch.arange(depth, device=device)  # (B, D) node indices, root to leaf
        return Verdict(num_accepted=n, next_token=sample(dist, u_sample), path=path, tests=())


class PathJacobiDrafter(Drafter):
    """The Jacobi window of a batch of images as ``paths`` parallel chains (module doc, steps 1 and 4).

    State per image: the stored ``q`` of every path's carried slots (B, K, D, V) and how many are carried (B,),
    the same for every path (each shifts by the winner's commit)."""

    drafts_trees = False  # its own paths; decoder.tree is refused when the decoder is built
    self_drafting = True
    static_path = True

    def __init__(self, target: ImageARModel, paths: int = 2, init: str = "random") -> None:
        self.paths = validate.integer("decoder.drafter.paths", paths, minimum=1)
        self.init = validate.choice("decoder.drafter.init", init, INITS)
        self.target = target
        self.vocab = target.codebook_size
        self.depth = 0  # D: slots per path (block_shape)
        self.streams = None
        self.batch, self.device = 0, torch.device("cpu")
        self.q: torch.Tensor | None = None  # (B, K, D, V)
        self.carried: torch.Tensor | None = None  # (B,)
        self._t: torch.Tensor | None = None
        self._static: dict = {}

    @property
    def tree_width(self) -> int:
        """The most children of a node (the root's ``K``): the static path's parallel-walk width."""
        return self.paths

    def block_levels(self, nodes: int) -> tuple[int, ...]:
        """The most nodes at each depth of a block of ``nodes`` draft nodes (the root, then ``K`` per depth): what an
        adapter with structural slots sizes a static block by (``coolsd.static.StaticLoop.levels``)."""
        return (1,) + (self.paths,) * (nodes // self.paths)

    def block_shape(self, draft_len: int) -> tuple[int, int]:
        if draft_len % self.paths:
            raise ValueError(f"decoder.draft_len={draft_len} must be a multiple of decoder.drafter.paths="
                             f"{self.paths} (each path has draft_len / paths slots; the authors' Grouped_Tree_2 "
                             "is 2 paths of 12: draft_len=24)")
        self.depth = draft_len // self.paths
        return self.depth, draft_len

    def iteration_draws(self, depth, tree):
        if not depth:
            return ()
        return (JACOBI, self.paths * self.depth), (INIT, self.paths * self.depth)

    def begin(self, prompts, prefill: TargetOutput, first_tokens: torch.Tensor, streams) -> None:
        b = first_tokens.shape[0]
        self.streams = streams
        self.batch, self.device = b, first_tokens.device
        self.q = torch.zeros(b, self.paths, self.depth, self.vocab, device=self.device)
        self.carried = torch.zeros(b, dtype=torch.long, device=self.device)

    def select(self, images) -> None:
        index = torch.tensor(list(images), device=self.device)
        self.q, self.carried = self.q[index], self.carried[index]
        self.batch = len(index)

    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        """Every path's ``D`` slots (the full layout even where fewer fit: ``limit`` marks the valid ones, so a node's
        draws never depend on the batch's other images)."""
        if tree is not None:
            raise ValueError("PathRelax drafts its own parallel paths; remove decoder.tree")
        b, k, d = self.batch, self.paths, self.depth
        if depth == 0:
            return empty_draft(b, self.vocab, self.device)
        self._t = t
        u_carry = self.streams.uniform(t, JACOBI, k * d).view(b, k, d)
        u_init = self.streams.uniform(t, INIT, k * d).view(b, k, d)
        slot = torch.arange(d, device=self.device)
        is_carried = slot < torch.minimum(self.carried, limit)[:, None, None]  # (B, K, D)
        carried_tokens = sample(self.q, u_carry)  # rows never carried (all zero) give garbage, discarded
        fresh = (u_init * self.vocab).long().clamp_(max=self.vocab - 1)
        tokens = torch.where(is_carried, carried_tokens, fresh)
        if self.init == "random_uniform_q":
            q_fresh = torch.full_like(self.q, 1.0 / self.vocab)
        else:
            q_fresh = torch.zeros_like(self.q).scatter_(-1, fresh[..., None], 1.0)
        q = torch.where(is_carried[..., None], self.q, q_fresh)
        parents = path_layout(k, d, self.device)[0].expand(b, -1) if k > 1 else None  # one path: a chain
        valid = (slot < limit[:, None, None]).expand(b, k, d)
        return Draft(tokens=tokens.reshape(b, k * d), q=q.reshape(b, k * d, self.vocab),
                     valid=valid.reshape(b, k * d), forwards=[0] * b, parents=parents)

    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        # every path shifts by the winner's n + 1: slot j ← the output at the path's node of depth n + 1 + j
        b, k, d = self.batch, self.paths, self.depth
        if draft.draft_len == 0:
            self.carried = torch.zeros(b, dtype=torch.long, device=self.device)
            return
        n = verdict.num_accepted
        drafted = draft.valid.view(b, k, d)[:, 0].sum(-1)  # the same for every path
        carried = (drafted - n).clamp_min(0)
        j = torch.arange(d, device=self.device)
        node = (n[:, None] + j).clamp(max=d - 1)  # (B, D) the path's node of depth n + 1 + j
        rows = 1 + torch.arange(k, device=self.device)[None, :, None] * d + node[:, None, :]  # (B, K, D)
        rows = torch.where((j < carried[:, None])[:, None, :], rows, 0)  # past the carried slots: never read
        self.q = p.gather(1, rows.reshape(b, k * d, 1).expand(-1, -1, p.shape[-1])).view(b, k, d, -1)
        self.carried = carried

    # -- the static decode path: the same state in fixed buffers -------------------------------------------
    def static_begin(self, prefill, first_tokens, streams, depth, room=None) -> None:
        b = first_tokens.shape[0]
        self.begin(None, prefill, first_tokens, streams)
        if b not in self._static:
            self._static[b] = (self.q, self.carried)
        self.q, self.carried = self._static[b]
        self.q.zero_()
        self.carried.zero_()

    def static_refill(self, rows, prefill, first_tokens, streams, depth, room=None) -> None:
        if self.carried is None or self._static.get(self.carried.shape[0]) is None:
            raise RuntimeError("PathJacobiDrafter.static_refill: no static batch is running (call static_begin)")
        self.streams = streams
        self.carried.index_fill_(0, rows, 0)

    def static_propose(self, last_tokens, t, limit, depth, tree=None, cache=None) -> Draft:
        return self.propose(last_tokens, t, limit, depth, tree)

    def static_observe(self, out, p, draft, verdict, active) -> None:
        buffers = (self.q, self.carried)
        self.observe(out, p, draft, verdict)
        for buffer, value in zip(buffers, (self.q, self.carried)):
            buffer.copy_(value)
        self.q, self.carried = buffers


class PathRelax(Decoder):
    """PathRelax (module doc): the ``K``-path Jacobi window (``PathJacobiDrafter``) verified by ``PathVerifier``
    under the decoder's rule (SJD's exact ratio test in the published settings). Lossy."""

    def __init__(self, name: str, model: ImageARModel, rule: AcceptanceRule, draft_len: int,
                 drafter: Callable[..., Drafter] | Drafter, track_tv: bool = True, sync_phases: bool = False,
                 path: str = "eager", refill: bool = False) -> None:
        drafter = drafter if isinstance(drafter, Drafter) else drafter(target=model)
        if not isinstance(drafter, PathJacobiDrafter):
            raise ValueError(f"decoder {name!r} (PathRelax) drafts with baselines.pathrelax.PathJacobiDrafter, got "
                             f"{type(drafter).__name__}: remove the decoder.drafter override")
        super().__init__(name, model, rule, draft_len=draft_len, drafter=drafter, track_tv=track_tv,
                         sync_phases=sync_phases, verifier=PathVerifier(drafter.paths), path=path, refill=refill)
