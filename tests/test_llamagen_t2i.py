"""LlamaGen text-to-image adapter (``coolsd.models.llamagen_t2i``) on tiny random-weight instances.

Checks: the adapter against a minimal re-statement of the reference computation (FoundationVision/LlamaGen
``sample_t2i.py`` left padding + ``generate.py`` masks and CFG + ``gpt.py`` forward), written here as plain
tensor code; KV-cached prefill + incremental decode == one block == the full re-statement; CFG halves; the
2-D RoPE table (zero caption rows, float32 under bf16); tree attention and KV compaction with a padded
caption prefix; VQ encode/decode; official checkpoint key names loading strictly from a weights folder;
a missing text encoder; caption cleaning. What every adapter promises (batched = alone, shapes, missing weights,
the published size on the meta device, the static path, every decoder through ``run.py``) is checked in
``tests/test_adapters.py``.

Everything is exact (float64 models; 1e-9, or float32 rounding where the head's float32 logits meet the
float64 re-statement). No network, no checkpoints. Runtime about 20 s on 2 CPU cores.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.llamagen import layer_skip_copy
from coolsd.models.llamagen_t2i import HashWordTokenizer, LlamaGenT2I, clean_caption
from coolsd.rng import Streams
from coolsd.sampling import guide
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from tests.helpers import CONFIGS, forward1, keep1, prefill1

ROOT = CONFIGS.parent
WORDS = ["a", "blue", "car", "parked", "in", "front", "of", "yellow", "brick", "wall", "photo", "the", "cat",
         "on", "red", "sofa", "dog", "with", "hat", "astronaut", "riding", "horse", "forest", "river"]
SHORT = "A blue car parked in front of a yellow brick wall"  # 11 words + </s>: 4 padded slots of 16
LONG = " ".join(WORDS * 2)  # longer than the 16 caption slots: truncated, no padding


def word_tokenizer():
    """A ``transformers`` fast tokenizer over a WordLevel vocabulary made here (T5-like ids and </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_t5(d_model: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(5)
    cfg = T5Config(vocab_size=64, d_model=d_model, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                   relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                   is_encoder_decoder=False, use_cache=False)
    return T5EncoderModel(cfg).double().eval()


def tiny_t2i(**overrides) -> LlamaGenT2I:
    """``configs/model/llamagen_t2i_tiny.yaml`` in float64 on the CPU, with overrides."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "llamagen_t2i_tiny.yaml"))
    cfg.pop("_target_")
    cfg.pop("defaults", None)  # Hydra's defaults list (the model's default eval), not an argument
    cfg.update(dtype="float64", device="cpu")
    cfg.update(overrides)
    return LlamaGenT2I(**cfg)


@pytest.fixture(scope="module")
def injected():
    """The tiny model with an injected T5 and ``transformers`` tokenizer; plain captions (lower case)."""
    t5, tok = tiny_t5(32), word_tokenizer()
    return tiny_t2i(text_encoder=t5, tokenizer=tok, caption_cleaning="lower"), t5, tok


@pytest.fixture(scope="module")
def model() -> LlamaGenT2I:
    return tiny_t2i()


# -- the reference computation, restated -------------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def rotations(grid: int, head_dim: int, base: float, prefix: int) -> torch.Tensor:
    """Complex unit rotations (prefix + grid², head_dim/2): row angles, then column angles; 0 on the prefix."""
    quarter = head_dim // 4
    freq = base ** (-torch.arange(quarter, dtype=torch.float64) * 2 / (head_dim // 2))  # (quarter,)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    angles = torch.cat([rows.reshape(-1, 1) * freq, cols.reshape(-1, 1) * freq], dim=1)  # (grid², head_dim/2)
    return torch.cat([torch.zeros(prefix, head_dim // 2, dtype=torch.complex128), torch.polar(
        torch.ones_like(angles), angles)])


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, D) rotated pairwise by rot (L, D/2); like the reference, in float32 precision of x."""
    pairs = torch.view_as_complex(x.float().double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rot[None, :, None]).flatten(3).to(x.dtype)


def reference_hidden(model: LlamaGenT2I, t5, tokenizer, prompt: str, tokens: torch.Tensor,
                     left_pad: bool = True, mask_uncond: bool = True) -> torch.Tensor:
    """Post-norm hidden states (2, C + len(tokens), dim) of ``[caption; uncond]`` over the whole sequence
    (the C caption slots, then the image tokens), no KV cache.

    ``left_pad=False`` / ``mask_uncond=False`` are deliberately wrong variants (right padding; an unmasked
    unconditional half) that the adapter must *not* match."""
    sd, cfg = model.gpt.state_dict(), model.cfg
    t = cfg.cls_token_num
    batch = tokenizer([prompt.lower().strip()], max_length=t, padding="max_length", truncation=True,
                      return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
    emb = t5(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["last_hidden_state"]
    valid_num = int(batch["attention_mask"][0].sum())
    emb_masks = batch["attention_mask"]
    if left_pad:
        emb = torch.cat([emb[0, valid_num:], emb[0, :valid_num]])[None]  # sample_t2i.py left padding
        emb_masks = torch.flip(emb_masks, dims=[-1])
    c = emb * emb_masks[:, :, None]
    cond_null = torch.zeros_like(c) + sd["cls_embedding.uncond_embedding"]
    cond = torch.cat([c, cond_null]).to(torch.float64)  # generate.py: [cond; uncond] halves
    x = F.linear(F.gelu(F.linear(cond, sd["cls_embedding.cap_proj.fc1.weight"]), approximate="tanh"),
                 sd["cls_embedding.cap_proj.fc2.weight"])
    x = torch.cat([x, F.embedding(tokens, sd["tok_embeddings.weight"])[None].expand(2, -1, -1)], dim=1)
    n = x.shape[1]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.long))[None].repeat(2, 1, 1)
    uncond_masks = emb_masks if mask_uncond else torch.ones_like(emb_masks)
    allowed[:, :, :t] = allowed[:, :, :t] * torch.cat([emb_masks, uncond_masks]).unsqueeze(1)
    eye = torch.eye(n, dtype=torch.long)
    allowed = (allowed * (1 - eye) + eye).bool()  # (2, n, n)
    heads, dim = cfg.n_head, cfg.dim
    d = dim // heads
    rot = rotations(math.isqrt(cfg.block_size), d, cfg.rope_base, t)[:n]
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"], cfg.norm_eps)
        q, k, v = F.linear(h, sd[p + "attention.wqkv.weight"]).split([dim, dim, dim], dim=-1)
        q, k = (rotate(z.view(2, n, heads, d), rot).transpose(1, 2) for z in (q, k))  # (2, H, n, d)
        v = v.view(2, n, heads, d).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(2, n, dim)
        x = x + F.linear(o, sd[p + "attention.wo.weight"])
        h = rms(x, sd[p + "ffn_norm.weight"], cfg.norm_eps)
        ffn = F.silu(F.linear(h, sd[p + "feed_forward.w1.weight"])) * F.linear(h, sd[p + "feed_forward.w3.weight"])
        x = x + F.linear(ffn, sd[p + "feed_forward.w2.weight"])
    return rms(x, sd["norm.weight"], cfg.norm_eps)


def reference_guided_logits(model: LlamaGenT2I, t5, tokenizer, prompt: str, tokens: torch.Tensor,
                            cfg_scale: float, left_pad: bool = True, mask_uncond: bool = True) -> torch.Tensor:
    """Guided logits (len(tokens) + 1, V): predictions of image tokens 0..len(tokens), no KV cache."""
    hidden = reference_hidden(model, t5, tokenizer, prompt, tokens, left_pad, mask_uncond)
    logits = F.linear(hidden, model.gpt.state_dict()["output.weight"])[:, model.cfg.cls_token_num - 1:]
    return logits[1] + (logits[0] - logits[1]) * cfg_scale  # (k+1, V)


# -- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["padded", "truncated"])
def test_first_token_and_teacher_forced_steps_match_the_reference(injected, prompt):
    model, t5, tok = injected
    tokens = torch.randint(1024, (6,), generator=torch.Generator().manual_seed(0))
    ref = reference_guided_logits(model, t5, tok, prompt, tokens, model.sampling.cfg_scale)
    cache, first = prefill1(model, prompt)
    assert cache.has_padding == (prompt == SHORT)
    steps = forward1(model, cache, tokens, torch.arange(6))
    ours = guide(torch.cat([first.logits, steps.logits], dim=1), model.sampling.cfg_scale)  # (7, V)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=1e-5)  # the head returns float32 logits
    assert model.text(prompt).num_tokens == (12 if prompt == SHORT else 16)
    if prompt == SHORT:  # the comparison sees both quirks
        for broken in ({"left_pad": False}, {"mask_uncond": False}):
            wrong = reference_guided_logits(model, t5, tok, prompt, tokens, model.sampling.cfg_scale, **broken)
            assert (ours - wrong.float()).abs().max() > 1e-3, broken


def test_prefill_then_incremental_decode_equals_one_block(injected):
    model, _, _ = injected
    tokens = torch.randint(1024, (9,), generator=torch.Generator().manual_seed(1))
    cache, _ = prefill1(model, SHORT)
    block = forward1(model, cache, tokens, torch.arange(9))
    cache, _ = prefill1(model, SHORT)
    singles = [forward1(model, cache, tokens[i:i + 1], torch.tensor([i])) for i in range(9)]
    assert cache.lengths[0] == model.cfg.cls_token_num + 9
    torch.testing.assert_close(torch.cat([o.logits for o in singles], 1), block.logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.cat([o.hidden for o in singles], 1), block.hidden, rtol=1e-9, atol=1e-9)
    assert block.hidden.shape == (2, 9, model.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.head(block.hidden), block.logits)


def test_cfg_halves(injected):
    model, _, _ = injected
    single = dataclasses.replace(model.sampling, cfg_scale=1.0)
    unguided = layer_skip_copy(model, model.cfg.n_layer)
    unguided.sampling = single
    assert (model.num_streams, unguided.num_streams) == (2, 1)
    _, both = prefill1(model, SHORT)
    _, cond = prefill1(unguided, SHORT)
    torch.testing.assert_close(both.logits[:1], cond.logits, rtol=1e-12, atol=1e-12)  # stream 0 = caption
    same_length = "the red dog on a blue sofa with a hat riding"  # also 11 words: the same mask
    _, other = prefill1(model, same_length)
    torch.testing.assert_close(other.logits[1], both.logits[1], rtol=1e-12, atol=1e-12)  # stream 1: uncond
    assert not torch.allclose(other.logits[0], both.logits[0])
    _, shorter = prefill1(model, "a cat")  # the uncond half reuses the caption's mask
    assert not torch.allclose(shorter.logits[1], both.logits[1])
    s = model.sampling.cfg_scale
    torch.testing.assert_close(guide(both.logits, s), both.logits[1] + s * (both.logits[0] - both.logits[1]))


def test_cfg_only_above_one_is_llamagens_rule(injected):
    """``sampling.cfg_rule=above_one`` (generate.py: ``if cfg_scale > 1.0``) samples the caption stream alone
    at scale 0.5; ``not_one`` guides towards the unconditional stream there. At 2.0 both guide."""
    model, t5, tok = injected
    assert model.sampling.cfg_rule == "above_one"
    for name in ("llamagen_t2i_256", "llamagen_t2i_512", "llamagen_t2i_256_lantern", "tiny", "embedded"):
        assert OmegaConf.load(CONFIGS / "model" / f"{name}.yaml").sampling.cfg_rule == "above_one", name
    probs = {}
    for rule in ("above_one", "not_one"):
        copy = layer_skip_copy(model, model.cfg.n_layer)
        copy.sampling = dataclasses.replace(model.sampling, cfg_scale=0.5, cfg_rule=rule)
        _, out = prefill1(copy, SHORT)
        probs[rule] = copy.probs(out)[0]
    assert (probs["above_one"] - probs["not_one"]).abs().sum() > 0.1
    empty = torch.zeros(0, dtype=torch.long)
    caption_only = F.linear(reference_hidden(model, t5, tok, SHORT, empty)[0, -1], model.gpt.output.weight)
    torch.testing.assert_close(probs["above_one"], torch.softmax(caption_only, -1).float(), rtol=1e-5, atol=1e-8)
    guided = reference_guided_logits(model, t5, tok, SHORT, empty, 0.5)[0]
    torch.testing.assert_close(probs["not_one"], torch.softmax(guided, -1).float(), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="cfg_rule"):
        dataclasses.replace(model.sampling, cfg_rule="positive")


def test_attention_kernel_tf32_and_pixel_rounding_plumbing(injected, monkeypatch):
    """``attention_kernel=math`` runs the decode forwards (and the EAGLE drafter's) on the math SDPA kernel only,
    the prefill on PyTorch's dispatch, as generate.py; ``tf32`` sets the CUDA flags of sample_t2i.py; the VQ
    image is saved as torchvision's save_image does (``half_up``). CPU plumbing only: the effect on CUDA bf16
    logits was not measured."""
    from coolsd.drafters.eagle import EagleDrafter, EagleHead
    from coolsd.models.base import set_tf32

    model, _, _ = injected
    assert (model.attention_kernel, model.tf32, model.pixel_rounding) == ("math", True, "half_up")
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cache, first = prefill1(model, SHORT)
    assert set(seen) == {(True, True)}  # prefill: PyTorch's choice
    seen.clear()
    forward1(model, cache, torch.tensor([1, 2]), torch.arange(2))
    drafter = EagleDrafter(model, head=EagleHead(model))
    drafter.begin([SHORT], model.prefill([SHORT])[1], torch.tensor([1]), Streams([0], "cpu"))
    seen.clear()
    forward1(model, cache, torch.tensor([3]), torch.arange(2, 3))
    drafter.propose(torch.tensor([1]), torch.tensor([1]), torch.tensor([1]), 1)
    assert set(seen) == {(False, True)}  # decode forwards and drafter steps: math only
    seen.clear()
    auto = layer_skip_copy(model, model.cfg.n_layer)
    auto.attention_kernel = "auto"
    forward1(auto, prefill1(auto, SHORT)[0], torch.tensor([1]), torch.arange(1))
    assert set(seen) == {(True, True)}
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(torch.device("cuda"), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(torch.device("cuda"), False)  # PyTorch's defaults (Janus, Lumina-mGPT)
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(torch.device("cpu"), True)  # nothing on a CPU
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    codes = torch.randint(model.codebook_size, (model.num_image_tokens,), generator=torch.Generator().manual_seed(1))
    half_up = model.decode_image(codes)
    auto.pixel_rounding = "truncate"
    truncated = auto.decode_image(codes)
    diff = half_up.int() - truncated.int()
    assert set(diff.unique().tolist()) == {0, 1} and 0.3 < diff.float().mean() < 0.7  # +1 where frac >= 0.5
    with pytest.raises(ValueError, match="attention_kernel"):
        tiny_t2i(attention_kernel="flash")


def test_rope_table_has_zero_caption_rows_and_stays_float32():
    model = tiny_t2i(dtype="float32")
    c, grid, d = model.cfg.cls_token_num, model.grid[0], model.cfg.dim // model.cfg.n_head
    table = model.gpt.freqs_cis  # (C + grid², d/2, 2)
    assert table.shape == (c + grid * grid, d // 2, 2) and not table[:c].any()
    expected = torch.view_as_real(rotations(grid, d, model.cfg.rope_base, c)).float()
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)
    half = tiny_t2i(dtype="bfloat16")
    assert half.gpt.tok_embeddings.weight.dtype == torch.bfloat16
    assert half.gpt.freqs_cis.dtype == torch.float32 and torch.equal(half.gpt.freqs_cis, table)
    assert half.make_draft_layer().freqs_cis.dtype == torch.float32


def test_tree_attention_with_padded_prefix_matches_per_path_forwards(model):
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    g = torch.Generator().manual_seed(0)
    prefix, nodes = torch.randint(1024, (5,), generator=g), torch.randint(1024, (len(parents),), generator=g)
    cache, _ = prefill1(model, SHORT)
    assert cache.has_padding
    forward1(model, cache, prefix, torch.arange(5))
    cache.keep(5)
    root = torch.tensor([7])
    positions = torch.tensor([5] + [5 + d for d in depths_of(parents)])
    tree_out = forward1(model, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in range(len(parents)):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        ref_cache, _ = prefill1(model, SHORT)
        seq = torch.cat([prefix, root, nodes[path]])
        ref = forward1(model, ref_cache, seq, torch.arange(len(seq)))
        torch.testing.assert_close(tree_out.logits[:, j + 1], ref.logits[:, -1], rtol=1e-9, atol=1e-9)


def test_kv_compaction_then_forward_equals_uncached(model):
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    nodes = torch.randint(1024, (len(parents),), generator=torch.Generator().manual_seed(3))
    cache, _ = prefill1(model, SHORT)
    root = torch.tensor([11])
    forward1(model, cache, torch.cat([root, nodes]), torch.tensor([0] + depths_of(parents)),
                        ancestor_mask(parents))
    path = [1, 5, 13, 21]  # block indices of the nodes [0], [0,0], [0,0,0], [0,0,0,0]
    assert [shape.paths[i - 1] for i in path] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    keep1(cache, torch.tensor([0] + path))
    nxt = torch.tensor([42, 43])
    after = forward1(model, cache, nxt, torch.arange(5, 7))
    committed = torch.cat([root, nodes[[i - 1 for i in path]], nxt])
    ref_cache, _ = prefill1(model, SHORT)
    ref = forward1(model, ref_cache, committed, torch.arange(len(committed)))
    torch.testing.assert_close(after.logits, ref.logits[:, -2:], rtol=1e-9, atol=1e-9)


def test_vq_encode_decode_shapes_and_range(model):
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1  # [-1, 1]
    codes = model.vq.encode_to_indices(images)
    assert codes.shape == (2, model.num_image_tokens) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < model.codebook_size
    pixels = model.vq.decode_to_uint8(codes, model.grid)  # decode(encode(x))
    assert pixels.shape == images.shape and pixels.dtype == torch.uint8
    single = model.decode_image(codes[0])  # batch of one: conv rounding may move a pixel by one level
    assert single.shape == pixels[0].shape and int((single.int() - pixels[0].int()).abs().max()) <= 1
    assert model.codebook().shape == (model.codebook_size, 8)


def official_gpt_keys(n_layer: int) -> set[str]:
    """The key names of the released T2I GPT checkpoints (FoundationVision/LlamaGen; docs/models.md)."""
    keys = {"cls_embedding.cap_proj.fc1.weight", "cls_embedding.cap_proj.fc2.weight",
            "cls_embedding.uncond_embedding", "tok_embeddings.weight", "norm.weight", "output.weight"}
    per_layer = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w1.weight",
                 "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight")
    return keys | {f"layers.{i}.{name}" for i in range(n_layer) for name in per_layer}


def test_official_key_names_load_strictly_from_a_weights_folder(model, tmp_path):
    state = model.gpt.state_dict()
    assert set(state) == official_gpt_keys(model.cfg.n_layer)
    assert "quantize.embedding.weight" in model.vq.state_dict() and "quantize.codebook_used" in model.vq.state_dict()
    torch.save({"model": state, "steps": 1}, tmp_path / "t2i_XL_stage1_256.pt")
    torch.save({"model": model.vq.state_dict()}, tmp_path / "vq_ds16_t2i.pt")
    loaded = tiny_t2i(pretrained=True, weights_dir=str(tmp_path), init_seed=99)
    for key, value in state.items():
        assert torch.equal(loaded.gpt.state_dict()[key], value), key
    _, a = prefill1(model, SHORT)
    _, b = prefill1(loaded, SHORT)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    torch.save({"model": {**state, "extra.weight": torch.zeros(1)}}, tmp_path / "t2i_XL_stage1_256.pt")
    with pytest.raises(RuntimeError, match="extra.weight"):
        tiny_t2i(pretrained=True, weights_dir=str(tmp_path))


def test_a_missing_text_encoder_names_the_command():
    """(The GPT and VQ files: tests/test_adapters.py, for every adapter.)"""
    with pytest.raises(MissingWeightsError, match="hf download coolsd-tests/no-such-t5"):
        tiny_t2i(text_encoder="coolsd-tests/no-such-t5")


def test_bad_configuration_names_the_key(injected):
    _, t5, tok = injected
    with pytest.raises(ValueError, match="caption_dim"):
        tiny_t2i(text_encoder=tiny_t5(48), tokenizer=tok)
    with pytest.raises(ValueError, match="model.tokenizer"):
        tiny_t2i(text_encoder=t5)
    with pytest.raises(ValueError, match="caption_cleaning"):
        tiny_t2i(caption_cleaning="strip")
    with pytest.raises(ValueError, match="model_type"):
        tiny_t2i(gpt={**OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "llamagen_t2i_tiny.yaml"))["gpt"],
                      "model_type": "c2i"})


def test_caption_cleaning_follows_the_training_pipeline():
    assert clean_caption("  A Photo of a CAT  ") == "a photo of a cat"
    assert clean_caption("A cat, on a sofa.Nice") == "a cat, on a sofa. nice"
    assert clean_caption("<b>Bold</b> cat http://example.com/x") == "bold cat"
    assert clean_caption("“Quoted” dog (small) #12 item_a_b_c_d") == '"quoted" dog small item a b c d'
    assert clean_caption("cat_on_sofa") == "cat_on_sofa"  # three or fewer separators are kept
    assert clean_caption("  Mixed Case ", "lower") == "mixed case"
    assert clean_caption("  Mixed Case ", "none") == "  Mixed Case "
    with pytest.raises(ValueError, match="caption_cleaning"):
        clean_caption("x", "bogus")


def test_tiny_random_text_encoder_is_deterministic(model):
    ids = HashWordTokenizer(512)(["a cat, a cat"], max_length=8)
    row = ids["input_ids"][0].tolist()  # a cat , a cat </s> <pad> <pad>
    assert row[0] == row[3] and row[1] == row[4] and row[0] != row[1] and row[5:] == [1, 0, 0]
    assert ids["attention_mask"][0].tolist() == [1] * 6 + [0] * 2
    assert HashWordTokenizer(512)(["w"] * 1, max_length=3)["input_ids"].shape == (1, 3)
    again = tiny_t2i()
    _, a = prefill1(model, "a photo of a cat")
    _, b = prefill1(again, "a photo of a cat")
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def test_eagle_draft_layer_for_t2i(model):
    from coolsd.drafters.eagle import EagleDrafter, EagleHead
    from coolsd.rng import Streams

    drafter = EagleDrafter(model, head=EagleHead(model))
    _, first = model.prefill([SHORT])
    drafter.begin([SHORT], first, torch.tensor([3]), Streams([0], "cpu"))
    draft = drafter.propose(torch.tensor([3]), torch.tensor([1]), torch.tensor([3]), 3)
    assert draft.tokens.shape == (1, 3) and draft.q.shape == (1, 3, model.codebook_size)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(1, 3, dtype=draft.q.dtype))


# -- LANTERN's drafter call sequence (jadohu/LANTERN models/ea_model_llamagen.py, drafters/cnets_llamagen.py) --
def lantern_checkpoint(model: LlamaGenT2I, folder, seed: int = 0) -> dict[str, torch.Tensor]:
    """A drafter folder in LANTERN's layout (``config.json`` + ``pytorch_model.bin``, cnets_llamagen.Model key
    names, its own ``embed_tokens``) for ``model``'s width; random weights. Returns the state dict."""
    h, v = model.hidden_size, model.codebook_size
    inter = model.make_draft_layer().intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    # scales chosen so that the draft distributions are spread out (peaked ones would hide a wrong context)
    weights = {"fc.weight": rnd(h, 2 * h, scale=0.03), "fc.bias": rnd(h), "embed_tokens.weight": rnd(v, h, scale=1.0),
               "layers.0.self_attn.q_proj.weight": rnd(h, h, scale=0.5),
               "layers.0.self_attn.k_proj.weight": rnd(h, h, scale=0.5),
               "layers.0.self_attn.v_proj.weight": rnd(h, h, scale=0.1),
               "layers.0.self_attn.o_proj.weight": rnd(h, h, scale=0.1),
               "layers.0.mlp.gate_proj.weight": rnd(inter, h, scale=0.05),
               "layers.0.mlp.up_proj.weight": rnd(inter, h, scale=0.05),
               "layers.0.mlp.down_proj.weight": rnd(h, inter, scale=0.05),
               "layers.0.post_attention_layernorm.weight": 1 + rnd(h)}
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": model.cfg.n_head,
              "num_key_value_heads": model.cfg.n_head, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": v, "model_type": "llama", "caption_dim": model.cfg.caption_dim}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))
    return weights


def lantern_drafter_forward(w: dict[str, torch.Tensor], heads: int, eps: float, hidden: torch.Tensor,
                            input_ids: torch.Tensor, position_ids: torch.Tensor, zero_rows: int, grid: int,
                            base: float) -> torch.Tensor:
    """``cnets_llamagen.Model.forward`` written out: ``fc(cat[embed_tokens(ids), hidden])``, one LLaMA layer
    without its input norm, RoPE from ``freqs_cis[position_ids]`` where ``freqs_cis`` = ``zero_rows`` zero
    rows (``cls_token_num = 119`` for a 120-slot caption), the 2-D grid table, 10 + 10 zero rows; q/k rotated
    in float32; causal attention over every pair given, no padding mask, softmax in float32; no final norm.
    ``hidden`` (S, T, H) per CFG stream, ``input_ids`` (T,) shared by the streams, ``position_ids`` (T,)."""
    s, t, dim = hidden.shape
    hd = dim // heads
    half = hd // 2  # precompute_freqs_cis_2d, in float32 as there
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    angles = torch.outer(torch.arange(grid).float(), freqs)  # (grid, hd/4)
    cells = torch.cat([angles[:, None].expand(-1, grid, -1), angles[None].expand(grid, -1, -1)], -1).flatten(0, 1)
    table = torch.cat([torch.zeros(zero_rows, half), cells, torch.zeros(20, half)])  # (rows, hd/2) angles
    live = torch.cat([torch.zeros(zero_rows), torch.ones(grid * grid), torch.zeros(20)]).bool()
    rot = torch.where(live[:, None], torch.polar(torch.ones_like(table), table), 0)[position_ids]  # cos + i sin
    e = w["embed_tokens.weight"][input_ids][None].expand(s, -1, -1)
    x = F.linear(torch.cat([e, hidden], dim=-1), w["fc.weight"], w["fc.bias"])  # (S, T, H)

    def rope(z):  # apply_rotary_emb: x.float() pairs times (cos, sin), type_as(x)
        pairs = torch.view_as_complex(z.view(s, t, heads, hd).float().reshape(s, t, heads, hd // 2, 2))
        return torch.view_as_real(pairs * rot[None, :, None]).flatten(3).to(z.dtype).transpose(1, 2)

    q, k = rope(F.linear(x, w["layers.0.self_attn.q_proj.weight"])), rope(F.linear(x, w["layers.0.self_attn.k_proj.weight"]))
    v = F.linear(x, w["layers.0.self_attn.v_proj.weight"]).view(s, t, heads, hd).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    att = scores.softmax(-1, dtype=torch.float32).to(v.dtype)
    x = x + F.linear((att @ v).transpose(1, 2).reshape(s, t, dim), w["layers.0.self_attn.o_proj.weight"])
    normed = rms(x, w["layers.0.post_attention_layernorm.weight"], eps)
    mlp = F.silu(F.linear(normed, w["layers.0.mlp.gate_proj.weight"])) * F.linear(normed, w["layers.0.mlp.up_proj.weight"])
    return x + F.linear(mlp, w["layers.0.mlp.down_proj.weight"])


class RecordingEagle:
    """Wraps ``EagleDrafter.propose`` to keep (position, drafted tokens, q) of every iteration."""

    @staticmethod
    def attach(drafter):
        records = []
        inner = drafter.propose

        def propose(last_tokens, t, limit, depth, tree=None):
            draft = inner(last_tokens, t, limit, depth, tree)
            if draft.draft_len:  # a batch of one image: (its last committed index, drafts, q)
                records.append((int(t[0]) - 1, draft.tokens[0].clone(), draft.q[0].clone()))
            return draft

        drafter.propose = propose
        return records


def test_lantern_drafters_see_the_whole_caption_prefix_as_lantern_feeds_it(injected, tmp_path):
    """``prefix: all`` = LANTERN's call sequence: the target's hidden states of all C caption slots (padded ones
    included) with ``input_ids[:, 1:]`` of ``[0] * C + [x_0 ..]`` (C − 1 zeros, then the image tokens) at
    drafter positions 0 .. C + P − 1 (``EaModel.initialize_tree`` / ``topK_genrate``: ``self(hidden_states,
    input_ids)`` with default positions, then ``stable_kv`` and ``position_ids = arange(kv_len, ..)``), the
    chain drafts at ``len_posi`` onwards, guided by the same CFG. ``prefix: last`` differs."""
    from baselines.exact import ExactRule
    from coolsd.decoding import Decoder
    from coolsd.drafters.eagle import EagleDrafter

    model, t5, tok = injected
    assert (model.sampling.temperature, model.sampling.top_k, model.sampling.top_p) == (1.0, 0, 1.0)
    weights = lantern_checkpoint(model, tmp_path / "lantern")
    c, n, s = model.cfg.cls_token_num, model.num_image_tokens, model.sampling.cfg_scale
    drafter = EagleDrafter(model, checkpoint=str(tmp_path / "lantern"), prefix="all")
    records = RecordingEagle.attach(drafter)
    out = Decoder("sd", model, ExactRule(), draft_len=3, drafter=drafter).generate(SHORT, seed=0)
    assert model.text(SHORT).num_tokens < c  # padded caption slots are part of the drafter's prefix
    assert drafter.cache.max_len == c + n + 2 * drafter.extra_slots  # C prefix pairs, N - 1 image pairs + 1,
    # a pending block padded to the longest image's and the speculative drafts
    hidden = reference_hidden(model, t5, tok, SHORT, out.tokens)  # (2, C + N, H): every slot of both streams
    ids = torch.cat([torch.zeros(c, dtype=torch.long), out.tokens])[1:]  # LANTERN's input_ids[:, 1:]

    def lantern_q(position: int, drafted: torch.Tensor) -> torch.Tensor:
        """LANTERN's draft distributions after committed token ``position`` for the chain ``drafted``."""
        feats, toks = hidden[:, : c + position], ids[: c + position]  # pairs of the stable_kv prefix
        qs = []
        for i in range(drafted.shape[0] + 1):
            f_hat = lantern_drafter_forward(weights, model.cfg.n_head, 1e-6, feats, toks,
                                            torch.arange(toks.shape[0]), c - 1, model.grid[0],
                                            model.cfg.rope_base)[:, -1:]  # (2, 1, H)
            logits = F.linear(f_hat[:, 0], model.gpt.output.weight)  # the target's frozen head
            qs.append(torch.softmax(logits[1] + s * (logits[0] - logits[1]), dim=-1))
            if i < drafted.shape[0]:  # next level: (the predicted feature, the drafted token) at len_posi
                feats, toks = torch.cat([feats, f_hat], 1), torch.cat([toks, drafted[i:i + 1]])
        return torch.stack(qs[:-1]).float()

    assert len(records) > 10
    for position, drafted, q in records:
        torch.testing.assert_close(q, lantern_q(position, drafted), rtol=1e-5, atol=1e-8)
    # the `last` convention (the prefill's last hidden state only) gives other draft distributions
    last = EagleDrafter(model, checkpoint=str(tmp_path / "lantern"), prefix="last")
    _, first = model.prefill([SHORT])
    last.begin([SHORT], first, out.tokens[:1], Streams([0], "cpu"))
    q_last = last.propose(out.tokens[:1], torch.tensor([1]), torch.tensor([1]), 1).q[0, 0]
    q_all = lantern_q(0, records[0][1])[0]
    assert (q_last - q_all).abs().sum() > 0.05  # L1; 0.31 measured


def test_prefix_all_decodes_losslessly_on_trees(injected, tmp_path):
    """Greedy SD with a LANTERN-layout drafter fed the whole prefix reproduces greedy AR, chain and trees."""
    from baselines.exact import ExactRule
    from coolsd.decoding import Decoder
    from coolsd.drafters.eagle import EagleDrafter

    model, _, _ = injected
    greedy = tiny_t2i(text_encoder=model.text.encoder, tokenizer=model.text.tokenizer, caption_cleaning="lower",
                      sampling={**dataclasses.asdict(model.sampling), "temperature": 0.0})
    lantern_checkpoint(greedy, tmp_path / "lantern")
    ar = Decoder("ar", greedy, ExactRule()).generate(SHORT, seed=0).tokens
    for tree in (None, "mc_sim_7b_63"):
        drafter = EagleDrafter(greedy, checkpoint=str(tmp_path / "lantern"), prefix="all")
        sd = Decoder("sd", greedy, ExactRule(), draft_len=4, tree=tree, drafter=drafter).generate(SHORT, seed=0)
        assert torch.equal(sd.tokens, ar), tree


def test_prefix_all_training_pairs_are_what_the_drafter_sees_when_decoding(model, tmp_path):
    """Distillation data and training (scripts/train_drafter.py) use the decoding convention: the cached
    drafts of ``EagleDrafter(prefix="all")`` equal the head run teacher-forced over ``training_pairs`` of
    ``teacher_force(prefix="all")`` (every caption slot with token id 0, then the image pairs)."""
    from baselines.exact import ExactRule
    from coolsd.decoding import Decoder
    from coolsd.drafters.eagle import EagleDrafter, EagleHead
    from coolsd.sampling import stream_probs
    from coolsd.training import data as dd

    c, n = model.cfg.cls_token_num, model.num_image_tokens
    head = EagleHead(model, init_seed=3, prefix="all")
    drafter = EagleDrafter(model, head=head, prefix="all")
    records = RecordingEagle.attach(drafter)
    gen = Decoder("sd", model, ExactRule(), draft_len=3, drafter=drafter).generate(SHORT, seed=5)
    hidden = model.teacher_force([SHORT], gen.tokens[None], prefix="all")[0]  # (S, C+N, H)
    assert hidden.shape == (2, c + n, model.hidden_size)
    torch.testing.assert_close(hidden[:, c - 1:], model.teacher_force([SHORT], gen.tokens[None])[0])
    features, tokens, _ = dd.training_pairs(hidden, gen.tokens)
    assert torch.equal(tokens[: c - 1], torch.zeros(c - 1, dtype=torch.long)) and torch.equal(tokens[c - 1:], gen.tokens)
    with torch.no_grad():
        f_hat = head(features, tokens, dd.pair_positions(n, "cpu", c))[:, -n:]  # pair j -> token j + 1
        q_tf = stream_probs(head.logits(f_hat), model.sampling)
    assert len(records) > 10
    for position, _, q in records:
        torch.testing.assert_close(q[0], q_tf[position], rtol=1e-9, atol=1e-12)
    # the data folder records the convention: samples for `all` are not reused for `last`
    data = dd.DistillConfig(num_samples=2, shard_size=2, storage_dtype="float32")
    manifest = dd.generate_data(model, data, tmp_path / "d", [SHORT], progress=False, prefix="all")
    assert dd.manifest_prefix(manifest) == "all"
    from safetensors.torch import load_file
    assert load_file(str(tmp_path / "d" / "shard_00000.safetensors"))["hidden"].shape[2] == c + n
    with pytest.raises(ValueError, match="prefix"):
        dd.generate_data(model, data, tmp_path / "d", [SHORT], progress=False, prefix="last")


@pytest.mark.gpu
def test_real_size_xl_on_gpu(tmp_path):
    """GPT-XL (T2I, 512 px) with random weights on CUDA: timing and bf16-vs-fp32 agreement, through the
    GPU command's named step (``scripts/gpu.py --steps xl_numerics``, ``eval.bench.gpu_check_llamagen``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    proc = subprocess.run([sys.executable, "scripts/gpu.py", "--steps", "xl_numerics", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())["results"]["xl_numerics"]
    # bounds estimated from GPT-B on a CPU (1.4 % mean relative logit error, 94 % arg-max agreement)
    assert report["rel_mean_abs_diff"] < 0.05 and report["argmax_agreement"] >= 0.8
    assert report["guided_tv_mean"] < 0.1
