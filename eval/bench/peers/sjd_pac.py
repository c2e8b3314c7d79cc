"""Peer glue: SJD-PAC, speculative Jacobi decoding with proactive drafting and adaptive continuation (Kang et al.,
arXiv 2603.18599, CVPR 2026), as published in ``KangJialiang/SJD-PAC``, on Lumina-mGPT.

Their side is their Lumina-mGPT path: their vendored Chameleon (``lumina_mgpt/model/chameleon/modeling_chameleon.py``
``ChameleonForConditionalGeneration``, the class their ``inference_solver.py`` loads) made into their sampler by
their ``renew_pipeline_sampler`` (``scheduler/sjd_pac_iteration_lumina_mgpt.py``: pipeline, sampler and backbone
classes, ``_init_new_params``) and driven through transformers' ``generate`` with the logits processors of their
pipeline's ``create_logits_processor`` (``scheduler/logit_processor_3dim.py``), as ``test_lumina_mgpt.py`` ->
``inference_solver.generate`` does, without the text tokenizer and the VQGAN. ``FlexARInferenceSolver`` itself is
not built: its ``__init__`` downloads the 7B checkpoint and reads Meta's tokenizer, and its module does not import
from this repository (``lumina_mgpt/inference_solver.py:16`` imports ``data.item_processor``, which the repository
does not ship); a stand-in with the model and an item processor answering ``token2id`` takes its place.

Weights, vocabulary layout, conditioning (our prompt ids with the header, our unconditional stream through their
``_init_doubled_attn_mask_cfg`` option), seeding, timing and counting are those of ``eval.bench.peers.scd`` (its
module docstring; the helpers are shared). Settings: our cfg_scale, image top-k (2000, their demo's), temperature,
window ``max_num_new_tokens = draft_len + 1`` (64, their demo's; it counts the root) and tree ``tree_width`` K = 3,
``tree_depth`` D = 3 (their demo's; D counts the root), fresh drafts uniform with q uniform (their only init).
Their loop has no plain steps: the prefill forward already carries the first window of fresh drafts.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.sjd import LUMINA_OVERRIDES

SPEC = PeerSpec(
    name="sjd_pac",
    repo="KangJialiang/SJD-PAC",
    commit="4fbc099f7f765b6b363a767da317c0fb8ad4a980",
    model="lumina_tiny",
    model_overrides=LUMINA_OVERRIDES,
    pairs=(
        Pair(
            ours="sjd_pac",
            theirs="sjd_pac",
            overrides=("decoder.draft_len=63", "decoder.drafter.tree_width=3", "decoder.drafter.tree_depth=3",
                       "decoder.drafter.init=random_uniform_q"),
            difference=("their tree draws a level's K siblings from the residual (p − q)+ but verifies them as "
                        "drawn from p_t, takes the path with the longest accepted prefix and commits a uniform "
                        "random token when every draft passes (not exact by our reading, baselines/jacobi.py); ours "
                        "draws siblings from the stored q without replacement and takes the first accepted one. "
                        "Their prefill forward also verifies the first window (ours: a plain prefill, then the "
                        "window), and their window counts end-of-row tokens as slots; ours inserts them for free"),
        ),
    ),
    patches=("cuda_sync", "cuda_event"),
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),
    cpu="",
    notes=(
        "sjd_pac: window 64 (their demo's max_num_new_tokens, counting the root; ours draft_len=63), tree K = 3, "
        "D = 3 (their demo's; the paper's sweet spot is K = 4); their window is never shortened at the grid's end, "
        "so its last forwards also draft past the image.",
        "Tiny Lumina with Chameleon's 8,192 codes (model.random_init.num_codes=8192: their logits processor and "
        "sampler hard-code image ids 4..8195), 4 key/value heads (their qk-norm is per model-parallel shard), image "
        "top-k 2000 (their demo's image_top_k), the header forced; their side maps our size tokens to ids 8804 + "
        "units.",
        "Their side: their vendored ChameleonForConditionalGeneration (the class their inference_solver.py loads) "
        "with our weights, made into their sampler by their renew_pipeline_sampler on a stand-in for "
        "FlexARInferenceSolver (whose module imports data.item_processor, absent from their repository, and whose "
        "__init__ loads the 7B checkpoint), their create_logits_processor, transformers 4.47.1 generate; our prompt "
        "ids (header included) and our unconditional stream (their _init_doubled_attn_mask_cfg option with a "
        "two-row attention mask).",
        "Timed over their whole generate call (its setup included) to the commit of the last image code (a "
        "stopping criterion; their loop "
        "would go on to <eoss>); their _sample's CUDA-event timer is patched (cuda_event), as are its "
        "torch.cuda.synchronize() calls (cuda_sync).",
        "tokens = image codes (16 on the 4x4 grid), as our DecodeStats.num_tokens; the end-of-row tokens their "
        "window commits count on neither side.",
        "Their loop fails when its first forward (prefill + first window, our header already in the prompt) takes "
        "a side branch of the tree: push_forward_model_kwargs_and_inputs re-gathers the KV of the accepted path "
        "as if the previous block were one window (scheduler/sjd_pac_iteration_lumina_mgpt.py:268-276; their demo "
        "never gets there, its first window starts at the model-sampled header, where no image draft passes). "
        "Not patched: such an image is decoded again with seed + 1,000,003 (about 1 image in 25 on the tiny "
        "model; each redraw is written to the worker's log), so their side is conditioned on the first forward "
        "not taking a side branch.",
        "Ours runs with model.batch_invariant=false (the default CPU kernels, as theirs); both sides in float32 "
        "(their solver autocasts to bf16 on a GPU).",
    ),
)

_SCHEDULER = "scheduler.sjd_pac_iteration_lumina_mgpt"
_BUG_SITE = "scheduler/sjd_pac_iteration_lumina_mgpt.py:268-276, push_forward_model_kwargs_and_inputs"
#: an image whose prefill forward hits their side-branch bug is decoded again with seed + k * REDRAW_STRIDE
MAX_REDRAWS, REDRAW_STRIDE = 5, 1_000_003
#: (seed, attempt) of every redraw in this worker (also written to its log)
REDRAWS: list[tuple[int, int]] = []


# -- our process ---------------------------------------------------------------------------------------------
def export(ours: Any, pair: Pair) -> dict:
    from eval.bench.peers.scd import export_lumina

    if pair.theirs != "sjd_pac":
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    drafter = ours.drafter
    if (getattr(drafter, "carry", None), getattr(drafter, "init", None)) != ("maximal", "random_uniform_q"):
        raise ValueError("sjd_pac: our decoder must run carry=maximal, init=random_uniform_q (their sampler's)")
    payload = export_lumina(ours)
    payload["tree_width"] = int(drafter.tree_width)
    payload["tree_depth"] = int(drafter.tree_depth)
    return payload


def inputs(ours: Any, prompt: str) -> dict:
    from eval.bench.peers.scd import lumina_inputs

    return lumina_inputs(ours, prompt)


# -- the worker ----------------------------------------------------------------------------------------------
def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    from eval.bench.peers.scd import build_lumina

    if pair.theirs != "sjd_pac":
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    if payload["window"] < 2:
        raise ValueError("their window must hold drafts (max_num_new_tokens >= 2; 1 is their plain AR baseline)")
    options = {"tree_width": payload["tree_width"], "tree_depth": payload["tree_depth"]}
    decode = build_lumina(Path(checkout), payload, _SCHEDULER, options)

    def call(cond: dict, seed: int) -> PeerImage:
        for attempt in range(MAX_REDRAWS + 1):
            try:
                return decode(cond, seed + attempt * REDRAW_STRIDE)
            except RuntimeError as e:
                if not (attempt < MAX_REDRAWS and _prefill_branch_bug(e, decode.clock)):
                    raise
                REDRAWS.append((seed, attempt))
                print(f"sjd_pac: seed {seed + attempt * REDRAW_STRIDE} hit their prefill-branch bug "
                      f"({_BUG_SITE}); redrawn with seed {seed + (attempt + 1) * REDRAW_STRIDE}", file=sys.stderr)
        raise AssertionError("unreachable")

    call.target = decode.target   # their model: the anatomy pass times its forwards
    return call


def _prefill_branch_bug(error: RuntimeError, clock: dict) -> bool:
    """Whether ``error`` is their KV re-gather failing after the prefill forward picked a side branch."""
    frames = traceback.extract_tb(error.__traceback__)
    return (clock.get("forwards") == 1 and bool(frames) and frames[-1].name == "push_forward_model_kwargs_and_inputs"
            and "must match the existing size" in str(error))
