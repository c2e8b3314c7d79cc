"""Small frozen records that the decoding steps exchange.

Notation follows the papers (see ``docs/algorithms.md``): ``p`` is the target's next-token
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
    """What one model forward returns, per classifier-free-guidance stream, for a batch of images.

    ``logits`` are raw (un-guided) logits over the image codebook ``[0, V)``; stream 0 is conditional,
    stream 1 (present only with CFG) unconditional, whatever batch layout the model uses internally.
    ``hidden`` are the last-layer, post-final-norm hidden states (what an EAGLE drafter consumes).
    ``prefix_hidden`` (prefill outputs only, where the adapter provides it) holds those hidden states for
    every slot of the condition prefix, per stream, the last slot's being ``hidden``: what an EAGLE drafter
    with ``prefix: all`` (LANTERN's LlamaGen convention, ``coolsd.drafters.eagle``) is fed first.
    """

    logits: torch.Tensor  # (S, B, T, V)
    hidden: torch.Tensor  # (S, B, T, H)
    prefix_hidden: torch.Tensor | None = None  # (S, B, C, H), prefill only: every prefix slot


@dataclass(frozen=True)
class Draft:
    """Proposed tokens of a batch of images with the distributions they were drawn from: chains or trees.

    ``q[b, j]`` is the full draft distribution node ``j`` of image ``b`` was drawn from (after the sampling
    pipeline; for a sibling drawn without replacement, with the earlier siblings removed and renormalised;
    one-hot for a deterministic draft). ``parents[b, j]`` is the node's parent (−1 = the last committed token);
    ``None`` means a chain (node i's parent is node i − 1). ``finite`` flags images whose drafter logits held a
NaN or infinity (the loop raises). Every image has the same number ``M`` of node
    slots; ``valid[b, j]`` is False for a slot that holds no draft (a chain cut at the end of the image, a
    tree node its parent's distribution could not supply): such nodes are run through the target (their
    outputs are ignored) but never tested. ``forwards[b]`` counts drafter network forwards for image ``b``.
    """

    tokens: torch.Tensor  # (B, M) int64 codebook ids
    q: torch.Tensor  # (B, M, V) float32
    valid: torch.Tensor  # (B, M) bool
    forwards: list[int] | torch.Tensor  # or (B,) int64 on the device: the loop reads it in its one host sync
    parents: torch.Tensor | None = None  # (B, M) int64, None for a chain
    finite: torch.Tensor | None = None  # (B,) bool: the drafter's logits were finite (None: not checked)

    @property
    def draft_len(self) -> int:
        """Number of node slots per image (the chain length for a chain)."""
        return int(self.tokens.shape[1])

    @property
    def is_chain(self) -> bool:
        return self.parents is None


@dataclass(frozen=True)
class Verdict:
    """Outcome of the acceptance step of one iteration, per image.

    ``num_accepted[b]`` = n drafts accepted; ``path[b, :n]`` are their node indices, root to leaf (a prefix
    ``0..n-1`` for a chain); ``next_token[b]`` is the token sampled from the rule's resampling distribution
    after a rejection, or the bonus token when the path ends in a fully accepted leaf. ``tests`` holds what
    the TV diagnostic needs: (p', q', depth, made) per test step, each (B, V), (B, V), (B,), (B,) bool.
    """

    num_accepted: torch.Tensor  # (B,) int64
    next_token: torch.Tensor  # (B,) int64
    path: torch.Tensor  # (B, D) int64 node indices, valid up to num_accepted
    tests: tuple = ()
    #: ``num_accepted`` on the host, set by the loop after its one host sync (so ``Drafter.observe`` needs none)
    accepted: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DecodeStats:
    """Per-image statistics of one decode.

    ``accepted_hist[k]`` counts the iterations that committed ``k + 1`` tokens (and the rounds that skipped
    verification, ``skipped_rounds``, which are not iterations). The token that the prefill
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
    batch_size: int = 1  # images decoded together; latency_s and the phase times are the batch's
    #: False when the decoder's verification makes joint tests with no analytic one-step TV (SJD-SV's subsequence
    #: test, ``baselines.sv``): its TV is then not measured (``tv_per_step`` None), not 0
    tv_measured: bool = True
    #: rounds that committed tokens without a target forward (verification skipping, ``baselines/vvs.py``) and
    #: the tokens they committed (in ``accepted_hist``, never tested; their TV is measured afterwards, see VVS)
    skipped_rounds: int = 0
    skipped_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Committed image tokens / target verify forwards, prefill excluded (AR = 1.00)."""
        committed = sum((k + 1) * c for k, c in enumerate(self.accepted_hist))
        return committed / max(self.iterations, 1)

    @property
    def tv_per_step(self) -> float | None:
        """Mean exact one-step TV distance over the acceptance steps of this image (0 without any test, as plain
        AR); None where it is not measured (``tv_measured``)."""
        if not self.tv_measured:
            return None
        return self.tv_sum / self.tv_steps if self.tv_steps else 0.0

    def as_dict(self) -> dict:
        """The record's fields; ``tv_measured`` only where it is False (older records lack it: measured)."""
        extra = {} if self.tv_measured else {"tv_measured": False}
        if self.skipped_rounds:  # only decoders that skip verification write them
            extra.update(skipped_rounds=self.skipped_rounds, skipped_tokens=self.skipped_tokens)
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
            "tv_sum": self.tv_sum,
            "tv_steps": self.tv_steps,
            "batch_size": self.batch_size,
            **extra,
        }


def pooled_accepted_length(stats: list) -> float:
    """Accepted length over many images: committed image tokens ÷ verify forwards, both summed (prefill
    excluded), from ``DecodeStats`` or their ``as_dict()`` records."""
    def get(s, key):
        return s[key] if isinstance(s, dict) else getattr(s, key)

    committed = sum(get(s, "num_tokens") - 1 for s in stats)
    return committed / max(sum(get(s, "iterations") for s in stats), 1)


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
    tv_measured: bool = True
    skipped_rounds: int = 0
    skipped_tokens: int = 0

    def __post_init__(self) -> None:
        self.hist = [0] * (self.max_accept + 1)

    def iteration(self, committed: int, tv: float = 0.0, tv_steps: int = 0) -> None:
        self.iterations += 1
        self.target_forwards += 1
        self.hist[committed - 1] += 1
        self.tv_sum += tv
        self.tv_steps += tv_steps

    def unverified(self, committed: int) -> None:
        """A round that committed ``committed`` tokens without a target forward (no iteration, no test)."""
        self.hist[committed - 1] += 1
        self.skipped_rounds += 1
        self.skipped_tokens += committed

    def freeze(self, num_tokens: int, latency_s: float, batch_size: int = 1) -> DecodeStats:
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
            batch_size=batch_size,
            tv_measured=self.tv_measured,
            skipped_rounds=self.skipped_rounds,
            skipped_tokens=self.skipped_tokens,
        )


@dataclass(frozen=True)
class Generation:
    """One generated image's tokens (N,) in raster order and its decode statistics."""

    tokens: torch.Tensor
    stats: DecodeStats
