"""VVS (``baselines/vvs.py``): each step of partial verification skipping on hand-made inputs, then the decoder
end to end on the tiny random-weight LlamaGen: no target forward in a skipped round, the skipped tokens fed as an
untested prefix chain in the next forward, batch = alone, and no skipping = LANTERN token for token."""
from __future__ import annotations

import pytest
import torch

from baselines.lantern import Lantern
from baselines.vvs import (VVS, BlockPrefix, leaf_paths, leaf_weighted_children, path_similarity, stale_rows,
                           truncation, uniform_skip)
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.rng import Streams
from coolsd.types import Draft, TargetOutput
from tests.helpers import tiny_llamagen

SMALL = dict(top_k=2, depth=2, total_tokens=5)


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(dtype="float64")


def build(model, **options):
    drafter = EagleDrafter(model, head=EagleHead(model, prefix="last"))
    return VVS(name="vvs", model=model, draft_len=3, drafter=drafter, k=8, delta=0.2, tree="dynamic",
               dynamic_tree=SMALL, **options)


# -- when to skip ----------------------------------------------------------------------------------------------
def test_uniform_schedule_counts_steps_after_the_first_row_and_1024_never_skips():
    assert [s for s in range(13) if uniform_skip(s, 0, 5)] == [1, 6, 11]
    assert [s for s in range(13) if uniform_skip(s, 3, 5)] == [4, 9]  # offset by the first row's 3 rounds
    assert not any(uniform_skip(s, 0, 1024) for s in range(3000))


def test_no_skip_while_five_or_fewer_tokens_are_generated_and_the_first_row_offset(model):
    dec = build(model)  # the reference code: first-row offset 0, the step is the round index
    dec.begin_rounds(3)
    dec.rounds = [1, 1, 6]
    dec.features_held = [4, 4, 4]
    # t counts the committed tokens with the last one (the reference's root): generated = t - 1
    assert dec.eligible([6, 7, 7]) == [False, True, True]
    dec.rounds = [2, 5, 6]
    assert dec.eligible([20, 20, 20]) == [False, False, True]
    measured = build(model, first_row="measured")
    measured.begin_rounds(2)
    measured.features_held = [4, 4]
    width = model.grid[1]  # 8: the first row is complete once 8 tokens are generated
    measured.rounds = [1, 3]
    assert measured.eligible([width, width + 1]) == [False, False]  # image 1's row completes at round 3
    assert measured.first_row_rounds == [None, 3]
    measured.rounds = [4, 4]
    assert measured.eligible([width, width + 5]) == [False, True]  # step 4 − 3 = 1


def test_dynamic_never_skips_twice_in_a_row(model):
    dec = build(model, skip_policy="dynamic")
    dec.begin_rounds(2)
    dec.features_held = [3, 3]
    dec.last_skipped = [True, False]
    assert dec.eligible([30, 30]) == [False, True]


def test_path_similarity_is_the_depth_weighted_mean_pairwise_cosine():
    codebook = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [1.0, 1.0]])
    codes = torch.tensor([[[0, 1, 3], [2, 1, 0], [1, 3, 0]]])
    lengths = torch.tensor([[3, 2, 1]])
    everyone = torch.tensor([[True, True, True]])
    w = torch.tensor([1.0, 0.9, 0.81]) / 2.71
    cos01 = w[0] * 1 + w[1] * 1  # codes 0~2 parallel, 1~1; path 1 has ended at depth 3
    cos02 = w[0] * 0  # code 0 vs code 1 orthogonal; path 2 has ended at depth 2
    cos12 = w[0] * 0
    expected = (cos01 + cos02 + cos12) / 3
    got = path_similarity(codes, lengths, everyone, codebook, decay=0.9)
    assert torch.allclose(got, expected.reshape(1), atol=1e-6)
    # every other path (the code's candidates[::2]): paths 0 and 2, weights over the longer one's 3 depths
    alternate = torch.tensor([[True, False, True]])
    assert torch.allclose(path_similarity(codes, lengths, alternate, codebook), cos02.reshape(1), atol=1e-6)
    assert path_similarity(codes, lengths, torch.tensor([[True, False, False]]), codebook).item() == 0.0
    same = torch.tensor([[[3, 3], [3, 3]]])
    assert torch.allclose(path_similarity(same, torch.tensor([[2, 2]]), torch.tensor([[True, True]]), codebook),
                          torch.ones(1))


# -- what a skipped round commits --------------------------------------------------------------------------------
def hand_tree():
    """Root → a(0), b(1); a → c(2), d(3); c → e(4); node 5 invalid (deeper than the image allows)."""
    parents = torch.tensor([[-1, -1, 0, 0, 2, 4]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    return parents, valid, tokens


def test_leaf_paths_in_lexicographic_order_and_the_truncation():
    parents, valid, tokens = hand_tree()
    nodes, count = leaf_paths(parents, valid, depth=4)
    assert count.tolist() == [3]
    assert nodes[0, :3].tolist() == [[0, 2, 4, -1], [0, 3, -1, -1], [1, -1, -1, -1]]
    assert (nodes[0, 3:] == -1).all()
    lengths = (nodes >= 0).sum(-1)
    # mean length with the root ⌊(4 + 3 + 2) / 3⌋ = 3, minus 1: at most 2 drafts
    assert truncation(lengths, count, torch.tensor([0])).tolist() == [2]
    assert truncation(lengths, count, torch.tensor([2])).tolist() == [1]  # a path shorter than that: all of it
    assert truncation(lengths, torch.tensor([0]), torch.tensor([0])).tolist() == [0]


def test_a_skipped_token_is_drawn_from_the_leaf_weighted_children_of_its_parent():
    parents, valid, tokens = hand_tree()
    nodes, count = leaf_paths(parents, valid, depth=4)
    laws = leaf_weighted_children(parents, valid, tokens, nodes, count, nodes[:, 0], vocab=16)
    assert torch.allclose(laws[0, 0, [10, 11]], torch.tensor([2 / 3, 1 / 3]))  # a carries 2 of the 3 leaves
    assert torch.allclose(laws[0, 1, [12, 13]], torch.tensor([0.5, 0.5]))
    assert laws[0, 2, 14] == 1.0


def test_stale_features_are_the_last_ones_held_or_the_last_repeated():
    assert stale_rows(torch.tensor([2, 3]), torch.tensor([5, 5]), size=5, width=3).tolist() == [[3, 4, 4], [2, 3, 4]]
    # fewer held than asked (the reference's repeat of the last feature)
    assert stale_rows(torch.tensor([3]), torch.tensor([2]), size=5, width=3).tolist() == [[3, 4, 4]]


def armed(model, **options):
    """A VVS decoder whose single image is past the first rounds, with hand-set features and a cached p."""
    dec = build(model, **options)
    dec.begin_rounds(1)
    dec.rounds = [1]
    h = model.hidden_size
    dec.features = torch.arange(dec.held, dtype=torch.float64)[None, None, :, None].expand(
        model.num_streams, 1, dec.held, h).clone()
    dec.features_held = [dec.held]
    dec.last_p = torch.zeros(1, model.codebook_size, dtype=torch.float64)
    dec.last_p[0, 7] = 1.0
    return dec


def hand_draft(vocab):
    parents, valid, tokens = hand_tree()
    return Draft(tokens=tokens, q=torch.nn.functional.one_hot(tokens, vocab).float(), valid=valid,
                 forwards=[1], parents=parents)


@pytest.mark.parametrize("bonus", ["reference_code", "reuse_logits"])
def test_a_skip_commits_a_truncated_random_path_and_feeds_the_drafter_stale_features(model, bonus):
    dec = armed(model, skip_bonus=bonus)
    draft = hand_draft(model.codebook_size)
    t_dev = torch.tensor([20])
    skips = dec.plan_skips(draft, [20], t_dev, Streams([0], "cpu"))
    assert skips is not None and skips.images == (True,)
    verdict = skips.verdict
    n = int(verdict.num_accepted)
    path = verdict.path[0, :n].tolist()
    committed = [int(draft.tokens[0, j]) for j in path] + [int(verdict.next_token)]
    a = n + 1 - (bonus == "reuse_logits")  # drafts of the path committed
    assert committed[:a] in ([10, 12], [10, 13], [11])  # a prefix of a leaf path, truncated to at most 2 drafts
    if bonus == "reuse_logits":
        assert committed[-1] == 7  # the next token comes from the previous verification's cached p
    # the drafter reads the last n + 1 held features (values = buffer slot) at the rows of the verdict
    rows = [0] + [j + 1 for j in path]
    held = dec.held
    assert skips.hidden[0, 0, rows, 0].tolist() == list(range(held - n - 1, held))


def test_the_prefix_chain_is_causal_seen_by_every_node_and_kept_in_front():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0]])
    prefix = BlockPrefix.of(tokens, [5, 4], [2, 1])
    assert prefix.tokens.tolist() == [[7, 8], [0, 3]] and prefix.positions.tolist() == [[2, 3], [3, 2]]
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    inputs, positions, mask = prefix.prepend(torch.tensor([[9, 1, 2], [4, 1, 2]]), torch.tensor([[4, 5, 5],
                                                                                                [3, 4, 4]]), tree)
    assert inputs.tolist() == [[7, 8, 9, 1, 2], [0, 3, 4, 1, 2]]
    assert mask[0].long().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                       [1, 1, 1, 0, 1]]
    assert mask[1].long().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0],
                                       [0, 1, 1, 0, 1]]  # the padding slot is seen by nobody
    kept, index = prefix.keep([2, 1], torch.tensor([[0, 3, 0], [0, 2, 0]]))
    assert kept == [4, 2]
    assert index[0, :4].tolist() == [0, 1, 2, 5] and index[1, :2].tolist() == [1, 2]
    out = TargetOutput(logits=torch.arange(5.0).view(1, 1, 5, 1).expand(1, 2, 5, 1), hidden=torch.zeros(1, 2, 5, 1))
    before, block = prefix.split(out)
    assert before.logits.shape[2] == 2 and block.logits[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]


# -- end to end on the tiny LlamaGen ------------------------------------------------------------------------------
class Spy:
    """Records every target forward's inputs (batch, width) and tokens."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.real = model.forward_block

    def __call__(self, cache, tokens, positions, tree_mask=None):
        self.calls.append((tokens.clone(), positions.clone()))
        return self.real(cache, tokens, positions, tree_mask)


def test_skipped_rounds_make_no_forward_and_the_next_forward_feeds_them_untested(model, monkeypatch):
    dec = build(model, skip_interval=3)
    spy = Spy(model)
    monkeypatch.setattr(model, "forward_block", spy)
    prefixes = []
    real = dec.block_prefix

    def block_prefix(tokens, t):
        prefix = real(tokens, t)
        prefixes.append(0 if prefix is None else prefix.counts[0])
        return prefix

    monkeypatch.setattr(dec, "block_prefix", block_prefix)
    gen = dec.generate("3", 5)
    stats = gen.stats
    assert stats.skipped_rounds > 0 and stats.skipped_tokens >= stats.skipped_rounds
    assert len(spy.calls) == stats.iterations == stats.target_forwards - 1  # no forward for a skipped round
    committed = sum((k + 1) * c for k, c in enumerate(stats.accepted_hist))
    assert committed == model.num_image_tokens - 1
    # the forward after a skip starts with a prefix chain: the skipped round's committed tokens at their own
    # positions, which are the final image's (never replaced by a test)
    assert len(prefixes) == len(spy.calls)  # block_prefix is asked once per forward, right before it
    chains = [(c, tok, pos) for c, (tok, pos) in zip(prefixes, spy.calls) if c]
    assert len(chains) == stats.skipped_rounds  # every skip is followed by a verified round here
    for c, tok, pos in chains:
        assert torch.equal(tok[0, :c], gen.tokens[pos[0, :c]])
        assert pos[0, :c].tolist() == list(range(int(pos[0, 0]), int(pos[0, 0]) + c))
    # the TV counts one step per skipped token besides the tests of the verified rounds
    assert stats.tv_steps >= stats.skipped_tokens and stats.tv_sum > 0


def test_without_skips_vvs_is_lantern_token_for_token(model):
    drafter = EagleDrafter(model, head=EagleHead(model, prefix="last"))
    common = dict(model=model, draft_len=3, drafter=drafter, k=8, delta=0.2, tree="dynamic", dynamic_tree=SMALL)
    vvs = VVS(name="vvs", skip_interval=1024, **common)
    lantern = Lantern(name="lantern", **common)
    for prompt, seed in (("1", 0), ("4", 9)):
        a, b = vvs.generate(prompt, seed), lantern.generate(prompt, seed)
        assert torch.equal(a.tokens, b.tokens)
        assert a.stats.accepted_hist == b.stats.accepted_hist and a.stats.skipped_rounds == 0
        assert a.stats.tv_sum == b.stats.tv_sum


@pytest.mark.parametrize("options", [dict(skip_interval=3),
                                     dict(skip_policy="dynamic", similarity_threshold=0.0, first_row="measured",
                                          skip_bonus="reuse_logits")])
def test_an_image_in_a_batch_equals_itself_decoded_alone(model, options):
    """Images of other lengths skip in other rounds: a mixed round (some skip, some verify) and a round where all
    skip both occur."""
    dec = build(model, **options)
    prompts, seeds = ["0", "7", "2"], [0, 1, 2]
    batch = dec.generate_batch(prompts, seeds)
    assert any(g.stats.skipped_rounds for g in batch)
    for i in range(3):
        alone = dec.generate(prompts[i], seeds[i])
        assert torch.equal(alone.tokens, batch[i].tokens), i
        assert alone.stats.accepted_hist == batch[i].stats.accepted_hist, i
        assert alone.stats.tv_sum == pytest.approx(batch[i].stats.tv_sum, abs=1e-9), i


def test_vvs_refuses_a_chain_and_a_drafter_without_features(model):
    from coolsd.drafters.model_drafter import ModelDrafter

    with pytest.raises(ValueError, match="decoder.tree=dynamic"):
        VVS(name="vvs", model=model, draft_len=3, drafter=EagleDrafter(model, head=EagleHead(model)), k=8, tree=None)
    with pytest.raises(ValueError, match="skip_interval"):
        build(model, skip_interval=1)
    with pytest.raises(ValueError, match="stale target features"):
        VVS(name="vvs", model=model, draft_len=3, drafter=ModelDrafter(model, draft_model=model), k=8,
            tree="dynamic", dynamic_tree=SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["janus", "lumina", "emu3"])
def test_vvs_runs_on_janus_pro_and_lumina_mgpt_batch_equal_alone(which):
    """The harness's own extension (no reference numbers): the tiny random-weight Janus-Pro and Lumina-mGPT
    (Lumina's and Emu3's end-of-row slots inside the prefix chain) skip rounds, and a batch equals its images alone."""
    from tests.test_emu3 import tiny_emu3
    from tests.test_janus import tiny_janus
    from tests.test_lumina import tiny_lumina

    model = {"janus": tiny_janus, "lumina": tiny_lumina, "emu3": tiny_emu3}[which]()
    dec = build(model, skip_interval=3)
    prompts = ["a cat", "a dog"]
    batch = dec.generate_batch(prompts, [0, 1])
    assert any(g.stats.skipped_rounds for g in batch)
    for i in range(2):
        assert torch.equal(dec.generate(prompts[i], i).tokens, batch[i].tokens), i


def test_preflight_names_a_bad_vvs_option_before_the_model_loads():
    from hydra import compose, initialize_config_dir

    from eval.run.preflight import DecoderConfigError, validate_decoders
    from tests.helpers import CONFIGS

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decoder=vvs", "decoder.skip_policy=sometimes"])
    with pytest.raises(DecoderConfigError, match=r"decoder.skip_policy must be one of \['uniform', 'dynamic'\]"):
        validate_decoders(cfg, {"vvs": cfg.decoder})
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decoder=vvs"])
    assert validate_decoders(cfg, {"vvs": cfg.decoder}) == []


@pytest.mark.parametrize("experiment,model,delta,interval", [("table_vvs_llamagen", "llamagen_t2i_512", 0.1, 2),
                                                             ("table_vvs_llamagen_256", "llamagen_t2i_256", 0.2, 4)])
def test_the_published_rows_presets_use_the_paper_notes_settings(experiment, model, delta, interval):
    """Issue 60: the VVS tables' rows at a note on the paper's settings (stage II: interval 2, δ 0.1; stage I:
    interval 4, δ 0.2; dynamic: threshold 0.65), LANTERN at the same δ and k = 1000; the released script's interval 5
    and the earlier threshold 0.70 stay as named rows."""
    from hydra import compose, initialize_config_dir

    from tests.helpers import CONFIGS

    def row(name, *extra):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name="config", overrides=[f"experiment={experiment}", f"row={name}", *extra])

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = compose(config_name="config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    assert base.hydra.sweeper.params.row == "lantern_eagle2,vvs_uniform,vvs_dynamic"
    uniform, dynamic, lantern = row("vvs_uniform"), row("vvs_dynamic"), row("lantern_eagle2")
    tokens = (int(model.split("_")[-1]) // 16) ** 2  # 16-px codes: 256 px -> 16x16, 512 px -> 32x32
    assert uniform.model._target_.endswith("LlamaGenT2I") and uniform.model.gpt.block_size == tokens
    assert (uniform.decoder.skip_policy, uniform.decoder.skip_interval, uniform.decoder.delta) == ("uniform", interval,
                                                                                                 delta)
    assert (dynamic.decoder.skip_policy, dynamic.decoder.similarity_threshold, dynamic.decoder.delta) == (
        "dynamic", 0.65, delta)
    assert lantern.decoder.name == "lantern" and lantern.decoder.delta == delta and lantern.decoder.k == 1000
    assert uniform.decoder.k == dynamic.decoder.k == 1000 and uniform.decoder.tree == "dynamic"
    script = row("vvs_uniform5", "vvs_lantern_delta=0.2")
    assert (script.decoder.skip_interval, script.decoder.delta) == (5, 0.2)
    assert row("vvs_dynamic070").decoder.similarity_threshold == 0.70
