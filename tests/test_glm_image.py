"""GLM-Image adapter on a tiny random ``GlmImageConfig`` (no download): exact agreement with ``transformers``' own
GLM-Image generation (its multi-axis positions for the preview grid and then the full grid, its raw logits at
every step, its seeded tokens under the reference's temperature and top-p with the visual-token constraint), the
reference's prompt and grid sizes, cached == uncached, trees and KV compaction across the preview / full grid
boundary, the pixel path through a tiny random diffusers pipeline (where diffusers is installed) and its refusal
where it is not, and the lossless decoders' exactness. What every adapter promises (batched = alone, shapes,
missing weights, the published size on the meta device, every decoder through ``run.py``) is checked in
``tests/test_adapters.py``.

Comparisons are identities on float64 models (tolerances of rounding error only); generate hands its processors
float32 copies of the logits, which the adapter's float64 logits equal after the same cast.

Statistical tests (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the probability that a
correct implementation fails for a random choice of seeds, per test and per prompt):

* ``test_lossless_decoders_are_exact_on_an_enumerable_glm_image``: ``glm_image_tiny`` (float32) shrunk to 4 codes
  and a 1 x 2 full grid after a 1 x 2 preview (``enumerable_glm_image``: one sequence of 2 x 2 codes, 256 grids per
  prompt), the exact sequence distribution by teacher forcing the adapter (``exact_grid_probs``, through the
  reference's temperature 0.9 and top-p 0.75); ``N_QUICK`` images per lossless decoder (``N_FULL`` under ``-m
  slow``), seeds 0..n-1, in batches of 100 mixing two prompts of different lengths; Pearson chi-square per
  prompt on the top-p support's cells (cells of expected count < 5 pooled); ``tests/test_emu3.py``'s
  ``exact_grid_probs``, ``lossless_decoders`` and ``grid_pvalues``, shared.
* ``test_the_exactness_test_rejects_a_broken_residual_on_glm_image``: the same test must reject SD that resamples
  from p after a rejection, on at least one prompt (p-values 6e-83 and 0.5: top-p leaves the shorter prompt 17
  cells, where the broken residual differs too little at ``N_QUICK``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models import glm_image as G
from coolsd.models.glm_image import GlmImage, layer_skip_copy
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from coolsd.types import TargetOutput
from tests.helpers import CONFIGS, forward1, keep1, prefill1
from tests.test_emu3 import EXACT_PROMPTS, exact_grid_probs, grid_pvalues, lossless_decoders
from tests.test_lossless import ResampleFromTarget

EXACT = {"rtol": 1e-9, "atol": 1e-9}
PROMPT = "a red cat"
diffusers_installed = pytest.mark.skipif(not G.importlib.util.find_spec("diffusers"),
                                         reason="needs the glm_image extra (diffusers); .ci/run installs it")


def tiny_glm(dtype: str = "float64", **options) -> GlmImage:
    """``configs/model/glm_image_tiny.yaml`` on the CPU in ``dtype`` (a 2 x 2 preview and a 4 x 4 grid)."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "glm_image_tiny.yaml"))
    cfg.pop("_target_"), cfg.pop("defaults", None)
    sampling = {**cfg.pop("sampling"), **options.pop("sampling", {})}
    return GlmImage(**{**cfg, "device": "cpu", "dtype": dtype, **options}, sampling=sampling)


@pytest.fixture(scope="module")
def model() -> GlmImage:
    return tiny_glm()


def grids(model: GlmImage) -> torch.Tensor:
    """The processor's ``image_grid_thw`` of a text-to-image sample: the full grid, then the preview."""
    return torch.tensor([[1, *model.full_grid], [1, *model.preview_grid]])


# -- prompt, grids, positions -------------------------------------------------------------------------------
def test_grid_sizes_prompt_and_positions_follow_the_reference(model):
    from transformers.models.glm_image.processing_glm_image import GlmImageProcessor

    for h, w in ((1024, 1024), (1152, 768), (768, 1344), (512, 512)):  # processing_glm_image.py _get_target_shape
        assert G.target_shape(h, w) == GlmImageProcessor._get_target_shape(None, height=h, width=w)
    assert G.target_shape(1024, 1024) == (32, 32, 16, 16)  # 1024 px: 256 + 1024 codes (+ end of image) = 1281 steps
    assert model.full_grid == (4, 4) and model.preview_grid == (2, 2) and model.grid == (5, 4)
    tokens = model.tokenizer.convert_ids_to_tokens(model.prompt_ids(PROMPT))
    assert tokens == ["a", "red", "cat", "<sop>", "4", "4", "<eop>", "<sop>", "2", "2", "<eop>", "<|dit_token_256|>"]
    assert model.tokenizer.unk_token_id not in model.prompt_ids(PROMPT)
    # transformers' get_rope_index: the decode positions of the preview, the full grid and the end marker
    ids = torch.tensor([model.prompt_ids(PROMPT)])
    inner = model.glm.model
    prefill, _ = inner.get_rope_index(ids, image_grid_thw=grids(model), images_per_sample=torch.tensor([2]))
    assert torch.equal(prefill[:, 0], torch.arange(ids.shape[1]).expand(3, -1))  # the prompt: one ramp, 3 axes
    decode = inner._cached_decode_position_ids[0].t()  # (N + 1, 3)
    n = model.num_image_tokens
    assert torch.equal(model.image_pos[: n + 1] + ids.shape[1], decode)


def test_layouts_that_do_not_fill_whole_rows_are_refused():
    with pytest.raises(ValueError, match="whole rows"):
        tiny_glm(height=1152, width=768, preview_side=16)  # a 19 x 13 preview over rows of 24
    with pytest.raises(ValueError, match="cfg_scale=1.0"):
        tiny_glm(sampling={"cfg_scale": 3.0})


# -- parity with transformers' GLM-Image generation -----------------------------------------------------------
class Record(LogitsProcessor):
    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


class VisualTokens(LogitsProcessor):
    """The adapter's visual-token constraint inside HF's generate: codes only for the image sequence, then the
    end-of-image token (the reference samples over the whole vision vocabulary)."""

    def __init__(self, model: GlmImage) -> None:
        self.n, self.v, self.step = model.num_image_tokens, model.codebook_size, 0

    def __call__(self, input_ids, scores):
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
        if self.step < self.n:
            keep[: self.v] = True
        else:
            keep[self.v + 1] = True  # image end
        self.step += 1
        return scores.masked_fill(~keep, float("-inf"))


def hf_generate(model: GlmImage, prompt: str, seed: int):
    """``transformers``' GLM-Image ``generate`` as diffusers' pipeline calls it (``max_new_tokens = h w + H W + 1``,
    ``do_sample``, the checkpoint's temperature and top-p), with the visual-token constraint: the new tokens (L,),
    the raw logits (L, vision vocab) and the constrained ones (L, vision vocab)."""
    ids = torch.tensor([model.prompt_ids(prompt)])
    raw, constraint = Record(), VisualTokens(model)
    s = model.sampling
    config = GenerationConfig(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0,
                              max_new_tokens=model.num_image_tokens + 1, eos_token_id=model.codebook_size + 1,
                              pad_token_id=model.pad_id)
    torch.manual_seed(seed)
    out = model.glm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), image_grid_thw=grids(model),
                             images_per_sample=torch.tensor([2]), generation_config=config,
                             logits_processor=LogitsProcessorList([raw, constraint]))
    scores = torch.cat(raw.scores)
    return out[0, ids.shape[1]:], scores


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_and_tokens_equal_transformers_generation(model, seed):
    """HF's generate decodes the preview and then the full grid, then the end of image; teacher-forcing its codes
    through the adapter gives HF's raw logits at every step; the adapter's temperature / top-p distributions are
    HF's warpers' over the visual tokens; replaying HF's draws on them gives HF's tokens."""
    new, raw = hf_generate(model, PROMPT, seed)
    n, v = model.num_image_tokens, model.codebook_size
    assert new.shape[0] == n + 1 and int(new[-1]) == v + 1 and bool((new[:n] < v).all())
    cache, first = prefill1(model, PROMPT)
    out = forward1(model, cache, new[: n - 1], torch.arange(n - 1))
    ours = torch.cat([first.logits, out.logits], dim=1)  # (1, N, V)
    torch.testing.assert_close(ours[0].float(), raw[:n, :v], rtol=0, atol=0)
    # the reference's warpers, in generate's order: the constraint, temperature, top-p
    s = model.sampling
    masked = raw[:n].masked_fill(torch.arange(raw.shape[1]) >= v, float("-inf"))
    warped = TopPLogitsWarper(s.top_p)(None, TemperatureLogitsWarper(s.temperature)(None, masked))
    expected = warped.softmax(-1)[:, :v]
    probs = model.probs(TargetOutput(logits=ours[:, None], hidden=ours[:, None]))[0]  # (N, V)
    torch.testing.assert_close(probs.double(), expected.double(), rtol=1e-5, atol=1e-7)
    torch.manual_seed(seed)
    replay = []
    for j in range(n + 1):
        full = torch.zeros(raw.shape[1])
        if j < n:
            full[:v] = probs[j].float()
        else:
            full[v + 1] = 1.0
        replay.append(int(torch.multinomial(full[None], 1)[0, 0]))
    assert replay == new.tolist()


def uncached_logits(model: GlmImage, prompt: str, codes: torch.Tensor) -> torch.Tensor:
    """One uncached ``GlmImageForConditionalGeneration`` forward over prompt + codes at the positions transformers
    computes (``get_rope_index``): the code logits (1, N, V) that predict each code."""
    ids = torch.tensor([model.prompt_ids(prompt) + codes[:-1].tolist()])
    p = ids.shape[1] - (len(codes) - 1)
    inner = model.glm.model
    prefill, _ = inner.get_rope_index(ids[:, :p], image_grid_thw=grids(model), images_per_sample=torch.tensor([2]))
    decode = inner._cached_decode_position_ids[:, :, : len(codes) - 1]
    positions = torch.cat([prefill, decode.permute(1, 0, 2)], dim=-1)  # (3, 1, L)
    with torch.no_grad():
        logits = model.glm(input_ids=ids, position_ids=positions).logits[0]
    return logits[p - 1:, : model.codebook_size][None]


def test_cached_blocks_equal_an_uncached_forward(model):
    codes = torch.randint(model.codebook_size, (model.num_image_tokens,), generator=torch.Generator().manual_seed(2))
    reference = uncached_logits(model, PROMPT, codes)
    cache, first = prefill1(model, PROMPT)
    logits, start = [first.logits], 0
    for size in (1, 3, 2, 5, 8):  # blocks crossing the preview / full grid boundary (token 4)
        logits.append(forward1(model, cache, codes[start: start + size], torch.arange(start, start + size)).logits)
        start += size
    torch.testing.assert_close(torch.cat(logits, dim=1), reference, **EXACT)


def test_tree_attention_and_compaction_across_the_grid_boundary(model):
    parents = TreeShape.load("mc_sim_7b_63").parents()
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(model.codebook_size, (3,), generator=gen)  # the tree starts at the preview's last cell
    nodes = torch.randint(model.codebook_size, (len(parents),), generator=gen)
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, prefix, torch.arange(3))
    cache.keep(3)
    root = torch.tensor([7])
    positions = torch.tensor([3] + [3 + d for d in depths_of(parents)])
    tree = forward1(model, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in (0, 1, 5, 13, len(parents) - 1):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        seq = torch.cat([prefix, root, nodes[path]])
        ref_cache, _ = prefill1(model, PROMPT)
        torch.testing.assert_close(tree.logits[:, j + 1],
                                   forward1(model, ref_cache, seq, torch.arange(len(seq))).logits[:, -1], **EXACT)
    keep1(cache, torch.tensor([0, 1, 5, 13]))  # root and the path [0], [0, 0], [0, 0, 0]
    nxt = torch.tensor([42, 43])
    after = forward1(model, cache, nxt, torch.arange(7, 9))
    committed = torch.cat([prefix, root, nodes[[0, 4, 12]], nxt, torch.tensor([0])])
    torch.testing.assert_close(after.logits, uncached_logits(model, PROMPT, committed)[:, -2:], **EXACT)


def test_greedy_speculative_decoders_reproduce_greedy_ar():
    """Temperature 0: exact decoders emit AR's tokens (cache, keep, rollback, trees, the position table)."""
    greedy = tiny_glm(sampling={"temperature": 0.0})
    eagle = EagleDrafter(greedy, head=EagleHead(greedy, init_seed=4))
    decoders = [
        Decoder("sd", greedy, ExactRule(), draft_len=3, drafter=ModelDrafter(greedy, layer_skip_copy(greedy, 1))),
        Decoder("sd_tree", greedy, ExactRule(), draft_len=4, drafter=eagle, tree="mc_sim_7b_63"),
        Decoder("sjd", greedy, ExactRule(), draft_len=5, drafter=JacobiDrafter(greedy)),
    ]
    for prompt in ("a red cat", "a blue sky"):
        ar = Decoder("ar", greedy, ExactRule()).generate(prompt, 0).tokens
        for decoder in decoders:
            assert torch.equal(decoder.generate(prompt, 1).tokens, ar), decoder.name


# -- pixels ------------------------------------------------------------------------------------------------------
@diffusers_installed
def test_pixels_are_the_diffusers_pipeline_over_the_upsampled_full_grid():
    """``pixel_decoder=tiny_diffusers``: the full grid's codes (the preview dropped), upsampled 2x nearest, through
    ``diffusers.GlmImagePipeline`` with the model's steps, guidance and per-image seed, as uint8 the way diffusers' PIL output
    rounds them (``numpy_to_pil``: ``(x * 255).round()``)."""
    glm = tiny_glm("float32", pixel_decoder="tiny_diffusers", pixel_steps=2)
    tokens = torch.randint(glm.codebook_size, (2, glm.num_image_tokens), generator=torch.Generator().manual_seed(5))
    images = glm.decode_images(tokens)
    assert images.shape == (2, 3, glm.height, glm.width) and images.dtype == torch.uint8
    big = tokens[:, glm.preview_tokens:].reshape(2, 1, *glm.full_grid)
    prior = big.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3).flatten(1)  # _upsample_token_ids
    pil = glm.pixels(prompt=["", ""], prior_token_ids=prior, height=glm.height, width=glm.width,
                     num_inference_steps=2, guidance_scale=1.5,
                     generator=[torch.Generator().manual_seed(glm.pixel_seed) for _ in range(2)]).images
    reference = torch.from_numpy(np.stack([np.asarray(im) for im in pil])).permute(0, 3, 1, 2)
    assert (images.int() - reference.int()).abs().max() <= 1  # float32 rounding at a .5 boundary
    # alone: the same noise (one generator per image); the DiT's and VAE's CPU kernels are not batch-invariant
    assert (glm.decode_image(tokens[1]).int() - images[1].int()).abs().max() <= 2
    changed = tokens.clone()
    changed[:, : glm.preview_tokens] = 0  # the preview does not reach the pixels
    assert torch.equal(glm.decode_images(changed), images)


@diffusers_installed
def test_the_published_pixel_decoder_loads_the_repository_folders_without_the_ar_stage(monkeypatch, tmp_path):
    """``pixel_decoder=diffusers`` reads ``GlmImagePipeline`` from the repository's snapshot (``transformer/``,
    ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``; no AR stage, no processor): a saved tiny pipeline
    gives the pixels of the same pipeline built in process, up to float rounding (measured: a few pixels one level
    apart)."""
    import huggingface_hub

    G.tiny_pixel_pipeline().save_pretrained(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: str(tmp_path))
    published = tiny_glm("float32", pixel_decoder="diffusers", pixel_steps=2, repo_id=G.REPO_ID)
    tiny = tiny_glm("float32", pixel_decoder="tiny_diffusers", pixel_steps=2)
    tokens = torch.randint(tiny.codebook_size, (1, tiny.num_image_tokens), generator=torch.Generator().manual_seed(6))
    difference = (published.decode_images(tokens).int() - tiny.decode_images(tokens).int()).abs()
    assert difference.max() <= 2 and difference.float().mean() < 0.1  # the same weights; a loaded pipeline's kernels
    assert published.pixels.vision_language_encoder is None


def test_without_diffusers_a_pixel_decoder_is_refused_naming_the_extra(monkeypatch):
    real = G.importlib.util.find_spec
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    for decoder in ("diffusers", "tiny_diffusers"):
        with pytest.raises(ImportError, match=r"\.\[glm_image\]") as err:
            tiny_glm(pixel_decoder=decoder)
        assert "pip install diffusers==0.42.1" in str(err.value) and "eval.save_images=false" in str(err.value)
    assert tiny_glm(pixel_decoder="codes").decode_images(torch.zeros(1, 20, dtype=torch.long)).shape == (1, 3, 128, 128)


# -- exactness: chi-square on an enumerable GLM-Image -------------------------------------------------------------
ALPHA = 1e-3
N_QUICK = 2000  # images per decoder in the default suite (1000 per prompt)
N_FULL = 8000  # in CI's -m slow pass


def enumerable_glm_image() -> GlmImage:
    """``glm_image_tiny`` shrunk until its images can be enumerated: 4 codes, a 1 x 2 preview (``preview_side`` 2
    at 32 x 64 px) and a 1 x 2 full grid: one 2 x 2 sequence, 256 per prompt; the reference's temperature 0.9 and
    top-p 0.75; weights N(0, 0.1)."""
    return tiny_glm("float32", height=32, width=64, arch={**OmegaConf.to_container(OmegaConf.load(
        CONFIGS / "model" / "glm_image_tiny.yaml").arch), "codebook_size": 4, "init_std": 0.1})


@pytest.fixture(scope="module")
def enumerable() -> tuple[GlmImage, dict[str, torch.Tensor]]:
    model = enumerable_glm_image()
    assert model.grid == (2, 2) and model.codebook_size == 4 and model.preview_tokens == 2
    return model, {prompt: exact_grid_probs(model, prompt) for prompt in EXACT_PROMPTS}


@pytest.mark.parametrize("n", [N_QUICK, pytest.param(N_FULL, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ar", "sd_layer_skip", "sd_eagle_chain", "sd_eagle_tree",
                                  "sd_eagle_dynamic_tree", "sjd", "sjd_pac", "scd_mc", "scd_gs"])
def test_lossless_decoders_are_exact_on_an_enumerable_glm_image(enumerable, name, n):
    """Pearson chi-square of ``n`` images per lossless decoder against the exact sequence distribution of each
    prompt (cells of expected count < 5 pooled); fails below ``ALPHA`` = 1e-3, the false-alarm probability per
    prompt of a correct implementation for a random choice of seeds."""
    model, exact = enumerable
    for prompt in EXACT_PROMPTS:
        assert float(exact[prompt].sum()) == pytest.approx(1.0, abs=1e-6)
        assert 16 <= int((exact[prompt] > 0).sum()) < 256  # top-p leaves a support that is neither one nor all
    decoder = lossless_decoders(model, layer_skip=layer_skip_copy)[name]
    pvalues = grid_pvalues(decoder, model, exact, n, checked=2, support_only=True)  # top-p: few cells
    assert min(pvalues.values()) > ALPHA, pvalues


def test_the_exactness_test_rejects_a_broken_residual_on_glm_image(enumerable):
    model, exact = enumerable
    decoder = Decoder("broken", model, ResampleFromTarget(), draft_len=3,
                      drafter=EagleDrafter(model, head=EagleHead(model, init_seed=4)))
    pvalues = grid_pvalues(decoder, model, exact, N_QUICK, checked=2, support_only=True)
    # measured: 6e-83 on the longer prompt; on "a red cat" (17 cells in the top-p support) the broken residual
    # changes too little to see at N_QUICK (p = 0.5), so the check asks for one prompt
    assert min(pvalues.values()) < ALPHA, pvalues


# -- configuration, weights ---------------------------------------------------------------------------------------
def test_pretrained_loading_reads_a_saved_checkpoint(monkeypatch, tmp_path):
    import huggingface_hub

    source = tiny_glm("float32")
    source.glm.save_pretrained(tmp_path / G.AR_FOLDER)
    source.tokenizer.save_pretrained(tmp_path / G.TOKENIZER_FOLDER)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: str(tmp_path))
    loaded = tiny_glm("float32", pretrained=True, arch=None, repo_id=G.REPO_ID)
    assert loaded.prompt_ids(PROMPT) == source.prompt_ids(PROMPT)
    assert torch.equal(prefill1(loaded, PROMPT)[1].logits, prefill1(source, PROMPT)[1].logits)


def test_required_files_name_the_ar_stage_and_the_pixel_decoder():
    files = GlmImage.required_files({"pretrained": True, "repo_id": G.REPO_ID, "pixel_decoder": "diffusers"})
    assert [f.repo_id for f in files] == [G.REPO_ID] * 2
    assert "vision_language_encoder/model.safetensors.index.json" in files[0].must_have
    assert "processor/tokenizer.json" in files[0].must_have and "transformer/config.json" in files[1].must_have
    assert len(GlmImage.required_files({"pretrained": True, "repo_id": G.REPO_ID, "pixel_decoder": "codes"})) == 1
    assert GlmImage.required_files({"pretrained": False}) == []
    assert math.isclose(OmegaConf.load(CONFIGS / "model" / "glm_image.yaml").sampling.top_p, 0.75)


# -- every decoder of the suite, batched = alone --------------------------------------------------------------------
def suite_decoders() -> list[str]:
    """The suite's decoder names: the ``decoder@suite.<name>`` entries of ``configs/config.yaml``'s defaults."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIGS / "config.yaml").defaults)
    keys = [next(iter(d)) for d in defaults if isinstance(d, dict)]
    return [k.split("@suite.")[1] for k in keys if k.startswith("decoder@suite.")]


EAGLE_DECODERS = ("sd", "coolsd", "lantern", "lantern_pp", "vvs")


@pytest.fixture(scope="module")
def suite_setup():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=glm_image_tiny", "model.device=cpu",
                                                       "model.dtype=float64"])
    from hydra.utils import instantiate

    return cfg, instantiate(cfg.model)


@pytest.mark.filterwarnings("ignore")  # LANTERN's k capped at the tiny codebook's size
@pytest.mark.parametrize("name", suite_decoders())
def test_every_decoder_gives_an_image_the_same_alone_and_in_a_batch(suite_setup, name):
    """Every decoder of the suite (``configs/config.yaml``) on ``glm_image_tiny`` (float64; the EAGLE family on a
    random EAGLE head, the others as configured, with the model's layer-skip drafter where they take one): a batch of three prompts of different lengths gives each image its alone tokens, a full sequence of codes."""
    from hydra.utils import instantiate

    cfg, glm = suite_setup
    node = OmegaConf.to_container(cfg.suite[name], resolve=True)
    if name in EAGLE_DECODERS:  # the EAGLE family on a random EAGLE head (the multi-axis draft layer), as VVS needs
        node.pop("drafter")
        decoder = instantiate(node, model=glm, drafter=EagleDrafter(glm, head=EagleHead(glm, init_seed=1)))
    else:
        decoder = instantiate(node, model=glm)
    prompts = ["a red cat", "a photo of the blue sky on a table", "a dog"]
    batch = decoder.generate_batch(prompts, [3, 4, 5])
    for k, gen in enumerate(batch):
        assert gen.tokens.shape == (glm.num_image_tokens,) and int(gen.tokens.max()) < glm.codebook_size
        assert torch.equal(decoder.generate(prompts[k], 3 + k).tokens, gen.tokens), (name, k)
