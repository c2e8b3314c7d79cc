"""Small frozen records that the decoding steps exchange.

Notation follows the papers (see ``shared/docs/algorithms.md``): ``p`` is the target's next-token
distribution, ``q`` the draft distribution, ``x`` a drafted token, ``draft_len`` (L) the number of draft
tokens per iteration. One *iteration* = draft -> one target verify forward -> accept/resample -> commit;
it commits ``n + 1`` tokens where ``n`` is the number of accepted drafts.

Example: ``python run.py decoder=sd`` prints the statistics that ``DecodeStats`` carries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TargetOutput:
    """What one model forward returns, per classifier-free-guidance stream.

    ``logits`` are raw (un-guided) logits over the image codebook ``[0, V)``; stream 0 is conditional,
    stream 1 (present only with CFG) unconditional, whatever batch layout the model uses internally.
    ``hidden`` are the last-layer, post-final-norm hidden states (what an EAGLE drafter consumes).
    ``prefix_hidden`` (prefill outputs only, where the adapter provides it) holds those hidden states for
    every slot of the condition prefix, per stream, the last slot's being ``hidden``: what an EAGLE drafter
    with ``prefix: all`` (LANTERN's LlamaGen convention, ``coolsd.drafters.eagle``) is fed first.
    """

    logits: torch.Tensor  # (S, T, V)
    hidden: torch.Tensor  # (S, T, H)
    prefix_hidden: torch.Tensor | None = None  # (S, C, H), prefill only


@dataclass(frozen=True)
class Draft:
    """Proposed tokens with the distributions they were drawn from: a chain, or a tree.

    ``q[i]`` is the full draft distribution node ``i`` was drawn from (after the sampling pipeline; for a
    sibling drawn without replacement, with the earlier siblings removed and renormalised; one-hot for a
    deterministic draft). ``parents`` (M,) gives each node's parent node (−1 = the last committed token);
    ``None`` means a chain (node i's parent is node i − 1). ``forwards`` counts drafter network forwards.
    """

    tokens: torch.Tensor  # (M,) int64 codebook ids
    q: torch.Tensor  # (M, V) float32
    forwards: int = 0
    parents: torch.Tensor | None = None  # (M,) int64, None for a chain

    @property
    def draft_len(self) -> int:
        """Number of drafted nodes (the chain length for a chain)."""
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        if self.parents is None:
            return True
        expected = torch.arange(-1, self.draft_len - 1, device=self.parents.device)
        return bool(torch.equal(self.parents, expected))


@dataclass(frozen=True)
class Verdict:
    """Outcome of the acceptance step of one iteration.

    ``num_accepted`` = n drafts accepted (a prefix of the chain); ``next_token`` is the token sampled from
    the rule's resampling distribution after a rejection, or the bonus token from ``p_{L+1}`` when every
    draft was accepted. ``tv_steps`` counts the acceptance tests made (positions 1 .. min(n + 1, L)); the
    loop computes their exact one-step TV as a diagnostic, outside the timed latency.
    """

    num_accepted: int
    next_token: int
    tv_steps: int = 0
    path: tuple[int, ...] = ()  # tree drafts: accepted node indices, root to leaf
    tests: tuple = ()  # tree drafts: (p', q', depth) of every acceptance test, for the TV diagnostic


@dataclass(frozen=True)
class DecodeStats:
    """Per-image statistics of one decode.

    ``accepted_hist[k]`` counts the iterations that committed ``k + 1`` tokens. The token that the prefill
    forward produces is not counted, so plain AR has ``mean_accepted_length == 1`` exactly. Times are wall
    seconds; ``latency_s`` runs from the start of prefill to the commit of the last image token, minus the
    time spent on diagnostics (``diagnostics_s``: the exact TV computation, which a deployed decoder would
    not run).
    """

    num_tokens: int
    iterations: int
    accepted_hist: tuple[int, ...]
    target_forwards: int  # verify forwards + the prefill forward
    drafter_forwards: int
    latency_s: float
    prefill_s: float
    draft_s: float
    verify_s: float
    accept_s: float
    observe_s: float
    diagnostics_s: float
    tv_sum: float
    tv_steps: int

    @property
    def mean_accepted_length(self) -> float:
        """Committed image tokens / target verify forwards, prefill excluded (AR = 1.00)."""
        committed = sum((k + 1) * c for k, c in enumerate(self.accepted_hist))
        return committed / max(self.iterations, 1)

    @property
    def tv_per_step(self) -> float:
        """Mean exact one-step TV distance over the acceptance steps of this image."""
        return self.tv_sum / self.tv_steps if self.tv_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "iterations": self.iterations,
            "accepted_hist": list(self.accepted_hist),
            "mean_accepted_length": self.mean_accepted_length,
            "target_forwards": self.target_forwards,
            "drafter_forwards": self.drafter_forwards,
            "latency_s": self.latency_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "accept_s": self.accept_s,
            "observe_s": self.observe_s,
            "diagnostics_s": self.diagnostics_s,
            "tv_per_step": self.tv_per_step,
        }


@dataclass
class StatsRecorder:
    """Mutable accumulator the loop fills; ``freeze`` turns it into a ``DecodeStats``."""

    max_accept: int
    hist: list[int] = field(default_factory=list)
    iterations: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    observe_s: float = 0.0
    diagnostics_s: float = 0.0
    tv_sum: float = 0.0
    tv_steps: int = 0

    def __post_init__(self) -> None:
        self.hist = [0] * (self.max_accept + 1)

    def iteration(self, committed: int, verdict: Verdict, tv: float) -> None:
        self.iterations += 1
        self.target_forwards += 1
        self.hist[committed - 1] += 1
        self.tv_sum += tv
        self.tv_steps += verdict.tv_steps

    def freeze(self, num_tokens: int, latency_s: float) -> DecodeStats:
        return DecodeStats(
            num_tokens=num_tokens,
            iterations=self.iterations,
            accepted_hist=tuple(self.hist),
            target_forwards=self.target_forwards,
            drafter_forwards=self.drafter_forwards,
            latency_s=latency_s,
            prefill_s=self.prefill_s,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            accept_s=self.accept_s,
            observe_s=self.observe_s,
            diagnostics_s=self.diagnostics_s,
            tv_sum=self.tv_sum,
            tv_steps=self.tv_steps,
        )
