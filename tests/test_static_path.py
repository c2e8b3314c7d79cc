"""The static decode path (``decoder.path=static``, ``coolsd.static``): the eager path's tokens, no host read inside
a step, whole-step compilation without graph breaks or recompilation, exactness, and clear refusals.

Statistical tests (seeds fixed, so each outcome is deterministic; ``ALPHA`` = 1e-3 is the probability that a
correct implementation fails for a random choice of seeds, per test and per prompt):

* ``test_static_path_lossless_decoders_are_exact``: on the tiny LlamaGen shrunk to 4 codes on a 2 x 2 grid
  (``enumerable_llamagen``: 256 grids, 81 in the top-k support, per prompt), the exact grid distribution by
  teacher forcing; ``N_QUICK`` images per lossless static decoder in batches of 8 mixing two prompts (``N_FULL``
  in the ``-m slow`` pass, and ``N_ALONE`` at batch 1); Pearson chi-square per prompt, cells of expected count
  below 5 pooled.
* ``test_static_path_exactness_test_rejects_a_broken_residual``: the same test must reject SD that resamples from
  p after a rejection.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.kv_cache import DeviceKVCache, bucket
from coolsd.models.llamagen import LlamaGen
from coolsd.static import StaticLoop
from coolsd.static.capture import Runner
from coolsd.sync_guard import HostReadError, SyncGuard, host_read
from coolsd.types import TargetOutput
from tests.helpers import CONFIGS, chi_square_pvalue, forward1, invariance_property, prefill1, tiny_llamagen
from tests.test_lossless import ResampleFromTarget

ALPHA = 1e-3
N_QUICK = 1000
N_FULL = 8000
N_ALONE = 600
BATCH = 8
#: the decoders of the default run and the Jacobi family: every decoder whose step the static path runs
STATIC = ("ar", "sd", "lantern", "lantern_pp", "coolsd", "sjd", "scd_mc", "scd_gs", "gsd")
#: the tree decoders: the suite's with a tree (label -> suite name, overrides), and SJD-PAC's window tree
TREES = {"sd_static_tree": ("sd", {"tree": "naive_extend_57"}), "sd_dynamic_tree": ("sd", {"tree": "dynamic"}),
         "lantern_dynamic_tree": ("lantern", {"tree": "dynamic"}),
         "lantern_pp_static_tree": ("lantern_pp", {"tree": "naive_extend_57"}),
         "coolsd_eagle1_tree": ("coolsd", {"tree": "mc_sim_7b_63"}), "sjd_pac": ("sjd_pac", {})}
STEP_NAMES = {"ar": "ar", "sjd": "jacobi_window", "scd_mc": "jacobi_window", "scd_gs": "jacobi_window",
              "gsd": "jacobi_window", "sjd_pac": "jacobi_window"}
PROMPTS = ["dress", "bag", "sneaker", "coat"]
#: every static decoder; LANTERN's EAGLE-2 tree only in the -m slow pass (SD's EAGLE-2 tree runs the same step and
#: LANTERN's relaxed rule runs on its chain and static tree in the default pass)
CASES = [pytest.param(name, marks=pytest.mark.slow) if name == "lantern_dynamic_tree" else name
         for name in (*STATIC, *TREES)]


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (float32) and its suite's configs, composed as ``run.py`` composes them."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.device=cpu"])
    return instantiate(cfg.model), cfg


def build(cfg, model, name: str, path: str) -> Decoder:
    """A suite decoder, or a tree decoder of ``TREES``, on ``path``."""
    base, overrides = TREES.get(name, (name, {}))
    node = OmegaConf.to_container(cfg.suite[base], resolve=True)
    node.update(overrides, path=path)
    return instantiate(node, model=model)


def same_generation(a, b, tv_rel: float = 1e-12) -> bool:
    """The same tokens and statistics (the summed TV up to float64 rounding: a tree's tests are summed per sibling
    rank on the static path, per walk step on the eager one; ``tv_rel`` = 1e-5 where the kernels are not
    batch-invariant, so float32 rounding moves the probabilities the TV is computed from: 2e-8 to 3e-7 relative
    on a 2-core AMD EPYC, tokens equal)."""
    fields = ("iterations", "accepted_hist", "target_forwards", "drafter_forwards", "tv_steps")
    return (torch.equal(a.tokens, b.tokens) and all(getattr(a.stats, f) == getattr(b.stats, f) for f in fields)
            and math.isclose(a.stats.tv_sum, b.stats.tv_sum, rel_tol=tv_rel, abs_tol=1e-15))


def eager_and_static_pairs(eager: Decoder, static: Decoder, prompts, alone: int, tv_rel: float) -> list[tuple]:
    """``prompts`` as one batch (seeds 3, 4, ...) and ``prompts[alone]`` alone (seed 7) on both paths: the same
    generations (``same_generation``; where the machine's linears are not batch-invariant, at most one differs);
    returns the (eager, static) pairs, the batch's first."""
    from coolsd.static.loop import static_refusal

    assert static_refusal(static) is None and static.static is not None
    seeds = [3 + i for i in range(len(prompts))]
    pairs = list(zip(eager.generate_batch(prompts, seeds), static.generate_batch(prompts, seeds)))
    pairs.append((eager.generate(prompts[alone], 7), static.generate(prompts[alone], 7)))
    differ = [i for i, (a, b) in enumerate(pairs) if not same_generation(a, b, tv_rel)]
    bitwise = invariance_property(eager.model) == "bitwise"
    assert not differ if bitwise else len(differ) <= 1, f"static != eager for images {differ}"
    assert [b.stats.batch_size for _, b in pairs] == [len(prompts)] * len(prompts) + [1]
    return pairs


@pytest.mark.parametrize("name", CASES)
def test_static_path_gives_the_eager_tokens_and_statistics(embedded, name):
    """On the embedded model in float32 every static decoder (chains, Jacobi windows, static and EAGLE-2 trees,
    SJD-PAC's window tree) gives the eager decoder's tokens and statistics (iterations, accepted-length histogram,
    forwards, TV), alone and in a batch of 4 whose images finish at different iterations. Where the machine's
    kernels are not batch-invariant (``invariance_property``) float32 rounding may flip a rare token: at most one
    image of five may then differ."""
    model, cfg = embedded
    eager, static = build(cfg, model, name, "eager"), build(cfg, model, name, "static")
    assert static.static.step_name == STEP_NAMES.get(name, "tree" if name in TREES else "chain")
    seeds = [3, 4, 5, 6]
    pairs = list(zip(eager.generate_batch(PROMPTS, seeds), static.generate_batch(PROMPTS, seeds)))
    pairs.append((eager.generate(PROMPTS[0], 7), static.generate(PROMPTS[0], 7)))
    bitwise = invariance_property(model) == "bitwise"
    differ = [i for i, (a, b) in enumerate(pairs) if not same_generation(a, b, 1e-12 if bitwise else 1e-5)]
    if bitwise:
        assert not differ, f"static != eager for images {differ}"
    else:
        assert len(differ) <= 1, f"static != eager for images {differ}"
    assert all(b.stats.batch_size == (4 if i < 4 else 1) for i, (_, b) in enumerate(pairs))
    assert all(b.stats.latency_s > 0 for _, b in pairs)


@pytest.mark.parametrize("name", ["coolsd", pytest.param("sd_dynamic_tree", marks=pytest.mark.slow)])
def test_static_path_batched_equals_alone_and_reuses_its_workspace(embedded, name):
    """Images of a batch of 8 (two checked per batch) equal their alone decodes (a chain and an EAGLE-2 tree); a
    second batch of the same size reuses the first's workspace (buffers refilled in place) and still gives its images
    their alone tokens."""
    model, cfg = embedded
    static = build(cfg, model, name, "static")
    prompts = (PROMPTS * 2)[:8]
    first = static.generate_batch(prompts, list(range(8)))
    workspace = static.static._workspaces[8][0]
    second = static.generate_batch(prompts[::-1], list(range(8, 16)))
    assert static.static._workspaces[8][0] is workspace
    bitwise = invariance_property(model) == "bitwise"
    for batch, seeds, order in ((first, range(8), prompts), (second, range(8, 16), prompts[::-1])):
        rows = (0, 5) if batch is first else (3, 7)  # first, middle and last rows across the two batches
        checked = [(image, s, p) for i, (image, s, p) in enumerate(zip(batch, seeds, order)) if i in rows]
        differ = [s for image, s, p in checked if not torch.equal(image.tokens, static.generate(p, s).tokens)]
        assert not differ if bitwise else len(differ) <= 1, differ


# -- no host read inside a step ----------------------------------------------------------------------------
@pytest.mark.parametrize(("call", "kind"), [
    (lambda x: x.sum().item(), "item"), (lambda x: x.tolist(), "tolist"), (lambda x: bool(x[0] > 0), "__bool__"),
    (lambda x: int(x[0]), "__int__"), (lambda x: float(x[0]), "__float__"), (lambda x: x.nonzero(), "nonzero"),
    (lambda x: torch.equal(x, x), "equal"), (lambda x: x.cpu(), "cpu"), (lambda x: x[x > 1], "__getitem__ (boolean mask)"),
    (lambda x: torch.tensor([1, 2]), "tensor from Python data"), (lambda x: x[[0, 1]], "__getitem__ (Python list)"),
    (lambda x: x.to("cpu"), "to (a device)"), (lambda x: torch.where(x > 1), "where (one argument: nonzero)"),
    (lambda x: x.repeat_interleave(x), "repeat_interleave (tensor repeats)"),
    (lambda x: list(range(5))[x[1]], "__index__"),
])
def test_sync_guard_names_every_host_read(call, kind):
    """Each kind of host read the static path must not make is seen by the guard, named, and raised on."""
    x = torch.arange(4)
    guard = SyncGuard()
    with guard:
        call(x)
    assert guard.reads[kind] >= 1, dict(guard.reads)
    with pytest.raises(HostReadError, match="guarded decode step"), SyncGuard(strict=True):
        call(x)


def test_sync_guard_lets_device_arithmetic_pass():
    """Shape reads, factories on a device, gathers, scatters and in-place updates are not host reads."""
    x = torch.arange(6).view(2, 3)
    with SyncGuard(strict=True) as guard:
        y = torch.zeros(2, 3, dtype=torch.long, device=x.device)
        y.scatter_(1, x.argmax(1, keepdim=True), 1)
        torch.where(y > 0, x, -x).cumsum(1).gather(1, torch.zeros(2, 1, dtype=torch.long))
        _ = x.shape[1] + len(x)
        x.float().to(torch.float64)
    assert guard.total == 0
    assert host_read(torch.Tensor.to, (x, torch.float32), {}) is None


def guarded_decode(monkeypatch, decoder: Decoder, prompts, seeds) -> tuple[SyncGuard, int]:
    """Decode one batch with every host read of the static loop (its steps, its per-iteration read and the TV
    diagnostic; not the prefill or the final read of the statistics) counted; returns the guard and the number
    of step calls."""
    guard, calls = SyncGuard(), []
    decode = StaticLoop.decode

    def counted(self, ws, runner, clock):
        with guard:
            calls.append(decode(self, ws, runner, clock))
        return calls[-1]

    monkeypatch.setattr(StaticLoop, "decode", counted)
    decoder.generate_batch(prompts, seeds)
    return guard, calls[0]


def assert_static_reads(monkeypatch, static: Decoder, batches, ar_steps: int | None, reverse: bool = False) -> None:
    """For each ``(prompts, seeds)`` of ``batches``: one batch that builds the size's workspace and constants, then one
    more (its prompts reversed with ``reverse``, seeds + 10) under the guard: ``ar_steps`` given (AR): 0 host reads
    and that many step calls; else at most one read per step call, each whether the batch has finished."""
    for prompts, seeds in batches:
        static.generate_batch(prompts, seeds)
        guard, calls = guarded_decode(monkeypatch, static, prompts[::-1] if reverse else prompts,
                                      [s + 10 for s in seeds])
        monkeypatch.undo()
        if ar_steps is not None:
            assert guard.total == 0, guard.where[:3]
            assert calls == ar_steps
        else:
            assert guard.total <= calls and set(guard.reads) <= {"__bool__"}, guard.where[:3]


@pytest.mark.parametrize("name", CASES)
def test_sync_guard_static_steps_read_nothing_and_iterations_read_once(embedded, monkeypatch, name):
    """On the embedded model: 0 host reads in all of AR's steps; at most 1 per iteration of a chain, a tree or a
    Jacobi window (whether every image has finished), whatever the batch (1 and 3 images), after the first batch
    of a size has built its constants; the TV diagnostic of the relaxed rules included."""
    model, cfg = embedded
    static = build(cfg, model, name, "static")
    assert_static_reads(monkeypatch, static, ((PROMPTS[:1], [0]), (PROMPTS[:3], [1, 2, 3])),
                        model.num_image_tokens - 1 if name == "ar" else None)


# -- compiled whole on a CPU ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ar", "jacobi_window", "tree", "dynamic_tree"])
def test_static_path_steps_compile_whole_without_recompiling(kind):
    """Each step compiles with ``fullgraph=True, dynamic=False`` (a graph break raises) and is not recompiled
    across the positions of an image (first, middle, last), the accept outcomes of its iterations, or for a
    second batch of the same size (dynamo's ``error_on_recompile``); every image is complete. A minute or more each
    (``-m slow``); the chain's step, on every adapter with a static path: ``tests/test_adapters.py``."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_llamagen(dtype="float32")
    model.compile = True  # model.compile=true: the static step is compiled whole on a CPU
    eagle = lambda: EagleDrafter(model, head=EagleHead(model, init_seed=1))  # noqa: E731
    drafter = {"ar": None, "chain": eagle, "tree": eagle, "dynamic_tree": eagle,
               "jacobi_window": lambda: JacobiDrafter(model, init="random")}[kind]
    tree = {"tree": "mc_sim_7b_63", "dynamic_tree": "dynamic"}.get(kind)
    decoder = Decoder(kind, model, ExactRule(), draft_len=0 if drafter is None else 3, path="static",
                      drafter=None if drafter is None else drafter(), tree=tree,
                      dynamic_tree=dict(top_k=3, depth=3, total_tokens=10))
    assert decoder.static.mode == "compiled"
    assert decoder.static.step_name == {"dynamic_tree": "tree"}.get(kind, kind)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seeds in ([0, 1], [2, 3]):
            images = decoder.generate_batch(["one", "two"], seeds)
            assert all(int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size for g in images)
            assert all(sum(g.stats.accepted_hist) == g.stats.iterations for g in images)
    runner = decoder.static._workspaces[2][1]
    assert runner.calls > 2


@pytest.mark.slow
def test_compiled_tree_steps_give_the_eager_tokens_and_stay_compiled_beside_other_decoders():
    """The tree steps compile with inductor (a static and an EAGLE-2 tree, ``model.compile=true``) and give the
    eager path's tokens (an uncompiled twin of the model); interleaved with each other and with eager decoders,
    which fill the tree code's module-level caches with other shapes, neither compiled step recompiles (each static
    loop reads its own store of constants: ``StaticLoop._constants``)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, twin = tiny_llamagen(dtype="float32"), tiny_llamagen(dtype="float32")
    model.compile = True

    def decoder(m: LlamaGen, tree: str, path: str) -> Decoder:
        return Decoder("sd", m, ExactRule(), draft_len=3, path=path, tree=tree,
                       drafter=EagleDrafter(m, head=EagleHead(m, init_seed=1)),
                       dynamic_tree=dict(top_k=3, depth=3, total_tokens=10))

    trees = ("mc_sim_7b_63", "dynamic")
    static = {tree: decoder(model, tree, "static") for tree in trees}
    eager = {tree: decoder(twin, tree, "eager") for tree in trees}
    prompts = ["one", "two"]
    for tree in trees:  # compile each step (its first two calls) and fill the eager caches
        static[tree].generate_batch(prompts, [0, 1])
        eager[tree].generate_batch(prompts, [0, 1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seeds in ([2, 3], [4, 5]):
            for tree in trees:
                got = static[tree].generate_batch(prompts, seeds)
                want = eager[tree].generate_batch(prompts, seeds)
                assert all(torch.equal(g.tokens, w.tokens) for g, w in zip(got, want)), tree
    assert all(static[tree].static.mode == "compiled" and static[tree].static._workspaces[2][1].calls > 4
               for tree in trees)


# -- exactness ---------------------------------------------------------------------------------------------
EXACT_PROMPTS = ("one", "two")


def enumerable_llamagen() -> LlamaGen:
    """``configs/model/tiny.yaml`` shrunk until its images can be enumerated: 4 codes on a 2 x 2 grid, top-k 3
    (81 grids in the support of 256), CFG 2, float32; weights N(0, 0.05), so the grid distribution is neither flat
    nor one spike (entropies 4.0 and 3.5 nats of at most log 81 = 4.4, largest cell 0.16)."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))
    cfg.pop("_target_")
    cfg.pop("defaults", None)
    cfg["gpt"].update(vocab_size=4, block_size=4)
    cfg["vq"].update(codebook_size=4)
    cfg["sampling"].update(top_k=3)
    cfg.update(device="cpu", dtype="float32", init_std=0.05)
    return LlamaGen(**cfg)


def exact_grid_probs(model: LlamaGen, prompt: str) -> torch.Tensor:
    """Probability of every complete grid (V^N,), base-V raster order: the product of the guided distributions of
    the model teacher-forced on the grid's first N − 1 codes."""
    v, n = model.codebook_size, model.num_image_tokens
    step = {}
    for prefix in itertools.product(range(v), repeat=n - 1):
        cache, first = prefill1(model, prompt)
        out = forward1(model, cache, torch.tensor(prefix), torch.arange(n - 1))
        logits = torch.cat([first.logits, out.logits], dim=1)  # (S, N, V)
        probs = model.probs(TargetOutput(logits=logits[:, None], hidden=logits[:, None]))[0].double()
        for i in range(n):
            step[prefix[:i]] = probs[i]
    return torch.stack([torch.prod(torch.stack([step[grid[:i]][grid[i]] for i in range(n)]))
                        for grid in itertools.product(range(v), repeat=n)])


def static_lossless(model, chain: int = 2) -> dict[str, Decoder]:
    """Every lossless decoder the static path runs: AR, SD with a random EAGLE head's chain, the EAGLE-1 static tree
    and an EAGLE-2 dynamic tree, SJD, SJD-PAC (its K = 2, D = 3 tree, both branching levels full), SCD-MC, SCD-GS;
    drafts past the grid's end (4 tokens) are invalid, so the trees are cut by the limit; ``chain``: the EAGLE
    chain's L."""
    def jacobi(**options):
        return JacobiDrafter(model, **{"init": "random", **options})

    def eagle():
        return EagleDrafter(model, head=EagleHead(model, init_seed=4))

    return {
        "ar": Decoder("ar", model, ExactRule(), path="static"),
        "sd_eagle_chain": Decoder("sd", model, ExactRule(), draft_len=chain, path="static", drafter=eagle()),
        "sd_eagle_tree": Decoder("sd", model, ExactRule(), path="static", drafter=eagle(), tree="mc_sim_7b_63"),
        "sd_eagle_dynamic_tree": Decoder("sd", model, ExactRule(), path="static", drafter=eagle(), tree="dynamic",
                                         dynamic_tree=dict(top_k=2, depth=3, total_tokens=6)),
        "sjd_pac": Decoder("sjd_pac", model, ExactRule(), draft_len=7, path="static", drafter=jacobi(
            init="random_uniform_q", carry="maximal", tree_width=2, tree_depth=3)),
        "sjd": Decoder("sjd", model, ExactRule(), draft_len=3, drafter=jacobi(), path="static"),
        "scd_mc": Decoder("scd_mc", model, ExactRule(), draft_len=3, drafter=jacobi(carry="maximal"), path="static"),
        "scd_gs": Decoder("scd_gs", model, ExactRule(), draft_len=3, drafter=jacobi(carry="gumbel"), path="static"),
    }


@pytest.fixture(scope="module")
def enumerable():
    model = enumerable_llamagen()
    return model, {prompt: exact_grid_probs(model, prompt) for prompt in EXACT_PROMPTS}


def grid_pvalues(decoder: Decoder, model: LlamaGen, exact: dict, n: int, batch: int) -> dict[str, float]:
    """Chi-square p-value per prompt of ``n`` images (seeds 0..n−1, prompts alternating) in batches of ``batch``."""
    v = model.codebook_size
    counts = {prompt: torch.zeros(v ** model.num_image_tokens) for prompt in EXACT_PROMPTS}
    for start in range(0, n, batch):
        seeds = list(range(start, min(start + batch, n)))
        prompts = [EXACT_PROMPTS[s % 2] for s in seeds]
        for prompt, image in zip(prompts, decoder.generate_batch(prompts, seeds)):
            counts[prompt][sum(int(c) * v ** (model.num_image_tokens - 1 - i)
                               for i, c in enumerate(image.tokens.tolist()))] += 1
    for prompt in EXACT_PROMPTS:
        assert counts[prompt][exact[prompt] == 0].sum() == 0, "an image outside the top-k support"
    return {prompt: chi_square_pvalue(counts[prompt], exact[prompt]) for prompt in EXACT_PROMPTS}


@pytest.mark.parametrize(("n", "batch"), [(N_QUICK, BATCH), pytest.param(N_FULL, BATCH, marks=pytest.mark.slow),
                                          pytest.param(N_ALONE, 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ar", "sd_eagle_chain", "sd_eagle_tree", "sd_eagle_dynamic_tree", "sjd",
                                  "sjd_pac", "scd_mc", "scd_gs"])
def test_static_path_lossless_decoders_are_exact(enumerable, name, n, batch):
    """Pearson chi-square of ``n`` images per lossless static decoder against the exact grid distribution of
    each prompt (module doc). Seeds are fixed (0..n−1); the test fails when a p-value is below ``ALPHA`` = 1e-3,
    the false-alarm probability per prompt for a correct implementation and a random choice of seeds."""
    model, exact = enumerable
    for prompt in EXACT_PROMPTS:
        assert float(exact[prompt].sum()) == pytest.approx(1.0, abs=1e-6)
        assert int((exact[prompt] > 0).sum()) == 3 ** model.num_image_tokens
    pvalues = grid_pvalues(static_lossless(model)[name], model, exact, n, batch)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_static_path_exactness_test_rejects_a_broken_residual(enumerable):
    """Power check on the same model, seeds and ``N_QUICK``: static SD resampling from p instead of
    norm([p − q]_+) after a rejection gives a p-value below ``ALPHA`` for each prompt."""
    model, exact = enumerable
    broken = Decoder("broken", model, ResampleFromTarget(), draft_len=2, path="static",
                     drafter=EagleDrafter(model, head=EagleHead(model, init_seed=4)))
    assert max(grid_pvalues(broken, model, exact, N_QUICK, BATCH).values()) < ALPHA


# -- the cache and the refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("span", [None, 16])
def test_device_cache_blocks_equal_the_eager_cache(tiny_model, span):
    """A ``DeviceKVCache`` block (attention over the whole capacity, or over a bucket of 16 slots that holds every
    block, masks from device lengths, per-row writes) gives the outputs of ``StaticKVCache`` for rows of different
    lengths, a causal block and a tree block, and ``keep`` with an index compacts a path as the eager cache does."""
    model = tiny_model
    prompts = ["one", "two"]
    eager, _ = model.prefill(prompts, extra_slots=8)
    static = DeviceKVCache.of(model.prefill(prompts, extra_slots=8)[0])
    if span is not None:
        assert bucket(9, static.max_len, granule=8) == span and span < static.max_len
        static.span = span

    def both(tokens, positions, tree=None):
        out_e = model.forward_block(eager, tokens, positions, tree)
        with model.decode_context(), torch.inference_mode():
            out_s = model.static_forward(static, tokens, positions, tree)
        assert torch.allclose(out_e.logits, out_s.logits, atol=1e-10)
        assert torch.allclose(out_e.hidden, out_s.hidden, atol=1e-10)

    gen = torch.Generator().manual_seed(0)
    both(torch.randint(0, model.codebook_size, (2, 6), generator=gen), torch.arange(6).expand(2, -1))
    eager.keep([3, 5])  # rows of different lengths from here on
    with torch.inference_mode():
        static.keep(torch.tensor([3, 5]))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    both(torch.randint(0, model.codebook_size, (2, 4), generator=gen), torch.tensor([[3, 4, 4, 5], [5, 6, 6, 7]]),
         tree)
    index = torch.tensor([[0, 2, 3], [0, 2, 3]])  # the root and the path through node 2
    eager.keep([3, 3], index)
    with torch.inference_mode():
        static.keep(torch.tensor([3, 3]), index)
    both(torch.randint(0, model.codebook_size, (2, 1), generator=gen), torch.tensor([[6], [8]]))
    assert static.lengths.tolist() == eager.lengths


class EagerOnlyDrafter(Drafter):
    """A drafter of the eager loop only (``Drafter``'s ``static_*`` left unimplemented)."""

    def begin(self, prompts, prefill, first_tokens, streams) -> None:
        return None

    def propose(self, last_tokens, t, limit, depth, tree=None):
        raise NotImplementedError

    def observe(self, out, p, draft, verdict) -> None:
        return None

    def select(self, images) -> None:
        return None


def test_static_path_refuses_a_drafter_without_a_static_form(tiny_model):
    """A drafter without a static form is refused when the decoder is built, naming why and the eager path (a model
    drafter whose draft model has no static forward: ``tests/test_static_model_drafter.py``)."""
    with pytest.raises(ValueError, match=r"decoder.path=static.*EagerOnlyDrafter\) has no static form; use "
                                         r"decoder.path=eager"):
        Decoder("sd", tiny_model, ExactRule(), draft_len=2, path="static", drafter=EagerOnlyDrafter())


@pytest.mark.parametrize(("overrides", "reason"), [
    (["model=lookup", "decoder=ar"], "no static forward"),
    (["decoder=vvs", "decoder.tree=dynamic", "model.device=cpu"], "skip verification"),
])
def test_static_path_refuses_models_and_decoders_of_the_eager_path(overrides, reason):
    """A model without a static forward (the lookup model) and VVS are refused with the reason and the eager path
    (ZipAR's fixed and adaptive windows, PJD and the SV verifiers run static: ``tests/test_static_orders_sv.py``)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, "decoder.path=static"])
    model = instantiate(cfg.model)
    with pytest.raises(Exception, match=rf"(?s)decoder.path=static.*{reason}.*decoder.path=eager"):
        instantiate(cfg.decoder, model=model)


def test_runner_modes_are_checked():
    with pytest.raises(ValueError, match="static step mode"):
        Runner(lambda: None, "jit")


def test_static_path_refuses_a_drafter_cache_too_small_for_its_tree(tiny_model):
    """The static cache cannot stop an overflow inside a step: a drafter cache smaller than the largest iteration
    (pending pairs and every tree node) is refused when the decoder is built, naming the setting that fits."""
    with pytest.raises(ValueError, match=r"drafter.extra_slots=\d+ or more"):
        Decoder("sd", tiny_model, ExactRule(), path="static", tree="mc_sim_7b_63",
                drafter=EagleDrafter(tiny_model, head=EagleHead(tiny_model, init_seed=1), extra_slots=4))
