"""The drafter interface of the shared speculative loop.

A drafter proposes ``L`` tokens with the distributions ``q`` they were drawn from (``propose``) and then
sees what the target verified and committed (``observe``), so it can update its own state (an EAGLE
head's KV cache, a Jacobi window). It never decides acceptance.

Example: ``python run.py decoder=ar`` uses ``NullDrafter`` (no drafts: plain autoregressive decoding).
"""
from __future__ import annotations

import abc

import torch

from coolsd.trees import DynamicTree, TreeShape
from coolsd.types import Draft, TargetOutput, Verdict


class Drafter(abc.ABC):
    """Proposes draft chains or trees for one prompt at a time (``begin`` starts a new prompt)."""

    @abc.abstractmethod
    def begin(self, prompt: str, prefill: TargetOutput, first_token: torch.Tensor) -> None:
        """Start a new image: the target's prefill output and the first committed token (image index 0)."""

    @abc.abstractmethod
    def propose(self, last_token: torch.Tensor, position: int, draft_len: int,
                generator: torch.Generator | None, tree: TreeShape | DynamicTree | None = None) -> Draft:
        """Draft after ``last_token``, the committed token at image index ``position``.

        ``tree`` None: a chain of ``draft_len`` tokens. Otherwise a static shape (already cut to
        ``draft_len`` levels) or a dynamic-tree spec whose levels must not exceed ``draft_len``; use
        ``coolsd.trees.draft_static_tree`` / ``draft_dynamic_tree`` with the drafter's own ``expand``.
        """

    @abc.abstractmethod
    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        """See the verify forward (``out`` over ``[last_token, drafts]``, ``p`` (L+1, V)) and its verdict."""


class NullDrafter(Drafter):
    """Drafts nothing: the shared loop then runs plain autoregressive decoding (one token per forward)."""

    def __init__(self, target: object = None) -> None:
        self.empty: Draft | None = None

    def begin(self, prompt: str, prefill: TargetOutput, first_token: torch.Tensor) -> None:
        if self.empty is None or self.empty.tokens.device != first_token.device:
            v = prefill.logits.shape[-1]
            device = first_token.device
            self.empty = Draft(tokens=torch.empty(0, dtype=torch.long, device=device),
                               q=torch.empty(0, v, device=device))

    def propose(self, last_token, position, draft_len, generator, tree=None) -> Draft:
        if draft_len or tree is not None:
            raise ValueError("NullDrafter cannot draft tokens; set decoder.draft_len=0 or choose a drafter")
        return self.empty

    def observe(self, out, p, draft, verdict) -> None:
        return None
