"""Generation orders other than raster: several image rows decoded at once (spatial parallel decoding).

The decoding loop's default order is raster: one token per image per target forward (plain AR) or a drafted
block after the last committed token. An order object replaces that for decoders that generate in another
order (``Decoder(order=...)``); the loop asks it for a schedule of forwards and runs them, and every image's
result is still its full raster grid. Positions are grid cells in raster order (``row · W + column``), which
every adapter already turns into its own positions (LlamaGen's 2-D RoPE, Janus-Pro's 1-D positions); the KV
cache keeps its slots in generation order, and each forward's attention mask says which slots a query may see.

``RowWindow`` is ZipAR's fixed window (He et al., arXiv 2412.04062; ``shared/docs/algorithms.md``, "Spatial
parallel decoding"): row ``r + 1`` starts once row ``r`` has ``window`` tokens; every forward feeds the latest
token of every active row at its own cell and samples each row's next token. A new row's first token is
predicted from a stand-in at the end-of-row cell of the row above (the missing ``x(r, W − 1)``): the latest
token of the row above (``stand_in: row_above``), or, as the reference's LlamaGen port does, the latest token of
the row above that one (``stand_in: reference``); the stand-in is seen by its own query only and dropped from
the cache after the forward. A query sees the generated tokens at or before its own cell in raster order (the
references' raster-causal attention over generated tokens), never a slot not yet generated: the reference's
LlamaGen port also lets queries see unwritten zero slots, a quirk not reproduced here. With ``window`` ≥ the
grid width the schedule is plain raster AR, forward for forward.

Example: ``python run.py decoder=zipar decoder.order.window=2`` on the 7×7 embedded model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coolsd import validate

STAND_INS = ("row_above", "reference")


@dataclass(frozen=True)
class Feed:
    """One input of a forward: the token generated at ``source`` (a raster cell) fed at cell ``cell`` (its
    position); ``out`` is the cell sampled from its output (None: the input only enters the cache) and ``keep``
    whether it stays in the cache (a stand-in, whose token is not the one at ``cell``, does not)."""

    cell: int
    source: int
    out: int | None
    keep: bool


@dataclass(frozen=True)
class Step:
    """One target forward of a schedule: its feeds in cache order and the (T, K) visibility of its queries over
    the last K = (image slots before it) + T cache slots, or None when that is plain causal attention."""

    feeds: tuple[Feed, ...]
    visible: torch.Tensor | None

    @property
    def outputs(self) -> list[int]:
        """Indices of the feeds whose output is sampled."""
        return [i for i, f in enumerate(self.feeds) if f.out is not None]


class RowWindow:
    """ZipAR's fixed window over a ``grid`` (rows, columns) of image tokens (module doc)."""

    def __init__(self, grid: tuple[int, int], window: int, stand_in: str = "row_above",
                 first_row_ar: bool = False) -> None:
        self.rows, self.cols = (int(x) for x in grid)
        self.window = validate.integer("decoder.order.window", window, minimum=1)
        self.stand_in = validate.choice("decoder.order.stand_in", stand_in, STAND_INS)
        self.first_row_ar = validate.boolean("decoder.order.first_row_ar", first_row_ar)
        self._schedule: list[Step] | None = None

    @property
    def max_feeds(self) -> int:
        """The most inputs one forward has (every row active, plus a finished row's last token)."""
        return self.rows + 1

    def schedule(self) -> list[Step]:
        """The forwards after the prefill (whose output gives cell 0), the same for every image (cached)."""
        if self._schedule is None:
            self._schedule = self._build()
        return self._schedule

    def _starts_below(self, r: int, count: list[int]) -> bool:
        """Whether row ``r + 1`` may start, with ``count`` tokens generated per row."""
        need = self.cols if (self.first_row_ar and r == 0) else min(self.window, self.cols)
        return r + 1 < self.rows and count[r] >= need

    def _build(self) -> list[Step]:
        rows, cols = self.rows, self.cols
        count = [0] * rows
        count[0] = 1  # cell 0 comes from the prefill
        started = [True] + [False] * (rows - 1)
        cached = [False] * rows  # whether row r's last token has entered the cache
        slots: list[int] = []  # the cell of every kept image slot, in cache order
        steps: list[Step] = []
        held: list[Feed] = []  # inputs without an output wait for the next forward
        held_before: list[Feed] | None = None
        while True:
            for r in range(rows - 1):  # rows whose row above has enough tokens start in this forward
                if not started[r + 1] and self._starts_below(r, count):
                    started[r + 1] = True
            feeds = list(held)
            held = []
            for r in range(rows):
                c = count[r]
                if not started[r]:
                    break
                if c == 0:  # a new row: its first token from the end-of-row cell of the row above
                    a = r - 1
                    end = a * cols + cols - 1
                    if count[a] == cols and not cached[a]:  # the real token there: the raster step itself
                        feeds.append(Feed(end, end, r * cols, True))
                        cached[a] = True
                    else:
                        src_row = a - 1 if self.stand_in == "reference" and a > 0 else a
                        feeds.append(Feed(end, src_row * cols + count[src_row] - 1, r * cols, False))
                elif c < cols:
                    feeds.append(Feed(r * cols + c - 1, r * cols + c - 1, r * cols + c, True))
                elif not cached[r] and r + 1 < rows and not (started[r + 1] and count[r + 1] == 0):
                    end = r * cols + cols - 1  # a finished row's last token enters the cache
                    feeds.append(Feed(end, end, None, True))
                    cached[r] = True
            if not any(f.out is not None for f in feeds):
                if all(c == cols for c in count):
                    break  # the image is complete (a last row's token never needs to enter the cache)
                if not feeds or feeds == held_before:
                    raise AssertionError(f"RowWindow schedule stalled with rows at {count} of {cols} tokens")
                held = held_before = feeds  # nothing to sample: the inputs join the next forward
                continue
            feeds.sort(key=lambda f: (f.cell, not f.keep))
            steps.append(Step(tuple(feeds), self._visibility(slots, feeds)))
            slots += [f.cell for f in feeds if f.keep]
            for f in feeds:
                if f.out is not None:
                    count[f.out // cols] += 1
        if any(c != cols for c in count):
            raise AssertionError(f"RowWindow schedule ended with rows at {count} of {cols} tokens")
        return steps

    @staticmethod
    def _visibility(slots: list[int], feeds: list[Feed]) -> torch.Tensor | None:
        """(T, K) bool: query i sees the kept slots and this forward's kept inputs at or before its own cell in
        raster order, and itself; None when that is every earlier slot and causal inside the block."""
        t = len(feeds)
        keys = [(cell, True) for cell in slots] + [(f.cell, f.keep) for f in feeds]
        visible = torch.zeros(t, len(keys), dtype=torch.bool)
        for i, f in enumerate(feeds):
            for j, (cell, kept) in enumerate(keys):
                visible[i, j] = (kept and cell <= f.cell) or j == len(slots) + i
        causal = torch.ones(t, len(keys), dtype=torch.bool).tril(len(slots))
        return None if torch.equal(visible, causal) else visible
