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
    """Block-addressed cache of token ids per image (inside blocks, each node's ancestors come from masks)."""

    def __init__(self, tables: list[int], max_len: int) -> None:
        self.tables = list(tables)  # which prompt's table each image reads
        self.tokens: list[list[int]] = [[] for _ in tables]
        self.max_len = max_len
        self.block_starts = [0] * len(tables)
        self.block_len = 0

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def keep(self, counts: list[int] | int, index: torch.Tensor | None = None) -> None:
        if isinstance(counts, int):
            counts = [counts] * len(self.tokens)
        listed = index.tolist() if index is not None else None
        for i, kept in enumerate(counts):
            if not 0 <= kept <= self.block_len:
                raise ValueError(f"keep({kept}) outside the latest block of {self.block_len} tokens")
            start = self.block_starts[i]
            block = self.tokens[i][start : start + self.block_len]
            chosen = block[:kept] if listed is None else [block[int(j)] for j in listed[i][:kept]]
            self.tokens[i] = self.tokens[i][:start] + chosen

    def rollback(self, lengths: list[int] | int) -> None:
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.tokens)
        for i, length in enumerate(lengths):
            if not 0 <= length <= len(self.tokens[i]):
                raise ValueError(f"rollback to {length} but cache holds {len(self.tokens[i])} tokens")
            del self.tokens[i][length:]

    def select(self, images: list[int]) -> None:
        self.tables = [self.tables[i] for i in images]
        self.tokens = [self.tokens[i] for i in images]
        self.block_starts = [self.block_starts[i] for i in images]


class LookupModel(ImageARModel):
    """``p(x_i | x_<i)`` read from a random table indexed by the whole prefix (V, N small).

    With ``prompts`` each listed prompt has a table of its own (so a batch can mix images of different
    distributions); without, every prompt reads the same table.
    """

    sjd_init = "random"

    def __init__(
        self,
        vocab: int = 3,
        grid: Sequence[int] = (2, 2),
        sampling: dict | SamplingConfig | None = None,
        seed: int = 0,
        scale: float = 1.5,
        table: torch.Tensor | None = None,
        prompts: Sequence[str] = (),
    ) -> None:
        super().__init__(sampling if sampling is not None else {})
        self.prompts = list(prompts)
        self.check_prompt_set = self.prompts  # the start-up self-check (coolsd.numerics) uses these
        self.codebook_size = vocab
        self.grid = (int(grid[0]), int(grid[1]))
        self.hidden_size = vocab
        n = self.num_image_tokens
        self.num_prefixes = sum(vocab**k for k in range(n))  # prefixes of length 0..N-1
        tables = max(len(self.prompts), 1)
        if table is None:
            g = torch.Generator().manual_seed(seed)
            table = scale * torch.randn(tables, self.num_prefixes, 2, vocab, generator=g, dtype=torch.float64)
        if table.dim() == 3:
            table = table[None]
        if table.shape != (tables, self.num_prefixes, 2, vocab):
            raise ValueError(f"table must have shape {(tables, self.num_prefixes, 2, vocab)}, "
                             f"got {tuple(table.shape)}")
        self.register_buffer("table", table.to(torch.float64))  # (prompt tables, prefixes, 2 streams, V)

    def table_of(self, prompt: str) -> int:
        """Index of the table a prompt reads."""
        if not self.prompts:
            return 0
        if prompt not in self.prompts:
            raise ValueError(f"prompt {prompt!r} is not one of this lookup model's prompts {self.prompts}")
        return self.prompts.index(prompt)

    def prefix_index(self, prefix: Sequence[int]) -> int:
        """Row of the table for a prefix: all shorter prefixes first, then base-V order."""
        offset = sum(self.codebook_size**k for k in range(len(prefix)))
        code = 0
        for tok in prefix:
            code = code * self.codebook_size + int(tok)
        return offset + code

    def _rows(self, tables: list[int], prefixes: list[list[list[int]]]) -> TargetOutput:
        """Per image, per node: the prefix whose table row gives its logits -> output (S, B, T, V).

        A prefix as long as the image (a padding node past the end, whose output nobody reads) is cut."""
        n = self.num_image_tokens
        idx = torch.tensor([[self.prefix_index(pre[: n - 1]) for pre in image] for image in prefixes],
                           device=self.table.device)  # (B, T)
        which = torch.tensor(tables, device=self.table.device)[:, None].expand_as(idx)
        logits = self.table[which, idx][:, :, : self.num_streams].permute(2, 0, 1, 3).contiguous()  # (S, B, T, V)
        return TargetOutput(logits=logits, hidden=logits.clone())

    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams=None) -> tuple[TokenCache, TargetOutput]:
        cache = TokenCache([self.table_of(p) for p in prompts], self.num_image_tokens + extra_slots)
        return cache, self._rows(cache.tables, [[[]] for _ in prompts])

    def forward_block(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        t = int(tokens.shape[1])
        masks = None if tree_mask is None else (tree_mask.expand(tokens.shape[0], -1, -1) if tree_mask.dim() == 2
                                               else tree_mask)
        prefixes = []
        cache.block_starts, cache.block_len = cache.lengths, t
        for i, row in enumerate(tokens.tolist()):
            start = len(cache.tokens[i])
            if start + t > cache.max_len:
                raise RuntimeError(f"cache overflow: need {start + t} slots, cache holds {cache.max_len}")
            window = t if masks is None else int(masks.shape[-1])  # the last `window` slots are masked
            slots = cache.tokens[i] + row
            first = start + t - window  # < 0: the window reaches into the prompt (a batch whose images hold
            visible = slots[: max(first, 0)]  # different numbers of image slots); older slots are visible
            image = []
            for j in range(t):
                if masks is None:
                    path = row[: j + 1]
                else:
                    path = [slots[first + c] for c in range(max(-first, 0), window) if bool(masks[i, j, c])]
                image.append(visible + path)
            prefixes.append(image)
            cache.tokens[i] = slots
        return self._rows(cache.tables, prefixes)

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

    def exact_sequence_probs(self, prompt: str | None = None) -> torch.Tensor:
        """Probability of every complete sequence (V^N,) of ``prompt``, in base-V order, under the sampling
        pipeline."""
        n, v = self.num_image_tokens, self.codebook_size
        table = self.table[0 if prompt is None else self.table_of(prompt)]
        step = {}
        for length in range(n):
            for prefix in itertools.product(range(v), repeat=length):
                logits = table[self.prefix_index(prefix)][: self.num_streams, None, None]  # (S, 1, 1, V)
                step[prefix] = stream_probs(logits, self.sampling)[0, 0].double()
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
    return LookupModel(vocab=target.codebook_size, grid=target.grid, sampling=target.sampling, table=table,
                       prompts=target.prompts)
