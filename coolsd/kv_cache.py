"""Static, preallocated key/value cache with a length pointer, rollback and compaction.

Every layer owns a slice of one ``(layers, B, H, S_max, D)`` buffer. A forward over ``T`` new tokens writes
slots ``[length, length + T)`` (a *block*) and attends to the committed slots plus, inside the block, a
causal mask or an explicit tree mask. After verification the caller keeps a subset of the block:
a prefix (chains; rollback is a pointer move, stale slots are overwritten later) or an arbitrary ordered
subset (trees; the kept slots are copied to be contiguous again).

Design after pytorch-labs/gpt-fast ``model.py: KVCache`` and EAGLE ``kv_cache.py`` (copy-on-accept).

Example: used by every model adapter; ``pytest tests/test_kv_cache.py`` checks cached == uncached.
"""
from __future__ import annotations

import torch


class StaticKVCache:
    """Preallocated K/V for ``num_layers`` layers and ``batch`` rows (the CFG streams live in the batch)."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, batch, num_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.has_padding = False
        self.max_len = max_len
        self.length = 0  # committed slots
        self.block_start = 0  # first slot of the latest block
        self.block_len = 0

    # -- one forward ------------------------------------------------------------------------------------
    def begin_block(self, num_tokens: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Reserve slots for ``num_tokens`` new tokens; return the attention mask (B, 1, T, end) or None.

        ``tree_mask`` (T, K) bool with K >= T covers the last K slots (earlier speculative blocks, then this
        block): ``tree_mask[i, j]`` = new token i may attend to slot ``end − K + j`` (it must include i itself).
        Older slots are committed and always visible. ``None`` means causal inside the block. The returned mask is ``None`` when plain attention to every
        cached slot is correct (a single new token and no padded prefix), which lets SDPA take its fast path.
        """
        start, end = self.length, self.length + num_tokens
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: need {end} slots, cache holds {self.max_len}")
        self.block_start, self.block_len, self.length = start, num_tokens, end
        if tree_mask is None and num_tokens == 1 and not self.has_padding:
            return None
        device = self.k.device
        mask = self.key_valid[:, None, None, :end].expand(-1, 1, num_tokens, -1).clone()  # (B, 1, T, end)
        if tree_mask is None:
            block = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
        else:
            block = tree_mask.to(device=device, dtype=torch.bool)
        mask[..., end - block.shape[-1] : end] &= block
        # a padded query still attends to itself, so its row is never empty (LlamaGen forces the diagonal)
        idx = torch.arange(num_tokens, device=device)
        mask[:, :, idx, start + idx] = True
        return mask

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the block's K/V (B, H, T, D) for ``layer``; return all K/V up to the block end."""
        s, e = self.block_start, self.block_start + self.block_len
        self.k[layer, :, :, s:e] = k
        self.v[layer, :, :, s:e] = v
        return self.k[layer, :, :, :e], self.v[layer, :, :, :e]

    # -- after verification -----------------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, kept: int | torch.Tensor) -> None:
        """Keep part of the latest block: its first ``kept`` tokens (int) or the listed block indices.

        Listed indices are copied, in order, to the start of the block (KV compaction of an accepted tree
        path); the rest of the block becomes free space.
        """
        start = self.block_start
        if isinstance(kept, int):
            if not 0 <= kept <= self.block_len:
                raise ValueError(f"keep({kept}) outside the latest block of {self.block_len} tokens")
            self.length = start + kept
            return
        kept = kept.to(self.k.device, torch.long)
        n = int(kept.numel())
        if n and not torch.equal(kept, torch.arange(n, device=kept.device)):
            src = start + kept
            self.k[:, :, :, start : start + n] = self.k[:, :, :, src]
            self.v[:, :, :, start : start + n] = self.v[:, :, :, src]
        self.length = start + n

    def rollback(self, length: int) -> None:
        """Forget every slot at or after ``length`` (a pointer move)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} but cache holds {self.length} slots")
        self.length = length

    def set_padding(self, key_valid: torch.Tensor) -> None:
        """Mark prefix slots (B, P) as valid keys or padding (LlamaGen's left-padded captions)."""
        p = key_valid.shape[1]
        self.key_valid[:, :p] = key_valid.to(self.key_valid.device, torch.bool)
        self.has_padding = not bool(key_valid.all())
