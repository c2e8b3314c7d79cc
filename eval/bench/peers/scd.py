"""Peer glue: SCD, speculative coupled decoding (So, Kook, Jang & Park, arXiv 2510.24211, ICML 2026; v1 "MC-SJD"),
as published in ``junhyukso/SCD``, on Lumina-mGPT: maximal coupling (``scd_mc``) and Gumbel sharing (``scd_gs``).

Their side is their Lumina-mGPT path (``lumina1/``): their vendored Chameleon
(``lumina_mgpt/model/chameleon/modeling_chameleon.py`` ``ChameleonForConditionalGeneration``, the class their
``inference_solver.py`` loads; ``ChameleonXLLMXForConditionalGeneration`` only adds a training forward) made into
their Jacobi sampler by their ``renew_pipeline_sampler`` (``scheduler/jacobi_iteration_lumina_mgpt_SCDMC.py`` for
``scd_mc``, ``..._GS.py`` for ``scd_gs``: pipeline, sampler and backbone classes, ``_init_new_params``) and driven
through transformers' ``generate`` with the logits processors of their pipeline's ``create_logits_processor``
(``scheduler/logit_processor_3dim.py``), as ``test_SCD_MC.py`` / ``test_SCD_GS.py`` -> ``inference_solver.generate``
do, without the text tokenizer and the VQGAN. ``FlexARInferenceSolver`` itself is not built (its ``__init__``
downloads the 7B checkpoint and reads Meta's tokenizer; importing it needs ``sentencepiece``): a stand-in object
with the model and an item processor answering ``token2id`` for the three token names it asks for takes its place
in ``renew_pipeline_sampler``.

* **Weights.** Our tiny Lumina (``coolsd.models.lumina_mgpt.ChameleonLM``, transformers' Chameleon key names) is
  loaded strictly into their class. Their code hard-codes Chameleon's vocabulary layout: image tokens are ids
  4..8195 (everything else is suppressed inside an image) and a size token's grid count is ``id - 8804``. So the
  tiny model gets Chameleon's 8,192 codes (``model.random_init.num_codes=8192``: its image tokens are ids 4..8195
  in shuffled code order, ``<eoss>`` / ``<racm3:break>`` are 8196 / 8197 as in the real vocabulary) and on their
  side the size tokens move to ``8804 + units`` (embedding and head rows; ids no token of ours uses get zero rows,
  which their processor masks inside an image). Their qk-LayerNorm keeps one row per model-parallel shard; with
  ``model_parallel_size`` = heads that is one row per head, which needs as many key/value heads as heads
  (``model.random_init.num_key_value_heads=4``). Their image-token list (``img_vocab``) is computed by their own
  ``model.chameleon_vae_ori.VocabInfo`` from our vocabulary (their code reads it from Meta's
  ``text_tokenizer.json``; ``use_chameleon_tokenizer=False`` keeps the one set here).
* **Conditioning.** Our prompt ids (BOS, template, end of turn, ``<racm3:break>``, the two size tokens) are their
  input ids, so the header is forced as ours (``model.header=forced``) and their window starts right after it
  (``jacobi_loop_interval_l=0``; their demos use 3 because their model samples the header). The unconditional
  stream is ours: their ``_init_doubled_attn_mask_cfg`` option takes a two-row attention mask whose second row
  (the CFG half) sees only the header, at positions 0..2 (by default theirs masks all but the last prompt token).
* **Settings.** Our cfg_scale, image top-k (``model.sampling.top_k=2000``, their demos' ``image_top_k``),
  temperature, window ``W = draft_len + 1`` (32: their demos' ``max_num_new_tokens``), fresh drafts ``random``
  (their demos' ``multi_token_init_scheme``), ``prefix_token_sampler_scheme='speculative_jacobi'``, and
  ``jacobi_loop_interval_r`` = the grid's tokens up to the last code: every grid token is decoded in the window as
  ours does (their demos decode the last ~10 tokens of a 768 px image plainly, which on a 4x4 grid would be half
  of it). Seeding: ``torch.manual_seed(seed)`` and their model's ``seed`` attribute (their demos' seeding:
  ``inference_solver.model.seed = seed``).
* **Measured.** A stopping criterion passed to ``generate`` ends their loop once the last image code is committed
  (their loop would go on to the last end-of-row token, ``<eoss>`` and the end of turn); ``seconds`` runs from their
  ``generate`` call (its setup included) to that commit. Forwards are counted with a pre-hook on their model (one per
  batched CFG pair, the prefill included); ``tokens`` counts the image codes, as our ``DecodeStats.num_tokens``
  does (16 on the 4x4 grid); the end-of-row tokens their window commits count on neither side.

The Lumina helpers here (``export_lumina``, ``lumina_inputs``, ``build_lumina``) also serve
``eval.bench.peers.sjd_pac``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from eval.bench.peers.contract import Pair, PeerImage, PeerSpec
from eval.bench.peers.sjd import END_OF_TURN_ID, EOR_SLOTS, LUMINA_OVERRIDES

#: Chameleon's layout as their logits processor hard-codes it (scheduler/logit_processor_3dim.py)
FIRST_IMAGE_ID, LAST_IMAGE_ID, SIZE_TOKEN_BASE = 4, 8195, 8804
#: the end of turn their ``inference_solver.generate`` stops at (never reached: the grid criterion stops first)
#: the token names their ``create_logits_processor`` asks the item processor for (lumina_mgpt/data/item_processor.py)
ITEM_TOKENS = {"image_start_token": "<racm3:break>", "image_end_token": "<eoss>", "new_line_token": "<reserved08799>"}

LUMINA_NOTES = (
    "Tiny Lumina with Chameleon's 8,192 codes (model.random_init.num_codes=8192: their logits processor hard-codes "
    "image ids 4..8195), 4 key/value heads (their qk-norm is per model-parallel shard), image top-k 2000 (their "
    "demos' image_top_k), the header forced; their side maps our size tokens to ids 8804 + units.",
    "Their side: their vendored ChameleonForConditionalGeneration (the class their inference_solver.py loads) with "
    "our weights, made into their sampler by their renew_pipeline_sampler on a stand-in for FlexARInferenceSolver "
    "(whose __init__ loads the 7B checkpoint and Meta's tokenizer), their create_logits_processor, transformers "
    "4.47.1 generate; our prompt ids (header included) and our unconditional stream (their "
    "_init_doubled_attn_mask_cfg option with a two-row attention mask).",
    "Timed over their whole generate call (its setup included) to the commit of the last image code (a stopping "
    "criterion; their loop would "
    "go on to <eoss> and the end of turn); their _sample's CUDA-event timer is patched (cuda_event), as are its "
    "torch.cuda.synchronize() calls (cuda_sync).",
    "tokens = image codes (16 on the 4x4 grid), as our DecodeStats.num_tokens; the end-of-row tokens their window "
    "commits count on neither side.",
    "Ours runs with model.batch_invariant=false (the default CPU kernels, as theirs); both sides in float32 (their "
    "solver autocasts to bf16 on a GPU).",
)

SPEC = PeerSpec(
    name="scd",
    repo="junhyukso/SCD",
    commit="7322379df906785094bd35aa2006791ba9acc8b0",
    model="lumina_tiny",
    model_overrides=LUMINA_OVERRIDES,
    pairs=(
        Pair(
            ours="scd_mc",
            theirs="scd_mc",
            overrides=("decoder.draft_len=31", "decoder.drafter.init=random",
                       "decoder.drafter.carried_q=reference_code"),
            difference=EOR_SLOTS,
        ),
        Pair(
            ours="scd_gs",
            theirs="scd_gs",
            overrides=("decoder.draft_len=31", "decoder.drafter.init=random"),
            difference=("their Gumbel table has one row per window slot and shifts only after Jacobi "
                        "iterations, so the prefill's token and the first window's first draft share a noise row "
                        "(not exact, baselines/jacobi.py); ours keys the noise by absolute image position. Their "
                        "window counts end-of-row tokens as slots (a fresh draft there is always rejected); ours "
                        "inserts them for free"),
        ),
    ),
    patches=("factory_cuda", "cuda_sync", "cuda_event"),
    requirements=("transformers==4.47.1", "absl-py==2.5.1"),
    cpu="",
    notes=(
        "scd_mc: ours runs decoder.drafter.carried_q=reference_code, their published reading (a carried draft "
        "kept by the coupling keeps its old q; the paper's exact q is p_t); window 32 = their demos' "
        "max_num_new_tokens (the paper's tables use 64).",
        "Their window covers the whole grid (jacobi_loop_interval_l=0 after our forced header, "
        "jacobi_loop_interval_r = grid tokens up to the last code); their demos decode the last ~10 tokens of a "
        "768 px image plainly. Their model's __init__ places five token-id tensors on 'cuda' "
        "(lumina_mgpt/model/chameleon/modeling_chameleon.py:1481-1485, unused by this path): factory_cuda.",
        *LUMINA_NOTES,
    ),
)

#: top-level module names of their repositories that the glue imports (forgotten between checkouts)
_SCHEDULERS = {"scd_mc": "scheduler.jacobi_iteration_lumina_mgpt_SCDMC",
               "scd_gs": "scheduler.jacobi_iteration_lumina_mgpt_GS"}


# -- our process ---------------------------------------------------------------------------------------------
def export_lumina(ours: Any) -> dict:
    """Our tiny Lumina's weights under their vocabulary layout, its sizes, ids and sampling settings."""
    from coolsd.models.lumina_mgpt import size_token

    model = ours.model
    voc = model.vocabulary
    codes = [int(b) for b in voc.code_to_bpe.tolist()]
    if sorted(codes) != list(range(FIRST_IMAGE_ID, LAST_IMAGE_ID + 1)):
        raise ValueError("their logits processor takes ids 4..8195 as the image tokens: the tiny model needs "
                         "Chameleon's 8,192 codes at those ids (model.random_init.num_codes=8192)")
    if (voc.image_end, voc.image_start) != (LAST_IMAGE_ID + 1, LAST_IMAGE_ID + 2):
        raise ValueError("<eoss> / <racm3:break> must be ids 8196 / 8197, as in Chameleon's vocabulary")
    if model.header != "forced":
        raise ValueError("their loop gets our header as input: set model.header=forced")
    sampling = model.sampling
    if sampling.top_p != 1.0:
        raise ValueError("their Lumina path has no top-p: set model.sampling.top_p=1.0")
    if not sampling.temperature > 0:
        raise ValueError("their loop samples (do_sample=True): model.sampling.temperature must be > 0")
    cfg = model.lm.config
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError("their qk-norm keeps one row per model-parallel shard: the tiny model needs as many "
                         "key/value heads as heads (model.random_init.num_key_value_heads)")
    remap = {voc.token_id(size_token(u)): SIZE_TOKEN_BASE + u for u in set(model.size_units)}
    ours_vocab = int(cfg.vocab_size)
    if min(remap.values()) < ours_vocab:
        raise ValueError(f"our vocabulary ({ours_vocab} ids) reaches Chameleon's size-token ids (8804 + units)")
    vocab_size = max(ours_vocab, max(remap.values()) + 1)
    index = torch.arange(ours_vocab)
    for a, b in remap.items():
        index[a] = b
    state = {}
    for key, value in model.lm.state_dict().items():
        value = value.detach().to("cpu", torch.float32).contiguous().clone()   # row-major (batch_invariant off)
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = torch.zeros(vocab_size, value.shape[1])
            rows[index] = value
            value = rows
        state[key] = value
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    names = {name: int(index[i]) for name, i in model.tokenizer.get_vocab().items()}
    return {
        "state": state,
        "config": {
            "vocab_size": vocab_size, "hidden_size": int(cfg.hidden_size),
            "intermediate_size": int(cfg.intermediate_size), "num_hidden_layers": int(cfg.num_hidden_layers),
            "num_attention_heads": int(cfg.num_attention_heads), "num_key_value_heads": int(cfg.num_key_value_heads),
            "max_position_embeddings": int(cfg.max_position_embeddings), "rms_norm_eps": float(cfg.rms_norm_eps),
            "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            "swin_norm": bool(cfg.swin_norm),
        },
        "vocabulary_map": names,
        "code_of_id": {b: c for c, b in enumerate(codes)},
        "end_of_row": voc.end_of_row,
        "grid": tuple(int(g) for g in model.grid),
        "cfg_scale": float(sampling.cfg_scale),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k or 0),
        "text_top_k": int(model.text_top_k),
        "window": int(ours.draft_len) + 1,
    }


def lumina_inputs(ours: Any, prompt: str) -> dict:
    """Our conditional prefix (prompt + header; size tokens at their ids) and the unconditional one's length."""
    from coolsd.models.lumina_mgpt import size_token

    model = ours.model
    remap = {model.vocabulary.token_id(size_token(u)): SIZE_TOKEN_BASE + u for u in set(model.size_units)}
    return {"ids": [remap.get(i, i) for i in model.prompt_ids(prompt)], "uncond": len(model.image_header())}


def export(ours: Any, pair: Pair) -> dict:
    drafter = ours.drafter
    want = {"scd_mc": "maximal", "scd_gs": "gumbel"}.get(pair.theirs)
    if want is None:
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    if getattr(drafter, "carry", None) != want or getattr(drafter, "init", None) != "random":
        raise ValueError(f"{pair.theirs}: our decoder must run carry={want}, init=random (their demos' 'random')")
    return export_lumina(ours)


def inputs(ours: Any, prompt: str) -> dict:
    return lumina_inputs(ours, prompt)


# -- the worker ----------------------------------------------------------------------------------------------
class _ItemProcessor:
    """Answers what their ``create_logits_processor`` asks ``FlexARItemProcessor`` (three names, ``token2id``)."""

    image_start_token = ITEM_TOKENS["image_start_token"]
    image_end_token = ITEM_TOKENS["image_end_token"]
    new_line_token = ITEM_TOKENS["new_line_token"]

    def __init__(self, vocab: dict) -> None:
        self.vocab = vocab

    def token2id(self, token: str) -> int:
        return self.vocab[token]


class _Solver:
    """Stands in for their ``FlexARInferenceSolver`` in ``renew_pipeline_sampler`` (model, item processor, device)."""

    def __init__(self, model: Any, vocab: dict) -> None:
        self.model = model
        self.item_processor = _ItemProcessor(vocab)
        self.device = "cpu"
        self.dtype = torch.float32


def their_chameleon(payload: dict) -> Any:
    """Their vendored ``ChameleonForConditionalGeneration`` (import path set by
    ``eval.bench.peers.sjd.import_from``) with our weights."""
    from model.chameleon.configuration_chameleon import ChameleonConfig
    from model.chameleon.modeling_chameleon import ChameleonForConditionalGeneration

    c = payload["config"]
    heads = c["num_attention_heads"]
    config = ChameleonConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"], max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"], swin_norm=c["swin_norm"],
        model_parallel_size=heads, mask_image_logits=False, tie_word_embeddings=False,
        vocabulary_map=payload["vocabulary_map"], attn_implementation="sdpa",
        vq_config={"embed_dim": 16, "num_embeddings": 64, "base_channels": 32, "latent_channels": 32,
                   "channel_multiplier": [1, 2], "num_res_blocks": 1},   # their ChameleonModel builds one; unused
    )
    net = ChameleonForConditionalGeneration(config)
    state = {k: v for k, v in net.state_dict().items() if k.startswith("model.vqmodel.")}
    state.update(payload["state"])
    net.load_state_dict(state, strict=True)
    return net.float().eval()


def their_image_tokens(vocab: dict) -> torch.Tensor:
    """The image-token ids their ``_init_new_params`` reads from ``text_tokenizer.json``, by their ``VocabInfo``."""
    import model.chameleon_vae_ori as chameleon_vae_ori

    info = chameleon_vae_ori.VocabInfo(vocab)
    return torch.tensor(chameleon_vae_ori.VocabTranslation(info)._vocab.image_tokens, dtype=torch.long)


def build_lumina(root: Path, payload: dict, scheduler: str, options: dict, processor_options: dict | None = None,
                 generation_options: dict | None = None) -> Callable[[dict, int], PeerImage]:
    """Their Lumina-mGPT sampler (module ``scheduler`` under ``root``, ``renew_pipeline_sampler(**options)``) on
    our weights; returns the per-image call (conditioning from ``lumina_inputs``, seed) -> ``PeerImage``.
    ``processor_options`` go to their ``create_logits_processor``, ``generation_options`` into the
    ``GenerationConfig`` (a fork's extra settings, e.g. ``eval.bench.peers.pathrelax``'s static tree)."""
    import copy
    import importlib

    from eval.bench.peers.sjd import import_from

    import_from(root)
    from transformers import GenerationConfig
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    jacobi = importlib.import_module(scheduler)
    c = payload["config"]
    h, w = payload["grid"]
    grid_len = h * (w + 1) - 1   # the sequence tokens up to the last code (end-of-row tokens included)
    image_top_k = payload["top_k"] or c["vocab_size"]
    net = their_chameleon(payload)
    net.img_vocab = their_image_tokens(payload["vocabulary_map"])
    solver = jacobi.renew_pipeline_sampler(
        _Solver(net, payload["vocabulary_map"]), max_num_new_tokens=payload["window"],
        guidance_scale=payload["cfg_scale"], seed=None, do_cfg=True, image_top_k=image_top_k,
        text_top_k=payload["text_top_k"], use_chameleon_tokenizer=False, _init_doubled_attn_mask_cfg=True,
        **options)
    template = solver.create_logits_processor(cfg=payload["cfg_scale"], image_top_k=image_top_k,
                                              text_top_k=payload["text_top_k"],
                                              **(processor_options or {}))   # slow to build: once
    generation_config = GenerationConfig(
        max_new_tokens=grid_len + 2 * payload["window"] + 8, temperature=payload["temperature"], top_k=None,
        do_sample=True, eos_token_id=[END_OF_TURN_ID], **(generation_options or {}),
    )   # inference_solver.generate's config; the grid criterion below stops first
    from eval.bench.peers.sjd import grid_stopwatch

    clock, GridDone = grid_stopwatch(net, StoppingCriteria, grid_len)   # to the last image code

    code_of_id = payload["code_of_id"]
    end_of_row = payload["end_of_row"]

    @torch.no_grad()
    def call(cond: dict, seed: int) -> PeerImage:
        ids = torch.tensor([cond["ids"]], dtype=torch.long)
        n = ids.shape[1]
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, : n - cond["uncond"]] = 0   # the CFG half sees only the header (our unconditional stream)
        logits_processor = copy.deepcopy(template)   # their processors keep per-image state (test: one per image)
        clock.update(forwards=0, start=None, end=None, prefix=n)
        torch.manual_seed(seed)
        net.seed = seed   # their demos' seeding (inference_solver.model.seed = seed)
        net.prompt_len = n   # as inference_solver.generate sets it
        clock["start"] = time.perf_counter()   # their whole decode call is timed (setup included)
        out = net.generate(ids, generation_config, logits_processor=logits_processor,
                           stopping_criteria=StoppingCriteriaList([GridDone()]), attention_mask=mask)
        if clock["end"] is None:
            raise RuntimeError("their loop ended before the last image code")
        seq = torch.cat([out[0, n: n + grid_len], torch.tensor([end_of_row])])   # + the last row's end
        grid = seq.view(h, w + 1)
        if not bool((grid[:, w] == end_of_row).all()):
            raise RuntimeError(f"their loop committed {grid[:, w].tolist()} where the end-of-row tokens go")
        codes = tuple(code_of_id[int(t)] for t in grid[:, :w].flatten().tolist())
        return PeerImage(seconds=clock["end"] - clock["start"], tokens=h * w, target_forwards=clock["forwards"],
                         codes=codes)

    call.clock = clock   # forwards of the image under way (eval.bench.peers.sjd_pac reads it after a failure)
    call.target = net   # their model: the anatomy pass times its forwards
    return call


def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[dict, int], PeerImage]:
    if pair.theirs not in _SCHEDULERS:
        raise ValueError(f"{SPEC.name} has no method {pair.theirs!r}")
    h, w = payload["grid"]
    options = {"jacobi_loop_interval_l": 0, "jacobi_loop_interval_r": h * (w + 1) - 1,
               "multi_token_init_scheme": "random", "prefix_token_sampler_scheme": "speculative_jacobi"}
    return build_lumina(Path(checkout) / "lumina1", payload, _SCHEDULERS[pair.theirs], options)
