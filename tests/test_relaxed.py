"""COOL-SD, LANTERN and LANTERN++: rule invariants, reductions to vanilla SD, G* optimality, TV
diagnostics, schedules, neighbour tables, and the rules' one-step output through the real loop.

Statistical test (``test_one_step_output_matches_the_loop``): on a lookup model with a 3-token image, the
first token is exact and the second is produced by one acceptance step with ``draft_len = 1``, so the
distribution of the first two tokens is ``p(x0) · P̂(x1 | x0)`` with ``P̂ = q f + Σ_x q(x)(1 − f(x)) G_x`` computed here by
brute force. Pearson chi-square over ``N_SAMPLES`` sequences (seeds 0..N−1, cells with expected count < 5
pooled); it fails when p < ALPHA = 1e-3, the false-alarm probability for a random seed choice.
"""
from __future__ import annotations

import math

import pytest
import torch

from baselines.exact import ExactRule
from baselines.lantern import LanternRule, lantern_rule
from coolsd.acceptance import output_distribution
from coolsd.cool import CoolSD, CoolSDRule, optimal_residual
from coolsd.decoding import Decoder
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.llamagen import layer_skip_copy
from coolsd.models.lookup import LookupModel, perturbed_copy
from coolsd.neighbours import compute_neighbours, latent_neighbours
from coolsd.schedules import omega_table
from tests.helpers import (acceptance1, chi_square_pvalue, forward1, generations, prefill1, residual1,
                           tiny_llamagen, tv1)

ALPHA = 1e-3
N_SAMPLES = 4000
V = 6


def random_pair(g: torch.Generator, v: int = V, sparsity: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    def dist():
        w = torch.rand(v, generator=g, dtype=torch.float64) ** 2
        if sparsity:
            w = w * (torch.rand(v, generator=g, dtype=torch.float64) > sparsity)
            w[int(torch.randint(v, (1,), generator=g))] += 0.1
        return w / w.sum()

    return dist(), dist()


def neighbour_table(v: int = V, seed: int = 0) -> torch.Tensor:
    return compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(seed)), v - 1)


def rules(v: int = V) -> dict[str, object]:
    table = neighbour_table(v)
    return {
        "coolsd_exp_d2": CoolSDRule(delta=2.0, draft_len=4),
        "coolsd_exp_d1.1_first": CoolSDRule(delta=1.1, draft_len=4, mu="first"),
        "coolsd_linear_d3": CoolSDRule(delta=3.0, draft_len=4, schedule="linear"),
        "coolsd_uniform_d0.5": CoolSDRule(delta=0.5, draft_len=4, schedule="uniform"),
        "lantern_ref": LanternRule(table, k=3, mode="additive", budget=0.3, resample="reference"),
        "lantern_ref_q": LanternRule(table, k=3, mode="additive", budget=0.3, resample="reference_q"),
        "lantern_opt": LanternRule(table, k=3, mode="additive", budget=0.3, resample="optimal"),
        "lantern_pp": LanternRule(table, k=2, mode="multiplicative", budget=4.0, resample="reference"),
    }


def brute_force_output(rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """``q f + Σ_x q(x)(1 − f(x)) G_x`` with each token's own residual."""
    d = torch.tensor(depth)
    f = torch.stack([rule.accept_prob(p[None], q[None], torch.tensor([x]), d[None])[0] for x in range(len(p))])
    out = q * f
    for x in range(len(p)):
        if q[x] > 0 and f[x] < 1:
            out = out + q[x] * (1 - f[x]) * residual1(rule, p, q, x, depth)
    return out


@pytest.mark.parametrize("name", list(rules()))
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_rule_invariants_and_exact_tv(name, sparsity):
    rule = rules()[name]
    g = torch.Generator().manual_seed(1)
    for trial in range(30):
        p, q = random_pair(g, sparsity=sparsity)
        depth = 1 + trial % 4
        f = acceptance1(rule, p, q, depth)
        assert ((f >= 0) & (f <= 1 + 1e-12)).all()
        for x in range(V):
            r = residual1(rule, p, q, x, depth)
            assert (r >= 0).all() and math.isclose(float(r.sum()), 1.0, abs_tol=1e-9)
        out = brute_force_output(rule, p, q, depth)
        assert math.isclose(float(out.sum()), 1.0, abs_tol=1e-9)
        assert math.isclose(tv1(rule, p, q, depth), 0.5 * float((out - p).abs().sum()), abs_tol=1e-9)


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_reductions_to_vanilla(sparsity):
    """COOL-SD uniform δ=1, LANTERN δ=0 and LANTERN++ λ=1 accept and resample exactly like vanilla SD.

    (LANTERN's reference residual zeroes neighbours only when m* ≥ 1; with δ = 0 that needs a zero-mass
    nearest neighbour, so its reduction is checked on full-support p.)"""
    exact = ExactRule()
    table = neighbour_table()
    relaxed = [CoolSDRule(delta=1.0, draft_len=5, schedule="uniform"),
               LanternRule(table, k=3, mode="additive", budget=0.0, resample="optimal"),
               LanternRule(table, k=3, mode="multiplicative", budget=1.0, resample="optimal")]
    if sparsity == 0.0:
        relaxed += [LanternRule(table, k=3, mode="additive", budget=0.0, resample=r)
                    for r in ("reference", "reference_q")]
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        p, q = random_pair(g, sparsity=sparsity)
        for rule in relaxed:
            torch.testing.assert_close(acceptance1(rule, p, q, 2),
                                       acceptance1(exact, p, q, 2), rtol=0, atol=1e-12)
            for x in range(V):
                torch.testing.assert_close(residual1(rule, p, q, x, 2), residual1(exact, p, q, x, 2),
                                           rtol=0, atol=1e-12)
            assert tv1(rule, p, q, 2) < 1e-12


def test_optimal_resampling_is_no_worse():
    """For random (p, q, f): TV with G* ≤ TV with the vanilla residual and with LANTERN's reference
    residual, and it equals Σ[q f − p]_+."""
    table = neighbour_table()
    lantern = LanternRule(table, k=3, mode="additive", budget=0.2, resample="reference")
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        p, q = random_pair(g, sparsity=0.3)
        f = torch.rand(V, generator=g, dtype=torch.float64)
        beta = 1 - (q * f).sum()

        def tv(out):
            return 0.5 * float((out - p).abs().sum())

        tv_star = tv(q * f + beta * optimal_residual(p, q, f))
        tv_vanilla = tv(q * f + beta * residual1(ExactRule(), p, q, None, 1))
        out_ref = q * f
        for x in range(V):
            # the reference zeroing applied to this f (m* taken from the LANTERN relaxation of x)
            out_ref = out_ref + q[x] * (1 - f[x]) * residual1(lantern, p, q, x, 1)
        assert tv_star <= tv_vanilla + 1e-12
        assert tv_star <= tv(out_ref) + 1e-12
        assert math.isclose(tv_star, float((q * f - p).clamp_min(0).sum()), abs_tol=1e-12)


def test_lantern_additive_moves_at_most_delta():
    """p' = p with the aggregated neighbours' mass moved onto x is within δ of p in TV."""
    table = neighbour_table(20)
    g = torch.Generator().manual_seed(4)
    for delta in (0.0, 0.05, 0.2, 0.6):
        rule = LanternRule(table, k=8, mode="additive", budget=delta)
        for _ in range(50):
            p, _ = random_pair(g, v=20)
            x = int(torch.randint(20, (1,), generator=g))
            p_tilde, m_star = (v[0] for v in rule.relaxed(p[None], torch.tensor([x])))
            moved = table[x, : int(m_star)]
            p_new = p.clone()
            p_new[x] += p[moved].sum()
            p_new[moved] = 0
            assert math.isclose(float(p_tilde), float(p_new[x]), abs_tol=1e-12)
            assert 0.5 * float((p_new - p).abs().sum()) <= delta + 1e-12
            if int(m_star) < 8:  # maximal: one more neighbour would break the budget
                assert float(p[table[x, : int(m_star) + 1]].sum()) > delta


def test_lantern_pp_bounds_the_boost():
    table = neighbour_table(20)
    g = torch.Generator().manual_seed(5)
    for lam in (1.0, 2.0, 5.0, 20.0):
        rule = LanternRule(table, k=5, mode="multiplicative", budget=lam)
        for _ in range(50):
            p, _ = random_pair(g, v=20)
            x = torch.randint(20, (7,), generator=g)
            p_tilde, _ = rule.relaxed(p.expand(len(x), -1), x)
            assert (p_tilde <= lam * p[x] + 1e-12).all() and (p_tilde >= p[x]).all()


@pytest.mark.parametrize("mode, budget", [("additive", 0.2), ("multiplicative", 4.0)])
def test_lantern_whole_codebook_relaxation_is_chunked_without_changing_a_bit(mode, budget):
    """``relaxed(p, None)`` in row chunks (RELAX_CHUNK) gives exactly the one-pass result, and every code's
    (p̃(x), m*(x)) equals the per-draft path's."""
    table = neighbour_table(40)
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(3 * torch.randn(37, 40, generator=g), -1)
    whole = LanternRule(table, k=9, mode=mode, budget=budget)
    whole.RELAX_CHUNK = 1 << 40
    chunked = LanternRule(table, k=9, mode=mode, budget=budget)
    chunked.RELAX_CHUNK = 40 * 9 * 4  # 4 rows per chunk: 10 chunks, the last one short
    a, b = whole.relaxed(p, None), chunked.relaxed(p, None)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    rows = torch.arange(37).repeat_interleave(40)
    x = torch.arange(40).repeat(37)
    per_draft = whole.relaxed(p[rows], x)
    assert torch.equal(per_draft[0].view(37, 40), a[0]) and torch.equal(per_draft[1].view(37, 40), a[1])


def test_neighbour_tables_exclude_self_sorted_and_cached(tmp_path):
    codebook = torch.randn(50, 8, generator=torch.Generator().manual_seed(6))
    table = compute_neighbours(codebook, 49, chunk=7)
    dist = torch.cdist(codebook, codebook)
    for c in range(50):
        assert c not in table[c].tolist()
        d = dist[c, table[c]]
        assert (d[1:] >= d[:-1]).all()
    cached = latent_neighbours(codebook, 10, cache_dir=str(tmp_path))
    files = list(tmp_path.glob("neighbours_*_l2_raw_k10.safetensors"))
    assert len(files) == 1 and torch.equal(cached, table[:, :10])
    assert torch.equal(latent_neighbours(codebook, 10, cache_dir=str(tmp_path)), cached)
    normalized = compute_neighbours(codebook, 5, metric="l2_normalized")
    unit = torch.nn.functional.normalize(codebook, dim=-1)
    assert torch.equal(normalized, compute_neighbours(unit, 5))


def test_schedules():
    for L in (1, 3, 5, 8):
        for delta in (1.1, 2.0):
            exp_mean = omega_table("exponential", delta, L, nu=0.7, mu="mean")
            assert math.isclose(float(exp_mean.mean()), delta, rel_tol=1e-12)
            assert (exp_mean[1:] < exp_mean[:-1]).all()
            assert math.isclose(float(omega_table("exponential", delta, L, mu="first")[0]), delta, rel_tol=1e-12)
            lin = omega_table("linear", delta, L)
            assert math.isclose(float(lin.mean()), delta, rel_tol=1e-12) and (lin > 0).all()
            assert torch.equal(omega_table("uniform", delta, L), torch.full((L,), delta, dtype=torch.float64))
    custom = omega_table("exponential", 2.0, 3, nu=0.5, mu=0.25)
    torch.testing.assert_close(custom, 2.0 * torch.exp(-0.5 * torch.arange(1, 4.0, dtype=torch.float64) - 0.25))
    with pytest.raises(ValueError, match="decoder.schedule"):
        omega_table("cosine", 1.0, 4)
    with pytest.raises(ValueError, match="decoder.mu"):
        omega_table("exponential", 1.0, 4, mu="middle")


@pytest.mark.parametrize("name", ["coolsd_exp_d2", "coolsd_uniform_d0.5", "lantern_ref", "lantern_ref_q",
                                  "lantern_pp"])
def test_one_step_output_matches_the_loop(name):
    target = LookupModel(vocab=V, grid=(1, 3), seed=3, scale=1.0, sampling=dict(cfg_scale=2.0))
    draft = perturbed_copy(target, noise=1.5, seed=4)
    rule = rules()[name]
    decoder = Decoder(name, target, rule, draft_len=1, drafter=ModelDrafter(target, draft))
    counts = torch.zeros(V * V)
    for gen in generations(decoder, N_SAMPLES):
        counts[int(gen.tokens[0]) * V + int(gen.tokens[1])] += 1
    _, out0 = prefill1(target, "p")
    p0 = target.probs(out0)[0].double()
    expected = torch.zeros(V, V, dtype=torch.float64)
    for x0 in range(V):
        cache, _ = prefill1(target, "p")
        p1 = target.probs(forward1(target, cache, torch.tensor([x0]), torch.tensor([0])))[0].double()
        dcache, _ = prefill1(draft, "p")
        q1 = draft.probs(forward1(draft, dcache, torch.tensor([x0]), torch.tensor([0])))[0].double()
        expected[x0] = p0[x0] * brute_force_output(rule, p1, q1, 1)
    assert math.isclose(float(expected.sum()), 1.0, abs_tol=1e-6)  # float32 probabilities
    assert chi_square_pvalue(counts, expected.flatten()) > ALPHA


@pytest.mark.slow  # CI's -m slow pass
def test_accepted_length_rises_with_relaxation():
    """On the tiny model (same prompts and seeds), τ grows with COOL-SD's δ and LANTERN++'s λ."""
    model = tiny_llamagen(dtype="float32")
    drafter_model = layer_skip_copy(model, 1)

    def tau(decoder) -> float:
        stats = [decoder.generate(prompt, seed).stats for seed, prompt in enumerate(["one", "four", "seven"] * 2)]
        return sum(s.num_tokens - 1 for s in stats) / sum(s.iterations for s in stats)

    cool = [tau(CoolSD("coolsd", model, draft_len=4, delta=d, drafter=ModelDrafter(model, drafter_model),
                       track_tv=False)) for d in (1.0, 2.0, 4.0, 8.0)]
    assert all(b > a for a, b in zip(cool, cool[1:])), cool
    pp = [tau(Decoder("lantern_pp", model, lantern_rule(model, 10, "multiplicative", lam, "reference", "l2_raw",
                                                        None), draft_len=4,
                      drafter=ModelDrafter(model, drafter_model), track_tv=False)) for lam in (1.0, 3.0, 10.0, 30.0)]
    assert all(b > a for a, b in zip(pp, pp[1:])), pp


def test_coolsd_decoder_reduces_to_sd_through_the_loop():
    """Same seeds, uniform δ = 1: COOL-SD and vanilla SD produce identical tokens."""
    target = LookupModel(vocab=3, grid=(2, 2), seed=0)
    draft = perturbed_copy(target, noise=1.0)
    sd = Decoder("sd", target, ExactRule(), draft_len=2, drafter=ModelDrafter(target, draft))
    cool = CoolSD("coolsd", target, draft_len=2, delta=1.0, schedule="uniform", drafter=ModelDrafter(target, draft))
    for seed in range(30):
        a, b = sd.generate("p", seed), cool.generate("p", seed)
        assert torch.equal(a.tokens, b.tokens) and b.stats.tv_per_step == 0.0
    assert output_distribution(cool.rule, torch.tensor([[0.5, 0.5]]), torch.tensor([[0.9, 0.1]]),
                               torch.tensor([1])).sum() > 0.99


def brute_force_tv_float64(rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> tuple[float, int]:
    """The sampler's one-step TV: ``q f + Σ_x q(x)(1 − f(x)) residual(x)`` with ``residual()`` itself for every
    rejected token (in ``p``'s dtype, as sampled), summed in float64; and how many of those residuals were
    empty (``residual()`` returned its uniform fallback)."""
    d = torch.tensor(depth)
    f = torch.stack([rule.accept_prob(p[None], q[None], torch.tensor([x]), d[None])[0] for x in range(len(p))])
    out = (q * f).double()
    uniform = torch.full_like(p, 1.0 / len(p))
    empty = 0
    for x in range(len(p)):
        if q[x] > 0 and f[x] < 1:
            g_x = residual1(rule, p, q, x, depth)
            empty += int(torch.equal(g_x, uniform))
            out = out + float(q[x]) * (1.0 - float(f[x])) * g_x.double()
    return 0.5 * float((out - p.double()).abs().sum()), empty


@pytest.mark.parametrize("resample", ["reference", "reference_q"])
@pytest.mark.parametrize("mode,budget", [("additive", 0.4), ("multiplicative", 5.0)])
@pytest.mark.parametrize("v,k", [(8, 6), (50, 48), (50, 40)])
def test_lantern_tv_equals_brute_force_in_float32_on_near_empty_residuals(v, k, mode, budget, resample):
    """float32 p, q as on a GPU. With k = V − 2 the reference zeroing removes every code but x, so the
    residual of a rejected x is empty (residual() samples uniformly); subtracting the zeroed mass from the
    total in float32 left ~6e-8 there and the diagnostic kept a distribution the sampler never uses."""
    rule = LanternRule(neighbour_table(v, seed=2), k=k, mode=mode, budget=budget, resample=resample)
    g = torch.Generator().manual_seed(0)
    empty = 0
    for trial in range(24):
        logits = torch.randn(v, generator=g) * (3.0 if trial % 4 else 12.0)  # some entries ~1e-20
        if trial % 2:  # a top-k-filtered p: exact zeros
            keep = torch.rand(v, generator=g) < 0.3
            keep[int(torch.randint(v, (1,), generator=g))] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        p = torch.softmax(logits, -1)
        if trial % 3 == 0:  # deterministic drafts (a dynamic tree's q ≡ 1 on the drafted token)
            q = torch.nn.functional.one_hot(torch.randint(v, (1,), generator=g), v).float()[0]
        else:
            q = torch.softmax(torch.randn(v, generator=g) * 3.0, -1)
        assert p.dtype == q.dtype == torch.float32
        expected, n_empty = brute_force_tv_float64(rule, p, q, 1)
        empty += n_empty
        assert abs(tv1(rule, p, q, 1) - expected) < 1e-6, (trial, tv1(rule, p, q, 1), expected)
    if resample == "reference" and k == v - 2:
        assert empty > 0  # the case above was exercised


@pytest.mark.parametrize("name", ["exact", *rules()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accept_prob_is_the_acceptance_of_the_drafted_token_bit_for_bit(name, dtype):
    """``accept_prob`` (the loop's per-test call, which Exact and COOL-SD compute on the drafted tokens only and
    LANTERN keeps for the residual that follows) equals ``acceptance`` over the codebook at the drafted token,
    bitwise: with zeros in q, one-hot q (a dynamic tree's drafts) and every depth; LANTERN's kept result is
    reused only for the same tensors."""
    rule = ExactRule() if name == "exact" else rules()[name]
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        n = 1 + trial % 5
        pairs = [random_pair(g, sparsity=0.5 * (trial % 2)) for _ in range(n)]
        p, q = (torch.stack([pq[k] for pq in pairs]).to(dtype) for k in (0, 1))
        x = torch.multinomial(q.double(), 1, generator=g).squeeze(-1)
        if trial % 3 == 0:
            q = torch.nn.functional.one_hot(x, V).to(dtype)
        depth = torch.randint(1, 6, (n,), generator=g)
        want = rule.acceptance(p, q, depth).gather(-1, x[:, None]).squeeze(-1)
        got = rule.accept_prob(p, q, x, depth)
        assert got.dtype == want.dtype and torch.equal(got, want), (trial, got, want)
        assert torch.equal(rule.accept_prob(p, q, x, depth), want)  # asked again (LANTERN: the kept result)
        other = x.flip(0) if n > 1 else (x + 1) % V  # other drafts, other objects: computed afresh
        assert torch.equal(rule.accept_prob(p, q, other, depth),
                           rule.acceptance(p, q, depth).gather(-1, other[:, None]).squeeze(-1))
