"""The acceptance-rule interface and the chain verification step every decoder shares.

A rule is a pair (acceptance function ``f``, resampling distribution ``G``) over the target distribution
``p`` and the draft distribution ``q`` (``shared/docs/algorithms.md``, "General relaxed acceptance"): a draft
``x ~ q`` is accepted with probability ``f(x)``; after a rejection the next token is drawn from ``G``. One step
then outputs ``P̂(y) = q(y) f(y) + β G(y)`` with ``β = 1 − Σ q f``, and its total-variation distance to ``p``
is the quantity the COOL-SD paper bounds (``one_step_tv``).

Rules are small pure objects; they never see a model, a cache or a loop. ``depth`` is the 1-based position
``i`` inside the draft block (the depth in a tree).

Example: ``python run.py decoder=sd`` uses ``baselines.exact.ExactRule`` through ``verify_chain``.
"""
from __future__ import annotations

import abc

import torch

from coolsd.sampling import sample
from coolsd.types import Draft, Verdict


class AcceptanceRule(abc.ABC):
    """A relaxed (or exact) speculative acceptance rule."""

    #: True when the rule reproduces ``p`` exactly (its one-step TV is 0 and need not be computed).
    lossless: bool = False

    @abc.abstractmethod
    def acceptance(self, p: torch.Tensor, q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """``f(y)`` for every token: p, q (..., V), depth (...) -> (..., V) in [0, 1]."""

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """``f(x)`` of the drafted tokens only: p, q (L, V), x (L,), depth (L,) -> (L,)."""
        return self.acceptance(p, q, depth).gather(-1, x[:, None]).squeeze(-1)

    @abc.abstractmethod
    def residual(self, p: torch.Tensor, q: torch.Tensor, x: int | None, depth: int) -> torch.Tensor:
        """Resampling distribution ``G`` (V,) after rejecting draft ``x`` at ``depth`` (p, q are (V,)).

        ``x`` is None when a rule whose ``G`` does not depend on the rejected token is asked for it in general.
        """

    def one_step_tv(self, p: torch.Tensor, q: torch.Tensor, depth: int) -> float:
        """Exact TV(P̂, p) of one acceptance step at ``depth`` (p, q are (V,)).

        The default assumes ``G`` does not depend on the rejected token; rules whose ``G`` does override it.
        """
        if self.lossless:
            return 0.0
        return 0.5 * float((output_distribution(self, p, q, depth) - p).abs().sum())


def output_distribution(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """The analytic one-step output distribution ``q f + β G`` (V,) of a rule with token-independent G."""
    f = rule.acceptance(p, q, torch.tensor(depth, device=p.device))
    accepted = q * f
    beta = (1.0 - accepted.sum()).clamp_min(0.0)
    return accepted + beta * rule.residual(p, q, None, depth)


def verify_chain(
    rule: AcceptanceRule,
    p: torch.Tensor,
    draft: Draft,
    generator: torch.Generator | None,
) -> Verdict:
    """Accept a prefix of a drafted chain and draw the next token.

    ``p`` (L + 1, V): the target's distributions at the L draft positions and the bonus position.
    For ``i = 1..L``: accept ``x_i`` iff ``U_i < f_i(x_i)``; at the first rejection sample from the rule's
    residual and stop; if all ``L`` pass, sample the bonus token from ``p_{L+1}``.
    """
    L = draft.draft_len
    n = L
    if L:
        depth = torch.arange(1, L + 1, device=p.device)
        f = rule.accept_prob(p[:L], draft.q, draft.tokens, depth)  # (L,)
        u = torch.rand(L, generator=generator, device=p.device)
        rejected = (u >= f).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
    if n < L:
        dist = rule.residual(p[n], draft.q[n], int(draft.tokens[n]), n + 1)
    else:
        dist = p[L]
    return Verdict(num_accepted=n, next_token=int(sample(dist, generator)), tv_steps=min(n + 1, L),
                   path=tuple(range(1, n + 1)))


def chain_tv(rule: AcceptanceRule, p: torch.Tensor, draft: Draft, verdict: Verdict) -> float:
    """Summed exact one-step TV of the positions the chain tested (1 .. min(n + 1, L)); a diagnostic."""
    if rule.lossless:
        return 0.0
    return sum(rule.one_step_tv(p[i], draft.q[i], i + 1) for i in range(verdict.tv_steps))


def verify_tree(
    rule: AcceptanceRule,
    p: torch.Tensor,
    draft: Draft,
    generator: torch.Generator | None,
) -> Verdict:
    """The multi-draft acceptance walk over a draft tree, for every rule (EAGLE-1 recursive rejection).

    ``p`` (M + 1, V): the target's distributions at the root (row 0, the last committed token) and at every
    node (row j + 1). From the root, the children of the current node are tried in order: child ``x`` with
    its conditional draft distribution ``q'`` (``draft.q``) is accepted iff ``U < f(x)`` under the current
    residual ``p'``; after a rejection ``p' ← rule.residual(p', q', x, depth)``. An accepted child becomes the
    current node (depth + 1); when every child fails, the next token is drawn from the final ``p'``; at a
    fully accepted leaf it is the bonus token from that leaf's ``p``. One uniform per node is drawn up front,
    so a chain-shaped tree consumes the random stream exactly like ``verify_chain``.
    """
    m = draft.draft_len
    u = torch.rand(m, generator=generator, device=p.device).tolist()
    parents = draft.parents.tolist() if draft.parents is not None else list(range(-1, m - 1))
    kids: list[list[int]] = [[] for _ in range(m + 1)]
    for j, par in enumerate(parents):
        kids[par + 1].append(j)
    path: list[int] = []
    tests: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    current, depth = 0, 1  # row of p of the current node (0 = root)
    while True:
        residual = p[current]
        accepted = None
        for j in kids[current]:
            x = draft.tokens[j : j + 1]
            q = draft.q[j]
            f = rule.accept_prob(residual[None], q[None], x, torch.tensor([depth], device=p.device))
            tests.append((residual, q, depth))
            if u[j] < float(f[0]):
                accepted = j
                break
            residual = rule.residual(residual, q, int(x), depth)
        if accepted is None:
            next_token = int(sample(residual, generator))
            break
        path.append(accepted + 1)
        current, depth = accepted + 1, depth + 1
    return Verdict(num_accepted=len(path), next_token=next_token, tv_steps=len(tests), path=tuple(path),
                   tests=tuple(tests))


def tree_tv(rule: AcceptanceRule, verdict: Verdict) -> float:
    """Summed exact one-step TV of every test the tree walk made; a diagnostic."""
    if rule.lossless:
        return 0.0
    return sum(rule.one_step_tv(residual, q, depth) for residual, q, depth in verdict.tests)
