"""Spatial generation orders on the static decode path: ZipAR's fixed and adaptive windows and PJD as fixed-shape
steps.

The eager loop runs a spatial order (``coolsd.orders``) forward by forward with blocks of their own widths (ZipAR's
schedule: one input per active row; PJD: each image's rows planned on the host after a host read of its
acceptances). Here each order is one named step of ``coolsd.static.loop.StaticLoop`` over the same ``Workspace``,
with fixed shapes, no host read and every state on the device, so it is compiled or captured like the others:

* ``row_window`` (ZipAR, ``RowWindow``): the schedule is the same for every image, so it becomes tables with one row
  per forward (``S`` forwards, ``T`` the widest one; an idle last row for an image that has finished): the inputs'
  cells, the cells their tokens come from, the cells sampled, which inputs stay in the cache and in which order.
  An image's forward is the table row of its verify-forward count (``Workspace.iterations``); a narrower forward is
  padded at its end with inputs that nothing sees and nothing keeps. Every image ends after exactly ``S`` forwards,
  so the loop calls the step ``S`` times and reads nothing (``calls``), as for AR.
* ``row_jacobi`` (PJD, ``RowJacobi``): the rows of an image are its state on the device (committed tokens per row,
  started, cached last token, carried drafts; the cells of its cache slots; the drafts and their distributions by
  cell). The active rows of an image are always the rows ``top .. top + A − 1`` below its complete rows, and at
  most ``A = min(rows, cols − min(c, cols) + 1)`` rows are active at once (a row below the top one has fewer
  committed tokens than the row above it and started when that row had ``c``), so a forward is one slot for a
  finished row's last token and ``A`` segments of ``min(W, cols)`` inputs (the row's anchor and its drafts). Each
  image's valid inputs are packed to the front of the block in the eager order (the padding last, as the eager
  loop pads a batch), the ``A`` chains of every image are verified at once by ``verify_chain`` with the eager
  loop's draws (keyed by cell and forward), and the counts, slots and carried drafts move by masked scatters. An
  image's state restarts by itself where its forward count is 0 (a new batch, or a refilled row). The loop reads
  whether every image has finished once per iteration.
* ``row_adaptive`` (ZipAR's adaptive window, ``AdaptiveRowWindow``: PJD's engine with one input per row) is
  ``row_jacobi``'s step with segments of two inputs (``W`` = 2: a new row's stand-in and its first token, held as a
  draft): every active row commits its next token (``lower_rows_sample``); a new row below an incomplete row is
  tentative (its first token carried from the forward before, tested with ``min(1, p_new/p_old)``, its next draw
  at index 1 + the forward count, a rejected token replaced by the residual's sample) and commits its first two
  tokens once accepted, nothing before. Its state and the one read per iteration are ``row_jacobi``'s.

The attention mask of a forward is computed on the device from cells: a window over the cache's last image slots
(every slot an image can hold; those before its image slots are the prompt's, seen) and the block, with the eager
path's visibility (ZipAR: the kept tokens at or before the query's cell, and itself; PJD: the committed tokens
before the query's cell and its own row's earlier drafts, and itself; on Lumina-mGPT and Emu3 a stand-in is hidden
from itself, so the end-of-row token after it sees the row above as generated). The columns over earlier slots are
in the cache's own units (``EndOfRowBlocks`` adapters keep an end-of-row slot after a row's last cell: it counts
as a slot of that cell).

The tokens equal the eager loop's in float32 (``tests/test_static_orders_sv.py``): the same inputs at the same
positions, the same draws, and the blocks laid out as the eager ones with the padding at their end.

Example: ``python run.py decoder=zipar decoder.path=static``; ``python run.py decoder=pjd decoder.path=static``;
``python run.py decoder=zipar_adaptive decoder.path=static``.
"""
from __future__ import annotations

from typing import Any

import torch

from coolsd.acceptance import verify_chain
from coolsd.orders import AdaptiveRowWindow, RowJacobi, RowWindow
from coolsd.rng import ACCEPT, INIT, JACOBI, SAMPLE, sample
from coolsd.sampling import finite_images
from coolsd.types import Draft


def order_refusal(decoder: Any) -> str | None:
    """Why the spatial order of ``decoder`` cannot run on the static path, or None."""
    order = decoder.order
    if type(order) not in (RowWindow, AdaptiveRowWindow, RowJacobi):
        return f"its generation order ({type(order).__name__}) has no static step (ZipAR's RowWindow and " \
               "AdaptiveRowWindow and PJD's RowJacobi have one)"
    return None


def order_step(decoder: Any) -> RowWindowStep | RowJacobiStep:
    """The static step of the spatial order of ``decoder`` (``order_refusal`` passed)."""
    order = decoder.order
    if isinstance(order, RowWindow):
        return RowWindowStep(decoder)
    return AdaptiveRowWindowStep(decoder) if isinstance(order, AdaptiveRowWindow) else RowJacobiStep(decoder)


def _row_ends(model: Any) -> torch.Tensor | None:
    """(N,) bool: the cells after which the model's static cache keeps an end-of-row slot (None: none)."""
    ends = getattr(model, "end_of_row_after", None)
    return ends if isinstance(ends, torch.Tensor) else None


def _first_failure(bad: torch.Tensor, ok: torch.Tensor, active: torch.Tensor, at: torch.Tensor) -> None:
    """Record position ``at`` for the images whose logits were not finite (``ok`` false) for the first time."""
    bad.copy_(torch.where(active & ~ok & (bad < 0), at, bad))


def _eye(t: int, device: torch.device) -> torch.Tensor:
    return torch.eye(t, dtype=torch.bool, device=device)


def _packed(valid: torch.Tensor) -> torch.Tensor:
    """The block index (B, T) of each input of ``valid`` (B, T): the valid ones first, in order, then the others
    (padding), in order."""
    ranks = valid.long().cumsum(1)
    return torch.where(valid, ranks - 1, ranks[:, -1:] + (~valid).long().cumsum(1) - 1)


def _ranked(values: torch.Tensor, where: torch.Tensor, scratch: int) -> torch.Tensor:
    """(B, scratch) the ``values`` (B, T) at ``where`` packed to the front in order (the rest zeros); ``scratch`` is
    the column past the packed values that the others are written to, dropped."""
    rank = torch.where(where, where.long().cumsum(1) - 1, scratch)
    out = torch.zeros(values.shape[0], scratch + 1, dtype=values.dtype, device=values.device)
    return out.scatter_(1, rank, values)[:, :scratch]


class RowWindowStep:
    """ZipAR's fixed window as one fixed-shape step (module doc): the schedule's tables on the model's device."""

    name = "row_window"
    #: the most nodes at each depth of a block (``StaticLoop.levels``): not a tree's, so not known
    levels = None

    def __init__(self, decoder: Any) -> None:
        model = decoder.model
        self.model = model
        device = model.device
        n = model.num_image_tokens
        schedule = decoder.order.schedule()
        ends = _row_ends(model)
        ends = None if ends is None else ends.tolist()
        hide = model.stand_in_is_end_of_row
        s = len(schedule)
        t = max(len(step.feeds) for step in schedule)
        #: forwards per image: the loop calls the step this many times and reads nothing
        self.calls = s
        self.width = t
        cells, sources, outs, kept, seen = [], [], [], [], []
        index, counts, commits, before = [], [], [], []
        slots: list[int] = []  # the cell of every cache slot after the prompt, in cache units
        for step in [*schedule, None]:  # the last row: an idle forward (an image that has finished)
            feeds = step.feeds if step is not None else ()
            pad = t - len(feeds)
            cells.append([f.cell for f in feeds] + [0] * pad)
            sources.append([f.source for f in feeds] + [0] * pad)
            outs.append([n if f.out is None else f.out for f in feeds] + [n] * pad)
            kept.append([f.keep for f in feeds] + [False] * pad)
            seen.append([not (hide and not f.keep and f.source != f.cell) for f in feeds] + [True] * pad)
            keep = [i for i, f in enumerate(feeds) if f.keep]
            index.append(keep + [0] * (t - len(keep)))
            counts.append(len(keep))
            commits.append(len(step.outputs) if step is not None else 0)
            before.append(len(slots))
            for f in feeds:
                if f.keep:
                    slots += [f.cell] * (2 if ends is not None and ends[f.cell] else 1)
        long = {"dtype": torch.long, "device": device}
        self.cells, self.sources, self.outs = (torch.tensor(x, **long) for x in (cells, sources, outs))
        self.kept = torch.tensor(kept, dtype=torch.bool, device=device)  # (S + 1, T)
        self.seen = torch.tensor(seen, dtype=torch.bool, device=device)  # (S + 1, T) an input sees itself
        self.index, self.counts = torch.tensor(index, **long), torch.tensor(counts, **long)
        self.commits, self.before = torch.tensor(commits, **long), torch.tensor(before, **long)
        #: the cells of the cache slots, then −1 (a column before them: a prompt slot, seen)
        self.slots = torch.tensor(slots + [-1], **long)
        self.window = torch.arange(len(slots), **long) - len(slots)  # (K,) a window column's slot, from the block
        self.eye = _eye(t, device)

    def mask(self, k: torch.Tensor) -> torch.Tensor:
        """(B, T, K + T) bool for the forwards ``k`` (B,): a query sees the kept tokens at or before its cell (every
        earlier slot, in the cache's units; a prompt slot) and itself (a hidden stand-in: not itself)."""
        q = self.cells[k]  # (B, T)
        slot = self.before[k][:, None] + self.window  # (B, K)
        key = self.slots[torch.where(slot >= 0, slot, -1)]
        old = key[:, None, :] <= q[:, :, None]
        block = self.kept[k][:, None, :] & (self.cells[k][:, None, :] <= q[:, :, None])
        block = torch.where(self.eye, self.seen[k][:, :, None], block)
        return torch.cat([old, block], -1)

    def __call__(self, ws: Any) -> None:
        """One forward of every image (module doc)."""
        model = self.model
        n = model.num_image_tokens
        k = ws.iterations.clamp(max=self.calls)  # (B,) the image's forward (past the last: the idle row)
        active = ws.t < n
        cells, outs = self.cells[k], self.outs[k]  # (B, T)
        out = model.static_forward(ws.cache, ws.tokens.gather(1, self.sources[k]), cells, self.mask(k))
        x = sample(model.probs(out), ws.streams.uniform_grid(outs, SAMPLE, 1)[..., 0])  # (B, T)
        write = (outs < n) & active[:, None]
        ws.tokens.scatter_(1, outs, torch.where(write, x, ws.tokens.gather(1, outs)))
        step = active.long()
        ws.cache.keep(self.counts[k] * step, self.index[k])
        _first_failure(ws.bad_target, finite_images(out.logits), active, cells[:, 0])
        commits = self.commits[k]
        ws.iterations.add_(step)
        ws.hist.scatter_add_(1, (commits - 1).clamp(min=0)[:, None], step[:, None])
        ws.t.add_(commits * step)
        ws.done.copy_((ws.t >= n).all())


class RowJacobiStep:
    """PJD as one fixed-shape step (module doc): the rows of every image on the device, one slot for a finished
    row's last token and ``A`` segments of ``W`` inputs per forward."""

    name = "row_jacobi"
    levels = None
    #: forwards per image depend on its acceptances: the loop reads whether every image has finished
    calls = None

    def __init__(self, decoder: Any) -> None:
        order, model = decoder.order, decoder.model
        self.model, self.rule = model, decoder.rule
        self.rows, self.cols = order.rows, order.cols
        self.context = min(order.context, self.cols)
        self.limit = min(order.window, self.cols)  # a row's inputs at most (its anchor and its drafts)
        #: every active row commits its next token (ZipAR), not the top one only (PJD)
        self.lower_rows_sample = order.lower_rows_sample
        #: a new row below an incomplete row holds its first token as a draft to verify again (ZipAR's adaptive
        #: window; ``order.tentative``)
        self.adaptive = bool(getattr(order, "adaptive", False))
        #: W: a segment's inputs (a row's anchor and W − 1 drafts; a tentative row: its stand-in and first token)
        self.window = min(max(self.limit, 2 if self.adaptive else 1), self.cols)
        #: A: the most rows active at once (module doc)
        self.segments = min(self.rows, self.cols - self.context + 1)
        self.width = 1 + self.segments * self.window  # T
        n = model.num_image_tokens
        ends = _row_ends(model)
        #: the cache slots an image's tokens can fill (in the cache's units: a row's last cell with its end of row)
        self.capacity = n + (0 if ends is None else int(ends.sum()))
        self.hide = model.stand_in_is_end_of_row
        device = model.device
        long = {"dtype": torch.long, "device": device}
        self.segment = torch.arange(self.segments, **long)[None, :, None]  # (1, A, 1)
        self.column = torch.arange(self.window, **long)  # (W,) an input's place in its segment
        self.old = torch.arange(self.capacity, **long) - self.capacity  # (K,) a window column's slot, from the block
        self.eye = _eye(self.width, device)
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def state(self, ws: Any) -> dict[str, torch.Tensor]:
        """The rows of the workspace's images (built at its batch size's first call; restarted by ``__call__``):
        ``count``, ``started``, ``cached``, ``carried`` (B, R + 1) (column R: a scratch row, complete and not
        started), the cells of the cache slots ``slots`` (B, K + 1) and their number ``filled`` (B,), the drafts by
        cell ``draft`` (B, N + 1) and their distributions ``q`` (B, N + 1, V) (column N: scratch)."""
        b = ws.t.shape[0]
        found = self._states.get(b)
        if found is None:
            device = ws.t.device
            n, rows, v = self.model.num_image_tokens, self.rows, self.model.codebook_size
            long = {"dtype": torch.long, "device": device}
            found = self._states[b] = {
                "count": torch.zeros(b, rows + 1, **long), "carried": torch.zeros(b, rows + 1, **long),
                "started": torch.zeros(b, rows + 1, dtype=torch.bool, device=device),
                "cached": torch.zeros(b, rows + 1, dtype=torch.bool, device=device),
                "slots": torch.zeros(b, self.capacity + 1, **long), "filled": torch.zeros(b, **long),
                "draft": torch.zeros(b, n + 1, **long), "q": torch.zeros(b, n + 1, v, device=device),
                "first": torch.tensor([1] + [0] * (rows - 1) + [self.cols], **long),  # a new image's counts
                "row": torch.arange(rows + 1, **long)}
        return found

    def _restart(self, state: dict[str, torch.Tensor], new: torch.Tensor) -> None:
        """The images ``new`` (B,) start: cell 0 committed (the prefill's), row 0 started (and row 1 with a context
        of one token), nothing cached or carried."""
        rows = self.rows
        first = new[:, None]
        state["count"].copy_(torch.where(first, state["first"], state["count"]))
        started = (state["row"] == 0) | ((state["row"] == 1) & (self.context <= 1) & (rows > 1))
        state["started"].copy_(torch.where(first, started & (state["row"] < rows), state["started"]))
        state["cached"].masked_fill_(first, False)
        state["carried"].masked_fill_(first, 0)
        state["filled"].masked_fill_(new, 0)

    def __call__(self, ws: Any) -> None:
        """One forward of every image: its rows' inputs, the verification of each row, the commits (module doc)."""
        model = self.model
        rows, cols, w, segments, t = self.rows, self.cols, self.window, self.segments, self.width
        n = model.num_image_tokens
        v = model.codebook_size
        st = self.state(ws)
        self._restart(st, ws.iterations == 0)
        count, started, cached, carried = st["count"], st["started"], st["cached"], st["carried"]
        b = ws.t.shape[0]
        device = ws.t.device
        active = ws.t < n
        fw = ws.iterations  # (B,) the image's forward count (the key of its draws)
        # the rows of the A segments: below the complete rows (a prefix), top first
        top = (count[:, :rows] == cols).sum(1)  # (B,)
        seg_row = top[:, None] + self.segment[..., 0]  # (B, A)
        row = torch.where(seg_row < rows, seg_row, rows)  # out of the grid: the scratch row
        c = count.gather(1, row)
        live = started.gather(1, row) & (c < cols) & active[:, None]  # (B, A)
        c_above = count.gather(1, (row - 1).clamp(min=0))
        above = torch.where(self.segment[..., 0] == 0, cols, c_above)
        drafts = torch.where(live, torch.minimum(above - c, torch.full_like(c, self.limit)) - 1, 0).clamp(min=0)
        # a new row below an incomplete row (adaptive ZipAR): its first token, drafted the forward before, if any
        tentative = live & (c == 0) & (self.segment[..., 0] > 0) if self.adaptive else None
        if tentative is not None:
            drafts = torch.where(tentative, carried.gather(1, row).clamp(max=1), drafts)
        base = row * cols + c  # (B, A) each row's first draft cell
        own = c > 0
        above_end = (row - 1).clamp(min=0) * cols + cols - 1
        anchor_cell = torch.where(own, base - 1, above_end)
        anchor_source = torch.where(own, base - 1, (row - 1).clamp(min=0) * cols + c_above - 1).clamp(min=0)
        j = self.column[None, None, 1:] - 1  # (1, 1, W − 1) a draft's place
        draft_ok = live[..., None] & (j < drafts[..., None])  # (B, A, W − 1)
        draft_cell = torch.where(draft_ok, base[..., None] + j, n)
        fresh = draft_ok & (j >= carried.gather(1, row)[..., None])
        # a finished row's last token (the row above the top one, once)
        done_row = (top - 1).clamp(min=0)
        finish = active & (top >= 1) & (top - 1 < rows - 1) & ~cached.gather(1, done_row[:, None])[:, 0]
        finish_cell = done_row * cols + cols - 1
        # fresh drafts: a uniform code, q one-hot (keyed by cell and forward, as the eager loop)
        flat_cell = draft_cell.flatten(1)  # (B, A·(W − 1))
        u = ws.streams.uniform_keyed(flat_cell, INIT, fw[:, None])
        code = (u * v).long().clamp_(max=v - 1)
        new = fresh.flatten(1)
        draft, q = st["draft"], st["q"]
        draft.scatter_(1, flat_cell, torch.where(new, code, draft.gather(1, flat_cell)))
        q_index = flat_cell[..., None].expand(-1, -1, v)
        one_hot = torch.zeros_like(q_index, dtype=q.dtype).scatter_(2, code[..., None], 1.0)
        q.scatter_(1, q_index, torch.where(new[..., None], one_hot, q.gather(1, q_index)))
        # the inputs in the eager order (the finished row's token, then each row's anchor and drafts), packed
        draft_source = n + draft_cell
        inputs = torch.cat([finish[:, None], torch.cat([live[..., None], draft_ok], 2).flatten(1)], 1)  # (B, T)
        cell = torch.cat([finish_cell[:, None], torch.cat([anchor_cell[..., None], draft_cell], 2).flatten(1)], 1)
        source = torch.cat([finish_cell[:, None], torch.cat([anchor_source[..., None], draft_source], 2).flatten(1)],
                           1)
        committed = torch.cat([torch.ones_like(finish[:, None]),
                               torch.cat([own[..., None], torch.zeros_like(draft_ok)], 2).flatten(1)], 1)
        group = torch.cat([torch.full_like(finish_cell[:, None], -1),
                           torch.cat([torch.where(own, row, -3 - row)[..., None],
                                      row[..., None].expand(-1, -1, w - 1)], 2).flatten(1)], 1)
        stand_in = torch.cat([torch.zeros_like(finish[:, None]),
                              torch.cat([~own[..., None], torch.zeros_like(draft_ok)], 2).flatten(1)], 1)
        hidden = stand_in & (source != cell) if self.hide else torch.zeros_like(stand_in)
        cell = torch.where(inputs, cell, 0)
        source = torch.where(inputs, source, 2 * n)
        committed = committed & inputs
        group = torch.where(inputs, group, -2)
        hidden = hidden & inputs
        dest = _packed(inputs)  # (B, T) each input's block index

        def block(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x).scatter_(1, dest, x)

        b_cell, b_source, b_committed, b_group, b_hidden = (block(x) for x in (cell, source, committed, group,
                                                                                hidden))
        out = model.static_forward(ws.cache, torch.cat([ws.tokens[:, :n], draft], 1).gather(1, b_source), b_cell,
                                   self.mask(st, b_cell, b_committed, b_group, b_hidden))
        p = model.probs(out)  # (B, T, V) in block order
        p = p.gather(1, dest[..., None].expand(-1, -1, v))  # (B, T, V) in input order
        # every row of every image verified at once (verify_chain, the eager loop's draws)
        chains = b * segments
        img = torch.arange(b, device=device).repeat_interleave(segments)  # (C,)
        p_chain = p[:, 1:].reshape(chains, w, v)  # a row's anchor and drafts: its cells base .. base + W − 1
        d_cell = draft_cell.reshape(chains, w - 1)
        d_q = q.gather(1, flat_cell[..., None].expand(-1, -1, v)).reshape(chains, w - 1, v)
        d_valid = draft_ok.reshape(chains, w - 1)
        f_chain = fw[img][:, None]
        base_c = base.reshape(chains)
        # the next token's draw: index 0 at the cell it commits to; a tentative first token's 1 + the forward count
        index = 0 if tentative is None else torch.where(tentative, fw[:, None] + 1, 0).reshape(chains, 1)
        u_accept = ws.streams.uniform_keyed(d_cell, ACCEPT, f_chain, img)
        k = self.column[None, :]  # (1, W) an output's place
        o_cell = torch.where(live.reshape(chains, 1) & (k <= drafts.reshape(chains, 1)), base_c[:, None] + k, n)
        u_carry = ws.streams.uniform_keyed(o_cell, JACOBI, f_chain, img)
        verdict = verify_chain(
            self.rule, p_chain, Draft(tokens=draft.gather(1, flat_cell).reshape(chains, w - 1), q=d_q,
                                      valid=d_valid, forwards=[0] * chains),
            u_accept,
            lambda accepted: ws.streams.uniform_keyed((base_c + accepted)[:, None], SAMPLE, index, img)[:, 0])
        accepted = verdict.num_accepted.view(b, segments)
        next_token = verdict.next_token.view(b, segments)
        # commit: every draft at its cell (a prefix of them counts), the next token after a row's accepted ones (the
        # top row's; ZipAR: every row's)
        ws.tokens.scatter_(1, flat_cell, draft.gather(1, flat_cell))
        bonus = live & ((self.segment[..., 0] == 0) | self.lower_rows_sample)  # (B, A)
        ws.tokens.scatter_(1, torch.where(bonus, base + accepted, n), next_token)
        # the next drafts: a fresh sample of every output, its q that output (the Jacobi update)
        carry = sample(p_chain, u_carry)  # (C, W)
        o_flat = o_cell.reshape(b, segments * w)
        draft.scatter_(1, o_flat, carry.reshape(b, segments * w))
        q.scatter_(1, o_flat[..., None].expand(-1, -1, v), p_chain.reshape(b, segments * w, v))
        # the counts, the slots kept, the carried drafts and the rows that start
        m = torch.where(live, accepted + bonus.long(), 0)  # (B, A) tokens committed per row
        if tentative is not None:  # a tentative row: its first token and the next once accepted, else nothing
            again = tentative & (accepted == 0) & (drafts > 0)  # rejected: the residual's sample replaces it
            draft.scatter_(1, torch.where(again, base, n), torch.where(again, next_token, draft[:, n:]))
            m = torch.where(tentative, torch.where(accepted == 1, 2, 0), m)
        place = self.column[None, None, :]  # (1, 1, W)
        keep_seg = (place < m[..., None]) & ((place >= 1) | own[..., None])  # (B, A, W)
        kept = torch.cat([finish[:, None], keep_seg.flatten(1)], 1)  # (B, T) in input order
        kept_block = block(kept)
        order = torch.arange(t, device=device).expand(b, -1)
        kept_count = kept_block.long().sum(1)
        ws.cache.keep(kept_count, _ranked(order, kept_block, t))
        self._keep_slots(st, kept_block, b_cell)
        count.scatter_add_(1, row, m)
        carried.scatter_(1, row, torch.where(live, (drafts + 1 - m).clamp(min=0), carried.gather(1, row)))
        cached.scatter_(1, torch.where(finish, done_row, rows)[:, None], True)
        started[:, 1:rows] |= started[:, :rows - 1] & (count[:, :rows - 1] >= self.context)
        committed_tokens = m.sum(1)
        _first_failure(ws.bad_target, finite_images(out.logits), active, ws.t)
        step = active.long()
        ws.iterations.add_(step)
        ws.hist.scatter_add_(1, (committed_tokens - 1).clamp(min=0)[:, None], step[:, None])
        ws.t.add_(committed_tokens * step)
        ws.done.copy_((ws.t >= n).all())

    def mask(self, st: dict[str, torch.Tensor], cell: torch.Tensor, committed: torch.Tensor, group: torch.Tensor,
             hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, K + T) bool over the cache's last K slots and the block (inputs in block order): a query sees the
        committed tokens before its cell and its own row's earlier drafts, and itself (a hidden stand-in: not)."""
        slot = st["filled"][:, None] + self.old  # (B, K)
        key = st["slots"].gather(1, slot.clamp(min=0))
        key = torch.where(slot >= 0, key, -1)
        q = cell[:, :, None]
        old = key[:, None, :] < q
        block = (cell[:, None, :] < q) & (committed[:, None, :] | (group[:, None, :] == group[:, :, None]))
        block = torch.where(self.eye, ~hidden[:, :, None], block)
        return torch.cat([old, block], -1)

    def _keep_slots(self, st: dict[str, torch.Tensor], kept: torch.Tensor, cell: torch.Tensor) -> None:
        """Append the cells of the kept inputs (B, T) in block order to each image's cache slots (a row's last cell
        twice where the cache keeps its end of row)."""
        ends = _row_ends(self.model)
        units = kept.long() if ends is None else kept.long() * (1 + ends[cell].long())
        first = st["filled"][:, None] + units.cumsum(1) - units  # (B, T) each kept input's first slot
        scratch = self.capacity
        slots = st["slots"]
        slots.scatter_(1, torch.where(kept, first, scratch).clamp(max=scratch), cell)
        if ends is not None:
            second = kept & ends[cell]
            slots.scatter_(1, torch.where(second, first + 1, scratch).clamp(max=scratch), cell)
        st["filled"].add_(units.sum(1))


class AdaptiveRowWindowStep(RowJacobiStep):
    """ZipAR's adaptive window as one fixed-shape step (module doc): ``row_jacobi``'s step with a segment of two
    inputs per row, every row's next token committed and a new row's first token tentative."""

    name = "row_adaptive"
