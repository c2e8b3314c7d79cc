"""Draft trees: exactness of the multi-draft walk (static and dynamic trees), chain equivalence, tree
attention against per-path forwards, KV compaction, tree shapes as data.

Statistical tests: lookup model (3 codes, 2x2 grid: 81 sequences, known exactly), ``N_SAMPLES`` sequences
with seeds 0..N−1, Pearson chi-square with cells of expected count < 5 pooled; the test fails when the
p-value is below ALPHA = 1e-3 (the false-alarm probability for a random seed choice). A deliberately broken
tree drafter (siblings keep the unconditional q instead of q with the earlier siblings removed) must fail.
"""
from __future__ import annotations

import pytest
import torch

from baselines.exact import ExactRule
from baselines.lantern import LanternRule
from coolsd.acceptance import verify_chain, verify_tree
from coolsd.cool import CoolSDRule
from coolsd.decoding import Decoder
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.llamagen import layer_skip_copy
from coolsd.models.lookup import LookupModel, perturbed_copy
from coolsd.neighbours import compute_neighbours
from coolsd.trees import TREE_DIR, TreeShape, ancestor_mask, depths_of
from coolsd.types import Draft
from tests.helpers import chi_square_pvalue, forward1, keep1, prefill1, tiny_llamagen

ALPHA = 1e-3
N_SAMPLES = 3000
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
DYNAMIC = dict(top_k=2, depth=2, total_tokens=5)


class UnconditionalSiblings(ModelDrafter):
    """Broken: every sibling is tested against the parent's full q (sampling without replacement ignored)."""

    def propose(self, last_tokens, t, limit, depth, tree=None):
        draft = super().propose(last_tokens, t, limit, depth, tree)
        if draft.parents is None:
            return draft
        q = draft.q.clone()
        for b, parents in enumerate(draft.parents.tolist()):
            first: dict[int, int] = {}
            for j, par in enumerate(parents):
                first.setdefault(par, j)
                q[b, j] = draft.q[b, first[par]]
        return Draft(tokens=draft.tokens, q=q, valid=draft.valid, forwards=draft.forwards, parents=draft.parents)


def lookup_pair():
    target = LookupModel(vocab=3, grid=(2, 2), seed=5, scale=1.0, sampling=dict(cfg_scale=2.0))
    return target, perturbed_copy(target, noise=1.5, seed=2)


def empirical(decoder, target, samples: int = N_SAMPLES, batch: int = 100) -> torch.Tensor:
    """Sequence counts over seeds 0..samples−1, decoded in batches (each image as alone)."""
    counts = torch.zeros(81)
    for start in range(0, samples, batch):
        for gen in decoder.generate_batch(["p"] * batch, list(range(start, start + batch))):
            counts[target.sequence_index(gen.tokens)] += 1
    return counts


def write_small_tree(tmp_path) -> str:
    path = tmp_path / "small.json"
    path.write_text('{"name": "small", "paths": ' + str(SMALL_TREE) + "}")
    return str(path)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_exact_rule_on_trees_is_lossless(tree, tmp_path):
    target, draft = lookup_pair()
    spec = write_small_tree(tmp_path) if tree == "static" else "dynamic"
    decoder = Decoder("sd", target, ExactRule(), draft_len=3, drafter=ModelDrafter(target, draft), tree=spec,
                      dynamic_tree=DYNAMIC)
    assert chi_square_pvalue(empirical(decoder, target), target.exact_sequence_probs()) > ALPHA


def test_unconditional_sibling_q_fails_the_same_test(tmp_path):
    target, draft = lookup_pair()
    decoder = Decoder("broken", target, ExactRule(), draft_len=3, drafter=UnconditionalSiblings(target, draft),
                      tree=write_small_tree(tmp_path))
    assert chi_square_pvalue(empirical(decoder, target, 4 * N_SAMPLES), target.exact_sequence_probs()) < ALPHA


@pytest.mark.parametrize("rule_name", ["exact", "coolsd", "lantern"])
def test_chain_tree_walk_equals_chain_verification(rule_name):
    """Same random stream: the tree walk on a chain makes the chain's decisions and draws its tokens."""
    v = 12
    rule = {"exact": ExactRule(), "coolsd": CoolSDRule(delta=2.0, draft_len=5),
            "lantern": LanternRule(compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(0)),
                                                      v - 1), k=4, mode="additive", budget=0.2)}[rule_name]
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        length = 1 + trial % 5
        p = torch.softmax(2 * torch.randn(length + 1, v, generator=g), -1)
        q = torch.softmax(2 * torch.randn(length, v, generator=g), -1)
        tokens = torch.multinomial(q, 1, generator=g).squeeze(-1)[None]
        valid = torch.ones_like(tokens, dtype=torch.bool)
        chain = Draft(tokens=tokens, q=q[None], valid=valid, forwards=[length])
        tree = Draft(tokens=tokens, q=q[None], valid=valid, forwards=[length], parents=torch.arange(-1, length - 1)[None])
        u = torch.Generator().manual_seed(trial)
        u_accept, u_sample = torch.rand(1, length, generator=u), torch.rand(1, generator=u)
        a = verify_chain(rule, p[None], chain, u_accept, u_sample)
        b = verify_tree(rule, p[None], tree, u_accept, u_sample)
        n = int(a.num_accepted[0])
        assert n == int(b.num_accepted[0]) and torch.equal(a.next_token, b.next_token)
        assert a.path[0, :n].tolist() == b.path[0, :n].tolist()


def test_tree_attention_matches_per_path_forwards():
    model = tiny_llamagen(dtype="float64")
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    mask = ancestor_mask(parents)
    for j, path in enumerate(shape.paths):  # row j+1 sees the root and exactly the prefixes of its path
        ancestors = {shape.paths.index(path[:i]) + 1 for i in range(1, len(path) + 1)}
        assert set(mask[j + 1].nonzero().flatten().tolist()) == {0} | ancestors
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(1024, (5,), generator=g)
    nodes = torch.randint(1024, (len(parents),), generator=g)
    depths = depths_of(parents)
    cache, _ = prefill1(model, "two")
    forward1(model, cache, prefix, torch.arange(5))
    cache.keep(5)
    root = torch.tensor([7])
    positions = torch.tensor([5] + [5 + d for d in depths])
    tree_out = forward1(model, cache, torch.cat([root, nodes]), positions, mask)
    for j in range(len(parents)):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        ref_cache, _ = prefill1(model, "two")
        seq = torch.cat([prefix, root, nodes[path]])
        ref = forward1(model, ref_cache, seq, torch.arange(len(seq)))
        torch.testing.assert_close(tree_out.logits[:, j + 1], ref.logits[:, -1], rtol=1e-9, atol=1e-9)


def test_kv_compaction_then_forward_equals_uncached():
    model = tiny_llamagen(dtype="float64")
    shape = TreeShape.load("mc_sim_7b_63")
    parents = shape.parents()
    g = torch.Generator().manual_seed(3)
    nodes = torch.randint(1024, (len(parents),), generator=g)
    cache, _ = prefill1(model, "six")
    root = torch.tensor([11])
    forward1(model, cache, torch.cat([root, nodes]), torch.tensor([0] + [d for d in depths_of(parents)]),
                        ancestor_mask(parents))
    path = [1, 5, 13, 21]  # nodes [0], [0,0], [0,0,0], [0,0,0,0] (block indices)
    assert [shape.paths[i - 1] for i in path] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    keep1(cache, torch.tensor([0] + path))
    nxt = torch.tensor([42, 43])
    after = forward1(model, cache, nxt, torch.arange(5, 7))
    committed = torch.cat([root, nodes[[i - 1 for i in path]], nxt])
    ref_cache, _ = prefill1(model, "six")
    ref = forward1(model, ref_cache, committed, torch.arange(len(committed)))
    torch.testing.assert_close(after.logits, ref.logits[:, -2:], rtol=1e-9, atol=1e-9)


def test_shapes_load_by_name_and_validate():
    counts = {"naive_extend_57": (57, [5, 13, 16, 14, 9]), "mc_sim_7b_63": (25, [4, 8, 8, 3, 2]),
              "chain": (5, [1, 1, 1, 1, 1])}
    for name, (nodes, per_depth) in counts.items():
        shape = TreeShape.load(name)
        depths = depths_of(shape.parents())
        assert len(shape.paths) == nodes and [depths.count(d) for d in range(1, 6)] == per_depth
    assert {p.stem for p in TREE_DIR.glob("*.json")} >= set(counts)
    with pytest.raises(ValueError, match="decoder.tree"):
        TreeShape.load("no_such_tree")
    with pytest.raises(ValueError, match="no parent"):
        TreeShape.from_paths("bad", [[0], [1, 0, 0]])
    assert len(TreeShape.load("naive_extend_57").truncated(2).paths) == 18


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "dynamic"])
def test_greedy_tree_sd_equals_greedy_ar(tree):
    model = tiny_llamagen(dtype="float64", temperature=0.0)
    ar = Decoder("ar", model, ExactRule())
    sd = Decoder("sd", model, ExactRule(), draft_len=4, drafter=ModelDrafter(model, layer_skip_copy(model, 2)),
                 tree=tree)
    for prompt in ("zero", "eight"):
        assert torch.equal(ar.generate(prompt, 0).tokens, sd.generate(prompt, 3).tokens)


@pytest.mark.parametrize("rule_name", ["exact", "coolsd", "lantern"])
def test_one_image_walk_equals_the_batched_walk(rule_name):
    """``verify_tree`` at batch 1 (host bookkeeping) gives bitwise the batched walk's verdict on random trees:
    accepted count, path, next token and every test's operands (what ``summed_tv`` reads), with deterministic
    (one-hot) and sampled sibling distributions, invalid nodes and empty trees."""
    from coolsd.acceptance import _verify_one_tree, _verify_tree_batch

    v = 12
    rule = {"exact": ExactRule(), "coolsd": CoolSDRule(delta=2.0, draft_len=5),
            "lantern": LanternRule(compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(0)),
                                                      v - 1), k=4, mode="additive", budget=0.2)}[rule_name]
    g = torch.Generator().manual_seed(3)
    accepted = 0
    for trial in range(300):
        m = trial % 9  # 0: an empty tree
        parents = [-1 if j == 0 or torch.rand(1, generator=g) < 0.3 else int(torch.randint(j, (1,), generator=g))
                   for j in range(m)]
        p = torch.softmax(3 * torch.randn(1, m + 1, v, generator=g), -1)
        q = torch.softmax(3 * torch.randn(1, m, v, generator=g), -1)
        tokens = torch.multinomial(q[0], 1, generator=g).T if m else torch.zeros(1, 0, dtype=torch.long)
        if trial % 2:  # a dynamic tree's drafts: q one-hot on its token
            q = torch.nn.functional.one_hot(tokens, v).float()
        valid = torch.rand(1, m, generator=g) < 0.85
        draft = Draft(tokens=tokens, q=q, valid=valid, forwards=[m], parents=torch.tensor([parents], dtype=torch.long).view(1, m))
        u_accept, u_sample = torch.rand(1, m, generator=g), torch.rand(1, generator=g)
        one = _verify_one_tree(rule, p, draft, u_accept, u_sample)
        batched = _verify_tree_batch(rule, p, draft, u_accept, u_sample)
        assert torch.equal(one.num_accepted, batched.num_accepted) and torch.equal(one.next_token, batched.next_token)
        assert torch.equal(one.path, batched.path) and len(one.tests) == len(batched.tests)
        for a, b in zip(one.tests, batched.tests):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        accepted += int(one.num_accepted)
    assert accepted > 50  # the walks went deeper than the root's children


@pytest.mark.parametrize("rule_name", ["exact", "coolsd", "lantern", "lantern_pp"])
def test_the_parallel_walk_gives_the_sequential_walks_verdict(rule_name):
    """``verify_tree_parallel`` (every node's sibling walk at once, no host read: the static path) gives bitwise
    the batched walk's accepted counts, paths and next tokens on 300 random trees per rule, in batches of 3 trees
    of different shapes (deterministic and sampled sibling distributions, invalid nodes, empty trees), and the
    same summed TV and test count (``summed_tv``)."""
    from coolsd.acceptance import _verify_tree_batch, summed_tv, verify_tree_parallel

    v = 12
    neighbours = compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(0)), v - 1)
    rule = {"exact": ExactRule(), "coolsd": CoolSDRule(delta=2.0, draft_len=5),
            "lantern": LanternRule(neighbours, k=4, mode="additive", budget=0.2),
            "lantern_pp": LanternRule(neighbours, k=3, mode="multiplicative", budget=4.0)}[rule_name]
    g = torch.Generator().manual_seed(7)
    accepted = 0
    for trial in range(100):
        m, b = trial % 10, 3
        parents = torch.tensor([[-1 if j == 0 or torch.rand(1, generator=g) < 0.3
                                 else int(torch.randint(j, (1,), generator=g)) for j in range(m)] for _ in range(b)],
                               dtype=torch.long).view(b, m)
        p = torch.softmax(3 * torch.randn(b, m + 1, v, generator=g), -1)
        q = torch.softmax(3 * torch.randn(b, m, v, generator=g), -1)
        tokens = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, m) if m else torch.zeros(b, 0, dtype=torch.long)
        if trial % 2:  # a dynamic tree's drafts: q one-hot on its token
            q = torch.nn.functional.one_hot(tokens, v).float()
        draft = Draft(tokens=tokens, q=q, valid=torch.rand(b, m, generator=g) < 0.85, forwards=[m] * b,
                      parents=parents)
        u_accept, u_sample = torch.rand(b, m, generator=g), torch.rand(b, generator=g)
        walk = _verify_tree_batch(rule, p, draft, u_accept, u_sample)
        fast = verify_tree_parallel(rule, p, draft, u_accept, u_sample, width=max(m, 1), levels=m)
        assert torch.equal(walk.num_accepted, fast.num_accepted) and torch.equal(walk.next_token, fast.next_token)
        n = walk.num_accepted
        mask = torch.arange(m)[None, :] < n[:, None]
        assert torch.equal(torch.where(mask, walk.path, 0), torch.where(mask, fast.path, 0))
        (tv_w, count_w), (tv_f, count_f) = summed_tv(rule, walk), summed_tv(rule, fast)
        assert torch.equal(count_w, count_f) and torch.allclose(tv_w, tv_f, rtol=1e-9, atol=1e-12)
        accepted += int(n.sum())
    assert accepted > 40  # the walks went deeper than the root's children


@pytest.mark.parametrize("rule_name", ["exact", "lantern"])
def test_the_parallel_walk_with_a_fixed_shapes_plan_gives_the_sequential_walks_verdict(rule_name):
    """With a fixed shape's ``TreePlan`` (the static path's static trees: exact per-rank row counts, invalid nodes
    skipped where they sit) and the caller's ancestor mask, ``verify_tree_parallel`` still gives bitwise the
    batched walk's verdict, on 150 random shapes shared by a batch of 3 with per-image invalid nodes; with
    ``tests=False`` it reports no tests and the same verdict."""
    from coolsd.acceptance import TreePlan, _verify_tree_batch, summed_tv, verify_tree_parallel
    from coolsd.trees import ancestor_mask

    v = 12
    neighbours = compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(1)), v - 1)
    rule = ExactRule() if rule_name == "exact" else LanternRule(neighbours, k=4, mode="additive", budget=0.2)
    g = torch.Generator().manual_seed(11)
    accepted = 0
    for trial in range(50):
        m, b = 1 + trial % 12, 3
        shape = [-1 if j == 0 or torch.rand(1, generator=g) < 0.25 else int(torch.randint(j, (1,), generator=g))
                 for j in range(m)]
        parents = torch.tensor(shape, dtype=torch.long).expand(b, m)
        p = torch.softmax(3 * torch.randn(b, m + 1, v, generator=g), -1)
        q = torch.softmax(3 * torch.randn(b, m, v, generator=g), -1)
        tokens = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, m)
        draft = Draft(tokens=tokens, q=q, valid=torch.rand(b, m, generator=g) < 0.85, forwards=[m] * b,
                      parents=parents)
        u_accept, u_sample = torch.rand(b, m, generator=g), torch.rand(b, generator=g)
        walk = _verify_tree_batch(rule, p, draft, u_accept, u_sample)
        plan = TreePlan.of(shape)
        for tests in (True, False):
            fast = verify_tree_parallel(rule, p, draft, u_accept, u_sample, width=len(plan.sizes), levels=m,
                                        tests=tests, ancestors=ancestor_mask(shape), plan=plan)
            assert torch.equal(walk.num_accepted, fast.num_accepted) and torch.equal(walk.next_token, fast.next_token)
            mask = torch.arange(m)[None, :] < walk.num_accepted[:, None]
            assert torch.equal(torch.where(mask, walk.path, 0), torch.where(mask, fast.path, 0))
            if tests:
                assert torch.equal(summed_tv(rule, walk)[1], summed_tv(rule, fast)[1])
            else:
                assert fast.tests == ()
        accepted += int(walk.num_accepted.sum())
    assert accepted > 20  # the walks went below the root


def test_eagle2_trees_have_at_most_one_plus_top_k_times_depth_rows_with_children():
    """The bound the static path gives the parallel walk for EAGLE-2 trees (``internal = 1 + top_k · depth``: the
    root and each level's expanded frontier) holds on 40 random dynamic trees (random draft distributions, some
    rows with zero-probability codes), and the walk under it gives the batched walk's verdict bitwise."""
    from coolsd.acceptance import _verify_tree_batch, children_slots, verify_tree_parallel
    from coolsd.trees import DraftRows, DynamicTree, draft_dynamic_tree

    g = torch.Generator().manual_seed(5)
    v, b = 16, 2
    for trial in range(40):
        spec = DynamicTree(top_k=2 + trial % 4, depth=1 + trial % 4, total_tokens=4 + trial % 20)

        def expand(request):
            f = 1 if request.root else request.tokens.shape[1]
            logits = 3 * torch.randn(b, f, v, generator=g)
            logits[torch.rand(b, f, v, generator=g) < 0.2] = float("-inf")
            return DraftRows(q=torch.softmax(logits, -1), finite=None)

        draft = draft_dynamic_tree(spec, torch.full((b,), 5), torch.full((b,), spec.depth + 1), expand, static=True)
        m = draft.tokens.shape[1]
        internal = 1 + spec.top_k * spec.depth
        rows_with_children = (children_slots(draft.parents, torch.ones_like(draft.valid), spec.top_k) >= 0).any(-1)
        assert int(rows_with_children.sum(-1).max()) <= internal
        p = torch.softmax(2 * torch.randn(b, m + 1, v, generator=g), -1)
        u_accept, u_sample = torch.rand(b, m, generator=g), torch.rand(b, generator=g)
        walk = _verify_tree_batch(ExactRule(), p, draft, u_accept, u_sample)
        fast = verify_tree_parallel(ExactRule(), p, draft, u_accept, u_sample, spec.top_k, spec.depth + 1,
                                    tests=False, internal=internal)
        assert torch.equal(walk.num_accepted, fast.num_accepted) and torch.equal(walk.next_token, fast.next_token)
