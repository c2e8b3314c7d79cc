"""SJD-SV — speculative Jacobi decoding with subsequence ("semantics") verification (Zhang, Shan, Fang, Lin, Li &
Ye, arXiv 2609.13245, ICML 2026): a verification wrapper over the Jacobi-window decoders (SJD-SV, GSD-SV and
LANTERN-SV inside the Jacobi loop). **Unofficial.**

There is no public code, and the paper's own text has not been read here: the rule is implemented from a
secondary, third-party description of the paper (a paper note; ``docs/algorithms.md``, "SJD-SV";
``docs/reference-behaviour.md``), so every result of it is labelled unofficial until the paper's text or code is
read. Notation: ``p`` the target distribution,
``q`` the draft distribution (in SJD the previous iteration's distribution at that slot). For the drafted chain
``x_1..x_m`` of a window:

1. the loop runs SJD's forward as usual; take ``p_i(x_i)`` and the base rule's **unclipped** ratio ``r_i``
   (``AcceptanceRule.ratio``: ``p/q`` for SJD's exact rule, ``p(G)/q(G)`` for GSD's group, ``p̃/q`` for LANTERN);
2. split the window into maximal runs in which ``p_i(x_i)`` does not decrease (a run ends where the next token's
   target probability drops);
3. in a run ``b..e`` take the largest ``b_g`` with ``Σ_{b_g..e} p_i(x_i) ≥ α · Σ_{b..e} p_i(x_i)``;
4. accept ``b..e`` iff ``u < min(1, Π_{b_g..e} r_i)``; ``b..b_g−1`` are not in the product (they ride along);
5. progressive fallback: if rejected, test ``b..e'`` with ``Π_{b_g..e'} r_i`` for ``e' = e−1, …, b_g`` (``b_g`` is
   kept; the product shrinks from the right) until one passes, which accepts ``b..e'``; the next token is
   resampled at the first failing position from the base rule's token-level residual (``norm([p − q]_+)`` for
   SJD) and everything after it is drafted again by the Jacobi drafter, as in SJD; runs are tested left to
   right, and when every run passes the bonus token is drawn from ``p`` after the window.

A run of one token is SJD's own test, so a window whose ``p_i(x_i)`` strictly decreases everywhere gets
``verify_chain``'s verdict. The uniforms are the loop's (one per drafted position, ``u_accept``, and one for the
resampled or bonus token, ``u_sample``): no new draws, and an image does not depend on its batch neighbours.

Choices the paper leaves open, each a named option (``decoder.sv.<option>``), default = the closest reading:

* ``alpha`` (0.8): the suffix's share of the run's target mass, in (0, 1].
* ``fallback`` (true): the progressive fallback; false = the paper's ablation "without fallback" (one test per run).
* ``fallback_uniform``: ``same`` (default) = every test of a run uses the uniform of its first test (the one that
  ends at ``e``), as the description has one uniform per subsequence; ``fresh`` = the test that ends at position i
  uses that position's uniform, so every fallback test has its own (the default before issue 60: a search over
  independent chances).
* ``zero_prob``: ``ride`` (default, the description's rule) = a token whose target probability ``p_i(x_i)`` is 0
  carries no mass, so it can fall before ``b_g`` and ride along even at α = 1; ``test`` = a run holding such a
  token is tested from its start (``b_g = b``: the token's ratio 0 rejects it). Within a run ``p_i(x_i)`` does not
  decrease, so its zero-probability tokens are always its first ones.
* ``reject_at``: where to resample when even the suffix start ``b_g`` alone fails (and, without fallback, when the
  run fails): ``run_start`` (default) = at ``b``, since ``b..b_g−1`` ride along with the suffix decision;
  ``suffix_start`` = accept ``b..b_g−1`` and resample at ``b_g``.
* ``earlier_runs``: ``keep`` (default) = runs before a failing run stay accepted; ``drop`` = when a run after the
  window's first fails its full test, nothing of the window is accepted and the next token is resampled at the
  window's first position (a failing first run falls back as usual).

Not exact: the prefix ``b..b_g−1`` is outside the product, the fallback searches several tests, and the residual
is token-level where exact block verification needs a block residual. A joint test has no analytic one-step TV,
so the Verdict carries no token tests and the run's TV shows as not measured (``analytic_tv``); the distance to
the target is measured by the chi-square harness on the lookup models (``tests/test_sv.py``; the numbers in
``docs/jacobi-and-spatial.md``). Chain drafts only (a tree draft is refused by ``coolsd.decoding.Decoder``).

The test is computed on the device over the whole window at once (runs, suffix starts and fallbacks by scans
and per-run reductions, undrafted positions masked), so the static decode path's Jacobi step runs it in place of
``verify_chain`` (``decoder.path=static``, ``coolsd.static``) and gives the eager loop's tokens.

Example: ``python run.py decoder=sjd_sv decoder.sv.alpha=0.5``; ``python run.py decoder=gsd_sv``;
``python run.py decoder=lantern_sjd decoder.sv.enabled=true`` (LANTERN-SV in the Jacobi loop).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from coolsd import validate
from coolsd.acceptance import AcceptanceRule
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.models.base import ImageARModel
from coolsd.rng import sample
from coolsd.types import Draft, Verdict

FALLBACK_UNIFORMS = ("same", "fresh")
ZERO_PROB = ("ride", "test")
REJECT_AT = ("run_start", "suffix_start")
EARLIER_RUNS = ("keep", "drop")
#: the keys of a decoder's ``sv`` block (``configs/decoder/sjd_sv.yaml``)
SV_KEYS = ("enabled", "alpha", "fallback", "fallback_uniform", "reject_at", "earlier_runs", "zero_prob")


@dataclass(frozen=True)
class Plan:
    """What the subsequence test decided for every window, per position (B, L) unless noted.

    ``run_start``/``run_end``: the run ``b..e`` holding the position; ``suffix_start``: its ``b_g``; ``passed``: the
    test that ends at the position (``b_g ≤ j ≤ e``) passes (False elsewhere); ``stop``: the run's first rejected
    position (``e + 1`` when the whole run passes); ``num_accepted`` (B,)."""

    run_start: torch.Tensor
    run_end: torch.Tensor
    suffix_start: torch.Tensor
    passed: torch.Tensor
    stop: torch.Tensor
    num_accepted: torch.Tensor


def _per_run(values: torch.Tensor, run: torch.Tensor, reduce: str, fill: int) -> torch.Tensor:
    """``reduce`` (amin / amax) of ``values`` (B, L) over each run ``run`` (B, L), gathered back per position."""
    out = torch.full_like(values, fill).scatter_reduce(1, run, values, reduce, include_self=True)
    return out.gather(1, run)


class SubsequenceVerifier:
    """SJD-SV's verification of chain drafts (module doc; unofficial: the rule of a secondary description of the
    paper), with ``verify_chain``'s signature and Verdict."""

    #: the config key a refusal names (``coolsd.decoding.Decoder``)
    option = "decoder.sv"
    #: a joint test has no analytic one-step TV: the loop records the TV as not measured
    analytic_tv = False
    #: the test runs on the static path as it is (``coolsd.static``): every decision is a fixed-shape tensor of the
    #: window's positions (undrafted ones masked, ``valid``), with no host read and no value-dependent shape
    static_path = True

    def __init__(self, alpha: float = 0.8, fallback: bool = True, fallback_uniform: str = "same",
                 reject_at: str = "run_start", earlier_runs: str = "keep", zero_prob: str = "ride") -> None:
        self.alpha = validate.number("decoder.sv.alpha", alpha, minimum=0.0, maximum=1.0, min_open=True)
        self.fallback = validate.boolean("decoder.sv.fallback", fallback)
        self.fallback_uniform = validate.choice("decoder.sv.fallback_uniform", fallback_uniform, FALLBACK_UNIFORMS)
        self.reject_at = validate.choice("decoder.sv.reject_at", reject_at, REJECT_AT)
        self.earlier_runs = validate.choice("decoder.sv.earlier_runs", earlier_runs, EARLIER_RUNS)
        self.zero_prob = validate.choice("decoder.sv.zero_prob", zero_prob, ZERO_PROB)

    def check(self, rule: AcceptanceRule) -> None:
        """Refuse a rule without an unclipped ratio (the joint test multiplies ratios before clipping)."""
        if not rule.has_ratio:
            raise ValueError(f"decoder.sv needs an acceptance rule with an unclipped ratio (AcceptanceRule.ratio); "
                             f"{type(rule).__name__} has none: set decoder.sv.enabled=false or use a rule that "
                             "defines it (the exact rule, GSD's, LANTERN's, COOL-SD's)")

    def plan(self, px: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor, u: torch.Tensor) -> Plan:
        """The decision for target probabilities ``px`` = p_i(x_i), unclipped ratios ``ratio`` (B, L), the drafted
        positions ``valid`` (B, L, a prefix) and the uniforms ``u`` (B, L)."""
        b, length = px.shape
        device = px.device
        j = torch.arange(length, device=device).expand(b, length)
        # 2. runs: a new run at the window's start, where p_i(x_i) drops, and at every undrafted position
        drop = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=device), px[:, 1:] < px[:, :-1]], 1)
        new_run = drop | ~valid  # (no write of a Python constant: a captured step holds no fresh tensor)
        run = new_run.long().cumsum(-1) - 1  # (B, L) run index of each position
        start = _per_run(j, run, "amin", length)
        end = _per_run(j, run, "amax", -1)
        # 3. suffix start b_g: the last position whose run suffix holds at least α of the run's target mass
        mass = torch.where(valid, px.double(), 0.0)
        after = torch.nn.functional.pad(mass.flip(-1).cumsum(-1).flip(-1), (0, 1))  # (B, L + 1) Σ_{i ≥ j}
        suffix = after[:, :length] - after.gather(1, end + 1)  # Σ_{i = j..e}
        total = suffix.gather(1, start)  # Σ_{i = b..e}
        holds = valid & (suffix >= self.alpha * total)  # a prefix of each run (suffix sums do not grow)
        g = _per_run(torch.where(holds, j, -1), run, "amax", -1).maximum(start)
        if self.zero_prob == "test":  # a zero-probability token (always a run's first ones) never rides along
            zero = _per_run((valid & (px <= 0)).long(), run, "amax", 0) > 0
            g = torch.where(zero, start, g)
        # 4. the joint test ending at j: u < min(1, Π_{b_g..j} r_i); one token is the base rule's own test
        tested = valid & (j >= g)
        ratio64 = ratio.double()
        zero = (tested & (ratio64 <= 0)).long()
        logs = torch.where(tested & (ratio64 > 0), ratio64.clamp_min(1e-300).log(), 0.0)
        zeros = torch.nn.functional.pad(zero.cumsum(-1), (1, 0))  # (B, L + 1) Σ_{i < j}
        sums = torch.nn.functional.pad(logs.cumsum(-1), (1, 0))
        gi = g.clamp_min(0)
        product = torch.where(zeros[:, 1:] - zeros.gather(1, gi) > 0, 0.0,
                              (sums[:, 1:] - sums.gather(1, gi)).exp()).clamp(max=1.0)
        uniform = u if self.fallback_uniform == "fresh" else u.gather(1, end.clamp_min(0))
        single = uniform < ratio.clamp(max=1.0)  # exactly verify_chain's comparison
        joint = uniform.double() < product
        passed = tested & torch.where(j == g, single, joint)
        # 5. fallback: the longest passing test of each run (only the full run's test without fallback)
        candidates = passed if self.fallback else passed & (j == end)
        best = _per_run(torch.where(candidates, j, -1), run, "amax", -1)
        failed_at = start if self.reject_at == "run_start" else g
        stop = torch.where(best == end, end + 1, torch.where(best >= 0, best + 1, failed_at))
        failing = valid & (stop <= end)
        drafted = valid.sum(-1)
        first = torch.where(failing, stop, length).amin(-1)  # runs are in order: the first failure stops the window
        n = torch.where(failing.any(-1), first, drafted)
        if self.earlier_runs == "drop":
            first_run = torch.where(failing, start, length).amin(-1)
            n = torch.where(failing.any(-1) & (first_run > 0), 0, n)
        return Plan(run_start=start, run_end=end, suffix_start=g, passed=passed, stop=stop, num_accepted=n)

    def __call__(self, rule: AcceptanceRule, p: torch.Tensor, draft: Draft, u_accept: torch.Tensor,
                 u_sample: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]) -> Verdict:
        """``verify_chain``'s contract: ``p`` (B, L + 1, V), ``draft`` a chain, ``u_accept`` (B, L), ``u_sample``
        (B,) or a function of the accepted counts; the Verdict's ``tests`` are empty (no analytic TV)."""
        self.check(rule)
        b, length = draft.tokens.shape
        device = p.device
        rows = torch.arange(b, device=device)
        path = torch.arange(length, device=device).expand(b, length)
        if length:
            x = draft.tokens
            depth = torch.arange(1, length + 1, device=device).expand(b, length)
            p_drafts = p[:, :length]
            px = p_drafts.gather(-1, x[..., None]).squeeze(-1)  # (B, L)
            v = p.shape[-1]
            ratio = rule.ratio(p_drafts.reshape(-1, v), draft.q.reshape(-1, v), x.reshape(-1),
                               depth.reshape(-1)).view(b, length)
            n = self.plan(px, ratio, draft.valid, u_accept).num_accepted
            at = n.clamp(max=length - 1)
            residual = rule.residual(p[rows, at], draft.q[rows, at], x[rows, at], n + 1)
            dist = torch.where((n < draft.valid.sum(-1))[:, None], residual, p[rows, n])
        else:
            n = torch.zeros(b, dtype=torch.long, device=device)
            dist = p[:, 0]
        if callable(u_sample):
            u_sample = u_sample(n)
        return Verdict(num_accepted=n, next_token=sample(dist, u_sample), path=path, tests=())


def sv_verifier(sv: Mapping[str, Any] | None, rule: AcceptanceRule) -> SubsequenceVerifier | None:
    """The verifier of a decoder's ``sv`` block (``enabled`` and the options above), or None when it is off.
    Every key is checked either way, so a typo fails with the key's name."""
    spec = validate.mapping("decoder.sv", sv, SV_KEYS, optional=True)
    if spec is None:
        return None
    enabled = validate.boolean("decoder.sv.enabled", spec.pop("enabled", False))
    verifier = SubsequenceVerifier(**spec)
    if not enabled:
        return None
    verifier.check(rule)
    return verifier


class SVDecoder(Decoder):
    """A chain decoder (the Jacobi window: SJD-SV) whose verification is the ``sv`` block's subsequence test
    (unofficial: the rule of a secondary description of the paper, module doc)."""

    def __init__(self, name: str, model: ImageARModel, rule: AcceptanceRule, draft_len: int,
                 drafter: Callable[..., Drafter] | Drafter, sv: Mapping[str, Any] | None = None,
                 track_tv: bool = True, sync_phases: bool = False, path: str = "eager",
                 refill: bool = False) -> None:
        super().__init__(name, model, rule, draft_len=draft_len, drafter=drafter, track_tv=track_tv,
                         sync_phases=sync_phases, verifier=sv_verifier(sv, rule), path=path, refill=refill)
