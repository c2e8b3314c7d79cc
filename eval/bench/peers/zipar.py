"""Peer glue: ZipAR (He et al., arXiv 2412.04062, ICML 2025) as published in ``ThisisBillhe/ZipAR``.

Their LlamaGen port (``LlamaGen-ZipAR/autoregressive/models/generate_zipar.py`` ``generate`` and ``gpt.py``
``Transformer``) against our ``decoder=zipar`` on ``model=llamagen_t2i_tiny``. Their repository has the fixed window
only (no adaptive window, so no pair for our ``zipar_adaptive``) and publishes a class-conditional sampling script
only (``sample_c2i_ddp_zipar.py``); their ``generate`` has a ``t2i`` branch (caption embeddings + ``emb_masks``)
that runs on our tiny T2I with no change of their code, so the pair uses that branch with our T5 features.

* Weights: our ``model.gpt`` uses LlamaGen's key names, so its state dict loads strictly into their
  ``Transformer(ModelArgs(...))`` built with our sizes. Their ``CaptionEmbedder`` fixes ``uncond_embedding`` to
  120 caption slots; the buffer is given our ``cls_token_num`` rows before loading (a weight shape, not code).
* Conditioning: our caption encoder's left-padded features times the mask, and the mask, as their ``t2i`` branch
  takes them (``cond``, ``emb_masks``), the unconditional half being their ``uncond_embedding`` (ours, loaded).
* Settings: their ``zipar_window_size`` attribute set to our window (as their script sets it from
  ``--zipar-window-size``); our cfg_scale / temperature / top_k / top_p; ``cfg_interval=-1``; ``torch.manual_seed``.
* The grid: the tiny model's 8x8 grid equals their default window 8 (plain AR), so the pair enlarges the tiny
  GPT to a 16x16 grid (``model.gpt.block_size=256``, random weights as before) and keeps their window 8.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.llamagen import T2I_OVERRIDES

_SUBDIR = "LlamaGen-ZipAR"

SPEC = PeerSpec(
    name="zipar",
    repo="ThisisBillhe/ZipAR",
    commit="2a5695ca2525872ac6ee38c9d62be38f0c9e985b",
    model="llamagen_t2i_tiny",
    model_overrides=(*T2I_OVERRIDES, "model.gpt.block_size=256"),
    pairs=(
        Pair(
            ours="zipar",
            theirs="zipar",
            overrides=("decoder.order.window=8", "decoder.order.stand_in=reference",
                       "decoder.order.first_row_ar=true", "decoder.track_tv=false"),
            difference=("theirs masks its static KV cache by global position, so a later row's queries also "
                        "attend to the zero-filled slots the rows above have not written yet and to the "
                        "stand-in token left at the row above's end slot; ours lets a query see written tokens "
                        "at or before its cell only (same schedule and forwards, other token distributions)"),
        ),
    ),
    patches=(),
    requirements=(),
    cpu="",
    notes=(
        "Their LlamaGen port (LlamaGen-ZipAR/autoregressive/models/generate_zipar.py generate, gpt.py Transformer);"
        " their published script is class-conditional, their generate's t2i branch is used as is with our tiny "
        "T5's caption features and mask.",
        "Tiny GPT enlarged to a 16x16 grid (model.gpt.block_size=256): at 8x8 their default window 8 is plain AR.",
        "120 caption slots (model.gpt.cls_token_num=120), as the released T2I models: their CaptionEmbedder fixes "
        "the unconditional embedding at 120 tokens.",
        "The repository has no adaptive window (paper's ICML version): decoder=zipar_adaptive has no pair.",
        "Their seconds run over their generate call, its KV-cache and mask setup included (ours allocates its cache "
        "in its prefill, also timed); the tiny T5 caption encoding is outside theirs (inputs(), our process) and "
        "inside ours (our prefill encodes the caption).",
        "Their decode loops enter torch.backends.cuda.sdp_kernel(...) (generate_zipar.py:111, :137): a deprecated "
        "context (one FutureWarning) that does nothing on the CPU; no device patch is needed.",
        "Ours runs with model.batch_invariant=false (default CPU kernels) for the speed comparison.",
    ),
)


# -- our process ---------------------------------------------------------------------------------------------------
def export(ours: Any, pair: Pair) -> dict:
    """Our tiny GPT's weights and sizes, our window and sampling settings (CPU tensors, numbers, strings)."""
    order = ours.order
    if order is None or not hasattr(order, "window"):
        raise ValueError(f"the zipar pair needs our decoder=zipar (a RowWindow order), got {ours.name!r}")
    if order.stand_in != "reference" or not order.first_row_ar:
        raise ValueError("the zipar pair runs their LlamaGen port's reading: decoder.order.stand_in=reference "
                         "decoder.order.first_row_ar=true")
    if order.rows != order.cols:
        raise ValueError(f"their Transformer needs a square grid, ours is {order.rows}x{order.cols}")
    model = ours.model
    if getattr(model, "model_type", None) != "t2i":
        raise ValueError("this glue pairs their t2i branch: our model must be a LlamaGen T2I (llamagen_t2i_*)")
    sampling = model.sampling
    if sampling.cfg_rule != "above_one":
        raise ValueError("their generate guides only when cfg_scale > 1: set model.sampling.cfg_rule=above_one")
    c = model.cfg
    args = {name: getattr(c, name) for name in (
        "dim", "n_layer", "n_head", "n_kv_head", "multiple_of", "ffn_dim_multiplier", "rope_base", "norm_eps",
        "num_classes", "caption_dim", "class_dropout_prob", "model_type", "vocab_size", "cls_token_num",
        "block_size")}
    args["rope_base"] = float(args["rope_base"])
    state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in model.gpt.state_dict().items()}
    return {
        "args": args,
        "state_dict": state,
        "window": int(order.window),
        "cfg_scale": float(sampling.cfg_scale),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k),
        "top_p": float(sampling.top_p),
    }


def inputs(ours: Any, prompt: str) -> object:
    """Our caption features (left-padded, zero on the padded slots) and their mask, batch 1, as their
    ``generate(..., emb_masks=...)`` t2i branch takes them."""
    with torch.inference_mode():
        caption = ours.model.text(prompt)
    valid = caption.valid.to("cpu")
    cond = caption.features.to("cpu", torch.float32) * valid[..., None].float()
    return {"cond": cond.clone(), "emb_masks": valid.long().clone()}


# -- the worker ----------------------------------------------------------------------------------------------------
def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[object, int], PeerImage]:
    root = str(Path(checkout) / _SUBDIR)
    if root not in sys.path:
        sys.path.insert(0, root)
    from autoregressive.models import gpt as their_gpt  # noqa: PLC0415 - their code, from the checkout
    from autoregressive.models.generate_zipar import generate  # noqa: PLC0415

    args = dict(payload["args"])
    model = their_gpt.Transformer(their_gpt.ModelArgs(**args))
    model.load_state_dict(payload["state_dict"], strict=True)
    model.eval()
    model.zipar_window_size = int(payload["window"])   # as their sample_c2i_ddp_zipar.py sets it
    block_size = int(args["block_size"])
    kwargs = {"cfg_scale": payload["cfg_scale"], "cfg_interval": -1, "temperature": payload["temperature"],
              "top_k": payload["top_k"], "top_p": payload["top_p"], "sample_logits": True}

    state = {"forwards": 0}

    def hook(module: Any, args: Any, output: Any) -> None:
        state["forwards"] += 1

    model.register_forward_hook(hook)

    def call(inp: object, seed: int) -> PeerImage:
        cond, emb_masks = inp["cond"], inp["emb_masks"]
        model.reset_zipar()
        state["forwards"] = 0
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            codes = generate(model, cond, block_size, emb_masks=emb_masks, **kwargs)
        end = time.perf_counter()
        model.reset_zipar()   # their script resets after every generate
        if codes.shape != (1, block_size):
            raise RuntimeError(f"their generate returned codes of shape {tuple(codes.shape)}, expected "
                               f"(1, {block_size})")
        return PeerImage(seconds=end - start, tokens=int(codes.shape[1]),
                         target_forwards=state["forwards"], codes=tuple(int(x) for x in codes[0].tolist()))

    call.target = model   # the anatomy pass times its forwards
    return call
