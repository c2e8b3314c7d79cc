"""The drafter interface of the shared speculative loop.

A drafter proposes up to ``L`` tokens per image of a batch with the distributions ``q`` they were drawn from
(``propose``) and then sees what the target verified and committed (``observe``), so it can update its own
state (an EAGLE head's KV cache, a Jacobi window). It never decides acceptance. Random draws come from the
per-image streams handed to ``begin`` (``coolsd.rng``), keyed by each image's iteration position, so a
drafter's proposals for an image do not depend on the other images of the batch.

Example: ``python run.py decoder=ar`` uses ``NullDrafter`` (no drafts: plain autoregressive decoding).
"""
from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from coolsd.rng import Streams
from coolsd.trees import DynamicTree, TreeShape, draft_dynamic_tree, draft_static_tree
from coolsd.types import Draft, TargetOutput, Verdict


def empty_draft(batch: int, vocab: int, device: torch.device) -> Draft:
    """A draft with no nodes for ``batch`` images."""
    return Draft(tokens=torch.zeros(batch, 0, dtype=torch.long, device=device),
                 q=torch.zeros(batch, 0, vocab, device=device),
                 valid=torch.zeros(batch, 0, dtype=torch.bool, device=device), forwards=[0] * batch)


_COLUMNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def chain_valid(limit: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, depth) bool: chain slot i of image b is a draft (``i < limit[b]``); the column indices are cached."""
    key = (depth, limit.device)
    columns = _COLUMNS.get(key)
    if columns is None:
        columns = _COLUMNS[key] = torch.arange(depth, device=limit.device)[None, :]
    return columns < limit.unsqueeze(1)


class Drafter(abc.ABC):
    """Proposes draft chains or trees for a batch of images (``begin`` starts a new batch)."""

    #: whether ``propose`` can draft the static or dynamic trees of ``decoder.tree`` (checked when a decoder is
    #: built, before any image)
    drafts_trees: bool = True

    def block_shape(self, draft_len: int) -> tuple[int, int]:
        """(draft levels, draft nodes) of the largest block this drafter proposes with ``decoder.draft_len`` and
        no ``decoder.tree``: a chain of ``draft_len`` by default; a drafter that builds its own tree (SJD-PAC)
        says how deep and wide. Called once when the decoder is built."""
        return draft_len, draft_len

    def iteration_draws(self, depth: int, tree: TreeShape | DynamicTree | None) -> tuple[tuple[int, int], ...]:
        """The ``(kind, count)`` draws ``propose`` and ``observe`` take with ``streams.uniform`` at the loop's
        ``t`` in an iteration of this ``depth`` and ``tree``: the loop prefetches them with its own in one
        call (``Streams.prefetch``). Only a saving of torch calls: a draw not named here is computed when
        asked, with the same value."""
        return ()

    @abc.abstractmethod
    def begin(self, prompts: Sequence[str], prefill: TargetOutput, first_tokens: torch.Tensor,
              streams: Streams) -> None:
        """Start new images: the target's prefill output (S, B, T, ·), the first committed tokens (B,) (image
        index 0) and the images' random streams (the loop keeps them in step with the batch)."""

    @abc.abstractmethod
    def propose(self, last_tokens: torch.Tensor, t: torch.Tensor, limit: torch.Tensor, depth: int,
                tree: TreeShape | DynamicTree | None = None) -> Draft:
        """Draft after ``last_tokens`` (B,), the committed tokens at image index ``t − 1``.

        ``t`` (B,) is each image's first uncommitted index (it keys the image's draws); ``limit`` (B,) how
        many draft levels fit in each image and ``depth = max(limit)``. ``tree`` None: chains of ``depth``
        node slots, valid up to each image's limit. Otherwise a static shape (already cut to ``depth``
        levels) or a dynamic-tree spec; use ``coolsd.trees.draft_static_tree`` / ``draft_dynamic_tree`` with
        the drafter's own ``expand``.
        """

    @abc.abstractmethod
    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        """See the verify forward (``out`` over ``[last_token, drafts]``, ``p`` (B, M+1, V)) and its verdict."""

    @abc.abstractmethod
    def select(self, images: Sequence[int]) -> None:
        """Keep the state of the listed images (positions in the current batch), in order."""

    # -- the static decode path (coolsd.static): fixed shapes, state in buffers updated in place -------------
    #: whether the drafter implements the three ``static_*`` calls (the static path refuses it otherwise)
    static_path: bool = False
    #: whether the drafts are the target's own outputs (a Jacobi window) rather than a drafter network's; the
    #: static path names its step after it (``jacobi_window`` or ``chain``)
    self_drafting: bool = False

    def static_reason(self, tree: TreeShape | DynamicTree | None) -> str | None:
        """Why this drafter cannot run the static path's step with the decoder's ``tree`` (None: chains), said after
        "its drafter (<class>)", or None: the static path refuses a drafter without ``static_path`` as having no
        static form, and one whose reason is not None with that reason (a ``ModelDrafter`` whose draft model has no
        static forward). Checked when a decoder with ``decoder.path=static`` is built."""
        return None

    def static_prefill(self, prompts: Sequence[str], depth: int, tree: TreeShape | DynamicTree | None) -> None:
        """Called by the static path before each ``static_begin`` and ``static_refill``, outside the decode contexts
        (where the target's prefill runs): the prompts of the images that call starts, in order, the decoder's
        draft levels ``depth`` and its ``tree`` (None: chains). A drafter with a model of its own prefills it here
        (``ModelDrafter``); the others need nothing.

        Example: ``drafter.static_prefill(["cat", "dog"], 4, None)``, then ``drafter.static_begin(...)``."""

    def static_begin(self, prefill: TargetOutput, first_tokens: torch.Tensor, streams: Streams, depth: int,
                     room: int | None = None) -> None:
        """Start a batch on the static path: as ``begin``, with state in persistent buffers of the batch's size
        (kept between batches of that size, refilled in place) and chains of exactly ``depth`` slots. ``room``:
        the most speculative pairs one iteration feeds a drafter cache (its capacity beyond the committed
        pairs: a static step attends to the whole capacity, so it is sized to what the step needs); None: the
        eager path's room."""
        raise NotImplementedError(f"{type(self).__name__} does not run on the static path")

    def static_refill(self, rows: torch.Tensor, prefill: TargetOutput, first_tokens: torch.Tensor, streams: Streams,
                      depth: int, room: int | None = None) -> None:
        """Restart the images of ``rows`` (R,) (long, on the device) of the current static batch, in place, as
        ``static_begin`` starts a batch: ``prefill`` is the target's prefill output of the R new images (S, R, T, ·),
        ``first_tokens`` (R,) their first tokens, ``streams`` the batch's streams (those rows already reseeded),
        ``depth`` and ``room`` as the batch's ``static_begin`` had them. The other rows' state is untouched and no
        buffer is replaced, so a compiled or captured step stays valid. Afterwards the refilled rows must draft
        exactly what a fresh batch's would (``StaticLoop.generate_stream``, ``decoder.refill``).

        Example: ``drafter.static_refill(torch.tensor([1]), out, first, ws.streams, 4)`` after row 1 finished."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart chosen rows of a static batch (no "
                                  "static_refill): set decoder.refill=false")

    @property
    def static_refills(self) -> bool:
        """Whether this drafter restarts chosen rows of a static batch (``static_refill``); checked when a decoder
        with ``decoder.refill=true`` is built."""
        return type(self).static_refill is not Drafter.static_refill

    def static_tree_draft(self, tree: TreeShape | DynamicTree, t: torch.Tensor, limit: torch.Tensor,
                          cache: dict | None) -> Draft:
        """Every level of a static or EAGLE-2 tree on the static path, each level's rows from the drafter's
        ``_static_expand`` (the drafters with a network: EAGLE heads, draft models)."""
        if isinstance(tree, TreeShape):
            return draft_static_tree(tree, t - 1, limit, self._static_expand, self.streams, t, static=True,
                                     cache=cache)
        return draft_dynamic_tree(tree, t - 1, limit, self._static_expand, static=True, cache=cache)

    def static_propose(self, last_tokens: torch.Tensor, t: torch.Tensor, limit: torch.Tensor, depth: int,
                       tree: TreeShape | DynamicTree | None = None, cache: dict | None = None) -> Draft:
        """``propose`` of exactly ``depth`` levels per image (a chain, or every level of ``tree``) with no host
        read (``limit`` marks the valid ones). ``cache``: the static loop's own store of the tree code's shape
        constants (``coolsd.trees._shaped``), which its compiled step reads."""
        raise NotImplementedError(f"{type(self).__name__} does not run on the static path")

    def static_observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict,
                       active: torch.Tensor) -> None:
        """``observe`` with no host read; ``active`` (B,) marks the images still decoding (the others keep
        nothing: their state may hold anything that stays in its buffers' bounds)."""
        raise NotImplementedError(f"{type(self).__name__} does not run on the static path")


class NullDrafter(Drafter):
    """Drafts nothing: the shared loop then runs plain autoregressive decoding (one token per forward)."""

    drafts_trees = False

    def __init__(self, target: object = None) -> None:
        self.vocab = 0
        self.batch = 0

    def begin(self, prompts, prefill, first_tokens, streams) -> None:
        self.vocab = prefill.logits.shape[-1]

    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        if depth or tree is not None:
            raise ValueError("NullDrafter cannot draft tokens; set decoder.draft_len=0 or choose a drafter")
        return empty_draft(last_tokens.shape[0], self.vocab, last_tokens.device)

    def observe(self, out, p, draft, verdict) -> None:
        return None

    def select(self, images) -> None:
        return None
