"""The shared sampling pipeline: CFG, temperature, top-k, top-p, greedy."""
from __future__ import annotations

import pytest
import torch

from coolsd.sampling import SamplingConfig, guide, logits_to_probs, normalize, sample, stream_probs


def test_guidance_formula():
    c, u = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(guide(torch.stack([c, u]), 3.0), u + 3.0 * (c - u))
    torch.testing.assert_close(guide(c[None], 3.0), c)


def test_top_k_keeps_k_largest():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3])
    p = logits_to_probs(logits, SamplingConfig(top_k=2))
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p[[1, 3]], torch.softmax(logits[[1, 3]], 0))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = logits_to_probs(probs.log(), SamplingConfig(top_p=0.7))
    assert (p > 0).tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    p = logits_to_probs(probs.log(), SamplingConfig(top_p=0.4))
    assert (p > 0).tolist() == [True, False, False, False]  # always at least one token


def test_temperature_and_greedy():
    logits = torch.tensor([1.0, 2.0, 0.0])
    torch.testing.assert_close(logits_to_probs(logits, SamplingConfig(temperature=0.5)),
                               torch.softmax(logits / 0.5, 0))
    torch.testing.assert_close(logits_to_probs(logits, SamplingConfig(temperature=0.0)),
                               torch.tensor([0.0, 1.0, 0.0]))


def test_order_is_cfg_then_temperature_then_topk():
    c, u = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)), torch.zeros(1, 50)
    cfg = SamplingConfig(cfg_scale=2.0, temperature=0.7, top_k=5)
    guided = 2.0 * c[0]
    kth = torch.topk(guided, 5).values[-1]
    expected = torch.softmax(torch.where(guided >= kth, guided / 0.7, torch.tensor(float("-inf"))), 0)
    torch.testing.assert_close(stream_probs(torch.stack([c, u]), cfg)[0], expected)


def test_sample_shapes_and_normalize_fallback():
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert sample(p, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    fallback = torch.tensor([0.5, 0.5])
    assert torch.equal(normalize(torch.zeros(2), fallback), fallback)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_config_names_the_key(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=f"sampling.{key}"):
        SamplingConfig(**bad)
