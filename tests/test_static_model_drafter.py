"""The static decode path (``decoder.path=static``) with a model drafter (``coolsd.drafters.model_drafter``: a draft
AR model of the target's codebook, the tiny models' default drafter, here the layer-skip copy of ``drafter=tiny``):
the eager path's tokens and statistics for chains and trees, no host read inside a step, a whole-step compile, refilled
rows as lock-step, storages kept across calls (capture-safe), exactness, and the refusals of draft models without a
static form.

The equalities are those of ``tests/test_static_path.py``, on the tiny models in float32, uncompiled, where a
forward's bits do not depend on its batch neighbours (``invariance_property``: bitwise where the start-up self-check
passes, else at most one image may differ).

Statistical test (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the probability that a correct
implementation fails for a random choice of seeds, per test and per prompt): ``test_static_model_drafter_is_exact``,
the chi-square test of ``tests/test_static_path.py`` (the enumerable tiny LlamaGen, 4 codes on a 2 x 2 grid) for SD
with a model drafter's chain and static tree on the static path.
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import tests.test_static_path as static_tests
from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.base import ImageARModel
from coolsd.models.llamagen import LlamaGen, layer_skip_copy
from coolsd.static.capture import stable_storage
from tests.helpers import CONFIGS, invariance_property, tiny_llamagen
from tests.test_refill import assert_refill_equals_lock_step, runner_calls
from tests.test_static_capture import BATCHES, ledger_of
from tests.test_static_path import ALPHA, BATCH, EXACT_PROMPTS, N_QUICK, guarded_decode, same_generation

PROMPTS = ["one", "two", "three", "four"]
SMALL_DYNAMIC = {"top_k": 3, "depth": 3, "total_tokens": 10}
#: label -> (suite decoder, overrides): the tiny model's suite with its layer-skip model drafter; chains (SD, COOL-SD,
#: LANTERN with decoder.tree=null), static trees (SD's, LANTERN++'s default) and EAGLE-2 trees (SD's, small;
#: LANTERN's default, top_k 10 and 58 nodes, only in the -m slow pass)
CASES = {"sd": ("sd", {}), "coolsd": ("coolsd", {}), "lantern_chain": ("lantern", {"tree": None}),
         "sd_static_tree": ("sd", {"tree": "mc_sim_7b_63"}), "lantern_pp": ("lantern_pp", {}),
         "sd_dynamic_tree": ("sd", {"tree": "dynamic", "dynamic_tree": SMALL_DYNAMIC}), "lantern": ("lantern", {})}
SLOW = {"lantern"}


def compose_tiny(model: str = "tiny"):
    """A tiny model (float32, on the CPU) and its suite's configs, composed as ``run.py`` composes them (its
    drafter: ``configs/drafter/<model>.yaml``, a ``ModelDrafter``)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", "model.device=cpu", "model.dtype=float32"])
    return instantiate(cfg.model), cfg


@pytest.fixture(scope="module")
def tiny_suite():
    return compose_tiny()


def build(cfg, model, label: str, path: str) -> Decoder:
    """A decoder of ``CASES`` on ``path``, its drafter the suite's model drafter."""
    name, overrides = CASES.get(label, (label, {}))
    node = OmegaConf.to_container(cfg.suite[name], resolve=True)
    node.update(overrides, path=path)
    decoder = instantiate(node, model=model)
    assert isinstance(decoder.drafter, ModelDrafter)
    return decoder


def assert_same(model, pairs) -> None:
    bitwise = invariance_property(model) == "bitwise"
    differ = [i for i, (a, b) in enumerate(pairs) if not same_generation(a, b, 1e-12 if bitwise else 1e-5)]
    assert not differ if bitwise else len(differ) <= 1, f"static != eager for images {differ}"


@pytest.mark.parametrize("label", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_static_model_drafter_gives_the_eager_tokens_and_statistics(tiny_suite, label):
    """On the tiny model in float32 SD, COOL-SD, LANTERN and LANTERN++ with the layer-skip model drafter (chains,
    static trees, EAGLE-2 trees) give the eager decoder's tokens and statistics (iterations, accepted-length
    histogram, forwards, TV) on the static path, in a batch of 3 whose images finish at different iterations and
    alone."""
    model, cfg = tiny_suite
    eager, static = build(cfg, model, label, "eager"), build(cfg, model, label, "static")
    assert static.static.step_name == ("chain" if static.tree is None else "tree")
    seeds = [3, 4, 5]
    pairs = list(zip(eager.generate_batch(PROMPTS[:3], seeds), static.generate_batch(PROMPTS[:3], seeds)))
    assert len({b.stats.iterations for _, b in pairs}) > 1  # the batch's images finish apart
    pairs.append((eager.generate(PROMPTS[3], 7), static.generate(PROMPTS[3], 7)))
    assert_same(model, pairs)
    assert all(b.stats.batch_size == (3 if i < 3 else 1) for i, (_, b) in enumerate(pairs))


#: the other tiny models whose adapters have a static forward, each with its layer-skip model drafter (Janus-Pro,
#: about 6 s, in the -m slow pass)
OTHER_TINY = ["llamagen_t2i_tiny", "lumina_tiny", "emu3_tiny", pytest.param("janus_tiny", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", OTHER_TINY)
def test_static_model_drafter_on_the_other_tiny_models(name):
    """The same on the text-to-image tiny models (the draft model's own prefill of padded captions or prompts of
    their own lengths; a draft model whose blocks add end-of-row slots, rolled back by the lengths it recorded):
    SD's chain, a batch of 3 and one image alone."""
    model, cfg = compose_tiny(name)
    assert_same_on_the_tiny_model(model, cfg, "sd")


def assert_same_on_the_tiny_model(model, cfg, label: str) -> None:
    """Static == eager tokens and statistics for a decoder of ``CASES`` on a text-to-image tiny model, a batch
    of 3 and one image alone."""
    eager, static = build(cfg, model, label, "eager"), build(cfg, model, label, "static")
    prompts = ["a red cat", "a dog on a very long road in the rain", "blue", "a house"]
    pairs = list(zip(eager.generate_batch(prompts[:3], [0, 1, 2]), static.generate_batch(prompts[:3], [0, 1, 2])))
    pairs.append((eager.generate(prompts[3], 3), static.generate(prompts[3], 3)))
    assert_same(model, pairs)
    assert all(b.stats.batch_size == (3 if i < 3 else 1) for i, (_, b) in enumerate(pairs))


@pytest.fixture(scope="module")
def row_end_suites():
    """The tiny models whose draft model adds end-of-row slots to its blocks (Lumina-mGPT's, Emu3's)."""
    return {name: compose_tiny(name) for name in ("lumina_tiny", "emu3_tiny")}


@pytest.mark.parametrize("label", ["sd_static_tree", "lantern"])
@pytest.mark.parametrize("name", ["lumina_tiny", "emu3_tiny"])
def test_static_model_drafter_trees_over_end_of_row_slots(row_end_suites, name, label):
    """Trees over a draft model whose blocks add end-of-row slots (each level's mask carried over to the model
    slots of the levels before it, ``RowEndKVCache.tree_mask``): SD's static tree and LANTERN's EAGLE-2 tree
    give the eager decoder's tokens and statistics on the static path, a batch of 3 and one image alone."""
    model, cfg = row_end_suites[name]
    assert build(cfg, model, label, "static").static.step_name == "tree"
    assert_same_on_the_tiny_model(model, cfg, label)


def test_sync_guard_model_drafter_tree_over_end_of_row_slots(row_end_suites, monkeypatch):
    """At most 1 host read per iteration of a static tree over a draft model with end-of-row slots."""
    model, cfg = row_end_suites["lumina_tiny"]
    static = build(cfg, model, "sd_static_tree", "static")
    prompts, seeds = ["a red cat", "blue"], [1, 2]
    static.generate_batch(prompts, seeds)
    guard, calls = guarded_decode(monkeypatch, static, prompts, [s + 10 for s in seeds])
    monkeypatch.undo()
    assert guard.total <= calls and set(guard.reads) <= {"__bool__"}, guard.where[:3]


@pytest.mark.parametrize("label", ["sd", "sd_static_tree", "sd_dynamic_tree"])
def test_sync_guard_model_drafter_steps_read_once_per_iteration(tiny_suite, monkeypatch, label):
    """At most 1 host read per iteration of a model drafter's chain or tree (whether every image has finished),
    at batch 1 and 3, after the first batch of a size has built its constants."""
    model, cfg = tiny_suite
    static = build(cfg, model, label, "static")
    for prompts, seeds in ((PROMPTS[:1], [0]), (PROMPTS[:3], [1, 2, 3])):
        static.generate_batch(prompts, seeds)
        guard, calls = guarded_decode(monkeypatch, static, prompts, [s + 10 for s in seeds])
        monkeypatch.undo()
        assert guard.total <= calls and set(guard.reads) <= {"__bool__"}, guard.where[:3]


@pytest.mark.slow
def test_static_model_drafter_chain_compiles_whole_without_recompiling():
    """The chain step with a model drafter compiles with ``fullgraph=True, dynamic=False`` (a graph break raises)
    and is not recompiled across the positions of an image, the accept outcomes of its iterations, or for a second
    batch of the same size (dynamo's ``error_on_recompile``); its tokens are those of the eager path (an uncompiled
    twin of the model)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, twin = tiny_llamagen(dtype="float32"), tiny_llamagen(dtype="float32")
    model.compile = True  # model.compile=true: the static step is compiled whole on a CPU

    def decoder(m: LlamaGen, path: str) -> Decoder:
        return Decoder("sd", m, ExactRule(), draft_len=3, path=path, drafter=ModelDrafter(m, layer_skip_copy(m, 1)))

    static, eager = decoder(model, "static"), decoder(twin, "eager")
    assert static.static.mode == "compiled" and static.static.step_name == "chain"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seeds in ([0, 1], [2, 3]):
            got = static.generate_batch(["one", "two"], seeds)
            want = eager.generate_batch(["one", "two"], seeds)
            assert all(torch.equal(g.tokens, w.tokens) for g, w in zip(got, want))
            assert all(sum(g.stats.accepted_hist) == g.stats.iterations for g in got)
    assert static.static._workspaces[2][1].calls > 2


@pytest.mark.parametrize("tree", [None, pytest.param("mc_sim_7b_63", marks=pytest.mark.slow)])
def test_static_model_drafter_steps_keep_every_storage(tiny_suite, monkeypatch, tree):
    """Capture is safe (``tests/test_static_capture.py``): every tensor a step with a model drafter reads or writes
    outside itself (the draft model's cache and pending buffers included) keeps its storage across the iterations
    of a batch and across batches of one size."""
    model, _ = tiny_suite
    decoder = Decoder("sd", model, ExactRule(), draft_len=3, path="static", tree=tree,
                      drafter=ModelDrafter(model, layer_skip_copy(model, 1)))
    calls = ledger_of(monkeypatch, decoder, BATCHES)
    assert len(calls) > 10 and stable_storage(calls) is None, stable_storage(calls)


@pytest.mark.parametrize("label", ["sd", "sd_static_tree"])
def test_static_model_drafter_refilled_images_equal_lock_step(tiny_suite, label):
    """7 prompts through 3 rows, each row refilled as its image finishes (the draft model's prefill of the new
    prompt copied into its cache rows): every image has its lock-step tokens and statistics, in fewer step calls."""
    model, cfg = tiny_suite
    decoder = build(cfg, model, label, "static")
    prompts, seeds = ["one", "two", "three", "four", "five", "six", "seven"], list(range(20, 27))
    decoder.generate_batch(prompts[:3], [0, 1, 2])  # builds the width's workspace and constants
    before = runner_calls(decoder)
    middle = assert_refill_equals_lock_step(decoder, prompts, seeds, 3, lambda: runner_calls(decoder))
    assert runner_calls(decoder) - middle < middle - before


@pytest.fixture(scope="module")
def enumerable():
    """The enumerable tiny LlamaGen and each prompt's exact grid distribution (``tests/test_static_path.py``)."""
    model = static_tests.enumerable_llamagen()
    return model, {prompt: static_tests.exact_grid_probs(model, prompt) for prompt in EXACT_PROMPTS}


@pytest.mark.parametrize("tree", [None, "mc_sim_7b_63"])
def test_static_model_drafter_is_exact(enumerable, tree):
    """Pearson chi-square of ``N_QUICK`` images of static SD with a model drafter (the layer-skip copy, a chain of
    2 or the EAGLE-1 static tree cut by the grid's end) against the exact grid distribution of each prompt."""
    model, exact = enumerable
    decoder = Decoder("sd", model, ExactRule(), draft_len=2, path="static", tree=tree,
                      drafter=ModelDrafter(model, layer_skip_copy(model, 1)))
    pvalues = static_tests.grid_pvalues(decoder, model, exact, N_QUICK, BATCH)
    assert min(pvalues.values()) > ALPHA, pvalues


# -- the refusals ----------------------------------------------------------------------------------------------
class EagerOnly(LlamaGen):
    """A LlamaGen without a static forward (as the adapters that place structural tokens on the host)."""

    static_forward = ImageARModel.static_forward


def test_static_path_refuses_a_draft_model_without_a_static_forward(tiny_model):
    """A model drafter runs on the static path only where its draft model has a static forward, and in the
    target's attention kernel; otherwise the decoder is refused when built, naming why and the eager path."""
    assert ModelDrafter(tiny_model, layer_skip_copy(tiny_model, 1)).static_path
    draft = layer_skip_copy(tiny_model, 1)
    draft.__class__ = EagerOnly
    with pytest.raises(ValueError, match=r"decoder.path=static.*ModelDrafter.*draft model \(EagerOnly\) has no "
                                         r"static forward.*decoder.path=eager"):
        Decoder("sd", tiny_model, ExactRule(), draft_len=2, path="static", drafter=ModelDrafter(tiny_model, draft))
    other = layer_skip_copy(tiny_model, 1)
    other.attention_kernel = "matmul"  # its own runtime (the target's stays math)
    with pytest.raises(ValueError, match=r"attention kernel \(matmul\) is not the target's \(math\)"):
        Decoder("sd", tiny_model, ExactRule(), draft_len=2, path="static", drafter=ModelDrafter(tiny_model, other))
    assert Decoder("sd", tiny_model, ExactRule(), draft_len=2, drafter=ModelDrafter(tiny_model, draft)).static is None


def test_static_begin_needs_the_draft_models_prefill(tiny_model):
    """``static_begin`` and ``static_refill`` take the draft model's prefill of ``static_prefill`` (the static loop
    calls it first, with the prompts): called without it, they say so."""
    drafter = ModelDrafter(tiny_model, layer_skip_copy(tiny_model, 1))
    first = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="static_prefill"):
        drafter.static_begin(None, first, None, 3)
    drafter.static_prefill(["one"], 3, None)
    with pytest.raises(RuntimeError, match="static_prefill"):  # prefilled for one image, not two
        drafter.static_begin(None, first, None, 3)


@pytest.mark.slow  # run.py end to end (about 10 s)
def test_a_tiny_run_decodes_with_its_model_drafter_on_the_static_path(tmp_path):
    """``python run.py model=tiny decoder=sd decoder.path=static``: the tiny model's default drafter (the layer-skip
    model drafter) runs on the static path, which run.json records."""
    import json

    from tests.test_run import run_py

    run_py("model=tiny", "decoder=sd", "decoder.path=static", "eval.num_prompts=2", "eval.threads=1", "logger=none",
           f"hydra.run.dir={tmp_path}")
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["decode_path"] == "static" and set(run["per_decoder"]) == {"ar", "sd"}
    assert run["per_decoder"]["sd"]["mean_accepted_length"] > 1
