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
SKIP = 11  # VVS: the draft path a round that skips verification commits (baselines/vvs.py)

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # the constants as signed int64 (torch has no uint64 arithmetic)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GAMMA_40 = ((0x9E3779B97F4A7C15 << 40) + (1 << 63)) % (1 << 64) - (1 << 63)  # (γ << 40) mod 2^64, signed


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


def unit_of_gamma_multiple(z: torch.Tensor) -> torch.Tensor:
    """``to_unit(mix(x))`` given ``z = x + γ`` (mix's first step): bitwise the same uniforms in 7 fewer torch
    calls. SplitMix64's last step ``z ^ (z >>> 31)`` leaves the top 24 bits unchanged (the shifted word has
    no bit above 32), so it is skipped."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))


class Streams:
    """The random streams of a batch of images, one per row, keyed by each image's seed.

    ``prefetch`` draws an iteration's uniforms of several kinds in one call; a later ``uniform`` with the same
    position tensor (the same object) and a kind and count inside it returns a view of them. Each uniform is a
    pure function of its key, so the values are bitwise those ``uniform`` computes on its own; the memo only
    saves torch calls (about 25 per draw). Position tensors must not be modified in place after ``prefetch``.
    """

    _draws: dict[tuple, torch.Tensor] = {}  # draw-index tensors of ``draws``, per (kinds and counts, device)

    def __init__(self, seeds: Sequence[int] | torch.Tensor, device: torch.device | str) -> None:
        seeds = torch.as_tensor(seeds, dtype=torch.long, device=device).reshape(-1)
        self.device = seeds.device
        self.keys = mix(seeds)  # (B,)
        self._memo: tuple[torch.Tensor, dict[int, tuple[int, int]], torch.Tensor] | None = None
        self._keys_gamma: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, keys·γ)
        self._index_gamma: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (index, (index + 1)·γ)
        #: the static path's streams (``reseed``): ``keys`` is a persistent buffer refilled in place for every batch,
        #: so nothing derived from it is kept between calls (a captured step recomputes it on every replay)
        self.persistent = False

    @classmethod
    def persistent_for(cls, batch: int, device: torch.device | str) -> "Streams":
        """Streams whose ``keys`` buffer (B,) is refilled in place by ``reseed`` for each batch of this size."""
        out = cls([0] * batch, device)
        out.persistent = True
        return out

    def reseed(self, seeds: Sequence[int]) -> None:
        """Refill a persistent stream's keys in place with ``seeds`` (one per image of the batch)."""
        self.keys.copy_(mix(torch.as_tensor(list(seeds), dtype=torch.long)).to(self.keys.device))
        self._memo = None

    def reseed_rows(self, rows: torch.Tensor, seeds: Sequence[int]) -> None:
        """Give the images of ``rows`` (R,) (long, on the streams' device) the ``seeds`` (R of them), in place; the
        other rows keep theirs. A row's draws then equal those of a fresh ``Streams`` of its seed, since each draw is
        a pure function of (seed, position, kind, index): the static path's refilling (``StaticLoop.generate_stream``).

        Example: ``s = Streams.persistent_for(3, "cpu"); s.reseed([0, 1, 2]); s.reseed_rows(torch.tensor([1]), [7])``
        gives row 1 the keys of seed 7."""
        if len(seeds) != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} rows but {len(seeds)} seeds")
        self.keys.index_copy_(0, rows, mix(torch.as_tensor(list(seeds), dtype=torch.long)).to(self.keys.device))
        self._memo = None
        self._keys_gamma = None

    @property
    def batch(self) -> int:
        return int(self.keys.shape[0])

    def select(self, rows: torch.Tensor) -> None:
        """Keep the streams of ``rows`` (finished images leave the batch)."""
        self.keys = self.keys[rows]
        self._memo = None

    def uniform(self, position: torch.Tensor, kind: int, count: int) -> torch.Tensor:
        """Uniforms (B, count) in [0, 1) for draws ``0 .. count − 1`` of ``kind`` at image ``position`` (B,)."""
        memo = self._memo
        if memo is not None and position is memo[0]:
            span = memo[1].get(kind)
            if span is not None and count <= span[1]:
                return memo[2][:, span[0]: span[0] + count]
        if position.dtype != torch.long:
            position = position.long()
        return self._draws_at(position, self.draws((kind, count), device=self.device))

    def uniforms(self, position: torch.Tensor, *kinds_counts: tuple[int, int],
                 index: torch.Tensor | None = None) -> torch.Tensor:
        """Draws ``0 .. count − 1`` of each ``(kind, count)`` at ``position`` (B,), in one call -> (B, Σ count),
        the kinds side by side in order: bitwise one ``uniform`` call per kind. A kind may appear once.
        ``index``: their ``draws`` index, held by the caller (a compiled step reads no shared cache)."""
        if position.dtype != torch.long:
            position = position.long()
        return self._draws_at(position, self.draws(*kinds_counts, device=self.device) if index is None else index)

    def prefetch(self, position: torch.Tensor, *kinds_counts: tuple[int, int]) -> torch.Tensor:
        """``uniforms``, kept for ``uniform`` calls at this position tensor (class doc)."""
        if position.dtype != torch.long:
            position = position.long()
        u = self.uniforms(position, *kinds_counts)
        spans, start = {}, 0
        for kind, count in kinds_counts:
            spans[kind] = (start, count)
            start += count
        self._memo = (position, spans, u)
        return u

    def uniform_grid(self, positions: torch.Tensor, kind: int, count: int) -> torch.Tensor:
        """Uniforms (B, L, count) for draws ``0 .. count − 1`` of ``kind`` at each of the positions (B, L):
        ``uniform(positions[:, l], kind, count)`` for every l at once (``positions`` on the streams' device)."""
        positions = positions if positions.dtype == torch.long else positions.long()
        counter = (positions << 40) + (self.keys[:, None] + (kind << 56))  # (B, L)
        flat = torch.arange(count, device=counter.device)
        return to_unit(mix((counter[..., None] + flat) * _GAMMA))

    def uniform_keyed(self, positions: torch.Tensor, kind: int, index: torch.Tensor,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """Uniforms (R, L) for draw ``index`` (broadcast to (R, L)) of ``kind`` at each position (R, L): the
        counter of ``uniform_grid`` with a per-element draw index; ``rows`` (R,) picks each row's image (default:
        every image once, in order). No conversion that would be a no-op is made (the static path's steps draw here
        and read nothing on the host)."""
        keys = self.keys if rows is None else self.keys[rows]
        if positions.dtype != torch.long or positions.device != self.device:
            positions = positions.to(self.device, torch.long)
        counter = (positions << 40) + (keys[:, None] + (kind << 56))
        return to_unit(mix((counter + index) * _GAMMA))

    @classmethod
    def draws(cls, *kinds_counts: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Draw indices for ``uniform_at(position, 0, ...)`` covering draws ``0 .. count − 1`` of each ``kind`` in
        order, e.g. ``draws((ACCEPT, m), (SAMPLE, 1))``: one call whose values are bitwise those of one
        ``uniform`` call per kind (the counter adds ``kind << 56`` and the index; int64 addition wraps alike
        in any order). Cached per kinds, counts and device (do not modify the tensor)."""
        key = (kinds_counts, str(device))
        index = cls._draws.get(key)
        if index is None:
            index = torch.tensor([(kind << 56) + j for kind, count in kinds_counts for j in range(count)],
                                 dtype=torch.long, device=device)
            cls._draws[key] = index
        return index

    def uniform_at(self, position: torch.Tensor, kind: int, index: torch.Tensor) -> torch.Tensor:
        """Uniforms (B, *index.shape) for the draws ``index`` (any shape, int64) of ``kind`` at ``position``.

        Conversions and reshapes that would be no-ops are skipped on the host (each is a torch call: the loop
        draws its uniforms here every iteration)."""
        device = self.device
        if position.dtype != torch.long or position.device != device:
            position = position.to(device, torch.long)
        flat = index if index.dtype == torch.long and index.device == device else index.to(device, torch.long)
        shape = index.shape
        if len(shape) != 1:
            flat = flat.reshape(-1)
        keys = self.keys + (kind << 56) if kind else self.keys
        z = to_unit(mix((((position << 40) + keys).unsqueeze(1) + flat) * _GAMMA))  # (B, n): broadcast
        return z if len(shape) == 1 else z.view(keys.shape[0], *shape)

    def _draws_at(self, position: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``uniform_at(position, 0, index)`` for a ``draws`` index and an int64 ``position`` (B,) on the device:
        the counter times γ split as ``position·(γ << 40) + key·γ`` and ``(index + 1)·γ`` folds mix's first
        addition of γ (int64 arithmetic wraps, so the sum is bitwise the same), with the last two factors
        cached: 4 calls to the first mixing step instead of 7."""
        if self.persistent:
            return unit_of_gamma_multiple((position * _GAMMA_40 + self.keys * _GAMMA).unsqueeze(1)
                                          + (index + 1) * _GAMMA)
        if self._keys_gamma is None or self._keys_gamma[0] is not self.keys:
            self._keys_gamma = (self.keys, self.keys * _GAMMA)
        step = self._index_gamma.get(id(index))
        if step is None or step[0] is not index:
            step = self._index_gamma[id(index)] = (index, (index + 1) * _GAMMA)
        return unit_of_gamma_multiple((position * _GAMMA_40 + self._keys_gamma[1]).unsqueeze(1) + step[1])


#: the other operand of ``sample``'s ``nextafter``, one 0-dim tensor per device: CUDA's ``nextafter`` refuses a
#: 0-dim CPU tensor (torch 2.11 on an H200: "Expected all tensors to be on the same device")
_BELOW: dict[torch.device, torch.Tensor] = {}


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (..., V) by inverse CDF with uniforms ``u`` (...) in [0, 1) -> int64 (...).

    The first code whose cumulative mass exceeds ``u·total``; zero-mass codes are never drawn, and rows need
    not be normalised. Greedy (one-hot) rows return their arg-max. ``u·total`` is capped just below ``total``
    (rounding reaches it when the total is subnormal), so the index is a code with mass; an all-zero row gives
    code 0, and the clamp keeps a NaN row's index in range (the loop then reports its non-finite logits).
    """
    cdf = probs.cumsum(-1, dtype=torch.float32)  # (..., V); float32 input is not copied
    total = cdf[..., -1:]
    below = _BELOW.get(total.device)
    if below is None:
        below = _BELOW.setdefault(total.device, torch.tensor(-1.0, device=total.device))
    x = torch.minimum(u.unsqueeze(-1) * total, torch.nextafter(total, below))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
