"""Janus-Pro adapter on a tiny random ``JanusConfig`` (no download): exact agreement with ``transformers``'
own image-generation loop, cached == uncached, draft trees, KV compaction, the VQ decode, the EAGLE draft
layer and its training. What every adapter promises (batched = alone, shapes, missing weights, the published
size on the meta device, every decoder through ``run.py``) is checked in ``tests/test_adapters.py``.

All comparisons are exact identities (float64 models, tolerances of rounding error only). About 35 s of
CPU time on one core: importing ``transformers`` ~10 s, drafter training ~7 s, the rest a few seconds each.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import ClassifierFreeGuidanceLogitsProcessor

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.models.janus_pro import JanusArch, JanusPro, layer_skip_copy, tiny_tokenizer
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from tests.helpers import CONFIGS, forward1, keep1, prefill1
PROMPT = "a red cube on a table"
EXACT = {"rtol": 1e-9, "atol": 1e-9}


def tiny_janus(dtype: str = "float64", **sampling) -> JanusPro:
    return JanusPro(sampling={"cfg_scale": 5.0, **sampling}, pretrained=False, arch={}, device="cpu",
                    dtype=dtype)


@pytest.fixture(scope="module")
def janus() -> JanusPro:
    """The tiny random Janus (``JanusArch()`` sizes: 2 layers of width 64, an 8x8 grid, 256 codes), CFG 5."""
    return tiny_janus()


class RecordScores(LogitsProcessor):
    """Keeps the raw per-row scores that ``generate`` hands to its logits processors, step by step."""

    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def hf_generate(model: JanusPro, prompt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers``' image generation: sampled tokens (N,) and the raw logits (2, N, V) it saw."""
    ids = model.prompt_ids(prompt)[None]  # (1, P)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, guidance_scale=5.0,
                              bos_token_id=model.bos_id, pad_token_id=model.pad_id,
                              generation_kwargs={"boi_token_id": model.boi_id})
    recorder = RecordScores()
    torch.manual_seed(seed)
    tokens = model.janus.generate(ids, attention_mask=torch.ones_like(ids), generation_mode="image",
                                  generation_config=config, logits_processor=LogitsProcessorList([recorder]))
    return tokens[0], torch.stack(recorder.scores, dim=1)


def teacher_forced(model: JanusPro, prompt: str, tokens: torch.Tensor):
    """Our prefill + one block over ``tokens[:-1]``: logits (S, N, V) for tokens 0 .. N-1."""
    cache, first = prefill1(model, prompt)
    out = forward1(model, cache, tokens[:-1], torch.arange(tokens.shape[0] - 1))
    return torch.cat([first.logits, out.logits], dim=1), torch.cat([first.hidden, out.hidden], dim=1)


def hf_uncached_logits(model: JanusPro, prompt: str, tokens: torch.Tensor) -> torch.Tensor:
    """One uncached ``LlamaModel`` forward over [prompt; image tokens] per stream -> logits (S, N, V)."""
    ids = model.stream_ids(prompt)  # (S, P)
    with torch.no_grad():
        image = model.janus.prepare_embeddings_for_image_generation(tokens[:-1])  # (N-1, H)
        h = torch.cat([model.lm.embed_tokens(ids), image.expand(ids.shape[0], -1, -1)], dim=1)
        hidden = model.lm(inputs_embeds=h).last_hidden_state[:, ids.shape[1] - 1 :]
        return model.janus.model.generation_head(hidden)


# -- the target ------------------------------------------------------------------------------------------
def test_prompt_template_and_the_unconditional_stream(janus):
    ids = janus.prompt_ids(f"  {PROMPT} ")
    assert janus.tokenizer.decode(ids) == (
        f"<｜begin▁of▁sentence｜><|User|>: {PROMPT}\n\n<|Assistant|>:<begin_of_image>")
    cond, uncond = janus.stream_ids(PROMPT)
    assert torch.equal(cond, ids)
    assert uncond[0] == janus.bos_id and uncond[-1] == janus.boi_id
    assert (uncond[1:-1] == janus.pad_id).all() and (cond[1:-1] != janus.pad_id).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_guided_logits_equal_transformers_image_generation(janus, seed):
    """Same prompt and seed: HF's loop samples N tokens; teacher-forcing them through the adapter gives HF's
    raw logits per stream (cond first) at every step, the first token included, and the same guided
    distribution as HF's CFG processor + softmax."""
    tokens, theirs = hf_generate(janus, PROMPT, seed)  # (N,), (2, N, V)
    assert tokens.shape == (janus.num_image_tokens,)
    ours, _ = teacher_forced(janus, PROMPT, tokens)
    torch.testing.assert_close(ours, theirs, **EXACT)
    cfg = ClassifierFreeGuidanceLogitsProcessor(5.0)  # HF's CFG on stacked [cond; uncond] halves
    guided = cfg(torch.zeros(1, 1), theirs[:, 0])  # (1, V); input_ids only fix the batch size
    _, first = prefill1(janus, PROMPT)
    # the shared pipeline works in float32
    expected = torch.softmax(guided[0].float(), -1)
    torch.testing.assert_close(janus.probs(first)[0], expected, rtol=1e-5, atol=1e-7)
    # a broken variant (the streams swapped, uncond read as cond) is far from it
    swapped = torch.softmax(cfg(torch.zeros(1, 1), theirs[[1, 0], 0])[0], -1)
    assert (swapped - janus.probs(first)[0]).abs().max() > 1e-3


def test_cached_incremental_decoding_equals_an_uncached_full_forward(janus):
    tokens = torch.randint(janus.codebook_size, (janus.num_image_tokens,),
                           generator=torch.Generator().manual_seed(2))
    reference = hf_uncached_logits(janus, PROMPT, tokens)  # (S, N, V)
    cache, first = prefill1(janus, PROMPT)
    logits, start = [first.logits], 0
    for size in (1, 1, 3, 2, 5, 1, 8):  # uneven blocks, then one token at a time
        block = tokens[start : start + size]
        logits.append(forward1(janus, cache, block, torch.arange(start, start + size)).logits)
        start += size
    while start < tokens.shape[0] - 1:
        logits.append(forward1(janus, cache, tokens[start : start + 1], torch.tensor([start])).logits)
        start += 1
    torch.testing.assert_close(torch.cat(logits, dim=1), reference, **EXACT)


def test_tree_attention_matches_per_path_forwards(janus):
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(janus.codebook_size, (5,), generator=gen)
    nodes = torch.randint(janus.codebook_size, (len(parents),), generator=gen)
    cache, _ = prefill1(janus, PROMPT)
    forward1(janus, cache, prefix, torch.arange(5))
    cache.keep(5)
    root = torch.tensor([7])
    positions = torch.tensor([5] + [5 + d for d in depths_of(parents)])
    tree_out = forward1(janus, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in range(len(parents)):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        ref_cache, _ = prefill1(janus, PROMPT)
        seq = torch.cat([prefix, root, nodes[path]])
        ref = forward1(janus, ref_cache, seq, torch.arange(len(seq)))
        torch.testing.assert_close(tree_out.logits[:, j + 1], ref.logits[:, -1], **EXACT)
        torch.testing.assert_close(tree_out.hidden[:, j + 1], ref.hidden[:, -1], **EXACT)


def test_kv_compaction_then_forward_equals_uncached(janus):
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    nodes = torch.randint(janus.codebook_size, (len(parents),), generator=torch.Generator().manual_seed(3))
    cache, _ = prefill1(janus, PROMPT)
    root = torch.tensor([11])
    forward1(janus, cache, torch.cat([root, nodes]), torch.tensor([0] + depths_of(parents)),
                        ancestor_mask(parents))
    path = [1, 5, 13, 21]  # block indices of nodes [0], [0,0], [0,0,0], [0,0,0,0]
    assert [shape.paths[i - 1] for i in path] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    keep1(cache, torch.tensor([0] + path))
    nxt = torch.tensor([42, 43])
    after = forward1(janus, cache, nxt, torch.arange(5, 7))
    committed = torch.cat([root, nodes[[i - 1 for i in path]], nxt, torch.tensor([0])])
    reference = hf_uncached_logits(janus, PROMPT, committed)  # (S, 8, V): outputs of inputs 0..6 + prefill
    torch.testing.assert_close(after.logits, reference[:, -2:], **EXACT)


def test_decode_image_gives_the_vq_image_in_0_1_and_uint8(janus):
    tokens = torch.randint(janus.codebook_size, (janus.num_image_tokens,),
                           generator=torch.Generator().manual_seed(4))
    side = janus.grid[0] * 16
    image = janus.decode_float(tokens)
    assert image.shape == (3, side, side) and image.dtype == torch.float32
    assert image.min() >= 0.0 and image.max() <= 1.0 and image.std() > 0
    with torch.no_grad():
        hf = janus.janus.decode_image_tokens(tokens[None])[0].permute(2, 0, 1)  # HF returns NHWC in [-1, 1]
    torch.testing.assert_close(image, ((hf + 1) / 2).clamp(0, 1), rtol=1e-6, atol=1e-6)
    pixels = janus.decode_image(tokens)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, side, side)
    recipe = np.zeros((side, side, 3), dtype=np.uint8)  # generation_inference.py: clip, then into uint8
    recipe[:, :, :] = np.clip((hf.permute(1, 2, 0).float().numpy() + 1) / 2 * 255, 0, 255)
    assert torch.equal(pixels, torch.from_numpy(recipe).permute(2, 0, 1))  # truncated (pixel_rounding)
    assert not torch.equal(pixels, (image * 255).round().to(torch.uint8))  # not rounded
    assert janus.codebook().shape == (janus.codebook_size, 8)


def test_bad_settings_name_the_key():
    """(Missing weights: tests/test_adapters.py, for every adapter.)"""
    with pytest.raises(ValueError, match="model.arch"):
        JanusPro(sampling={}, pretrained=False, device="cpu")
    with pytest.raises(ValueError, match="model.arch=null"):
        JanusPro(sampling={}, pretrained=True, repo_id="deepseek-community/Janus-Pro-1B", arch={},
                 device="cpu")
    with pytest.raises(ValueError, match="model.arch.patch_size"):
        JanusArch(patch_size=8)


def test_pretrained_loading_reads_a_saved_checkpoint(monkeypatch, tmp_path):
    """``pretrained=true`` on a hub snapshot (here a saved tiny model): same weights, tokenizer, logits."""
    import huggingface_hub

    source = tiny_janus("float32")
    source.janus.save_pretrained(tmp_path)
    source.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: str(tmp_path))
    loaded = JanusPro(sampling={"cfg_scale": 5.0}, repo_id="deepseek-community/Janus-Pro-1B", device="cpu",
                      dtype="float32")
    assert torch.equal(loaded.prompt_ids(PROMPT), source.prompt_ids(PROMPT))
    assert torch.equal(prefill1(loaded, PROMPT)[1].logits, prefill1(source, PROMPT)[1].logits)


# -- drafters --------------------------------------------------------------------------------------------
def test_draft_layer_is_a_llama_layer_without_input_norm_at_pair_position_plus_one(janus):
    """The draft layer equals ``transformers``' ``LlamaDecoderLayer`` (input norm removed) rotated at RoPE
    position t + 1; cached blocks equal the teacher-forced pass; a constant position offset (the prompt
    length the drafter leaves out) changes nothing; HF-Llama key names load as they are."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layer = janus.make_draft_layer()
    text = janus.janus.config.text_config
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 9, janus.hidden_size, generator=gen, dtype=torch.float64)  # (B, T, H)
    positions = torch.arange(-1, 8)
    with torch.no_grad():
        ours = layer(h, positions, None, None)
        text = copy.deepcopy(text)
        text._attn_implementation = "sdpa"  # causal when no mask is given
        ref = LlamaDecoderLayer(text, layer_idx=0).double()
        ref.load_state_dict(layer.state_dict(), strict=False)
        ref.input_layernorm = torch.nn.Identity()
        rope = layer.rotary(h, (positions + 1)[None])
        torch.testing.assert_close(ours, ref(h, attention_mask=None, position_embeddings=rope), **EXACT)
        shifted = layer(h, positions + 37, None, None)
        torch.testing.assert_close(shifted, ours, rtol=1e-7, atol=1e-7)
        head = EagleHead(janus, init_seed=1)
        cache = EagleDrafter(janus, head=head).new_cache(batch=1)  # one image: its two CFG rows are h's rows
        parts = []
        for lo, hi in ((0, 1), (1, 4), (4, 9)):
            mask = cache.begin_block(hi - lo)
            parts.append(layer(h[:, lo:hi], positions[lo:hi], cache, mask))
        torch.testing.assert_close(torch.cat(parts, dim=1), ours, **EXACT)
    assert layer.to(torch.bfloat16).rotary.inner.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    state = layer.state_dict()
    assert set(layer.from_eagle_keys(state)) == set(state) and "self_attn.q_proj.weight" in state
    with pytest.raises(ValueError, match="input_layernorm"):
        layer.from_eagle_keys({**state, "input_layernorm.weight": torch.ones(janus.hidden_size)})


@pytest.mark.parametrize("tree", [None, "mc_sim_7b_63"])
def test_greedy_sd_with_eagle_and_layer_skip_drafters_equals_greedy_ar(tree):
    model = tiny_janus(temperature=0.0)
    ar = Decoder("ar", model, ExactRule()).generate(PROMPT, seed=0).tokens
    eagle = EagleDrafter(model, head=EagleHead(model, init_seed=4))
    sd = Decoder("sd", model, ExactRule(), draft_len=4, tree=tree, drafter=eagle).generate(PROMPT, seed=0)
    assert torch.equal(sd.tokens, ar)
    from coolsd.drafters.model_drafter import ModelDrafter

    skip = ModelDrafter(model, layer_skip_copy(model, 1))
    sd = Decoder("sd", model, ExactRule(), draft_len=4, tree=tree, drafter=skip).generate(PROMPT, seed=0)
    assert torch.equal(sd.tokens, ar) and sd.stats.mean_accepted_length > 1.0


def test_drafter_training_runs_on_janus(tmp_path):
    from coolsd.training import drafter as td

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train_drafter", overrides=[
            "model=janus_tiny", "model.device=cpu", "wandb.mode=disabled", "train.progress=false",
            "data.prompts=[a cat,a red cube]", f"distill.dir={tmp_path / 'data'}",
            f"out_dir={tmp_path / 'drafter'}",
            "distill.num_samples=4", "distill.shard_size=2", "distill.storage_dtype=float32", "train.steps=4",
            "train.batch_size=2", "train.warmup_steps=1", "train.checkpoint_every=4", "train.val_every=100",
            "val.num_images=1", "val.max_samples=2", "val.prompts=[a dog]"])
    result = td.run(cfg)
    assert result.steps == 4
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["target"].endswith("JanusPro") and config["hidden_size"] == 64
    model = tiny_janus("float32")
    drafter = EagleDrafter(model, checkpoint=str(tmp_path / "drafter"))
    generated = Decoder("sd", model, ExactRule(), draft_len=3, drafter=drafter).generate("a cat", seed=0)
    assert generated.tokens.shape == (model.num_image_tokens,)


def test_the_tiny_tokenizer_round_trips_text():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("<|User|>: hi\n<begin_of_image>")["input_ids"]
    assert tokenizer.decode(ids) == "<|User|>: hi\n<begin_of_image>"
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<begin_of_image>")
