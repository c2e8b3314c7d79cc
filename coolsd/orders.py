"""Generation orders other than raster: several image rows decoded at once (spatial parallel decoding).

The decoding loop's default order is raster: one token per image per target forward (plain AR) or a drafted
block after the last committed token. An order object replaces that for decoders that generate in another
order (``Decoder(order=...)``); the loop asks it for a schedule of forwards and runs them, and every image's
result is still its full raster grid. Positions are grid cells in raster order (``row · W + column``), which
every adapter already turns into its own positions (LlamaGen's 2-D RoPE, Janus-Pro's 1-D positions); the KV
cache keeps its slots in generation order, and each forward's attention mask says which slots a query may see.

``RowWindow`` is ZipAR's fixed window (He et al., arXiv 2412.04062; ``docs/algorithms.md``, "Spatial
parallel decoding"): row ``r + 1`` starts once row ``r`` has ``window`` tokens; every forward feeds the latest
token of every active row at its own cell and samples each row's next token. A new row's first token is
predicted from a stand-in at the end-of-row cell of the row above (the missing ``x(r, W − 1)``): the latest
token of the row above (``stand_in: row_above``), or, as the reference's LlamaGen port does, the latest token of
the row above that one (``stand_in: reference``); the stand-in is seen by its own query only and dropped from
the cache after the forward. A query sees the generated tokens at or before its own cell in raster order (the
references' raster-causal attention over generated tokens), never a slot not yet generated: the reference's
LlamaGen port also lets queries see unwritten zero slots, a quirk not reproduced here. With ``window`` ≥ the
grid width the schedule is plain raster AR, forward for forward.

On Lumina-mGPT (``model.stand_in_is_end_of_row``) a new row's first code is the output of the end-of-row token
the adapter adds after the row above's last cell: a stand-in there is hidden from that token (its mask row
excludes itself), which then sees the row above as far as it is generated, as the reference's end-of-row lead
does. Unlike the reference, the end-of-row token enters the cache only with the row's real last code, so the
rows below see it from then on (the reference keeps it from the new row's start).

``RowJacobi`` (PJD) and ``AdaptiveRowWindow`` (ZipAR's adaptive window) have schedules that depend on each
image's acceptances (``dynamic``): every forward is planned per image on the host and padded to one block,
with a (B, T, K) mask per image.

Example: ``python run.py decoder=zipar decoder.order.window=2`` on the 7×7 embedded model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coolsd import validate
from coolsd.acceptance import verify_chain
from coolsd.rng import ACCEPT, INIT, JACOBI, SAMPLE, sample
from coolsd.sampling import finite_images
from coolsd.types import Draft

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


# -- PJD: SJD on several rows at once, a schedule that depends on each image's acceptances ----------------------
_PAD_GROUP = -2  # the group of a padding input (seen by no other query)
_ALONE = -3  # the group of row r's stand-in is _ALONE − r (seen by its own query only)


@dataclass
class RowFeed:
    """One input of a dynamic forward: fed at ``cell`` (its position), its token at ``source`` of the loop's
    token buffer (committed cells ``0 .. N − 1``, then the drafts by cell at ``N + cell``); ``committed``: a
    generated token (seen by every later query) rather than a draft or a stand-in (seen by its own row only);
    ``group``: the row whose drafts see it (−1: none, a finished row's last token; a stand-in or padding: its
    own query only)."""

    cell: int
    source: int
    committed: bool
    group: int


@dataclass
class Chain:
    """A row's part of a forward: its row, committed count ``start`` (its first draft's column), the indices
    of its anchor and drafts in the forward (the anchor's output predicts the row's next cell), its number of
    drafts, whether it is the top active row and whether its anchor is the row's own latest token (kept in the
    cache with the accepted drafts) rather than a stand-in."""

    row: int
    start: int
    inputs: list[int]
    drafts: int
    top: bool
    own_anchor: bool
    bonus: bool = False  # commits one token more than it accepts (the top row; every row of ZipAR)
    tentative: bool = False  # a new row's first token, re-verified until accepted (adaptive ZipAR)


class RowJacobiState:
    """Per-image state of ``RowJacobi``: committed tokens per row, which rows started, whether a finished
    row's last token is in the cache, the carried drafts per row, the cells of the kept cache slots, the
    forward counter; and on the device the drafts by cell (B, N + 1) and their distributions (B, N + 1, V)
    (column N: a scratch cell that padded writes go to)."""

    def __init__(self, order: "RowJacobi", batch: int, codebook: int, device: torch.device) -> None:
        rows, cols = order.rows, order.cols
        n = rows * cols
        self.count = [[1] + [0] * (rows - 1) for _ in range(batch)]  # cell 0 comes from the prefill
        self.started = [[True] + [False] * (rows - 1) for _ in range(batch)]
        self.cached = [[False] * rows for _ in range(batch)]  # a finished row's last token is in the cache
        self.carried = [[0] * rows for _ in range(batch)]  # drafts from the last forward, from cell `count`
        self.slots: list[list[int]] = [[] for _ in range(batch)]  # kept image slots' cells, in cache order
        self.forwards = [0] * batch
        self.draft_tok = torch.zeros(batch, n + 1, dtype=torch.long, device=device)
        self.draft_q = torch.zeros(batch, n + 1, codebook, dtype=torch.float32, device=device)
        for b in range(batch):
            order.activate(self, b)

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        for name in ("count", "started", "cached", "carried", "slots", "forwards"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        self.draft_tok, self.draft_q = self.draft_tok[index], self.draft_q[index]


class RowJacobi:
    """PJD (arXiv 2606.05703; ``docs/algorithms.md``, "Spatial parallel decoding"): speculative Jacobi
    decoding on several image rows at once.

    Row ``r + 1`` becomes active when row ``r`` has ``context`` (c) committed tokens. Every forward feeds, for
    each active row from the top, its anchor (the row's latest committed token, whose output predicts the
    row's next cell; for a row without tokens, a stand-in at the end-of-row cell of the row above: its
    latest token) and its drafts at their cells: ``draft_window`` (W) inputs at most, and never past the row above
    (a row below the top drafts ``min(W, c_above − c_r) − 1`` tokens, so every draft's upper-right
    neighbour is committed). A draft sees the committed tokens before its cell in raster order and the
    earlier drafts of its own row (the row-causal mask); a committed input sees the committed tokens
    before its cell. Each row is verified left to right with SJD's test ``min(1, p(d)/q(d))``
    (``verify_chain`` with the decoder's rule): the top active row commits its accepted drafts and one token
    more (the residual's sample at the first rejection, or the bonus), so it always advances; a lower row
    commits its accepted drafts only and waits. A row's outputs at and after the tokens it committed become
    its next drafts (a fresh sample of each output, stored q = that output: SJD's Jacobi update); the rest of
    its window is filled with uniform random codes (q one-hot). A finished row's last token enters the cache
    in the next forward. KV is kept for each row's anchor and the accepted drafts but the newest, which is the
    row's next anchor (the reference's rule).

    Lossy for ``context`` < the grid width (a row starts without the end of the row above); with ``context``
    = the grid width only one row is active at a time and every row is SJD: exact (``tests/test_spatial.py``,
    chi-square against AR). Every random number is keyed by the image's seed, the cell and the image's
    forward count, so an image does not depend on its batch.

    Differences from the reference code (``boyaliao/PJD``, Lumina-mGPT only; ``docs/reference/spatial-parallel-
    decoding.md``): its mask bug (rows below the second see upper rows' drafts) and its refresh quirk (an old
    draft with ``p/q > 0.5`` kept with its old q) are not reproduced; the paper's mask and SJD's update are.
    Its hard-coded ``long_size`` 9 counts the row's lead token, so it is ``context`` = 8 here.

    Example: ``python run.py decoder=pjd decoder.order.context=3 decoder.order.draft_window=4``.
    """

    dynamic = True
    lower_rows_sample = False  # a row below the top commits its accepted drafts only (True: and one more)

    def __init__(self, grid: tuple[int, int], context: int, draft_window: int = 8) -> None:
        self.rows, self.cols = (int(x) for x in grid)
        self.context = validate.integer("decoder.order.context", context, minimum=1)
        self.window = validate.integer("decoder.order.draft_window", draft_window, minimum=1)

    @property
    def max_feeds(self) -> int:
        """The most inputs one forward has: a window per row (never more than the grid) and a finished row's
        last token."""
        return min(self.rows * min(self.window, self.cols), self.rows * self.cols) + 1

    @property
    def max_commit(self) -> int:
        return min(self.rows * min(self.window, self.cols), self.rows * self.cols)

    def begin(self, batch: int, codebook: int, device: torch.device) -> RowJacobiState:
        return RowJacobiState(self, batch, codebook, device)

    def activate(self, state: RowJacobiState, b: int) -> None:
        """Start every row whose row above has ``context`` committed tokens."""
        count, started = state.count[b], state.started[b]
        for r in range(self.rows - 1):
            if started[r] and not started[r + 1] and count[r] >= min(self.context, self.cols):
                started[r + 1] = True

    # -- one forward ------------------------------------------------------------------------------------------
    def plan(self, state: RowJacobiState, b: int) -> tuple[list[RowFeed], list[Chain], list[tuple[int, int]]]:
        """Image ``b``'s inputs, chains and the new random drafts (cell, row) this forward needs."""
        rows, cols, n = self.rows, self.cols, self.rows * self.cols
        count, started, cached, carried = state.count[b], state.started[b], state.cached[b], state.carried[b]
        feeds: list[RowFeed] = []
        chains: list[Chain] = []
        fresh: list[tuple[int, int]] = []
        for r in range(rows - 1):  # a finished row's last token enters the cache
            if count[r] == cols and not cached[r]:
                end = r * cols + cols - 1
                feeds.append(RowFeed(end, end, True, -1))
                cached[r] = True
        top = True
        for r in range(rows):
            c = count[r]
            if not started[r] or c == cols:
                continue
            above = cols if top else count[r - 1]
            inputs = min(self.window, above - c) if not top else min(self.window, cols - c)
            if inputs < 1:  # a row below never reaches the row above (it commits less than the gap)
                raise AssertionError(f"{type(self).__name__}: row {r} caught up with the row above ({count})")
            tentative = self.tentative(c, count[r - 1] == cols if r else True)
            drafts = min(carried[r], 1) if tentative else inputs - 1
            first = len(feeds)
            if c > 0:
                cell = r * cols + c - 1
                feeds.append(RowFeed(cell, cell, True, r))
            else:  # the row above's latest token at its end-of-row cell (the real token once it is complete)
                a = r - 1
                # a stand-in is seen by its own query only, as in ZipAR (a complete row's last token, also fed
                # or cached as itself, is seen as that)
                feeds.append(RowFeed(a * cols + cols - 1, a * cols + count[a] - 1, False, _ALONE - r))
            for j in range(drafts):
                cell = r * cols + c + j
                feeds.append(RowFeed(cell, n + cell, False, r))
                if j >= carried[r]:
                    fresh.append((cell, r))
            carried[r] = min(carried[r], drafts)
            chains.append(Chain(r, c, list(range(first, first + 1 + drafts)), drafts, top, c > 0,
                                top or self.lower_rows_sample, tentative))
            top = False
        return feeds, chains, fresh

    def tentative(self, count: int, above_complete: bool) -> bool:
        """Whether a row with ``count`` tokens holds its first token as a draft to verify again (PJD: never)."""
        return False

    @staticmethod
    def visibility(slots: list[list[int]], feeds: list[list[RowFeed]], width: int,
                   hide_stand_ins: bool = False) -> torch.Tensor:
        """(B, T, K) bool over each image's last K = (most kept slots) + T cache slots: a query sees itself and
        the keys before its cell in raster order that are committed or of its own row; an image's window
        columns before its own image slots are prompt slots (seen). ``hide_stand_ins``: a stand-in that is not
        the real token of its cell does not see itself either (Lumina-mGPT: the end-of-row token after it, whose
        output is the query's, then sees the generated tokens only)."""
        k_slots = max(len(s) for s in slots)
        key_cell, key_commit, key_group, q_cell, q_group = [], [], [], [], []
        for s, f in zip(slots, feeds):
            pad = width - len(f)
            key_cell.append([-1] * (k_slots - len(s)) + s + [x.cell for x in f] + [0] * pad)
            key_commit.append([True] * k_slots + [x.committed for x in f] + [False] * pad)
            key_group.append([-1] * k_slots + [x.group for x in f] + [_PAD_GROUP] * pad)
            q_cell.append([x.cell for x in f] + [0] * pad)
            q_group.append([x.group for x in f] + [_PAD_GROUP] * pad)
        kc, kcom, kg = torch.tensor(key_cell), torch.tensor(key_commit), torch.tensor(key_group)
        qc, qg = torch.tensor(q_cell), torch.tensor(q_group)
        visible = (kc[:, None, :] < qc[:, :, None]) & (kcom[:, None, :] | (kg[:, None, :] == qg[:, :, None]))
        idx = torch.arange(width)
        visible[:, idx, k_slots + idx] = True
        if hide_stand_ins:  # a stand-in that is another cell's token (not the real token of a complete row)
            alone = torch.tensor([[x.group <= _ALONE and x.source != x.cell for x in f] + [False] * (width - len(f))
                                  for f in feeds], dtype=torch.bool)
            visible[:, idx, k_slots + idx] = ~alone
        return visible

    def iteration(self, model, rule, cache, tokens: torch.Tensor, streams, state: RowJacobiState) -> tuple:
        """One forward of every image in the batch and its verification; updates ``tokens`` and ``state``.
        Returns the tokens committed per image and whether each image's logits were finite."""
        b = tokens.shape[0]
        device = tokens.device
        n = self.rows * self.cols
        codebook = state.draft_q.shape[-1]
        plans = [self.plan(state, i) for i in range(b)]
        width = max(len(f) for f, _, _ in plans)
        # fresh random drafts: uniform codes, q one-hot
        fresh = [[cell for cell, _ in fr] for _, _, fr in plans]
        most = max(len(x) for x in fresh)
        if most:
            cells = torch.tensor([x + [n] * (most - len(x)) for x in fresh], device=device)
            u = streams.uniform_keyed(cells, INIT, torch.tensor(state.forwards, device=device)[:, None])
            code = (u * codebook).long().clamp_(max=codebook - 1)
            rows_b = torch.arange(b, device=device)[:, None].expand_as(cells)
            state.draft_tok[rows_b, cells] = code
            state.draft_q[rows_b, cells] = torch.nn.functional.one_hot(code, codebook).float()
        # the forward: committed tokens and drafts side by side as one source buffer
        source = torch.cat([tokens[:, :n], state.draft_tok], dim=1)  # (B, 2N + 1); N + N: scratch (zeros)
        src = torch.tensor([[x.source for x in f] + [2 * n] * (width - len(f)) for f, _, _ in plans], device=device)
        pos = torch.tensor([[x.cell for x in f] + [0] * (width - len(f)) for f, _, _ in plans], device=device)
        visible = self.visibility(state.slots, [f for f, _, _ in plans], width, model.stand_in_is_end_of_row)
        visible = visible.to(device)
        out = model.forward_block(cache, source.gather(1, src), pos, visible)
        p = model.probs(out)  # (B, T, V)
        # the chains of every image, verified together
        chains = [(i, ch) for i, (_, cs, _) in enumerate(plans) for ch in cs]
        length = max(ch.drafts for _, ch in chains)
        img = torch.tensor([i for i, _ in chains], device=device)
        outs = torch.tensor([ch.inputs + [ch.inputs[0]] * (length - ch.drafts) for _, ch in chains], dtype=torch.long,
                            device=device)
        base = [ch.row * self.cols + ch.start for _, ch in chains]  # each chain's first draft cell
        dcells = torch.tensor([[c0 + j if j < ch.drafts else n for j in range(length)]
                               for c0, (_, ch) in zip(base, chains)], dtype=torch.long, device=device).reshape(len(chains), length)
        ocells = torch.tensor([[c0 + j if j <= ch.drafts else n for j in range(length + 1)]
                               for c0, (_, ch) in zip(base, chains)], dtype=torch.long, device=device)
        p_chain = p[img[:, None], outs]  # (C, L + 1, V)
        valid = torch.tensor([[j < ch.drafts for j in range(length)] for _, ch in chains], dtype=torch.bool,
                             device=device).reshape(len(chains), length)
        draft = Draft(tokens=state.draft_tok[img[:, None], dcells], q=state.draft_q[img[:, None], dcells],
                      valid=valid, forwards=[0] * len(chains))
        fw = torch.tensor(state.forwards, device=device)[img]
        u_accept = streams.uniform_keyed(dcells, ACCEPT, fw[:, None], img)
        u_carry = streams.uniform_keyed(ocells, JACOBI, fw[:, None], img)
        # the next token's draw: plain AR's at the cell it commits to (draw 0 of SAMPLE there: committed once);
        # a tentative first token, which may be drawn again at its cell, draws at index 1 + the forward count
        tentative = torch.tensor([ch.tentative for _, ch in chains], dtype=torch.bool, device=device)
        base_t = torch.tensor(base, dtype=torch.long, device=device)
        index = torch.where(tentative, fw + 1, torch.zeros_like(fw))[:, None]
        verdict = verify_chain(rule, p_chain, draft, u_accept,
                               lambda accepted: streams.uniform_keyed((base_t + accepted)[:, None], SAMPLE, index, img)[:, 0])
        # commit on the device: every draft at its cell (a prefix of them is what the counts commit; the other
        # cells are written again before they count), then the top rows' next token
        ci, cj = valid.nonzero(as_tuple=True)
        tokens[img[ci], dcells[ci, cj]] = draft.tokens[ci, cj]
        bonus = torch.tensor([ch.bonus for _, ch in chains], dtype=torch.bool, device=device)
        at = base_t + verdict.num_accepted
        tokens[img[bonus], at[bonus]] = verdict.next_token[bonus]
        # the next drafts: a fresh sample of every output, its q that output (Jacobi update)
        carry = sample(p_chain, u_carry)  # (C, L + 1)
        state.draft_tok[img[:, None].expand_as(ocells), ocells] = carry
        state.draft_q[img[:, None].expand_as(ocells), ocells] = p_chain
        if bool(tentative.any()):  # a rejected tentative first token: the residual's sample replaces it
            again = tentative & (verdict.num_accepted == 0) & valid.any(-1)
            cell0 = base_t[again]
            state.draft_tok[img[again], cell0] = verdict.next_token[again]
        host = torch.cat([verdict.num_accepted, finite_images(out.logits).long()]).tolist()  # the one host sync
        accepted, finite = host[: len(chains)], [bool(x) for x in host[len(chains):]]
        # host bookkeeping: counts, cache slots kept, carried drafts, rows that start
        committed = [0] * b
        keep_index: list[list[int]] = [[] for _ in range(b)]
        for i, (feeds, _, _) in enumerate(plans):
            keep_index[i] += [j for j, x in enumerate(feeds) if x.group == -1]  # finished rows' last tokens
        for (i, ch), a in zip(chains, accepted):
            if ch.tentative:  # accepted: the token and the one after it (its output's sample); else nothing
                m = 2 if a == ch.drafts == 1 else 0
            else:
                m = a + 1 if ch.bonus else a
            if m:
                kept = ch.inputs[: m] if ch.own_anchor else ch.inputs[1: m]
                keep_index[i] += kept
            state.count[i][ch.row] += m
            state.carried[i][ch.row] = max(0, ch.start + ch.drafts + 1 - state.count[i][ch.row])
            committed[i] += m
        for i, (feeds, _, _) in enumerate(plans):
            order = sorted(keep_index[i])
            state.slots[i] += [feeds[j].cell for j in order]
            keep_index[i] = order
            state.forwards[i] += 1
            self.activate(state, i)
        most = max(len(x) for x in keep_index)
        index = torch.tensor([x + [0] * (most - len(x)) for x in keep_index], dtype=torch.long,
                             device=device).reshape(b, most)
        cache.keep([len(x) for x in keep_index], index)
        return committed, finite


class AdaptiveRowWindow(RowJacobi):
    """ZipAR's window on the dynamic engine (He et al., arXiv 2412.04062; ``docs/algorithms.md``): row
    ``r + 1`` starts once row ``r`` has ``window`` (s) tokens and every forward samples one token per active row
    from the latest token of that row (a new row's first token from a stand-in at the end-of-row cell of the
    row above: its latest token, seen by its own query only). ``adaptive`` (the paper's ICML version; neither
    reference port has it): a new row's first token is a draft until the row above is complete or it passes
    ``min(1, p_new(x)/p_old(x))``, where ``p_new`` is the stand-in's prediction one forward later (one more
    token of context) and ``p_old`` the previous one; a rejected token is replaced by a sample of
    ``norm([p_new − p_old]_+)`` and tested again at the next forward, so the row starts later (its window
    widens). The row's second token is predicted from the draft in the same forward and committed with it.
    With ``adaptive: false`` it gives ``RowWindow``'s tokens (``stand_in: row_above``).

    Approximate (lossy): a token is accepted against a prediction that still lacks the rest of the row above.

    Example: ``python run.py decoder=zipar_adaptive decoder.order.window=2``.
    """

    lower_rows_sample = True

    def __init__(self, grid: tuple[int, int], window: int, adaptive: bool = True) -> None:
        super().__init__(grid, context=validate.integer("decoder.order.window", window, minimum=1), draft_window=1)
        self.adaptive = validate.boolean("decoder.order.adaptive", adaptive)

    @property
    def max_feeds(self) -> int:
        return 2 * self.rows + 1  # a stand-in and a draft per new row, the latest token of the others

    @property
    def max_commit(self) -> int:
        return 2 * self.rows

    def tentative(self, count: int, above_complete: bool) -> bool:
        return self.adaptive and count == 0 and not above_complete
