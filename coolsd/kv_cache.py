"""Static, preallocated key/value cache for a batch of images: per-row lengths, rollback and compaction.

Every layer owns a slice of one ``(layers, B·S, H, S_max, D)`` buffer: ``B`` images (prompt rows), each with
``S`` classifier-free-guidance streams, laid out image-major (cache row ``b·S + s``). Every image has its own
committed length. A forward over ``T`` new tokens per image writes slots ``[length_b, length_b + T)`` of row
``b`` (a *block*) and attends to that row's committed slots plus, inside the block, a causal mask or an
explicit per-row tree mask. After verification the caller keeps a subset of each row's block: a prefix
(chains: a pointer move, stale slots are overwritten later) or an ordered subset (trees: the kept slots are
copied to be contiguous again). Finished images leave the batch (``select``): the caller fills their places
with images from the end of the batch, so only those move and the buffers shrink to a prefix view.

Design after pytorch-labs/gpt-fast ``model.py: KVCache`` and EAGLE ``kv_cache.py`` (copy-on-accept).

Example: used by every model adapter; ``pytest tests/test_kv_cache.py`` checks cached == uncached.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import torch

#: inside ``padding_invariant_attention``: the fewest key slots a forward attends to (masked beyond each row's
#: length). On this project's x86_64 CPU (AVX-512, 16 floats per vector) PyTorch's softmax gave a row of fewer
#: than 16 keys other last bits alone than padded with masked keys inside a batch whose longest row is longer
#: (measured: 23 of 220 (length, padding) pairs); from 16 keys up padding never changed a bit (0 of 9,042).
MIN_ATTENTION_WIDTH = 16
_PADDING_INVARIANT = contextvars.ContextVar("padding_invariant_attention", default=False)


@contextlib.contextmanager
def padding_invariant_attention(enabled: bool = True):
    """Inside: every row's attention output is bitwise independent of how far its batch neighbours are.

    A speculative batch attends every row over the longest row's keys, the others' masked, so on a CPU a row's
    float32 sums changed in the last bits with its neighbours' lengths. Inside this context (a) a block attends
    to at least ``MIN_ATTENTION_WIDTH`` keys and (b) written-out attention (``attention_context("matmul")``)
    runs a single query as two equal ones: MKL multiplies one query row (``q Kᵀ``, ``p V``) with kernels whose
    sums depend on the number of keys (measured: 84–96 of 144 (length, padding) pairs differ), two or more
    rows with one that does not (0 of 144). The decoding loop enables it for drafting and verification;
    plain AR, whose rows always have equal lengths, runs without it. PyTorch's SDPA kernels
    (``attention_kernel`` auto or math, the real models) are not changed by it.
    """
    token = _PADDING_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _PADDING_INVARIANT.reset(token)


def padding_invariant() -> bool:
    """Whether ``padding_invariant_attention`` is on."""
    return _PADDING_INVARIANT.get()


class StaticKVCache:
    """Preallocated K/V for ``num_layers`` layers, ``batch`` images and ``streams`` CFG streams per image."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        streams: int = 1,
    ) -> None:
        rows = streams * batch
        shape = (num_layers, rows, num_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_valid = torch.ones(rows, max_len, dtype=torch.bool, device=device)
        self.has_padding = False
        self.max_len = max_len
        self.num_layers = num_layers
        self.streams = streams
        self.lengths = [0] * batch  # committed slots per image
        self.block_starts = [0] * batch  # first slot of the latest block per image
        self.block_len = 0
        self._slots: torch.Tensor | None = None  # (B·S, T) slot of every block token when starts differ
        self._end = 0  # keys the block attends to
        self._start = 0  # the block's first slot when every row's block starts there
        self._views: tuple | None = None  # per-layer views of the latest block (``_block_views``), built lazily
        self._slot_cache: tuple | None = None  # its slots, token-major (``block_slots``)
        self._token_views: tuple | None = None  # token-major views of the whole cache (``_token_major``)
        self._causal: torch.Tensor | None = None  # (max_len, max_len) additive causal mask, built lazily

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def _rows(self, per_image: torch.Tensor) -> torch.Tensor:
        """A per-image tensor (B, ...) repeated for every stream -> per cache row (B·S, ...), image-major."""
        return per_image.repeat_interleave(self.streams, dim=0) if self.streams > 1 else per_image

    # -- one forward ------------------------------------------------------------------------------------
    def begin_block(self, num_tokens: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Reserve ``num_tokens`` slots per image; return the attention mask (B·S, 1, T, end) or None.

        The mask is additive (0 where a query may attend, −inf elsewhere) in the cache's dtype: the form the
        attention kernels take without converting it in every layer.

        ``tree_mask`` (T, K) shared or (B, T, K) per image, bool, K >= T, covers each row's last K slots
        (earlier speculative blocks, then this block): ``tree_mask[i, j]`` = new token i may attend to slot
        ``end_b − K + j`` (it must include i itself). Older slots are committed and visible unless marked as
        padding. ``None`` means causal inside the block. The mask is ``None`` when plain attention to every
        cached slot is correct (one new token per row, equal lengths, no padded prefix): SDPA's fast path.
        """
        starts = self.lengths
        t = num_tokens
        last = max(starts) + t
        if last > self.max_len:
            raise RuntimeError(f"KV cache overflow: need {last} slots, cache holds {self.max_len}")
        end = min(max(last, MIN_ATTENTION_WIDTH), self.max_len) if padding_invariant() else last
        self.block_starts, self.block_len, self.lengths = list(starts), t, [s + t for s in starts]
        self._end, self._start = end, last - t
        self._views = self._slot_cache = None
        uniform = min(starts) == last - t  # every row's block at the same slots
        self._slots = None
        if not uniform:
            device = self.k.device
            start_t = self._rows(torch.tensor(starts, device=device))
            self._slots = start_t[:, None] + torch.arange(t, device=device)  # (B·S, T)
        if tree_mask is None and not self.has_padding and uniform:
            if t == 1 and end == last:
                return None
            # causal inside the block, every committed slot visible, the free slots up to ``end`` masked: the
            # rows [last − t, last) of one additive causal matrix (the values the general construction gives)
            return self._causal_mask()[last - t: last, :end].expand(self.k.shape[1], 1, t, end).clone()
        device = self.k.device
        block = torch.ones(t, t, dtype=torch.bool, device=device).tril() if tree_mask is None \
            else tree_mask.to(device=device, dtype=torch.bool)
        k = block.shape[-1]
        valid = self.key_valid[:, :end]  # (B·S, end)
        if uniform:  # one window for every row: slice assignments, no gathers
            mask = valid[:, None, :].expand(-1, t, -1).clone()  # (B·S, T, end)
            win = block if block.dim() == 2 else self._rows(block)
            mask[..., last - k: last] &= win
            idx = torch.arange(t, device=device)
            mask[:, idx, last - t + idx] = True  # a padded query still attends to itself (LlamaGen's diagonal)
            mask[..., last:] = False  # the free slots up to the attended width
            return self._additive(mask)
        ends = self._rows(torch.tensor(self.lengths, device=device))  # (B·S,)
        col = torch.arange(end, device=device)
        rel = col[None, :] - (ends - k)[:, None]  # (B·S, end): column inside each row's window
        old = (rel < 0) & valid
        block = block.expand(self.batch, -1, -1) if block.dim() == 2 else block
        padded = torch.cat([self._rows(block), torch.zeros_like(block[:1, :, :1]).expand(
            self.streams * self.batch, t, 1)], dim=-1)  # (B·S, T, K + 1): column K is "not in the window"
        where = torch.where((rel >= 0) & (rel < k), rel, torch.full_like(rel, k))
        win = padded.gather(-1, where[:, None, :].expand(-1, t, -1)) & valid[:, None, :]
        mask = old[:, None, :] | win  # (B·S, T, end)
        mask.scatter_(-1, self._slots[:, :, None], True)
        return self._additive(mask)

    def _causal_mask(self) -> torch.Tensor:
        """(max_len, max_len) additive mask in the cache's dtype: 0 where key slot j <= query slot i, −inf above."""
        if self._causal is None:
            self._causal = torch.full((self.max_len, self.max_len), float("-inf"), dtype=self.k.dtype,
                                      device=self.k.device).triu_(1)
        return self._causal

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Boolean visibility (B·S, T, end) -> the additive attention mask (B·S, 1, T, end)."""
        return torch.zeros(visible.shape, dtype=self.k.dtype, device=visible.device).masked_fill_(
            ~visible, float("-inf")).unsqueeze(1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the block's K/V (B·S, H, T, D) for ``layer``; return all K/V up to the block end."""
        end = self._end
        if self._slots is None:
            s = self._start
            self.k[layer, :, :, s:s + self.block_len] = k
            self.v[layer, :, :, s:s + self.block_len] = v
        else:
            rows = torch.arange(self._slots.shape[0], device=k.device)[:, None]
            self.k[layer][rows, :, self._slots] = k.transpose(1, 2)
            self.v[layer][rows, :, self._slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def _block_views(self) -> tuple:
        """Per-layer views of the latest block's K and V up to the attended end (B·S, H, end, D), built once per
        block."""
        if self._views is None:
            end = self._end
            if self.num_layers == 1:  # an EAGLE drafter's cache: index the one layer (no unbind)
                self._views = ((self.k[0, :, :, :end],), (self.v[0, :, :, :end],))
            else:
                self._views = (self.k[:, :, :, :end].unbind(0), self.v[:, :, :, :end].unbind(0))
        return self._views

    def _slot_views(self) -> tuple:
        """Per-layer views of the latest block's slots, token-major (B·S, T, H, D), when every row's block starts
        at the same slot; sliced from token-major views of the whole cache, built once per cache tensor
        (``_token_major``)."""
        s, t = self._start, self.block_len
        k, v = self._token_major()
        if self.num_layers == 1:
            return (k[:, s:s + t],), (v[:, s:s + t],)
        return k[:, :, s:s + t].unbind(0), v[:, :, s:s + t].unbind(0)

    def _token_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V token-major ((L,) B·S, max_len, H, D); rebuilt when ``select`` has replaced the cache tensors."""
        cached = self._token_views
        if cached is None or cached[0] is not self.k or cached[1] is not self.v:
            k, v = (self.k[0], self.v[0]) if self.num_layers == 1 else (self.k, self.v)
            cached = self._token_views = (self.k, self.v, k.transpose(-3, -2), v.transpose(-3, -2))
        return cached[2], cached[3]

    def block_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The latest block's K/V slots of ``layer`` as writable token-major views (B·S, T, H, D), or None when
        the rows' blocks start at different slots (then ``write_tokens``). After writing them, ``attended``
        gives what the block attends to."""
        if self._slots is not None:
            return None
        if self._slot_cache is None:
            self._slot_cache = self._slot_views()
        return self._slot_cache[0][layer], self._slot_cache[1][layer]

    def write_tokens(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write`` for token-major K/V (B·S, T, H, D), as projections produce them (no transposes); K/V of another
        dtype (a float32 rotation of a bf16 model's keys) are rounded to the cache's."""
        slots = self.block_slots(layer)
        if slots is not None:
            slots[0].copy_(k)
            slots[1].copy_(v)
        else:
            rows = torch.arange(self._slots.shape[0], device=k.device)[:, None]
            self.k[layer][rows, :, self._slots] = k.to(self.k.dtype)
            self.v[layer][rows, :, self._slots] = v.to(self.v.dtype)
        return self.attended(layer)

    def attended(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``layer`` up to the latest block's attended end (B·S, H, end, D) (views, as ``write``)."""
        views = self._block_views()
        return views[0][layer], views[1][layer]

    # -- after verification -----------------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, counts: Sequence[int] | int, index: torch.Tensor | None = None) -> None:
        """Keep part of every image's latest block: the first ``counts[b]`` tokens, or the block indices
        ``index[b, :counts[b]]`` ((B, n) long; entries past a row's count are ignored), copied in order to the
        start of the block (KV compaction of an accepted tree path); the rest becomes free space."""
        if isinstance(counts, int):
            counts = [counts] * self.batch
        if any(not 0 <= c <= self.block_len for c in counts):
            raise ValueError(f"keep({list(counts)}) outside the latest block of {self.block_len} tokens")
        starts = self.block_starts
        self.lengths = [s + c for s, c in zip(starts, counts)]
        if index is None or index.shape[-1] == 0:
            return
        device = self.k.device
        index = index.to(device, torch.long)
        n = index.shape[1]
        if torch.equal(index, torch.arange(n, device=device).expand_as(index)):
            return
        start_t = torch.tensor(starts, device=device)[:, None]
        src = self._rows(start_t + index)  # (B·S, n)
        dst = self._rows(start_t + torch.arange(n, device=device))
        rows = torch.arange(src.shape[0], device=device)[:, None]
        # gather first, then scatter: a kept slot may be another one's destination
        self.k[:, rows, :, dst] = self.k[:, rows, :, src]
        self.v[:, rows, :, dst] = self.v[:, rows, :, src]

    def rollback(self, lengths: Sequence[int] | int) -> None:
        """Forget every slot at or after ``lengths[b]`` of each image (a pointer move)."""
        if isinstance(lengths, int):
            lengths = [lengths] * self.batch
        if any(not 0 <= n <= c for n, c in zip(lengths, self.lengths)):
            raise ValueError(f"rollback to {list(lengths)} but the cache holds {self.lengths} slots")
        self.lengths = list(lengths)

    def set_padding(self, key_valid: torch.Tensor) -> None:
        """Mark prefix slots (B·S, P) as valid keys or padding (left-padded prompts)."""
        p = key_valid.shape[1]
        self.key_valid[:, :p] = key_valid.to(self.key_valid.device, torch.bool)
        self.has_padding = not bool(key_valid.all())

    @torch.inference_mode()
    def select(self, images: Sequence[int]) -> None:
        """Keep only the listed images (positions in the batch), in that order; the others leave the batch.

        Only images whose position changes are copied; the buffers become views of their first rows, so a
        caller that fills the places of finished images with the last ones (``swap_remove``) moves little.
        """
        images = list(images)
        device = self.k.device
        s = self.streams
        moved = [(j, i) for j, i in enumerate(images) if i != j]
        if moved:
            dst = torch.tensor([j * s + r for j, _ in moved for r in range(s)], device=device)
            src = torch.tensor([i * s + r for _, i in moved for r in range(s)], device=device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            self.key_valid[dst] = self.key_valid[src]
        rows = len(images) * s
        self.k, self.v, self.key_valid = self.k[:, :rows], self.v[:, :rows], self.key_valid[:rows]
        self.has_padding = not bool(self.key_valid.all())
        self.lengths = [self.lengths[i] for i in images]
        self.block_starts = [self.block_starts[i] for i in images]


#: the granule of ``bucket``: key slots are attended in multiples of it
BUCKET_GRANULE = 128


def bucket(length: int, capacity: int, granule: int = BUCKET_GRANULE) -> int:
    """The smallest multiple of ``granule`` that holds ``length`` key slots, at most ``capacity``: the span a
    static step attends to when its caller knows every row's block ends by ``length`` (one graph per bucket)."""
    return min(capacity, -(-length // granule) * granule)


def swap_remove(count: int, finished: Sequence[int]) -> list[int]:
    """The order of the images that stay when ``finished`` (positions in a batch of ``count``) leave: every
    place of a finished image is filled by one of the last images, the rest keep their places."""
    gone = set(finished)
    keep = count - len(gone)
    tail = [i for i in range(keep, count) if i not in gone]
    return [tail.pop() if i in gone else i for i in range(keep)]


class DeviceKVCache:
    """The static decode path's cache (``coolsd.static``): K/V of its own per layer, every length on the device.

    A ``StaticKVCache`` keeps each image's committed length in a host list and attends to the keys up to the
    longest row's end; this one keeps the lengths in a (B,) tensor, attends every block to the whole capacity (or
    to a bucket of it, ``span``) with a mask computed on the device from the lengths, writes a block's K/V at each
    row's own slots with one index copy per layer, and moves lengths in place. No value of a step depends on a
    tensor's contents, so a step over it can be captured in a CUDA graph or compiled with ``fullgraph=True``, and
    replayed: every tensor it holds is updated in place (``lengths``, ``starts``) and never replaced.

    Each layer's K and V is a tensor of its own (``keys``, ``values``), not a view of one buffer of every layer:
    a compiled step that writes into a view of a graph input is rewritten by functionalization into a copy of the
    whole base (the step then copied the cache of every layer at every token, its cost growing with the cache's
    capacity: measured at 256 tokens on a CPU), where a write into an input of its own is done in place.

    Built over a prefilled ``StaticKVCache`` (``of``: its committed slots copied once) or refilled by ``load`` for
    each batch of the same size. A row's block starts at its length; a chain's rejected tail is dropped by moving
    the length (the next block overwrites it), a tree's accepted path is compacted by ``keep`` with an index.
    Rows that have finished stay in the batch and keep nothing (``keep`` with a count of 0).

    Where an image's tokens sit in the sequence: ``prefix_len``, the prefix slots every image has (a Python
    number: LlamaGen's condition tokens), and, where a prefill's cache carries each image's own prompt length
    (``prefix_lens`` (B,): left-padded prompts, Janus-Pro's ``JanusCache``), ``prefix_lens`` (B,) on the
    device, copied by ``load`` and ``load_rows`` with the slots (None for caches without it).

    Example: ``DeviceKVCache.of(model.prefill(prompts, extra_slots=8)[0])``, then ``model.static_forward``.
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], key_valid: torch.Tensor,
                 streams: int, prefix_len: int = 0, prefix_lens: bool = False) -> None:
        """``prefix_lens``: whether the cache keeps each image's prompt length on the device (class doc)."""
        self.keys, self.values = tuple(keys), tuple(values)  # L × (B·S, H, S_max, D), a storage each
        self.key_valid = key_valid  # (B·S, S_max)
        self.num_layers = len(self.keys)
        rows, _, self.max_len, _ = self.keys[0].shape
        self.streams = streams
        self.prefix_len = prefix_len
        device = self.keys[0].device
        self.lengths = torch.zeros(rows // streams, dtype=torch.long, device=device)  # (B,) committed slots
        #: (B,) each image's prompt length (its image token i at sequence position prefix_lens[b] + i) or None
        self.prefix_lens = torch.zeros_like(self.lengths) if prefix_lens else None
        self.starts = torch.zeros_like(self.lengths)  # (B,) first slot of the latest block
        self.block_len = 0
        self.has_padding = False
        #: the key slots a block attends to, ``[0, span)``: the whole capacity, or a bucket that its caller knows
        #: holds every row's block end (a Python number: one compiled or captured graph per bucket)
        self.span = self.max_len
        self._columns = torch.arange(self.max_len, device=device)  # (S_max,)
        self._row_index = torch.arange(rows, device=device)[:, None]  # (B·S, 1)
        self._slots: torch.Tensor | None = None  # (B·S, T) the latest block's slots
        self._frames: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ``_frame``'s columns per block width
        #: the additive mask's two values (visible, masked) in the cache's dtype
        self._mask_values = (torch.zeros((), dtype=self.dtype, device=device),
                             torch.full((), float("-inf"), dtype=self.dtype, device=device))

    @classmethod
    def of(cls, cache: StaticKVCache) -> "DeviceKVCache":
        """Buffers of its own, shaped as a prefilled cache's, holding its committed slots and lengths."""
        out = cls.like(cache)
        out.load(cache)
        return out

    @classmethod
    def like(cls, cache: StaticKVCache) -> "DeviceKVCache":
        """Empty buffers of a prefilled cache's shape, dtype and device (``load`` fills them)."""
        layer = cache.k[0]
        return cls([torch.zeros_like(layer) for _ in range(cache.k.shape[0])],
                   [torch.zeros_like(layer) for _ in range(cache.v.shape[0])], torch.ones_like(cache.key_valid),
                   cache.streams, getattr(cache, "prefix_len", 0), _prefix_lens(cache) is not None)

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def load(self, cache: StaticKVCache) -> None:
        """Copy a prefilled cache (of this shape) into these buffers, in place: its committed slots, padding,
        lengths and prompt lengths (the tail of the buffers is stale and masked until overwritten)."""
        self._check_source(cache, "load")
        end = max(cache.lengths)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            keys[:, :, :end].copy_(cache.k[layer, :, :, :end])
            values[:, :, :end].copy_(cache.v[layer, :, :, :end])
        self.key_valid.copy_(cache.key_valid)
        self.lengths.copy_(torch.tensor(cache.lengths))
        if self.prefix_lens is not None:
            self.prefix_lens.copy_(_prefix_lens(cache))
        self.has_padding = cache.has_padding

    def _check_source(self, cache: StaticKVCache | DeviceKVCache, what: str) -> None:
        """A cache to copy from must place image tokens as these buffers do: the same prefix slots, and prompt
        lengths exactly where these buffers keep them."""
        prefix = getattr(cache, "prefix_len", 0)
        if prefix != self.prefix_len:
            raise ValueError(f"{what}: the cache's prefix holds {prefix} slots, these buffers' "
                             f"{self.prefix_len}: image positions would shift")
        if (_prefix_lens(cache) is None) != (self.prefix_lens is None):
            which = "only the cache" if self.prefix_lens is None else "only these buffers"
            raise ValueError(f"{what}: {which} keep each image's prompt length (prefix_lens): image "
                             "positions would shift")

    def load_rows(self, rows: torch.Tensor, cache: "StaticKVCache | DeviceKVCache") -> None:
        """Copy the ``R`` images of another cache of this capacity into the images ``rows`` (R,) (long, on this
        cache's device) of these buffers, in place: their committed slots (every CFG stream's: image ``rows[i]``
        owns cache rows ``rows[i]·S .. rows[i]·S + S − 1``), padding, lengths and prompt lengths. The other
        images are untouched, and no buffer is replaced, so a compiled or captured step over this cache stays
        valid: the static path's refilling of finished rows (``StaticLoop.generate_stream``). A
        ``StaticKVCache`` (a prefill's) is copied up to its longest image, a ``DeviceKVCache`` (lengths on the
        device, not read) over its whole capacity.

        Example: ``ws.cache.load_rows(torch.tensor([2, 0]), model.prefill(["cat", "dog"], extra_slots=8)[0])``."""
        r = rows.shape[0]
        device = isinstance(cache, DeviceKVCache)
        source_len = cache.max_len
        if cache.streams != self.streams or source_len != self.max_len or cache.batch != r:
            raise ValueError(f"load_rows: a cache of {cache.batch} image(s) x {cache.streams} stream(s) and "
                             f"{source_len} slots into {r} row(s) of one of {self.streams} stream(s) and "
                             f"{self.max_len} slots")
        self._check_source(cache, "load_rows")
        s = self.streams
        cache_rows = (rows[:, None] * s + torch.arange(s, device=rows.device)).flatten()  # (R·S,) image-major
        end = self.max_len if device else max(cache.lengths)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            source_k = cache.keys[layer] if device else cache.k[layer]  # (R·S, H, S_max, D)
            source_v = cache.values[layer] if device else cache.v[layer]
            keys[cache_rows, :, :end] = source_k[:, :, :end].to(keys.dtype)
            values[cache_rows, :, :end] = source_v[:, :, :end].to(values.dtype)
        self.key_valid[cache_rows] = cache.key_valid.to(self.device, torch.bool)
        lengths = cache.lengths if device else torch.tensor(cache.lengths, device=self.device)
        self.lengths.index_copy_(0, rows, lengths)
        if self.prefix_lens is not None:
            self.prefix_lens.index_copy_(0, rows, _prefix_lens(cache).to(self.prefix_lens))
        self.has_padding = self.has_padding or cache.has_padding

    def _rows(self, per_image: torch.Tensor) -> torch.Tensor:
        return per_image.repeat_interleave(self.streams, dim=0) if self.streams > 1 else per_image

    # -- one forward ------------------------------------------------------------------------------------
    def begin_block(self, num_tokens: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Reserve ``num_tokens`` slots per image at its length; return the additive mask (B·S, 1, T, span) over the
        first ``span`` key slots (``span``: the whole capacity unless a caller set a bucket that holds every block).

        ``tree_mask`` as ``StaticKVCache.begin_block``: (T, K) shared or (B, T, K) per image over each row's last
        K slots up to the block end (``None``: causal inside the block); older slots are visible unless padding.
        """
        t = num_tokens
        self.block_len = t
        self.starts.copy_(self.lengths)
        start = self._rows(self.lengths)  # (B·S,)
        self._slots = (start[:, None] + self._columns[:t]).clamp(max=self.max_len - 1)  # (B·S, T)
        columns = self._columns[:self.span]  # (span,)
        if tree_mask is None:  # causal: key slot j visible to block token i iff j <= start + i
            visible = columns <= self._slots[:, :, None]  # (B·S, T, span)
        else:
            # the window framed by a visible column (older slots) and a masked one (free slots): one gather at
            # each key slot's column in the frame gives the visibility of every slot
            k = tree_mask.shape[-1]
            old, free = self._frame(t)
            window = tree_mask if tree_mask.dtype == torch.bool else tree_mask.to(torch.bool)
            if window.dim() == 3:
                window = self._rows(window)
                old, free = old.expand(window.shape[0], -1, -1), free.expand(window.shape[0], -1, -1)
            framed = torch.cat([old, window, free], -1)  # (T, K + 2) or (B·S, T, K + 2)
            column = (columns - (start + (t - k - 1))[:, None]).clamp(0, k + 1)  # (B·S, span)
            visible = framed.expand(start.shape[0], -1, -1).gather(-1, column[:, None, :].expand(-1, t, -1))
        # (always: a captured step serves batches with and without padding)
        visible = visible & self.key_valid[:, None, :self.span]
        self.lengths.add_(t)
        return torch.where(visible, self._mask_values[0], self._mask_values[1]).unsqueeze(1)

    def _frame(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1) columns of True and of False (built once per block width)."""
        frame = self._frames.get(t)
        if frame is None:
            frame = self._frames[t] = (torch.ones(t, 1, dtype=torch.bool, device=self.device),
                                       torch.zeros(t, 1, dtype=torch.bool, device=self.device))
        return frame

    def block_slots(self, layer: int) -> None:
        """Never contiguous views (rows start at their own slots): ``write_tokens`` writes."""
        return None

    def write_tokens(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the block's token-major K/V (B·S, T, H, D) at its slots (rounded to the cache's dtype); return the
        layer's K/V over the attended slots (B·S, H, span, D)."""
        keys, values = self.keys[layer], self.values[layer]
        keys[self._row_index, :, self._slots] = k.to(keys.dtype)
        values[self._row_index, :, self._slots] = v.to(values.dtype)
        return self._spanned(keys), self._spanned(values)

    def _spanned(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.span == self.max_len else x[:, :, :self.span]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_tokens`` for head-major K/V (B·S, H, T, D)."""
        return self.write_tokens(layer, k.transpose(1, 2), v.transpose(1, 2))

    def attended(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._spanned(self.keys[layer]), self._spanned(self.values[layer])

    # -- after verification -----------------------------------------------------------------------------
    def keep(self, counts: torch.Tensor | int, index: torch.Tensor | None = None) -> None:
        """Keep the first ``counts[b]`` tokens (B,) of each image's latest block, or its block indices
        ``index[b, :counts[b]]`` ((B, n), compacted to the block's start with one gather and one scatter per layer's
        K and V)."""
        self.lengths.copy_(self.starts + counts)
        if index is None:
            return
        n = index.shape[1]
        start = self._rows(self.starts)[:, None]  # (B·S, 1)
        src = (start + self._rows(index)).clamp(max=self.max_len - 1)  # (B·S, n)
        dst = (start + self._columns[:n]).clamp(max=self.max_len - 1)
        rows = self._row_index
        for buffer in (*self.keys, *self.values):
            buffer[rows, :, dst] = buffer[rows, :, src]  # gather first, then scatter

    def rollback(self, lengths: torch.Tensor) -> None:
        """Forget every slot at or after ``lengths[b]`` (B,) (a pointer move)."""
        self.lengths.copy_(lengths)


def _prefix_lens(cache: StaticKVCache | DeviceKVCache) -> torch.Tensor | None:
    """A cache's per-image prompt lengths (B,) (``DeviceKVCache``'s class doc), or None where it has none."""
    lens = getattr(cache, "prefix_lens", None)
    return lens if isinstance(lens, torch.Tensor) else None
