"""Spatial generation orders (``coolsd.orders``): ZipAR's fixed window on the loop's order seam.

The schedule samples every cell once from inputs already generated; with a window of the grid width it is
plain AR forward for forward, and the decoder gives AR's tokens bitwise (the same inputs, positions, masks and
per-cell draws) on every adapter that runs it. The attention masks the model receives never show a query a slot
that is not a generated token at or before its own cell (or itself), nor hide one that is. An image is the same
alone and inside a batch. Lumina-mGPT and drafted decoders are refused before any work. About 20 s on 2 cores.
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from coolsd.kv_cache import StaticKVCache
from coolsd.orders import RowWindow
from tests.helpers import CONFIGS

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


@pytest.mark.parametrize("model_name", ["embedded", "tiny", "llamagen_t2i_tiny", "janus_tiny"])
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


@pytest.mark.parametrize("model_name", ["embedded", "llamagen_t2i_tiny", "janus_tiny"])
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
    with pytest.raises(Exception, match="Lumina"):
        build("lumina_tiny")
