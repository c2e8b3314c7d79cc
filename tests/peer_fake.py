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
