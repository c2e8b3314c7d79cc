"""Lumina-mGPT and Emu3 on the static decode path (``decoder.path=static``, ``coolsd.static``): their end-of-row
(end-of-line) slots added to every block on the device (``coolsd.models.lumina_mgpt.EndOfRowBlocks``,
``RowEndKVCache``). The tiny random models (``configs/model/lumina_tiny.yaml``, ``emu3_tiny.yaml``: 4 x 4 grids, an
end-of-row slot after every row but the last, float32) give the eager path's tokens and statistics, a block and its
``keep`` equal the eager cache's across row ends, every block has room for its end-of-row slots, the steps read
nothing from the host (AR) or once per iteration, a refilled queue gives its lock-step images, the steps compile
whole without recompiling (``-m slow``), and the lossless static decoders are exact on an enumerable Emu3.

The EAGLE decoders (SD, COOL-SD, LANTERN) draft with a randomly initialised EAGLE head (the tiny models' own
drafter is a layer-skip ``ModelDrafter``). Batches mix prompts of different lengths (left-padded, masked; on the
static path to ``model.prompt_capacity``).

Statistical test (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the probability that a
correct implementation fails for a random choice of seeds, per test and per prompt):

* ``test_static_lossless_decoders_are_exact_on_an_enumerable_emu3``: ``tests/test_emu3.py``'s ``enumerable_emu3``
  (4 codes on a 2 x 2 grid, an end-of-line slot after the first row; 81 grids in the top-k support per prompt) and
  its exact grid distribution by teacher forcing the eager adapter; ``N_QUICK`` images per lossless static decoder
  (``N_FULL`` in the ``-m slow`` pass) in batches of ``BATCH`` mixing two prompts of different lengths; Pearson
  chi-square per prompt, cells of expected count below 5 pooled.

About 40 s on 2 CPU cores; the compiled steps take a minute or more (``-m slow``).
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.models.lumina_mgpt import EndOfRowBlocks, RowEndKVCache
from tests.helpers import CONFIGS, chi_square_pvalue
from tests.test_emu3 import EXACT_PROMPTS, enumerable_emu3, exact_grid_probs, grid_index
from tests.test_refill import assert_refill_equals_lock_step
from tests.test_static_path import assert_static_reads, eager_and_static_pairs, static_lossless

MODELS = ("lumina_tiny", "emu3_tiny")
#: prompts of different lengths (19, 25 and 21 prefix tokens on lumina_tiny; 17, 23 and 19 on emu3_tiny)
PROMPTS = ["a red cat", "a photo of the blue sky on a table", "a blue dog on a tree"]
EAGLE = ("sd", "coolsd", "lantern")
#: the decoders of the brief that run on both paths: AR, SJD and SJD-PAC as configured, SD on a chain, EAGLE-1's
#: static tree and an EAGLE-2 tree, COOL-SD's chain and LANTERN's EAGLE-2 tree (as published)
TREES = {"sd_static_tree": ("sd", {"tree": "mc_sim_7b_63"}), "sd_dynamic_tree": ("sd", {"tree": "dynamic"})}
DECODERS = ("ar", "sd", "sd_static_tree", "sd_dynamic_tree", "coolsd", "lantern", "sjd", "sjd_pac")
#: the relative tolerance of a relaxed rule's summed TV: the models attend with PyTorch's SDPA
#: (``model.attention_kernel=auto``), which is not padding-invariant on a CPU, and a static step attends over the
#: cache's whole capacity where the eager one attends up to the batch's longest row, so the probabilities may
#: differ in float32's last bits; the tokens and every count are the same
TV_REL = 1e-5
ALPHA = 1e-3
N_QUICK = 1000
N_FULL = 8000
BATCH = 100


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    """A tiny model in float32 and its suite's configs, composed as ``run.py`` composes them."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={request.param}", "model.device=cpu"])
    model = instantiate(cfg.model)
    assert model.grid == (4, 4) and model.sampling.guided and isinstance(model, EndOfRowBlocks)
    return model, cfg


def build(cfg, model, name: str, path: str, **overrides) -> Decoder:
    """A suite decoder on ``path`` (``TREES``: SD on a tree); an EAGLE decoder's drafter is a random EAGLE head."""
    base, tree = TREES.get(name, (name, {}))
    node = OmegaConf.to_container(cfg.suite[base], resolve=True)
    node.update(tree, **overrides, path=path)
    if base in EAGLE:
        node.pop("drafter")
        return instantiate(node, model=model, drafter=EagleDrafter(model, head=EagleHead(model, init_seed=1)))
    return instantiate(node, model=model)


@pytest.mark.filterwarnings("ignore:decoder.k=1000 exceeds")  # LANTERN's k capped to the tiny codebook
@pytest.mark.parametrize("name", DECODERS)
def test_static_gives_the_eager_tokens_and_statistics(tiny, name):
    """Every decoder gives the eager decoder's tokens and statistics (iterations, accepted-length histogram, forwards;
    the TV to ``TV_REL``) on the static path, in a batch of 3 prompts of different lengths whose images finish at
    different iterations, and alone; where the machine's linears are not batch-invariant (``invariance_property``),
    at most one image of four may differ. The accepted lengths count image tokens only, on both paths."""
    model, cfg = tiny
    eager, static = build(cfg, model, name, "eager"), build(cfg, model, name, "static")
    pairs = eager_and_static_pairs(eager, static, PROMPTS, 1, TV_REL)
    for _, b in pairs:
        assert sum((c + 1) * k for c, k in enumerate(b.stats.accepted_hist)) == model.num_image_tokens - 1
    if name in ("sd_static_tree", "lantern", "sjd", "sjd_pac"):  # (a random head's chain accepts little)
        assert len({b.stats.iterations for _, b in pairs}) > 1  # images finish at different iterations


@pytest.mark.parametrize("name", ["sd", "sd_static_tree", "sd_dynamic_tree", "sjd", "sjd_pac"])
def test_every_block_has_room_for_its_end_of_row_slots(tiny, monkeypatch, name):
    """The fixed room of a block (``RowEndKVCache.extra_rows``, from ``StaticLoop.levels``) holds every end-of-row
    slot its nodes need, whatever the accept outcomes and positions: none is ever dropped."""
    model, cfg = tiny
    static = build(cfg, model, name, "static")
    seen = []
    forward = type(model).static_forward

    def recorded(self, cache, tokens, positions, tree_mask=None):
        needed = self.end_of_row_after[positions].sum(1).max()
        seen.append((needed, cache.extra_rows(tokens.shape[1], tree_mask is not None)))
        return forward(self, cache, tokens, positions, tree_mask)

    monkeypatch.setattr(type(model), "static_forward", recorded)
    static.generate_batch(PROMPTS, [10, 11, 12])
    needed = [int(n) for n, _ in seen]
    room = {extra for _, extra in seen}
    assert len(room) == 1 and 1 <= max(needed) <= room.pop() <= static.max_nodes + 1, (needed, seen[0][1])


@pytest.mark.parametrize("name", ["ar", "sd", "sd_static_tree", "sjd_pac"])
def test_sync_guard_static_steps_read_nothing_and_iterations_read_once(tiny, monkeypatch, name):
    """0 host reads in all of AR's steps; at most 1 per iteration of a chain, a tree or SJD-PAC's window (whether
    every image has finished), at 1 and 3 images, after the first batch of a size has built its constants."""
    model, cfg = tiny
    static = build(cfg, model, name, "static")
    assert_static_reads(monkeypatch, static, ((PROMPTS[1:2], [0]), (PROMPTS, [1, 2, 3])),
                        model.num_image_tokens - 1 if name == "ar" else None, reverse=True)


def test_refilled_images_equal_their_lock_step_images(tiny):
    """5 prompts of different lengths through 2 rows, each row refilled as its image finishes (an EAGLE chain):
    every image has its lock-step tokens and statistics."""
    model, cfg = tiny
    decoder = build(cfg, model, "sd", "static", refill=True)
    prompts, seeds = [*PROMPTS, "a tree", "a cat on the sky"], [20, 21, 22, 23, 24]
    assert_refill_equals_lock_step(decoder, prompts, seeds, 2)


# -- a block and its keep, the prefill ------------------------------------------------------------------------
@pytest.mark.parametrize("config", MODELS)
@torch.inference_mode()
def test_static_blocks_equal_the_eager_blocks_across_row_ends(config):
    """On the float64 model ``static_forward`` over a ``RowEndKVCache`` gives ``forward_block``'s outputs over a
    ``LuminaCache`` (its block laid out on the host) for images of different lengths: a chain across a row end, a
    tree whose nodes at a row end have their end-of-row slots (visible to their descendants only), one token after
    a row end and the last position; ``keep`` of a prefix and of a tree path (with their end-of-row slots) leaves
    the cache holding what the eager one holds."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={config}", "model.device=cpu", "model.dtype=float64"])
    model = instantiate(cfg.model)
    prompts = PROMPTS[:2]
    eager, _ = model.prefill(prompts, extra_slots=8)
    static = model.static_cache(model.static_prefill(prompts, extra_slots=8)[0], levels=(1, 2, 1))
    assert isinstance(static, RowEndKVCache)

    def both(tokens, positions, tree=None):
        want = model.forward_block(eager, tokens, positions, tree)
        with model.decode_context():
            got = model.static_forward(static, tokens, positions, tree)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-9, atol=1e-9)

    gen = torch.Generator().manual_seed(0)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, model.codebook_size, shape, generator=gen)

    both(codes(2, 6), torch.arange(6).expand(2, -1))  # positions 0..5: the first row's end at 3
    eager.keep([3, 5])  # image 0 stops before the row end, image 1 after it
    static.keep(torch.tensor([3, 5]))
    # a tree of depth 2 at t − 1 = 3 and 5: node 0 the root, 1 and 2 its children, 3 a child of 2
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    both(codes(2, 4), torch.tensor([[3, 4, 4, 5], [5, 6, 6, 7]]), tree)
    index = torch.tensor([[0, 2, 3], [0, 2, 3]])  # the root and the path through node 2
    eager.keep([3, 3], index)
    static.keep(torch.tensor([3, 3]), index)
    both(codes(2, 1), torch.tensor([[6], [8]]))
    eager.keep(1)
    static.keep(1)
    both(codes(2, 3), torch.tensor([[7, 8, 9], [9, 10, 11]]))  # across the row ends at 7 and 11
    eager.keep([3, 3])
    static.keep(torch.tensor([3, 3]))
    both(codes(2, 2), torch.tensor([[10, 11], [12, 13]]))
    assert (static.lengths - static.prefix_len).tolist() == [n - eager.prefix_len for n in eager.kv.lengths]


@torch.inference_mode()
def test_the_static_prefill_pads_to_the_prompt_capacity_and_refuses_a_longer_prompt(tiny):
    """``static_prefill`` pads every batch to ``model.prompt_capacity`` (one cache capacity whatever the prompts)
    with the prefill's outputs unchanged, and returns the model-slot cache; a longer prompt is refused naming the
    key, and the eager path takes it."""
    model, _ = tiny
    eager, first = model.prefill(PROMPTS, extra_slots=8)
    static, out = model.static_prefill(PROMPTS, extra_slots=8)
    short, _ = model.static_prefill(PROMPTS[:1], extra_slots=8)
    assert static.max_len == short.max_len > eager.kv.max_len
    assert static.prefix_len == model.prompt_capacity and static.lengths == [model.prompt_capacity] * 3
    torch.testing.assert_close(out.logits, first.logits, rtol=1e-5, atol=1e-5)
    long = "a red cat " * 20
    with pytest.raises(ValueError, match=r"more than model.prompt_capacity=64.*set model.prompt_capacity=\d+"):
        model.static_prefill([PROMPTS[0], long], extra_slots=8)
    assert model.prefill([long], extra_slots=8)[0].prefix_len > model.prompt_capacity


# -- compiled whole on a CPU ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("config", MODELS)
@pytest.mark.parametrize("kind", ["ar", "chain", "sjd_pac"])
def test_static_steps_compile_whole_without_recompiling(config, kind):
    """The AR step, an EAGLE chain's step and SJD-PAC's window tree compile with ``fullgraph=True, dynamic=False``
    (a graph break raises) and are not recompiled across the positions of an image (the blocks with and without
    a row end), the accept outcomes of its iterations, or for a second batch of the same size with other prompt
    lengths (dynamo's ``error_on_recompile``); every image is complete. 15-40 s each on a CPU."""
    import torch._dynamo

    torch._dynamo.reset()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={config}", "model.device=cpu"])
    model = instantiate(cfg.model)
    model.compile = True  # the static step compiled whole on a CPU (the eager layers are not compiled)
    if kind == "sjd_pac":
        decoder = Decoder("sjd_pac", model, ExactRule(), draft_len=7, path="static", drafter=JacobiDrafter(
            model, init="random_uniform_q", carry="maximal", tree_width=2, tree_depth=3))
    else:
        drafter = None if kind == "ar" else EagleDrafter(model, head=EagleHead(model, init_seed=1))
        decoder = Decoder(kind, model, ExactRule(), draft_len=0 if drafter is None else 3, path="static",
                          drafter=drafter)
    assert decoder.static.mode == "compiled"
    assert decoder.static.step_name == {"sjd_pac": "jacobi_window"}.get(kind, kind)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts, seeds in ((PROMPTS[:2], [0, 1]), (PROMPTS[1:], [2, 3])):
            images = decoder.generate_batch(prompts, seeds)
            assert all(int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size for g in images)
            assert all(sum(g.stats.accepted_hist) == g.stats.iterations for g in images)
    assert decoder.static._workspaces[2][1].calls > 2


# -- exactness -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def enumerable():
    model = enumerable_emu3()
    assert model.grid == (2, 2) and model.codebook_size == 4
    return model, {prompt: exact_grid_probs(model, prompt) for prompt in EXACT_PROMPTS}


@pytest.mark.parametrize("n", [N_QUICK, pytest.param(N_FULL, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ar", "sd_eagle_chain", "sd_eagle_tree", "sd_eagle_dynamic_tree", "sjd", "sjd_pac"])
def test_static_lossless_decoders_are_exact_on_an_enumerable_emu3(enumerable, name, n):
    """Pearson chi-square of ``n`` static images per lossless decoder against the exact grid distribution of each
    prompt (module doc), in batches of ``BATCH`` mixing two prompts of different lengths. Seeds are fixed
    (0..n−1); the test fails when a p-value is below ``ALPHA`` = 1e-3, the false-alarm probability per prompt for
    a correct implementation and a random choice of seeds."""
    model, exact = enumerable
    decoder = static_lossless(model, chain=3)[name]
    assert decoder.static is not None
    counts = {prompt: torch.zeros(model.codebook_size ** model.num_image_tokens) for prompt in EXACT_PROMPTS}
    for start in range(0, n, BATCH):
        seeds = list(range(start, min(start + BATCH, n)))
        prompts = [EXACT_PROMPTS[s % 2] for s in seeds]
        for prompt, image in zip(prompts, decoder.generate_batch(prompts, seeds)):
            counts[prompt][grid_index(model, image.tokens)] += 1
    for prompt in EXACT_PROMPTS:
        assert counts[prompt][exact[prompt] == 0].sum() == 0, "an image outside the top-k support"
    pvalues = {prompt: chi_square_pvalue(counts[prompt], exact[prompt]) for prompt in EXACT_PROMPTS}
    assert min(pvalues.values()) > ALPHA, pvalues
