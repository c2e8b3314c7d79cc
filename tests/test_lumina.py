"""Lumina-mGPT adapter on a tiny random Chameleon + tiny VQGAN (no download): vocabulary map, prompt and
structural tokens against transformers' own Chameleon forward, the unconditional CFG stream, cached and
tree forwards, KV compaction and rollback across row ends, the EAGLE draft layer, Meta's VQGAN checkpoint
layout, missing-file errors, greedy speculative decoding = AR. What every adapter promises (batched = alone,
shapes, missing weights, the published size on the meta device, every decoder through ``run.py``) is checked in
``tests/test_adapters.py``.

Everything is exact (float64, tolerance 1e-9). No network, no checkpoints. About 15 s on one CPU core (plus the
imports).
"""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import yaml

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.chameleon_vqgan import (
    ChameleonVQGAN,
    ChameleonVQGANConfig,
    load_vqgan,
    read_vqgan_state,
)
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.lumina_mgpt import (
    ChameleonVocabulary,
    LuminaMGPT,
    expand_qk_norm,
    image_token_name,
    layer_skip_copy,
    parse_image_token,
    tiny_vocabulary,
)
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from coolsd.rng import HEADER, Streams
from tests.helpers import forward1, keep1, prefill1

TOL = {"rtol": 1e-9, "atol": 1e-9}
PROMPT = "a red cat"
SIZES = {"num_hidden_layers": 2, "num_key_value_heads": 2, "num_codes": 64}


def tiny_lumina(header: str = "forced", header_mismatch: str = "force", **sampling) -> LuminaMGPT:
    """64 x 96 px -> a 6 x 4 grid (rows of 4 codes + end of row), GQA, CFG 3, float64; the header forced
    unless asked (random weights would sample any header)."""
    return LuminaMGPT(sampling={"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, **sampling}, width=64,
                      height=96, pretrained=False, random_init=SIZES, device="cpu", dtype="float64",
                      header=header, header_mismatch=header_mismatch)


@pytest.fixture(scope="module")
def model() -> LuminaMGPT:
    return tiny_lumina()


@pytest.fixture(scope="module")
def reference(model):
    """transformers' ChameleonForConditionalGeneration with the adapter's weights (its VQ encoder aside)."""
    from transformers import ChameleonForConditionalGeneration

    hf = ChameleonForConditionalGeneration(model.lm.config)
    missing, unexpected = hf.load_state_dict(model.lm.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("model.vqmodel.") for k in missing)
    return hf.to(torch.float64).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Full-vocabulary logits (T, vocab) of one sequence at positions 0..T-1, no cache."""
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                       use_cache=False)
        return hf.lm_head(out.last_hidden_state)[0]


def image_part(model, codes: torch.Tensor) -> list[int]:
    """The reference layout of image codes: BPE ids, an end-of-row token after every row."""
    w, out = model.grid[1], []
    for i, code in enumerate(codes.tolist()):
        out.append(int(model.code_to_bpe[code]))
        if i % w == w - 1:
            out.append(model.vocabulary.end_of_row)
    return out


def codes(model, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(model.codebook_size, (n,), generator=torch.Generator().manual_seed(seed))


def chain_output(model, tokens: torch.Tensor):
    """Fresh prefill, then one causal block over ``tokens`` at positions 0..T-1."""
    cache, _ = prefill1(model, PROMPT)
    return forward1(model, cache, tokens, torch.arange(len(tokens)))


# -- vocabulary and prompt -----------------------------------------------------------------------------------
def test_image_codes_come_from_the_token_names_not_an_offset(model):
    assert image_token_name(123) == "IMGIMGBCDZ" and parse_image_token("IMGIMGBCDZ") == 123
    assert parse_image_token("IMGIMGZ") is None and parse_image_token("<s>") is None
    names = model.tokenizer.convert_ids_to_tokens(model.code_to_bpe.tolist())
    assert names == [image_token_name(c) for c in range(model.codebook_size)]
    assert not torch.equal(model.code_to_bpe, torch.arange(model.codebook_size) + 4)  # shuffled on purpose
    ordered = ChameleonVocabulary(tiny_vocabulary(64, [1], shuffle=False))
    assert torch.equal(ordered.code_to_bpe, torch.arange(64) + 4)  # the released layout: bpe = code + 4
    some = torch.tensor([[5, 0], [63, 17]])
    assert torch.equal(model.vocabulary.bpe_to_code(model.code_to_bpe[some]), some)
    h = torch.randn(3, model.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(model.head(h), model.lm.lm_head(h)[:, model.code_to_bpe], **TOL)
    torch.testing.assert_close(model.embed(some), model.lm.model.embed_tokens(model.code_to_bpe[some]), **TOL)


def test_prompt_follows_the_lumina_conversation_template(model):
    ids = model.prompt_ids(PROMPT)
    assert model.tokenizer.convert_ids_to_tokens(ids) == [
        "<s>", "Generate", "an", "image", "of", "64x96", "according", "to", "the", "following", "prompt", ":",
        "a", "red", "cat", "<reserved08706>", "<racm3:break>", "<reserved08803>", "<reserved08802>"]
    assert model.grid == (6, 4)  # height 96 px = 3 units -> 6 rows; width 64 px = 2 units -> 4 columns


# -- the forward against transformers' Chameleon -------------------------------------------------------------
def test_structural_tokens_and_both_cfg_streams_match_the_reference_sequences(model, reference):
    """Prefill + one block over all codes = transformers' forward over the explicit Lumina sequences.

    Conditional stream: prompt, header, rows of codes each followed by the end-of-row token, positions from
    0. Unconditional stream: the header and the same image part, its positions from 0 at the image start.
    """
    x = codes(model, model.num_image_tokens)
    cond_prefix, header = model.prompt_ids(PROMPT), model.image_header()
    image = image_part(model, x)
    cond = hf_logits(reference, cond_prefix + image)[:, model.code_to_bpe]  # (T, V) image-code logits
    uncond = hf_logits(reference, header + image)[:, model.code_to_bpe]
    cache, first = prefill1(model, PROMPT)
    out = forward1(model, cache, x, torch.arange(len(x)))
    w = model.grid[1]
    rows = [i + i // w + int(i % w == w - 1) for i in range(len(x))]  # row predicting token i + 1
    torch.testing.assert_close(first.logits[0, 0], cond[len(cond_prefix) - 1], **TOL)
    torch.testing.assert_close(first.logits[1, 0], uncond[len(header) - 1], **TOL)
    torch.testing.assert_close(out.logits[0], cond[[len(cond_prefix) + r for r in rows]], **TOL)
    torch.testing.assert_close(out.logits[1], uncond[[len(header) + r for r in rows]], **TOL)
    probs = model.probs(out)  # the guided distribution: u + 3 (c - u), over image codes only
    expected = torch.softmax(uncond[[len(header) + r for r in rows]] * -2.0
                             + 3.0 * cond[[len(cond_prefix) + r for r in rows]], -1)
    torch.testing.assert_close(probs, expected.float(), rtol=1e-5, atol=1e-7)
    assert cache.kv.lengths[0] == len(cond_prefix) + len(image)  # one end-of-row slot per row, nothing else


def test_swin_norm_layers_match_transformers():
    """Chameleon-34B's layer variant (norms after attention and MLP) also follows transformers' forward."""
    from transformers import ChameleonForConditionalGeneration

    swin = LuminaMGPT(sampling={"cfg_scale": 1.0}, width=64, height=96, pretrained=False,
                      random_init={**SIZES, "swin_norm": True}, device="cpu", dtype="float64")
    hf = ChameleonForConditionalGeneration(swin.lm.config)
    hf.load_state_dict(swin.lm.state_dict(), strict=False)
    hf = hf.to(torch.float64).eval()
    x = codes(swin, 9, seed=8)
    prefix = swin.prompt_ids(PROMPT)
    expected = hf_logits(hf, prefix + image_part(swin, x))[:, swin.code_to_bpe]
    rows = [len(prefix) + i + i // 4 + int(i % 4 == 3) for i in range(9)]
    torch.testing.assert_close(chain_output(swin, x).logits[0], expected[rows], **TOL)


def test_cached_incremental_decoding_equals_one_full_forward(model):
    x = codes(model, model.num_image_tokens, seed=1)
    full = chain_output(model, x)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        cache, _ = prefill1(model, PROMPT)
        logits, hidden, t = [], [], 0
        while t < len(x):
            size = int(torch.randint(1, 6, (1,), generator=g))
            out = forward1(model, cache, x[t: t + size], torch.arange(t, min(t + size, len(x))))
            logits.append(out.logits), hidden.append(out.hidden)
            t += size
        torch.testing.assert_close(torch.cat(logits, 1), full.logits, **TOL)
        torch.testing.assert_close(torch.cat(hidden, 1), full.hidden, **TOL)


def test_single_stream_without_cfg(model):
    plain = LuminaMGPT(sampling={"cfg_scale": 1.0}, width=64, height=96, pretrained=False, random_init=SIZES,
                       device="cpu", dtype="float64")
    x = codes(plain, 9)
    assert plain.num_streams == 1
    torch.testing.assert_close(chain_output(plain, x).logits[0], chain_output(model, x).logits[0], **TOL)


# -- the sampled image header (inference_solver.py's logits processors) ---------------------------------------
class ScriptedSample:
    """Stands in for ``coolsd.models.lumina_mgpt.sample``: records each distribution, returns scripted ids."""

    def __init__(self, tokens):
        self.tokens, self.probs = list(tokens), []

    def __call__(self, probs, u):
        self.probs.append(probs[0].clone())
        return torch.tensor([self.tokens[len(self.probs) - 1]])


def interleaved_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """InterleavedTopKLogitsWarper: keep the k highest logits (ties with the k-th kept), then softmax."""
    kth = torch.topk(logits, k).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


def test_the_sampled_header_follows_the_reference_and_a_mismatch_is_explicit(reference, monkeypatch):
    """``header=sampled``: ``<racm3:break>`` from the unguided full-vocabulary logits with text top-k 10, the size
    tokens unguided and unmasked with image top-k; the grid is checked against the sampled size tokens."""
    import coolsd.models.lumina_mgpt as lm

    model = tiny_lumina(header="sampled", header_mismatch="error", top_k=20)
    text = model.text_ids(PROMPT)
    expected = model.image_header()
    script = ScriptedSample(expected)
    monkeypatch.setattr(lm, "sample", script)
    gen = Streams([0], "cpu")
    model.prefill([PROMPT], streams=gen)  # a matching header: no error
    assert len(script.probs) == 3
    for step, k in enumerate((10, 20, 20)):  # text top-k for the break, image top-k inside the image
        logits = hf_logits(reference, text + expected[:step])[-1]  # conditional stream, no CFG, no mask
        torch.testing.assert_close(script.probs[step], interleaved_top_k(logits, k).float(), rtol=1e-5, atol=1e-7)
        assert int((script.probs[step] > 0).sum()) == k
    # a sampled size other than the configured grid's: error, or continue with the configured header
    wrong = [expected[0], expected[2], expected[1]]  # 64 x 96 sampled as 96 x 64
    monkeypatch.setattr(lm, "sample", ScriptedSample(wrong))
    with pytest.raises(lm.HeaderMismatchError, match="reserved08802.*64x96"):
        model.prefill([PROMPT], streams=gen)
    model.header_mismatch = "force"
    monkeypatch.setattr(lm, "sample", ScriptedSample(wrong))
    with pytest.warns(UserWarning, match="continuing with the configured header"):
        _, out = model.prefill([PROMPT], streams=gen)
    assert model.header_mismatches[-1]["prompt"] == PROMPT
    _, forced = tiny_lumina(top_k=20).prefill([PROMPT])
    torch.testing.assert_close(out.logits, forced.logits, **TOL)  # the configured header's context
    # without the decoder's streams (teacher forcing, draft models) nothing is sampled
    monkeypatch.setattr(lm, "sample", ScriptedSample([]))
    prefill1(model, PROMPT)


def test_sampled_headers_take_their_own_draws():
    """Through the decoder, ``sampled`` draws the three header tokens from the image's stream (their own draw
    kind), so with the configured header forced back (random weights sample any header) the image tokens
    equal ``forced``'s: sampling the header does not shift the image's draws."""
    sampled, forced = tiny_lumina(header="sampled"), tiny_lumina(header="forced")
    with pytest.warns(UserWarning, match="sampled the image header"):  # random weights: any header
        a = Decoder("ar", sampled, ExactRule()).generate(PROMPT, 3).tokens
    b = Decoder("ar", forced, ExactRule()).generate(PROMPT, 3).tokens
    assert torch.equal(a, b) and len(sampled.header_mismatches) == 1
    u = Streams([3], "cpu").uniform(torch.zeros(1, dtype=torch.long), HEADER, 3)[0]
    header = sampled.sample_header(PROMPT, u)
    assert len(header) == 3 and header == sampled.sample_header(PROMPT, u)  # deterministic in its uniforms
    with pytest.raises(ValueError, match="model.header"):
        LuminaMGPT(sampling={}, width=64, height=96, pretrained=False, random_init=SIZES, device="cpu",
                   header="guessed")


# -- trees, compaction, rollback -----------------------------------------------------------------------------
def tree_setup(model):
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    nodes = codes(model, len(parents), seed=3)
    depths = depths_of(parents)
    return parents, nodes, depths


def path_of(parents, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


def test_tree_attention_matches_per_path_forwards(model):
    """A tree rooted at image position 2: depth 1 and depth 5 nodes end a row (width 4)."""
    parents, nodes, depths = tree_setup(model)
    prefix, root = codes(model, 2, seed=4), torch.tensor([7])
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, prefix, torch.arange(2))
    cache.keep(2)
    positions = torch.tensor([2] + [2 + d for d in depths])
    tree = forward1(model, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in range(len(parents)):
        seq = torch.cat([prefix, root, nodes[path_of(parents, j)]])
        ref = chain_output(model, seq)
        torch.testing.assert_close(tree.logits[:, j + 1], ref.logits[:, -1], **TOL)
        torch.testing.assert_close(tree.hidden[:, j + 1], ref.hidden[:, -1], **TOL)


def test_tree_in_two_blocks_with_a_mask_over_the_earlier_block(model):
    """Dynamic-tree drafting feeds a tree level by level: the mask (T, K) covers earlier blocks (K > T)."""
    parents, nodes, depths = tree_setup(model)
    full = ancestor_mask(parents)  # (M+1, M+1) over [root, nodes]
    split = 1 + sum(d <= 2 for d in depths)  # root and depths 1, 2 first (nodes are in depth order)
    prefix, root = codes(model, 2, seed=4), torch.tensor([7])
    tokens = torch.cat([root, nodes])
    positions = torch.tensor([2] + [2 + d for d in depths])
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, prefix, torch.arange(2))
    cache.keep(2)
    forward1(model, cache, tokens[:split], positions[:split], full[:split, :split])
    late = forward1(model, cache, tokens[split:], positions[split:], full[split:])
    for row in range(split, len(tokens)):
        seq = torch.cat([prefix, root, nodes[path_of(parents, row - 1)]])
        torch.testing.assert_close(late.logits[:, row - split], chain_output(model, seq).logits[:, -1], **TOL)


def test_kv_compaction_then_forward_equals_uncached(model):
    parents, nodes, depths = tree_setup(model)
    shape = TreeShape.load("mc_sim_7b_63")
    root = torch.tensor([11])
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, torch.cat([root, nodes]), torch.tensor([0] + depths), ancestor_mask(parents))
    path = [1, 5, 13, 21]  # nodes [0], [0,0], [0,0,0], [0,0,0,0]: image positions 1..4, row end at 3
    assert [shape.paths[i - 1] for i in path] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    keep1(cache, torch.tensor([0] + path))
    assert cache.lengths[0] == 5 and cache.newline[0] == [False, False, False, True, False]
    nxt = torch.tensor([42, 43, 44])
    after = forward1(model, cache, nxt, torch.arange(5, 8))
    committed = torch.cat([root, nodes[[i - 1 for i in path]], nxt])
    torch.testing.assert_close(after.logits, chain_output(model, committed).logits[:, -3:], **TOL)


@pytest.mark.parametrize("kept", [2, 3, 4, 6])
def test_prefix_keep_and_rollback_across_a_row_end(model, kept):
    """Keep the first ``kept`` tokens of a block over positions 1..7 (row ends at 3 and 7), or roll back to
    the same length, then continue: both equal an uncached forward of the committed tokens."""
    x = codes(model, 12, seed=5)
    for mode in ("keep", "rollback"):
        cache, _ = prefill1(model, PROMPT)
        forward1(model, cache, x[:1], torch.arange(1))
        forward1(model, cache, x[1:8], torch.arange(1, 8))
        if mode == "keep":
            cache.keep(kept)
        else:
            forward1(model, cache, x[8:10], torch.arange(8, 10))  # a later block, dropped too
            cache.rollback(1 + kept)
        assert cache.lengths[0] == 1 + kept
        n = 1 + kept
        after = forward1(model, cache, x[n: n + 3], torch.arange(n, n + 3))
        torch.testing.assert_close(after.logits, chain_output(model, x[: n + 3]).logits[:, -3:], **TOL)


def test_rollback_to_the_prefix_and_errors(model):
    x = codes(model, 6, seed=6)
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, x, torch.arange(6))
    cache.rollback(0)
    assert cache.kv.lengths[0] == cache.prefix_len
    again = forward1(model, cache, x, torch.arange(6))
    torch.testing.assert_close(again.logits, chain_output(model, x).logits, **TOL)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(7)
    with pytest.raises(ValueError, match="keep"):
        cache.keep(9)


# -- greedy speculative decoding reproduces AR ---------------------------------------------------------------
def test_greedy_speculative_decoders_reproduce_greedy_ar():
    """Temperature 0: every exact decoder must emit AR's tokens (cache, keep, rollback, trees, row ends)."""
    greedy = tiny_lumina(temperature=0.0)

    def drafter() -> ModelDrafter:
        return ModelDrafter(greedy, layer_skip_copy(greedy, 1))

    decoders = [
        Decoder("sd", greedy, ExactRule(), draft_len=3, drafter=drafter()),
        Decoder("sd_tree", greedy, ExactRule(), draft_len=4, drafter=drafter(), tree="mc_sim_7b_63"),
        Decoder("sd_dynamic", greedy, ExactRule(), draft_len=3, drafter=drafter(), tree="dynamic",
                dynamic_tree={"top_k": 3, "depth": 3, "total_tokens": 8}),
        Decoder("sjd", greedy, ExactRule(), draft_len=5, drafter=JacobiDrafter(greedy)),
    ]
    for prompt in ("a red cat", "a blue sky"):
        ar = Decoder("ar", greedy, ExactRule()).generate(prompt, 0).tokens
        for decoder in decoders:
            assert torch.equal(decoder.generate(prompt, 1).tokens, ar), decoder.name


# -- EAGLE draft layer ---------------------------------------------------------------------------------------
def test_eagle_draft_layer_positions_and_cache(model):
    head = EagleHead(model, init_seed=2)
    assert head.layer.rope_positions(torch.arange(-1, 9)).tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11]
    drafter = EagleDrafter(model, head=head)
    _, out = model.prefill([PROMPT])
    drafter.begin([PROMPT], out, torch.tensor([3]), Streams([0], "cpu"))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 7, model.hidden_size, generator=g, dtype=torch.float64)
    tokens, positions = codes(model, 7, seed=7), torch.arange(-1, 6)
    cached = torch.cat([drafter.step(features[:, None, :3], tokens[None, :3], positions[None, :3]).features[:, 0],
                        drafter.step(features[:, None, 3:], tokens[None, 3:], positions[None, 3:]).features[:, 0]], 1)
    with torch.no_grad():
        teacher = head(features, tokens, positions)  # causal pass without a cache
    torch.testing.assert_close(cached, teacher, **TOL)
    state = {k: v for k, v in head.layer.state_dict().items()}
    state["self_attn.q_norm.weight"] = state["self_attn.q_norm.weight"][:1]  # LANTERN's per-shard layout
    state["self_attn.k_norm.bias"] = state["self_attn.k_norm.bias"][:1]
    converted = head.layer.from_eagle_keys(state)
    assert converted["self_attn.q_norm.weight"].shape == head.layer.self_attn.q_norm.weight.shape


def test_qk_norm_shard_rows_expand_like_lumina():
    """Lumina's ChameleonLayerNorm repeats shard row s for heads s*n..(s+1)*n-1 (repeat_interleave)."""
    from transformers.models.chameleon.modeling_chameleon import ChameleonLayerNorm

    g = torch.Generator().manual_seed(0)
    per_shard = {"x.self_attn.q_norm.weight": torch.randn(2, 8, generator=g),
                 "x.self_attn.q_norm.bias": torch.randn(2, 8, generator=g)}
    per_head = expand_qk_norm(per_shard, num_heads=4, num_kv_heads=4)
    norm = ChameleonLayerNorm((4, 8))
    weight, bias = per_shard["x.self_attn.q_norm.weight"], per_shard["x.self_attn.q_norm.bias"]
    norm.load_state_dict({"weight": per_head["x.self_attn.q_norm.weight"],
                          "bias": per_head["x.self_attn.q_norm.bias"]})
    x = torch.randn(3, 4, 8, generator=g)
    base = torch.nn.functional.layer_norm(x, (8,), eps=1e-5)
    shard_of_head = torch.tensor([0, 0, 1, 1])
    expected = base * weight[shard_of_head] + bias[shard_of_head]
    torch.testing.assert_close(norm(x), expected)


# -- the VQGAN decoder ---------------------------------------------------------------------------------------
TINY_VQ = {"n_embed": 64, "embed_dim": 8, "z_channels": 32, "ch": 32, "ch_mult": (1, 2, 2),
           "num_res_blocks": 1, "attn_resolutions": (4,), "resolution": 16}


def meta_decoder_shapes(n_embed, embed_dim, z_channels, ch, ch_mult, num_res_blocks, attn_resolutions,
                        resolution, out_ch=3) -> dict[str, tuple[int, ...]]:
    """The decoding half of Meta's vqgan.py state dict, enumerated from its layout (names and shapes)."""
    shapes = {"quantize.embedding.weight": (n_embed, embed_dim),
              "post_quant_conv.weight": (z_channels, embed_dim, 1, 1), "post_quant_conv.bias": (z_channels,)}

    def conv(name, cin, cout, k):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c,), (c,)

    def resblock(name, cin, cout):
        norm(f"{name}.norm1", cin), conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout), conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    block_in = ch * ch_mult[-1]
    res = resolution // 2 ** (len(ch_mult) - 1)
    conv("decoder.conv_in", z_channels, block_in, 3)
    resblock("decoder.mid.block_1", block_in, block_in)
    attn("decoder.mid.attn_1", block_in)
    resblock("decoder.mid.block_2", block_in, block_in)
    for level in reversed(range(len(ch_mult))):
        block_out = ch * ch_mult[level]
        for i in range(num_res_blocks + 1):
            resblock(f"decoder.up.{level}.block.{i}", block_in, block_out)
            block_in = block_out
            if res in attn_resolutions:
                attn(f"decoder.up.{level}.attn.{i}", block_in)
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", block_in, block_in, 3)
            res *= 2
    norm("decoder.norm_out", block_in)
    conv("decoder.conv_out", block_in, out_ch, 3)
    return shapes


def fake_lightning_class():
    """A class that pickles as pytorch_lightning's ModelCheckpoint (registered only while saving)."""
    names = ["pytorch_lightning", "pytorch_lightning.callbacks",
             "pytorch_lightning.callbacks.model_checkpoint"]
    mods = {n: types.ModuleType(n) for n in names}
    cls = type("ModelCheckpoint", (), {"__module__": names[-1]})
    mods[names[-1]].ModelCheckpoint = cls
    return mods, cls


def write_meta_checkpoint(path, state) -> None:
    mods, cls = fake_lightning_class()
    sys.modules.update(mods)
    try:
        torch.save({"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "1.0.8",
                    "state_dict": state,
                    "callbacks": {cls: {"best_model_score": torch.tensor(0.5), "best_model_path": "x.ckpt"}},
                    "optimizer_states": [], "lr_schedulers": []}, path)
    finally:
        for name in mods:
            sys.modules.pop(name)


def meta_yaml(path) -> None:
    dd = {"double_z": False, "z_channels": 32, "resolution": 16, "in_channels": 3, "out_ch": 3, "ch": 32,
          "ch_mult": [1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [4], "dropout": 0.0}
    config = {"model": {"target": "taming.models.vqgan.VQModel", "params": {
        "embed_dim": 8, "n_embed": 64, "ddconfig": dd,
        "lossconfig": {"target": "taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator",
                       "params": {"disc_start": 0}}}}}
    path.write_text(yaml.safe_dump(config))


def test_meta_vqgan_checkpoint_loads_strictly_by_key_name(tmp_path):
    shapes = meta_decoder_shapes(**TINY_VQ)
    model = ChameleonVQGAN(ChameleonVQGANConfig(**TINY_VQ))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    extras = {"encoder.conv_in.weight": torch.zeros(32, 3, 3, 3),
              "quant_conv.weight": torch.zeros(8, 32, 1, 1),
              "loss.discriminator.main.0.weight": torch.zeros(4, 3, 4, 4), "loss.logvar": torch.zeros(())}
    write_meta_checkpoint(tmp_path / "vqgan.ckpt", {**state, **extras})
    meta_yaml(tmp_path / "vqgan.yaml")
    with pytest.raises(Exception, match="ModelCheckpoint"):  # plain weights_only refuses the Lightning class
        torch.load(tmp_path / "vqgan.ckpt", weights_only=True)
    vqgan = load_vqgan(tmp_path / "vqgan.yaml", tmp_path / "vqgan.ckpt")
    assert vqgan.config == ChameleonVQGANConfig(**TINY_VQ)
    for key, value in state.items():
        assert torch.equal(vqgan.state_dict()[key], value)
    short = {k: v for k, v in state.items() if k != "decoder.up.1.block.0.conv1.bias"}
    extra = {**state, "decoder.extra.weight": torch.zeros(1)}
    stray = {**state, "mystery.weight": torch.zeros(1)}
    for broken, message in ((short, "missing"), (extra, "unexpected"), (stray, "no part")):
        write_meta_checkpoint(tmp_path / "broken.ckpt", broken)
        with pytest.raises(ValueError, match=message):
            load_vqgan(tmp_path / "vqgan.yaml", tmp_path / "broken.ckpt")
    assert set(read_vqgan_state(tmp_path / "vqgan.ckpt")) == set(state) | set(extras)


def test_other_pickled_objects_are_refused_with_a_conversion_hint(tmp_path):
    module = types.ModuleType("trainer_state")
    module.Hyper = type("Hyper", (), {"__module__": "trainer_state"})
    sys.modules["trainer_state"] = module
    try:
        torch.save({"state_dict": {}, "hyper_parameters": module.Hyper()}, tmp_path / "vqgan.ckpt")
    finally:
        sys.modules.pop("trainer_state")
    with pytest.raises(ValueError, match="cannot be read safely.*trainer_state.*safetensors"):
        read_vqgan_state(tmp_path / "vqgan.ckpt")


def test_decoding_returns_images_of_the_grid_size(model):
    image = model.decode_image(codes(model, model.num_image_tokens))
    assert image.shape == (3, 12, 8) and image.dtype == torch.uint8  # 6 x 4 codes, 2 px per code (tiny VQGAN)
    vqgan = ChameleonVQGAN(ChameleonVQGANConfig(**TINY_VQ))
    z = vqgan.quantize.lookup(torch.arange(6)[None], (2, 3))  # raster order: code i at (i // 3, i % 3)
    torch.testing.assert_close(z[0, :, 1, 2], vqgan.codebook()[5])
    assert vqgan.decode_codes(torch.arange(6)[None], (2, 3)).shape == (1, 3, 8, 12)
    assert ChameleonVQGANConfig().downsample_factor == 16  # Meta's tokenizer: 48 x 48 codes -> 768 px


# -- weights and files ---------------------------------------------------------------------------------------
def test_missing_tokenizer_files_are_each_named(tmp_path):
    (tmp_path / "vqgan.yaml").write_text("model: {}\n")
    with pytest.raises(MissingWeightsError) as err:
        LuminaMGPT(sampling={"cfg_scale": 3.0}, tokenizer_dir=str(tmp_path), device="cpu")
    message = str(err.value)
    listed = message.split("(looked in")[0]
    assert "text_tokenizer.json" in listed and "vqgan.ckpt" in listed and "vqgan.yaml" not in listed
    assert "model.tokenizer_dir" in message and "chameleon-downloads" in message
    with pytest.raises(ValueError, match="multiple of 32"):
        LuminaMGPT(sampling={}, width=100, pretrained=False)


def write_fake_lumina_repo(repo, source: LuminaMGPT) -> dict:
    """Lumina's hub layout: a 4.43-style config.json, two safetensors shards + index, qk-norm per shard."""
    from safetensors.torch import save_file

    config = source.lm.config.to_dict()
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, rope_scaling=None, mask_image_logits=False, z_loss_weight=1e-5,
                  architectures=["ChameleonXLLMXForConditionalGeneration"])
    (repo / "config.json").write_text(json.dumps(config))
    state = {k: v.clone() for k, v in source.lm.state_dict().items()}
    for key in [k for k in state if ".self_attn." in k and "_norm." in k]:
        state[key] = state[key][:1].clone()  # model_parallel_size 1: one row shared by every head
    state["model.vqmodel.quantize.embedding.weight"] = torch.zeros(8, 4)  # the VQ encoder's, skipped
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: state[k].contiguous() for k in part}, str(repo / name))
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def test_pretrained_path_reads_the_lumina_layout_offline(tmp_path, monkeypatch):
    """Hub files (config, shards) and Meta's tokenizer folder, all fake and local: loads, runs, decodes."""
    import coolsd.models.lumina_mgpt as lumina

    source = tiny_lumina()
    repo, meta = tmp_path / "hub", tmp_path / "tokenizer"
    repo.mkdir(), meta.mkdir()
    state = write_fake_lumina_repo(repo, source)

    def fake_hub_file(repo_id, filename, local_dir=None, revision=None):
        if not (repo / filename).is_file():
            raise MissingWeightsError(f"{filename} missing")
        return str(repo / filename)

    monkeypatch.setattr(lumina, "hub_file", fake_hub_file)
    source.tokenizer.backend_tokenizer.save(str(meta / "text_tokenizer.json"))
    meta_yaml(meta / "vqgan.yaml")
    vq_state = {k: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.1
                for k, s in meta_decoder_shapes(**TINY_VQ).items()}
    write_meta_checkpoint(meta / "vqgan.ckpt", vq_state)
    loaded = LuminaMGPT(sampling={"cfg_scale": 3.0, "top_k": 0}, width=64, height=96,
                        hub_repo="fake/lumina", tokenizer_dir=str(meta), device="cpu", dtype="float64")
    for key, value in loaded.lm.state_dict().items():
        expected = state[key].expand_as(value) if "_norm." in key and "self_attn" in key else state[key]
        assert torch.equal(value, expected.to(value.dtype)), key
    assert torch.equal(loaded.codebook(), vq_state["quantize.embedding.weight"])
    assert loaded.prompt_ids(PROMPT) == source.prompt_ids(PROMPT)
    x = codes(loaded, 6)
    out = forward1(loaded, prefill1(loaded, PROMPT)[0], x, torch.arange(6))
    assert torch.isfinite(out.logits).all()
    assert loaded.decode_image(codes(loaded, loaded.num_image_tokens)).shape == (3, 24, 16)  # 4 px per code
    other = tiny_vocabulary(64, loaded.size_units, seed=9)  # the same names, other ids
    lumina.word_level_tokenizer(other).backend_tokenizer.save(str(meta / "text_tokenizer.json"))
    with pytest.raises(ValueError, match="does not belong to this model"):
        LuminaMGPT(sampling={"cfg_scale": 3.0}, width=64, height=96, hub_repo="fake/lumina",
                   tokenizer_dir=str(meta), device="cpu", dtype="float64")


def test_random_weights_take_the_real_vocabulary_size():
    """``random_init.vocab_size`` (the bench preset's 65,536 embeddings and head rows) pads the made-up vocabulary;
    a size below it is refused. Decoding only ever reads image-code rows, so the padding changes no token's id."""
    big = LuminaMGPT(sampling={}, width=64, height=96, pretrained=False, random_init={**SIZES, "vocab_size": 4000},
                     device="cpu", dtype="float32")
    assert big.lm.lm_head.weight.shape[0] == big.lm.model.embed_tokens.weight.shape[0] == 4000
    assert big.codebook_size == SIZES["num_codes"] and int(big.code_to_bpe.max()) < 4000
    tokens = big.teacher_force(["a cat"], torch.zeros(1, 4, dtype=torch.long))
    assert torch.isfinite(tokens).all()
    with pytest.raises(ValueError, match="random_init.vocab_size=10 is smaller than the vocabulary"):
        LuminaMGPT(sampling={}, width=64, height=96, pretrained=False, random_init={**SIZES, "vocab_size": 10},
                   device="cpu", dtype="float32")
