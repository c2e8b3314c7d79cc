"""A lookup-table "model" whose next-token distributions are known exactly.

Every prefix of image tokens has its own row of logits (per CFG stream) in a table, so the distribution of
complete sequences can be enumerated in closed form (``exact_sequence_probs``) and compared with what a
decoder samples. It implements the full adapter interface, including blocks, rollback, tree masks and
compaction, on a cache of token ids instead of keys and values.

Example (tests): ``LookupModel(vocab=3, grid=(2, 2), seed=0)``; ``python run.py model=lookup``.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
from torch import nn

from coolsd.models.base import ImageARModel
from coolsd.sampling import SamplingConfig, stream_probs
from coolsd.types import TargetOutput


class TokenCache:
    """Block-addressed cache of token ids (and, inside blocks, each node's ancestor set)."""

    def __init__(self, max_len: int) -> None:
        self.tokens: list[int] = []
        self.max_len = max_len
        self.length = 0
        self.block_start = 0
        self.block_len = 0

    def keep(self, kept: int | torch.Tensor) -> None:
        start = self.block_start
        if isinstance(kept, int):
            if not 0 <= kept <= self.block_len:
                raise ValueError(f"keep({kept}) outside the latest block of {self.block_len} tokens")
            self.length = start + kept
        else:
            block = self.tokens[start : start + self.block_len]
            chosen = [block[int(i)] for i in kept]
            self.tokens[start : start + len(chosen)] = chosen
            self.length = start + len(chosen)
        del self.tokens[self.length :]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} but cache holds {self.length} tokens")
        self.length = length
        del self.tokens[length:]


class LookupModel(ImageARModel):
    """``p(x_i | x_<i)`` read from a random table indexed by the whole prefix (V, N small)."""

    sjd_init = "random"

    def __init__(
        self,
        vocab: int = 3,
        grid: Sequence[int] = (2, 2),
        sampling: dict | SamplingConfig | None = None,
        seed: int = 0,
        scale: float = 1.5,
        table: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.codebook_size = vocab
        self.grid = (int(grid[0]), int(grid[1]))
        self.sampling = (sampling if isinstance(sampling, SamplingConfig)
                         else SamplingConfig(**dict(sampling or {})))
        self.hidden_size = vocab
        n = self.num_image_tokens
        self.num_prefixes = sum(vocab**k for k in range(n))  # prefixes of length 0..N-1
        if table is None:
            g = torch.Generator().manual_seed(seed)
            table = scale * torch.randn(self.num_prefixes, 2, vocab, generator=g, dtype=torch.float64)
        if table.shape != (self.num_prefixes, 2, vocab):
            raise ValueError(f"table must have shape {(self.num_prefixes, 2, vocab)}, got {tuple(table.shape)}")
        self.register_buffer("table", table.to(torch.float64))  # (prefixes, 2 streams, V)

    def prefix_index(self, prefix: Sequence[int]) -> int:
        """Row of the table for a prefix: all shorter prefixes first, then base-V order."""
        offset = sum(self.codebook_size**k for k in range(len(prefix)))
        code = 0
        for tok in prefix:
            code = code * self.codebook_size + int(tok)
        return offset + code

    def _rows(self, prefixes: list[list[int]]) -> TargetOutput:
        idx = torch.tensor([self.prefix_index(pre) for pre in prefixes], device=self.table.device)
        logits = self.table[idx][:, : self.num_streams].permute(1, 0, 2).contiguous()  # (S, T, V)
        return TargetOutput(logits=logits, hidden=logits.clone())

    def prefill(self, prompt: str, extra_slots: int = 64,
                generator: torch.Generator | None = None) -> tuple[TokenCache, TargetOutput]:
        cache = TokenCache(self.num_image_tokens + extra_slots)
        return cache, self._rows([[]])

    def forward_block(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        t = int(tokens.shape[0])
        start = cache.length
        if start + t > cache.max_len:
            raise RuntimeError(f"cache overflow: need {start + t} slots, cache holds {cache.max_len}")
        new = [int(x) for x in tokens]
        window = t if tree_mask is None else int(tree_mask.shape[-1])  # the last `window` slots are masked
        slots = cache.tokens[:start] + new
        visible = slots[: start + t - window]  # committed slots: always visible
        prefixes = []
        for i in range(t):
            if tree_mask is None:
                path = new[: i + 1]
            else:
                path = [slots[start + t - window + j] for j in range(window) if bool(tree_mask[i, j])]
            prefixes.append(visible + path)
        cache.tokens = slots
        cache.block_start, cache.block_len, cache.length = start, t, start + t
        return self._rows(prefixes)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(tokens, self.codebook_size).to(self.table.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def codebook(self) -> torch.Tensor:
        """A fixed random (V, 4) codebook, so latent-neighbour tables have a non-trivial order."""
        g = torch.Generator().manual_seed(12345)
        return torch.randn(self.codebook_size, 4, generator=g)

    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        levels = (tokens.float() * 255.0 / max(self.codebook_size - 1, 1)).round().to(torch.uint8)
        img = levels.reshape(1, *self.grid).repeat_interleave(8, 1).repeat_interleave(8, 2)
        return img.expand(3, -1, -1).contiguous()

    def exact_sequence_probs(self) -> torch.Tensor:
        """Probability of every complete sequence (V^N,), in base-V order, under the sampling pipeline."""
        n, v = self.num_image_tokens, self.codebook_size
        step = {}
        for length in range(n):
            for prefix in itertools.product(range(v), repeat=length):
                logits = self.table[self.prefix_index(prefix)][: self.num_streams, None]  # (S, 1, V)
                step[prefix] = stream_probs(logits, self.sampling)[0].double()
        probs = torch.empty(v**n, dtype=torch.float64)
        for k, seq in enumerate(itertools.product(range(v), repeat=n)):
            probs[k] = torch.prod(torch.stack([step[seq[:i]][seq[i]] for i in range(n)]))
        return probs

    def sequence_index(self, tokens: torch.Tensor) -> int:
        """Base-V index of a complete sequence (matches ``exact_sequence_probs``)."""
        code = 0
        for tok in tokens.tolist():
            code = code * self.codebook_size + int(tok)
        return code


def perturbed_copy(target: LookupModel, noise: float, seed: int = 1) -> LookupModel:
    """A draft lookup model: the target's table plus N(0, noise²) logit noise, same sampling settings."""
    g = torch.Generator().manual_seed(seed)
    table = target.table.cpu() + noise * torch.randn(target.table.shape, generator=g, dtype=torch.float64)
    return LookupModel(vocab=target.codebook_size, grid=target.grid, sampling=target.sampling, table=table)
