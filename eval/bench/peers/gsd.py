"""Peer glue: grouped speculative decoding (So, Shin, Kook & Park, arXiv 2508.07747, ICCV 2025) as
published in ``junhyukso/GSD``, on Lumina-mGPT, and the SJD baseline of the same repository.

GSD's repository is a fork of the SJD code; ``eval/bench/peers/sjd.py`` says how that code is driven on our tiny
Lumina, and this glue runs it the same way from the GSD checkout: ``test_GSD.py`` patches the pipeline with
``scheduler/jacobi_iteration_lumina_mgpt.py`` (the grouped test in ``SpeculativeSampler.__call__``: ranks
``[k - 7, k + 7)`` of the processed logits around the draft's rank ``k``, kept where
``|p(g) - p(x)| < 0.15`` and the squared distance of the input embeddings is ``< 0.5``, accepted with
``min(1, p(G) / q(G))``, the plain ratio where the slice is empty), ``test_SJD.py`` with
``scheduler/jacobi_iteration_lumina_mgpt_sjd.py`` (plain SJD). Both use their own vendored Chameleon
(``lumina_mgpt/model/chameleon/modeling_chameleon.py``, whose constructor makes five token tensors on
``device='cuda'``: the ``factory_cuda`` patch keeps them on the CPU).

Pairs: ours ``gsd`` with ``window=reference_code`` (the code's ±7 slice and its empty-slice fallback), the
input embeddings and the code's thresholds (``delta_p=0.15``, ``max_distance=0.5``) against their GSD; ours
``sjd`` against their ``test_SJD.py`` path. The tiny model is the SJD glue's (Chameleon's 8,192 codes, 4
key/value heads, image top-k 2000, weights drawn at ``init_std=0.06``); the small weights matter here too:
their distance threshold 0.5 is fixed in the code, and at the tiny model's default 0.2 no two input
embeddings are that close (every group would be the draft alone: GSD = SJD).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.sjd import EOR_SLOTS, MODEL_OVERRIDES

_SCHEDULERS = {"gsd": "scheduler.jacobi_iteration_lumina_mgpt",
               "sjd": "scheduler.jacobi_iteration_lumina_mgpt_sjd"}

SPEC = PeerSpec(
    name="gsd",
    repo="junhyukso/GSD",
    commit="4216c7c2bd5d04be12410adb07143af4cd7f7b88",
    model="lumina_tiny",
    model_overrides=MODEL_OVERRIDES,
    pairs=(
        Pair(
            ours="gsd",
            theirs="gsd",
            overrides=("decoder.window=reference_code", "decoder.embedding=input", "decoder.delta_p=0.15",
                       "decoder.max_distance=0.5", "decoder.drafter.init=random", "decoder.draft_len=15"),
            difference=(EOR_SLOTS + "; theirs ranks the whole vocabulary's processed logits with an "
                        "unstable sort (masked ids tie at -inf in any order), ours the image codes by "
                        "probability with a stable sort: the groups differ only for a zero-probability draft "
                        "next to the top-k boundary"),
        ),
        Pair(
            ours="sjd",
            theirs="sjd",
            overrides=("decoder.drafter.init=random", "decoder.draft_len=15"),
            difference=EOR_SLOTS,
        ),
    ),
    patches=("factory_cuda", "cuda_sync", "cuda_event"),
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),
    cpu="",
    notes=(
        "Their GSD (test_GSD.py: scheduler/jacobi_iteration_lumina_mgpt.py) and SJD (test_SJD.py: "
        "scheduler/jacobi_iteration_lumina_mgpt_sjd.py) on their vendored Chameleon, driven as "
        "eval/bench/peers/sjd.py drives the SJD repository: our prompt ids and unconditional stream, transformers "
        "4.47.1 generate, their multi-token logits processors, stopped at the last grid token.",
        "Tiny Lumina with Chameleon's 8,192 codes, 4 key/value heads, image top-k 2000 (their demos' "
        "image_top_k) and weights drawn at init_std=0.06 (their fixed embedding-distance threshold 0.5 "
        "groups nothing at the default 0.2); their side maps our size tokens to ids 8804 + units.",
        "Their GSD code fixes the window at 16 (prefix_matching_next_tokens sets max_num_new_tokens = 16) "
        "and the group at ranks k-7..k+6 with thresholds 0.15 / 0.5; ours runs "
        "decoder.window=reference_code with the same thresholds and W = 16.",
        "Their window covers the whole grid (jacobi_loop_interval_l=0 after our forced header, "
        "jacobi_loop_interval_r = grid tokens); their demos decode the last ~10 tokens of a 768 px image "
        "plainly.",
        "Timed over their whole generate call (its setup included) to the commit of the last image code; their "
        "_sample's CUDA-event timing (cuda_event) and torch.cuda.synchronize() (cuda_sync) are patched, and their "
        "Chameleon constructor's device='cuda' tensors (factory_cuda, at build). Both their _sample functions "
        "(GSD's and this repository's SJD) compute a 10,000 x 10,000 distance table of embedding rows in every "
        "call, before the prefill (jacobi_iteration_lumina_mgpt.py:1199, jacobi_iteration_lumina_mgpt_sjd.py:1178):"
        " timed, as published; it took 0.68 s of their 0.81 s per image on this CPU (a line profile), a fixed "
        "cost that does not shrink with the tiny model.",
        "Their SJD script (test_SJD.py) fails as published: jacobi_iteration_lumina_mgpt_sjd.py _sample "
        "(lines 1143-1146) binds SpeculativeSampler only where the model has SpecSamplerClass, so the name "
        "is local there and raises UnboundLocalError; the glue sets that hook to the same module's "
        "SpeculativeSampler (no code of theirs changed).",
        "tokens = image codes (16), as our DecodeStats.num_tokens; end-of-row tokens count on neither side.",
        "Ours runs with model.batch_invariant=false (the default CPU kernels, as theirs); both in float32.",
    ),
)


def export(ours: Any, pair: Pair) -> dict:
    from eval.bench.peers import sjd

    return sjd.export(ours, pair)


def inputs(ours: Any, prompt: str) -> dict:
    from eval.bench.peers import sjd

    return sjd.inputs(ours, prompt)


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    from eval.bench.peers import sjd

    if pair.theirs not in _SCHEDULERS:
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}; it has {sorted(_SCHEDULERS)}")
    return sjd.build_lumina(checkout, payload, _SCHEDULERS[pair.theirs])
