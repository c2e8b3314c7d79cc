"""Batched decoding: every image of a batch runs the same algorithm as alone, with its own acceptance.

Statistical tests (seeds fixed, so deterministic; each would fail with probability ALPHA = 1e-3 for a random
choice of seeds if the implementation were right — the false-alarm probability per test):

* ``test_lossless_decoders_stay_exact_in_mixed_batches``: on a lookup model with one table per prompt
  ("a", "b"; 3 codes, 2x2 grid: 81 sequences each, known exactly), ``N_SAMPLES`` images per decoder, decoded
  in batches whose sizes cycle through 1, 3 and 8 and whose prompts alternate, so every batch mixes both
  distributions; Pearson chi-square per prompt (cells of expected count < 5 pooled).
* ``test_relaxed_rules_give_their_analytic_one_step_output_in_a_batch_of_8``: a 3-token image whose second
  token comes from one acceptance step (draft_len 1), batches of 8 mixing two prompts: each prompt's
  distribution of the first two tokens equals ``p(x0) · P̂(x1 | x0)`` with ``P̂ = q f + Σ_x q(x)(1 − f(x)) G_x``
  (COOL-SD, LANTERN, LANTERN++, GSD's grouped rule).

Reproducibility: an image depends only on its prompt, seed and config — identical tokens at batch 1, inside a
batch of 8 with other prompts, at the end of a batch whose other images finish earlier, and through the
runner (batched quality set vs timed batch-1 subset, resumed runs).
"""
from __future__ import annotations

import json

import pytest
import torch

from baselines.exact import ExactRule
from baselines.gsd import GroupedRule
from baselines.lantern import LanternRule
from baselines.jacobi import JacobiDrafter
from coolsd.cool import CoolSDRule
from coolsd.decoding import Decoder, NonFiniteError
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.models.llamagen import layer_skip_copy
from coolsd.models.lookup import LookupModel, perturbed_copy
from coolsd.neighbours import compute_neighbours
from tests.helpers import chi_square_pvalue, forward1, prefill1, residual1, tiny_llamagen
from tests.test_run import LOOKUP, run_py

ALPHA = 1e-3
N_SAMPLES = 3000
PROMPTS = ("a", "b")
SMALL_TREE = '{"name": "small", "paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}'


def mixed_batches(n: int, sizes=(1, 3, 8)):
    """(prompts, seeds) chunks covering seeds 0..n−1: batch sizes cycle through ``sizes``, prompts alternate."""
    start, k = 0, 0
    while start < n:
        size = min(sizes[k % len(sizes)], n - start)
        seeds = list(range(start, start + size))
        yield [PROMPTS[s % 2] for s in seeds], seeds
        start, k = start + size, k + 1


def lookup_pair(grid=(2, 2), vocab=3):
    target = LookupModel(vocab=vocab, grid=grid, seed=5, scale=1.0, sampling=dict(cfg_scale=2.0), prompts=PROMPTS)
    return target, perturbed_copy(target, noise=1.5, seed=2)


def lossless_decoders(target, draft, tmp_path):
    tree = tmp_path / "small.json"
    tree.write_text(SMALL_TREE)
    table = compute_neighbours(torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), 2)
    model_drafter = lambda: ModelDrafter(target, draft)  # noqa: E731
    return {
        "ar": Decoder("ar", target, ExactRule()),
        "sd_chain": Decoder("sd", target, ExactRule(), draft_len=2, drafter=model_drafter()),
        "sd_static_tree": Decoder("sd", target, ExactRule(), drafter=model_drafter(), tree=str(tree)),
        "sd_dynamic_tree": Decoder("sd", target, ExactRule(), drafter=model_drafter(), tree="dynamic",
                                   dynamic_tree=dict(top_k=2, depth=2, total_tokens=5)),
        "sjd_random": Decoder("sjd", target, ExactRule(), draft_len=3, drafter=JacobiDrafter(target, init="random")),
        "sjd_repeat_horizon": Decoder("sjd", target, ExactRule(), draft_len=3,
                                      drafter=JacobiDrafter(target, init="repeat_horizon")),
        "coolsd_lossless": Decoder("coolsd", target, CoolSDRule(delta=1.0, draft_len=2, schedule="uniform"),
                                   draft_len=2, drafter=model_drafter()),
        "lantern_pp_lossless": Decoder("lantern_pp", target, LanternRule(table, k=1, mode="multiplicative",
                                                                         budget=1.0, resample="optimal"),
                                       drafter=model_drafter(), tree=str(tree)),
    }


@pytest.mark.parametrize("name", ["ar", "sd_chain", "sd_static_tree", "sd_dynamic_tree", "sjd_random",
                                  "sjd_repeat_horizon", "coolsd_lossless", "lantern_pp_lossless"])
def test_lossless_decoders_stay_exact_in_mixed_batches(name, tmp_path):
    target, draft = lookup_pair()
    decoder = lossless_decoders(target, draft, tmp_path)[name]
    assert decoder.rule.lossless
    counts = {p: torch.zeros(81) for p in PROMPTS}
    for prompts, seeds in mixed_batches(N_SAMPLES):
        for prompt, gen in zip(prompts, decoder.generate_batch(prompts, seeds)):
            counts[prompt][target.sequence_index(gen.tokens)] += 1
    for prompt in PROMPTS:
        assert chi_square_pvalue(counts[prompt], target.exact_sequence_probs(prompt)) > ALPHA, prompt


def brute_force_output(rule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q f + Σ_x q(x)(1 − f(x)) G_x`` at depth 1, each rejected token with its own residual."""
    f = rule.accept_prob(p.expand(len(p), -1), q.expand(len(p), -1), torch.arange(len(p)),
                         torch.ones(len(p), dtype=torch.long))
    out = q * f
    for x in range(len(p)):
        if q[x] > 0 and f[x] < 1:
            out = out + q[x] * (1 - f[x]) * residual1(rule, p, q, x, 1)
    return out


@pytest.mark.parametrize("name", ["coolsd_exp_d2", "lantern_ref", "lantern_pp", "gsd"])
def test_relaxed_rules_give_their_analytic_one_step_output_in_a_batch_of_8(name):
    v = 6
    target, draft = lookup_pair(grid=(1, 3), vocab=v)
    table = compute_neighbours(torch.randn(v, 3, generator=torch.Generator().manual_seed(0)), v - 1)
    embeddings = torch.randn(v, 3, generator=torch.Generator().manual_seed(1))
    rule = {"coolsd_exp_d2": lambda: CoolSDRule(delta=2.0, draft_len=1),
            "lantern_ref": lambda: LanternRule(table, k=3, mode="additive", budget=0.3, resample="reference"),
            "lantern_pp": lambda: LanternRule(table, k=2, mode="multiplicative", budget=4.0),
            "gsd": lambda: GroupedRule(embeddings, group_size=4, delta_p=0.3, max_distance=3.0)}[name]()
    decoder = Decoder(name, target, rule, draft_len=1, drafter=ModelDrafter(target, draft), track_tv=False)
    counts = {p: torch.zeros(v * v) for p in PROMPTS}
    for prompts, seeds in mixed_batches(8000, sizes=(8,)):
        for prompt, gen in zip(prompts, decoder.generate_batch(prompts, seeds)):
            counts[prompt][int(gen.tokens[0]) * v + int(gen.tokens[1])] += 1
    for prompt in PROMPTS:
        _, out0 = prefill1(target, prompt)
        p0 = target.probs(out0)[0].double()
        expected = torch.zeros(v, v, dtype=torch.float64)
        for x0 in range(v):
            cache, _ = prefill1(target, prompt)
            p1 = target.probs(forward1(target, cache, torch.tensor([x0]), torch.tensor([0])))[0].double()
            dcache, _ = prefill1(draft, prompt)
            q1 = draft.probs(forward1(draft, dcache, torch.tensor([x0]), torch.tensor([0])))[0].double()
            expected[x0] = p0[x0] * brute_force_output(rule, p1, q1)
        assert chi_square_pvalue(counts[prompt], expected.flatten()) > ALPHA, prompt


@pytest.mark.parametrize("decoder", ["sd", pytest.param("lantern", marks=pytest.mark.slow),
                                     pytest.param("lantern_pp", marks=pytest.mark.slow), "coolsd", "sjd"])
# LANTERN's and LANTERN++'s rules (COOL-SD's relaxed rule stays in the default pass) in CI's -m slow pass
def test_an_image_is_the_same_alone_and_inside_any_batch(decoder):
    """Tiny LlamaGen (float64, CFG), the suite's configurations (EAGLE-style layer-skip drafter; LANTERN on a
    dynamic tree, LANTERN++ on naive_extend_57): identical tokens and statistics at batch 1 and in a batch of
    8 with other prompts, images finishing at different iterations."""
    model = tiny_llamagen(dtype="float64")
    drafter = lambda: ModelDrafter(model, layer_skip_copy(model, 1))  # noqa: E731
    table = compute_neighbours(model.codebook(), 11)
    build = {
        "sd": lambda: Decoder("sd", model, ExactRule(), draft_len=4, drafter=drafter()),
        "lantern": lambda: Decoder("lantern", model, LanternRule(table, k=10, mode="additive", budget=0.2),
                                   drafter=drafter(), tree="dynamic"),
        "lantern_pp": lambda: Decoder("lantern_pp", model, LanternRule(table, k=5, mode="multiplicative",
                                                                       budget=5.0), drafter=drafter(),
                                      tree="naive_extend_57"),
        "coolsd": lambda: Decoder("coolsd", model, CoolSDRule(delta=2.0, draft_len=4), draft_len=4,
                                  drafter=drafter()),
        "sjd": lambda: Decoder("sjd", model, ExactRule(), draft_len=15, drafter=JacobiDrafter(model)),
    }[decoder]
    prompts = ["one", "four", "seven", "nine", "zero", "two", "six", "three"]
    seeds = [11, 3, 5, 8, 2, 13, 21, 34]
    batch = build().generate_batch(prompts, seeds)
    iterations = {g.stats.iterations for g in batch}
    assert len(iterations) > 1  # the images finish at different iterations
    alone = build()
    for k in (0, 3, 7):
        single = alone.generate(prompts[k], seeds[k])
        assert torch.equal(single.tokens, batch[k].tokens), k
        assert single.stats.accepted_hist == batch[k].stats.accepted_hist
        assert single.stats.drafter_forwards == batch[k].stats.drafter_forwards
        assert single.stats.tv_sum == pytest.approx(batch[k].stats.tv_sum, rel=1e-9, abs=1e-12)
    assert [g.stats.batch_size for g in batch] == [8] * 8


def test_a_batch_whose_images_accept_everything_and_a_batch_of_one():
    """Greedy, with a drafter identical to the target (all its layers, so q = p): every draft is accepted, every
    image commits full chains and finishes with the others, and the images are greedy AR's. A batch of one
    is ``generate``; an empty batch returns nothing."""
    model = tiny_llamagen(dtype="float64", temperature=0.0)
    same = Decoder("sd", model, ExactRule(), draft_len=4, drafter=ModelDrafter(model, layer_skip_copy(model, 4)))
    ar = Decoder("ar", model, ExactRule())
    prompts = ["one", "five", "eight"]
    batch = same.generate_batch(prompts, [0, 1, 2])
    n = model.num_image_tokens
    for prompt, gen in zip(prompts, batch):
        assert torch.equal(gen.tokens, ar.generate(prompt, 0).tokens)  # greedy: the drafts are AR's tokens
        assert gen.stats.accepted_hist[4] == (n - 1) // 5 and gen.stats.num_tokens == n  # 5 tokens committed
    one = same.generate_batch(["two"], [9])
    assert len(one) == 1 and torch.equal(one[0].tokens, same.generate("two", 9).tokens)
    assert same.generate_batch([], []) == []


class NaNAt(LookupModel):
    """A lookup model whose logits are NaN for image position ``position`` of prompt "b"."""

    def __init__(self, position: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad_position = position

    def forward_block(self, cache, tokens, positions, tree_mask=None):
        out = super().forward_block(cache, tokens, positions, tree_mask)
        of_b = torch.tensor([self.prompts[t] == "b" for t in cache.tables])[:, None]
        bad = (positions + 1 == self.bad_position) & of_b  # the output at position t predicts token t + 1
        out.logits[:, bad] = float("nan")
        return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["ar", "sd"])
def test_non_finite_logits_raise_with_the_model_decoder_image_and_position(kind, temperature):
    target = NaNAt(2, vocab=3, grid=(2, 2), prompts=PROMPTS,
                   sampling=dict(cfg_scale=2.0, temperature=temperature))
    draft = perturbed_copy(target, noise=0.5)
    decoder = Decoder(kind, target, ExactRule(), draft_len=2 if kind == "sd" else 0,
                      drafter=ModelDrafter(target, draft) if kind == "sd" else None)
    decoder.generate("a", 0)  # the other prompt is fine
    with pytest.raises(NonFiniteError, match=rf"target \(NaNAt\).*decoder '{kind}': image 7 \(prompt 'b'"):
        decoder.generate_batch(["a", "b"], [0, 1], labels=[6, 7])
    clean = LookupModel(vocab=3, grid=(2, 2), prompts=PROMPTS, sampling=target.sampling)
    bad_draft = NaNAt(1, vocab=3, grid=(2, 2), prompts=PROMPTS, sampling=target.sampling)
    sd = Decoder("sd", clean, ExactRule(), draft_len=2, drafter=ModelDrafter(clean, bad_draft))
    with pytest.raises(NonFiniteError, match=r"from the drafter \(ModelDrafter\)"):
        sd.generate("b", 0)


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_the_runner_makes_the_same_images_batched_timed_and_resumed(tmp_path):
    """The timed subset (batch 1) and the batched rest hold the same images as a run timed throughout; a run
    resumed with more prompts keeps the first images and adds the same ones a fresh run makes."""
    common = [*LOOKUP, "eval.threads=1", "eval.warmup=0", "decoder=sd", "compare=none"]
    run_py(*common, "eval.num_prompts=6", "eval.speed_prompts=2", "eval.batch_size=3",
           f"hydra.run.dir={tmp_path / 'a'}")
    run_py(*common, "eval.num_prompts=6", f"hydra.run.dir={tmp_path / 'b'}")  # every image timed at batch 1
    for n in (3, 6):  # a run, then the same folder with more prompts
        run_py(*common, f"eval.num_prompts={n}", "eval.batch_size=2", "eval.speed_prompts=1",
               f"hydra.run.dir={tmp_path / 'c'}")

    def tokens(folder, name):
        lines = (tmp_path / folder / "records" / f"{name}.jsonl").read_text().splitlines()
        return {r["index"]: r["tokens"] for r in map(json.loads, lines)}

    for name in ("ar", "sd"):
        a, b, c = tokens("a", name), tokens("b", name), tokens("c", name)
        assert a == b == c and len(a) == 6, name
    record = json.loads((tmp_path / "a" / "run.json").read_text())["per_decoder"]["sd"]
    # the batched rest: [2, 3, 4] first, before the timed phase (the pre-flight batch: a decoder's cold first call,
    # recorded but not a throughput sample), then [5]
    assert record["num_timed"] == 2 and record["throughput_images"] == 1 and record["throughput_batches"] == 1


@pytest.mark.slow  # an end-to-end run (CI's -m slow pass)
def test_a_decoder_added_to_a_finished_run_is_timed_beside_ar_in_the_same_invocation(tmp_path):
    """A resumed run that adds a decoder times every decoder again on the timed prompts, AR included, so the
    added decoder's speedup divides latencies of one invocation; the batched images are not made again."""
    common = [*LOOKUP, "eval.threads=1", "eval.warmup=0", "decoder=sd", "eval.num_prompts=3", "eval.speed_prompts=2",
              f"hydra.run.dir={tmp_path}"]
    run_py(*common, "compare=none")
    run_py(*common, "compare=[sjd]")

    def lines(name):
        return [json.loads(x) for x in (tmp_path / "records" / f"{name}.jsonl").read_text().splitlines()]

    for name in ("ar", "sd"):
        recs = lines(name)
        assert sorted(r["index"] for r in recs if r["timed"]) == [0, 0, 1, 1], name  # timed in both invocations
        assert sorted(r["index"] for r in recs if not r["timed"]) == [2], name  # the batched image kept
    assert sorted(r["index"] for r in lines("sjd") if r["timed"]) == [0, 1]


def test_a_rerun_with_other_settings_refuses_before_any_work_and_overwrite_replaces(tmp_path):
    """Records carry a fingerprint of everything that makes their images: a rerun into the same folder with
    another draft length, seed or temperature is refused before any image is made, naming what differs and
    the two ways out; ``eval.resume=overwrite`` replaces the mismatching records."""
    import subprocess
    import sys

    from tests.test_run import ROOT

    common = [*LOOKUP, "eval.threads=1", "eval.warmup=0", "decoder=sd", "compare=none", "eval.num_prompts=2",
              f"hydra.run.dir={tmp_path}"]
    run_py(*common)
    before = (tmp_path / "records" / "sd.jsonl").read_text()
    for change, key in (("decoder.draft_len=2", "decoder.draft_len"), ("eval.seed=7", "seed 7"),
                        ("model.sampling.temperature=0", "model.sampling.temperature")):
        proc = subprocess.run([sys.executable, "run.py", *common, change], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode != 0 and key in proc.stderr, (change, proc.stderr[-2000:])
        assert "hydra.run.dir=<new folder>" in proc.stderr and "eval.resume=overwrite" in proc.stderr
        assert (tmp_path / "records" / "sd.jsonl").read_text() == before  # nothing was generated or lost
    run_py(*common, "decoder.draft_len=2", "eval.resume=overwrite")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["decoder"]["draft_len"] == 2
    assert record["per_decoder"]["sd"]["mean_accepted_length"] <= 3.0  # at most draft_len + 1


@pytest.mark.parametrize("method,tree", [("sd", None), ("sd", "mc_sim_7b_63"), ("lantern", "dynamic"),
                                         ("lantern_pp", "naive_extend_57"), ("coolsd", None)])
def test_a_nan_eagle_drafter_raises_on_chains_and_trees_never_falls_back(method, tree):
    """An EAGLE head with NaN weights: every decoder stops with the drafter named (no IndexError in the dynamic
    tree, no silent one-token steps on static trees or greedy chains)."""
    from baselines.lantern import Lantern, LanternPP
    from coolsd.cool import CoolSD
    from coolsd.drafters.eagle import EagleDrafter, EagleHead

    model = tiny_llamagen(dtype="float64", temperature=0.0)
    head = EagleHead(model, prefix="last")
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))
    drafter = EagleDrafter(model, head=head)
    common = dict(name=method, model=model, draft_len=3, drafter=drafter, tree=tree, track_tv=False)
    build = {"sd": lambda: Decoder(rule=ExactRule(), **common), "coolsd": lambda: CoolSD(delta=2.0, **common),
             "lantern": lambda: Lantern(k=4, **common), "lantern_pp": lambda: LanternPP(k=4, **common)}
    with pytest.raises(NonFiniteError, match=r"from the drafter \(EagleDrafter\).*image 0"):
        build[method]().generate_batch(model.class_names[:2], [0, 1])


def test_batch_invariant_linears_keeps_values_and_skips_tied_and_cuda_weights():
    """Column-major storage changes strides only; a weight shared with an embedding keeps its layout."""
    from coolsd.models.base import batch_invariant_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(7, 16), torch.nn.Linear(16, 24), torch.nn.Linear(24, 7, bias=False))
    net[2].weight = torch.nn.Parameter(torch.randn(7, 24))
    tied = torch.nn.Linear(16, 7, bias=False)
    tied.weight = net[0].weight  # (7, 16): an output head tied to the embedding
    net.append(tied)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert batch_invariant_linears(net) == 2
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert not net[1].weight.is_contiguous() and net[1].weight.t().is_contiguous()
    assert net[0].weight.is_contiguous()  # the tied one
    assert batch_invariant_linears(net) == 0  # idempotent


def shipped_model(**overrides):
    """The default config's model (the shipped embedded LlamaGen, float32) and config."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from tests.helpers import CONFIGS

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"{k}={v}" for k, v in overrides.items()])
    return instantiate(cfg.model), cfg


@pytest.mark.invariance
@pytest.mark.parametrize("row_block", [1, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_shipped_float32_model_gives_an_image_bitwise_the_same_output_alone_and_in_any_batch(threads, row_block):
    """The default model and its EAGLE drafter in float32 on the CPU (the default run's setting), over 1-, 5- and
    3-token blocks, alone, in a batch of 8 with other prompts and in other sub-batches. Where the start-up
    self-check passes on this machine (``coolsd.numerics``): the target logits are bitwise equal and sd's tokens
    and acceptance identical alone and in the batch. Where it fails: the logits agree within float32 rounding
    (relative 1e-5 of the largest logit), the documented weaker property. On an AMD EPYC (AVX2) MKL's kernels
    for 1–3 rows make rows [3] alone differ from the same rows in the batch of 8 with ``model.row_block=1`` (the
    default; the weaker property is checked there) and not with 4 (bitwise)."""
    from hydra.utils import instantiate

    from tests.helpers import invariance_property

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, cfg = shipped_model(**{"model.row_block": row_block})
        assert model.gpt.tok_embeddings.weight.dtype == torch.float32
        prop = invariance_property(model)
        prompts = [model.class_names[i % 10] for i in range(8)]
        gen = torch.Generator().manual_seed(0)
        blocks = [torch.randint(0, model.codebook_size, (8, t), generator=gen) for t in (1, 5, 3)]

        def logits(rows):
            cache, out = model.prefill([prompts[i] for i in rows])
            outs, pos = [out.logits], 0
            for tokens in blocks:
                t = tokens.shape[1]
                positions = torch.arange(pos, pos + t)[None].expand(len(rows), -1)
                outs.append(model.forward_block(cache, tokens[rows], positions).logits)  # (S, B, T, V)
                cache.keep(t)
                pos += t
            return outs

        full = logits(list(range(8)))
        for rows in ([3], [0], [2, 5], [7, 1, 4]):
            for part, whole in zip(logits(rows), full):
                whole = whole[:, rows]
                if prop == "bitwise":
                    assert torch.equal(part, whole), (rows, prop)
                else:
                    rel = float((part - whole).abs().max() / whole.abs().max())
                    assert rel <= 1e-5, (rows, prop, rel)
        if prop == "bitwise":
            decoder = instantiate(cfg.suite.sd, model=model)
            batch = decoder.generate_batch(prompts, list(range(8)))
            for k in (0, 5):
                alone = decoder.generate(prompts[k], k)
                assert torch.equal(alone.tokens, batch[k].tokens), (k, prop)
                assert alone.stats.accepted_hist == batch[k].stats.accepted_hist
    finally:
        torch.set_num_threads(old)


@pytest.mark.invariance
@pytest.mark.parametrize("row_block", [1, 4])
@pytest.mark.parametrize("decoder", ["lantern", "coolsd"])
@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_an_image_of_the_default_run_is_bitwise_the_same_alone_and_among_rows_of_other_lengths(decoder, row_block):
    """The default run's batch of images 52–83 (class names cycled, seed = index) on the shipped model, whose rows
    have other lengths at every iteration. Where the self-check passes: images 60, 52 and 83 alone equal their
    tokens in that batch (image 60 under LANTERN differed at token 43 before ``padding_invariant_attention``:
    the drafter's single-query steps attended over its neighbours' longer rows). Where it fails: the documented
    weaker property, an image's tokens change between batch 1 and a batch with probability at most 2 % (measured
    0.3–1.3 % per decoder where the self-check fails, README), on images 0–49 alone against one batch of 50: a
    one-sided binomial test that fails at 6 or more changed images, false-alarm probability 4.8e-4 at 2 %."""
    from hydra.utils import instantiate

    from tests.helpers import invariance_property

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the suite's workers share the cores (the logits test covers 2 threads)
    try:
        model, cfg = shipped_model(**{"model.row_block": row_block})
        prop = invariance_property(model)
        dec = instantiate(cfg.suite[decoder], model=model)
        if prop == "bitwise":
            index = list(range(52, 84))
            prompts = [model.class_names[i % 10] for i in index]
            batch = dec.generate_batch(prompts, index)
            assert len({g.stats.iterations for g in batch}) > 1
            for k in (60, 52, 83):
                alone = dec.generate(prompts[k - 52], k)
                assert torch.equal(alone.tokens, batch[k - 52].tokens), (k, prop)
                assert alone.stats.accepted_hist == batch[k - 52].stats.accepted_hist, k
        else:
            index = list(range(50))
            prompts = [model.class_names[i % 10] for i in index]
            differ = [i for i, gen in zip(index, dec.generate_batch(prompts, index))
                      if not torch.equal(gen.tokens, dec.generate(prompts[i], i).tokens)]
            assert len(differ) <= 5, (prop, differ)
    finally:
        torch.set_num_threads(old)


def test_model_batch_invariant_false_keeps_the_default_layout_and_attention():
    """``model.batch_invariant=false``: row-major weights in the target and the loaded EAGLE head, and the
    decoding loop runs without ``padding_invariant_attention``; the default (true) stores them column-major."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import coolsd.decoding as decoding
    from tests.helpers import CONFIGS

    seen = []
    real = decoding.padding_invariant_attention

    def spy(enabled=True):
        seen.append(enabled)
        return real(enabled)

    for flag in (False, True):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"model.batch_invariant={str(flag).lower()}"])
        model = instantiate(cfg.model)
        dec = instantiate(cfg.suite.sd, model=model)
        weights = [model.gpt.layers[0].attention.wqkv.weight, dec.drafter.head.fc.weight]
        assert all(w.is_contiguous() != flag for w in weights)
        decoding.padding_invariant_attention = spy
        try:
            dec.generate_batch(["bag"], [0])
        finally:
            decoding.padding_invariant_attention = real
        assert seen[-1] is flag
