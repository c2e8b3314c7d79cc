"""Per-image random streams: counter-based noise keyed by (seed, image position, draw kind, draw index).

Batched decoding must not let an image depend on its batch neighbours, the batch size, the shard count or
where a resumed run restarted. A ``torch.Generator`` shared by the batch cannot give that (a row's draws
would depend on how many draws the other rows made before it). Here every random number is a pure function
of its key: SplitMix64 (Steele, Lea & Flood 2014; the generator of ``java.util.SplittableRandom``) over a
counter — the image's mixed seed plus the packed ``(kind, t, index)`` times the golden gamma, then the
SplitMix64 finaliser — so a row's stream is the same at batch 1 and inside any batch. One iteration of the
decoding loop starts at image position ``t`` (the first uncommitted token), which is unique per iteration
of an image, so ``(seed, t, kind, index)`` never repeats; the packing (kind: 8 bits, t: 16, index: 40) is
one-to-one.

Samples use the uniforms: a token from a distribution by inverse CDF (``sample``: the first code whose
cumulative mass exceeds ``u·total``, so a zero-probability code is never drawn); several distinct tokens one
at a time, each from what the earlier ones left (sampling without replacement).

Example: ``Streams([0, 1], device="cpu").uniform(torch.tensor([5, 9]), ACCEPT, 4)`` -> (2, 4) in [0, 1).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# draw kinds: each random decision of the algorithms has its own counter space
ACCEPT = 1  # acceptance uniforms, one per draft node
SAMPLE = 2  # the token the target distribution gives (resample / bonus / AR)
DRAFT = 3  # drafted tokens: chain position i, or tree level i's children (index i + STRIDE·(rank slot))
JACOBI = 5  # SJD: the carried window tokens
INIT = 6  # SJD: freshly initialised window tokens
HEADER = 7  # Lumina-mGPT: the sampled image header (before image position 0)
COUPLE = 8  # Jacobi maximal coupling of a carried draft: the keep test and the residual draw
GUMBEL = 9  # Jacobi Gumbel coupling: one noise vector per absolute image position (its draw index = the code)
TREE = 10  # SJD-PAC's proactive tree: the extra siblings of each level

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # the constants as signed int64 (torch has no uint64 arithmetic)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64: int64 (wrapping) -> well-mixed int64, elementwise."""
    z = x + _GAMMA
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def to_unit(z: torch.Tensor) -> torch.Tensor:
    """The top 24 bits of mixed int64 as float32 in [0, 1) (exactly representable, never 1.0)."""
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))


class Streams:
    """The random streams of a batch of images, one per row, keyed by each image's seed."""

    def __init__(self, seeds: Sequence[int] | torch.Tensor, device: torch.device | str) -> None:
        seeds = torch.as_tensor(seeds, dtype=torch.long, device=device).reshape(-1)
        self.keys = mix(seeds)  # (B,)

    @property
    def batch(self) -> int:
        return int(self.keys.shape[0])

    def select(self, rows: torch.Tensor) -> None:
        """Keep the streams of ``rows`` (finished images leave the batch)."""
        self.keys = self.keys[rows]

    def uniform(self, position: torch.Tensor, kind: int, count: int) -> torch.Tensor:
        """Uniforms (B, count) in [0, 1) for draws ``0 .. count − 1`` of ``kind`` at image ``position`` (B,)."""
        return self.uniform_at(position, kind, torch.arange(count, device=self.keys.device))

    def uniform_grid(self, positions: torch.Tensor, kind: int, count: int) -> torch.Tensor:
        """Uniforms (B, L, count) for draws ``0 .. count − 1`` of ``kind`` at each of the positions (B, L):
        ``uniform(positions[:, l], kind, count)`` for every l at once."""
        counter = (positions.to(self.keys.device, torch.long) << 40) + (self.keys[:, None] + (kind << 56))  # (B, L)
        flat = torch.arange(count, device=counter.device)
        return to_unit(mix((counter[..., None] + flat) * _GAMMA))

    @staticmethod
    def draws(*kinds_counts: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Draw indices for ``uniform_at(position, 0, ...)`` covering draws ``0 .. count − 1`` of each ``kind`` in
        order, e.g. ``draws((ACCEPT, m), (SAMPLE, 1))``: one call whose values are bitwise those of one
        ``uniform`` call per kind (the counter adds ``kind << 56`` and the index; int64 addition wraps alike
        in any order)."""
        return torch.tensor([(kind << 56) + j for kind, count in kinds_counts for j in range(count)], device=device)

    def uniform_at(self, position: torch.Tensor, kind: int, index: torch.Tensor) -> torch.Tensor:
        """Uniforms (B, *index.shape) for the draws ``index`` (any shape, int64) of ``kind`` at ``position``.

        Conversions and reshapes that would be no-ops are skipped on the host (each is a torch call: the loop
        draws its uniforms here every iteration)."""
        device = self.keys.device
        if position.dtype != torch.long or position.device != device:
            position = position.to(device, torch.long)
        counter = (position << 40) + (self.keys + (kind << 56))  # (B,)
        flat = index if index.dtype == torch.long and index.device == device else index.to(device, torch.long)
        if flat.dim() != 1:
            flat = flat.reshape(-1)
        z = to_unit(mix((counter.unsqueeze(1) + flat) * _GAMMA))  # (B, n): broadcast, no index views
        return z if index.dim() == 1 else z.view(counter.shape[0], *index.shape)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (..., V) by inverse CDF with uniforms ``u`` (...) -> int64 (...).

    The first code whose cumulative mass exceeds ``u·total``; zero-mass codes are never drawn, and rows need
    not be normalised. Greedy (one-hot) rows return their arg-max.
    """
    cdf = (probs if probs.dtype == torch.float32 else probs.float()).cumsum(-1)  # (..., V)
    total = cdf[..., -1:]
    x = torch.minimum(u.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
