"""SJD-SV, GSD-SV and LANTERN in the Jacobi loop (``baselines/sv.py``): every step of the subsequence test on
hand-computed windows, its χ² verdict, batched decoding, the configs on every model, and the "TV not measured" path.

Statistical tests (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the false-alarm probability:
the probability that an exact decoder fails for a random choice of seeds, per test and per prompt):

* ``test_sjd_sv_is_not_exact_at_batch_1_and_8``: on ``tests.test_jacobi.lookup()`` (3 codes on a 1×5 grid, one
  table per prompt: 243 sequences each, known exactly), window 4 (draft_len 3), ``N_SV`` images (seeds
  0..N_SV−1, prompts alternating), decoded at batch 1 and at batch 8 (the same tokens). Pearson χ² per prompt
  against the exact sequence distribution must reject at ``ALPHA`` (SJD-SV is not exact). The size of the
  departure is measured with a valid lower confidence bound on the TV: the first half of each prompt's images picks
  the set A of sequences that are more frequent than the target says, the second half estimates
  ``P_SV(A) − P(A) ≤ TV(P_SV, P)``, whose 95 % interval (normal approximation, ±1.96 σ) must lie above 0. The
  numbers are printed (``pytest -s``) and quoted in ``docs/jacobi-and-spatial.md``.
* ``test_sjd_sv_with_sv_off_is_sjd_and_exact``: ``decoder=sjd_sv decoder.sv.enabled=false`` is SJD token for token and
  passes SJD's χ² exactness test (``N_EXACT`` images in mixed batches of 1, 3 and 8; accept at ``ALPHA``).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from baselines.exact import ExactRule
from baselines.gsd import GSD, GroupedRule
from baselines.jacobi import JacobiDrafter
from baselines.lantern import Lantern, LanternRule
from baselines.sv import SubsequenceVerifier, SVDecoder, sv_verifier
from coolsd.acceptance import AcceptanceRule, vanilla_residual, verify_chain
from coolsd.cool import CoolSDRule
from coolsd.decoding import Decoder
from coolsd.neighbours import compute_neighbours
from coolsd.types import DecodeStats, Draft
from tests.helpers import CONFIGS, chi_square_pvalue
from tests.test_batched import PROMPTS, mixed_batches
from tests.test_jacobi import lookup

ALPHA = 1e-3
N_SV = 2000
N_EXACT = 4000

# -- the hand-computed window ---------------------------------------------------------------------------------
# p_i(x_i) of a 7-token window: runs [0..2] (0.1 ≤ 0.2 ≤ 0.3), a drop at 3, [3..5] (0.05 ≤ 0.3 ≤ 0.4), a drop at 6.
PX = [0.1, 0.2, 0.3, 0.05, 0.3, 0.4, 0.1]
# the unclipped ratios r_i: x_0 alone would fail SJD's test at u_0 = 0.9, but it rides along with its run's suffix
RATIO = [0.5, 2.0, 0.3, 0.1, 0.5, 0.5, 1.5]


def plan(px=PX, ratio=RATIO, u=(0.9, 0.9, 0.5, 0.9, 0.4, 0.3, 0.5), drafted=7, **options):
    """The verifier's plan for one window (a batch of one)."""
    valid = torch.arange(len(px))[None] < drafted
    return SubsequenceVerifier(**options).plan(torch.tensor([px], dtype=torch.float64),
                                               torch.tensor([ratio], dtype=torch.float64), valid,
                                               torch.tensor([u], dtype=torch.float64))


def test_the_runs_and_the_suffix_start_for_several_alphas():
    """Runs end where p_i(x_i) drops; b_g is the largest start whose suffix holds α of the run's target mass
    (run [0..2]: suffix masses 0.6, 0.5, 0.3; run [3..5]: 0.75, 0.7, 0.4)."""
    result = plan()
    assert result.run_start.tolist() == [[0, 0, 0, 3, 3, 3, 6]]
    assert result.run_end.tolist() == [[2, 2, 2, 5, 5, 5, 6]]
    expected = {0.95: [0, 3, 6], 0.8: [1, 4, 6], 0.6: [1, 4, 6], 0.4: [2, 5, 6], 0.1: [2, 5, 6]}
    for alpha, (g0, g1, g2) in expected.items():
        assert plan(alpha=alpha).suffix_start.tolist() == [[g0] * 3 + [g1] * 3 + [g2]], alpha


def test_the_joint_test_accepts_a_run_whose_suffix_product_passes():
    """α = 0.8: run [0..2] is tested with r_1·r_2 = 0.6 at u_2 = 0.5 and passes, so x_0 (r_0 = 0.5, u_0 = 0.9: SJD
    would reject it) is accepted with it; run [3..5] fails its full test (r_4·r_5 = 0.25 < u_5 = 0.3), the fallback
    test b..4 (r_4 = 0.5 > u_4 = 0.4) passes: 5 tokens accepted, the resample at position 5."""
    result = plan()
    assert result.passed.tolist() == [[False, True, True, False, True, False, True]]
    assert result.stop.tolist() == [[3, 3, 3, 5, 5, 5, 7]]
    assert result.num_accepted.tolist() == [5]
    # run [0..2] fails at u_2 = 0.7 > 0.6; its fallback test b..1 has r_1 = 2 (clipped to 1) and passes
    assert plan(u=(0.9, 0.9, 0.7, 0.9, 0.4, 0.3, 0.5)).num_accepted.tolist() == [2]
    assert plan(u=(0.9, 0.9, 0.5, 0.9, 0.4, 0.2, 0.5)).num_accepted.tolist() == [7]  # every run passes: bonus


def test_the_progressive_fallback_and_where_it_resamples():
    """``fresh`` uniforms: run [3..5] with u_4 = 0.7 fails at e = 5 and at b_g = 4: ``reject_at`` run_start resamples
    at b = 3, suffix_start accepts b..b_g−1 = [3] and resamples at 4. Without fallback only the full test is made."""
    u = (0.9, 0.9, 0.5, 0.9, 0.7, 0.3, 0.5)
    assert plan(u=u, fallback_uniform="fresh").num_accepted.tolist() == [3]
    assert plan(u=u, fallback_uniform="fresh", reject_at="suffix_start").num_accepted.tolist() == [4]
    assert plan(fallback=False).num_accepted.tolist() == [3]  # the fallback test b..4 would have passed
    assert plan(fallback=False, reject_at="suffix_start").num_accepted.tolist() == [4]
    # one run of 4 with b_g = b (α = 0.95; suffix masses 1.0, 0.9, 0.8, 0.45): products 0.9, 0.81, 0.729, 0.0729
    px, ratio = [0.1, 0.1, 0.35, 0.45], [0.9, 0.9, 0.9, 0.1]
    longer = dict(px=px, ratio=ratio, drafted=4, alpha=0.95, fallback_uniform="fresh")
    assert plan(u=(0.99, 0.99, 0.7, 0.5), **longer).suffix_start.tolist() == [[0] * 4]
    assert plan(u=(0.99, 0.99, 0.7, 0.5), **longer).num_accepted.tolist() == [3]  # e' = 2 passes (0.7 < 0.729)
    assert plan(u=(0.99, 0.8, 0.75, 0.5), **longer).num_accepted.tolist() == [2]  # e' = 2 fails, e' = 1 passes
    assert plan(u=(0.95, 0.9, 0.75, 0.5), **longer).num_accepted.tolist() == [0]  # all fail: resample at b = 0


def test_fallback_uniform_fresh_or_the_runs_first():
    """``fresh``: the test ending at i uses u_i; ``same`` (the default: one uniform per subsequence, as the
    description): every test of a run uses the uniform of its first test (u_e): with u_4 = 0.7, u_5 = 0.3 run
    [3..5]'s fallback test b..4 fails (fresh) or passes (same, 0.3 < 0.5)."""
    u = (0.9, 0.9, 0.5, 0.9, 0.7, 0.3, 0.5)
    assert plan(u=u, fallback_uniform="fresh").num_accepted.tolist() == [3]
    assert plan(u=u, fallback_uniform="same").num_accepted.tolist() == [5]
    assert plan(u=u).num_accepted.tolist() == [5] and SubsequenceVerifier().fallback_uniform == "same"
    longer = dict(px=[0.1, 0.1, 0.35, 0.45], ratio=[0.9, 0.9, 0.9, 0.1], drafted=4, alpha=0.95)
    assert plan(u=(0.95, 0.9, 0.75, 0.5), fallback_uniform="same", **longer).num_accepted.tolist() == [3]


def test_earlier_runs_keep_or_drop():
    """``keep``: run [0..2] stays accepted when run [3..5] fails; ``drop``: a failing run after the window's first
    rejects the window from its first token; a failing first run falls back as usual under both."""
    assert plan(earlier_runs="keep").num_accepted.tolist() == [5]
    assert plan(earlier_runs="drop").num_accepted.tolist() == [0]
    first_fails = (0.9, 0.9, 0.7, 0.9, 0.4, 0.3, 0.5)
    assert plan(u=first_fails, earlier_runs="drop").num_accepted.tolist() == [2]
    passes = (0.9, 0.9, 0.5, 0.9, 0.4, 0.2, 0.5)
    assert plan(u=passes, earlier_runs="drop").num_accepted.tolist() == [7]


def test_undrafted_positions_are_never_tested():
    """Only 4 of 7 slots drafted (the end of an image): the tail, which would extend run [3..] (0.05 ≤ 0.3 ≤ 0.4),
    is its own runs, never tested; with every drafted run passing all 4 are accepted."""
    result = plan(u=(0.9, 0.9, 0.5, 0.05, 0.0, 0.0, 0.0), drafted=4)
    assert result.run_start.tolist() == [[0, 0, 0, 3, 4, 5, 6]] and result.run_end.tolist() == [[2, 2, 2, 3, 4, 5, 6]]
    assert result.passed[0, 4:].tolist() == [False] * 3
    assert result.num_accepted.tolist() == [4]
    assert plan(u=(0.9, 0.9, 0.5, 0.2, 0.0, 0.0, 0.0), drafted=4).num_accepted.tolist() == [3]  # r_3 = 0.1 < 0.2
    assert plan(drafted=0).num_accepted.tolist() == [0]


def test_a_zero_probability_token_rides_along_or_is_tested():
    """A run starting with p_0(x_0) = 0 (0 ≤ 0.2 ≤ 0.3): its mass is 0, so even at α = 1 the suffix start is b_g = 1
    and x_0 rides along with r_1·r_2 = 0.6 > u_2 = 0.5 (``ride``, the description's rule); ``test`` moves b_g to the
    run's start, the product takes r_0 = 0 and every test of the run fails: nothing is accepted and the next token
    is resampled at 0. A run without such a token is verified alike under both (the same verdict on PX)."""
    zero = dict(px=[0.0, 0.2, 0.3], ratio=[0.0, 2.0, 0.3], u=(0.9, 0.9, 0.5), drafted=3, alpha=1.0)
    ride, test = plan(**zero), plan(zero_prob="test", **zero)
    assert ride.suffix_start.tolist() == [[1, 1, 1]] and ride.num_accepted.tolist() == [3]
    assert test.suffix_start.tolist() == [[0, 0, 0]] and test.num_accepted.tolist() == [0]
    assert plan(zero_prob="test", reject_at="suffix_start", **zero).num_accepted.tolist() == [0]
    for options in (dict(), dict(alpha=1.0), dict(alpha=0.3, fallback_uniform="fresh")):
        a, b = plan(**options), plan(zero_prob="test", **options)
        assert a.suffix_start.tolist() == b.suffix_start.tolist() and a.num_accepted.tolist() == b.num_accepted.tolist()
    later = plan(px=[0.3, 0.0, 0.2], ratio=[1.0, 0.0, 2.0], u=(0.5, 0.9, 0.9), drafted=3, alpha=1.0)
    assert later.run_start.tolist() == [[0, 1, 1]] and later.num_accepted.tolist() == [3]  # a drop starts a run
    assert plan(px=[0.3, 0.0, 0.2], ratio=[1.0, 0.0, 2.0], u=(0.5, 0.9, 0.9), drafted=3, alpha=1.0,
                zero_prob="test").num_accepted.tolist() == [1]


# -- the verifier in the loop's contract ------------------------------------------------------------------------
def window_draft(px=PX, ratio=RATIO, drafted=7):
    """A batch-of-one chain whose drafts are code 0 with p_i(0) = px_i and q_i(0) = px_i / r_i (V = 9): p_i puts
    the rest on code i + 1, q_i on code 8, so the residual at a position with r_i ≤ 1 is one-hot on i + 1; the
    bonus row p_L is one-hot on code 8. Returns (p (1, L + 1, V), draft)."""
    length, v = len(px), 9
    p = torch.zeros(1, length + 1, v)
    q = torch.zeros(1, length, v)
    for i, (a, r) in enumerate(zip(px, ratio)):
        p[0, i, 0], p[0, i, i + 1] = a, 1 - a
        q[0, i, 0] = a / r
        q[0, i, 8] = 1 - a / r
    p[0, length, 8] = 1.0
    valid = torch.arange(length)[None] < drafted
    return p, Draft(tokens=torch.zeros(1, length, dtype=torch.long), q=q, valid=valid, forwards=[0])


@pytest.mark.parametrize("u,n,token", [((0.9, 0.9, 0.5, 0.9, 0.4, 0.3, 0.5), 5, 6),  # residual at 5: code 6
                                       ((0.9, 0.9, 0.5, 0.9, 0.7, 0.3, 0.5), 3, 4),
                                       ((0.9, 0.9, 0.5, 0.9, 0.4, 0.2, 0.5), 7, 8)])  # bonus from p_7
def test_the_next_token_is_the_residual_at_the_first_failing_position_or_the_bonus(u, n, token):
    """The residual norm([p − q]_+) is drawn at the first failing position only (u_sample = 0.01 would draw code 0
    from p there); when every run passes, the bonus token comes from p after the window (``fresh`` uniforms)."""
    p, draft = window_draft()
    verifier = SubsequenceVerifier(fallback_uniform="fresh")
    verdict = verifier(ExactRule(), p, draft, torch.tensor([u]), torch.tensor([0.01]))
    assert verdict.num_accepted.tolist() == [n] and verdict.next_token.tolist() == [token]
    assert verdict.tests == () and verdict.path.tolist() == [list(range(7))]
    called = []
    verdict = verifier(ExactRule(), p, draft, torch.tensor([u]),
                                    lambda accepted: called.append(accepted.tolist()) or torch.tensor([0.01]))
    assert called == [[n]]  # a keyed u_sample gets the accepted counts, as verify_chain's does


def test_an_image_end_draws_the_bonus_after_its_last_draft():
    p, draft = window_draft(drafted=4)
    verdict = SubsequenceVerifier()(ExactRule(), p, draft, torch.tensor([[0.9, 0.9, 0.5, 0.05, 0.0, 0.0, 0.0]]),
                                    torch.tensor([0.01]))
    assert verdict.num_accepted.tolist() == [4] and verdict.next_token.tolist() == [0]  # p_4 at u = 0.01: code 0


OPTIONS = [dict(), dict(alpha=0.3), dict(fallback=False), dict(fallback_uniform="same"),
           dict(reject_at="suffix_start"), dict(alpha=1.0, fallback_uniform="same", reject_at="suffix_start")]


@pytest.mark.parametrize("options", OPTIONS, ids=[str(o) or "defaults" for o in OPTIONS])
def test_a_strictly_decreasing_window_is_verified_exactly_as_sjd(options):
    """Where p_i(x_i) strictly decreases every run is one token, so the subsequence test is SJD's: the same
    accepted counts and next tokens as ``verify_chain`` on 256 random windows (drafted prefixes of every length,
    one-hot and dense q), for every option value but ``earlier_runs: drop`` (which rejects after a failing run)."""
    g = torch.Generator().manual_seed(0)
    b, length, v = 256, 6, 5
    target = torch.sort(torch.rand(b, length, generator=g), dim=-1, descending=True).values * 0.9 + 0.05
    x = torch.randint(v, (b, length), generator=g)
    rest = torch.distributions.Dirichlet(torch.ones(v)).sample((b, length + 1))
    p = rest.clone()
    p[:, :length] = rest[:, :length] * (1 - target[..., None])
    p[:, :length].scatter_(-1, x[..., None], 0.0)
    p[:, :length] = p[:, :length] / p[:, :length].sum(-1, keepdim=True) * (1 - target[..., None])
    p[:, :length].scatter_(-1, x[..., None], target[..., None])
    q = torch.softmax(torch.randn(b, length, v, generator=g) * 2, -1)
    one_hot = torch.rand(b, length, generator=g) < 0.3
    q = torch.where(one_hot[..., None], torch.nn.functional.one_hot(x, v).float(), q)
    drafted = torch.randint(length + 1, (b,), generator=g)
    draft = Draft(tokens=x, q=q, valid=torch.arange(length)[None] < drafted[:, None], forwards=[0] * b)
    u = torch.rand(b, length, generator=g)
    u_sample = torch.rand(b, generator=g)
    want = verify_chain(ExactRule(), p, draft, u, u_sample)
    got = SubsequenceVerifier(**options)(ExactRule(), p, draft, u, u_sample)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.next_token, want.next_token)
    assert 0 < int(want.num_accepted.sum()) < int(drafted.sum())  # both accepts and rejections were made


def test_every_rule_has_an_unclipped_ratio_whose_clip_is_its_acceptance():
    """``ratio`` clipped at 1 is ``accept_prob`` bit for bit (exact rule, GSD's both windows, LANTERN, COOL-SD)."""
    g = torch.Generator().manual_seed(3)
    n, v = 64, 12
    p = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)
    x = torch.randint(v, (n,), generator=g)
    depth = torch.randint(1, 5, (n,), generator=g)
    emb = torch.randn(v, 3, generator=g)
    table = compute_neighbours(torch.randn(v, 3, generator=g), v - 1)
    rules = [ExactRule(), GroupedRule(emb, group_size=4, delta_p=0.3, max_distance=4.0),
             GroupedRule(emb, window="reference_code", delta_p=0.3, max_distance=4.0),
             LanternRule(table, k=3, mode="additive", budget=0.3), CoolSDRule(delta=2.0, draft_len=4)]
    for rule in rules:
        ratio = rule.ratio(p, q, x, depth)
        assert torch.equal(ratio.clamp(max=1.0), rule.accept_prob(p, q, x, depth)), type(rule).__name__
        assert bool((ratio > 1).any()), type(rule).__name__  # unclipped somewhere


class _NoRatio(AcceptanceRule):
    def acceptance(self, p, q, depth):
        return torch.ones_like(p)

    def residual(self, p, q, x, depth):
        return vanilla_residual(p, q)


def test_a_rule_without_ratio_and_bad_options_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"decoder\.sv .*_NoRatio.*decoder\.sv\.enabled=false"):
        sv_verifier({"enabled": True}, _NoRatio())
    assert sv_verifier({"enabled": False}, _NoRatio()) is None and sv_verifier(None, ExactRule()) is None
    p, draft = window_draft()
    with pytest.raises(ValueError, match="unclipped ratio"):
        SubsequenceVerifier()(_NoRatio(), p, draft, torch.rand(1, 7), torch.rand(1))
    bad = [({"alpha": 0.0}, r"decoder\.sv\.alpha must be a number in \(0, 1\]"),
           ({"alpha": 1.5}, r"decoder\.sv\.alpha"), ({"fallback": "yes"}, r"decoder\.sv\.fallback must be true or false"),
           ({"fallback_uniform": "new"}, r"decoder\.sv\.fallback_uniform must be one of \['same', 'fresh'\]"),
           ({"zero_prob": "skip"}, r"decoder\.sv\.zero_prob must be one of \['ride', 'test'\]"),
           ({"reject_at": "b"}, r"decoder\.sv\.reject_at must be one of \['run_start', 'suffix_start'\]"),
           ({"earlier_runs": "x"}, r"decoder\.sv\.earlier_runs must be one of \['keep', 'drop'\]"),
           ({"enabled": 1}, r"decoder\.sv\.enabled must be true or false"),
           ({"alhpa": 0.5}, r"decoder\.sv must have keys among .*unknown keys \['alhpa'\]")]
    for spec, message in bad:
        for enabled in (True, False):  # checked even when the test is off
            with pytest.raises((ValueError, TypeError), match=message):
                sv_verifier({"enabled": enabled, **spec}, ExactRule())


def test_a_tree_draft_is_refused_with_the_option_named():
    model = lookup(grid=(2, 4), vocab=5)
    with pytest.raises(ValueError, match=r"decoder\.sv .*verifies chain drafts only.*tree_width=1"):
        SVDecoder("sjd_sv", model, ExactRule(), 8, JacobiDrafter(model, tree_width=2, tree_depth=3),
                  sv={"enabled": True})
    assert SVDecoder("sjd_sv", model, ExactRule(), 8, JacobiDrafter(model, tree_width=2, tree_depth=3),
                     sv={"enabled": False}).verifier is None  # SJD-PAC's window without the test


# -- decoding ---------------------------------------------------------------------------------------------------
def sjd_sv(model, draft_len=3, **sv) -> Decoder:
    return SVDecoder("sjd_sv", model, ExactRule(), draft_len, JacobiDrafter(model, init="random"),
                     sv={"enabled": True, **sv})


def sequences(decoder, n: int, sizes) -> dict[str, list[int]]:
    """Each prompt's sequence indices in seed order (seeds 0..n−1, prompts alternating, batches of ``sizes``)."""
    out = {p: [] for p in PROMPTS}
    model = decoder.model
    for prompts, seeds in mixed_batches(n, sizes):
        for prompt, gen in zip(prompts, decoder.generate_batch(prompts, seeds)):
            out[prompt].append(model.sequence_index(gen.tokens))
    return out


def tv_lower_bound(indices: list[int], probs: torch.Tensor) -> tuple[float, float, float]:
    """A valid lower confidence bound on TV(empirical source, probs) by sample splitting: the first half picks the set
    A of cells more frequent than ``probs`` says, the second half estimates P(A) − probs(A) (≤ TV). Returns (the
    estimate, its 95 % interval's ends), normal approximation of the binomial."""
    half = len(indices) // 2
    cells = probs.numel()
    first = torch.bincount(torch.tensor(indices[:half]), minlength=cells).double() / half
    chosen = first > probs
    second = torch.tensor(indices[half:])
    m = len(second)
    share = float(chosen[second].double().mean())
    gap = share - float(probs[chosen].sum())
    sigma = math.sqrt(max(share * (1 - share), 1e-12) / m)
    return gap, gap - 1.96 * sigma, gap + 1.96 * sigma


def test_sjd_sv_is_not_exact_at_batch_1_and_8():
    """Module doc: χ² rejects SJD-SV's sequence distribution at ALPHA on both prompts, at batch 1 and at batch 8
    (the same images), and the TV lower bound's 95 % interval lies above 0 (measured: see the printed line)."""
    model = lookup()
    decoder = sjd_sv(model)
    alone = sequences(decoder, N_SV, sizes=(1,))
    batched = sequences(decoder, N_SV, sizes=(8,))
    assert alone == batched  # each image is itself in a batch of 8
    assert_departs(model, alone, "SJD-SV")


def assert_departs(model, indices: dict[str, list[int]], label: str) -> None:
    """Each prompt's sequences ``indices`` depart from the lookup model's exact distribution: Pearson χ² rejects at
    ``ALPHA`` and the split-sample TV lower bound's 95 % interval lies above 0 (both printed, ``pytest -s``)."""
    for prompt in PROMPTS:
        probs = model.exact_sequence_probs(prompt)
        counts = torch.bincount(torch.tensor(indices[prompt]), minlength=probs.numel())
        pvalue = chi_square_pvalue(counts, probs)
        plug_in = 0.5 * float((counts / counts.sum() - probs).abs().sum())
        gap, low, high = tv_lower_bound(indices[prompt], probs)
        print(f"{label} on lookup prompt {prompt!r}, {int(counts.sum())} images: chi-square p = {pvalue:.3g}, "
              f"plug-in TV {plug_in:.3f}, TV >= {gap:.3f} [{low:.3f}, {high:.3f}] (95 %)")
        assert pvalue < ALPHA, (prompt, pvalue)
        assert low > 0, (prompt, gap, low, high)


def test_sjd_sv_with_sv_off_is_sjd_and_exact():
    """Module doc: the wrapper off is SJD token for token (the same uniforms), and SJD's χ² test passes."""
    model = lookup()
    off = SVDecoder("sjd_sv", model, ExactRule(), 3, JacobiDrafter(model, init="random"),
                    sv={"enabled": False, "alpha": 0.8})
    sjd = Decoder("sjd", model, ExactRule(), 3, drafter=JacobiDrafter(model, init="random"))
    assert off.verifier is None and off.tv_measured
    seeds = list(range(64))
    prompts = [PROMPTS[s % 2] for s in seeds]
    assert [g.tokens.tolist() for g in off.generate_batch(prompts, seeds)] == \
        [g.tokens.tolist() for g in sjd.generate_batch(prompts, seeds)]
    found = sequences(off, N_EXACT, sizes=(1, 3, 8))
    for prompt in PROMPTS:
        probs = model.exact_sequence_probs(prompt)
        counts = torch.bincount(torch.tensor(found[prompt]), minlength=probs.numel())
        assert chi_square_pvalue(counts, probs) > ALPHA, prompt


def test_the_tv_of_a_joint_test_is_not_measured_and_not_shown_as_zero():
    """SJD-SV records no token tests: its stats say the TV is not measured (None, not 0), the run's summary has no TV
    metrics, and the table prints "–" with a note, the one-line summary "– (not measured)"."""
    from eval.report.run_table import TV_NOTE, markdown_table, one_line_summary
    from eval.run.experiment import summarize

    model = lookup()
    gen = sjd_sv(model).generate("a", 0)
    assert gen.stats.tv_measured is False and gen.stats.tv_per_step is None and gen.stats.tv_steps == 0
    record = gen.stats.as_dict()
    assert record["tv_measured"] is False and record["tv_per_step"] is None
    exact = Decoder("sjd", model, ExactRule(), 3, drafter=JacobiDrafter(model, init="random")).generate("a", 0)
    assert "tv_measured" not in exact.stats.as_dict() and exact.stats.tv_per_step == 0.0
    metrics = summarize([{"index": 0, "stats": record}, {"index": 1, "stats": record}])
    assert metrics["tv_measured"] is False and not any(k.startswith("tv_per") for k in metrics)
    sjd_metrics = summarize([{"index": 0, "stats": exact.stats.as_dict()}])
    assert sjd_metrics["tv_per_step"] == 0.0 and "tv_measured" not in sjd_metrics
    table = markdown_table({"sjd": sjd_metrics, "sjd_sv": metrics})
    row = next(line for line in table.splitlines() if line.startswith("| sjd_sv"))
    assert "0.0000" not in row and "–" in row and TV_NOTE in table
    assert "TV_NOTE" not in markdown_table({"sjd": sjd_metrics}) and TV_NOTE not in markdown_table({"sjd": sjd_metrics})
    line = one_line_summary({"decoder": "sjd_sv", "metrics": {**metrics, "latency_s": 1.0},
                             "per_decoder": {"ar": {"latency_s": 2.0}}, "num_prompts": 2, "output_dir": "x"})
    assert "TV/step – (not measured)" in line
    assert DecodeStats(num_tokens=1, iterations=0, accepted_hist=(), target_forwards=1, drafter_forwards=0,
                       latency_s=0, prefill_s=0, draft_s=0, verify_s=0, accept_s=0, observe_s=0, diagnostics_s=0,
                       tv_sum=0.0, tv_steps=0).tv_per_step == 0.0  # plain AR: exact, no tests


def test_labels():
    from eval.report.labels import decoder_options, method_label

    def label(name, overrides=(), noted=()):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"decoder={name}", *overrides])
        from omegaconf import OmegaConf
        return method_label(name, decoder_options(OmegaConf.to_container(cfg.decoder, resolve=True)), noted)

    # the subsequence test's rule comes from a secondary description of the paper: its rows say "unofficial"
    assert label("sjd_sv") == "SJD-SV (unofficial) α=0.8"
    assert label("sjd_sv", ["decoder.sv.enabled=false"]) == "SJD (SV off)"
    assert label("sjd_sv", ["decoder.sv.fallback=false"], ["fallback"]) == "SJD-SV (unofficial) α=0.8 (fallback=false)"
    noted = ["fallback_uniform", "zero_prob"]  # noted only where a row leaves the default (same, ride)
    assert label("sjd_sv", [], noted) == "SJD-SV (unofficial) α=0.8"
    assert label("sjd_sv", ["decoder.sv.fallback_uniform=fresh", "decoder.sv.zero_prob=test"], noted) == \
        "SJD-SV (unofficial) α=0.8 (fallback_uniform=fresh, zero_prob=test)"
    assert label("gsd_sv") == "GSD-SV (unofficial) G=25, α=0.8"
    assert label("lantern_sjd").startswith("LANTERN (Jacobi) δ=0.1, k=")
    sv_on = label("lantern_sjd", ["decoder.sv.enabled=true"], ["sv", "fallback", "alpha"])
    assert sv_on.startswith("LANTERN-SV (Jacobi, unofficial) δ=0.1, k=") and sv_on.endswith("α=0.8")


ROWS = ("jacobi_sjd", "sjd_sv", "gsd_g25", "gsd_sv", "lantern_sjd", "lantern_sv_sjd")


def test_the_sv_table_preset_runs_gsds_setup():
    """``experiment=table_sv_lumina``: every row on Lumina-mGPT 768 with CFG 3, top-k 2000, MS-COCO captions,
    window 16 (15 drafts), random initialisation, and the subsequence test on exactly the SV rows."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = compose(config_name="config", overrides=["experiment=table_sv_lumina"], return_hydra_config=True)
    assert base.hydra.sweeper.params.row == ",".join(ROWS)
    for row in ROWS:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["experiment=table_sv_lumina", f"row={row}"])
        assert cfg.model._target_ == "coolsd.models.lumina_mgpt.LuminaMGPT" and cfg.model.width == 768, row
        assert cfg.data._target_ == "coolsd.prompts.CocoCaptions", row
        assert (cfg.model.sampling.cfg_scale, cfg.model.sampling.top_k) == (3.0, 2000), row
        decoder = OmegaConf.to_container(cfg.decoder, resolve=True)
        assert decoder["draft_len"] == 15 and decoder["drafter"]["init"] == "random", row
        assert (decoder.get("sv") or {}).get("enabled", False) == (row in ("sjd_sv", "gsd_sv", "lantern_sv_sjd")), row


# -- the configs on every model ---------------------------------------------------------------------------------
CASES = {"sjd_sv": [], "gsd_sv": [], "lantern_sv": ["decoder=lantern_sjd", "decoder.sv.enabled=true"]}
MODELS = ("lookup", "embedded", "tiny", "lumina_tiny", "janus_tiny", "llamagen_t2i_tiny", "emu3_tiny",
          "glm_image_tiny")  # ~0.2-4 s each


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_name", MODELS)
def test_every_sv_config_runs_on_every_model_batched_and_alone(model_name, case):
    """Each new config on each model: a batch of 3 and each image alone give the same tokens (its own acceptance and
    uniforms), every image of the grid's size, accepted length ≥ 1, TV not measured."""
    decoder = batched_equals_alone_without_tv(model_name, CASES[case] or [f"decoder={case}"])
    assert isinstance(decoder.verifier, SubsequenceVerifier)
    assert isinstance(decoder, {"sjd_sv": SVDecoder, "gsd_sv": GSD, "lantern_sv": Lantern}[case])


def batched_equals_alone_without_tv(model_name: str, overrides: list[str]) -> Decoder:
    """The decoder of ``overrides`` (draft_len 8, float64 but on the lookup model) on ``model_name``: a batch of 3 and
    each image alone give the same tokens, every image of the grid's size, accepted length ≥ 1, TV not measured.
    Returns the decoder (shared with ``tests/test_pathrelax.py``)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model_name}", *overrides, "decoder.draft_len=8",
                                                       *(["model.dtype=float64"] if model_name != "lookup" else [])])
    model = instantiate(cfg.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LANTERN's k capped at a small codebook's size
        decoder = instantiate(cfg.decoder, model=model)
    names = list(getattr(model, "class_names", None) or ["a cat", "a red bus", "a dog"])
    prompts = [names[i % len(names)] for i in range(3)]
    batch = decoder.generate_batch(prompts, [0, 1, 2])
    for k, gen in enumerate(batch):
        assert gen.tokens.shape == (model.num_image_tokens,)
        assert gen.stats.mean_accepted_length >= 1.0 and gen.stats.tv_per_step is None
        assert torch.equal(decoder.generate(prompts[k], k).tokens, gen.tokens), (model_name, overrides, k)
    return decoder


def test_lantern_in_the_jacobi_loop_without_sv_tracks_its_tv():
    """``decoder=lantern_sjd``: LANTERN's rule on the Jacobi window, token-level tests (its TV is measured)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=embedded", "decoder=lantern_sjd"])
    decoder = instantiate(cfg.decoder, model=instantiate(cfg.model))
    assert decoder.verifier is None and isinstance(decoder.drafter, JacobiDrafter) and decoder.tree is None
    gen = decoder.generate(decoder.model.class_names[0], 0)
    assert gen.stats.tv_steps > 0 and gen.stats.tv_per_step is not None and gen.stats.tv_per_step > 0
