"""Peer glue: LANTERN (arXiv 2410.03355) and LANTERN++ (arXiv 2502.06352) as published in ``jadohu/LANTERN``.

Their LlamaGen text-to-image path: ``models/ea_model_llamagen.py`` ``EaModel.generate`` (the loop, the EAGLE-2
dynamic tree and EAGLE-1 static tree, ``evaluate_posterior`` / ``evaluate_posterior_v1`` with the relaxed
acceptance), ``models/kv_variants/modeling_llamagen_kv.py`` ``LlamaForCausalLM`` (the target) and
``models/drafters/cnets_llamagen.py`` ``Model`` (the EAGLE drafter), against our ``sd`` (on the same tree),
``lantern`` and ``lantern_pp`` on ``model=llamagen_t2i_tiny``.

* Target weights: our ``model.gpt`` (LlamaGen names) mapped onto their HF-Llama names (``wqkv`` split into
  ``q/k/v_proj``, ``w1/w3/w2`` -> ``gate/up/down_proj``, ``attention_norm/ffn_norm`` ->
  ``input_layernorm/post_attention_layernorm``, ``output`` -> ``lm_head``), loaded strictly into their
  ``LlamaForCausalLM`` built from a ``LlamaConfig`` with our sizes. Their ``EaModel`` pads ``input_ids`` with
  120 zeros for the caption slots (``ea_model_llamagen.py`` ``initialize_tree`` and ``generate``), so the tiny
  model runs with 120 caption slots (``model.gpt.cls_token_num=120``).
* Drafter weights: our random EAGLE head (``EagleHead(model, init_seed=0, prefix="all")``) mapped onto their
  ``cnets_llamagen.Model`` names (the inverse of ``coolsd.drafters.eagle._eagle_to_ours``; ``embed_tokens`` =
  our target's token embedding, which our head reads), loaded strictly by their ``EaModel.__init__``. Their
  drafter config names the ``input_type`` ``t2i`` only for the 16x16 grid it hard-codes; ours passes another
  ``input_type`` with our 8x8 grid and their t2i values ``cls_token_num=119``, ``rope_base=10000`` (their
  ``Model.__init__`` keeps a config's own values for other input types). Their drafter is fed every caption
  slot (their ``initialize_tree``), so our side runs ``drafter.prefix=all`` (``make_ours``).
* Neighbourhoods: their ``generate_codebook.py`` format (every other code by raw-codebook L2 distance,
  ``topk``, uint16, ``top_{N-1}_indices.npy``) from our VQ codebook, written where their ``EaModel.__init__``
  reads it (``ckpts/llamagen/vq_distances/top_16383_indices.npy`` relative to the working directory,
  hard-coded) in a temporary folder that is the working directory while ``EaModel`` is built.
* Conditioning: our tiny T5's caption features, handed over in the right-padded layout of their T5Embedder's
  ``get_text_embeddings`` (their ``generate`` left-pads and masks them itself); their ``LlamaForCausalLM``
  constructs a flan-t5-xl ``T5Embedder`` on CUDA, which is replaced by a stand-in that returns ours.
* Settings: our cfg_scale / temperature / top_k / top_p; LANTERN ``lantern_k`` / ``lantern_delta`` = our
  ``decoder.k`` / ``decoder.delta`` (LANTERN++: ``decoder.lam`` as their ``lantern_delta > 1``); their
  ``EaModel.from_pretrained`` tree defaults (``total_token=59, depth=4, top_k=10``: 58 nodes, 5 draft levels);
  their static tree ``naive_extend_57`` (``generate``'s default); seeds as their ``set_seed`` (``random``,
  ``numpy``, ``torch``) before every image.

Checked on the tiny model: their target's logits equal ours to 4e-6 (prefill and an image block); with a
caption filling all 120 slots their first EAGLE-2 draft tree equals ours token for token, while a short
caption gives other drafts (the padded slots' hidden states, ``Pair.difference``); over 30 images per pair the
accepted lengths agree once their forwards past the last grid token are left out.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.llamagen import T2I_OVERRIDES

_DYNAMIC = ("decoder.tree=dynamic", "decoder.dynamic_tree.top_k=10", "decoder.dynamic_tree.depth=4",
            "decoder.dynamic_tree.total_tokens=58")
_STATIC = ("decoder.tree=naive_extend_57",)
_LANTERN = ("decoder.k=1000", "decoder.delta=0.1", "decoder.resample=reference",
            "decoder.neighbour_metric=l2_raw")
_LANTERN_PP = ("decoder.k=10", "decoder.lam=5.0", "decoder.resample=reference_q",
               "decoder.neighbour_metric=l2_raw")
_DIFFERENCE = ("theirs stops only once more than the grid's tokens precede the pending one "
               "(ea_model_llamagen.py generate, `new_token > max_length`): 1-2 target forwards past the "
               "last grid token; and their target's HF-style mask lets a padded caption slot attend to the "
               "earlier padded slots (ours, LlamaGen's: to itself), so both targets agree on every "
               "distribution but feed their drafters (prefix=all) other hidden states at padded slots: other "
               "drafts for captions under 120 tokens")

SPEC = PeerSpec(
    name="lantern",
    repo="jadohu/LANTERN",
    commit="3a56e451dd5ebfa1903d044f754c68c420de27a9",
    model="llamagen_t2i_tiny",
    model_overrides=T2I_OVERRIDES,
    pairs=(
        Pair(ours="sd", theirs="eagle (dynamic tree)", overrides=_DYNAMIC, difference=_DIFFERENCE),
        Pair(ours="sd", theirs="eagle (static tree)", overrides=_STATIC, difference=_DIFFERENCE),
        Pair(ours="lantern", theirs="lantern", overrides=(*_DYNAMIC, *_LANTERN), difference=_DIFFERENCE),
        Pair(ours="lantern_pp", theirs="lantern++", overrides=(*_STATIC, *_LANTERN_PP),
             difference=_DIFFERENCE),
    ),
    patches=(),
    requirements=("transformers==4.47.1", "beautifulsoup4==4.15.0"),
    cpu="",
    notes=(
        "Their models/__init__.py imports the Lumina-mGPT model, which needs transformers 4.x "
        "(LogitsWarper), and their LlamaGen target imports T5Embedder (models/base_models/llamagen/t5.py), "
        "which needs bs4: their side runs in a peer venv with transformers==4.47.1 and beautifulsoup4.",
        "120 caption slots (model.gpt.cls_token_num=120): EaModel hard-codes 120 prefix positions.",
        "Their drafter's input_type t2i hard-codes a 16x16 RoPE grid; the glue names another input_type "
        "with our 8x8 grid (block_size=64) and their t2i cls_token_num=119 (their Model keeps a config's "
        "values then).",
        "Their T5Embedder (flan-t5-xl on CUDA, built in LlamaForCausalLM.__init__) is replaced by a "
        "stand-in returning our tiny T5's features in its layout; no text encoding is timed on either side.",
        "Drafter: our random EAGLE head (init_seed 0) with drafter.prefix=all on both sides (their drafter "
        "is fed every caption slot); its accepted lengths mean nothing about a trained drafter.",
        "Neighbour table: their generate_codebook.py format (raw-codebook L2, uint16) from our tiny VQ "
        "codebook, at the path their EaModel reads it from; k = 1000 (their default), LANTERN++ k = 10, "
        "lambda = 5 (their run.sh values).",
        "Their seconds run over their whole generate call (their tree-buffer and KV-cache setup and their "
        "trailing forwards included), as ours run over our whole decode (cache allocation and the tiny T5's "
        "caption encoding included).",
        "Ours runs with model.batch_invariant=false (default CPU kernels) for the speed comparison.",
    ),
)

#: their drafter's input types with a hard-coded grid (cnets_llamagen.py Model.__init__); ours must be another
_THEIR_GRID_TYPES = ("c2i", "t2i", "t2i2")
_CAPTION_SLOTS = 120   # EaModel's hard-coded prefix length


# -- our process ---------------------------------------------------------------------------------------------
def make_ours(cfg: Any, model: Any, pair: Pair) -> Any:
    """Our decoder of ``pair`` with a random EAGLE head fed every caption slot (``prefix=all``, as theirs)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from coolsd.drafters.eagle import EagleDrafter, EagleHead

    head = EagleHead(model, init_seed=0, prefix="all")
    drafter = EagleDrafter(target=model, head=head, extra_slots=64, prefix="all")
    node = OmegaConf.to_container(cfg.decoder, resolve=True)
    node.update(drafter=None, track_tv=False, sync_phases=False)
    return instantiate(node, model=model, drafter=drafter)


def _method(ours: Any, pair: Pair) -> dict:
    """Their ``generate`` arguments for ``pair``, read from our built decoder (checked against the pair)."""
    from coolsd.trees import DynamicTree, TreeShape

    static = isinstance(ours.tree, TreeShape)
    if pair.theirs.endswith("(static tree)") or pair.theirs == "lantern++":
        if not static or ours.tree.name != "naive_extend_57":
            raise ValueError(f"pair {pair.theirs!r} runs their static tree naive_extend_57; ours has "
                             f"{ours.tree!r}")
    elif not isinstance(ours.tree, DynamicTree) or (
            (ours.tree.top_k, ours.tree.depth, ours.tree.total_tokens) != (10, 4, 58)):
        raise ValueError(f"pair {pair.theirs!r} runs their EAGLE-2 tree (top_k 10, depth 4, 58 nodes); ours "
                         f"has {ours.tree!r}")
    method = {"static_tree": static, "lantern": False, "lantern_k": 1000, "lantern_delta": 0.1,
              "tree": ours.tree.name if static else None,
              "tree_paths": sorted(list(p) for p in ours.tree.paths) if static else None}
    if pair.theirs in ("lantern", "lantern++"):
        rule = ours.rule
        want = ("additive", "reference") if pair.theirs == "lantern" else ("multiplicative", "reference_q")
        if (rule.mode, rule.resample) != want:
            raise ValueError(f"pair {pair.theirs!r} needs our rule mode/resample {want}, got "
                             f"{(rule.mode, rule.resample)}")
        if ours.model.codebook_size - 1 < rule.k + 1:
            raise ValueError(f"their neighbour table has {ours.model.codebook_size - 1} columns; "
                             f"k = {rule.k} reads k + 1")
        method.update(lantern=True, lantern_k=int(rule.k), lantern_delta=float(rule.budget))
        if pair.theirs == "lantern" and method["lantern_delta"] > 1.0:
            raise ValueError("their lantern_delta > 1 means LANTERN++'s lambda; LANTERN's delta must be <= 1")
        if pair.theirs == "lantern++" and method["lantern_delta"] <= 1.0:
            raise ValueError("LANTERN++'s lambda must be > 1 in their code (lantern_delta <= 1 is additive)")
    return method


def _target_state(gpt: Any) -> dict[str, torch.Tensor]:
    """Our LlamaGen GPT's tensors under their ``LlamaForCausalLM`` names."""
    cfg = gpt.config
    head_dim = cfg.dim // cfg.n_head
    kv = (cfg.n_kv_head or cfg.n_head) * head_dim
    src = {k: v.detach().cpu().float().clone() for k, v in gpt.state_dict().items()}
    out = {
        "model.embed_tokens.weight": src.pop("tok_embeddings.weight"),
        "model.cls_embedding.cap_proj.fc1.weight": src.pop("cls_embedding.cap_proj.fc1.weight"),
        "model.cls_embedding.cap_proj.fc2.weight": src.pop("cls_embedding.cap_proj.fc2.weight"),
        "model.cls_embedding.uncond_embedding": src.pop("cls_embedding.uncond_embedding"),
        "model.norm.weight": src.pop("norm.weight"),
        "lm_head.weight": src.pop("output.weight"),
    }
    for i in range(cfg.n_layer):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = src.pop(p + "attention.wqkv.weight").split([cfg.dim, kv, kv], dim=0)
        out.update({q + "self_attn.q_proj.weight": wq.clone(), q + "self_attn.k_proj.weight": wk.clone(),
                    q + "self_attn.v_proj.weight": wv.clone(),
                    q + "self_attn.o_proj.weight": src.pop(p + "attention.wo.weight"),
                    q + "mlp.gate_proj.weight": src.pop(p + "feed_forward.w1.weight"),
                    q + "mlp.up_proj.weight": src.pop(p + "feed_forward.w3.weight"),
                    q + "mlp.down_proj.weight": src.pop(p + "feed_forward.w2.weight"),
                    q + "input_layernorm.weight": src.pop(p + "attention_norm.weight"),
                    q + "post_attention_layernorm.weight": src.pop(p + "ffn_norm.weight")})
    if src:
        raise ValueError(f"our GPT has tensors the glue does not map: {sorted(src)[:8]}")
    return out


def _drafter_state(head: Any) -> dict[str, torch.Tensor]:
    """Our EAGLE head's tensors under their ``cnets_llamagen.Model`` names (their HF-Llama layer names)."""
    layer = head.layer
    src = {k: v.detach().cpu().float().clone() for k, v in head.state_dict().items()}
    q_rows = layer.num_heads * layer.head_dim
    kv_rows = layer.num_kv_heads * layer.head_dim
    wq, wk, wv = src.pop("layer.attention.wqkv.weight").split([q_rows, kv_rows, kv_rows], dim=0)
    own = src.pop("embedding", None)
    out = {
        "layers.0.self_attn.q_proj.weight": wq.clone(),
        "layers.0.self_attn.k_proj.weight": wk.clone(),
        "layers.0.self_attn.v_proj.weight": wv.clone(),
        "layers.0.self_attn.o_proj.weight": src.pop("layer.attention.wo.weight"),
        "layers.0.mlp.gate_proj.weight": src.pop("layer.feed_forward.w1.weight"),
        "layers.0.mlp.up_proj.weight": src.pop("layer.feed_forward.w3.weight"),
        "layers.0.mlp.down_proj.weight": src.pop("layer.feed_forward.w2.weight"),
        "layers.0.post_attention_layernorm.weight": src.pop("layer.ffn_norm.weight"),
        "fc.weight": src.pop("fc.weight"),
        # the head embeds with its own table where it has one, else with the target's (read at call time)
        "embed_tokens.weight": (own if own is not None
                                else head.target.gpt.tok_embeddings.weight.detach().cpu().float().clone()),
    }
    if "fc.bias" in src:
        out["fc.bias"] = src.pop("fc.bias")
    if src:
        raise ValueError(f"our EAGLE head has tensors the glue does not map: {sorted(src)[:8]}")
    return out


def export(ours: Any, pair: Pair) -> dict:
    """Our target's and drafter's weights in their names, their configs, our sampling, the method."""
    from coolsd.drafters.eagle import EagleDrafter

    model = ours.model
    if getattr(model, "model_type", None) != "t2i":
        raise ValueError(f"the lantern peer runs their LlamaGen T2I path; our model is "
                         f"{type(model).__name__}")
    cfg = model.cfg
    if cfg.cls_token_num != _CAPTION_SLOTS:
        raise ValueError(f"their EaModel hard-codes {_CAPTION_SLOTS} caption slots; set "
                         f"model.gpt.cls_token_num={_CAPTION_SLOTS} (ours: {cfg.cls_token_num})")
    if model.num_streams != 2:
        raise ValueError("their LlamaGen EaModel always runs the CFG pair; our model must use CFG "
                         "(cfg_scale > 1)")
    drafter = ours.drafter
    if not isinstance(drafter, EagleDrafter) or drafter.prefix != "all":
        raise ValueError("the lantern pairs need our EAGLE drafter fed every caption slot (prefix=all), "
                         "as their drafter is; build ours with eval.bench.peers.lantern.make_ours")
    head = drafter.head
    layer = head.layer
    sampling = model.sampling
    ffn = model.gpt.layers[0].feed_forward.w1.weight.shape[0]
    n = int(model.num_image_tokens)
    target_config = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": int(ffn),
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": _CAPTION_SLOTS + n + 256, "hidden_act": "silu", "attention_bias": False,
        "pretraining_tp": 1, "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"],
        # LlamaGen fields their LlamaModel reads from the config
        "block_size": cfg.block_size, "num_classes": cfg.num_classes, "input_type": "t2i",
        "cls_token_num": cfg.cls_token_num, "caption_dim": cfg.caption_dim, "rope_base": cfg.rope_base,
        "token_dropout_p": 0.0, "class_dropout_p": 0.0, "resid_dropout_p": 0.0, "ffn_dropout_p": 0.0,
    }
    drafter_config = {
        "vocab_size": cfg.vocab_size, "hidden_size": int(layer.hidden_size),
        "intermediate_size": int(layer.intermediate_size), "num_hidden_layers": 1,
        "num_attention_heads": int(layer.num_heads), "num_key_value_heads": int(layer.num_kv_heads),
        "rms_norm_eps": float(head.norm_eps if head.norm_eps is not None else cfg.norm_eps),
        "max_position_embeddings": _CAPTION_SLOTS + n + 256, "hidden_act": "silu", "bias": bool(head.bias),
        "architectures": ["LlamaForCausalLM"],
        # not one of their hard-coded grids (c2i/t2i/t2i2): their Model keeps these values
        "input_type": "t2i_tiny", "block_size": cfg.block_size, "rope_base": cfg.rope_base,
        "cls_token_num": _CAPTION_SLOTS - 1,
    }
    assert drafter_config["input_type"] not in _THEIR_GRID_TYPES
    return {
        "target_config": target_config,
        "target_state": _target_state(model.gpt),
        "drafter_config": drafter_config,
        "drafter_state": _drafter_state(head),
        "codebook": model.codebook().detach().cpu().float().clone(),
        "max_length": n,
        "cfg_scale": float(sampling.cfg_scale),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k or 0),
        "top_p": float(sampling.top_p),
        "method": _method(ours, pair),
    }


def inputs(ours: Any, prompt: str) -> dict:
    """Our tiny T5's caption in their T5Embedder's layout: valid rows first (right padding), the 0/1 mask."""
    caption = ours.model.text(prompt)
    c = caption.features.shape[1]
    k = int(caption.num_tokens)
    emb = torch.zeros_like(caption.features, dtype=torch.float32, device="cpu")
    emb[:, :k] = caption.features[:, c - k:].detach().cpu().float()
    mask = torch.zeros(1, c, dtype=torch.int64)
    mask[:, :k] = 1
    return {"caption": emb, "mask": mask}


# -- the worker ----------------------------------------------------------------------------------------------
class _CaptionStandIn:
    """Stands in for their ``T5Embedder``: ``get_text_embeddings(prompt)``, ``prompt`` = our ``inputs()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_text_embeddings(self, prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return prompt["caption"], prompt["mask"]


def _neighbour_table(codebook: torch.Tensor):
    """Their ``entrypoints/generate_codebook.py`` output for ``codebook``: (N, N-1) uint16, nearest first."""
    distances = torch.cdist(codebook, codebook, p=2)
    distances.fill_diagonal_(float("inf"))
    _, idx = torch.topk(distances, codebook.shape[0] - 1, dim=-1, largest=False)
    return idx.to(torch.uint16).numpy()


def their_target(kv: Any, payload: dict) -> Any:
    """Their ``LlamaForCausalLM`` (``models/kv_variants/modeling_llamagen_kv.py``, module ``kv``) with our GPT's
    weights, loaded strictly by name. Their constructor builds flan-t5-xl on CUDA; while it runs, their module's
    ``T5Embedder`` name points at ``_CaptionStandIn`` (our captions come instead), and is restored after."""
    from transformers.models.llama import LlamaConfig

    their_t5 = kv.T5Embedder
    kv.T5Embedder = _CaptionStandIn
    try:
        base = kv.LlamaForCausalLM(LlamaConfig(**payload["target_config"]))
    finally:
        kv.T5Embedder = their_t5
    missing, unexpected = base.load_state_dict(payload["target_state"], strict=False)
    if missing or unexpected:
        raise RuntimeError(f"their LlamaForCausalLM does not take our weights: missing {missing}, "
                           f"unexpected {unexpected}")
    return base.float().eval()


def their_ea_model(ea: Any, base: Any, work: Path, payload: dict) -> Any:
    """Their ``EaModel`` (module ``ea``: LANTERN's, or VVS's fork of it) over ``base`` with our drafter's config and
    weights, in eval mode. Built with ``work`` as the working directory, since ``EaModel.__init__`` reads the files
    the caller put there (the neighbour table; VVS's also its VQ) relative to it; ``work`` is removed after."""
    drafter_config = work / "config.json"
    drafter_config.write_text(json.dumps(payload["drafter_config"]))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        model = ea.EaModel(base, "tiny", str(drafter_config), total_token=59, depth=4, top_k=10,
                           threshold=1.0, ea_layer_state_dict=payload["drafter_state"])   # from_pretrained's
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)   # EaModel.__init__ has read every file it needs
    model.eval()
    return model


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    import numpy as np

    sys.path.insert(0, str(checkout))
    from models import ea_model_llamagen as ea
    from models.kv_variants import modeling_llamagen_kv as kv

    work = Path(tempfile.mkdtemp(prefix="lantern-peer-"))
    table = work / "ckpts" / "llamagen" / "vq_distances" / "top_16383_indices.npy"   # their hard-coded path
    table.parent.mkdir(parents=True)
    np.save(table, _neighbour_table(payload["codebook"]))
    base = their_target(kv, payload)
    model = their_ea_model(ea, base, work, payload)
    if model.nearest_latents.shape != (payload["codebook"].shape[0], payload["codebook"].shape[0] - 1):
        raise RuntimeError(f"their EaModel read a neighbour table of shape {model.nearest_latents.shape}")

    clock = {"forwards": 0, "start": None}

    def pre_hook(*_: Any) -> None:
        clock["forwards"] += 1

    base.model.register_forward_pre_hook(pre_hook)   # their LlamaModel: prefill + one per tree verification
    method = payload["method"]
    n = payload["max_length"]
    options = dict(max_length=n, temperature=payload["temperature"], top_k=payload["top_k"],
                   top_p=payload["top_p"], cfg=payload["cfg_scale"], lantern=method["lantern"],
                   lantern_k=method["lantern_k"], lantern_delta=method["lantern_delta"],
                   static_tree=method["static_tree"])
    if method["static_tree"]:   # their own shape object (generate's default), checked against ours
        from models.drafters import choices

        shape = getattr(choices, method["tree"])
        if sorted(list(p) for p in shape) != method["tree_paths"]:
            raise RuntimeError(f"their {method['tree']} differs from ours")
        options["tree_choices"] = shape

    def call(cond: dict, seed: int) -> PeerImage:
        random.seed(seed)   # their generate_images.set_seed
        np.random.seed(seed)
        torch.manual_seed(seed)
        clock["forwards"] = 0
        clock["start"] = time.perf_counter()   # their whole decode call is timed (setup included)
        ids, _, _ = model.generate(prompt=cond, **options)
        seconds = time.perf_counter() - clock["start"]
        codes = tuple(int(x) for x in ids[0].tolist())
        return PeerImage(seconds=seconds, tokens=len(codes), target_forwards=clock["forwards"], codes=codes)

    call.target, call.drafter = base.model, model.ea_layer   # the anatomy pass times their forwards
    return call
