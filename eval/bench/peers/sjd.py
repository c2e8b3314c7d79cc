"""Peer glue: speculative Jacobi decoding (Teng et al., arXiv 2410.01699, ICLR 2025) as published in
``tyshiwo1/Accelerating-T2I-AR-with-SJD``, on Lumina-mGPT.

Their side is their Lumina-mGPT path: their vendored Chameleon
(``lumina_mgpt/model/chameleon/modeling_chameleon.py`` ``ChameleonForConditionalGeneration``, the class their
``inference_solver.py`` loads) made their Jacobi sampler as ``renew_pipeline_sampler`` does it
(``scheduler/jacobi_iteration_lumina_mgpt.py``: ``renew_sampler`` on the model class, ``renew_backbone`` on
the decoder stack, ``_init_new_params``), run by transformers' ``generate`` with the two logits processors
their ``create_logits_processor`` builds (``scheduler/logit_processor_3dim.py``:
``MultiTokensVLLogitsProcessor``, ``MultiTokensInterleavedTopKLogitsWarper``), as their
``test_lumina_mgpt.py`` -> ``inference_solver.generate`` does, without the text tokenizer and the VQGAN.

* **Weights.** Our tiny Lumina (``coolsd.models.lumina_mgpt.ChameleonLM``, Chameleon's key names) loads
  strictly into their class. Their code hard-codes the real Chameleon vocabulary: image tokens are ids
  4..8195 (every other id is suppressed inside an image) and a size token's grid count is ``id - 8804``. So
  the tiny model gets Chameleon's 8,192 codes (``model.random_init.num_codes=8192``: image tokens at ids
  4..8195 in shuffled code order, ``<eoss>`` / ``<racm3:break>`` at 8196 / 8197 as in the real vocabulary),
  and on their side the size tokens move to ``8804 + units`` (embedding and head rows; ids no token of ours
  uses get zero rows, which their processor masks inside images). Their qk-LayerNorm keeps one row per
  model-parallel shard (``ChameleonLayerNorm``); ``model_parallel_size`` = heads makes that one row per
  head, which needs as many key/value heads as heads (``model.random_init.num_key_value_heads=4``).
* **Conditioning.** Our prompt ids (BOS, template, end of turn, ``<racm3:break>``, the two size tokens) are
  their input ids, so the header is forced as ours is (``model.header=forced``) and their window starts right
  after it (``jacobi_loop_interval_l=0``). The unconditional stream is ours too: their
  ``_init_doubled_attn_mask_cfg`` option takes a two-row attention mask, whose second row (the CFG half)
  sees only the header, at positions 0..2 (by default theirs masks all but the last prompt token).
* **Settings.** Our cfg_scale, image top-k (``model.sampling.top_k``; 2000, their demos' ``image_top_k``),
  temperature, window ``W = draft_len + 1`` (16, their ``max_num_new_tokens``), init ``random``, and
  ``jacobi_loop_interval_r`` = the grid's tokens (end-of-row tokens included): every grid token is decoded
  in the window, as ours does (their demo decodes the last ~10 tokens of a 768 px image plainly, half of a
  4x4 grid). Seeding: ``torch.manual_seed(seed)`` and their model's ``seed`` attribute (their demo's).
* **Measured.** A stopping criterion given to ``generate`` ends their loop once the last image code is
  committed, as ours ends (theirs would go on to the last end-of-row token, ``<eoss>`` and the end of turn);
  ``seconds`` runs from their ``generate`` call (its setup included) to that commit. Forwards are counted by a pre-hook
  on their model (one per batched CFG pair, the prefill included); ``tokens`` counts the image codes, as
  our ``DecodeStats.num_tokens`` does (16 on the 4x4 grid; end-of-row tokens count on neither side).
* **Model.** Weights drawn at ``model.random_init.init_std=0.06``: at the tiny model's default 0.2 the
  distributions are so peaked and so unstable that SJD accepts almost nothing (tau ~1.05 on both sides),
  which tests little; at 0.06 tau is ~2.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec

#: Chameleon's real layout, as their logits processor hard-codes it (scheduler/logit_processor_3dim.py)
FIRST_IMAGE_ID, LAST_IMAGE_ID, SIZE_TOKEN_BASE = 4, 8195, 8804
#: the end of turn their ``inference_solver.generate`` stops at (never reached: the grid criterion stops)
END_OF_TURN_ID = 8710

#: every Lumina-mGPT-based peer's tiny model (eval/bench/peers/scd.py LUMINA_NOTES says why each is needed)
LUMINA_OVERRIDES = (
    "model.batch_invariant=false",
    "model.random_init.num_codes=8192",
    "model.random_init.num_key_value_heads=4",
    "model.sampling.top_k=2000",
)
#: SJD and GSD also draw smaller weights (at init_std 0.2 tau is ~1.05 and GSD's fixed threshold groups nothing)
MODEL_OVERRIDES = (*LUMINA_OVERRIDES, "model.random_init.init_std=0.06")

#: the loops' one difference on purpose (the table's "difference" column)
EOR_SLOTS = ("their window counts end-of-row tokens as slots (a fresh random draft there is always rejected "
             "and the forced end-of-row token committed in its place); ours drafts image codes only and "
             "inserts each end-of-row token for free")

SPEC = PeerSpec(
    name="sjd",
    repo="tyshiwo1/Accelerating-T2I-AR-with-SJD",
    commit="b389cfb2b6aa228efab32190f98bc13c3fd4b8e6",
    model="lumina_tiny",
    model_overrides=MODEL_OVERRIDES,
    pairs=(
        Pair(
            ours="sjd",
            theirs="sjd",
            overrides=("decoder.drafter.init=random", "decoder.draft_len=15"),
            difference=EOR_SLOTS,
        ),
    ),
    patches=("cuda_sync", "cuda_event"),
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),
    cpu="",
    notes=(
        "Their Lumina-mGPT path: vendored ChameleonForConditionalGeneration + renew_sampler/renew_backbone "
        "(scheduler/jacobi_iteration_lumina_mgpt.py) + their two multi-token logits processors, through "
        "transformers 4.47.1 generate, with our prompt ids (header included) and our unconditional stream "
        "(their _init_doubled_attn_mask_cfg option).",
        "Tiny Lumina with Chameleon's 8,192 codes (model.random_init.num_codes=8192; their processor "
        "hard-codes image ids 4..8195), 4 key/value heads (their qk-norm is per model-parallel shard), image "
        "top-k 2000 (their demos' image_top_k), weights drawn at init_std=0.06 (at 0.2 tau is ~1.05 on both "
        "sides); their side maps our size tokens to ids 8804 + units.",
        "Their window covers the whole grid (jacobi_loop_interval_l=0 after our forced header, "
        "jacobi_loop_interval_r = grid tokens); their demo decodes the last ~10 tokens of a 768 px image "
        "plainly.",
        "Timed over their whole generate call (its setup included) to the commit of the last image code (a "
        "stopping criterion; their "
        "loop would go on to <eoss> and the end of turn); their _sample's own CUDA-event timing is patched "
        "(cuda_event) and its torch.cuda.synchronize() calls (cuda_sync). Their logits processors are built "
        "once (their demo builds them per image, a slow Python loop over the vocabulary), untimed.",
        "tokens = image codes (16), as our DecodeStats.num_tokens; end-of-row tokens count on neither side.",
        "Ours runs with model.batch_invariant=false (the default CPU kernels, as theirs); both in float32 "
        "(their solver would autocast to bf16 on a GPU).",
    ),
)

#: top-level module names of their repositories that this glue imports (purged between checkouts)
#: the top-level module names a Lumina-mGPT-based checkout brings (forgotten before another checkout's import)
_THEIR_PACKAGES = ("scheduler", "model", "data", "xllmx", "lumina_mgpt")


# -- our process ---------------------------------------------------------------------------------------------
def export(ours: Any, pair: Pair) -> dict:
    """Our tiny Lumina's weights under their vocabulary layout, its sizes, ids and sampling settings."""
    from coolsd.models.lumina_mgpt import size_token

    model = ours.model
    voc = model.vocabulary
    codes = [int(b) for b in voc.code_to_bpe.tolist()]
    if sorted(codes) != list(range(FIRST_IMAGE_ID, LAST_IMAGE_ID + 1)):
        raise ValueError("their logits processor takes ids 4..8195 as the image tokens: the tiny model "
                         "needs Chameleon's 8,192 codes at those ids (model.random_init.num_codes=8192)")
    if model.header != "forced":
        raise ValueError("their loop gets our header as input: set model.header=forced")
    remap = {voc.token_id(size_token(u)): SIZE_TOKEN_BASE + u for u in set(model.size_units)}
    cfg = model.lm.config
    ours_vocab = int(cfg.vocab_size)
    if min(remap.values()) < ours_vocab:
        raise ValueError(f"our vocabulary ({ours_vocab} ids) reaches Chameleon's size-token ids "
                         "(8804 + units)")
    vocab_size = max(ours_vocab, max(remap.values()) + 1)
    index = torch.arange(ours_vocab)
    for a, b in remap.items():
        index[a] = b
    state = {}
    for key, value in model.lm.state_dict().items():
        value = value.detach().cpu().float().clone()
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = torch.zeros(vocab_size, value.shape[1])
            rows[index] = value
            value = rows
        state[key] = value
    names = {name: int(index[i]) if i < ours_vocab else i for name, i in model.tokenizer.get_vocab().items()}
    sampling = model.sampling
    decoder_window = int(ours.draft_len) + 1
    return {
        "state": state,
        "config": {
            "vocab_size": vocab_size,
            "hidden_size": int(cfg.hidden_size),
            "intermediate_size": int(cfg.intermediate_size),
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "num_attention_heads": int(cfg.num_attention_heads),
            "num_key_value_heads": int(cfg.num_key_value_heads),
            "max_position_embeddings": int(cfg.max_position_embeddings),
            "rms_norm_eps": float(cfg.rms_norm_eps),
            "rope_theta": float(_rope_theta(cfg)),
            "swin_norm": bool(cfg.swin_norm),
        },
        "vocabulary_map": names,
        "image_ids": sorted(codes),
        "code_of_id": {b: c for c, b in enumerate(codes)},
        "image_start": voc.image_start,
        "image_end": voc.image_end,
        "end_of_row": voc.end_of_row,
        "grid": tuple(int(g) for g in model.grid),
        "cfg_scale": float(sampling.cfg_scale),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k or 0),
        "text_top_k": int(model.text_top_k),
        "window": decoder_window,
        "remap": remap,
    }


def _rope_theta(cfg: Any) -> float:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def inputs(ours: Any, prompt: str) -> dict:
    """Our conditional prefix (prompt + header) and the length of the unconditional one (the header)."""
    model = ours.model
    return {"ids": list(model.prompt_ids(prompt)), "uncond": len(model.image_header())}


# -- the worker ----------------------------------------------------------------------------------------------
def import_from(checkout: Path) -> None:
    """Put ``checkout`` (and its ``lumina_mgpt``) first on the path, forgetting another checkout's modules."""
    for name in list(sys.modules):
        if name.split(".")[0] in _THEIR_PACKAGES:
            del sys.modules[name]
    for path in (str(checkout / "lumina_mgpt"), str(checkout)):
        while path in sys.path:
            sys.path.remove(path)
    sys.path.insert(0, str(checkout / "lumina_mgpt"))
    sys.path.insert(0, str(checkout))


def grid_stopwatch(net: Any, criteria: type, grid_len: int) -> tuple[dict[str, Any], type]:
    """Their target's forwards, counted by a pre-hook on ``net``, and a ``StoppingCriteria`` subclass (their
    transformers' ``criteria``) that ends their ``generate`` once ``grid_len`` tokens follow the prompt
    (``clock["prefix"]`` long) and notes the time in ``clock["end"]``; the caller sets ``forwards``, ``start``,
    ``end`` and ``prefix`` per image."""
    clock: dict[str, Any] = {"forwards": 0, "start": None, "end": None, "prefix": 0}

    def count(*_: Any) -> None:
        clock["forwards"] += 1

    net.register_forward_pre_hook(count)

    class GridDone(criteria):
        """Stop once the last grid token to time is committed (and note when)."""

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            done = input_ids.shape[1] >= clock["prefix"] + grid_len
            if done and clock["end"] is None:
                clock["end"] = time.perf_counter()
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return clock, GridDone


def build_lumina(checkout: Path, payload: dict, scheduler: str) -> Callable[[dict, int], PeerImage]:
    """Their Lumina-mGPT Jacobi sampler (module ``scheduler``) on our weights; returns the per-image call."""
    import_from(checkout)
    import importlib

    from transformers import GenerationConfig
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    from model.chameleon.configuration_chameleon import ChameleonConfig
    from model.chameleon.modeling_chameleon import ChameleonForConditionalGeneration

    jacobi = importlib.import_module(scheduler)
    processors = importlib.import_module("scheduler.logit_processor_3dim")

    c = payload["config"]
    heads = c["num_attention_heads"]
    if c["num_key_value_heads"] != heads:
        raise ValueError("their qk-norm keeps one row per model-parallel shard: the tiny model needs as many "
                         "key/value heads as heads (model.random_init.num_key_value_heads)")
    config = ChameleonConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"], max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"], swin_norm=c["swin_norm"],
        model_parallel_size=heads, mask_image_logits=False, vocabulary_map=payload["vocabulary_map"],
        vq_config={"embed_dim": 16, "num_embeddings": 64, "base_channels": 32, "latent_channels": 32,
                   "channel_multiplier": [1, 2], "num_res_blocks": 1},   # their ChameleonModel's; unused
    )
    net = ChameleonForConditionalGeneration(config)
    state = {k: v for k, v in net.state_dict().items() if k.startswith("model.vqmodel.")}
    state.update(payload["state"])
    net.load_state_dict(state, strict=True)
    net.eval()

    h, w = payload["grid"]
    grid_tokens = h * (w + 1)   # codes and end-of-row tokens
    net.__class__ = jacobi.renew_sampler(net.__class__)
    net.img_vocab = torch.tensor(payload["image_ids"], dtype=torch.long)   # their image-token list (sorted)
    net._init_new_params(
        jacobi_loop_interval_l=0, jacobi_loop_interval_r=grid_tokens, max_num_new_tokens=payload["window"],
        guidance_scale=payload["cfg_scale"], seed=None, multi_token_init_scheme="random", do_cfg=True,
        prefix_token_sampler_scheme="speculative_jacobi", use_chameleon_tokenizer=False,
        _init_doubled_attn_mask_cfg=True, image_top_k=payload["top_k"], text_top_k=payload["text_top_k"],
    )
    net.model.__class__ = jacobi.renew_backbone(net.model.__class__)
    # junhyukso/GSD's jacobi_iteration_lumina_mgpt_sjd.py (_sample, lines 1143-1146) binds
    # ``SpeculativeSampler`` only where the model has ``SpecSamplerClass`` (their "SpecSamplerSwap" hook),
    # which makes the name local there: without the attribute their SJD loop raises UnboundLocalError (so
    # does their test_SJD.py). The hook gets their module's own sampler, what the loop means to use; the
    # other loops never read it.
    net.SpecSamplerClass = jacobi.SpeculativeSampler

    image_top_k = payload["top_k"] or c["vocab_size"]
    generation_config = GenerationConfig(
        max_new_tokens=8192, max_length=c["max_position_embeddings"], temperature=payload["temperature"],
        top_k=None, do_sample=True, eos_token_id=[END_OF_TURN_ID],
    )
    clock, GridDone = grid_stopwatch(net, StoppingCriteria, grid_tokens - 1)   # the last code (as ours ends)

    code_of_id, remap = payload["code_of_id"], payload["remap"]
    template = _processors(processors, payload, c["vocab_size"], image_top_k)   # slow to build: once

    @torch.no_grad()
    def call(cond: dict, seed: int) -> PeerImage:
        ids = torch.tensor([[remap.get(i, i) for i in cond["ids"]]], dtype=torch.long)   # size tokens moved
        n = ids.shape[1]
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, : n - cond["uncond"]] = 0   # the CFG half sees its own context only (our unconditional one)
        logits_processor = _fresh(template)
        clock.update(forwards=0, start=None, end=None, prefix=n)
        torch.manual_seed(seed)
        net.seed = seed   # their demo's seeding (test_lumina_mgpt.py: inference_solver.model.seed = seed)
        clock["start"] = time.perf_counter()   # their whole decode call is timed (setup included)
        out = net.generate(ids, generation_config, logits_processor=logits_processor,
                           stopping_criteria=StoppingCriteriaList([GridDone()]), attention_mask=mask)
        if clock["end"] is None:
            raise RuntimeError("their loop ended before the last grid token")
        committed = out[0, n: n + grid_tokens]
        if committed.numel() == grid_tokens - 1:   # stopped at the last code, before its end-of-row token
            committed = torch.cat([committed, committed.new_tensor([payload["end_of_row"]])])
        grid = committed.view(h, w + 1)
        if not bool((grid[:, w] == payload["end_of_row"]).all()):
            raise RuntimeError(f"their loop committed {grid[:, w].tolist()} where the end-of-row tokens "
                               "go")
        codes = tuple(code_of_id[int(t)] for t in grid[:, :w].flatten().tolist())
        return PeerImage(seconds=clock["end"] - clock["start"], tokens=h * w,
                         target_forwards=clock["forwards"], codes=codes)

    call.model = call.target = net   # their model: for checks, and the anatomy pass times its forwards
    return call


def _processors(module: Any, payload: dict, vocab_size: int, image_top_k: int) -> Any:
    """The list their ``JacobiPipeline.create_logits_processor`` builds, with our ids."""
    from transformers.generation.logits_process import LogitsProcessorList

    return LogitsProcessorList([
        module.MultiTokensVLLogitsProcessor(
            image_start_token_id=payload["image_start"], image_end_token_id=payload["image_end"],
            image_next_line_token_id=payload["end_of_row"], patch_size=32, voc_size=vocab_size, device="cpu"),
        module.MultiTokensInterleavedTopKLogitsWarper(
            image_top_k=image_top_k, text_top_k=payload["text_top_k"],
            image_start_token_id=payload["image_start"], image_end_token_id=payload["image_end"]),
    ])


def _fresh(template: Any) -> Any:
    """Copies of their processors in the state their constructors leave (they keep per-image state)."""
    import copy

    from transformers.generation.logits_process import LogitsProcessorList

    out = LogitsProcessorList()
    for proc in template:
        proc = copy.copy(proc)
        for attr in ("image_start_token_id_index", "h_latent_dim", "w_latent_dim", "num_image_start_tokens",
                     "num_image_end_tokens"):
            if hasattr(proc, attr):
                setattr(proc, attr, None)
        out.append(proc)
    return out


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    if pair.theirs != "sjd":
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    return build_lumina(checkout, payload, "scheduler.jacobi_iteration_lumina_mgpt")
