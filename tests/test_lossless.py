"""Losslessness of vanilla speculative decoding through the real loop, and greedy SD == greedy AR.

Statistical test: on the lookup model (3 codes, 3 image tokens: 27 sequences, known exactly) we draw
``N_SAMPLES`` complete sequences with ``sd`` and apply Pearson's chi-square goodness-of-fit test (cells with
expected count < 5 pooled). The test fails when the p-value is below ``ALPHA = 1e-3``: for a correct
implementation and a random choice of seeds that happens with probability 0.001 (the false-alarm
probability); the seeds here are fixed (0 .. N_SAMPLES-1), so the outcome is deterministic. The same test
with a deliberately broken residual (resampling from ``p`` instead of ``norm([p − q]_+)``) must fail.
"""
from __future__ import annotations

import torch

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter, NullDrafter
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.llamagen import layer_skip_copy
from coolsd.models.lookup import LookupModel, perturbed_copy
from tests.helpers import chi_square_pvalue, sequence_counts, tiny_llamagen

ALPHA = 1e-3
N_SAMPLES = 6000


class ResampleFromTarget(ExactRule):
    """A classic bug: after a rejection sample from p instead of the residual."""

    def residual(self, p, q, x, depth):
        return p


def lookup_pair():
    target = LookupModel(vocab=3, grid=(1, 3), seed=0, sampling=dict(cfg_scale=2.0, top_k=2))
    return target, perturbed_copy(target, noise=1.0, seed=1)


def test_sd_matches_exact_sequence_distribution():
    target, draft = lookup_pair()
    decoder = Decoder("sd", target, ExactRule(), draft_len=2, drafter=ModelDrafter(target, draft))
    counts = sequence_counts(decoder, target, N_SAMPLES)
    assert chi_square_pvalue(counts, target.exact_sequence_probs()) > ALPHA


def test_broken_residual_fails_the_same_test():
    target, draft = lookup_pair()
    decoder = Decoder("broken", target, ResampleFromTarget(), draft_len=2, drafter=ModelDrafter(target, draft))
    counts = sequence_counts(decoder, target, N_SAMPLES)
    assert chi_square_pvalue(counts, target.exact_sequence_probs()) < ALPHA


def test_greedy_sd_equals_greedy_ar_on_tiny_model():
    model = tiny_llamagen(dtype="float64", temperature=0.0)
    ar = Decoder("ar", model, ExactRule())
    sd = Decoder("sd", model, ExactRule(), draft_len=3, drafter=ModelDrafter(model, layer_skip_copy(model, 1)))
    for prompt in ("zero", "five", "nine"):
        a, s = ar.generate(prompt, 0), sd.generate(prompt, 1)
        assert torch.equal(a.tokens, s.tokens)
        assert s.stats.iterations < a.stats.iterations or s.stats.mean_accepted_length == 1.0
        assert a.stats.mean_accepted_length == 1.0


class _EmptyDrafter(Drafter):
    """Drafts nothing like ``NullDrafter`` but is not one, so the decoder takes its general loop."""

    def __init__(self) -> None:
        self.inner = NullDrafter()

    def begin(self, prompts, prefill, first_tokens, streams):
        self.inner.begin(prompts, prefill, first_tokens, streams)

    def propose(self, last_tokens, t, limit, depth, tree=None):
        return self.inner.propose(last_tokens, t, limit, depth, tree)

    def observe(self, out, p, draft, verdict):
        self.inner.observe(out, p, draft, verdict)

    def select(self, images):
        self.inner.select(images)


def test_plain_ar_fast_path_equals_the_general_loop_token_for_token():
    """AR keeps each sampled token on the device (no per-token host sync); it must be the general loop's
    AR exactly: the same tokens from the same seeds, the same statistics."""
    model = tiny_llamagen()
    fast = Decoder("ar", model, ExactRule())
    general = Decoder("ar", model, ExactRule(), drafter=_EmptyDrafter())
    for seed in range(4):
        prompt = model.class_names[seed % 3]
        a, b = fast.generate(prompt, seed), general.generate(prompt, seed)
        assert torch.equal(a.tokens, b.tokens)
        assert (a.stats.iterations, a.stats.accepted_hist, a.stats.target_forwards, a.stats.tv_steps) == \
            (b.stats.iterations, b.stats.accepted_hist, b.stats.target_forwards, b.stats.tv_steps)
        assert a.stats.iterations == 63 and a.stats.target_forwards == 64
        assert a.stats.mean_accepted_length == 1.0 and a.stats.verify_s > 0
