"""The static decode path's state and steps: one named step per path, chosen when the decoder is built.

A batch's state lives on the device in a ``Workspace`` kept per batch size and refilled in place for every batch:
the KV cache at its final capacity with per-image lengths (``coolsd.kv_cache.DeviceKVCache``), the tokens, the
per-image committed counts ``t``, the per-image random streams (their keys refilled; every draw is a pure
function of seed and position, ``coolsd.rng``), and the statistics the records need. A step reads and writes only
these tensors and the drafter's own buffers (``Drafter.static_*``), with fixed shapes and no host read, so it can be
compiled or captured (``coolsd.static.capture``):

* ``ar``: forward the last token of every image at its position, draw the next from ``p`` (SAMPLE draw 0 at the
  position, as the eager loop draws it), commit it where the image is still decoding;
* ``chain`` (an EAGLE or model drafter's chain: vanilla SD, COOL-SD, LANTERN, LANTERN++) and ``jacobi_window`` (the
  target's own Jacobi window: SJD, SCD-MC/GS, GSD): draft exactly ``L`` tokens per image (those past an image's end
  are invalid, ``limit``), verify the fixed ``L + 1`` block over the whole cache with a mask from positions, find
  the first rejection and draw the next token on the device (``verify_chain``, the rules' own ``accept_prob`` and
  ``residual``), commit by a masked scatter and keep the accepted prefix by moving each image's length (no KV copy);
  a decoder's verifier (SJD-SV, GSD-SV, LANTERN-SV: ``baselines.sv``) takes ``verify_chain``'s place;
* ``row_window`` (ZipAR's fixed window), ``row_adaptive`` (ZipAR's adaptive window) and ``row_jacobi`` (PJD): a
  spatial generation order's forward of every image, its inputs at their grid cells with a mask computed from cells
  (``coolsd.static.orders``).

Structural tokens (Lumina-mGPT's end-of-row, Emu3's end-of-line token after every row) are the adapter's, as on
the eager path: the steps run in image tokens, and the adapter's ``static_forward`` adds the end-of-row slots to a
block on the device from a map of the positions that end a row, built once per resolution, into a cache that keeps
them (``static_cache``: ``coolsd.models.lumina_mgpt.RowEndKVCache``, whose ``keep`` takes image tokens). A fixed
block has room for as many of them as its nodes can need, sized from the most nodes at each depth of the loop's
blocks (``StaticLoop.levels``); drafts, verification and the accepted-length statistics never see them, and the
tokens and statistics are the eager path's (``tests/test_static_lumina_emu3.py``). The other adapters' caches and
steps are unchanged (``ImageARModel.static_cache``: a plain ``DeviceKVCache``).

In a lock-step batch (``generate_batch``) images that finish stay in the batch and commit nothing until its slowest
image ends; the loop reads one value per iteration (whether every image has finished), none per AR step (AR takes
exactly ``N − 1`` steps), and the statistics once at the end. With refilling (``generate_stream``,
``decoder.refill``) a list of prompts is a queue through the batch's rows: the one read per iteration says which
rows have finished, and between two steps, outside them, each finished row's image is set aside and the row takes
the queue's next prompt (its prefill, its KV rows, tokens, counts, random stream and drafter state replaced row by
row in place), so every shape stays fixed and the same step runs; once the queue is empty the finished rows idle
as in lock-step. Plain AR needs none (all its images finish together).

The tokens equal the eager loop's in float32 on the embedded model (``tests/test_static_path.py``), and a refilled
image's its lock-step ones (``tests/test_refill.py``): the same draws at the same positions, and a forward's bits
do not depend on how many keys or rows it spans there (padding-invariant attention, batch-invariant linears).
Latency is wall time from the prefill to the last token (refilled: from the image's own prefill to the end of the
iteration in which it finished), by CUDA events on a GPU (synchronised once at the end) and ``perf_counter``
elsewhere; the TV diagnostic of a relaxed rule runs
between steps, timed apart and not counted; no other phase is timed (the anatomy pass of ``scripts/bench.py`` does
that on the eager path).

Example: ``Decoder(..., path="static")`` builds a ``StaticLoop``; ``python run.py decoder=sjd decoder.path=static``;
``python run.py decoder=sd decoder.path=static decoder.refill=true eval.batch_size=16``.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coolsd.acceptance import TreePlan, summed_tv, verify_chain, verify_tree_parallel
from coolsd.drafters.base import NullDrafter
from coolsd.kv_cache import DeviceKVCache, padding_invariant_attention
from coolsd.rng import ACCEPT, SAMPLE, Streams, sample
from coolsd.sampling import finite_images
from coolsd.static.capture import Runner, mode_for
from coolsd.trees import TreeShape, ancestor_mask, ancestor_masks, depths_of
from coolsd.types import DecodeStats, Generation, Verdict

STEPS = ("ar", "chain", "tree", "jacobi_window", "row_window", "row_jacobi", "row_adaptive")


@dataclass(frozen=True)
class Workspace:
    """The device state of one batch size (module doc); every tensor is updated in place, never replaced."""

    cache: DeviceKVCache
    streams: Streams
    tokens: torch.Tensor  # (B, N + room) committed tokens, then scratch
    t: torch.Tensor  # (B,) committed image tokens
    done: torch.Tensor  # () bool: every image has finished (the one value read per iteration)
    bad_target: torch.Tensor  # (B,) first position whose target logits were not finite (−1: none)
    bad_drafter: torch.Tensor  # (B,) the same for the drafter's logits
    iterations: torch.Tensor  # (B,) verify forwards (AR steps)
    hist: torch.Tensor  # (B, C) iterations that committed c + 1 tokens
    drafter_forwards: torch.Tensor  # (B,)
    tv_sum: torch.Tensor  # (B,) float64, the exact one-step TV summed over the tests
    tv_steps: torch.Tensor  # (B,) acceptance tests made
    #: the latest iteration's tests for the TV diagnostic (relaxed rules): p', q (E, B, R, V), depth, made (E, B, R);
    #: a chain's E = 1 test block of R = L rows, a tree's one block per sibling rank over the R = L + 1 rows it visited
    tests: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def new(cls, cache: DeviceKVCache, streams: Streams, batch: int, width: int, commits: int, vocab: int,
            tests: tuple[int, int] | None) -> "Workspace":
        device = cache.device
        long = dict(dtype=torch.long, device=device)
        return cls(cache=cache, streams=streams,
                   tokens=torch.zeros(batch, width, **long), t=torch.ones(batch, **long),
                   done=torch.zeros((), dtype=torch.bool, device=device),
                   bad_target=torch.full((batch,), -1, **long), bad_drafter=torch.full((batch,), -1, **long),
                   iterations=torch.zeros(batch, **long), hist=torch.zeros(batch, commits, **long),
                   drafter_forwards=torch.zeros(batch, **long),
                   tv_sum=torch.zeros(batch, dtype=torch.float64, device=device),
                   tv_steps=torch.zeros(batch, **long),
                   tests=None if tests is None else (
                       torch.zeros(tests[0], batch, tests[1], vocab, device=device),
                       torch.zeros(tests[0], batch, tests[1], vocab, device=device),
                       torch.zeros(tests[0], batch, tests[1], **long),
                       torch.zeros(tests[0], batch, tests[1], dtype=torch.bool, device=device)))

    def reset(self, first_tokens: torch.Tensor, prefill_finite: torch.Tensor) -> None:
        """A new batch: the first tokens, every count zeroed (in place)."""
        self.tokens.zero_()
        self.tokens[:, 0] = first_tokens
        self.t.fill_(1)
        self.done.fill_(False)
        self.bad_target.copy_(torch.where(prefill_finite, -1, 0))
        self.bad_drafter.fill_(-1)
        for counter in (self.iterations, self.hist, self.drafter_forwards, self.tv_sum, self.tv_steps):
            counter.zero_()

    def reset_rows(self, rows: torch.Tensor, first_tokens: torch.Tensor, prefill_finite: torch.Tensor) -> None:
        """``reset`` for the images of ``rows`` (R,) only (a refilled row, ``StaticLoop.generate_stream``): their
        first tokens (R,), their counts zeroed, in place; the other rows are untouched.

        Example: ``ws.reset_rows(torch.tensor([0, 2]), first, finite_images(out.logits))``."""
        tokens = torch.zeros(rows.shape[0], self.tokens.shape[1], dtype=self.tokens.dtype, device=self.tokens.device)
        tokens[:, 0] = first_tokens
        self.tokens.index_copy_(0, rows, tokens)
        self.t.index_fill_(0, rows, 1)
        self.done.fill_(False)
        self.bad_target.index_copy_(0, rows, torch.where(prefill_finite, -1, 0).to(self.bad_target))
        self.bad_drafter.index_fill_(0, rows, -1)
        for counter in (self.iterations, self.hist, self.drafter_forwards, self.tv_sum, self.tv_steps):
            counter.index_fill_(0, rows, 0)


def _first_failure(bad: torch.Tensor, ok: torch.Tensor, active: torch.Tensor, t: torch.Tensor) -> None:
    """Record position ``t`` for the images whose logits were not finite (``ok`` false) for the first time."""
    bad.copy_(torch.where(active & ~ok & (bad < 0), t, bad))


class StaticLoop:
    """The static path of one ``Decoder``: its named step, workspaces and runners (module doc)."""

    def __init__(self, decoder: Any) -> None:
        refusal = static_refusal(decoder)
        if refusal:
            raise ValueError(f"decoder {decoder.name!r} cannot run on decoder.path=static: {refusal}; use "
                             "decoder.path=eager (the papers' loop)")
        self.decoder = decoder
        self.model = decoder.model
        self.drafter = decoder.drafter
        self.depth = decoder.max_depth  # L: draft levels of every iteration
        self.tree = decoder.tree  # a static shape, an EAGLE-2 spec, or None
        #: whether the drafts are a tree (a drafter's tree, or SJD-PAC's window), verified by the parallel walk
        self.tree_drafts = decoder.order is None and (self.tree is not None or decoder.max_nodes != self.depth)
        #: a spatial order's step (ZipAR's ``row_window`` and ``row_adaptive``, PJD's ``row_jacobi``:
        #: ``coolsd.static.orders``), or None
        self.order_step = None
        if decoder.order is not None:
            from coolsd.static.orders import order_step

            self.order_step = order_step(decoder)
        self.step_name = self.order_step.name if self.order_step is not None else "ar" if decoder.plain_ar else (
            "jacobi_window" if self.drafter.self_drafting else "tree" if self.tree is not None else "chain")
        self.step = self.order_step or {"ar": self.ar_step, "chain": self.chain_step, "tree": self.tree_step,
                                        "jacobi_window": self.jacobi_step}[self.step_name]
        room = 2 * getattr(self.drafter, "extra_slots", 0)  # an EAGLE drafter's speculative cache slots
        #: the drafter cache's room on this path: what an iteration feeds at most (the pending block, then every
        #: expansion), not the eager path's 2 · extra_slots, since a static step attends to the whole capacity
        self.drafter_room: int | None = None
        if room:  # the static cache cannot refuse an overflow inside a step: check the largest iteration here
            need = (self.depth + 1) + (self.tree.depth * self.tree.top_k if self.tree is not None
                                       and not isinstance(self.tree, TreeShape) else decoder.max_nodes)
            self.drafter_room = need
            if need > room:
                raise ValueError(f"decoder {decoder.name!r}: an iteration feeds up to {need} pairs to the drafter "
                                 f"cache, which holds {room}: set drafter.extra_slots={-(-need // 2)} or more")
        #: the parallel walk's width: the most children a node of these trees has
        self.width = 1
        #: the most rows with children (an EAGLE-2 tree: the root and top_k expanded nodes per level; None: M)
        self.internal: int | None = None
        if isinstance(self.tree, TreeShape):
            parents = self.tree.parents()
            self._shape = (ancestor_mask(parents), torch.tensor([0] + depths_of(parents)))  # (M+1, M+1), (M+1,)
            self._plan = TreePlan.of(parents)  # the parallel walk's row layout of the shape
            self.width = len(self._plan.sizes)
        elif self.tree is not None:
            self.width = self.tree.top_k
            self.internal = 1 + self.tree.top_k * self.tree.depth
        elif self.tree_drafts:
            self.width = self.drafter.tree_width
        #: the most nodes at each depth of this loop's blocks (depth 0: the last committed token), from which an
        #: adapter with structural slots sizes a block (``ImageARModel.static_cache``); None: not known
        self.levels = self._levels()
        self.mode = mode_for(self.model.device, bool(getattr(self.model, "compile", False)))
        #: AR steps per call (per captured graph on a GPU): AR needs no read between its steps
        self.ar_steps = 8 if self.mode == "graph" else 1
        self.diagnose_tv = (decoder.track_tv and decoder.tv_measured and not decoder.rule.lossless
                            and not decoder.plain_ar)
        self._workspaces: dict[int, tuple[Workspace, Runner]] = {}
        self._streams: dict[int, Streams] = {}  # per batch size: the persistent random streams
        self._offsets: dict[torch.device, torch.Tensor] = {}
        #: this loop's own store of the tree code's constants (``coolsd.trees._shaped``, the parallel walk's rank
        #: slots): a compiled step guards on the stores it reads, and these are filled by its first call only
        self._constants: dict = {}
        #: the draw index of an iteration's uniforms: ACCEPT 0 .. max_nodes − 1, then SAMPLE 0 (held here, read by
        #: every step)
        self._draws = Streams.draws((ACCEPT, decoder.max_nodes), (SAMPLE, 1), device=self.model.device)
        #: the wall time of the latest ``generate_stream``, diagnostics excluded (None before the first)
        self.stream_s: float | None = None

    # -- the steps --------------------------------------------------------------------------------------
    def ar_step(self, ws: Workspace) -> None:
        """Plain AR: one token per image (module doc)."""
        model = self.model
        n_tokens = model.num_image_tokens
        t = ws.t
        active = t < n_tokens
        at = (t - 1)[:, None]  # (B, 1) the last committed token's position
        out = model.static_forward(ws.cache, ws.tokens.gather(1, at), at)
        _first_failure(ws.bad_target, finite_images(out.logits), active, t)
        x = sample(model.probs(out)[:, 0], ws.streams.uniform(t, SAMPLE, 1)[:, 0])  # (B,)
        ws.tokens.scatter_(1, t[:, None], torch.where(active, x, ws.tokens.gather(1, t[:, None])[:, 0])[:, None])
        step = active.long()
        ws.cache.keep(step)
        ws.iterations.add_(step)
        ws.hist[:, 0].add_(step)
        ws.t.add_(step)

    def chain_step(self, ws: Workspace) -> None:
        """Draft ``L`` tokens with the drafter network, verify the ``L + 1`` block, commit (module doc)."""
        self._speculative_step(ws)

    def tree_step(self, ws: Workspace) -> None:
        """Draft every level of a static or EAGLE-2 tree, verify its ``M + 1`` block under its ancestor mask, walk
        every node's siblings at once (``verify_tree_parallel``), commit the accepted path and compact its KV
        entries with one gather and one scatter (module doc)."""
        self._speculative_step(ws)

    def jacobi_step(self, ws: Workspace) -> None:
        """The Jacobi window of ``L`` tokens (the target drafting for itself), verified as a chain, or SJD-PAC's
        window tree verified by the parallel walk (module doc)."""
        self._speculative_step(ws)

    def _block(self, draft, t: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                      TreePlan | None]:
        """Positions (B, M + 1) of the verify block ``[last committed token, drafts]`` (past the grid: clamped), its
        mask: causal for a chain (None), the shape's ancestor mask, or each image's (dynamic trees), and a fixed
        shape's ``TreePlan`` (else None)."""
        device = t.device
        m = draft.tokens.shape[1]
        if not self.tree_drafts:
            return ((t - 1)[:, None] + self._columns(m + 1, device)).clamp(max=n_tokens - 1), None, None
        if isinstance(self.tree, TreeShape):
            key = ("shape", device)
            if key not in self._offsets:
                self._offsets[key] = (self._shape[0].to(device), self._shape[1].to(device), self._plan.to(device))
            mask, depth, plan = self._offsets[key]
            return ((t - 1)[:, None] + depth).clamp(max=n_tokens - 1), mask, plan
        mask = ancestor_masks(draft.parents, levels=self.depth + 1)  # (B, M + 1, M + 1)
        return ((t - 1)[:, None] + mask.sum(-1) - 1).clamp(max=n_tokens - 1), mask, None

    def _speculative_step(self, ws: Workspace) -> None:
        model, decoder = self.model, self.decoder
        n_tokens = model.num_image_tokens
        depth = self.depth
        t = ws.t
        active = t < n_tokens
        limit = (n_tokens - 1 - t).clamp(0, depth)  # (B,) draft levels that fit in each image
        last = ws.tokens.gather(1, (t - 1)[:, None])[:, 0]  # (B,)
        # 1. draft
        draft = self.drafter.static_propose(last, t, limit, depth, self.tree, cache=self._constants)
        m = draft.tokens.shape[1]
        # 2. verify [last committed token, drafts] at each node's position (a node at depth d: t − 1 + d)
        positions, mask, plan = self._block(draft, t, n_tokens)
        out = model.static_forward(ws.cache, torch.cat([last[:, None], draft.tokens], 1), positions, mask)
        p = model.probs(out)  # (B, M + 1, V)
        # 3. accept / resample with each image's ACCEPT draws 0..M−1 and SAMPLE draw 0 at t (the eager loop's)
        u = ws.streams.uniforms(t, index=self._draws)
        u_accept, u_sample = u[:, :m], u[:, decoder.max_nodes]
        if self.tree_drafts and not decoder.verifies_trees:
            verdict = verify_tree_parallel(decoder.rule, p, draft, u_accept, u_sample, self.width, depth,
                                           tests=decoder.track_tv, ancestors=mask, plan=plan,
                                           internal=self.internal, cache=self._constants)
        else:
            verdict = (decoder.verifier or verify_chain)(decoder.rule, p, draft, u_accept, u_sample)
        n = verdict.num_accepted  # (B,)
        # 4. commit: the accepted path and the next token at t .., where the image is still decoding; keep the
        #    path's KV entries (a chain's are already in place: a length move)
        offsets = self._columns(depth + 1, t.device)
        path = verdict.path[:, :depth]  # (B, L): node indices along the accepted path (a chain's: 0 .. L − 1)
        accepted = draft.tokens.gather(1, path) if self.tree_drafts else draft.tokens
        values = torch.cat([accepted, accepted[:, :1]], 1).scatter(1, n[:, None], verdict.next_token[:, None])
        write = (offsets <= n[:, None]) & active[:, None]
        columns = t[:, None] + offsets  # (B, L + 1)
        ws.tokens.scatter_(1, columns, torch.where(write, values, ws.tokens.gather(1, columns)))
        committed = torch.where(active, n + 1, 0)
        ws.cache.keep(committed, torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1) if self.tree_drafts
                      else None)
        # 5. observe
        self.drafter.static_observe(out, p, draft, verdict, active)
        # statistics, on the device
        _first_failure(ws.bad_target, finite_images(out.logits), active, t)
        if draft.finite is not None:
            _first_failure(ws.bad_drafter, draft.finite, active, t)
        if isinstance(draft.forwards, torch.Tensor):
            ws.drafter_forwards.add_(draft.forwards * active)
        step = active.long()
        ws.iterations.add_(step)
        ws.hist.scatter_add_(1, n[:, None], step[:, None])
        if decoder.track_tv:
            made = [test[3] & active.view(-1, *[1] * (test[3].dim() - 1)) for test in verdict.tests]
            ws.tv_steps.add_(sum(x.flatten(1).sum(-1) for x in made))
            if ws.tests is not None:  # the relaxed rule's TV, computed between steps (``diagnose``)
                for e, ((residual, q, test_depth, _), x) in enumerate(zip(verdict.tests, made)):
                    rows = x.shape[1]
                    ws.tests[0][e, :, :rows].copy_(residual[:, :rows])
                    ws.tests[1][e, :, :rows].copy_(q)
                    ws.tests[2][e, :, :rows].copy_(test_depth.expand(x.shape))
                    ws.tests[3][e, :, :rows].copy_(x)
        ws.t.add_(committed)
        ws.done.copy_((ws.t >= n_tokens).all())

    def diagnose(self, ws: Workspace) -> None:
        """The exact one-step TV of the latest iteration's tests (a relaxed rule's; not part of the latency)."""
        p, q, depth, made = ws.tests
        verdict = Verdict(num_accepted=ws.t, next_token=ws.t, path=ws.tokens[:, :0],
                          tests=tuple(zip(p.unbind(0), q.unbind(0), depth.unbind(0), made.unbind(0))))
        tv, _ = summed_tv(self.decoder.rule, verdict)
        ws.tv_sum.add_(tv)

    def _levels(self) -> tuple[int, ...] | None:
        """The most nodes at each depth of a block (``levels``): one per depth of AR and a chain, a static shape's
        own, an EAGLE-2 tree's ``top_k`` children of the root and ``top_k`` of each of its ``top_k`` frontier nodes
        below, SJD-PAC's window tree (the drafter's ``template``: ``tree_width`` siblings per branching level, then
        its chain), or what the drafter's ``block_levels(nodes)`` says (PathRelax's ``K`` paths)."""
        if self.order_step is not None:
            return self.order_step.levels
        if self.step_name == "ar":
            return (1,)
        if not self.tree_drafts:
            return (1,) * (self.depth + 1)
        if isinstance(self.tree, TreeShape):
            depths = self._shape[1].tolist()
            return tuple(depths.count(d) for d in range(max(depths) + 1))
        nodes = self.decoder.max_nodes
        if self.tree is not None:
            k = self.tree.top_k
            return (1, min(k, nodes)) + (min(k * k, nodes),) * (self.depth - 1)
        block_levels = getattr(self.drafter, "block_levels", None)  # a drafter that says its own (PathRelax)
        if block_levels is not None:
            return block_levels(nodes)
        template = getattr(self.drafter, "template", None)
        if template is None:
            return None
        slots = template(nodes).slot.tolist()
        return (1,) + tuple(slots.count(d) for d in range(max(slots) + 1))

    def _columns(self, count: int, device: torch.device) -> torch.Tensor:
        key = (count, device)
        if key not in self._offsets:
            self._offsets[key] = torch.arange(count, device=device)[None, :]
        return self._offsets[key]

    # -- a batch ----------------------------------------------------------------------------------------
    def decode(self, ws: Workspace, runner: Runner, clock: "_Clock") -> int:
        """Run the steps to the end of every image of the batch; return the number of step calls. AR takes
        exactly ``N − 1`` steps and ZipAR its schedule's forwards (``calls``), reading nothing; the others read
        ``ws.done`` once per iteration."""
        n_tokens = self.model.num_image_tokens
        if self.step_name == "ar" or getattr(self.order_step, "calls", None):
            calls = getattr(self.order_step, "calls", None) or -(-(n_tokens - 1) // self.ar_steps)
            for _ in range(calls):
                runner()
            return calls
        for call in range(1, n_tokens + 1):  # at most N − 1 iterations: each commits a token per image
            runner()
            if self.diagnose_tv:
                with clock.apart():
                    self.diagnose(ws)
            if bool(ws.done):  # the iteration's one host read
                return call
        return n_tokens

    def _workspace(self, cache: Any, batch: int) -> tuple[Workspace, Runner]:
        """The batch size's workspace and runner, built at its first batch (over that batch's prefilled cache) and
        refilled for every later one."""
        found = self._workspaces.get(batch)
        if found is None:
            model = self.model
            tests = None
            if self.diagnose_tv:  # (blocks, rows): a chain's one block of L rows, a tree's one per sibling rank
                tests = (self.width, self.depth + 1) if self.tree_drafts else (1, self.depth)
            ws = Workspace.new(model.static_cache(cache, self.levels), self._streams[batch], batch,
                               width=model.num_image_tokens + self.decoder.max_nodes + 2,
                               commits=self.decoder.max_commit + 1, vocab=model.codebook_size, tests=tests)
            if self.step_name == "ar":
                steps = self.ar_steps
                fn = (lambda: [self.ar_step(ws) for _ in range(steps)]) if steps > 1 else (lambda: self.ar_step(ws))
            else:
                fn = lambda: self.step(ws)  # noqa: E731
            found = self._workspaces[batch] = (ws, Runner(fn, self.mode))
        else:
            found[0].cache.load(cache)
        return found

    def _prefill(self, prompts: Sequence[str], streams: Streams) -> tuple[Any, Any]:
        """The model's own prefill of ``prompts`` with the cache room every step needs, outside the decode contexts
        (as every batch's), at the one capacity of every batch (``static_prefill``)."""
        with _piecewise_off(self.model):  # model.compile's piecewise layers serve the eager loop only
            return self.model.static_prefill(list(prompts), extra_slots=self.decoder.max_nodes + 1,
                                             streams=streams)

    def _start(self, prompts: Sequence[str], seeds: Sequence[int]) -> tuple[Workspace, Runner, "_Clock", Any,
                                                                               torch.Tensor]:
        """A new batch up to the drafter: the clock started, the prefill, the workspace of its size refilled, the
        first tokens drawn, the drafter's own prefill (``Drafter.static_prefill``); returns ``(workspace, runner,
        clock, prefill output, first tokens)``."""
        model = self.model
        b = len(prompts)
        device = model.device
        clock = _Clock(device.type == "cuda")
        clock.mark("start")
        if b not in self._streams:
            self._streams[b] = Streams.persistent_for(b, device)
        self._streams[b].reseed(seeds)
        cache, out = self._prefill(prompts, self._streams[b])
        ws, runner = self._workspace(cache, b)
        del cache
        first = sample(model.probs(out)[:, -1], ws.streams.uniform(torch.zeros_like(ws.t), SAMPLE, 1)[:, 0])
        ws.reset(first, finite_images(out.logits))
        if not self.decoder.plain_ar:  # a drafter's own prefill, outside the decode contexts as the target's
            self.drafter.static_prefill(prompts, self.depth, self.tree)
        return ws, runner, clock, out, first

    @contextlib.contextmanager
    def _decoding(self):
        """The contexts every step runs in: the model's decode context and, for speculative steps and a dynamic
        spatial order (PJD, as the eager loop) on a batch-invariant model, padding-invariant attention."""
        invariant = self.model.batch_invariant and (not self.decoder.plain_ar or self.decoder.dynamic_order)
        with self.model.decode_context(), padding_invariant_attention(invariant):
            yield

    @contextlib.contextmanager
    def batch(self, prompts: Sequence[str], seeds: Sequence[int]):
        """A batch made ready to step: the prefill, the workspace of its size refilled, the first token drawn, the
        drafter begun; yields ``(workspace, runner, clock)`` inside the decode contexts. ``generate_batch`` steps it
        to the end; a benchmark may call the runner a fixed number of times instead (every step has fixed shapes,
        so an image that has finished costs what a decoding one does)."""
        ws, runner, clock, out, first = self._start(prompts, seeds)
        with self._decoding():
            if not self.decoder.plain_ar:
                self.drafter.static_begin(out, first, ws.streams, self.depth, room=self.drafter_room)
            clock.mark("prefill")
            yield ws, runner, clock

    def generate_batch(self, prompts: Sequence[str], seeds: Sequence[int], labels: list) -> list[Generation]:
        decoder = self.decoder
        b = len(prompts)
        n_tokens = self.model.num_image_tokens
        with self.batch(prompts, seeds) as (ws, runner, clock):
            self.decode(ws, runner, clock)
        clock.mark("end")
        host = torch.cat([ws.t, ws.iterations, ws.drafter_forwards, ws.tv_steps, ws.bad_target, ws.bad_drafter,
                          ws.hist.flatten()]).tolist()  # the batch's one read of its statistics
        tv = ws.tv_sum.tolist()
        latency, prefill_s, diagnostics_s = clock.seconds()
        t_end, iterations, forwards, tests, bad_target, bad_drafter = (host[i * b:(i + 1) * b] for i in range(6))
        hist = host[6 * b:]
        rows = list(range(b))
        if any(x < n_tokens for x in t_end):
            raise RuntimeError(f"the static loop stopped before every image was complete (committed {t_end} of "
                               f"{n_tokens} tokens)")
        for source, bad in (("target", bad_target), ("drafter", bad_drafter)):
            decoder._check([x < 0 for x in bad], source, labels, list(prompts), list(seeds), bad)
        commits = decoder.max_commit + 1  # StatsRecorder.hist: one more than the most committed
        tokens = ws.tokens[:, :n_tokens].clone()
        return [Generation(tokens=tokens[i], stats=DecodeStats(
            num_tokens=n_tokens, iterations=iterations[i], accepted_hist=tuple(hist[i * commits:(i + 1) * commits]),
            target_forwards=iterations[i] + 1, drafter_forwards=forwards[i], latency_s=latency, prefill_s=prefill_s,
            draft_s=0.0, verify_s=0.0, accept_s=0.0, observe_s=0.0, diagnostics_s=diagnostics_s, tv_sum=tv[i],
            tv_steps=tests[i], batch_size=b, tv_measured=decoder.tv_measured)) for i in rows]


    @torch.inference_mode()
    def generate_stream(self, prompts: Sequence[str], seeds: Sequence[int], labels: list,
                        width: int) -> list[Generation]:
        """Decode a queue of prompts with ``width`` rows, a row taking the queue's next prompt as soon as its image
        has finished (refilling, ``decoder.refill``); one ``Generation`` per prompt, in prompt order.

        The first ``width`` prompts start as ``batch`` starts a batch, with the workspace and runner of that size
        (the step lock-step compiles or captures). After every iteration one host read says which rows have
        finished (it replaces lock-step's read of ``done``). A finished image's tokens and statistics are copied
        aside on the device (all read once at the end), and the rows finished at that iteration take the next
        prompts, between two steps and outside them: one prefill of those prompts (the model's ``prefill``), their
        KV rows copied into the workspace's cache (``DeviceKVCache.load_rows``), their tokens and counts reset
        (``Workspace.reset_rows``), their streams reseeded (``Streams.reseed_rows``) and the drafter's state of
        those rows restarted (``Drafter.static_refill``). Every shape stays fixed, so the step is reused unchanged.
        Once the queue is empty, finished rows stay in the step, as in lock-step, until every row has finished.
        Each draw is a pure function of an image's seed and position and a forward's bits do not depend on its
        batch neighbours (module doc), so an image's tokens and statistics equal its lock-step ones.

        Statistics are per image, as lock-step's: its own iterations, accepted histogram, forwards, TV and bad
        positions; ``latency_s`` is the wall time from the start of its own prefill (the stream's start for the
        first ``width`` images) to the end of the iteration in which it finished, less the TV diagnostics run in
        between; ``prefill_s`` its prefill with the drafter's restart; ``batch_size`` the width. ``stream_s`` then
        holds the stream's wall time (its start to its last image's end, less every diagnostic): the images per
        second's denominator.

        Plain AR needs no refilling (every image takes exactly ``N − 1`` steps, so all finish together): it runs
        lock-step batches of ``width`` (``generate_batch``), as does a queue of at most ``width`` prompts.

        Example: ``loop.generate_stream(["cat"] * 7, list(range(7)), list(range(7)), width=3)``: 7 images, at most
        3 at a time.
        """
        k = len(prompts)
        if len(seeds) != k or len(labels) != k:
            raise ValueError(f"{k} prompts but {len(seeds)} seeds and {len(labels)} labels")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"generate_stream: width must be an integer >= 1, got {width!r}")
        if self.decoder.plain_ar or k <= width:
            gens, self.stream_s = lock_step_batches(self.generate_batch, prompts, seeds, labels, width)
            return gens
        if not self.drafter.static_refills:
            raise ValueError(f"decoder {self.decoder.name!r}: its drafter ({type(self.drafter).__name__}) cannot "
                             "restart chosen rows of a static batch; set decoder.refill=false")
        return self._stream(list(prompts), list(seeds), list(labels), width)

    def _stream(self, prompts: list[str], seeds: list[int], labels: list, width: int) -> list[Generation]:
        """``generate_stream`` of a speculative decoder and a queue longer than ``width``."""
        decoder, model = self.decoder, self.model
        k = len(prompts)
        n_tokens = model.num_image_tokens
        device = model.device
        ws, runner, clock, out, first = self._start(prompts[:width], seeds[:width])
        image_of: list[int | None] = list(range(width))  # the image each row decodes (None: finished, not refilled)
        starts: dict[int, tuple[Any, Any, int]] = {}  # image -> (its prefill's start and end, spans apart before)
        ends: dict[int, tuple[Any, int]] = {}  # image -> (the end of its last iteration, spans apart until then)
        taken: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []  # images, stats, TV, tokens
        queued = width
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self._decoding())
            self.drafter.static_begin(out, first, ws.streams, self.depth, room=self.drafter_room)
            ready = clock.now()
            starts.update((i, (clock.marks["start"], ready, 0)) for i in range(width))
            del out, first
            for _ in range(k * n_tokens):  # a bound: every iteration commits a token of every decoding image
                runner()
                if self.diagnose_tv:
                    with clock.apart():
                        self.diagnose(ws)
                finished = (ws.t >= n_tokens).tolist()  # the iteration's one host read
                rows = [r for r, image in enumerate(image_of) if image is not None and finished[r]]
                if not rows:
                    continue
                end, apart = clock.now(), len(clock.spans)
                index = torch.tensor(rows, device=device)
                counts = torch.cat([torch.stack([ws.t, ws.iterations, ws.drafter_forwards, ws.tv_steps,
                                                 ws.bad_target, ws.bad_drafter], 1), ws.hist], 1)  # (B, 6 + C)
                taken.append(([image_of[r] for r in rows], counts.index_select(0, index),
                               ws.tv_sum.index_select(0, index), ws.tokens.index_select(0, index)[:, :n_tokens]))
                for r in rows:
                    ends[image_of[r]] = (end, apart)
                    image_of[r] = None
                refill = rows[:k - queued]
                if refill:
                    images = list(range(queued, queued + len(refill)))
                    queued += len(refill)
                    start = clock.now()
                    self._refill(ws, refill, [prompts[i] for i in images], [seeds[i] for i in images], stack)
                    ready = clock.now()
                    for r, i in zip(refill, images):
                        image_of[r] = i
                        starts[i] = (start, ready, len(clock.spans))
                if all(image is None for image in image_of):
                    break
        finally:
            stack.close()
        if len(ends) != k:
            raise RuntimeError(f"the static loop stopped with {k - len(ends)} of {k} images unfinished")
        clock.sync()
        order = [i for images, *_ in taken for i in images]
        host = torch.cat([c for _, c, _, _ in taken]).tolist()  # the stream's one read of its statistics
        tv = torch.cat([x for _, _, x, _ in taken]).tolist()
        tokens = [row for *_, x in taken for row in x.unbind(0)]
        by_image = {i: (h, v, x) for i, h, v, x in zip(order, host, tv, tokens)}
        bad = {source: [by_image[i][0][column] for i in range(k)] for source, column in (("target", 4),
                                                                                          ("drafter", 5))}
        for source, positions in bad.items():
            decoder._check([x < 0 for x in positions], source, labels, prompts, seeds, positions)
        last, spans = ends[taken[-1][0][0]]  # the stream ends with its last harvest
        self.stream_s = clock.between(clock.marks["start"], last) - clock.apart_seconds(0, spans)
        gens = []
        for i in range(k):
            (start, ready, before), (end, after) = starts[i], ends[i]
            (_, iterations, forwards, tests, *_), commits = by_image[i][0][:6], by_image[i][0][6:]
            diagnostics = clock.apart_seconds(before, after)
            gens.append(Generation(tokens=by_image[i][2], stats=DecodeStats(
                num_tokens=n_tokens, iterations=iterations, accepted_hist=tuple(commits),
                target_forwards=iterations + 1, drafter_forwards=forwards,
                latency_s=clock.between(start, end) - diagnostics, prefill_s=clock.between(start, ready),
                draft_s=0.0, verify_s=0.0, accept_s=0.0, observe_s=0.0, diagnostics_s=diagnostics,
                tv_sum=by_image[i][1], tv_steps=tests, batch_size=width, tv_measured=decoder.tv_measured)))
        return gens

    def _refill(self, ws: Workspace, rows: list[int], prompts: list[str], seeds: list[int],
                stack: contextlib.ExitStack) -> None:
        """Rows ``rows`` of the workspace take the new images ``prompts``/``seeds`` (``generate_stream``): the
        prefill outside the decode contexts (``stack`` is left and entered again), then the row-wise resets."""
        device = self.model.device
        index = torch.tensor(rows, device=device)
        stack.close()  # the prefill runs outside the decode contexts, as every batch's
        ws.streams.reseed_rows(index, seeds)
        cache, out = self._prefill(prompts, Streams(seeds, device))
        u = ws.streams.uniform(torch.zeros_like(ws.t), SAMPLE, 1)[:, 0].index_select(0, index)  # (R,) draw 0 at 0
        first = sample(self.model.probs(out)[:, -1], u)
        ws.cache.load_rows(index, cache)
        del cache
        ws.reset_rows(index, first, finite_images(out.logits))
        self.drafter.static_prefill(prompts, self.depth, self.tree)
        stack.enter_context(self._decoding())
        self.drafter.static_refill(index, out, first, ws.streams, self.depth, room=self.drafter_room)


def lock_step_batches(generate_batch, prompts: Sequence[str], seeds: Sequence[int], labels: Sequence[Any],
                      width: int) -> tuple[list[Generation], float]:
    """A queue decoded in consecutive lock-step batches of ``width`` by ``generate_batch(prompts, seeds, labels)``:
    the images in prompt order and the summed batch latencies (each batch's slowest image).

    Example: ``gens, wall = lock_step_batches(decoder.generate_batch, prompts, seeds, labels, 16)``."""
    gens: list[Generation] = []
    wall = 0.0
    for s0 in range(0, len(prompts), width):
        batch = generate_batch(prompts[s0:s0 + width], seeds[s0:s0 + width], labels[s0:s0 + width])
        wall += max(g.stats.latency_s for g in batch)
        gens += batch
    return gens, wall


def static_refusal(decoder: Any) -> str | None:
    """Why ``decoder`` (a ``coolsd.decoding.Decoder``) cannot run on the static path, or None."""
    model = decoder.model
    if not model.static_path:
        return (f"{type(model).__name__} has no static forward (static_forward; the LlamaGen, Janus-Pro, "
                "Lumina-mGPT and Emu3 adapters have one)")
    if decoder.order is not None:
        from coolsd.static.orders import order_refusal

        reason = order_refusal(decoder)
        if reason:
            return reason
    if decoder.verifier is not None and not getattr(decoder.verifier, "static_path", False):
        return f"its verifier ({type(decoder.verifier).__name__}) runs on the eager path only"
    if decoder.changes_rounds:
        return "its rounds skip verification (VVS), which runs on the eager path only"
    if not decoder.plain_ar:
        reason = decoder.drafter.static_reason(decoder.tree)
        if reason or not decoder.drafter.static_path:
            return f"its drafter ({type(decoder.drafter).__name__}) {reason or 'has no static form'}"
    if not decoder.plain_ar and isinstance(decoder.drafter, NullDrafter):
        return "a draft length without a drafter"
    return None


@contextlib.contextmanager
def _piecewise_off(model: torch.nn.Module):
    """Every module's ``compiled`` flag (``model.compile``'s piecewise compiled layers) off inside."""
    flagged = [m for m in model.modules() if getattr(m, "compiled", False) is True]
    for module in flagged:
        module.compiled = False
    try:
        yield
    finally:
        for module in flagged:
            module.compiled = True


class _Clock:
    """Wall time of a batch: CUDA events on a GPU (read once, after the final synchronisation), ``perf_counter``
    elsewhere; ``apart`` excludes a span (the diagnostics) from the latency."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: dict[str, Any] = {}
        self.spans: list[tuple[Any, Any]] = []

    def now(self) -> Any:
        """A time mark: a recorded CUDA event on a GPU (read after ``sync``), ``perf_counter`` elsewhere."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    @contextlib.contextmanager
    def apart(self):
        begin = self.now()
        yield
        self.spans.append((begin, self.now()))

    def between(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (on a GPU: after ``sync``)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def apart_seconds(self, first: int, last: int) -> float:
        """Seconds of the spans apart ``first .. last − 1`` (on a GPU: after ``sync``)."""
        return sum(self.between(a, b) for a, b in self.spans[first:last])

    def sync(self) -> None:
        """The final synchronisation, before any mark is read."""
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self) -> tuple[float, float, float]:
        """(latency without the spans apart, prefill, the spans apart), after the batch's final synchronisation."""
        self.sync()
        apart = self.apart_seconds(0, len(self.spans))
        total = self.between(self.marks["start"], self.marks["end"])
        return total - apart, self.between(self.marks["start"], self.marks["prefill"]), apart
