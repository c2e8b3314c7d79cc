"""PathRelax (``baselines/pathrelax.py``): the longest-path verification on hand-made trees and on the authors' own
verdicts, one path = SJD token for token, the loss measured, batched = alone on every model, the static path, the
configs and the run beside SJD.

Statistical test (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the false-alarm probability:
the probability that an exact decoder fails for a random choice of seeds, per test and per prompt):

* ``test_pathrelax_is_not_exact_and_its_gap_is_measured``: on ``tests.test_jacobi.lookup()`` (3 codes on a 1×5 grid,
  243 sequences per prompt, known exactly), 2 paths of 3 slots (draft_len 6), ``N_LOSSY`` images (seeds 0..N−1,
  prompts alternating) at batch 16; the first ``N_ALONE`` of them decoded alone too (the same tokens). Pearson χ² per
  prompt against the exact sequence distribution must reject at ``ALPHA``, and the sample-splitting lower bound on
  the TV (``tests.test_sv``) must have its 95 % interval above 0. The numbers are printed (``pytest -s``) and quoted
  in ``docs/jacobi-and-spatial.md``. (At 2,000 images the χ² test did not reject on one prompt, p = 0.08: the gap is
  a few hundredths of TV, and one slot per path is exact, see ``docs/algorithms.md``.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from baselines.pathrelax import PathJacobiDrafter, PathRelax, PathVerifier, path_layout
from coolsd.acceptance import vanilla_residual
from coolsd.decoding import Decoder
from coolsd.types import Draft
from tests.helpers import CONFIGS
from tests.test_jacobi import PROMPTS, lookup
from tests.test_sv import ALPHA, MODELS, assert_departs, batched_equals_alone_without_tv, sequences

N_LOSSY = 8000
N_ALONE = 400
FIXTURES = Path(__file__).resolve().parent / "golden" / "pathrelax_acceptance.json"


def pathrelax(model, paths: int = 2, depth: int = 3, **drafter) -> PathRelax:
    return PathRelax("pathrelax", model, ExactRule(), paths * depth,
                     lambda target: PathJacobiDrafter(target, paths=paths, **drafter))


# -- the verification on hand-made trees -----------------------------------------------------------------------
def tree(tokens, q, p, u, valid=None, paths=2):
    """One image's K-path draft: ``tokens`` (K, D), ``q`` (K, D, V), the target rows ``p`` (M + 1, V), ``u`` (K, D)."""
    tokens, q = torch.tensor(tokens), torch.tensor(q, dtype=torch.float64)
    k, d = tokens.shape
    valid = torch.ones(k, d, dtype=torch.bool) if valid is None else torch.tensor(valid)
    parents = path_layout(k, d, torch.device("cpu"))[0]
    draft = Draft(tokens=tokens.reshape(1, -1), q=q.reshape(1, k * d, -1), valid=valid.reshape(1, -1), forwards=[0],
                  parents=parents[None] if k > 1 else None)
    return draft, torch.tensor(p, dtype=torch.float64)[None], torch.tensor(u, dtype=torch.float64).reshape(1, -1)


ONE_HOT = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
# rows of p: the root's output, then path 0's two nodes, then path 1's two nodes
P = [[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6], [0.6, 0.2, 0.2]]


def test_the_longest_path_wins_and_its_residual_or_bonus_is_drawn():
    # path 0 drafts (0, 1) with one-hot q: p(0 | root) = 0.5, p(1 | 0) = 0.8; path 1 drafts (1, 2): 0.3, then 0.6
    q = [[ONE_HOT[0], ONE_HOT[1]], [ONE_HOT[1], ONE_HOT[2]]]
    draft, p, u = tree([[0, 1], [1, 2]], q, P, [[0.4, 0.9], [0.2, 0.5]])
    verifier = PathVerifier(2)
    counts = verifier.counts(ExactRule(), p, draft, u)
    assert counts.tolist() == [[1, 2]]  # path 0 fails at its 2nd node (0.9 > 0.8), path 1 passes whole
    verdict = verifier(ExactRule(), p, draft, u, torch.tensor([0.5], dtype=torch.float64))
    assert verdict.num_accepted.tolist() == [2] and verdict.path.tolist() == [[2, 3]]
    # the bonus after path 1's last node (row 4: [0.6, 0.2, 0.2]) at u = 0.5 is code 0
    assert verdict.next_token.tolist() == [0] and verdict.tests == ()
    # a tie (both fail at their first node) goes to path 0; the next token comes from path 0's residual
    draft, p, u = tree([[0, 1], [1, 2]], q, P, [[0.7, 0.0], [0.9, 0.0]])
    residual = vanilla_residual(p[:, 0], torch.tensor([ONE_HOT[0]], dtype=torch.float64))  # [0, 0.6, 0.4]
    assert torch.allclose(residual, torch.tensor([[0.0, 0.6, 0.4]], dtype=torch.float64))
    for u_sample, token in ((0.5, 1), (0.7, 2)):
        verdict = verifier(ExactRule(), p, draft, u, torch.tensor([u_sample], dtype=torch.float64))
        assert verdict.num_accepted.tolist() == [0] and verdict.next_token.tolist() == [token]
        assert verdict.path[0, 0].item() == 0  # path 0's first node (the verdict path's first n are used)


def test_undrafted_slots_are_never_tested_and_an_empty_tree_draws_from_the_root():
    q = [[ONE_HOT[0], ONE_HOT[1]], [ONE_HOT[1], ONE_HOT[2]]]
    # one slot per path fits: both first nodes pass, so the bonus comes after the winner's (path 0's) first node
    draft, p, u = tree([[0, 1], [1, 2]], q, P, [[0.0, 0.0], [0.0, 0.0]], valid=[[True, False], [True, False]])
    verdict = PathVerifier(2)(ExactRule(), p, draft, u, torch.tensor([0.95], dtype=torch.float64))
    assert verdict.num_accepted.tolist() == [1] and verdict.next_token.tolist() == [2]  # row 1 [0.1, 0.8, 0.1]
    empty = Draft(tokens=torch.zeros(1, 0, dtype=torch.long), q=torch.zeros(1, 0, 3), valid=torch.zeros(1, 0,
                  dtype=torch.bool), forwards=[0])
    verdict = PathVerifier(2)(ExactRule(), p[:, :1], empty, u[:, :0], torch.tensor([0.6], dtype=torch.float64))
    assert verdict.num_accepted.tolist() == [0] and verdict.next_token.tolist() == [1]


# -- against the authors' acceptance ---------------------------------------------------------------------------
def test_the_verification_matches_the_authors_verdicts():
    """``tests/golden/pathrelax_acceptance.json``: the authors' ``SpeculativeSampler`` (PathSpec@8a3df48,
    ``scheduler/tree_until.py``) run on shared drafts, target rows and uniforms, per path as their
    ``prefix_matching_next_tree_tokens`` calls it (``python -m eval.bench.peers.pathrelax fixtures``). Ours must give
    every path's first-misaligned index, the chosen path and the residual their correction token was drawn from."""
    record = json.loads(FIXTURES.read_text())
    assert record["source"]["repo"] == "Haodong-Lei-Ray/PathSpec"
    assert record["source"]["commit"].startswith("8a3df48")
    cases = record["cases"]
    assert len(cases) >= 20
    verifier_by_paths: dict[int, PathVerifier] = {}
    kinds = {"tie": 0, "all_accepted": 0, "all_rejected_first": 0, "undefined": 0}
    for case in cases:
        tokens = torch.tensor(case["draft_tokens"])  # (K, L + 1), column 0 the root
        q = torch.tensor(case["draft_prob"], dtype=torch.float64)  # (K, L + 1, V)
        target = torch.tensor(case["target_prob"], dtype=torch.float64)  # (K, L + 1, V): column i after node i
        k, width = tokens.shape
        depth = width - 1
        # our p: the root's output once, then every path's nodes (node j's output at row j + 1)
        p = torch.cat([target[:1, 0], target[:, 1:].reshape(k * depth, -1)])[None]
        draft = Draft(tokens=tokens[:, 1:].reshape(1, -1), q=q[:, 1:].reshape(1, k * depth, -1),
                      valid=torch.ones(1, k * depth, dtype=torch.bool), forwards=[0],
                      parents=path_layout(k, depth, torch.device("cpu"))[0][None] if k > 1 else None)
        u = torch.tensor(case["u"], dtype=torch.float64).reshape(1, -1)
        # a node whose token has q = 0 and p = 0: their ratio 0/0 is NaN, which fails their test; ours is 1 where
        # q = 0 (such a token is never drafted: q is the distribution it was drawn from, so no real draft has it),
        # so a uniform of 1 there makes ours reject as theirs does; every other node is compared as it is
        x = draft.tokens[..., None]
        px = p[:, path_layout(k, depth, torch.device("cpu"))[1].reshape(-1)].gather(-1, x)[..., 0]
        undefined = (draft.q.gather(-1, x)[..., 0] == 0) & (px == 0)
        u = torch.where(undefined, 1.0, u)
        kinds["undefined"] += int(undefined.any())
        verifier = verifier_by_paths.setdefault(k, PathVerifier(k))
        counts = verifier.counts(ExactRule(), p, draft, u)[0]
        # their first-misaligned index of a path is its passing prefix + 1 (L + 1 when it passes whole)
        assert (counts + 1).tolist() == case["first_misaligned"], case.get("name")
        best = int(counts.argmax())
        assert best == case["chosen_path"] and int(counts[best]) + 1 == case["matched_num"], case.get("name")
        residual = case["residual"]
        n = int(counts[best])
        if residual is None:
            assert n == depth
        else:
            at = best * depth + n
            ours = vanilla_residual(p[:, path_layout(k, depth, torch.device("cpu"))[1].reshape(-1)[at]],
                                    draft.q[:, at])
            assert torch.allclose(ours[0], torch.tensor(residual, dtype=torch.float64), atol=2e-6), case.get("name")
        kinds["tie"] += int((counts == counts.max()).sum() > 1)
        kinds["all_accepted"] += int(n == depth)
        kinds["all_rejected_first"] += int(counts.max() == 0)
    assert all(kinds.values()), kinds  # ties, whole paths, first-node rejections and a 0/0 ratio are exercised


# -- decoding --------------------------------------------------------------------------------------------------
def test_one_path_is_sjd_token_for_token():
    model = lookup(grid=(2, 4))
    one = pathrelax(model, paths=1, depth=3)
    sjd = Decoder("sjd", model, ExactRule(), 3, lambda target: JacobiDrafter(target, init="random"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    for a, b in zip(one.generate_batch(prompts, list(range(12))), sjd.generate_batch(prompts, list(range(12)))):
        assert torch.equal(a.tokens, b.tokens) and a.stats.accepted_hist == b.stats.accepted_hist


def test_pathrelax_is_not_exact_and_its_gap_is_measured():
    """Module doc: χ² rejects at ALPHA on both prompts, batch 16 = alone, and the TV lower bound is above 0."""
    assert ALPHA == 1e-3  # the level assert_departs tests at (the module doc's)
    model = lookup()
    decoder = pathrelax(model, paths=2, depth=3)
    batched = sequences(decoder, N_LOSSY, sizes=(16,))
    alone = sequences(decoder, N_ALONE, sizes=(1,))
    assert all(alone[p] == batched[p][: len(alone[p])] for p in PROMPTS)
    assert_departs(model, batched, "PathRelax (2 paths x 3)")


def test_carried_drafts_shift_every_path_by_the_winners_commit():
    """After an iteration that commits n + 1 tokens, slot j of every path holds the target's output at that path's
    node of depth n + 1 + j, and as many slots are carried as the paths had nodes past n."""
    model = lookup(grid=(2, 4))
    drafter = PathJacobiDrafter(model, paths=2)
    drafter.block_shape(6)
    v = model.codebook_size
    drafter.batch, drafter.device = 1, torch.device("cpu")
    p = torch.rand(1, 7, v, dtype=torch.float64)
    draft = Draft(tokens=torch.zeros(1, 6, dtype=torch.long), q=torch.zeros(1, 6, v), forwards=[0],
                  valid=torch.ones(1, 6, dtype=torch.bool), parents=path_layout(2, 3, torch.device("cpu"))[0][None])
    verdict = PathVerifier(2)(ExactRule(), p, draft, torch.ones(1, 6), torch.zeros(1))  # u = 1: nothing passes
    verdict.num_accepted.fill_(1)  # as if the winner passed one node
    drafter.observe(None, p, draft, verdict)
    assert drafter.carried.tolist() == [2]
    for k in range(2):  # path k's nodes are rows 1 + 3k .. 3 + 3k; depth n + 1 + j = 2 + j
        for j in range(2):
            assert torch.equal(drafter.q[0, k, j], p[0, 1 + 3 * k + 1 + j]), (k, j)


@pytest.mark.parametrize("model_name", MODELS)
def test_the_config_runs_on_every_model_batched_and_alone(model_name):
    decoder = batched_equals_alone_without_tv(model_name, ["decoder=pathrelax"])
    assert isinstance(decoder, PathRelax) and decoder.max_depth == 4 and decoder.max_nodes == 8


def test_the_static_path_gives_the_eager_tokens_and_reads_once_per_iteration(monkeypatch):
    from tests.test_static_path import assert_static_reads, eager_and_static_pairs

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.device=cpu", "decoder=pathrelax",
                                                       "decoder.draft_len=8"])
    model = instantiate(cfg.model)
    eager = instantiate(cfg.decoder, model=model)
    static = instantiate(OmegaConf.merge(cfg.decoder, {"path": "static"}), model=model)
    assert static.static.step_name == "jacobi_window" and static.static.levels == (1, 2, 2, 2, 2)
    pairs = eager_and_static_pairs(eager, static, ["dress", "bag", "sneaker"], alone=1, tv_rel=1e-5)
    assert any(a.stats.mean_accepted_length > 1.5 for a, _ in pairs)
    assert_static_reads(monkeypatch, static, [(["dress", "bag", "coat"], [0, 1, 2])], ar_steps=None)


def test_refilled_rows_give_their_lock_step_images():
    """``decoder.refill=true``: a finished image's row takes the next prompt (its paths restart empty) and every
    image keeps its lock-step tokens and statistics (``tests.test_refill``)."""
    from tests.test_refill import assert_refill_equals_lock_step

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.device=cpu", "decoder=pathrelax", "decoder.draft_len=8",
                                                       "decoder.path=static", "decoder.refill=true"])
    decoder = instantiate(cfg.decoder, model=instantiate(cfg.model))
    prompts = ["dress", "bag", "sneaker", "coat", "shirt"]
    assert_refill_equals_lock_step(decoder, prompts, list(range(len(prompts))), 2)


def test_bad_settings_name_the_key():
    model = lookup()
    with pytest.raises(ValueError, match="decoder.draft_len=7 must be a multiple of decoder.drafter.paths=2"):
        PathRelax("p", model, ExactRule(), 7, lambda target: PathJacobiDrafter(target, paths=2))
    with pytest.raises(ValueError, match="decoder.drafter.paths"):
        PathJacobiDrafter(model, paths=0)
    with pytest.raises(ValueError, match="decoder.drafter.init"):
        PathJacobiDrafter(model, init="repeat_horizon")
    with pytest.raises(ValueError, match="PathJacobiDrafter"):
        PathRelax("p", model, ExactRule(), 6, lambda target: JacobiDrafter(target))


def test_run_py_puts_sjd_beside_it(tmp_path):
    """``python run.py decoder=pathrelax``: the run compares it with SJD on the same prompts (``compare_auto``)."""
    from eval.run.suite import select_decoders

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decoder=pathrelax"])
        other = compose(config_name="config", overrides=["decoder=sjd"])
    assert list(select_decoders(cfg, decoder_overridden=True)) == ["ar", "sjd", "pathrelax"]
    assert list(select_decoders(other, decoder_overridden=True)) == ["ar", "sjd"]
