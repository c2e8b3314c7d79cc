"""The exact (vanilla) rule: the losslessness identity without sampling and forced-outcome cases."""
from __future__ import annotations

import pytest
import torch

from baselines.exact import ExactRule
from coolsd.acceptance import output_distribution, verify_chain
from coolsd.types import Draft


def random_dist(v: int, g: torch.Generator, sparsity: float = 0.0) -> torch.Tensor:
    w = torch.rand(v, generator=g, dtype=torch.float64) ** 3
    if sparsity:
        w = w * (torch.rand(v, generator=g, dtype=torch.float64) > sparsity)
        w[0] += 1e-3
    return w / w.sum()


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_exact_identity_holds_for_random_pairs(sparsity):
    """q·a + (1 − Σq·a)·r = p for every token, on 200 random (p, q) pairs incl. disjoint supports."""
    rule = ExactRule()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        v = int(torch.randint(2, 40, (1,), generator=g))
        p, q = random_dist(v, g, sparsity), random_dist(v, g, sparsity)
        a = rule.acceptance(p, q, torch.tensor(1))
        assert ((a >= 0) & (a <= 1)).all()
        r = rule.residual(p, q, None, 1)
        assert (r >= 0).all() and torch.isclose(r.sum(), torch.tensor(1.0, dtype=r.dtype))
        lhs = q * a + (1 - (q * a).sum()) * r
        torch.testing.assert_close(lhs, p, rtol=0, atol=1e-12)
        torch.testing.assert_close(output_distribution(rule, p, q, 1), p, rtol=0, atol=1e-12)
        assert rule.one_step_tv(p, q, 1) == 0.0


def chain(tokens, q):
    return Draft(tokens=torch.tensor(tokens), q=torch.stack(q).float())


def test_identical_distributions_accept_everything():
    p = torch.tensor([0.2, 0.5, 0.3])
    draft = chain([1, 0, 2], [p, p, p])
    for seed in range(50):
        verdict = verify_chain(ExactRule(), torch.stack([p] * 4), draft, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 3


def test_disjoint_supports_reject_and_resample_from_p():
    p = torch.tensor([0.0, 0.0, 0.4, 0.6])
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft = chain([0], [q])
    seen = set()
    for seed in range(200):
        verdict = verify_chain(ExactRule(), torch.stack([p, p]), draft, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        seen.add(verdict.next_token)
    assert seen == {2, 3}  # the residual norm([p − q]_+) is p itself here
    torch.testing.assert_close(ExactRule().residual(p, q, 0, 1), p)


def test_draft_on_zero_probability_token_is_rejected():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.1, 0.1, 0.8])
    draft = chain([2, 0], [q, p])
    for seed in range(100):
        verdict = verify_chain(ExactRule(), torch.stack([p, p, p]), draft, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        assert verdict.next_token in (0, 1)


def test_bonus_token_comes_from_last_position():
    p1 = torch.tensor([1.0, 0.0, 0.0])
    bonus = torch.tensor([0.0, 0.0, 1.0])
    draft = chain([0], [p1])
    verdict = verify_chain(ExactRule(), torch.stack([p1, bonus]), draft, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 1 and verdict.next_token == 2


def test_empty_draft_samples_from_p():
    p = torch.tensor([0.0, 1.0])
    draft = Draft(tokens=torch.empty(0, dtype=torch.long), q=torch.empty(0, 2))
    verdict = verify_chain(ExactRule(), p[None], draft, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 0 and verdict.next_token == 1 and verdict.tv_steps == 0
