"""Spatial generation orders (``coolsd.orders``): ZipAR's fixed window and PJD on the loop's order seam.

The schedule samples every cell once from inputs already generated; with a window of the grid width it is
plain AR forward for forward, and the decoder gives AR's tokens bitwise (the same inputs, positions, masks and
per-cell draws) on every adapter that runs it. The attention masks the model receives never show a query a slot
that is not a generated token at or before its own cell (or itself), nor hide one that is. An image is the same
alone and inside a batch; on Lumina-mGPT a stand-in is hidden from the end-of-row token after it (whose output
is the new row's first distribution, as the reference's end-of-row lead). Models that cannot take grid cells and
masks, and drafted decoders, are refused before any work.

PJD (``RowJacobi``): with ``context`` = the grid width it is SJD row by row, exact: Pearson chi-square of
``N_EXACT`` images per prompt (seeds 0.., batches of 1, 3 and 8) against the lookup model's exact sequence
distribution, ``ALPHA`` = 1e-3 the probability that a correct implementation fails for a random choice of seeds.
Every cache slot it keeps holds the token finally committed at its cell, and the masks the attention receives
show each query the prompt, the committed tokens before its cell and its own row's earlier drafts (a stand-in:
the committed tokens only), and itself.
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from coolsd.kv_cache import StaticKVCache
from coolsd.orders import RowJacobi, RowWindow
from tests.helpers import CONFIGS, chi_square_pvalue

PROMPTS = {"embedded": ["t-shirt", "bag", "sandal"], "tiny": ["1", "2", "3"]}


def build(model_name: str, decoder: str = "zipar", overrides=()):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model_name}", f"decoder={decoder}", *overrides])
    model = instantiate(cfg.model)
    return model, instantiate(cfg.decoder, model=model)


def prompts_for(model) -> list[str]:
    names = getattr(model, "class_names", None)
    return list(names[:3]) if names else ["a red cube", "two cats", "a boat"]


@pytest.mark.parametrize("grid", [(7, 7), (4, 6), (5, 3)])
@pytest.mark.parametrize("window", [1, 2, 3, 8])
@pytest.mark.parametrize("stand_in", ["row_above", "reference"])
def test_the_schedule_samples_every_cell_once_from_generated_inputs(grid, window, stand_in):
    order = RowWindow(grid, window, stand_in=stand_in)
    rows, cols = grid
    generated = {0}
    slots: list[int] = []
    for step in order.schedule():
        outs = [f.out for f in step.feeds if f.out is not None]
        assert outs, "a forward that samples nothing"
        for f in step.feeds:
            assert f.source in generated, (f, generated)  # only generated tokens are fed
            assert f.keep == (f.source == f.cell)  # a stand-in (another cell's token) never stays
            if f.out is not None:  # the next cell in raster order (a stand-in sits at the row above's end)
                assert f.out == f.cell + 1 and f.out not in generated, f
        assert len(set(outs)) == len(outs)
        slots += [f.cell for f in step.feeds if f.keep]
        generated.update(outs)
    assert generated == set(range(rows * cols))
    assert len(set(slots)) == len(slots)  # no cell enters the cache twice
    if window >= cols:  # plain raster AR, forward for forward
        assert [[(f.cell, f.out) for f in s.feeds] for s in order.schedule()] == [[(i, i + 1)] for i in
                                                                                 range(rows * cols - 1)]
        assert all(s.visible is None for s in order.schedule())
    else:
        assert len(order.schedule()) < rows * cols - 1


def test_rows_start_at_the_window_and_keep_their_lag():
    order = RowWindow((4, 8), 3)
    lead = {}  # first forward that samples each row
    for i, step in enumerate(order.schedule()):
        for f in step.feeds:
            if f.out is not None:
                lead.setdefault(f.out // 8, i)
    assert [lead[r] for r in range(4)] == [0, 2, 5, 8]  # row r + 1 starts when row r has 3 tokens
    ar_first = RowWindow((4, 8), 3, first_row_ar=True)
    firsts = [next(i for i, s in enumerate(ar_first.schedule()) for f in s.feeds if f.out == 8)]
    assert firsts == [7]  # row 1 waits for a complete row 0 (the LlamaGen port)


@pytest.mark.parametrize("model_name", ["embedded", "tiny", "llamagen_t2i_tiny", "janus_tiny", "lumina_tiny", "emu3_tiny"])
def test_a_window_of_the_grid_width_gives_plain_ar_tokens(model_name):
    model, _ = build(model_name)
    _, ar = build(model_name, "ar")
    width = model.grid[1]
    zipar = instantiate({"_target_": "coolsd.decoding.Decoder", "name": "zipar", "draft_len": 0,
                         "rule": {"_target_": "baselines.exact.ExactRule"},
                         "order": {"_target_": "coolsd.orders.RowWindow", "_partial_": True, "window": width}},
                        model=model)
    prompts = prompts_for(model)
    expected = ar.generate_batch(prompts, [3, 4, 5])
    got = zipar.generate_batch(prompts, [3, 4, 5])
    for a, z in zip(expected, got):
        assert torch.equal(a.tokens, z.tokens)
        assert z.stats.target_forwards == a.stats.target_forwards == model.num_image_tokens


@pytest.mark.parametrize("model_name", ["embedded", "llamagen_t2i_tiny", "janus_tiny", "lumina_tiny", "emu3_tiny"])
def test_zipar_runs_in_fewer_forwards_and_an_image_is_the_same_alone_and_in_a_batch(model_name):
    model, dec = build(model_name, overrides=["decoder.order.window=2"])
    prompts = prompts_for(model)
    batch = dec.generate_batch(prompts, [0, 1, 2])
    n = model.num_image_tokens
    for i, g in enumerate(batch):
        alone = dec.generate(prompts[i], i)
        assert torch.equal(alone.tokens, g.tokens)
        assert g.tokens.shape == (n,) and int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size
        assert g.stats.target_forwards == len(dec.order.schedule()) + 1 < n
        assert g.stats.num_tokens == n


def test_no_query_sees_a_slot_it_must_not(monkeypatch):
    """The additive masks the cache hands the attention, compared with what each query may see: the prompt,
    every generated token at or before its own cell in raster order, and itself; nothing else (unwritten or
    free slots, stand-ins of other queries, tokens of rows below)."""
    model, dec = build("embedded", overrides=["decoder.order.window=2"])
    masks = []
    original = StaticKVCache.begin_block

    def recording(self, num_tokens, tree_mask=None):
        start = self.lengths[0]
        mask = original(self, num_tokens, tree_mask)
        masks.append((start, num_tokens, mask))
        return mask

    monkeypatch.setattr(StaticKVCache, "begin_block", recording)
    dec.generate_batch(["coat", "dress"], [7, 8])
    prefix = masks[0][0] + masks[0][1]  # the prefill block: the prompt's slots
    steps = dec.order.schedule()
    assert len(masks) == len(steps) + 1
    cells: list[int] = []  # the cell of every image slot after the prefix, in cache order
    for (start, t, mask), step in zip(masks[1:], steps):
        assert start == prefix + len(cells)
        feeds = step.feeds
        for i, f in enumerate(feeds):
            may = set(range(prefix)) | {prefix + j for j, c in enumerate(cells) if c <= f.cell}
            may |= {start + j for j, g in enumerate(feeds) if (g.keep and g.cell <= f.cell) or j == i}
            if mask is None:  # plain causal attention over every slot up to the query
                seen = set(range(start + i + 1))
            else:
                seen = set((mask[0, 0, i] == 0).nonzero().flatten().tolist())
            assert seen == may, (step, i)
        cells += [f.cell for f in feeds if f.keep]


def test_bad_orders_are_refused_before_any_work():
    with pytest.raises(Exception, match="decoder.order.window"):
        build("embedded", overrides=["decoder.order.window=0"])
    with pytest.raises(Exception, match="decoder.order.stand_in"):
        build("embedded", overrides=["decoder.order.stand_in=left"])
    from baselines.exact import ExactRule
    from baselines.jacobi import JacobiDrafter
    from coolsd.decoding import Decoder

    model, _ = build("embedded")
    with pytest.raises(ValueError, match="decoder.draft_len=0 and decoder.drafter=null"):
        Decoder("zipar", model, ExactRule(), draft_len=2, drafter=JacobiDrafter(model), order=RowWindow(model.grid, 2))
    from coolsd.models.lookup import LookupModel

    lookup = LookupModel(vocab=2, grid=(2, 2), seed=0)  # reads prefixes in cache order: no spatial orders
    with pytest.raises(ValueError, match="does not run on LookupModel"):
        Decoder("zipar", lookup, ExactRule(), order=RowWindow(lookup.grid, 1))
    for decoder, bad in [("pjd", "decoder.order.context=0"), ("pjd", "decoder.order.draft_window=0"),
                         ("zipar_adaptive", "decoder.order.window=0"), ("zipar_adaptive", "decoder.order.adaptive=2")]:
        with pytest.raises(Exception, match=bad.split("=")[0]):
            build("embedded", decoder, overrides=[bad])
    for decoder in ("pjd", "zipar_adaptive"):
        with pytest.raises(Exception, match="does not run on LookupModel"):
            ordered(lookup, "RowJacobi" if decoder == "pjd" else "AdaptiveRowWindow",
                    **({"context": 2} if decoder == "pjd" else {"window": 1}))


# -- PJD ------------------------------------------------------------------------------------------------------------
ALPHA = 1e-3
N_EXACT = 3000


def ordered(model, target: str, **options):
    return instantiate({"_target_": "coolsd.decoding.Decoder", "name": "spatial", "draft_len": 0,
                        "rule": {"_target_": "baselines.exact.ExactRule"},
                        "order": {"_target_": f"coolsd.orders.{target}", "_partial_": True, **options}}, model=model)


def pjd(model, context: int, window: int):
    return ordered(model, "RowJacobi", context=context, draft_window=window)


def test_pjd_with_a_context_of_the_grid_width_is_exact():
    """One row at a time, each decoded by SJD (random drafts, q one-hot; refreshed drafts from the outputs):
    the sequence distribution is AR's. The lookup model reads each query's prefix from the visible slots in
    cache order, which is raster order here (rows complete in order), so it may run this order."""
    from coolsd.models.lookup import LookupModel
    from tests.test_batched import PROMPTS, mixed_batches

    model = LookupModel(vocab=2, grid=(3, 2), seed=5, scale=1.5, sampling=dict(cfg_scale=2.0), prompts=PROMPTS)
    model.spatial_orders = True
    dec = pjd(model, context=2, window=2)
    counts = {p: torch.zeros(2 ** model.num_image_tokens) for p in PROMPTS}
    forwards = 0
    for prompts, seeds in mixed_batches(N_EXACT, (1, 3, 8)):
        for prompt, gen in zip(prompts, dec.generate_batch(prompts, seeds)):
            counts[prompt][model.sequence_index(gen.tokens)] += 1
            forwards += gen.stats.target_forwards
    for p in PROMPTS:
        assert chi_square_pvalue(counts[p], model.exact_sequence_probs(p)) > ALPHA, p
    assert forwards < N_EXACT * model.num_image_tokens  # drafts were accepted


@pytest.mark.parametrize("model_name", ["embedded", "llamagen_t2i_tiny", "janus_tiny", "lumina_tiny", "emu3_tiny"])
def test_pjd_runs_in_fewer_forwards_and_an_image_is_the_same_alone_and_in_a_batch(model_name):
    model, _ = build(model_name)
    dec = pjd(model, context=2, window=3)
    prompts = prompts_for(model)
    batch = dec.generate_batch(prompts, [0, 1, 2])
    n = model.num_image_tokens
    for i, g in enumerate(batch):
        alone = dec.generate(prompts[i], i)
        assert torch.equal(alone.tokens, g.tokens)
        assert alone.stats.target_forwards == g.stats.target_forwards < n
        assert g.tokens.shape == (n,) and int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size
        assert sum(g.stats.accepted_hist) == g.stats.iterations == g.stats.target_forwards - 1


@pytest.mark.parametrize("context, window", [(2, 3), (1, 7), (7, 4)])
def test_pjd_caches_only_committed_tokens_and_masks_drafts_of_other_rows(monkeypatch, context, window):
    """Per forward (batch 1): the plan's inputs (``RowJacobi.plan``), the tokens fed, the additive mask the
    cache hands the attention and the slots it keeps. Every kept slot holds the token the image finally has at
    that cell and no cell is kept twice; each query sees exactly the prompt, the kept slots before its cell,
    this forward's committed inputs before its cell, its own row's drafts before it (for a draft or an anchor;
    a stand-in sees none) and itself: never a draft of another row, another query's stand-in, a padding input
    or a row below."""
    model, _ = build("embedded")
    dec = pjd(model, context, window)
    n, cols = model.num_image_tokens, model.grid[1]
    events = []
    plan, begin, keep = RowJacobi.plan, StaticKVCache.begin_block, StaticKVCache.keep
    forward = type(model).forward_block

    def planning(self, state, b):
        feeds, chains, fresh = plan(self, state, b)
        events.append(("plan", list(feeds)))
        return feeds, chains, fresh

    def forwarding(self, cache, tokens, positions, tree_mask=None):
        events.append(("fed", tokens[0].tolist(), positions[0].tolist()))
        return forward(self, cache, tokens, positions, tree_mask)

    def beginning(self, num_tokens, tree_mask=None):
        mask = begin(self, num_tokens, tree_mask)
        events.append(("mask", self.block_starts[0], num_tokens, mask))
        return mask

    def keeping(self, counts, index=None):
        count = counts if isinstance(counts, int) else counts[0]
        events.append(("keep", list(range(count)) if index is None else index[0, :count].tolist()))
        return keep(self, counts, index)

    monkeypatch.setattr(RowJacobi, "plan", planning)
    monkeypatch.setattr(type(model), "forward_block", forwarding)
    monkeypatch.setattr(StaticKVCache, "begin_block", beginning)
    monkeypatch.setattr(StaticKVCache, "keep", keeping)
    for prompt, seed in [("coat", 7), ("dress", 8)]:
        events.clear()
        final = dec.generate(prompt, seed).tokens.tolist()
        assert events[0][0] == "mask"  # the prefill's block
        _, start, t, _ = events[0]
        prefix = start + t
        kinds = [e[0] for e in events[1:]]
        assert kinds == ["plan", "fed", "mask", "keep"] * (len(kinds) // 4) and len(kinds) % 4 == 0
        cells: list[int] = []  # the cell of every kept image slot, in cache order
        for k in range(1, len(events), 4):
            (_, feeds), (_, fed, positions), (_, start, t, mask), (_, index) = events[k: k + 4]
            assert start == prefix + len(cells) and t >= len(feeds)
            assert positions[: len(feeds)] == [f.cell for f in feeds]
            for q, f in enumerate(feeds):
                draft = f.source >= n
                standin = f.group <= -3  # a new row's first input, at the end-of-row cell of the row above
                assert not (standin or draft) or not f.committed
                if not draft:  # a generated token: at its own cell, or a stand-in's (the row above's latest)
                    assert fed[q] == final[f.source] and (standin or f.source == f.cell)
                    if standin:
                        assert f.cell % cols == cols - 1 and f.source // cols == f.cell // cols
                may = set(range(prefix)) | {prefix + j for j, c in enumerate(cells) if c < f.cell}
                for j, g in enumerate(feeds):
                    own_draft = g.source >= n and g.cell // cols == f.cell // cols and not standin
                    if j == q or (g.cell < f.cell and (g.committed or own_draft)):
                        may.add(start + j)
                seen = set((mask[0, 0, q] == 0).nonzero().flatten().tolist())
                assert seen == may, (k, q, f)
            for q in range(len(feeds), t):  # padding: itself only
                assert set((mask[0, 0, q] == 0).nonzero().flatten().tolist()) == set(range(prefix)) | {start + q}
            for j in index:
                f = feeds[j]
                assert fed[j] == final[f.cell], (k, f)  # a kept draft is the token committed there
                cells.append(f.cell)
        assert len(set(cells)) == len(cells) and set(cells) < set(range(n))


# -- ZipAR on the dynamic engine: the fixed window as RowWindow, the adaptive window ------------------------------
@pytest.mark.parametrize("model_name", ["embedded", "llamagen_t2i_tiny", "janus_tiny", "lumina_tiny", "emu3_tiny"])
def test_the_dynamic_engine_gives_the_fixed_window_s_tokens_and_the_adaptive_window_of_the_grid_width_is_ar(
        model_name):
    """``AdaptiveRowWindow(adaptive=False)`` feeds the same tokens at the same cells with the same visibility as
    the static ``RowWindow`` schedule (a stand-in and a finished row's last token as two queries instead of one)
    and draws each cell's token with plain AR's draw: the same tokens bitwise and the same forwards. With the
    window at the grid width, rows run one after another and the adaptive test never has an incomplete row
    above: plain AR's tokens."""
    model, ar = build(model_name, "ar")
    prompts = prompts_for(model)
    for window in (1, 2):
        static = ordered(model, "RowWindow", window=window).generate_batch(prompts, [0, 1, 2])
        dynamic = ordered(model, "AdaptiveRowWindow", window=window, adaptive=False).generate_batch(prompts, [0, 1, 2])
        for a, b in zip(static, dynamic):
            assert torch.equal(a.tokens, b.tokens) and a.stats.target_forwards == b.stats.target_forwards
    full = ordered(model, "AdaptiveRowWindow", window=model.grid[1]).generate_batch(prompts, [3, 4, 5])
    for a, b in zip(ar.generate_batch(prompts, [3, 4, 5]), full):
        assert torch.equal(a.tokens, b.tokens) and b.stats.target_forwards == model.num_image_tokens


def test_the_adaptive_window_verifies_first_tokens_and_an_image_is_the_same_alone_and_in_a_batch(monkeypatch):
    """On the embedded model: rejections happen (a row waits, so the adaptive window takes more forwards than the
    fixed one on some image and never fewer on average) and an image is the same alone and in a batch."""
    from coolsd import acceptance

    model, _ = build("embedded")
    prompts = ["coat", "dress", "bag", "sneaker"]
    adaptive = ordered(model, "AdaptiveRowWindow", window=1)
    tests = []
    verify = acceptance.verify_chain

    def counting(rule, p, draft, u_accept, u_sample):
        verdict = verify(rule, p, draft, u_accept, u_sample)
        tests.append((int(draft.valid.sum()), int(verdict.num_accepted.sum())))
        return verdict

    monkeypatch.setattr("coolsd.orders.verify_chain", counting)
    batch = adaptive.generate_batch(prompts, [0, 1, 2, 3])
    fixed = ordered(model, "AdaptiveRowWindow", window=1, adaptive=False).generate_batch(prompts, [0, 1, 2, 3])
    tested = sum(t for t, _ in tests)
    accepted = sum(a for t, a in tests if t)
    assert tested > 0 and 0 < accepted < tested  # first tokens were tested; some passed, some did not
    assert sum(g.stats.target_forwards for g in batch) > sum(g.stats.target_forwards for g in fixed)
    for i, g in enumerate(batch):
        assert torch.equal(adaptive.generate(prompts[i], i).tokens, g.tokens)
        assert g.stats.target_forwards < model.num_image_tokens


@pytest.mark.parametrize("decoder, options", [("RowWindow", {"window": 1}), ("AdaptiveRowWindow", {"window": 1}),
                                              ("RowJacobi", {"context": 1, "draft_window": 1})])
def test_on_lumina_a_stand_in_is_hidden_from_its_end_of_row_token(monkeypatch, decoder, options):
    """Lumina-mGPT predicts a row's first code from the end-of-row token after the row above; a stand-in at the
    row above's last cell (another cell's token) must not be seen by it, so the stand-in's mask row excludes
    itself, while the real last token of a complete row sees itself as in AR. (Orders without drafts at row
    ends, so an input there that is not the image's final token is a stand-in.)"""
    model, _ = build("lumina_tiny")
    cols, n = model.grid[1], model.num_image_tokens
    forward, seen = type(model).forward_block, []

    def recording(self, cache, tokens, positions, tree_mask=None):
        seen.append((tokens[0].tolist(), positions[0].tolist(), None if tree_mask is None else tree_mask))
        return forward(self, cache, tokens, positions, tree_mask)

    monkeypatch.setattr(type(model), "forward_block", recording)
    final = ordered(model, decoder, **options).generate("a red cube", 4).tokens.tolist()
    stand_ins = 0
    for tokens, positions, mask in seen:
        assert mask is not None or len(positions) == 1
        k = None if mask is None else mask[0] if mask.dim() == 3 else mask
        for i, (token, cell) in enumerate(zip(tokens, positions)):
            if k is None or cell % cols != cols - 1 or i >= len(positions):
                continue
            sees_itself = bool(k[i, k.shape[1] - k.shape[0] + i])
            if token != final[cell]:  # a stand-in
                stand_ins += 1
                assert not sees_itself, (positions, i)
    assert stand_ins > 0 and n == len(final)
