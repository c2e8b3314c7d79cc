"""The exact (vanilla) rule: the losslessness identity without sampling, forced-outcome cases, and the chain
verification of a batch (each image its own accepted prefix, chains cut at the end of an image)."""
from __future__ import annotations

import pytest
import torch

from baselines.exact import ExactRule
from coolsd.acceptance import output_distribution, summed_tv, verify_chain
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
        p, q = random_dist(v, g, sparsity)[None], random_dist(v, g, sparsity)[None]
        depth = torch.ones(1, dtype=torch.long)
        a = rule.acceptance(p, q, depth)
        assert ((a >= 0) & (a <= 1)).all()
        r = rule.residual(p, q, None, depth)
        assert (r >= 0).all() and torch.isclose(r.sum(), torch.tensor(1.0, dtype=r.dtype))
        lhs = q * a + (1 - (q * a).sum()) * r
        torch.testing.assert_close(lhs, p, rtol=0, atol=1e-12)
        torch.testing.assert_close(output_distribution(rule, p, q, depth), p, rtol=0, atol=1e-12)
        assert float(rule.one_step_tv(p, q, depth)[0]) == 0.0


def chain(tokens, q, valid=None):
    """A batch of chains: tokens (B, L), q (B, L, V)."""
    tokens = torch.tensor(tokens)
    q = torch.stack([torch.stack(row) for row in q]).float() if q and q[0] else torch.zeros(*tokens.shape, 2)
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else torch.tensor(valid)
    return Draft(tokens=tokens, q=q, valid=valid, forwards=[tokens.shape[1]] * tokens.shape[0])


def uniforms(seed: int, b: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, L, generator=g), torch.rand(b, generator=g)


def test_identical_distributions_accept_everything():
    p = torch.tensor([0.2, 0.5, 0.3])
    draft = chain([[1, 0, 2]], [[p, p, p]])
    for seed in range(50):
        verdict = verify_chain(ExactRule(), torch.stack([p] * 4)[None], draft, *uniforms(seed, 1, 3))
        assert verdict.num_accepted.tolist() == [3]


def test_disjoint_supports_reject_and_resample_from_p():
    p = torch.tensor([0.0, 0.0, 0.4, 0.6])
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft = chain([[0]], [[q]])
    seen = set()
    for seed in range(200):
        verdict = verify_chain(ExactRule(), torch.stack([p, p])[None], draft, *uniforms(seed, 1, 1))
        assert verdict.num_accepted.tolist() == [0]
        seen.add(int(verdict.next_token[0]))
    assert seen == {2, 3}  # the residual norm([p − q]_+) is p itself here
    torch.testing.assert_close(ExactRule().residual(p[None], q[None], torch.tensor([0]), torch.tensor([1]))[0], p)


def test_draft_on_zero_probability_token_is_rejected():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.1, 0.1, 0.8])
    draft = chain([[2, 0]], [[q, p]])
    for seed in range(100):
        verdict = verify_chain(ExactRule(), torch.stack([p, p, p])[None], draft, *uniforms(seed, 1, 2))
        assert verdict.num_accepted.tolist() == [0]
        assert int(verdict.next_token[0]) in (0, 1)


def test_bonus_token_comes_from_last_position():
    p1 = torch.tensor([1.0, 0.0, 0.0])
    bonus = torch.tensor([0.0, 0.0, 1.0])
    draft = chain([[0]], [[p1]])
    verdict = verify_chain(ExactRule(), torch.stack([p1, bonus])[None], draft, *uniforms(0, 1, 1))
    assert verdict.num_accepted.tolist() == [1] and verdict.next_token.tolist() == [2]


def test_empty_draft_samples_from_p():
    p = torch.tensor([0.0, 1.0])
    draft = Draft(tokens=torch.empty(1, 0, dtype=torch.long), q=torch.empty(1, 0, 2),
                  valid=torch.empty(1, 0, dtype=torch.bool), forwards=[0])
    verdict = verify_chain(ExactRule(), p[None, None], draft, *uniforms(0, 1, 0))
    assert verdict.num_accepted.tolist() == [0] and verdict.next_token.tolist() == [1]
    assert summed_tv(ExactRule(), verdict)[1].tolist() == [0]


def test_every_image_of_a_batch_gets_its_own_prefix_and_token():
    """Three images in one call: accept all (bonus from the last position), reject at position 2, and a chain
    cut after one draft by the end of its image (its bonus comes from p at position 2, not a residual)."""
    one = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 3).float()  # noqa: E731
    p = torch.stack([
        torch.stack([one(0), one(1), one(2)]),  # every draft has p = 1: all accepted, bonus token 2
        torch.stack([one(0), one(0), one(2)]),  # second draft (1) has p = 0: rejected, residual -> 0
        torch.stack([one(0), one(1), one(0)]),  # only one draft is valid: accepted, bonus from p[1] -> 1
    ])
    q = [[one(0), one(1)], [one(0), one(1)], [one(0), one(2)]]
    draft = chain([[0, 1], [0, 1], [0, 2]], q, valid=[[True, True], [True, True], [True, False]])
    verdict = verify_chain(ExactRule(), p, draft, torch.full((3, 2), 0.5), torch.full((3,), 0.5))
    assert verdict.num_accepted.tolist() == [2, 1, 1]
    assert verdict.next_token.tolist() == [2, 0, 1]
    assert summed_tv(ExactRule(), verdict)[1].tolist() == [2, 2, 1]  # tests made: min(n + 1, drafted)
