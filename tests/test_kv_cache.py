"""Static KV cache: cached incremental forwards equal the uncached forward; rollback and compaction; a batch
of images with their own lengths equals the images one at a time."""
from __future__ import annotations

import torch

from coolsd.kv_cache import StaticKVCache
from tests.helpers import forward1, keep1, prefill1

TOKENS = torch.tensor([5, 17, 200, 3, 99, 42, 7, 255, 0, 11, 64, 128])


def uncached(model, tokens):
    """Teacher-forced pass (no cache) over [condition, tokens]: logits (S, len, V) for positions 0..len."""
    label = torch.tensor([model.class_index("three"), model.cfg.num_classes])
    ext = torch.cat([tokens, tokens[:1]])  # forward_train drops the last input; pad so every output exists
    logits, hidden = model.gpt.forward_train(ext.expand(2, -1), label)
    return logits, hidden


def test_cached_incremental_equals_uncached(tiny_model):
    full_logits, full_hidden = uncached(tiny_model, TOKENS)
    cache, out = prefill1(tiny_model, "three")
    outs = [out.logits]
    pos = 0
    for size in (1, 3, 1, 4, 2):  # blocks of different sizes, as speculative verification produces
        block = TOKENS[pos : pos + size]
        outs.append(forward1(tiny_model, cache, block, torch.arange(pos, pos + size)).logits)
        cache.keep(size)
        pos += size
    cached = torch.cat(outs, dim=1)  # (S, 1 + pos, V)
    torch.testing.assert_close(cached, full_logits[:, : pos + 1], rtol=1e-9, atol=1e-9)


def test_rollback_then_reforward_equals_original(tiny_model):
    cache, _ = prefill1(tiny_model, "three")
    first = forward1(tiny_model, cache, TOKENS[:5], torch.arange(5))
    cache.keep(2)  # reject three of the five: the next forward must not see them
    branch = torch.tensor([77, 78, 79])
    after = forward1(tiny_model, cache, branch, torch.arange(2, 5))
    expected, _ = uncached(tiny_model, torch.cat([TOKENS[:2], branch]))
    torch.testing.assert_close(after.logits, expected[:, 3:6], rtol=1e-9, atol=1e-9)
    cache.rollback(cache.prefix_len)  # back to just after the prefill, then redo the first block
    again = forward1(tiny_model, cache, TOKENS[:5], torch.arange(5))
    torch.testing.assert_close(again.logits, first.logits, rtol=0, atol=0)


def test_keep_indices_compacts_block():
    cache = StaticKVCache(num_layers=1, batch=1, num_heads=1, max_len=10, head_dim=2,
                          dtype=torch.float32, device="cpu")
    cache.begin_block(2)
    cache.write(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    cache.keep(2)
    cache.begin_block(4)
    vals = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 1, 4, 2)
    cache.write(0, vals, vals + 10)
    keep1(cache, torch.tensor([1, 3]))
    assert cache.lengths[0] == 4
    assert cache.k[0, 0, 0, 2:4, 0].tolist() == [1.0, 3.0]
    assert cache.v[0, 0, 0, 2:4, 0].tolist() == [11.0, 13.0]


def test_mask_is_causal_within_block_and_respects_padding():
    cache = StaticKVCache(num_layers=1, batch=1, num_heads=1, max_len=8, head_dim=2,
                          dtype=torch.float32, device="cpu")
    cache.set_padding(torch.tensor([[False, True]]))
    mask = cache.begin_block(2) == 0  # additive: 0 = visible, -inf = hidden
    assert mask[0, 0].tolist() == [[True, False], [False, True]]  # padded slot 0 sees itself only
    cache.keep(2)
    mask = cache.begin_block(2) == 0
    assert mask[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    cache.keep(0)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    mask = cache.begin_block(3, tree) == 0
    assert mask[0, 0, :, 2:].tolist() == tree.tolist()


def test_batched_teacher_force_equals_the_per_sample_default(tiny_model):
    from coolsd.models.base import ImageARModel

    tokens = torch.stack([TOKENS, TOKENS.flip(0), TOKENS.roll(3)])  # (3, 12)
    prompts = ["one", "two", "nine"]
    batched = tiny_model.teacher_force(prompts, tokens)
    reference = ImageARModel.teacher_force(tiny_model, prompts, tokens)
    assert batched.shape == (3, 2, 13, tiny_model.hidden_size)
    torch.testing.assert_close(batched, reference, rtol=1e-9, atol=1e-9)


def test_a_batch_with_its_own_lengths_equals_each_image_alone(tiny_model):
    """Three images whose committed lengths differ (different accepted counts), a chain block, a tree block
    with per-image masks, tree compaction per image and dropping an image: logits equal per-image runs."""
    prompts = ["one", "four", "nine"]
    g = torch.Generator().manual_seed(4)
    cache, _ = tiny_model.prefill(prompts)
    singles = [prefill1(tiny_model, p)[0] for p in prompts]
    first = torch.randint(1024, (3, 4), generator=g)
    tiny_model.forward_block(cache, first, torch.arange(4).expand(3, -1))
    kept = [1, 4, 2]
    cache.keep(kept)
    for i, c in enumerate(singles):
        forward1(tiny_model, c, first[i], torch.arange(4))
        c.keep(kept[i])
    assert cache.lengths == [c.lengths[0] for c in singles]
    # a tree block: root plus three nodes, different tree shapes per image
    masks = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]],
                          [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
                          [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    depth = masks.sum(-1) - 1
    nodes = torch.randint(1024, (3, 4), generator=g)
    positions = torch.tensor(kept)[:, None] - 1 + 1 + depth  # the root is the last committed token
    out = tiny_model.forward_block(cache, nodes, positions, masks)
    for i, c in enumerate(singles):
        ref = forward1(tiny_model, c, nodes[i], positions[i], masks[i])
        torch.testing.assert_close(out.logits[:, i], ref.logits, rtol=1e-9, atol=1e-9)
    paths = torch.tensor([[0, 1, 2], [0, 2, 3], [0, 3, 0]])
    counts = [3, 3, 2]
    cache.keep(counts, paths)
    for i, c in enumerate(singles):
        keep1(c, paths[i, : counts[i]])
    cache.select([2, 0])  # image 1 finished
    nxt = torch.randint(1024, (2, 2), generator=g)
    pos = torch.tensor([[kept[2] + 1, kept[2] + 2], [kept[0] + 2, kept[0] + 3]])
    out = tiny_model.forward_block(cache, nxt, pos)
    for row, i in enumerate([2, 0]):
        ref = forward1(tiny_model, singles[i], nxt[row], pos[row])
        torch.testing.assert_close(out.logits[:, row], ref.logits, rtol=1e-9, atol=1e-9)
