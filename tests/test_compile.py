"""``model.compile`` (issue 35): the piecewise compiled decode layers of the LlamaGen adapters
(``coolsd.models.llamagen.compiled_region``).

* Compiled and eager forwards agree to float32 rounding in float64 (the tiny model: target blocks of 1 and 5 tokens over a cache,
  the EAGLE drafter step), and greedy speculative decoding gives AR's tokens with the compiled target and
  drafter (slow: inductor compiles each region for a first shape, then once more with dynamic sizes; about
  1–2 min on 2 CPU cores; CI runs it in its ``-m slow`` pass).
* ``model.compile`` is in the record fingerprint only when true (older records stay valid); adapters without
  compiled layers refuse it before any weight is read; a non-boolean is refused.
"""
from __future__ import annotations

import pytest
import torch

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from tests.helpers import tiny_llamagen


def _forwards(model, prompt="zero"):
    """Target logits of the prefill's next block (1 token), then a 5-token block, and one EAGLE step."""
    cache, _ = model.prefill([prompt], extra_slots=8)
    one = model.forward_block(cache, torch.tensor([[3]]), torch.tensor([[0]]))
    cache.keep(1)
    five = model.forward_block(cache, torch.tensor([[1, 4, 1, 5, 9]]), torch.arange(1, 6)[None])
    return one.logits, five.logits, five.hidden


@pytest.mark.slow
def test_compiled_forwards_and_drafter_equal_eager_in_float64_and_greedy_sd_equals_ar():
    eager = tiny_llamagen("float64", temperature=0.0)
    compiled = tiny_llamagen("float64", runtime={"compile": True}, temperature=0.0)
    assert compiled.runtime == eager.runtime.replace(compile=True)
    assert compiled.gpt.compiled and not eager.gpt.compiled
    with torch.inference_mode():
        for a, b in zip(_forwards(eager), _forwards(compiled)):
            # the eager path rounds its RMSNorm (the reference's x.float()) to float32 even in a float64 model;
            # inductor's fused norm does not: agreement to float32 rounding, not to float64's
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    head = EagleHead(compiled, prefix="last")
    assert head.layer.compiled
    ar = Decoder("ar", eager, ExactRule())
    sd = Decoder("sd", compiled, ExactRule(), draft_len=3, drafter=EagleDrafter(compiled, head=head))
    for prompt, seed in (("zero", 0), ("eight", 3)):
        assert torch.equal(ar.generate(prompt, seed).tokens, sd.generate(prompt, seed).tokens)


def test_compile_is_fingerprinted_only_when_on():
    from eval.records.fingerprints import normalised

    fp = {"code_version": 3, "model": {"dtype": "float32", "compile": False}, "decoder": {"name": "ar"}}
    assert "compile" not in normalised(fp)["model"]  # records made before the option keep their fingerprint
    fp["model"]["compile"] = True
    assert normalised(fp)["model"]["compile"] is True


def test_adapters_without_compiled_layers_refuse_it_before_reading_weights():
    from coolsd.models.base import eager_only
    from coolsd.models.janus_pro import JanusPro
    from coolsd.models.lumina_mgpt import LuminaMGPT

    for cls, name in ((JanusPro, "Janus-Pro"), (LuminaMGPT, "Lumina-mGPT")):
        with pytest.raises(ValueError, match=f"model.compile=true is implemented for the LlamaGen.*{name}"):
            cls(sampling={}, compile=True)
    eager_only(False, "x")
    with pytest.raises(TypeError, match="model.compile"):
        tiny_llamagen("float64", runtime={"compile": "yes"})
