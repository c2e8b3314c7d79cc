"""A fake peer glue module for tests/test_peers.py: no repository, a side that sleeps and asks for CUDA.

Its "decoder" returns the accepted lengths it is told to (``payload["tau"]``) and sleeps ``payload["sleep"]``
seconds per image; on the way it calls ``Tensor.cuda()``, ``torch.zeros(..., device="cuda")`` and
``torch.cuda.synchronize()``, which only work on a CPU machine under the peer bench's device patches.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec

SPEC = PeerSpec(
    name="fake",
    repo="example/fake-peer",
    commit="0" * 40,
    model="lookup",
    pairs=(Pair(ours="ar", theirs="fake AR"),),
    patches=("tensor_cuda", "factory_cuda", "cuda_sync"),
)


def export(ours: Any, pair: Pair) -> dict:
    return {"tokens": int(ours.model.num_image_tokens), "sleep": 0.0, "tau": 1.0, "fail": False}


def inputs(ours: Any, prompt: str) -> dict:
    return {"prompt": prompt}


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    if payload.get("fail"):
        raise ValueError("the fake peer refuses to build")

    net = torch.nn.Linear(2, 2)   # the "target network": its forwards are the anatomy pass's target phase

    def call(cond: dict, seed: int) -> PeerImage:
        t0 = time.perf_counter()
        with torch.no_grad():
            net(torch.ones(1, 2))
        x = torch.zeros(2, device="cuda").cuda() + seed    # CUDA-only calls, redirected by the patches
        torch.cuda.synchronize()
        time.sleep(payload["sleep"])
        n = payload["tokens"]
        forwards = 1 + round((n - 1) / payload["tau"])
        return PeerImage(seconds=time.perf_counter() - t0, tokens=n, target_forwards=forwards,
                         codes=(int(x[0]),))

    call.target = net
    return call


class TreeSampler:
    """A stand-in for PathSpec's per-path verifier (``scheduler/tree_until.py`` ``SpeculativeSampler``: its
    constructor, ``__call__`` and ``reject_sampling_single_token`` signatures) for the fixture maker of
    ``eval.bench.peers.pathrelax``: it draws its uniforms as one ``torch.rand(p.shape, generator)`` first, tests node
    ``i`` of path ``b`` with ``rs[b, i, x]`` against ``min(1, p/q)`` and keeps what it drew and returned."""

    def __init__(self, generator=None, reject_sampling_relative_ids=None, reject_sampling_draft_token_logits=None,
                 sampling_last_draft_token=None) -> None:
        self.generator = generator
        self.rs = None
        self.returned: list[torch.Tensor] = []

    def reject_sampling_single_token(self, token_advanced_prob, token_draft_prob, logits_processor=None,
                                     logits_warper=None, all_collected_input_ids=None):
        scores = torch.softmax((token_advanced_prob - token_draft_prob).clamp(min=0).log(), -1)
        token = torch.multinomial(scores, 1, generator=self.generator)
        self.returned.append(scores)
        return token, scores

    def __call__(self, draft_tokens, advanced_tokens, draft_prob, advanced_prob, logits_processor=None,
                 logits_warper=None, all_collected_input_ids=None, retrieve_indices=None):
        self.rs = torch.rand(advanced_prob.shape, generator=self.generator)
        first = []
        for b in range(draft_tokens.shape[0]):
            n = draft_tokens.shape[1]
            for i in range(1, draft_tokens.shape[1]):
                x = draft_tokens[b, i]
                if not self.rs[b, i, x] < (advanced_prob[b, i - 1, x] / draft_prob[b, i, x]).clamp(max=1):
                    self.reject_sampling_single_token(token_advanced_prob=advanced_prob[b, i - 1],
                                                      token_draft_prob=draft_prob[b, i])
                    n = i
                    break
            first.append(n)
        return first, advanced_tokens, advanced_prob
