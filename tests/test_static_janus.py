"""Janus-Pro on the static decode path (``decoder.path=static``, ``coolsd.static``): the tiny random Janus
(``configs/model/janus_tiny.yaml``, float32) gives the eager path's tokens and statistics, its steps read
nothing from the host (AR) or once per iteration, they compile whole without recompiling, a refilled queue
gives its lock-step images, and the fixed prompt width (``model.prompt_capacity``) and the per-image prompt
lengths on the device (``DeviceKVCache.prefix_lens``) behave as documented.

Janus's prompts have their own lengths (left-padded, masked): the batches below mix prompts of different
lengths, so every image's positions come from its own prompt length on the device. The EAGLE decoders (SD,
COOL-SD, LANTERN, LANTERN++) draft with a randomly initialised EAGLE head (``janus_tiny``'s own drafter is the
layer-skip ``ModelDrafter``, whose static form ``tests/test_static_model_drafter.py`` checks). About 25 s on one core (building the model ~3 s); the compiled steps take about
20 s each (``-m slow``).
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.kv_cache import DeviceKVCache
from tests.helpers import CONFIGS
from tests.test_refill import assert_refill_equals_lock_step
from tests.test_static_path import assert_static_reads, eager_and_static_pairs

#: prompts of different lengths (57, 33 and 80 tokens with the tiny character tokenizer)
PROMPTS = ["a red apple on a wooden table", "a cat", "a vintage car parked on a street by the sea at night"]
#: the decoders of the default run and the Jacobi family's window and window tree, as configured for
#: janus_tiny (LANTERN: its EAGLE-2 tree, as published); the EAGLE ones with a random head
EAGLE = ("sd", "coolsd", "lantern", "lantern_pp")
DECODERS = ("ar", "sd", "sd_static_tree", "coolsd", "lantern", "lantern_pp", "sjd", "sjd_pac")
#: the relative tolerance of a relaxed rule's summed TV: Janus attends with PyTorch's SDPA
#: (``model.attention_kernel=auto``), which is not padding-invariant on a CPU, and a static step attends over
#: the cache's whole capacity where the eager one attends up to the batch's longest row, so the logits differ
#: in float32's last bits (measured on a 2-core AMD EPYC: up to 6e-6 absolute) and the TV by up to 6e-6
#: relative; the tokens and every count are the same
TV_REL = 1e-5


@pytest.fixture(scope="module")
def janus():
    """The tiny random Janus in float32 and its suite's configs, composed as ``run.py`` composes them."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=janus_tiny", "model.device=cpu"])
    model = instantiate(cfg.model)
    assert model.sampling.guided and model.lm.embed_tokens.weight.dtype == torch.float32
    return model, cfg


def build(cfg, model, name: str, path: str, **overrides) -> Decoder:
    """A suite decoder on ``path``; an EAGLE decoder's drafter is a random EAGLE head (module doc);
    ``sd_static_tree``: SD on EAGLE-1's static tree."""
    base = "sd" if name == "sd_static_tree" else name
    node = OmegaConf.to_container(cfg.suite[base], resolve=True)
    node.update(overrides, path=path)
    if name == "sd_static_tree":
        node["tree"] = "mc_sim_7b_63"
    if base in EAGLE:
        node.pop("drafter")
        return instantiate(node, model=model, drafter=EagleDrafter(model, head=EagleHead(model, init_seed=1)))
    return instantiate(node, model=model)


@pytest.mark.parametrize("name", DECODERS)
def test_static_janus_gives_the_eager_tokens_and_statistics(janus, name):
    """Every decoder gives the eager decoder's tokens and statistics (iterations, accepted-length histogram,
    forwards; the TV to ``TV_REL``) on the static path, in a batch of 3 prompts of different lengths whose
    images finish at different iterations and alone; as ``tests/test_static_path.py`` on the embedded model:
    where the machine's linears are not batch-invariant (``invariance_property``), at most one image of four
    may differ."""
    model, cfg = janus
    eager, static = build(cfg, model, name, "eager"), build(cfg, model, name, "static")
    pairs = eager_and_static_pairs(eager, static, PROMPTS, 2, TV_REL)
    if name != "ar":
        assert len({b.stats.iterations for _, b in pairs[:3]}) > 1  # they finish at different iterations


@pytest.mark.parametrize("name", ["ar", "sd", "sd_static_tree", "sjd"])
def test_sync_guard_static_janus_steps_read_nothing_and_iterations_read_once(janus, monkeypatch, name):
    """0 host reads in all of AR's steps; at most 1 per iteration of a chain, a tree or a Jacobi window
    (whether every image has finished), at 1 and 3 images, after the first batch of a size has built its
    constants."""
    model, cfg = janus
    static = build(cfg, model, name, "static")
    assert_static_reads(monkeypatch, static, ((PROMPTS[1:2], [0]), (PROMPTS, [1, 2, 3])),
                        model.num_image_tokens - 1 if name == "ar" else None, reverse=True)


def test_refilled_janus_images_equal_their_lock_step_images(janus):
    """5 prompts of different lengths through 2 rows, each row refilled (its prompt length too) as its image
    finishes: every image has its lock-step tokens and statistics."""
    model, cfg = janus
    decoder = build(cfg, model, "sd", "static", refill=True)
    prompts, seeds = [*PROMPTS, "a tree", "two dogs on a beach"], [20, 21, 22, 23, 24]
    assert_refill_equals_lock_step(decoder, prompts, seeds, 2)


# -- the fixed prompt width and the prompt lengths on the device ---------------------------------------------
@torch.inference_mode()
def test_the_static_prefill_pads_to_the_prompt_capacity_and_refuses_a_longer_prompt(janus):
    """``static_prefill`` pads every batch to ``model.prompt_capacity`` (one cache capacity whatever the
    prompts) with the prefill's outputs unchanged; a longer prompt is refused naming the key, and the eager
    path takes it."""
    model, _ = janus
    eager, first = model.prefill(PROMPTS, extra_slots=8)
    static, out = model.static_prefill(PROMPTS, extra_slots=8)
    short, _ = model.static_prefill(PROMPTS[1:2], extra_slots=8)
    capacity = model.prompt_capacity + model.num_image_tokens + 8
    assert static.max_len == short.max_len == capacity > eager.max_len
    assert torch.equal(static.prefix_lens, eager.prefix_lens)
    torch.testing.assert_close(out.logits, first.logits, rtol=1e-5, atol=1e-6)
    long = "a very long prompt " * 6
    wanted = r"than model.prompt_capacity=128.*set model.prompt_capacity=1[3-9]\d"
    with pytest.raises(ValueError, match=wanted):
        model.static_prefill([PROMPTS[0], long], extra_slots=8)
    assert model.prefill([long], extra_slots=8)[0].prefix_lens[0] > model.prompt_capacity


@torch.inference_mode()
def test_device_cache_carries_each_images_prompt_length(janus, tiny_model):
    """``DeviceKVCache`` keeps a Janus cache's prompt lengths on the device: built by ``of``, refilled by
    ``load`` and row by row by ``load_rows``; a LlamaGen cache has none (its one ``prefix_len``), and copying
    between the two kinds is refused."""
    model, _ = janus
    cache, _ = model.static_prefill(PROMPTS, extra_slots=8)
    device = DeviceKVCache.of(cache)
    assert torch.equal(device.prefix_lens, cache.prefix_lens)
    other, _ = model.static_prefill(PROMPTS[::-1], extra_slots=8)
    buffer = device.prefix_lens
    device.load(other)
    assert device.prefix_lens is buffer and torch.equal(device.prefix_lens, other.prefix_lens)
    rows, _ = model.static_prefill(["a tree", PROMPTS[2]], extra_slots=8)
    device.load_rows(torch.tensor([2, 0]), rows)
    assert device.prefix_lens.tolist() == [int(rows.prefix_lens[1]), int(other.prefix_lens[1]),
                                           int(rows.prefix_lens[0])]
    assert DeviceKVCache.like(cache).prefix_lens.tolist() == [0, 0, 0]
    llamagen = DeviceKVCache.of(tiny_model.prefill(["one"], extra_slots=8)[0])
    assert llamagen.prefix_lens is None
    with pytest.raises(ValueError, match="prefix"):
        device.load(tiny_model.prefill(["one", "two", "three"], extra_slots=8)[0])


def test_the_prompt_capacity_is_fingerprinted_on_the_static_path_only():
    """Eager images do not depend on ``model.prompt_capacity`` (its records keep matching when it changes);
    a static decoder's fingerprint holds it (its padding may change last bits); normalising is idempotent."""
    from eval.records.fingerprints import normalised

    model = {"prompt_capacity": 128, "cfg_scale": 5.0}
    eager = normalised({"model": model, "decoder": {"name": "sd", "path": "eager"}})
    static = normalised({"model": model, "decoder": {"name": "sd", "path": "static"}})
    assert eager["model"] == {"cfg_scale": 5.0} and static["model"] == model
    assert normalised(eager) == eager and normalised(static) == static


# -- compiled whole on a CPU ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ar", "chain"])
def test_static_janus_steps_compile_whole_without_recompiling(kind):
    """The AR step and an EAGLE chain's step compile with ``fullgraph=True, dynamic=False`` (a graph break
    raises) and are not recompiled across the positions of an image, the accept outcomes of its iterations, or
    for a second batch of the same size with other prompt lengths (dynamo's ``error_on_recompile``); every
    image is complete."""
    import torch._dynamo

    torch._dynamo.reset()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=janus_tiny", "model.device=cpu"])
    model = instantiate(cfg.model)
    model.compile = True  # the static step compiled whole on a CPU (Janus's eager layers are not compiled)
    drafter = None if kind == "ar" else EagleDrafter(model, head=EagleHead(model, init_seed=1))
    decoder = Decoder(kind, model, ExactRule(), draft_len=0 if drafter is None else 3, path="static",
                      drafter=drafter)
    assert decoder.static.mode == "compiled" and decoder.static.step_name == kind
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts, seeds in ((PROMPTS[:2], [0, 1]), (PROMPTS[1:], [2, 3])):
            images = decoder.generate_batch(prompts, seeds)
            assert all(int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size for g in images)
            assert all(sum(g.stats.accepted_hist) == g.stats.iterations for g in images)
    assert decoder.static._workspaces[2][1].calls > 2
