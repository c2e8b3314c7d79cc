"""Emu3 adapter on a tiny random ``Emu3Config`` (no download): exact agreement with ``transformers``' own Emu3
generation under the reference's logits processors (baaivision/Emu3 ``image_generation.py``: unbatched CFG with
the negative prompt, the prefix constraint, top-k), its sampled tokens and decoded pixels; the reference's
prompt and header; cached == uncached; trees and KV compaction across end-of-line tokens; the lossless
decoders' exactness. What every adapter promises (batched = alone, shapes, missing weights, the published size on
the meta device, every decoder through ``run.py``) is checked in ``tests/test_adapters.py``.

Comparisons are identities on float64 models (tolerances of rounding error only); the shared sampling
pipeline works in float32, so guided distributions agree to float32 rounding.

Statistical tests (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the probability that a
correct implementation fails for a random choice of seeds, per test and per prompt):

* ``test_lossless_decoders_are_exact_on_an_enumerable_emu3``: on ``emu3_tiny`` (float32) shrunk to 4 codes on
  a 2 x 2 grid (``enumerable_emu3``: 256 grids, 81 of them in the top-k support, per prompt), the exact grid
  distribution by teacher forcing the adapter (``exact_grid_probs``); ``N_QUICK`` images per lossless decoder
  (``N_FULL`` in the ``-m slow`` pass), seeds 0..n-1, in batches of ``BATCH`` mixing two prompts of different
  lengths; Pearson chi-square per prompt (cells of expected count < 5 pooled).
* ``test_the_exactness_test_rejects_a_broken_residual_on_emu3``: the same test must reject SD that resamples
  from p after a rejection (p-values 9e-7 and 4e-5 on these seeds).

About 20 s on one core (the exactness tests 14 s of it; up to 1.6x that on a loaded machine) plus the
``-m slow`` pass: the exactness tests at ``N_FULL`` (90 s; 3 minutes under load).
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    PrefixConstrainedLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models import emu3 as E
from coolsd.models.base import ImageARModel
from coolsd.models.emu3 import Emu3Gen, layer_skip_copy
from coolsd.trees import TreeShape, ancestor_mask, depths_of
from coolsd.types import TargetOutput
from tests.helpers import CONFIGS, chi_square_pvalue, forward1, keep1, prefill1
from tests.test_lossless import ResampleFromTarget

ROOT = CONFIGS.parent
EXACT = {"rtol": 1e-9, "atol": 1e-9}
PROMPT = "a red cat"
TINY_AREA = 1024  # 32 x 32 px: a 4 x 4 grid at Emu3's 8x down-sampling


def tiny_emu3(dtype: str = "float64", **sampling) -> Emu3Gen:
    return Emu3Gen(sampling={"cfg_scale": 3.0, **sampling}, pretrained=False, arch={}, image_area=TINY_AREA,
                   device="cpu", dtype=dtype)


@pytest.fixture(scope="module")
def model() -> Emu3Gen:
    return tiny_emu3()


# -- the reference recipe, restated ------------------------------------------------------------------------
def reference_prefix_constraint(model: Emu3Gen):
    """The allowed next tokens of baaivision/Emu3 ``emu3/mllm/utils_emu3.py`` ``Emu3PrefixConstrainedLogitsHelper``
    (one image of ``model.grid``): visual tokens; end of line where the offset from ``<|image token|>`` is a
    multiple of W + 1; then end of frame, end of image, EOS, padding."""
    h, w = model.grid
    vocab = model.tokenizer.get_vocab()
    visual = list(range(int(model.code_to_bpe[0]), int(model.code_to_bpe[-1]) + 1))  # the reference's id range
    img = vocab[E.IMAGE_TOKEN]

    def allowed(batch_id, input_ids):
        offset = input_ids.shape[0] - int(torch.nonzero(input_ids == img)[0, 0])
        if offset % (w + 1) == 0:
            return [vocab[E.END_OF_LINE]]
        for k, name in enumerate((E.END_OF_FRAME, E.IMAGE_END, E.EOS), start=1):
            if offset == (w + 1) * h + k:
                return [vocab[name]]
        return [vocab[E.PAD]] if offset > (w + 1) * h + 3 else visual

    return allowed


class Record(LogitsProcessor):
    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def hf_generate(model: Emu3Gen, prompt: str, seed: int, top_k: int):
    """``transformers``' Emu3 ``generate`` with image_generation.py's processors: the new tokens (L,), the raw
    conditional and unconditional logits (L, vocab) and the processed scores before top-k (L, vocab)."""
    h, w = model.grid
    cond = torch.tensor([model.prompt_ids(prompt)])
    cfg = UnbatchedClassifierFreeGuidanceLogitsProcessor(3.0, model.emu3,
                                                         unconditional_ids=torch.tensor([model.negative_ids()]))
    uncond: list[torch.Tensor] = []
    inner = cfg.get_unconditional_logits
    cfg.get_unconditional_logits = lambda ids: uncond.append(inner(ids)[:, -1].clone()) or uncond[-1][:, None]
    raw, processed = Record(), Record()
    processors = LogitsProcessorList([raw, cfg, PrefixConstrainedLogitsProcessor(reference_prefix_constraint(model),
                                                                                  num_beams=1), processed])
    config = GenerationConfig(do_sample=True, top_k=top_k, max_new_tokens=h * (w + 1) + 3,
                              eos_token_id=model.tokenizer.eos_token_id, pad_token_id=model.tokenizer.pad_token_id)
    torch.manual_seed(seed)
    out = model.emu3.generate(cond, config, logits_processor=processors, attention_mask=torch.ones_like(cond))
    return (out[0, cond.shape[1]:], torch.cat(raw.scores), torch.cat(uncond), torch.cat(processed.scores))


def image_steps(model: Emu3Gen) -> list[int]:
    """Indices of the visual tokens among the generated tokens (the end-of-line steps left out)."""
    h, w = model.grid
    return [r * (w + 1) + c for r in range(h) for c in range(w)]


def top_k_probs(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k:
        kth = scores.topk(k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return scores.softmax(-1)


# -- prompt, header, grid ----------------------------------------------------------------------------------
def test_prompt_header_and_grid_follow_the_reference_processor(model):
    from transformers.models.emu3.processing_emu3 import Emu3Processor

    # processing_emu3.py calculate_generate_size (ratio "W:H"), the same in transformers' Emu3Processor
    for ratio in ("1:1", "16:9", "4:3"):
        assert E.generate_size(ratio, 518400, 8) == Emu3Processor.calculate_generate_size(None, ratio, 518400, 8)
    assert E.generate_size("1:1", 518400, 8) == (90, 90)  # Emu3-Gen's 720 px images
    assert E.generate_size("16:9", 518400, 8) == (68, 120)
    assert model.grid == (4, 4)
    # BOS + prompt + positive prompt + <|image start|> H*W <|image token|> (processing_emu3.py l.177-183)
    text = model.tokenizer.decode(model.prompt_ids(PROMPT))
    assert text.replace(" ", "") == ("<|extra_203|>" + PROMPT + E.POSITIVE_PROMPT + "<|image start|>4*4"
                                     "<|image token|>").replace(" ", "")
    negative = model.tokenizer.convert_ids_to_tokens(model.negative_ids())
    assert negative[0] == E.BOS and negative[-5:] == [E.IMAGE_START, "4", "*", "4", E.IMAGE_TOKEN]
    assert "lowres" in negative and "masterpiece" not in negative
    assert model.tokenizer.unk_token_id not in model.prompt_ids(PROMPT) + model.negative_ids()


def test_visual_codes_come_from_the_token_names(model):
    vocab = model.tokenizer.get_vocab()
    for code in (0, 17, model.codebook_size - 1):
        assert int(model.code_to_bpe[code]) == vocab[f"<|visual token {code:06d}|>"]
    mapping = model.emu3.model.vocabulary_mapping.img2bpe  # transformers' own reading of the names
    assert [mapping[c] for c in range(model.codebook_size)] == model.code_to_bpe.tolist()
    with pytest.raises(ValueError, match="visual tokens"):
        E.visual_code_ids({"<|visual token 000001|>": 5})


# -- parity with transformers' Emu3 generation ------------------------------------------------------------
@pytest.mark.parametrize("seed,top_k", [(0, 0), (1, 40)])
def test_logits_tokens_and_pixels_equal_transformers_generation(model, seed, top_k):
    """HF's generate with the reference's processors: its grid has end-of-line tokens after every row and then
    end of frame / image / EOS; teacher-forcing its visual tokens through the adapter gives HF's raw logits of
    both streams at every step; the guided top-k distributions agree; replaying HF's draws on ours gives HF's
    tokens; the decoded pixels are HF's ``decode_image_tokens`` and the recipe's uint8 postprocess."""
    rule = tiny_emu3(top_k=top_k)
    new, cond, uncond, processed = hf_generate(rule, PROMPT, seed, top_k)
    h, w = rule.grid
    vocab = rule.tokenizer.get_vocab()
    assert new.shape[0] == h * (w + 1) + 3
    assert new[[r * (w + 1) + w for r in range(h)]].eq(vocab[E.END_OF_LINE]).all()
    assert new[-3:].tolist() == [vocab[E.END_OF_FRAME], vocab[E.IMAGE_END], vocab[E.EOS]]
    steps = image_steps(rule)
    bpe = new[steps]
    codes = torch.tensor([{b: c for c, b in enumerate(rule.code_to_bpe.tolist())}[int(t)] for t in bpe])
    cache, first = prefill1(rule, PROMPT)
    out = forward1(rule, cache, codes[:-1], torch.arange(len(codes) - 1))
    ours = torch.cat([first.logits, out.logits], dim=1)  # (S, N, V)
    visual = rule.code_to_bpe
    # generate hands its processors float32 copies of the conditional logits; the unconditional ones are the
    # model's own (float64)
    torch.testing.assert_close(ours[0].float(), cond[steps][:, visual], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1], uncond[steps][:, visual], **EXACT)
    # guided distributions: the reference's log-softmax CFG + constraint + top-k vs the shared float32 pipeline
    expected = top_k_probs(processed[steps], top_k)[:, visual]  # (N, V); everything else is masked
    probs = rule.probs(TargetOutput(logits=ours[:, None], hidden=ours[:, None]))[0]
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
    # HF's draws replayed on our distributions (forced steps consume their draw too)
    torch.manual_seed(seed)
    replay, k = [], 0
    for j in range(len(new)):
        full = torch.zeros(len(vocab), dtype=torch.float64)
        if j in steps:
            full[visual] = probs[k].double()
            k += 1
        else:
            full[int(new[j])] = 1.0
        replay.append(int(torch.multinomial(full[None], 1)[0, 0]))
    assert replay == new.tolist()
    # decoded pixels
    with torch.no_grad():
        theirs = rule.emu3.model.decode_image_tokens(image_tokens=new[None], height=h, width=w).float()
    torch.testing.assert_close(rule.decode_pixels(codes[None]), theirs, **EXACT)
    recipe = np.clip((theirs[0].numpy() + 1) / 2 * 255, 0, 255).astype(np.uint8)  # postprocess: clip, cast
    assert torch.equal(rule.decode_image(codes), torch.from_numpy(recipe))
    assert torch.equal(rule.decode_images(codes[None])[0], rule.decode_image(codes))


def full_sequence_logits(model: Emu3Gen, prompt: str, codes: torch.Tensor) -> torch.Tensor:
    """One uncached ``Emu3ForConditionalGeneration`` forward per stream over prefix + codes with end-of-line
    tokens after each row: the visual-token logits (S, N, V) that predict each code."""
    h, w = model.grid
    eol = model.tokenizer.get_vocab()[E.END_OF_LINE]
    body, at = [], []
    for i, c in enumerate(codes[:-1].tolist()):
        body.append(int(model.code_to_bpe[c]))
        if i % w == w - 1:
            body.append(eol)
        at.append(len(body) - 1)
    out = []
    for prefix in (model.prompt_ids(prompt), model.negative_ids()):
        ids = torch.tensor([prefix + body])
        with torch.no_grad():
            logits = model.emu3(input_ids=ids).logits[0]  # (L, vocab)
        rows = [len(prefix) - 1] + [len(prefix) + a for a in at]
        out.append(logits[rows][:, model.code_to_bpe])
    return torch.stack(out)


def test_cached_blocks_equal_an_uncached_forward(model):
    codes = torch.randint(model.codebook_size, (model.num_image_tokens,), generator=torch.Generator().manual_seed(2))
    reference = full_sequence_logits(model, PROMPT, codes)
    cache, first = prefill1(model, PROMPT)
    logits, start = [first.logits], 0
    for size in (1, 3, 4, 2, 5):  # blocks crossing row ends
        logits.append(forward1(model, cache, codes[start: start + size], torch.arange(start, start + size)).logits)
        start += size
    torch.testing.assert_close(torch.cat(logits, dim=1), reference, **EXACT)


def test_batched_prefill_gives_each_image_its_alone_output(model):
    prompts = ["a red cat", "a photo of the blue sky on a table", "a dog"]
    cache, out = model.prefill(prompts)
    codes = torch.randint(model.codebook_size, (3, 6), generator=torch.Generator().manual_seed(3))
    block = model.forward_block(cache, codes, torch.arange(6).expand(3, -1))
    for b, prompt in enumerate(prompts):
        c1, o1 = prefill1(model, prompt)
        torch.testing.assert_close(out.logits[:, b], o1.logits, **EXACT)
        torch.testing.assert_close(block.logits[:, b], forward1(model, c1, codes[b], torch.arange(6)).logits, **EXACT)


def test_tree_attention_and_compaction_across_row_ends(model):
    parents = TreeShape.load("mc_sim_7b_63").parents()
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(model.codebook_size, (3,), generator=gen)  # the tree starts at a row's last cell
    nodes = torch.randint(model.codebook_size, (len(parents),), generator=gen)
    cache, _ = prefill1(model, PROMPT)
    forward1(model, cache, prefix, torch.arange(3))
    cache.keep(3)
    root = torch.tensor([7])
    positions = torch.tensor([3] + [3 + d for d in depths_of(parents)])
    tree = forward1(model, cache, torch.cat([root, nodes]), positions, ancestor_mask(parents))
    for j in (0, 1, 5, 13, 21, len(parents) - 1):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        seq = torch.cat([prefix, root, nodes[path]])
        ref_cache, _ = prefill1(model, PROMPT)
        ref = forward1(model, ref_cache, seq, torch.arange(len(seq)))
        torch.testing.assert_close(tree.logits[:, j + 1], ref.logits[:, -1], **EXACT)
    keep1(cache, torch.tensor([0, 1, 5, 13]))  # root and the path [0], [0, 0], [0, 0, 0]
    nxt = torch.tensor([42, 43])
    after = forward1(model, cache, nxt, torch.arange(7, 9))
    committed = torch.cat([prefix, root, nodes[[0, 4, 12]], nxt, torch.tensor([0])])
    torch.testing.assert_close(after.logits, full_sequence_logits(model, PROMPT, committed)[:, -2:], **EXACT)


def test_greedy_speculative_decoders_reproduce_greedy_ar():
    """Temperature 0: exact decoders emit AR's tokens (cache, keep, rollback, trees, end-of-line slots)."""
    greedy = tiny_emu3(temperature=0.0)
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


# -- exactness: chi-square on an enumerable Emu3 ------------------------------------------------------------
ALPHA = 1e-3
N_QUICK = 1000  # images per decoder in the default suite (500 per prompt)
N_FULL = 8000  # in CI's -m slow pass
BATCH = 100
EXACT_PROMPTS = ("a red cat", "a photo of the blue sky on a table")  # prefixes of two lengths: left padding


def enumerable_emu3() -> Emu3Gen:
    """``configs/model/emu3_tiny.yaml`` shrunk until its images can be enumerated: 4 codes on a 2 x 2 grid (an
    end-of-line token forced after the first row), 256 grids of which top-k 3 leaves 81 per prompt; CFG 3 with
    the reference's negative-prompt stream, shortened to keep the prefill cheap; weights N(0, 0.1) so the
    grid distribution is neither flat nor one spike (entropies 2.7 and 2.6 nats of at most log 81 = 4.4,
    largest cell 0.24)."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "emu3_tiny.yaml"))
    cfg.pop("_target_")
    cfg.pop("defaults", None)
    cfg["arch"].update(codebook_size=4, init_std=0.1)
    cfg["sampling"].update(top_k=3)
    cfg.update(image_area=256, negative_prompt="lowres, blurry.", device="cpu")  # 16 x 16 px: 2 x 2 codes
    return Emu3Gen(**cfg)


def grid_index(model: ImageARModel, tokens: torch.Tensor) -> int:
    """Base-V index of a complete code grid in raster order (matches ``exact_grid_probs``)."""
    index = 0
    for code in tokens.tolist():
        index = index * model.codebook_size + int(code)
    return index


def exact_grid_probs(model: ImageARModel, prompt: str) -> torch.Tensor:
    """Probability of every complete code grid (V^N,), base-V raster order, as the decoders see the model: the
    product over the N steps of the guided distributions (CFG with the unconditional stream, top-k, visual
    tokens only) of the adapter teacher-forced on the grid's first N - 1 codes, end-of-line token included
    (one prefill and one block per prefix, each alone)."""
    v, n = model.codebook_size, model.num_image_tokens
    step = {}
    for prefix in itertools.product(range(v), repeat=n - 1):
        cache, first = prefill1(model, prompt)
        out = forward1(model, cache, torch.tensor(prefix), torch.arange(n - 1))
        logits = torch.cat([first.logits, out.logits], dim=1)  # (S, N, V)
        out = TargetOutput(logits=logits[:, None], hidden=logits[:, None])
        probs = model.probs(out)[0].double()  # (N, V)
        for i in range(n):
            step[prefix[:i]] = probs[i]
    return torch.stack([torch.prod(torch.stack([step[grid[:i]][grid[i]] for i in range(n)]))
                        for grid in itertools.product(range(v), repeat=n)])


def lossless_decoders(model: ImageARModel, layer_skip=layer_skip_copy) -> dict[str, Decoder]:
    """Every decoder README marks lossless, on ``model``: AR; SD with the layer-skip drafter and with an EAGLE
    drafter of random weights on a chain, the EAGLE-1 static tree and an EAGLE-2 dynamic tree; SJD, SJD-PAC
    (its K = 2, D = 3 tree, both branching levels full), SCD-MC and SCD-GS. Windows and trees span the end of
    the first row. ``layer_skip``: the adapter's ``layer_skip_copy`` (Emu3's by default; GLM-Image's tests pass
    theirs)."""
    def eagle():
        return EagleDrafter(model, head=EagleHead(model, init_seed=4))

    def jacobi(**options):
        return JacobiDrafter(model, **options)

    return {
        "ar": Decoder("ar", model, ExactRule()),
        "sd_layer_skip": Decoder("sd", model, ExactRule(), draft_len=2,
                                 drafter=ModelDrafter(model, layer_skip(model, 1))),
        "sd_eagle_chain": Decoder("sd", model, ExactRule(), draft_len=3, drafter=eagle()),
        "sd_eagle_tree": Decoder("sd", model, ExactRule(), drafter=eagle(), tree="mc_sim_7b_63"),
        "sd_eagle_dynamic_tree": Decoder("sd", model, ExactRule(), drafter=eagle(), tree="dynamic",
                                         dynamic_tree=dict(top_k=2, depth=3, total_tokens=6)),
        "sjd": Decoder("sjd", model, ExactRule(), draft_len=3, drafter=jacobi(init="random")),
        "sjd_pac": Decoder("sjd_pac", model, ExactRule(), draft_len=7, drafter=jacobi(
            init="random_uniform_q", carry="maximal", tree_width=2, tree_depth=3)),
        "scd_mc": Decoder("scd_mc", model, ExactRule(), draft_len=3,
                          drafter=jacobi(init="random", carry="maximal")),
        "scd_gs": Decoder("scd_gs", model, ExactRule(), draft_len=3,
                          drafter=jacobi(init="random", carry="gumbel")),
    }


@pytest.fixture(scope="module")
def enumerable() -> tuple[Emu3Gen, dict[str, torch.Tensor]]:
    model = enumerable_emu3()
    assert model.grid == (2, 2) and model.codebook_size == 4
    return model, {prompt: exact_grid_probs(model, prompt) for prompt in EXACT_PROMPTS}


def grid_pvalues(decoder: Decoder, model: ImageARModel, exact: dict[str, torch.Tensor], n: int, checked: int = 3,
                 support_only: bool = False) -> dict[str, float]:
    """Chi-square p-value per prompt of ``n`` images (seeds 0..n-1, prompts alternating) decoded in batches of
    ``BATCH``; the first two images of the first ``checked`` batches must equal their alone decodes (one of those may
    differ where the kernels are not batch-invariant, ``tests.helpers.invariance_property``), and no image may fall
    outside the sampling support (top-k or top-p). ``support_only``: the test runs on the support's cells only (a
    top-p support leaves few), else on every cell (cells of expected count < 5 pooled). Shared with
    ``tests/test_glm_image.py``."""
    from tests.helpers import invariance_property

    bitwise = invariance_property(model) == "bitwise"
    counts = {prompt: torch.zeros(model.codebook_size ** model.num_image_tokens) for prompt in EXACT_PROMPTS}
    differ = []
    for start in range(0, n, BATCH):
        seeds = list(range(start, min(start + BATCH, n)))
        prompts = [EXACT_PROMPTS[s % 2] for s in seeds]
        images = decoder.generate_batch(prompts, seeds)
        if start < checked * BATCH:
            for b in (0, 1):
                if not torch.equal(decoder.generate(prompts[b], seeds[b]).tokens, images[b].tokens):
                    differ.append(seeds[b])
        for prompt, image in zip(prompts, images):
            counts[prompt][grid_index(model, image.tokens)] += 1
    # where the machine's kernels are not batch-invariant (tests.helpers.invariance_property), float32 rounding may
    # flip a token of a rare image: at most one of the checked images may then differ from its alone decode
    assert not differ if bitwise else len(differ) <= 1, f"batched != alone for seeds {differ}"
    for prompt in EXACT_PROMPTS:
        assert counts[prompt][exact[prompt] == 0].sum() == 0, "an image outside the sampling support"
    cells = {prompt: exact[prompt] > 0 if support_only else slice(None) for prompt in EXACT_PROMPTS}
    return {prompt: chi_square_pvalue(counts[prompt][cells[prompt]], exact[prompt][cells[prompt]])
            for prompt in EXACT_PROMPTS}


@pytest.mark.parametrize("n", [N_QUICK, pytest.param(N_FULL, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ar", "sd_layer_skip", "sd_eagle_chain", "sd_eagle_tree",
                                  "sd_eagle_dynamic_tree", "sjd", "sjd_pac", "scd_mc", "scd_gs"])
def test_lossless_decoders_are_exact_on_an_enumerable_emu3(enumerable, name, n):
    """Pearson chi-square of ``n`` images per lossless decoder (``lossless_decoders``) on ``enumerable_emu3``
    against the exact grid distribution of each prompt (``exact_grid_probs``; cells of expected count < 5
    pooled). Seeds are fixed (0..n-1, so the outcome is deterministic); the test fails when a p-value is below
    ``ALPHA`` = 1e-3, which for a correct implementation and a random choice of seeds happens with probability
    0.001 per prompt (the false-alarm probability). Images are decoded in batches of ``BATCH`` mixing both
    prompts (different prefix lengths); each checked image equals its alone decode."""
    model, exact = enumerable
    for prompt in EXACT_PROMPTS:
        assert float(exact[prompt].sum()) == pytest.approx(1.0, abs=1e-6)
        assert int((exact[prompt] > 0).sum()) == 3 ** model.num_image_tokens  # top-k: 3 of 4 codes a step
    decoder = lossless_decoders(model)[name]
    assert decoder.rule.lossless
    pvalues = grid_pvalues(decoder, model, exact, n)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_the_exactness_test_covers_every_decoder_readme_marks_lossless(enumerable):
    """The decoders table of README.md: every decoder whose "lossless" cell says yes is among
    ``lossless_decoders`` (a decoder added there as lossless must be added here)."""
    rows = [line.split("|") for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    readme = {name for row in rows if row[-2].strip() == "yes" for name in re.findall(r"`(\w+)`", row[1])}
    assert {"ar", "sd", "sjd"} <= readme
    assert readme <= {decoder.name for decoder in lossless_decoders(enumerable[0]).values()}


def test_the_exactness_test_rejects_a_broken_residual_on_emu3(enumerable):
    """Power check of the test above on the same model, seeds and ``N_QUICK``: SD (EAGLE chain)
    resampling from p instead of norm([p - q]_+) after a rejection must give a p-value below ``ALPHA`` for
    each prompt."""
    model, exact = enumerable
    decoder = Decoder("broken", model, ResampleFromTarget(), draft_len=3,
                      drafter=EagleDrafter(model, head=EagleHead(model, init_seed=4)))
    assert max(grid_pvalues(decoder, model, exact, N_QUICK).values()) < ALPHA


# -- configuration, weights ---------------------------------------------------------------------------------
def test_bad_settings_name_what_to_do():
    """(Missing weights: tests/test_adapters.py, for every adapter.)"""
    with pytest.raises(ValueError, match="model.arch"):
        Emu3Gen(sampling={}, pretrained=False, device="cpu")
    with pytest.raises(ValueError, match="model.arch=null"):
        Emu3Gen(sampling={}, repo_id="BAAI/Emu3-Gen-hf", arch={}, device="cpu")
    with pytest.raises(ValueError, match="model.ratio"):
        E.generate_size("square", 518400, 8)


def test_pretrained_loading_reads_a_saved_checkpoint(monkeypatch, tmp_path):
    import huggingface_hub

    source = tiny_emu3("float32")
    source.emu3.save_pretrained(tmp_path)
    source.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: str(tmp_path))
    loaded = Emu3Gen(sampling={"cfg_scale": 3.0}, repo_id="BAAI/Emu3-Gen-hf", image_area=TINY_AREA, device="cpu",
                     dtype="float32")
    assert loaded.prompt_ids(PROMPT) == source.prompt_ids(PROMPT)
    assert torch.equal(prefill1(loaded, PROMPT)[1].logits, prefill1(source, PROMPT)[1].logits)


def test_required_files_name_the_hub_snapshot():
    files = Emu3Gen.required_files({"pretrained": True, "repo_id": "BAAI/Emu3-Gen-hf"})
    assert [f.repo_id for f in files] == ["BAAI/Emu3-Gen-hf"]
    assert "model.safetensors.index.json" in files[0].must_have and "tokenizer.json" in files[0].must_have
    assert Emu3Gen.required_files({"pretrained": False}) == []
