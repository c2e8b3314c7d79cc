"""Anole adapter (``coolsd.models.anole``) on a tiny random Chameleon + tiny VQGAN (no download): Anole's prompt and
both CFG streams (LANTERN's and PathSpec's unconditional context) against transformers' own Chameleon forward, a plain
grid without end-of-row tokens, cached and tree forwards, the EAGLE draft layer's positions, greedy speculative
decoding = AR, every suite decoder batched = alone and static = eager on ``model=anole_tiny``, and the published
layout (``leloy/Anole-7b-v0.1-hf`` + ``GAIR/Anole-7b-v0.1``'s tokenizer folder) read offline from fake hub files.
What every adapter promises (shapes, missing weights, the published size on the meta device, AR and EAGLE batched =
alone, the static path's AR / chain / tree, every decoder through ``run.py``) is ``tests/test_adapters.py``'s
(``anole_tiny`` is in its ``ADAPTERS``).

Parity is exact (float64, tolerance 1e-9). About 30 s on 2 CPU cores; the rest of the static decoders in ``-m slow``.
"""
from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.anole import Anole
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.lumina_mgpt import layer_skip_copy
from coolsd.trees import ancestor_mask
from tests.helpers import CONFIGS, default_run_decoders, forward1, prefill1
from tests.test_lumina import (
    TINY_VQ,
    codes,
    hf_logits,
    meta_decoder_shapes,
    meta_yaml,
    path_of,
    tree_setup,
    write_meta_checkpoint,
)
from tests.test_lumina import reference as reference  # noqa: PLC0414  (the fixture, over this module's model)
from tests.test_static_lumina_emu3 import DECODERS, build
from tests.test_static_path import assert_static_reads, eager_and_static_pairs

TOL = {"rtol": 1e-9, "atol": 1e-9}
PROMPT = "a red cat"
SIZES = {"num_hidden_layers": 2, "num_key_value_heads": 2, "num_codes": 64}
PATHSPEC = {"prompt_template": "Generate an image of {prompt}", "uncond_context": "end_of_turn"}
#: prompts of different lengths (5, 10 and 7 prefix tokens on anole_tiny)
PROMPTS = ["a red cat", "a photo of the blue sky on a table", "a blue dog on a tree"]


def tiny_anole(**options) -> Anole:
    """64 x 96 px -> a plain 6 x 4 grid (no end-of-row tokens), GQA, CFG 3, float64."""
    sampling = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, **options.pop("sampling", {})}
    return Anole(sampling=sampling, width=64, height=96, pretrained=False, random_init=SIZES, device="cpu",
                 dtype="float64", **options)


@pytest.fixture(scope="module")
def model() -> Anole:
    return tiny_anole()


def chain_output(model, tokens: torch.Tensor):
    """Fresh prefill, then one causal block over ``tokens`` at positions 0..T-1."""
    cache, _ = prefill1(model, PROMPT)
    return forward1(model, cache, tokens, torch.arange(len(tokens)))


# -- prompt, unconditional stream, parity with transformers' Chameleon ----------------------------------------------
def test_prompt_and_unconditional_stream_follow_lantern_and_pathspec(model):
    names = model.tokenizer.convert_ids_to_tokens
    assert names(model.prompt_ids(PROMPT)) == ["<s>", "a", "red", "cat", "<reserved08706>", "<racm3:break>"]
    assert names(model.unconditional_ids()) == ["<s>", "<racm3:break>"]  # LANTERN's uncond_tokens (and GAIR's)
    assert model.grid == (6, 4) and model.num_image_tokens == 24  # 16 px per code, no size tokens
    pathspec = tiny_anole(**PATHSPEC)
    assert names(pathspec.prompt_ids(PROMPT)) == ["<s>", "Generate", "an", "image", "of", "a", "red", "cat",
                                                  "<reserved08706>", "<racm3:break>"]
    assert names(pathspec.unconditional_ids()) == ["<reserved08706>", "<racm3:break>"]
    with pytest.raises(ValueError, match="model.uncond_context must be one of"):
        tiny_anole(uncond_context="pad")
    with pytest.raises(ValueError, match="model.prompt_template must contain"):
        tiny_anole(prompt_template="Generate an image")


@pytest.mark.parametrize("options", [{}, PATHSPEC], ids=["lantern", "pathspec"])
def test_both_cfg_streams_match_transformers_on_the_explicit_sequences(options, reference):
    """Prefill + one block over every code = transformers' forward over Anole's sequences, positions from 0 in each
    stream: the conditional prompt then the codes' BPE ids, and the unconditional context then the same ids; no
    structural token anywhere in the image. The guided distribution is ``softmax(u + 3 (c - u))`` over image codes."""
    anole = tiny_anole(**options)
    assert torch.equal(anole.lm.lm_head.weight, reference.lm_head.weight)  # the same seeded weights as the fixture's
    x = codes(anole, anole.num_image_tokens)
    cond_prefix, uncond_prefix = anole.prompt_ids(PROMPT), anole.unconditional_ids()
    image = anole.code_to_bpe[x].tolist()
    cond = hf_logits(reference, cond_prefix + image)[:, anole.code_to_bpe]  # (T, V) image-code logits
    uncond = hf_logits(reference, uncond_prefix + image)[:, anole.code_to_bpe]
    cache, first = prefill1(anole, PROMPT)
    out = forward1(anole, cache, x, torch.arange(len(x)))
    c, u = len(cond_prefix), len(uncond_prefix)
    torch.testing.assert_close(first.logits[0, 0], cond[c - 1], **TOL)
    torch.testing.assert_close(first.logits[1, 0], uncond[u - 1], **TOL)
    torch.testing.assert_close(out.logits[0], cond[c: c + len(x)], **TOL)
    torch.testing.assert_close(out.logits[1], uncond[u: u + len(x)], **TOL)
    expected = torch.softmax(uncond[u: u + len(x)] * -2.0 + 3.0 * cond[c: c + len(x)], -1)
    torch.testing.assert_close(anole.probs(out), expected.float(), rtol=1e-5, atol=1e-7)
    assert cache.lengths == [c + len(x)]  # one slot per image token after the prompt


# -- cache, trees, draft layer ---------------------------------------------------------------------------------------
def test_cached_incremental_decoding_equals_one_full_forward(model):
    x = codes(model, model.num_image_tokens, seed=1)
    full = chain_output(model, x)
    cache, _ = prefill1(model, PROMPT)
    logits, t = [], 0
    for size in (1, 3, 5, 2, 7, 6):
        logits.append(forward1(model, cache, x[t: t + size], torch.arange(t, t + size)).logits)
        t += size
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, **TOL)


def test_tree_attention_matches_per_path_forwards_and_compaction(model):
    parents, nodes, depths = tree_setup(model)
    prefix, root = codes(model, 3, seed=4), torch.tensor([7])
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, prefix, torch.arange(3))
    cache.keep(3)
    positions = torch.tensor([3] + [3 + d for d in depths])
    tree = forward1(model, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in range(len(parents)):
        seq = torch.cat([prefix, root, nodes[path_of(parents, j)]])
        torch.testing.assert_close(tree.logits[:, j + 1], chain_output(model, seq).logits[:, -1], **TOL)
    deepest = max(range(len(parents)), key=lambda j: depths[j])
    path = [0] + [1 + j for j in path_of(parents, deepest)]
    cache.keep([len(path)], torch.tensor([path]))  # KV compaction of the accepted path, then one more token
    seq = torch.cat([prefix, root, nodes[path_of(parents, deepest)]])
    after = forward1(model, cache, torch.tensor([5]), torch.tensor([3 + len(path)]))
    expected = chain_output(model, torch.cat([seq, torch.tensor([5])])).logits[:, -1]
    torch.testing.assert_close(after.logits[:, 0], expected, **TOL)


def test_eagle_draft_layer_rotates_plain_positions(model):
    """No end-of-row gaps (Lumina-mGPT's draft layer skips one position per row): pair t at position t + 1."""
    assert EagleHead(model, init_seed=2).layer.rope_positions(torch.arange(-1, 9)).tolist() == list(range(10))


def test_greedy_speculative_decoders_reproduce_greedy_ar():
    greedy = tiny_anole(sampling={"temperature": 0.0})

    def drafter() -> ModelDrafter:
        return ModelDrafter(greedy, layer_skip_copy(greedy, 1))

    decoders = [Decoder("sd", greedy, ExactRule(), draft_len=3, drafter=drafter()),
                Decoder("sd_tree", greedy, ExactRule(), draft_len=4, drafter=drafter(), tree="mc_sim_7b_63"),
                Decoder("sd_dynamic", greedy, ExactRule(), draft_len=3, drafter=drafter(), tree="dynamic",
                        dynamic_tree={"top_k": 3, "depth": 3, "total_tokens": 8}),
                Decoder("sjd", greedy, ExactRule(), draft_len=5, drafter=JacobiDrafter(greedy))]
    ar = Decoder("ar", greedy, ExactRule()).generate(PROMPT, 0).tokens
    for decoder in decoders:
        assert torch.equal(decoder.generate(PROMPT, 1).tokens, ar), decoder.name


# -- every decoder of the suite on model=anole_tiny -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """``model=anole_tiny`` in float32 and its suite's configs, composed as ``run.py`` composes them."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=anole_tiny", "model.device=cpu"])
    return instantiate(cfg.model), cfg


def suite_decoder(cfg, model, name: str, path: str) -> Decoder:
    """``build`` (``tests/test_static_lumina_emu3.py``), with VVS on a random EAGLE head too (it feeds the drafter
    stale target features, which the tiny model's layer-skip drafter cannot read)."""
    if name != "vvs":
        return build(cfg, model, name, path)
    node = {**OmegaConf.to_container(cfg.suite[name], resolve=True), "path": path}
    node.pop("drafter")
    return instantiate(node, model=model, drafter=EagleDrafter(model, head=EagleHead(model, init_seed=1)))


def suite_names() -> list[str]:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return sorted(compose(config_name="config").suite)


@pytest.mark.filterwarnings("ignore:decoder.k=1000 exceeds")  # LANTERN's k capped to the tiny codebook
@pytest.mark.parametrize("name", suite_names())
def test_every_suite_decoder_gives_an_image_the_same_alone_and_in_a_batch(tiny, name):
    """Every decoder a run can compare (``configs/config.yaml``'s suite, as configured, on the model's own drafter;
    SD, COOL-SD and LANTERN on a random EAGLE head), a batch of 3 prompts of different lengths: each image equals
    the same prompt and seed alone, tokens and accepted-length histogram."""
    model, cfg = tiny
    decoder = suite_decoder(cfg, model, name, "eager")
    seeds = [3, 4, 5]
    batch = decoder.generate_batch(PROMPTS, seeds)
    for prompt, seed, image in zip(PROMPTS, seeds, batch):
        alone = decoder.generate(prompt, seed)
        assert image.tokens.shape == (model.num_image_tokens,)
        assert torch.equal(alone.tokens, image.tokens), (name, prompt)
        assert alone.stats.accepted_hist == image.stats.accepted_hist, (name, prompt)


def test_the_default_run_compares_the_suite_decoders_tested_here():
    assert default_run_decoders() <= set(suite_names())


# -- the static path --------------------------------------------------------------------------------------------------
QUICK_STATIC = ("ar", "sd", "sd_static_tree", "sjd")


@pytest.mark.filterwarnings("ignore:decoder.k=1000 exceeds")
@pytest.mark.parametrize("name", [n if n in QUICK_STATIC else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DECODERS])
def test_static_gives_the_eager_tokens_and_statistics(tiny, name):
    """The Lumina-mGPT static machinery with one slot per image token (``DeviceKVCache``, prompts padded to
    ``model.prompt_capacity``): every decoder's tokens and statistics equal the eager path's, in a batch of 3 prompts
    of different lengths and alone."""
    model, cfg = tiny
    pairs = eager_and_static_pairs(build(cfg, model, name, "eager"), build(cfg, model, name, "static"), PROMPTS, 1,
                                   1e-5)
    for _, b in pairs:
        assert sum((c + 1) * k for c, k in enumerate(b.stats.accepted_hist)) == model.num_image_tokens - 1


@pytest.mark.parametrize("name", ["ar", "sd"])
def test_sync_guard_static_steps_read_nothing_and_iterations_read_once(tiny, monkeypatch, name):
    model, cfg = tiny
    static = build(cfg, model, name, "static")
    assert_static_reads(monkeypatch, static, ((PROMPTS[1:2], [0]), (PROMPTS, [1, 2, 3])),
                        model.num_image_tokens - 1 if name == "ar" else None)


def test_the_static_prefill_pads_to_the_prompt_capacity_and_refuses_a_longer_prompt(tiny):
    model, _ = tiny
    eager, first = model.prefill(PROMPTS, extra_slots=8)
    static, out = model.static_prefill(PROMPTS, extra_slots=8)
    assert static.prefix_len == model.prompt_capacity and eager.prefix_len == len(model.prompt_ids(PROMPTS[1]))
    torch.testing.assert_close(out.logits, first.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="model.prompt_capacity=64"):
        model.static_prefill([" ".join(["cat"] * 70)], extra_slots=8)


# -- the published layout, offline --------------------------------------------------------------------------------
def write_fake_anole_hub(folder, source: Anole) -> dict:
    """leloy/Anole-7b-v0.1-hf's layout (config.json with its vocabulary_map, one safetensors shard + index, qk-norm
    per head, the VQ encoder under ``model.vqmodel.``) and GAIR/Anole-7b-v0.1's ``tokenizer/`` folder, as files."""
    from safetensors.torch import save_file

    lm, tok = folder / "leloy", folder / "gair" / "tokenizer"
    lm.mkdir(), tok.mkdir(parents=True)
    config = source.lm.config.to_dict()
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, rope_scaling=None, architectures=["ChameleonForConditionalGeneration"])
    (lm / "config.json").write_text(json.dumps(config))
    state = {k: v.clone().contiguous() for k, v in source.lm.state_dict().items()}
    save_file({**state, "model.vqmodel.quantize.embedding.weight": torch.zeros(8, 4)},
              str(lm / "model-00001-of-00001.safetensors"))
    shard = "model-00001-of-00001.safetensors"
    index = {"weight_map": {k: shard for k in [*state, "model.vqmodel.quantize.embedding.weight"]}}
    (lm / "model.safetensors.index.json").write_text(json.dumps(index))
    source.tokenizer.backend_tokenizer.save(str(tok / "text_tokenizer.json"))
    meta_yaml(tok / "vqgan.yaml")
    write_meta_checkpoint(tok / "vqgan.ckpt", {k: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.1
                                               for k, s in meta_decoder_shapes(**TINY_VQ).items()})
    return state


def test_the_published_files_load_offline_from_both_hub_repos(tmp_path, monkeypatch):
    import coolsd.models.lumina_mgpt as lumina
    from coolsd.models import anole

    source = tiny_anole()
    assert source.codebook_size == TINY_VQ["n_embed"]
    state = write_fake_anole_hub(tmp_path, source)
    repos = {"leloy/Anole-7b-v0.1-hf": tmp_path / "leloy", "GAIR/Anole-7b-v0.1": tmp_path / "gair"}
    asked = []

    def fake_hub_file(repo_id, filename, local_dir=None, revision=None):
        asked.append((repo_id, filename))
        path = repos[repo_id] / filename
        if not path.is_file():
            raise MissingWeightsError(f"{filename} from {repo_id} is not available (looked in {path.parent})")
        return str(path)

    monkeypatch.setattr(anole, "hub_file", fake_hub_file)
    monkeypatch.setattr(lumina, "hub_file", fake_hub_file)
    loaded = Anole(sampling={"cfg_scale": 3.0, "top_k": 0}, width=64, height=96, device="cpu", dtype="float64")
    assert ("GAIR/Anole-7b-v0.1", "tokenizer/vqgan.ckpt") in asked
    assert ("leloy/Anole-7b-v0.1-hf", "config.json") in asked
    assert all(torch.equal(v, state[k]) for k, v in loaded.lm.state_dict().items())
    assert loaded.prompt_ids(PROMPT) == source.prompt_ids(PROMPT)
    x = codes(loaded, loaded.num_image_tokens)
    torch.testing.assert_close(forward1(loaded, prefill1(loaded, PROMPT)[0], x, torch.arange(len(x))).logits,
                               chain_output(source, x).logits, **TOL)
    assert loaded.decode_image(x).shape == (3, 24, 16)  # the tiny VQGAN: 4 px per code
    (tmp_path / "gair" / "tokenizer" / "vqgan.yaml").unlink()
    with pytest.raises(MissingWeightsError, match="tokenizer/vqgan.yaml from GAIR/Anole-7b-v0.1"):
        Anole(sampling={"cfg_scale": 3.0}, width=64, height=96, device="cpu", dtype="float64")
