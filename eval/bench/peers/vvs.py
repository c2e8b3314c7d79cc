"""Peer glue: VVS (Dong et al., arXiv 2511.13587, CVPR 2026) as published in ``HyattDD/VVS``.

Their LANTERN fork for LlamaGen: ``models/ea_llamagen.py`` ``EaModel.generate`` with ``skip=True``
(verification skipping on LANTERN's EAGLE-2 dynamic tree: ``models/skip_utils_llamagen.py``,
``models/utils_llamagen.py``), their ``models/kv_variants/modeling_llamagen_kv.py`` target and
``models/drafters/cnets_llamagen.py`` drafter, against our ``decoder=vvs`` with the released code's readings
(``first_row=reference_code``, ``skip_bonus=reference_code``, ``similarity_paths=every_other``,
``select_token=random``, ``reuse_feature=reuse_prev``) and their run's settings (``run_vvs.sh``: uniform
skipping every 5 rounds, LANTERN ``k=1000``, ``delta=0.2``) on ``model=llamagen_t2i_tiny``.

**It does not run as published** (``SPEC.cpu``): their target module imports ``professional_profiling_utils``
(``models/kv_variants/modeling_llamagen_kv.py:34``), a module that is neither in the repository nor a
published package, so nothing of their LlamaGen path can be imported; and past that, ``EaModel.generate``
calls ``skip_verify`` with one positional argument too many (``models/ea_llamagen.py:446``: ``prompt_idx``
before ``idx``, against ``skip_verify(cur_step, steps_in_1st_row, ...)`` at
``models/skip_utils_llamagen.py:61``), a ``TypeError`` ("got multiple values for argument 'last_step_skip'")
in its first round, on any device. Neither is patched here. The glue below is complete up to their call (the
same weight, drafter, neighbour-table and caption handover as ``eval/bench/peers/lantern.py``, whose helpers it
reuses), so the pair runs as soon as a fixed commit of theirs is pinned.

Files their ``EaModel.__init__`` reads from paths relative to the working directory (a temporary folder while
it is built): ``ckpts/llamagen/top_16383_indices.npy`` (LANTERN's neighbour table, their
``generate_codebook.py`` format, from our codebook), ``ckpts/llamagen/code_emb.npy`` (loaded, never used; our
raw codebook) and ``ckpts/llamagen/vq_ds16_t2i.pt``, strictly loaded into their hard-coded
``VQ_16(codebook_size=16384, codebook_embed_dim=8)`` for its codebook (``self.latents``, the dynamic policy's
similarity): a checkpoint of their ``VQ_16`` with our codes in its first rows (our token ids never reach the
others; its encoder and decoder are never run).
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.llamagen import T2I_OVERRIDES

_OPTIONS = ("decoder.tree=dynamic", "decoder.dynamic_tree.top_k=10", "decoder.dynamic_tree.depth=4",
            "decoder.dynamic_tree.total_tokens=58", "decoder.k=1000", "decoder.delta=0.2",
            "decoder.resample=reference", "decoder.neighbour_metric=l2_raw", "decoder.skip_policy=uniform",
            "decoder.skip_interval=5", "decoder.select_token=random", "decoder.reuse_feature=reuse_prev",
            "decoder.first_row=reference_code", "decoder.skip_bonus=reference_code",
            "decoder.similarity_paths=every_other")

SPEC = PeerSpec(
    name="vvs",
    repo="HyattDD/VVS",
    commit="77901736dbc56c3ceb4123cdf37bc28ab15ab9f1",
    model="llamagen_t2i_tiny",
    model_overrides=T2I_OVERRIDES,
    pairs=(
        Pair(ours="vvs", theirs="vvs (uniform, interval 5)", overrides=_OPTIONS,
             difference=("their loop runs until more than the grid's tokens precede the pending token "
                         "(`new_token > max_length`, ea_llamagen.py generate), past the last grid token")),
    ),
    patches=(),
    requirements=("transformers==4.47.1", "beautifulsoup4==4.15.0"),
    cpu=("does not run as published, on any device: models/kv_variants/modeling_llamagen_kv.py:34 imports "
         "professional_profiling_utils, which is neither in the repository nor a published package (their "
         "LlamaGen path cannot be imported); past that, models/ea_llamagen.py:446 calls skip_verify "
         "(models/skip_utils_llamagen.py:61) with one positional argument too many, a TypeError in the first "
         "round"),
    notes=(
        "Their requirements.txt pins transformers 4.45.2; with a stand-in for the missing module (a probe "
        "outside the harness) their code imports under the peer venv's transformers 4.47.1, not under "
        "transformers 5 (their T5Embedder needs bs4, their LlamaGen path transformers 4.x).",
        "Not patched: the missing module and the extra argument are their code's, not device placement.",
        "Our side as their run_vvs.sh: uniform skipping every 5 rounds, LANTERN k = 1000, delta = 0.2, the "
        "released code's readings (first_row=reference_code, skip_bonus=reference_code, "
        "select_token=random, reuse_feature=reuse_prev); their from_pretrained tree (58 nodes, depth 4); "
        "our tiny model's CFG and sampling; 120 caption slots and drafter.prefix=all as in "
        "eval/bench/peers/lantern.py.",
    ),
)


# -- our process ---------------------------------------------------------------------------------------------
def make_ours(cfg: Any, model: Any, pair: Pair) -> Any:
    """Our ``vvs`` with a random EAGLE head fed every caption slot (``prefix=all``), as the lantern pairs."""
    from eval.bench.peers import lantern

    return lantern.make_ours(cfg, model, pair)


def export(ours: Any, pair: Pair) -> dict:
    """As the lantern glue's export, plus our VVS options in their ``generate`` keywords."""
    from baselines.vvs import VVS
    from coolsd.trees import DynamicTree
    from eval.bench.peers import lantern

    if not isinstance(ours, VVS):
        raise ValueError(f"the vvs pair needs our decoder=vvs, got {type(ours).__name__}")
    tree = ours.tree
    if not isinstance(tree, DynamicTree) or (tree.top_k, tree.depth, tree.total_tokens) != (10, 4, 58):
        raise ValueError(f"their EaModel drafts from_pretrained's EAGLE-2 tree (top_k 10, depth 4, 58 "
                         "nodes); "
                         f"ours is {tree!r}")
    readings = (ours.first_row, ours.skip_bonus, ours.similarity_paths)
    if readings != ("reference_code", "reference_code", "every_other"):
        raise ValueError(f"their code's readings are first_row=reference_code, skip_bonus=reference_code, "
                         f"similarity_paths=every_other; ours are {readings}")
    rule = ours.rule
    if (rule.mode, rule.resample) != ("additive", "reference"):
        raise ValueError(f"VVS runs LANTERN's additive rule with the published resampling; ours is "
                         f"{(rule.mode, rule.resample)}")
    pseudo = Pair(ours=pair.ours, theirs="lantern", overrides=pair.overrides)
    payload = lantern.export(ours, pseudo)
    payload["method"] = {
        "lantern": True, "lantern_k": int(rule.k), "lantern_delta": float(rule.budget),
        "skip": True, "skip_policy": ours.skip_policy,
        "skip_interval": int(ours.skip_interval), "sim_threshold": float(ours.similarity_threshold),
        "select_token": "random", "reuse_feature": "reuse_prev",
    }
    return payload


def inputs(ours: Any, prompt: str) -> dict:
    from eval.bench.peers import lantern

    return lantern.inputs(ours, prompt)


# -- the worker ----------------------------------------------------------------------------------------------
def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    import numpy as np

    from eval.bench.peers import lantern

    sys.path.insert(0, str(checkout))
    from models import ea_llamagen as ea   # ModuleNotFoundError: professional_profiling_utils (SPEC.cpu)
    from models.base_models.llamagen.vq_model import VQ_16
    from models.kv_variants import modeling_llamagen_kv as kv

    codebook = payload["codebook"]
    work = Path(tempfile.mkdtemp(prefix="vvs-peer-"))
    ckpts = work / "ckpts" / "llamagen"
    ckpts.mkdir(parents=True)
    np.save(ckpts / "top_16383_indices.npy", lantern._neighbour_table(codebook))   # their hard-coded paths
    np.save(ckpts / "code_emb.npy", codebook.numpy())
    vq = VQ_16(codebook_size=16384, codebook_embed_dim=8)   # their EaModel's hard-coded VQ
    if codebook.shape[0] > 16384 or codebook.shape[1] != 8:
        raise ValueError(f"their EaModel hard-codes a 16384 x 8 codebook; ours is {tuple(codebook.shape)}")
    vq_state = vq.state_dict()
    vq_state["quantize.embedding.weight"][: codebook.shape[0]] = codebook
    torch.save({"model": vq_state}, ckpts / "vq_ds16_t2i.pt")
    del vq, vq_state
    base = lantern.their_target(kv, payload)   # flan-t5-xl on CUDA in their constructor: our captions instead
    model = lantern.their_ea_model(ea, base, work, payload)

    clock = {"forwards": 0, "start": None}

    def pre_hook(*_: Any) -> None:
        clock["forwards"] += 1

    base.model.register_forward_pre_hook(pre_hook)   # their LlamaModel: prefill + verified rounds
    method = payload["method"]
    n = payload["max_length"]
    # their gen_images.py keywords for a LlamaGen VVS run (run_vvs.sh; the labs and AR_lab off, as default)
    options = dict(model="llamagen", max_length=n, temperature=payload["temperature"], top_k=payload["top_k"],
                   top_p=payload["top_p"], cfg=payload["cfg_scale"], static_tree=False,
                   lantern=method["lantern"], lantern_k=method["lantern_k"],
                   lantern_delta=method["lantern_delta"],
                   prompts="peer", skip=True, skip_interval=method["skip_interval"],
                   skip_policy=method["skip_policy"], select_token=method["select_token"],
                   reuse_feature=method["reuse_feature"], feat_shift_lab=False, feat_shift_staleness=-1,
                   feat_cons_lab=False, feat_cons_staleness=None, token_shift_lab=False,
                   token_shift_interval=2,
                   post_verify=False, AR_lab=False, sim_threshold=method["sim_threshold"])
    calls = [0]

    def call(cond: dict, seed: int) -> PeerImage:
        random.seed(seed)   # their gen_images.set_seed
        np.random.seed(seed)
        torch.manual_seed(seed)
        clock["forwards"] = 0
        clock["start"] = time.perf_counter()   # their whole decode call is timed (setup included)
        out = model.generate(prompt=cond, idx=calls[0], **options)
        calls[0] += 1
        seconds = time.perf_counter() - clock["start"]
        codes = tuple(int(x) for x in out[0][0].tolist())
        return PeerImage(seconds=seconds, tokens=len(codes), target_forwards=clock["forwards"], codes=codes)

    return call
