"""Peer: LlamaGen's own ``generate`` (FoundationVision/LlamaGen, ``autoregressive/models/generate.py``) against our
``decoder=ar`` on the same text-to-image GPT weights.

Their side builds their ``Transformer(ModelArgs)`` (``autoregressive/models/gpt.py``) with our tiny T2I GPT's
sizes and loads our ``model.gpt`` state dict into it strictly by key name (our GPT keeps the released
checkpoints' names). Both sides get the same caption: our tiny T5's features, left-padded and multiplied by the
mask (``c = emb * mask``, as their ``sample_t2i.py`` does), with the same mask as ``emb_masks``; CFG, temperature,
top-k and top-p are ours. Their ``generate`` sets up its KV caches per call (their published cost, timed);
everything runs as their sampling script runs it, without ``torch.compile`` (``--compile`` is off by default
there too).

Nothing needs patching on a CPU: ``generate`` places everything on the caption's device. Their time is the whole
``generate`` call (cache setup included, as our prefill's cache allocation is in ours); the tiny T5's caption
encoding is in ours (our prefill encodes the caption) and not in theirs.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec

#: every LlamaGen-T2I peer's tiny model: the default CPU kernels (as theirs) and 120 caption slots (their
#: CaptionEmbedder and EaModel fix 120)
T2I_OVERRIDES = ("model.batch_invariant=false", "model.gpt.cls_token_num=120")

SPEC = PeerSpec(
    name="llamagen",
    repo="FoundationVision/LlamaGen",
    commit="ce98ec41803a74a90ce68c40ababa9eaeffeb4ec",
    model="llamagen_t2i_tiny",
    model_overrides=T2I_OVERRIDES,
    pairs=(Pair(ours="ar", theirs="generate (AR)"),),
    notes=("120 caption slots (`model.gpt.cls_token_num=120`), as the released T2I models: their "
           "`CaptionEmbedder` fixes the unconditional embedding at 120 tokens.",
           "Their `generate` allocates its KV caches and causal mask inside every call "
           "(`setup_caches`); that is their published per-image cost and is timed.",
           "Ours runs with `model.batch_invariant=false` (the default CPU kernels, as theirs); the harness's "
           "default batch-invariant kernels cost more at batch 1 and are not what this compares."),
)


def export(ours: Any, pair: Pair) -> dict:
    model = ours.model
    sampling = model.sampling
    return {
        "args": dataclasses.asdict(model.cfg),
        "state": {k: v.detach().cpu().clone() for k, v in model.gpt.state_dict().items()},
        "grid_tokens": int(model.num_image_tokens),
        "cfg_scale": float(sampling.cfg_scale),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k or 0),
        "top_p": float(sampling.top_p),
    }


def inputs(ours: Any, prompt: str) -> dict:
    caption = ours.model.text(prompt)
    valid = caption.valid.cpu()
    return {"cond": (caption.features.cpu().float() * valid[..., None]), "mask": valid.to(torch.int64)}


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    sys.path.insert(0, str(checkout))
    from autoregressive.models.generate import generate
    from autoregressive.models.gpt import ModelArgs, Transformer

    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    args = ModelArgs(**{k: v for k, v in payload["args"].items() if k in fields})
    net = Transformer(args)
    missing, unexpected = net.load_state_dict(payload["state"], strict=False)
    if missing or unexpected:
        raise RuntimeError(f"their GPT does not take our weights by name: missing {missing}, "
                           f"unexpected {unexpected}")
    net.eval()
    forwards = [0]
    net.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    n = payload["grid_tokens"]

    def call(cond: dict, seed: int) -> PeerImage:
        torch.manual_seed(seed)
        forwards[0] = 0
        t0 = time.perf_counter()
        seq = generate(net, cond["cond"], n, emb_masks=cond["mask"], cfg_scale=payload["cfg_scale"],
                       temperature=payload["temperature"], top_k=payload["top_k"], top_p=payload["top_p"],
                       sample_logits=True)
        seconds = time.perf_counter() - t0
        codes = seq[0, -n:].tolist()
        return PeerImage(seconds=seconds, tokens=n, target_forwards=forwards[0], codes=tuple(codes))

    call.target = net   # the anatomy pass times its forwards
    return call
