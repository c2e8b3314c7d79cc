"""The one speculative decoding loop that every decoder runs (AR, SD, LANTERN, LANTERN++, SJD, COOL-SD).

A decoder is a drafter + an acceptance rule + a draft length; the loop below never branches on which.
Per iteration (the algorithm box of speculative sampling, Leviathan et al. 2023; loop shape after
Hugging Face ``generation/utils.py: _assisted_decoding`` and gpt-fast ``generate.py: speculative_decode``):

1. draft   — the drafter proposes ``L`` tokens with their draft distributions ``q``;
2. verify  — one target forward over ``[last committed token, x_1..x_L]`` gives ``p_1..p_{L+1}``;
3. accept/resample — the rule accepts a prefix of ``n`` drafts and draws one more token;
4. commit  — append ``n + 1`` tokens, keep their KV entries, drop the rest;
5. observe — the drafter sees the verified block and updates its own state.

``draft_len = 0`` with the null drafter is plain autoregressive decoding (the speedup denominator).
Batch size is 1 prompt per call (classifier-free guidance doubles the batch inside the model adapter).

Example: ``python run.py decoder=sd decoder.draft_len=4``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from coolsd.acceptance import AcceptanceRule, chain_tv, tree_tv, verify_chain, verify_tree
from coolsd.drafters.base import Drafter, NullDrafter
from coolsd.models.base import ImageARModel
from coolsd.sampling import sample
from coolsd.trees import DynamicTree, TreeShape, ancestor_mask, depths_of, resolve_tree
from coolsd.types import DecodeStats, StatsRecorder, Verdict


_AR_VERDICT = Verdict(num_accepted=0, next_token=-1)  # the statistics of one plain-AR iteration


@dataclass(frozen=True)
class Generation:
    """One generated image's tokens (N,) in raster order and its decode statistics."""

    tokens: torch.Tensor
    stats: DecodeStats


class Decoder:
    """A decoding method: ``drafter`` proposes, ``rule`` accepts, ``draft_len`` tokens per iteration."""

    def __init__(
        self,
        name: str,
        model: ImageARModel,
        rule: AcceptanceRule,
        draft_len: int = 0,
        drafter: Callable[..., Drafter] | Drafter | None = None,
        tree: str | None = None,
        dynamic_tree: dict | None = None,
        track_tv: bool = True,
        sync_phases: bool = False,
    ) -> None:
        if draft_len < 0:
            raise ValueError(f"decoder.draft_len must be >= 0, got {draft_len}")
        if draft_len > 0 and drafter is None:
            raise ValueError(f"decoder {name!r} has draft_len={draft_len} but no drafter; set decoder.drafter")
        self.name = name
        self.model = model
        self.rule = rule
        self.draft_len = draft_len
        if drafter is None:
            drafter = NullDrafter()
        self.drafter = drafter if isinstance(drafter, Drafter) else drafter(target=model)
        self.tree: TreeShape | DynamicTree | None = resolve_tree(tree, dynamic_tree)
        if self.tree is not None and isinstance(self.drafter, NullDrafter):
            raise ValueError(f"decoder {name!r} has decoder.tree={tree} but no drafter")
        if isinstance(self.tree, TreeShape):
            self.max_depth, self.max_nodes = self.tree.depth, len(self.tree.paths)
        elif isinstance(self.tree, DynamicTree):
            self.max_depth, self.max_nodes = self.tree.depth + 1, self.tree.total_tokens
        else:
            self.max_depth = self.max_nodes = draft_len
        self.track_tv = track_tv
        self.sync_phases = sync_phases and model.device.type == "cuda"

    def _plan(self, depth: int) -> TreeShape | DynamicTree | None:
        """The tree to draft when at most ``depth`` more tokens fit (None: a chain of ``depth`` tokens)."""
        if isinstance(self.tree, TreeShape):
            return self.tree.truncated(depth)
        return self.tree

    def _clock(self) -> float:
        if self.sync_phases:
            torch.cuda.synchronize()
        return time.perf_counter()

    @torch.inference_mode()
    def generate(self, prompt: str, seed: int) -> Generation:
        """Generate one image for ``prompt``; all randomness comes from a generator seeded with ``seed``."""
        model, rule = self.model, self.rule
        n_tokens = model.num_image_tokens
        device = model.device
        gen = torch.Generator(device=device).manual_seed(seed)
        rec = StatsRecorder(max_accept=self.max_depth + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()

        cache, out = model.prefill(prompt, extra_slots=self.max_nodes + 1, generator=gen)
        tokens = torch.empty(n_tokens, dtype=torch.long, device=device)
        tokens[0] = sample(model.probs(out)[-1], gen)
        rec.target_forwards += 1
        self.drafter.begin(prompt, out, tokens[0])
        t = 1  # committed image tokens
        now = self._clock()
        rec.prefill_s = now - start

        plain_ar = self.max_depth == 0 and isinstance(self.drafter, NullDrafter)
        while t < n_tokens:
            if plain_ar:  # the same steps as below with an empty draft, minus the per-token host sync
                now, t = self._ar_step(cache, tokens, t, gen, rec, now)
                continue
            depth = min(self.max_depth, n_tokens - t - 1)  # drafts that still fit in the image
            # 1. draft
            draft = self.drafter.propose(tokens[t - 1], t - 1, depth, gen, tree=self._plan(depth) if depth else None)
            t1 = self._clock()
            # 2. verify: the last committed token and the drafts; a tree uses per-node positions and its
            #    ancestor mask (node at depth d sits at image position t - 1 + d)
            inputs = torch.cat([tokens[t - 1 : t], draft.tokens])
            if draft.is_chain:
                positions, tree_mask = torch.arange(t - 1, t + draft.draft_len, device=device), None
            else:
                parents = draft.parents.tolist()
                positions = torch.tensor([t - 1] + [t - 1 + d for d in depths_of(parents)], device=device)
                tree_mask = ancestor_mask(parents)
            out = model.forward_block(cache, inputs, positions, tree_mask)
            p = model.probs(out)  # (M+1, V)
            t2 = self._clock()
            # 3. accept / resample
            verdict = verify_chain(rule, p, draft, gen) if draft.is_chain else verify_tree(rule, p, draft, gen)
            n = verdict.num_accepted
            t3 = self._clock()
            # 4. commit: the accepted path and the next token; keep (and compact) the path's KV entries
            if draft.is_chain:
                tokens[t : t + n] = draft.tokens[:n]
                cache.keep(n + 1)
            else:
                path = torch.tensor((0,) + verdict.path, device=device)
                tokens[t : t + n] = inputs[path[1:]]
                cache.keep(path)
            tokens[t + n] = verdict.next_token
            t += n + 1
            # 5. observe
            self.drafter.observe(out, p, draft, verdict)
            t4 = self._clock()
            # diagnostics (not part of the method's latency): the exact one-step TV of the tests made
            tv = 0.0
            if self.track_tv:
                tv = chain_tv(rule, p, draft, verdict) if draft.is_chain else tree_tv(rule, verdict)
            t5 = self._clock()
            rec.diagnostics_s += t5 - t4
            rec.iteration(n + 1, verdict, tv)
            rec.drafter_forwards += draft.forwards
            rec.draft_s += t1 - now
            rec.verify_s += t2 - t1
            rec.accept_s += t3 - t2
            rec.observe_s += t4 - t3
            now = t5

        if device.type == "cuda":
            torch.cuda.synchronize()
        latency = time.perf_counter() - start - rec.diagnostics_s
        return Generation(tokens=tokens, stats=rec.freeze(n_tokens, latency))

    def _ar_step(self, cache, tokens: torch.Tensor, t: int, gen: torch.Generator, rec: StatsRecorder,
                 now: float) -> tuple[float, int]:
        """One plain-AR iteration: forward the last token, draw the next one from ``p`` into ``tokens[t]``.

        Token for token and draw for draw what the general loop does with an empty draft (``verify_chain``
        with L = 0 samples from ``p[0]`` and draws no uniform), but the token stays on the device: the general
        loop turns it into a Python int (a host sync per token on a GPU, which keeps the host from queueing
        the next forward's kernels while the current one runs). LlamaGen's own ``generate`` keeps it on the
        device too, so this is the AR baseline of the published speedups.
        """
        model = self.model
        out = model.forward_block(cache, tokens[t - 1 : t], torch.arange(t - 1, t, device=tokens.device))
        p = model.probs(out)  # (1, V)
        t2 = self._clock()
        tokens[t] = sample(p[0], gen)
        cache.keep(1)
        t3 = self._clock()
        rec.iteration(1, _AR_VERDICT, 0.0)
        rec.verify_s += t2 - now
        rec.accept_s += t3 - t2
        return t3, t + 1

