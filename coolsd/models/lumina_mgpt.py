"""Lumina-mGPT (Liu et al., 2024, arXiv 2408.02657), a Chameleon-7B text-to-image fine-tune, as an adapter.

The target is ``transformers``' Chameleon decoder (``ChameleonDecoderLayer``: qk-LayerNorm per head, 1-D RoPE,
SwiGLU; parameter names equal Lumina-mGPT's released safetensors: ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``). Its stock forward masks every
image-token logit, so this adapter runs the layers itself, with the project's static KV cache, and applies
``lm_head`` to the image-code rows only.

What the adapter hides from the decoders (they see a 48 x 48 grid of codebook ids at 768 px):

* **Vocabulary.** Image tokens are the BPE entries named ``IMGIMG<digits as letters A..J>Z``; the map between
  BPE ids and VQ codes is read from the vocabulary (Meta's ``text_tokenizer.json``), never assumed to be an
  offset (it happens to be ``code + 4`` in the released vocabulary).
* **Prompt.** ``[<s>] + "Generate an image of {W}x{H} according to the following prompt:\\n{prompt}"`` +
  ``<reserved08706>`` (Lumina's one-turn ``Conversation`` template; the assistant turn is open), then the
  image header ``<racm3:break>``, ``<reserved{8800 + H/32}>``, ``<reserved{8800 + W/32}>``.
* **Header** (``model.header``). ``sampled`` (default; the reference): the three header tokens are sampled
  from the conditional stream as ``inference_solver.py``'s logits processors leave them (``sample_header``:
  ``<racm3:break>`` in text mode, no CFG, text top-k ``model.text_top_k`` = 10; the size tokens without CFG
  or masks, image top-k; the decoder's random stream), and the grid is read from the size tokens sampled.
  The harness decodes one fixed grid per run, so a sampled header other than the configured one is handled
  by ``model.header_mismatch``: ``force`` (default) continues with the configured header, warns and records
  the prompt in ``header_mismatches``; ``error`` raises ``HeaderMismatchError``. ``forced``: the adapter
  writes the configured header (no draws).
* **Structural tokens.** After every row of image codes the end-of-row token ``<reserved08799>`` follows;
  the adapter inserts it into each forward block right after the last code of a row, so its K/V are in the
  cache before the next row starts, and the distribution the decoders see for the first code of the next
  row is the end-of-row token's output. The end of image (``<eoss>``, end of turn) is not needed for the
  grid and is never run. Structural tokens are never drafted, verified or relaxed.
* **CFG.** As Lumina's ``inference_solver.py`` (sequential mode): the unconditional stream's context starts
  at the image-start token (no text) and its positions start at 0 there; both streams run as one batch of
  2, the shorter unconditional prefix left-padded and masked. Guidance ``u + s(c - u)`` on image-code
  logits (the shared pipeline), 3.0 by default, with image top-k 2000 and temperature 1.0.
* **Decoding.** Meta's VQGAN decoder (``coolsd.models.chameleon_vqgan``), 16 pixels per code; pixels are
  truncated to uint8 as Meta's tokenizer does (``model.pixel_rounding=truncate``).
* **Other reference settings.** Guidance at any scale ≠ 1 (``sampling.cfg_rule=not_one``: the reference's
  CFG processor returns the conditional scores only at exactly 1.0); ``model.attention_kernel=auto`` and
  ``model.tf32=false`` (the reference's HF attention and PyTorch's TF32 defaults; their GPU effect was not
  measured). The reference samples under ``torch.cuda.amp.autocast(bf16)``; this adapter runs the bf16
  weights without autocast and does guidance and sampling in float32 (``coolsd.sampling``).

Cache addressing: decoders address the cache in image units (one slot per image token), the model holds an
extra slot after each row-end token. ``LuminaCache`` keeps the image-slot -> model-slot map and translates
``keep`` / ``rollback`` / tree masks (a tree node at a row end gets its end-of-row slot right after it in
the same block, visible to its descendants only). The static decode path (``decoder.path=static``) lays the same
blocks out on the device (``EndOfRowBlocks.static_forward`` over a ``RowEndKVCache``, from a map of the positions
that end a row built once per resolution; ``static_prefill`` pads every prompt to ``model.prompt_capacity``), and
both paths share the forward (``EndOfRowBlocks``, Emu3's too).

Weights: ``Alpha-VLLM/Lumina-mGPT-7B-768`` from the Hugging Face hub (downloaded on first use), and Meta's
Chameleon tokenizer files (``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt``) from a folder the user
downloaded under Meta's licence (``model.tokenizer_dir``). ``pretrained=false`` builds a random-weight model
of the sizes in ``random_init`` with a vocabulary and word-level tokenizer made in code (tests).

Written after Alpha-VLLM/Lumina-mGPT ``lumina_mgpt/inference_solver.py``, ``data/item_processor.py``,
``data/convertsation.py``, ``model/chameleon_vae_ori/vocab.py``, tyshiwo1/Accelerating-T2I-AR-with-SJD
``scheduler/logit_processor_3dim.py`` and jadohu/LANTERN ``models/drafters/cnets_lumina_mgpt.py``.

Anole (``coolsd.models.anole``) is this adapter with Anole's layout (a plain grid, one slot per image token), through
the hooks ``tokenizer_files``, ``image_header``, ``unconditional_ids`` and ``_eager_cache``.

Example: ``python run.py model=lumina_mgpt_768 decoder=coolsd model.tokenizer_dir=ckpts/chameleon/tokenizer``;
``python run.py model=lumina_tiny`` (random weights).
"""
from __future__ import annotations

import json
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ChameleonConfig, PreTrainedTokenizerFast
from transformers.models.chameleon.modeling_chameleon import (
    ChameleonDecoderLayer,
    ChameleonRMSNorm,
    ChameleonSwinDecoderLayer,
    apply_rotary_pos_emb,
)

from coolsd import validate
from coolsd.kv_cache import DeviceKVCache, StaticKVCache
from coolsd.models.base import (
    ImageARModel,
    Runtime,
    attention_context,
    layer_skipping,
    per_stream,
    stream_rows,
    to_rows,
)
from coolsd.models.chameleon_vqgan import ChameleonVQGAN, ChameleonVQGANConfig, load_vqgan
from coolsd.models.checkpoints import MissingWeightsError, hub_file, missing_together, strict_load
from coolsd.required_files import RequiredFile
from coolsd.rng import HEADER, Streams, sample
from coolsd.sampling import SamplingConfig, logits_to_probs
from coolsd.types import TargetOutput

BOS = "<s>"
IMAGE_START = "<racm3:break>"
IMAGE_END = "<eoss>"
END_OF_TURN = "<reserved08706>"  # Lumina's conversation separator
END_OF_ROW = "<reserved08799>"
IMAGE_NAME_PREFIX, IMAGE_NAME_SUFFIX = "IMGIMG", "Z"
PIXELS_PER_SIZE_UNIT = 32  # one unit of the size tokens = 32 px = 2 image codes
CODES_PER_SIZE_UNIT = 2
PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
TOKENIZER_FILES = ("text_tokenizer.json", "vqgan.yaml", "vqgan.ckpt")
LM_PATTERNS = ("config.json", "model.safetensors.index.json", "*.safetensors")  # what lumina_lm_files reads
HEADER_MODES = ("sampled", "forced")  # model.header
HEADER_MISMATCH = ("force", "error")  # model.header_mismatch
CHAMELEON_DOWNLOAD = ("Meta's Chameleon download (licence form at "
                      "https://ai.meta.com/resources/models-and-libraries/chameleon-downloads/; the emailed "
                      "link's download script fetches a `tokenizer` folder holding text_tokenizer.json, "
                      "vqgan.yaml and vqgan.ckpt)")
#: how to get Meta's tokenizer folder (``required_files``, the missing-file error)
TOKENIZER_HINT = (f"get the tokenizer folder from {CHAMELEON_DOWNLOAD}, then set model.tokenizer_dir=<folder> or "
                  "export CHAMELEON_TOKENIZER_DIR=<folder>")


class HeaderMismatchError(ValueError):
    """``header=sampled`` drew an image header other than the configured grid's (``header_mismatch=error``)."""


def size_token(units: int) -> str:
    """The size token of ``units`` x 32 pixels (Lumina's ``get_n_grids_token``)."""
    return f"<reserved{8800 + units:05d}>"


def image_token_name(code: int) -> str:
    """Chameleon's vocabulary name of VQ code ``code``: its decimal digits spelled with letters A..J."""
    return IMAGE_NAME_PREFIX + "".join(chr(ord("A") + int(d)) for d in str(code)) + IMAGE_NAME_SUFFIX


def parse_image_token(name: str) -> int | None:
    """The VQ code of an image-token name (``IMGIMGBCDZ`` -> 123), ``None`` for any other token."""
    if not (name.startswith(IMAGE_NAME_PREFIX) and name.endswith(IMAGE_NAME_SUFFIX)):
        return None
    letters = name[len(IMAGE_NAME_PREFIX): -len(IMAGE_NAME_SUFFIX)]
    if not letters or any(not "A" <= c <= "J" for c in letters):
        return None
    return int("".join(str(ord(c) - ord("A")) for c in letters))


def image_code_ids(vocab: Mapping[str, int]) -> torch.Tensor:
    """BPE id of every VQ code (V,), read from the image-token names of a Chameleon vocabulary."""
    codes = {}
    for name, bpe in vocab.items():
        code = parse_image_token(name)
        if code is not None:
            codes[code] = int(bpe)
    if not codes:
        raise ValueError("the vocabulary has no image tokens (names IMGIMG<A-J>Z); is it Chameleon's "
                         "text_tokenizer.json?")
    if sorted(codes) != list(range(len(codes))):
        raise ValueError(f"image-token codes are not 0..{len(codes) - 1}; the vocabulary is not "
                         "Chameleon's")
    return torch.tensor([codes[c] for c in range(len(codes))], dtype=torch.long)


class ChameleonVocabulary:
    """Image-code <-> BPE-id map and the structural token ids of a Chameleon vocabulary (name -> id)."""

    def __init__(self, vocab: Mapping[str, int]) -> None:
        self.vocab = dict(vocab)
        self.code_to_bpe = image_code_ids(self.vocab)  # (V,)
        self.codebook_size = int(self.code_to_bpe.numel())
        self.bos = self.token_id(BOS)
        self.image_start = self.token_id(IMAGE_START)
        self.image_end = self.token_id(IMAGE_END)
        self.end_of_turn = self.token_id(END_OF_TURN)
        self.end_of_row = self.token_id(END_OF_ROW)

    def token_id(self, name: str) -> int:
        if name not in self.vocab:
            raise ValueError(f"token {name!r} is missing from the Chameleon vocabulary")
        return int(self.vocab[name])

    def bpe_to_code(self, bpe: torch.Tensor) -> torch.Tensor:
        """BPE ids of image tokens -> VQ codes (raises on a non-image id)."""
        inverse = {int(b): c for c, b in enumerate(self.code_to_bpe.tolist())}
        try:
            codes = [inverse[int(b)] for b in bpe.flatten().tolist()]
        except KeyError as err:
            raise ValueError(f"bpe_to_code got id {err.args[0]}, which is not an image token") from err
        return torch.tensor(codes, device=bpe.device).view(bpe.shape)


# -- tiny vocabulary and tokenizer for random-weight models --------------------------------------------------
TINY_WORDS = ("Generate", "an", "image", "of", "according", "to", "the", "following", "prompt", ":", "a",
              "photo", "cat", "dog", "red", "blue", "sky", "tree")


def tiny_vocabulary(num_codes: int, size_units: Sequence[int], seed: int = 0, shuffle: bool = True,
                    words: Sequence[str] = TINY_WORDS) -> dict[str, int]:
    """A small Chameleon-style vocabulary: specials, ``num_codes`` image tokens, structural tokens, words.

    With ``shuffle`` the image tokens get ids 4.. in a seeded random order of codes, so nothing may rely on
    ``bpe = code + 4``. ``size_units`` lists the size tokens to include (e.g. the grid's height and width in
    units of 32 px); the ``WxH`` word of the prompt template is added for every pair of them.
    """
    names = ["<unk>", BOS, "</s>", "<pad>"]
    order = list(range(num_codes))
    if shuffle:
        random.Random(seed).shuffle(order)
    names += [image_token_name(c) for c in order]
    names += [IMAGE_END, IMAGE_START, END_OF_TURN, END_OF_ROW]
    units = sorted({int(u) for u in size_units})
    names += [size_token(u) for u in units]
    names += [f"{a * PIXELS_PER_SIZE_UNIT}x{b * PIXELS_PER_SIZE_UNIT}" for a in units for b in units]
    names += [w for w in words if w not in names]
    return {name: i for i, name in enumerate(names)}


def word_level_tokenizer(vocab: Mapping[str, int]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``vocab`` (unknown words -> ``<unk>``), for tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation runs
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=BOS)


# -- the Chameleon decoder stack ------------------------------------------------------------------------
class ChameleonStack(nn.Module):
    """Embedding, decoder layers and final norm under ``transformers``' ``ChameleonModel`` attribute names."""

    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        layer_cls = ChameleonSwinDecoderLayer if config.swin_norm else ChameleonDecoderLayer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = ChameleonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ChameleonLM(nn.Module):
    """``model`` (the stack) + ``lm_head``: the state-dict layout of ``ChameleonForConditionalGeneration``
    without the VQ encoder (``model.vqmodel``), which generation does not use."""

    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ChameleonStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for ``positions`` (B, T) -> cos, sin (B, T, head_dim), computed as transformers does."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_inv_freq(config: ChameleonConfig, head_dim: int) -> torch.Tensor:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Chameleon config has RoPE type {rope['rope_type']!r}; only the default RoPE is "
                         "supported")
    base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def chameleon_block(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache: StaticKVCache | None, index: int, mask: torch.Tensor | None,
                    swin: bool) -> torch.Tensor:
    """One Chameleon decoder layer over ``h`` (B, T, H) with the static cache (layer ``index``) and ``mask``.

    Same arithmetic as ``ChameleonDecoderLayer`` / ``ChameleonSwinDecoderLayer`` (norms, qk-norm, RoPE, MLP
    are the layer's own modules); only the attention core is this project's (cache writes, tree masks).
    ``cache=None`` and ``mask=None``: a causal pass over the whole sequence.
    """
    attn = layer.self_attn
    b, t, _ = h.shape
    nh, nkv, hd = attn.num_heads, attn.num_key_value_heads, attn.head_dim
    x = h if swin else layer.input_layernorm(h)
    q = attn.q_norm(attn.q_proj(x).reshape(-1, nh, hd)).reshape(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, D)
    k = attn.k_norm(attn.k_proj(x).reshape(-1, nkv, hd)).reshape(b, t, nkv, hd).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.write(index, k, v)  # (B, nkv, end, D)
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None and mask is None)
    out = attn.o_proj(out.transpose(1, 2).reshape(b, t, nh * hd))
    if swin:
        h = h + layer.input_layernorm(out)
        return h + layer.post_attention_layernorm(layer.mlp(h))
    h = h + out
    return h + layer.mlp(layer.post_attention_layernorm(h))


def expand_qk_norm(state: dict[str, torch.Tensor], num_heads: int,
                   num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Lumina stores qk-norm parameters per model-parallel shard, (mp, head_dim); expand them per head.

    Lumina's ``ChameleonLayerNorm.repeat_param`` repeats each shard's row for the shard's heads
    (``repeat_interleave``); transformers keeps one row per head, (heads, head_dim).
    """
    heads = {"q_norm": num_heads, "k_norm": num_kv_heads}
    out = dict(state)
    for key, value in state.items():
        kind = key.rsplit(".", 2)[-2] if key.count(".") >= 1 else ""
        if kind in heads and value.dim() == 2 and value.shape[0] != heads[kind]:
            if heads[kind] % value.shape[0]:
                raise ValueError(f"{key} has {value.shape[0]} rows, which do not divide {heads[kind]} heads")
            out[key] = value.repeat_interleave(heads[kind] // value.shape[0], dim=0)
    return out


# -- image-unit cache -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelBlock:
    """One forward block in model slots for every image: its image nodes plus the end-of-row slots inserted
    after row ends, padded to the longest image's block (padding rows come last and are never read).

    ``ids_rows`` (B, Tm) which model row holds image node i (−1: padding); ``output_rows`` (B, T) the row whose
    output is node i's next-token distribution (its end-of-row row at a row end); ``offsets`` (B, Tm)
    positions inside the image part; ``node_rows``/``row_end`` per image as lists; ``attention`` the mask
    ``begin_block`` returned.
    """

    node_rows: list[list[int]]
    row_end: list[list[bool]]
    output_rows: torch.Tensor
    offsets: torch.Tensor
    is_node: torch.Tensor
    node_index: torch.Tensor
    attention: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[1])


@dataclass
class LuminaCache:
    """The decoders' image-unit view of a model-slot ``StaticKVCache`` for a batch (see the module docstring).

    Per image ``b``: ``slot[b][i]`` is the model slot of image slot ``i`` and ``newline[b][i]`` whether slot
    ``slot[b][i] + 1`` holds its end-of-row token (always right after it); ``lengths[b]`` counts image
    tokens (0 right after prefill). ``position_base`` (S, B) is the model position of image-part offset 0 in
    each CFG stream of each image.
    """

    kv: StaticKVCache
    prefix_len: int
    width: int
    position_base: torch.Tensor
    slot: list[list[int]] = field(default_factory=list)
    newline: list[list[bool]] = field(default_factory=list)
    block: tuple[list[int], list[int], ModelBlock] | None = None  # (image starts, model starts, layout)

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.slot]

    def open_block(self, positions: list[list[int]], tree_mask: torch.Tensor | None) -> ModelBlock:
        """Lay out each image's nodes at ``positions`` in model slots, reserve them, build the mask."""
        w = self.width
        b = len(positions)
        t = len(positions[0])
        layouts = []
        for pos in positions:
            node_rows, row_end, output_rows, offsets = [], [], [], []
            for p in pos:
                node_rows.append(len(offsets))
                offsets.append(p + p // w)
                end = p % w == w - 1
                row_end.append(end)
                if end:
                    offsets.append(p + p // w + 1)
                output_rows.append(len(offsets) - 1)
            layouts.append((node_rows, row_end, output_rows, offsets))
        tm = max(len(lay[3]) for lay in layouts)
        device = self.kv.k.device
        offsets = torch.tensor([lay[3] + [lay[3][-1]] * (tm - len(lay[3])) for lay in layouts], device=device)
        is_node = torch.zeros(b, tm, dtype=torch.bool)
        node_index = torch.zeros(b, tm, dtype=torch.long)
        for i, lay in enumerate(layouts):
            is_node[i, lay[0]] = True
            node_index[i, lay[0]] = torch.arange(t)
        image_starts, model_starts = self.lengths, list(self.kv.lengths)
        model_mask = None
        if tree_mask is not None:
            masks = tree_mask.expand(b, -1, -1) if tree_mask.dim() == 2 else tree_mask
            parts = [self._model_mask(i, masks[i], lay[0], lay[1], len(lay[3])) for i, lay in enumerate(layouts)]
            window = max(part.shape[1] + (tm - part.shape[0]) for part in parts)
            model_mask = torch.zeros(b, tm, window, dtype=torch.bool, device=device)
            for i, part in enumerate(parts):
                rows, cols = part.shape  # the row's own block and earlier blocks end at its window's end
                pad = tm - rows  # padding rows of this image come after its own rows in the block
                model_mask[i, :, : window - cols - pad] = True  # committed slots before its earlier blocks
                model_mask[i, :rows, window - cols - pad: window - pad] = part
                model_mask[i, rows:, window - pad:] = torch.eye(pad, dtype=torch.bool, device=device)
        elif tm > min(len(lay[3]) for lay in layouts):
            model_mask = None  # causal: padding rows come last, so no real row sees them
        attention = self.kv.begin_block(tm, model_mask)
        for i, lay in enumerate(layouts):
            self.slot[i] += [model_starts[i] + r for r in lay[0]]
            self.newline[i] += lay[1]
            # an image's padding rows (a shorter block than the batch's longest) are written but not kept: a forward
            # that follows without ``keep`` (a draft model's chain) must not see them
            self.kv.lengths[i] = model_starts[i] + len(lay[3])
        block = ModelBlock(node_rows=[lay[0] for lay in layouts], row_end=[lay[1] for lay in layouts],
                           output_rows=torch.tensor([lay[2] for lay in layouts], device=device), offsets=offsets,
                           is_node=is_node.to(device), node_index=node_index.to(device), attention=attention)
        self.block = (image_starts, model_starts, block)
        return block

    def _model_mask(self, i: int, tree_mask: torch.Tensor, node_rows: list[int], row_end: list[bool],
                    num_rows: int) -> torch.Tensor:
        """Image ``i``'s image-unit tree mask (T, K) over its last K image slots -> model-slot mask (Tm, Km)."""
        slot, newline, length = self.slot[i], self.newline[i], len(self.slot[i])
        t, k = tree_mask.shape
        earlier = k - t  # image slots of earlier speculative blocks the mask covers
        if earlier > length and bool(tree_mask[:, : earlier - length].all()):  # a batch's window reaching
            tree_mask = tree_mask[:, earlier - length:]  # into this image's prompt (other images hold more
            t, k = tree_mask.shape  # image slots): those columns are committed prompt slots, seen anyway
            earlier = k - t
        if earlier < 0 or earlier > length:
            raise ValueError(f"tree mask of shape {tuple(tree_mask.shape)} does not fit a block of {t} "
                             f"tokens after {length} cached image tokens")
        first = slot[length - earlier] if earlier else self.kv.lengths[i]
        known = self.kv.lengths[i] - first  # model columns of the earlier blocks
        pairs = []  # (image column, model column): each image slot stands for its token and its end of row
        for c, s_ in enumerate(range(length - earlier, length)):
            pairs.append((c, slot[s_] - first))
            if newline[s_]:
                pairs.append((c, slot[s_] - first + 1))
        for a, (r, end) in enumerate(zip(node_rows, row_end)):
            pairs.append((earlier + a, known + r))
            if end:
                pairs.append((earlier + a, known + r + 1))
        device = tree_mask.device
        expand = torch.zeros(k, known + num_rows, device=device)
        index = torch.tensor(pairs, device=device)  # (P, 2)
        expand[index[:, 0], index[:, 1]] = 1.0
        visible = (tree_mask.to(device=device, dtype=expand.dtype) @ expand) > 0  # (T, Km)
        owner = [a for a, end in enumerate(row_end) for _ in range(1 + int(end))]
        mask = visible[torch.tensor(owner, device=device)]  # (Tm, Km): an end of row sees what its node sees
        for a, (r, end) in enumerate(zip(node_rows, row_end)):
            if end:
                mask[r, known + r + 1] = False  # a node does not see its own end-of-row token ...
                mask[r + 1, known + r + 1] = True  # ... which sees itself
        return mask

    def keep(self, counts: list[int] | int, index: torch.Tensor | None = None) -> None:
        """Keep the first ``counts[b]`` image tokens of each image's latest block, or its block indices."""
        if self.block is None:
            raise RuntimeError("keep() before any forward block")
        image_starts, model_starts, block = self.block
        b = len(self.slot)
        if isinstance(counts, int):
            counts = [counts] * b
        t = block.output_rows.shape[1]
        model_counts, model_index = [], []
        listed = index.tolist() if index is not None else None
        for i in range(b):
            kept = counts[i]
            if not 0 <= kept <= t:
                raise ValueError(f"keep({kept}) outside the latest block of {t} tokens")
            node_rows, row_end = block.node_rows[i], block.row_end[i]
            start = image_starts[i]
            if listed is None:
                model_counts.append(node_rows[kept - 1] + 1 + int(row_end[kept - 1]) if kept else 0)
                del self.slot[i][start + kept:], self.newline[i][start + kept:]
                continue
            rows, slots, newline = [], [], []
            for j in listed[i][:kept]:
                slots.append(model_starts[i] + len(rows))
                rows.append(node_rows[j])
                if row_end[j]:
                    rows.append(node_rows[j] + 1)
                newline.append(row_end[j])
            model_counts.append(len(rows))
            model_index.append(rows)
            self.slot[i][start:] = slots
            self.newline[i][start:] = newline
        if listed is None:
            self.kv.keep(model_counts)
            return
        width = max(model_counts) if model_counts else 0
        padded = torch.tensor([r + [0] * (width - len(r)) for r in model_index], dtype=torch.long,
                              device=self.kv.k.device).reshape(b, width)
        self.kv.keep(model_counts, padded)

    def rollback(self, lengths: list[int] | int) -> None:
        """Forget each image's slots from ``lengths[b]`` on, with their end-of-row slots."""
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.slot)
        ends = []
        for i, length in enumerate(lengths):
            if not 0 <= length <= len(self.slot[i]):
                raise ValueError(f"rollback to {length} but cache holds {len(self.slot[i])} image tokens")
            ends.append(self.prefix_len if length == 0
                        else self.slot[i][length - 1] + 1 + int(self.newline[i][length - 1]))
            del self.slot[i][length:], self.newline[i][length:]
        self.kv.rollback(ends)

    def select(self, images: list[int]) -> None:
        """Keep only the listed images."""
        self.kv.select(images)
        self.slot = [self.slot[i] for i in images]
        self.newline = [self.newline[i] for i in images]
        self.position_base = self.position_base[:, torch.tensor(list(images), device=self.position_base.device)]
        self.block = None


# -- the static decode path: end-of-row slots on the device ---------------------------------------------
class RowEndKVCache(DeviceKVCache):
    """The static path's cache of an adapter whose blocks hold end-of-row slots (``EndOfRowBlocks``): K/V and
    lengths in model slots, as ``LuminaCache.kv`` holds them, and ``keep`` in image units, as ``LuminaCache.keep``.

    ``static_forward`` lays each block out on the device (every image node, the end-of-row slot right after a node
    that ends a row, padding rows last), reserves its model rows with ``begin_block`` and records the layout
    (``layout``: each node's block row and whether an end-of-row slot follows it); ``keep`` turns the image tokens
    kept into those rows: a chain's accepted prefix is a prefix of its rows (a length move), a tree's path is
    compacted with its end-of-row slots. ``width``: the grid's width; ``levels``: the most nodes at each depth of
    the loop's tree blocks (``ImageARModel.static_cache``), from which ``extra_rows`` sizes a block.

    Example: ``cache = model.static_cache(model.static_prefill(prompts, extra_slots=8)[0])``, then
    ``model.static_forward(cache, tokens, positions)`` and ``cache.keep(counts)`` (image tokens).
    """

    width: int = 1
    levels: tuple[int, ...] | None = None
    layout: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, T) block row of each node, (B, T) row end
    #: a draft tree's levels since ``open_tree``: (B, R + 1) the tree node of each model slot they hold
    #: (column R: scratch), (B,) the model slots they hold, and how many nodes
    drafted: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @classmethod
    def over(cls, prefilled: StaticKVCache, width: int, levels: tuple[int, ...] | None) -> RowEndKVCache:
        """Buffers of their own over a static prefill's model-slot cache (``DeviceKVCache.of``)."""
        cache = cls.of(prefilled)
        cache.width, cache.levels, cache.layout = width, None if levels is None else tuple(levels), None
        return cache

    def extra_rows(self, num_nodes: int, tree: bool) -> int:
        """End-of-row slots a block of ``num_nodes`` image nodes has room for: the most nodes that can end a row.

        Nodes at depth ``d`` sit at position ``t − 1 + d``, so the nodes of one block that end a row are those at
        the depths of one residue modulo the width: a chain (one node per depth) has room for ``ceil(T / W)``, a
        tree for the largest sum of ``levels`` over the depths of one residue (every node when ``levels`` is not
        known). Nodes at the grid's last position need none (nothing follows them)."""
        levels = (1,) * num_nodes if not tree else self.levels
        if levels is None:
            return num_nodes
        w = self.width
        return min(num_nodes, max(sum(levels[r::w]) for r in range(min(w, len(levels)))))

    def columns(self, count: int) -> torch.Tensor:
        """``0 .. count − 1`` on the device (a view of the cache's own, no allocation)."""
        return self._columns[:count]

    def keep(self, counts: torch.Tensor | int, index: torch.Tensor | None = None) -> None:
        """Keep the first ``counts[b]`` image tokens (B,) of each image's latest block, or its block nodes
        ``index[b, :counts[b]]`` (B, n), with their end-of-row slots (``DeviceKVCache.keep`` in model rows)."""
        rows, ends = self.layout
        if isinstance(counts, int):
            counts = torch.full_like(self.lengths, counts)
        if index is None:  # the rows of nodes 0 .. c − 1 and their end-of-row slots: a prefix of the block
            last = (counts - 1).clamp(min=0)[:, None]
            rows_kept = rows.gather(1, last)[:, 0] + 1 + ends.gather(1, last)[:, 0].long()
            super().keep(torch.where(counts > 0, rows_kept, 0))
            return
        n = index.shape[1]
        index = index.clamp(0, rows.shape[1] - 1)
        node_rows, node_ends = rows.gather(1, index), ends.gather(1, index)  # (B, n)
        entries = torch.stack([node_rows, node_rows + 1], 2).flatten(1)  # (B, 2n): a node, its end-of-row slot
        present = torch.stack([torch.ones_like(node_ends), node_ends], 2).flatten(1)
        to = torch.where(present, present.long().cumsum(1) - 1, 2 * n)  # compacted; column 2n: scratch
        model_index = torch.zeros_like(entries[:, :1]).expand(-1, 2 * n + 1).clone().scatter_(1, to, entries)
        kept_ends = (node_ends & (self.columns(n) < counts[:, None])).sum(1)
        super().keep(counts + kept_ends, model_index[:, :2 * n])

    # -- a draft tree's levels (``ModelDrafter`` over a draft model with end-of-row slots) ------------------
    def open_tree(self) -> None:
        """Start recording the blocks that follow as a draft tree's levels after its root (``record_tree``),
        whose masks in image units ``tree_mask`` carries over to model slots: none recorded yet."""
        zero = torch.zeros_like(self.lengths)
        self.drafted = (zero[:, None], zero, 0)

    def record_tree(self) -> None:
        """Record the latest block's nodes (``layout``) as the tree's next ones: the tree node of each model
        slot they hold, an end-of-row slot its node's."""
        owner, used, n = self.drafted
        rows, ends = self.layout
        t = rows.shape[1]
        bound = owner.shape[1] - 1  # the most model slots the recorded levels hold (column bound: scratch)
        grown = torch.cat([owner[:, :bound], torch.zeros_like(owner[:, :1]).expand(-1, 2 * t + 1)], 1)
        node = n + self.columns(t).expand_as(rows)
        at = used[:, None] + rows
        grown.scatter_(1, at, node).scatter_(1, torch.where(ends, at + 1, bound + 2 * t), node)
        self.drafted = (grown, used + t + ends.long().sum(1), n + t)

    def tree_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """A draft tree level's mask in image units, (F, K) or (B, F, K) over the tree's root, the N nodes
        recorded since ``open_tree`` and the level's F nodes (``coolsd.trees.Expansion``), as
        ``static_forward`` takes it: (B, F, E + F) over the last E model slots before the block (E: the
        recorded levels' bound), each recorded slot seen as its node (an end-of-row slot as its node), the
        older ones (the root's and the committed slots before it) seen by every node."""
        owner, used, n = self.drafted
        f, k = tree_mask.shape[-2:]
        if k != 1 + n + f:
            raise ValueError(f"a tree mask of shape {tuple(tree_mask.shape)} does not cover the root, the "
                             f"{n} nodes recorded since open_tree and {f} new ones")
        masks = tree_mask.expand(used.shape[0], -1, -1) if tree_mask.dim() == 2 else tree_mask
        e = owner.shape[1] - 1
        since = self.columns(e) - (e - used)[:, None]  # (B, E): each column's slot since the root's (< 0)
        node = owner.gather(1, since.clamp(min=0))  # (B, E)
        seen = masks[:, :, 1:1 + n].gather(2, node[:, None, :].expand(-1, f, -1)) | (since < 0)[:, None, :]
        return torch.cat([seen, masks[:, :, 1 + n:]], -1)


class EndOfRowBlocks:
    """What Lumina-mGPT and Emu3 share: blocks in model slots with the structural token after every row
    (Lumina-mGPT's end-of-row, Emu3's end-of-line token, id ``end_of_row_id``), on both decode paths.

    The eager path lays a block out on the host (``LuminaCache.open_block``); the static path (``static_forward``
    over a ``RowEndKVCache``) on the device, from a map built once per resolution (``end_of_row_after``: whether
    an end-of-row slot follows image position i, every row's last position but the grid's last;
    ``model_offsets``: the offset of position i in the image part, ``i + i // W``): each node at its row, the
    end-of-row slot after a node that ends a row, padding rows last, a tree's mask carried over to the slots (an
    end-of-row slot sees what its node sees and itself; its node does not see it). A block has room for as many
    end-of-row slots as its nodes can need (``RowEndKVCache.extra_rows``). Both paths then run the same
    computation (``_block_output``); the distribution of a row's last node is its end-of-row slot's output, and
    structural slots are never drafted, verified or counted, on either path. The static path's prefill pads
    every prompt to ``prompt_capacity`` (``static_prefill``), so one cache capacity serves every batch; RoPE
    positions start at each stream's own prompt length, read on the device from the prefix's padding.
    """

    end_of_row_id: int
    prompt_capacity: int

    def _row_end_maps(self) -> None:
        """The per-resolution position map of the static path (class doc), as buffers moved with the model."""
        n, w = self.num_image_tokens, self.grid[1]
        positions = torch.arange(n)
        self.register_buffer("end_of_row_after", (positions % w == w - 1) & (positions < n - 1), persistent=False)
        self.register_buffer("model_offsets", positions + positions // w, persistent=False)

    def decode_context(self):
        return attention_context(self.attention_kernel)

    def _block_output(self, ids: torch.Tensor, positions: torch.Tensor, kv: Any, attention: torch.Tensor | None,
                      output_rows: torch.Tensor) -> TargetOutput:
        """Model-slot ids (B, Tm) at RoPE positions (B·S, Tm) over ``kv`` -> each node's output (S, B, T, ·) at its
        ``output_rows`` (B, T) (a row's last node: its end-of-row slot's)."""
        s = self.num_streams
        hidden = self._hidden(stream_rows(ids, s), positions, kv, attention)
        out = self._output(hidden)  # (S, B, Tm, ·)
        gather = output_rows.view(1, *output_rows.shape, 1)
        return TargetOutput(logits=out.logits.gather(2, gather.expand(s, -1, -1, out.logits.shape[-1])),
                            hidden=out.hidden.gather(2, gather.expand(s, -1, -1, out.hidden.shape[-1])))

    @torch.inference_mode()
    def forward_block(self, cache: LuminaCache, tokens: torch.Tensor, positions: torch.Tensor,
                      tree_mask: torch.Tensor | None = None) -> TargetOutput:
        block = cache.open_block(positions.tolist(), tree_mask)
        codes = self.code_to_bpe[tokens.to(self.device)].gather(1, block.node_index)  # (B, Tm)
        ids = torch.where(block.is_node, codes, self.end_of_row_id)  # end-of-row rows forced
        model_positions = cache.position_base[:, :, None] + block.offsets[None]  # (S, B, Tm)
        with self.decode_context():
            return self._block_output(ids, to_rows(model_positions), cache.kv, block.attention, block.output_rows)

    def static_forward(self, cache: RowEndKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                       tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """``forward_block`` on the device (class doc): over the ``RowEndKVCache`` of ``static_cache``, the caller
        inside ``decode_context()``; positions past the grid are clamped to its last by the caller. ``tree_mask``
        (T, K) or (B, T, K): over the block's nodes, and with K > T first over the cache's last K − T slots before
        the block, in model slots (a spatial order's window, ``coolsd.static.orders``)."""
        if not isinstance(cache, RowEndKVCache):
            raise TypeError(f"{type(self).__name__}.static_forward runs over the RowEndKVCache of static_cache, got "
                            f"a {type(cache).__name__}")
        b, t = tokens.shape
        extra = cache.extra_rows(t, tree_mask is not None)
        rows = t + extra  # the block's model rows; column ``rows`` of the scratch tensors below is discarded
        ends = self.end_of_row_after[positions]  # (B, T): an end-of-row slot follows the node
        if extra < t:  # a no-op for the static loop's blocks (``extra_rows``); keeps every index in the block
            ends = ends & (ends.long().cumsum(1) <= extra)
        step = ends.long()
        node_row = cache.columns(t) + step.cumsum(1) - step  # (B, T): after the end-of-row slots before it
        end_row = torch.where(ends, node_row + 1, rows)
        offsets = self.model_offsets[positions]
        ids = torch.full((b, rows + 1), self.end_of_row_id, dtype=torch.long, device=tokens.device)
        ids.scatter_(1, node_row, self.code_to_bpe[tokens])
        row_offsets = torch.zeros_like(ids).scatter_(1, node_row, offsets).scatter_(1, end_row, offsets + 1)
        visible = None  # a chain: causal over the block (padding rows come last)
        if tree_mask is not None:
            # columns before the block's (a spatial order's, ``coolsd.static.orders``): the cache's last slots
            # before the block in model slots (an end-of-row slot is one of its own), seen by a node's rows
            earlier = tree_mask.shape[-1] - t
            nodes = torch.zeros(b, t + 1, earlier + t + 1, dtype=torch.bool, device=tokens.device)  # t: padding
            nodes[:, :t, :earlier + t] = tree_mask
            node = cache.columns(t).expand(b, -1)
            owner = torch.full_like(ids, t).scatter_(1, node_row, node).scatter_(1, end_row, node)[:, :rows]
            is_end = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, end_row, True)[:, :rows]
            visible = nodes.gather(1, owner[:, :, None].expand(-1, -1, nodes.shape[2]))
            before, visible = visible[..., :earlier], visible[..., earlier:]
            visible = visible.gather(2, owner[:, None, :].expand(-1, rows, -1))  # (B, Tm, Tm) as their nodes
            own = (owner[:, :, None] == owner[:, None, :]) & is_end[:, None, :] & ~is_end[:, :, None]
            eye = cache.columns(rows)[:, None] == cache.columns(rows)[None, :]
            visible = (visible & ~own) | eye  # a node does not see its own end of row; every row sees itself
            visible = torch.cat([before, visible], -1) if earlier else visible
        attention = cache.begin_block(rows, visible)
        cache.lengths.copy_(cache.starts + t + step.sum(1))  # padding rows are not kept (``LuminaCache.open_block``)
        cache.layout = (node_row, ends)
        base = cache.key_valid[:, :cache.prefix_len].sum(-1)  # (B·S,) each stream's prompt length (padding masked)
        seq = base[:, None] + stream_rows(row_offsets[:, :rows], self.num_streams)
        return self._block_output(ids[:, :rows], seq, cache, attention, torch.where(ends, node_row + 1, node_row))

    def static_cache(self, prefilled: StaticKVCache, levels: tuple[int, ...] | None = None) -> RowEndKVCache:
        """A ``RowEndKVCache`` over a ``static_prefill`` cache (``ImageARModel.static_cache``)."""
        return RowEndKVCache.over(prefilled, self.grid[1], levels)

    def static_prefill(self, prompts: list[str], extra_slots: int = 64,
                       streams: Streams | None = None) -> tuple[StaticKVCache, TargetOutput]:
        """``prefill`` with every stream left-padded to ``prompt_capacity`` slots (the padding masked), returning
        the model-slot cache itself (its image-unit view is ``static_cache``'s): one capacity for every batch; a
        longer prompt is refused, naming the key."""
        return self._prefill(prompts, extra_slots, streams, self.prompt_capacity)

    def _prefix_width(self, prompts: list[str], seqs: list[list[int]], width: int | None) -> int:
        """The prefix slots of a prefill: the longest stream's (``width`` None), or ``width`` (static path)."""
        longest = max(len(seq) for seq in seqs)
        if width is not None and longest > width:
            i, stream = divmod(max(range(len(seqs)), key=lambda j: len(seqs[j])), self.num_streams)
            what = f"prompt {prompts[i]!r}" if stream == 0 else "the unconditional stream (its negative prompt)"
            raise ValueError(f"{what} takes {longest} prefix tokens (template and image header included), more "
                             f"than model.prompt_capacity={width}, the prompt width of the static decode path: set "
                             f"model.prompt_capacity={longest} or more, or decoder.path=eager")
        return longest if width is None else width


# -- the adapter ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandomInit:
    """Sizes of a random-weight Lumina-mGPT (``pretrained=false``); ``vqgan`` holds the decoder's sizes."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    num_codes: int = 256
    vocab_size: int | None = None  # embeddings and head rows (None: the vocabulary's size; 65536 at real size)
    max_position_embeddings: int = 4096
    swin_norm: bool = False
    init_std: float = 0.2
    seed: int = 0
    shuffle_codes: bool = True
    vqgan: Mapping[str, Any] = field(default_factory=lambda: {
        "embed_dim": 8, "z_channels": 32, "ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1,
        "attn_resolutions": [], "resolution": 8})


def chameleon_tokenizer_files(tokenizer_dir: str | None) -> dict[str, Path]:
    """Paths of Meta's ``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt`` (or ``vqgan.safetensors``)."""
    if not tokenizer_dir:
        raise MissingWeightsError("model.tokenizer_dir is not set: point it at the folder with Meta's "
                                  f"Chameleon tokenizer files ({', '.join(TOKENIZER_FILES)}) from "
                                  f"{CHAMELEON_DOWNLOAD}")
    base = Path(tokenizer_dir).expanduser()
    files = {name: base / name for name in TOKENIZER_FILES}
    if not files["vqgan.ckpt"].is_file() and (base / "vqgan.safetensors").is_file():
        files["vqgan.ckpt"] = base / "vqgan.safetensors"
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise MissingWeightsError(
            f"Chameleon tokenizer files missing: {', '.join(missing)} (looked in {base.resolve()}). They are "
            f"not on the Hugging Face hub: {TOKENIZER_HINT}")
    return files


class CodesInVocabulary:
    """The image codes of a model whose text vocabulary holds them as tokens (Lumina-mGPT, Emu3): ``code_to_bpe``
    (V,) maps code -> token id (``first_code_bpe`` + code when ``contiguous_codes``); the adapter gives its
    ``token_embedding()`` and ``output_weight()`` (the ``lm_head`` weight)."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embedding()(self.code_to_bpe[tokens])

    def image_head_weight(self) -> torch.Tensor:
        """The ``lm_head`` rows of the image codes in code order (V, H); a view if the ids are contiguous."""
        weight = self.output_weight()
        if self.contiguous_codes:
            return weight[self.first_code_bpe: self.first_code_bpe + self.codebook_size]
        return weight.index_select(0, self.code_to_bpe)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.image_head_weight())
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays


class LuminaMGPT(EndOfRowBlocks, CodesInVocabulary, ImageARModel):
    """Lumina-mGPT text-to-image adapter (see the module docstring); prompts are free text."""

    sjd_init = "random"  # the SJD reference's Lumina-mGPT demo setting
    spatial_orders = True  # image cells as positions (end-of-row slots added by LuminaCache), per-query masks
    stand_in_is_end_of_row = True  # a new row's first code is predicted by the row above's end-of-row token
    #: Lumina-mGPT's ``inference_solver.py``: PyTorch's SDPA dispatch and TF32 defaults; Meta's tokenizer
    #: truncates pixels
    runtime_defaults = Runtime()
    model_name = "Lumina-mGPT"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the language model's config, index and shards (``hub_repo``) and Meta's Chameleon
        tokenizer folder (``tokenizer_dir``: not on the hub, a manual download)."""
        if not cfg.get("pretrained", True):
            return []
        folder = cfg.get("tokenizer_dir") or "<model.tokenizer_dir unset>"
        repo = str(cfg.get("hub_repo", "Alpha-VLLM/Lumina-mGPT-7B-768"))
        return [RequiredFile("Lumina-mGPT language model", repo_id=repo, patterns=LM_PATTERNS,
                             revision=cfg.get("revision"), must_have=("config.json", "model.safetensors.index.json")),
                RequiredFile("Chameleon tokenizer + VQGAN", local=str(folder),
                             must_have=("text_tokenizer.json", "vqgan.yaml", "vqgan.ckpt|vqgan.safetensors"),
                             manual=TOKENIZER_HINT)]

    def __init__(
        self,
        sampling: dict | SamplingConfig,
        width: int = 768,
        height: int = 768,
        pretrained: bool = True,
        hub_repo: str = "Alpha-VLLM/Lumina-mGPT-7B-768",
        revision: str | None = None,
        tokenizer_dir: str | None = None,
        random_init: dict | RandomInit | None = None,
        header: str = "sampled",
        header_mismatch: str = "force",
        text_top_k: int = 10,
        prompt_capacity: int = 256,
        runtime: Runtime | None = None,
    ) -> None:
        """Reference options (defaults = Lumina-mGPT's ``inference_solver.py``): ``header`` ``sampled`` (the
        image header is sampled as the reference does, ``forced``: written by the adapter), ``header_mismatch``
        (``force``: a sampled header other than the configured grid's is replaced by it, with a warning;
        ``error``: raise), ``text_top_k`` (the reference's top-k outside images, used for ``<racm3:break>``).
        ``prompt_capacity``: the prefix width of the static decode path's prefill (``static_prefill``; template,
        BOS, end of turn and image header included). ``runtime``: with ``pretrained``, ``requires_cuda`` stops ``device=auto`` without CUDA before any file is
        read (``coolsd.device``)."""
        super().__init__(sampling, runtime)
        device, dtype = self.runtime.resolve(published=pretrained)
        if header not in HEADER_MODES:
            raise ValueError(f"model.header must be one of {HEADER_MODES}, got {header!r}")
        if header_mismatch not in HEADER_MISMATCH:
            raise ValueError(f"model.header_mismatch must be one of {HEADER_MISMATCH}, got {header_mismatch!r}")
        if text_top_k < 1:
            raise ValueError(f"model.text_top_k must be >= 1, got {text_top_k}")
        self.header, self.header_mismatch, self.text_top_k = header, header_mismatch, text_top_k
        self.prompt_capacity = validate.integer("model.prompt_capacity", prompt_capacity, minimum=4)
        self.header_mismatches: list[dict[str, Any]] = []  # prompts whose sampled header was replaced
        for name, value in (("width", width), ("height", height)):
            if not isinstance(value, int) or value <= 0 or value % PIXELS_PER_SIZE_UNIT:
                raise ValueError(f"model.{name} must be a positive multiple of {PIXELS_PER_SIZE_UNIT} "
                                 f"pixels, got {value!r}")
        self.width, self.height = width, height
        self.size_units = (height // PIXELS_PER_SIZE_UNIT, width // PIXELS_PER_SIZE_UNIT)  # (h, w) tokens
        self.grid = (self.size_units[0] * CODES_PER_SIZE_UNIT, self.size_units[1] * CODES_PER_SIZE_UNIT)
        if pretrained:  # every file is looked up before anything is built; one error lists what is missing
            errors = []
            try:
                files = self.tokenizer_files(tokenizer_dir)
            except MissingWeightsError as err:
                errors.append(str(err))
            try:
                lm_config, shards = lumina_lm_files(hub_repo, revision)
            except MissingWeightsError as err:
                errors.append(str(err))
            missing_together(f"{self.model_name} files are missing (looked up before building the model)",
                             errors)
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(files["text_tokenizer.json"]))
            self.lm = build_lumina_lm(lm_config, read_lumina_state(shards, dtype, device), hub_repo)
            vqgan = load_vqgan(files["vqgan.yaml"], files["vqgan.ckpt"])
        else:
            init = random_init if isinstance(random_init, RandomInit) else RandomInit(**(random_init or {}))
            vocab = tiny_vocabulary(init.num_codes, self.size_units, seed=init.seed,
                                    shuffle=init.shuffle_codes)
            tokenizer = word_level_tokenizer(vocab)
            self.lm, vqgan = random_lumina(init, vocab, device, dtype)
        self.tokenizer = tokenizer
        self.vocabulary = ChameleonVocabulary(tokenizer.get_vocab())
        check_vocabulary(self.vocabulary, self.lm.config)
        if vqgan.config.n_embed != self.vocabulary.codebook_size:
            raise ValueError(f"the VQGAN has {vqgan.config.n_embed} codes but the vocabulary "
                             f"{self.vocabulary.codebook_size} image tokens")
        self.vqgan = vqgan
        self.codebook_size = self.vocabulary.codebook_size
        self.hidden_size = self.lm.config.hidden_size
        self.num_kv_heads = self.lm.config.num_key_value_heads
        self.head_dim = self.hidden_size // self.lm.config.num_attention_heads
        self.active_layers = self.lm.config.num_hidden_layers
        self.swin = bool(self.lm.config.swin_norm)
        self.register_buffer("code_to_bpe", self.vocabulary.code_to_bpe.clone(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(self.lm.config, self.head_dim), persistent=False)
        self.end_of_row_id = self.vocabulary.end_of_row
        self._row_end_maps()
        self.first_code_bpe = int(self.vocabulary.code_to_bpe[0])
        contiguous = torch.arange(self.first_code_bpe, self.first_code_bpe + self.codebook_size)
        self.contiguous_codes = bool(torch.equal(self.vocabulary.code_to_bpe, contiguous))
        self.lm.to(dtype=dtype)  # the language model only: the RoPE frequencies stay float32
        self.place(device, float32=(self.vqgan,))

    def tokenizer_files(self, tokenizer_dir: str | None) -> dict[str, Path]:
        """Meta's tokenizer files (``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt``) of a pretrained model:
        Lumina-mGPT's come from the folder ``model.tokenizer_dir`` (a licensed manual download)."""
        return chameleon_tokenizer_files(tokenizer_dir)

    # -- prompts ---------------------------------------------------------------------------------------------
    def text_ids(self, prompt: str) -> list[int]:
        """BOS, the templated prompt and the end of turn: the context in which the header is sampled."""
        text = PROMPT_TEMPLATE.format(width=self.width, height=self.height, prompt=prompt)
        body = self.tokenizer.encode(text, add_special_tokens=False)
        return [self.vocabulary.bos, *body, self.vocabulary.end_of_turn]

    def prompt_ids(self, prompt: str) -> list[int]:
        """Conditional prefix: BOS, the templated prompt, end of turn, image start and the two size tokens."""
        return [*self.text_ids(prompt), *self.image_header()]

    @torch.inference_mode()
    def sample_header(self, prompt: str, u: torch.Tensor) -> list[int]:
        """Three tokens after the prompt, sampled as Lumina-mGPT's ``inference_solver.py`` samples them.

        Its logits processors leave these three steps unguided (the CFG processor starts after the two size
        tokens) and unmasked (``MultiModalLogitsProcessor`` constrains only later steps); its
        ``InterleavedTopKLogitsWarper`` uses ``text_top_k`` outside an image (so for ``<racm3:break>``) and
        ``image_top_k`` (``sampling.top_k``) inside one (the size tokens, once a break was sampled); the
        generation temperature is ``sampling.temperature`` (0: arg-max); no top-p. Full-vocabulary logits of
        the conditional stream alone, one cached forward per token (an extra pass over the prompt, timed
        as part of the prefill, as the reference's own header steps are part of its generation). ``u`` (3,):
        the image's uniforms for the three draws (inverse CDF, ``coolsd.rng.sample``).
        """
        ids = self.text_ids(prompt)
        p = len(ids)
        kv = StaticKVCache(num_layers=self.active_layers, batch=1, num_heads=self.num_kv_heads, max_len=p + 2,
                           head_dim=self.head_dim, dtype=self.lm.lm_head.weight.dtype, device=self.device)
        x = torch.tensor([ids], device=self.device)
        hidden = self._hidden(x, torch.arange(p, device=self.device)[None], kv, kv.begin_block(p))
        header: list[int] = []
        for step in range(3):
            in_image = bool(header) and header[0] == self.vocabulary.image_start
            top_k = self.sampling.top_k if in_image else self.text_top_k
            rule = SamplingConfig(temperature=self.sampling.temperature, top_k=top_k)
            logits = self.lm.lm_head(hidden[:, -1]).float()  # (1, vocab): every token, not only image codes
            header.append(int(sample(logits_to_probs(logits, rule), u[step: step + 1].to(logits.device))[0]))
            if step < 2:
                x = torch.tensor([[header[-1]]], device=self.device)
                hidden = self._hidden(x, torch.tensor([[p + step]], device=self.device), kv, kv.begin_block(1))
        return header

    def check_header(self, prompt: str, header: list[int]) -> None:
        """A sampled header must be ``<racm3:break>`` and the configured grid's size tokens (module doc)."""
        expected = self.image_header()
        if header == expected:
            return
        names = self.tokenizer.convert_ids_to_tokens(header)
        message = (f"Lumina-mGPT sampled the image header {names} for prompt {prompt!r}, not "
                   f"{self.tokenizer.convert_ids_to_tokens(expected)} of the configured {self.width}x"
                   f"{self.height} image (model.width / model.height); this harness decodes the configured "
                   "grid only")
        if self.header_mismatch == "error":
            raise HeaderMismatchError(message + "; set model.header_mismatch=force to continue with the "
                                      "configured header, or model.header=forced")
        self.header_mismatches.append({"prompt": prompt, "sampled": names})
        warnings.warn(message + "; continuing with the configured header (model.header_mismatch=force)",
                      stacklevel=2)

    def image_header(self) -> list[int]:
        """``<racm3:break>``, the height and the width size tokens (the unconditional stream's context)."""
        voc = self.vocabulary
        return [voc.image_start, *(voc.token_id(size_token(units)) for units in self.size_units)]

    def unconditional_ids(self) -> list[int]:
        """The unconditional CFG stream's context: the image header alone (``inference_solver.py``)."""
        return self.image_header()

    # -- the network ------------------------------------------------------------------------------------
    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, kv: StaticKVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Token ids (S, T) at model positions (S, T) -> post-norm hidden states (S, T, H)."""
        stack = self.lm.model
        h = stack.embed_tokens(ids)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, h.dtype)
        for i, layer in enumerate(stack.layers[: self.active_layers]):
            h = chameleon_block(layer, h, cos, sin, kv, i, mask, self.swin)
        return stack.norm(h)

    # -- the adapter interface --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[LuminaCache, TargetOutput]:
        """With ``header=sampled`` and the images' ``streams`` (the decoder's), each image's header is first
        sampled (``sample_header``) and checked against the configured grid (``check_header``); the prefill
        then runs over the configured header, which is what was sampled unless ``header_mismatch=force``
        replaced it. Without streams (teacher forcing, draft models, benchmarks) the configured header is
        used."""
        return self._prefill(prompts, extra_slots, streams, None)

    def _prefill(self, prompts: list[str], extra_slots: int, streams: Streams | None,
                 width: int | None) -> tuple[LuminaCache, TargetOutput]:
        """``prefill`` with every stream left-padded to ``width`` prefix slots (None: the longest stream's); the
        static path (a width) takes the model-slot cache (``static_prefill``)."""
        if self.header == "sampled" and streams is not None:
            u = streams.uniform(torch.zeros(len(prompts), dtype=torch.long, device=self.device), HEADER, 3)
            for k, prompt in enumerate(prompts):
                self.check_header(prompt, self.sample_header(prompt, u[k]))
        conds = [self.prompt_ids(p) for p in prompts]
        uncond = self.unconditional_ids()
        s, b = self.num_streams, len(prompts)
        seqs = [seq for cond in conds for seq in ([cond, uncond] if s == 2 else [cond])]
        p = self._prefix_width(prompts, seqs, width)  # every stream of every image left-padded to p slots
        rows = self.grid[0]
        kv = StaticKVCache(
            num_layers=self.active_layers, batch=b, streams=s, num_heads=self.num_kv_heads,
            max_len=p + self.num_image_tokens + rows + 2 * extra_slots + 2, head_dim=self.head_dim,
            dtype=self.lm.lm_head.weight.dtype, device=self.device,
        )
        kv.prefix_len = p  # the prefix's model slots (``DeviceKVCache.prefix_len`` on the static path)
        ids, positions, valid, bases = [], [], [], []
        for seq in seqs:  # image-major rows: each image's conditional stream, then its unconditional one (the header)
            pad = p - len(seq)
            ids.append([self.vocabulary.image_start] * pad + list(seq))
            positions.append([0] * pad + list(range(len(seq))))  # from 0 at the stream's own start
            valid.append([False] * pad + [True] * len(seq))
            bases.append(len(seq))
        kv.set_padding(torch.tensor(valid))
        mask = kv.begin_block(p)
        hidden = self._hidden(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                              kv, mask)
        if width is not None:
            return kv, self._output(hidden[:, -1:])
        bases = torch.tensor(bases, device=self.device).view(b, s).t()  # (S, B)
        return self._eager_cache(kv, bases), self._output(hidden[:, -1:])

    def _eager_cache(self, kv: StaticKVCache, position_base: torch.Tensor) -> LuminaCache:
        """The eager path's image-unit view of a prefill's model-slot cache; ``position_base`` (S, B): each
        stream's prompt length (the position of its first image-part slot)."""
        b = position_base.shape[1]
        return LuminaCache(kv=kv, prefix_len=kv.prefix_len, width=self.grid[1], position_base=position_base,
                           slot=[[] for _ in range(b)], newline=[[] for _ in range(b)])

    def _output(self, hidden: torch.Tensor) -> TargetOutput:
        """Hidden states of the cache rows (B·S, T, H) -> per-stream output (S, B, T, ·)."""
        hidden = per_stream(hidden, self.num_streams)
        return TargetOutput(logits=self.head(hidden), hidden=hidden)

    def token_embedding(self) -> nn.Module:
        return self.lm.model.embed_tokens

    def output_weight(self) -> torch.Tensor:
        return self.lm.lm_head.weight

    def codebook(self) -> torch.Tensor:
        return self.vqgan.codebook()

    @torch.inference_mode()
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vqgan.decode_to_uint8(tokens.reshape(1, -1), self.grid, self.pixel_rounding)[0]

    def make_draft_layer(self, norm_eps: float | None = None) -> ChameleonDraftLayer:
        """A fresh ``ChameleonDraftLayer`` of this model's width (see ``ImageARModel.make_draft_layer``)."""
        layer = ChameleonDraftLayer(self.lm.config, width=self.grid[1] if self.stand_in_is_end_of_row else None,
                                    norm_eps=self.lm.config.rms_norm_eps if norm_eps is None else norm_eps)
        return layer.to(device=self.device, dtype=self.lm.lm_head.weight.dtype)


class ChameleonDraftLayer(nn.Module):
    """The EAGLE draft layer of a Lumina-mGPT target: one Chameleon decoder layer (qk-norm, 1-D RoPE).

    As jadohu/LANTERN ``models/drafters/cnets_lumina_mgpt.py``: the layer keeps its ``input_layernorm``
    (unlike the LlamaGen drafter) and has no final norm; its parameters carry transformers' layer names
    (``self_attn.q_proj.weight``, ``self_attn.q_norm.weight`` ...).

    Positions: the pair ``(f_t, x_{t+1})`` at pair position ``t`` is rotated with the position of
    ``x_{t+1}`` inside the image part of the target's sequence, ``(t + 1) + (t + 1) // W`` (``W`` = grid
    width): image tokens keep the gaps of the end-of-row tokens between rows, which the drafter never sees
    (the target's output for a row's last token, the drafter's ``f_t`` there, is the end-of-row token's
    output). Only differences of positions matter to RoPE, so the offset of the image part is left out.
    ``width=None``: a target without end-of-row tokens (Anole, ``coolsd.models.anole``), plain ``t + 1``.
    """

    def __init__(self, config: ChameleonConfig, width: int | None, norm_eps: float) -> None:
        super().__init__()
        small = ChameleonConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=1,
            intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, hidden_act=config.hidden_act,
            rms_norm_eps=norm_eps, attention_bias=config.attention_bias, mlp_bias=config.mlp_bias,
            swin_norm=config.swin_norm, vocabulary_map={},
        )
        layer = (ChameleonSwinDecoderLayer if config.swin_norm else ChameleonDecoderLayer)(small, 0)
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.swin = bool(config.swin_norm)
        self.width = width
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.intermediate_size = config.intermediate_size
        self.register_buffer("inv_freq", rope_inv_freq(config, self.head_dim), persistent=False)

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Pair positions t (T,) -> the image-part positions of x_{t+1}, end-of-row gaps included."""
        nxt = positions.long() + 1
        if self.width is None:
            return nxt
        return nxt + torch.div(nxt, self.width, rounding_mode="floor")

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        pos = self.rope_positions(positions if positions.device == h.device else positions.to(h.device))
        pos = pos if pos.dim() == 2 else pos[None]  # (1 or R, T)
        cos, sin = rotary_cos_sin(pos, self.inv_freq, h.dtype)
        return chameleon_block(self, h, cos, sin, cache, 0, mask, self.swin)

    def from_eagle_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A LANTERN Lumina drafter layer (Chameleon names, qk-norm per shard) -> this module's keys."""
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(f"EAGLE layer keys differ from a Chameleon layer's: missing "
                             f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
        return expand_qk_norm(state, self.num_heads, self.num_kv_heads)


def check_vocabulary(vocabulary: ChameleonVocabulary, config: ChameleonConfig) -> None:
    """The tokenizer's image tokens must have the ids that the model's own ``vocabulary_map`` gives them."""
    if int(vocabulary.code_to_bpe.max()) >= config.vocab_size:
        raise ValueError(f"image-token ids reach {int(vocabulary.code_to_bpe.max())} but the model has "
                         f"{config.vocab_size} embeddings; the tokenizer does not belong to this model")
    vmap = getattr(config, "vocabulary_map", None) or {}
    has_images = any(parse_image_token(name) is not None for name in vmap)
    if has_images and not torch.equal(image_code_ids(vmap), vocabulary.code_to_bpe):
        raise ValueError("the tokenizer and the model's vocabulary_map map image codes to different ids; "
                         "text_tokenizer.json does not belong to this model")


def random_lumina(init: RandomInit, vocab: Mapping[str, int], device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> tuple[ChameleonLM, ChameleonVQGAN]:
    """A random-weight Chameleon LM and VQGAN decoder of the sizes in ``init`` (seeded, float32 on the CPU).

    On CUDA the LM is drawn there, in ``dtype`` (a 7B model in float32 on the CPU would take 28 GB and minutes to
    draw): the same distribution, other values than the CPU's for the same seed. On the meta device nothing is
    allocated."""
    if init.vocab_size is not None and init.vocab_size < len(vocab):
        raise ValueError(f"model.random_init.vocab_size={init.vocab_size} is smaller than the vocabulary "
                         f"({len(vocab)} tokens)")
    config = ChameleonConfig(
        vocab_size=init.vocab_size or len(vocab), hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_hidden_layers, num_attention_heads=init.num_attention_heads,
        num_key_value_heads=init.num_key_value_heads, swin_norm=init.swin_norm, vocabulary_map=dict(vocab),
        max_position_embeddings=init.max_position_embeddings,
        vq_config={"embed_dim": 16, "num_embeddings": 64, "base_channels": 32, "latent_channels": 32,
                   "channel_multiplier": [1, 2], "num_res_blocks": 1},  # unused here; keeps HF's copy small
    )
    vq_cfg = ChameleonVQGANConfig(n_embed=init.num_codes, **dict(init.vqgan))
    on_gpu = device is not None and device.type == "cuda"
    there = on_gpu or (device is not None and device.type == "meta")  # meta: nothing allocated
    with torch.random.fork_rng(devices=[device] if on_gpu else []), \
            torch.device(device if there else "cpu"):
        torch.manual_seed(init.seed)
        lm = ChameleonLM(config)
        if there and dtype is not None:
            lm.to(dtype=dtype)
        for name, param in lm.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # per-head qk-norm scales around 1
                nn.init.normal_(param, mean=1.0, std=0.1)
            elif name.endswith(("q_norm.bias", "k_norm.bias")):
                nn.init.normal_(param, mean=0.0, std=0.1)
            elif param.dim() == 2:
                nn.init.normal_(param, mean=0.0, std=init.init_std)
        vqgan = ChameleonVQGAN(vq_cfg)
    return lm, vqgan.eval()


def lumina_lm_files(repo: str, revision: str | None) -> tuple[ChameleonConfig, list[str]]:
    """The config and the local safetensors shards of Lumina-mGPT's language model (downloaded when online);
    a ``MissingWeightsError`` names the first file that is not available."""
    config = ChameleonConfig.from_json_file(hub_file(repo, "config.json", revision=revision))
    if not getattr(config, "vocabulary_map", None):
        raise ValueError(f"{repo}/config.json has no vocabulary_map; is it a Chameleon / Lumina-mGPT "
                         "checkpoint?")
    index_path = hub_file(repo, "model.safetensors.index.json", revision=revision)
    shards = sorted(set(json.loads(Path(index_path).read_text())["weight_map"].values()))
    return config, [hub_file(repo, shard, revision=revision) for shard in shards]


def read_lumina_state(shards: Sequence[str], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The language model's tensors of the shards (the VQ encoder's ``model.vqmodel.*`` entries skipped)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(shard, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not key.startswith(VQ_ENCODER_PREFIX):
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return state


#: Lumina-mGPT's checkpoints hold Chameleon's VQ encoder under this prefix; generation never runs it.
VQ_ENCODER_PREFIX = "model.vqmodel."


def build_lumina_lm(config: ChameleonConfig, state: dict[str, torch.Tensor], source: str) -> ChameleonLM:
    """A ``ChameleonLM`` of ``config`` holding ``state`` (checkpoint key names; per-shard qk-norm rows are
    expanded per head, ``model.vqmodel.*`` is skipped), built on the meta device and loaded strictly."""
    with torch.device("meta"):
        lm = ChameleonLM(config)
    state = {k: v for k, v in state.items() if not k.startswith(VQ_ENCODER_PREFIX)}
    state = expand_qk_norm(state, config.num_attention_heads, config.num_key_value_heads)
    strict_load(lm, state, source, "is it a Lumina-mGPT (Chameleon) checkpoint of this size?", assign=True)
    return lm


def load_lumina_lm(repo: str, revision: str | None, dtype: torch.dtype, device: torch.device) -> ChameleonLM:
    """Lumina-mGPT's language model from the hub (safetensors shards; VQ-encoder entries are skipped)."""
    config, shards = lumina_lm_files(repo, revision)
    return build_lumina_lm(config, read_lumina_state(shards, dtype, device), repo)


def layer_skip_copy(target: LuminaMGPT, num_layers: int) -> LuminaMGPT:
    """A draft model sharing the target's weights that runs only its first ``num_layers`` decoder layers."""
    return layer_skipping(target, num_layers, target.lm.config.num_hidden_layers)
