"""Emu3-Gen (BAAI, Wang et al., 2024, arXiv 2409.18869), the 8B text-to-image Emu3, as an adapter.

The target runs on ``transformers``' Emu3 classes (``Emu3ForConditionalGeneration``: a Llama-style decoder,
``Emu3TextModel``, with ``lm_head`` over a 184,622-token vocabulary, and the ``Emu3VQVAE`` vision tokenizer of
32,768 codes, 8x spatial down-sampling). Like the Lumina-mGPT adapter (``coolsd.models.lumina_mgpt``, whose
image-unit cache it reuses) it runs the decoder layers itself with the project's static KV cache and applies
``lm_head`` to the visual-token rows only.

What the adapter reproduces of the authors' sampling recipe (baaivision/Emu3 ``image_generation.py``,
``emu3/mllm/processing_emu3.py``, ``emu3/mllm/utils_emu3.py``), each a model option:

* **Prompt** (``positive_prompt``): ``<|extra_203|>`` (BOS) + prompt + ``" masterpiece, film grained, best
  quality."`` (image_generation.py l.31, 36) + the image header ``<|image start|>`` ``"{H}*{W}"``
  ``<|image token|>`` (processing_emu3.py l.177-183: ``boi_token + prefix_template.format(H=h, W=w) +
  img_token``; ``prefix_template="{H}*{W}"``, l.69), ``H``/``W`` the grid in tokens.
* **Grid** (``ratio``, ``image_area``): ``calculate_generate_size`` (processing_emu3.py l.254-261): for ratio
  ``"W:H"`` and ``image_area`` 518,400 px (Emu3-Gen's ``config.image_area``, passed by image_generation.py
  l.41), ``round(h * sqrt(area / (w h)) / 8)`` tokens (8 = the vision tokenizer's ``spatial_scale_factor``,
  ``2 ** (len(ch_mult) - 1)``): 90 x 90 tokens, 720 x 720 px at ``"1:1"``.
* **Unconditional stream** (``negative_prompt``): the negative prompt of image_generation.py l.32 run through
  the same template (l.46: ``processor(text=[NEGATIVE_PROMPT] * len(prompt), ...)``, its own header), as a
  second sequence whose positions start at 0 (transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor``
  runs it as its own batch). Both streams run here as one batch of 2, the shorter prefix left-padded and masked.
* **CFG** 3.0 (image_generation.py l.34): the reference guides log-softmaxed full-vocabulary scores,
  ``s (log p_c - log p_u) + log p_u``; restricted to visual tokens (the prefix constraint below) this differs
  from the shared pipeline's ``u + s (c - u)`` on raw visual-token logits by a constant per row, so the
  distributions are the same. **Top-k 2048** (l.55), temperature 1 (``do_sample=True``, no temperature).
* **Prefix constraint** (utils_emu3.py ``Emu3PrefixConstrainedLogitsHelper``, l.45-68): after
  ``<|image token|>`` only visual tokens, and ``<|extra_200|>`` (end of line) wherever the offset from the
  image token is a multiple of ``W + 1``, i.e. after every row, the last included; then ``<|extra_201|>``
  (end of frame), ``<|image end|>``, EOS. Decoders see visual tokens only (codes ``0..32767``, ids read from
  the ``<|visual token NNNNNN|>`` names); the end-of-line token is forced after every row exactly as
  Lumina-mGPT's end-of-row token (``LuminaCache``: image slot ``i`` sits at model offset ``i + i // W``, the
  first code of the next row is predicted by the end-of-line token's output), on the static decode path too
  (``EndOfRowBlocks``: the slots added on the device; ``static_prefill`` pads every stream to
  ``model.prompt_capacity``). The end-of-frame / image / text tokens are not needed for the grid and never run.
* **Decode**: ``Emu3VQVAE.decode`` of the (H, W) code grid (transformers' ``decode_image_tokens`` path), then
  the recipe's postprocess (``Emu3VisionVQImageProcessor.postprocess``: ``(x + 1) / 2 * 255``, clip, cast to
  uint8 = truncation; ``model.pixel_rounding=truncate``).

Deliberate deviation (as for every model here): the weights run in bf16 on CUDA without autocast, but
guidance, top-k and softmax are done in **float32** (``coolsd.sampling``); the reference does them in the
logits' bf16 dtype. The reference decodes with flash-attention-2; this adapter uses PyTorch's SDPA dispatch
(``model.attention_kernel=auto``).

Weights: ``BAAI/Emu3-Gen-hf``, the transformers conversion of ``BAAI/Emu3-Gen`` (language model) +
``BAAI/Emu3-VisionTokenizer`` (VQ) into one ``Emu3ForConditionalGeneration`` checkpoint with a
``tokenizer.json`` (transformers' ``convert_emu3_weights_to_hf.py``), fetched into the Hugging Face cache; no
repository code runs (the original repos need ``trust_remote_code``). ``pretrained=false`` builds a random
tiny model of ``arch`` sizes with a word-level tokenizer made in code (tests, ``model=emu3_tiny``).

Written after baaivision/Emu3 ``image_generation.py``, ``emu3/mllm/processing_emu3.py``,
``emu3/mllm/utils_emu3.py``, ``emu3/tokenizer/image_processing_emu3visionvq.py`` and transformers'
``models/emu3`` (``modeling_emu3.py``, ``processing_emu3.py``).

Example: ``python run.py model=emu3_gen decoder=coolsd``; ``python run.py model=emu3_tiny`` (random weights).
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from coolsd import validate
from coolsd.kv_cache import StaticKVCache
from coolsd.models.base import (
    ImageARModel,
    Runtime,
    hf_weights,
    layer_skipping,
    per_stream,
    pixels_to_uint8,
)
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.janus_pro import JanusDraftLayer, attention
from coolsd.models.lumina_mgpt import CodesInVocabulary, EndOfRowBlocks, LuminaCache, rotary_cos_sin
from coolsd.required_files import RequiredFile
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput

# Token names of Emu3's vocabulary (transformers' Emu3Processor / Emu3ImageVocabularyMapping; the tokenizer of
# BAAI/Emu3-Gen: bos <|extra_203|>, eos <|extra_204|>, pad <|endoftext|>, eol <|extra_200|>, eof <|extra_201|>).
BOS = "<|extra_203|>"
EOS = "<|extra_204|>"
PAD = "<|endoftext|>"
END_OF_LINE = "<|extra_200|>"
END_OF_FRAME = "<|extra_201|>"
IMAGE_START = "<|image start|>"
IMAGE_END = "<|image end|>"
IMAGE_TOKEN = "<|image token|>"
VISUAL_TOKEN = "<|visual token {code:06d}|>"  # processing_emu3.py l.70 visual_template
VISUAL_PATTERN = re.compile(r"<\|visual token (\d+)\|>")
# baaivision/Emu3 image_generation.py l.31-32
POSITIVE_PROMPT = " masterpiece, film grained, best quality."
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, "
                   "cropped, worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, "
                   "username, blurry.")
SIZE_TEMPLATE = "{H}*{W}"  # processing_emu3.py l.69 prefix_template
IMAGE_AREA = 518400  # BAAI/Emu3-Gen config.json image_area (= 720 x 720), image_generation.py l.41
SPATIAL_FACTOR = 8  # the vision tokenizer's spatial_scale_factor, 2 ** (len([1, 2, 2, 4]) - 1)
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.jinja")  # configs, weights, tokenizer files


def generate_size(ratio: str, image_area: int, spatial_factor: int) -> tuple[int, int]:
    """(height, width) in tokens for ``ratio`` ``"W:H"`` (processing_emu3.py ``calculate_generate_size``)."""
    try:
        w, h = (int(x) for x in ratio.split(":"))
    except ValueError as err:
        raise ValueError(f"model.ratio must look like '1:1' or '16:9' (width:height), got {ratio!r}") from err
    scale = (image_area / (h * w)) ** 0.5
    return int(round(h * scale / spatial_factor)), int(round(w * scale / spatial_factor))


def visual_code_ids(vocab: Mapping[str, int]) -> torch.Tensor:
    """BPE id of every VQ code (V,), read from the ``<|visual token NNNNNN|>`` names of the vocabulary."""
    codes = {}
    for name, bpe in vocab.items():
        match = VISUAL_PATTERN.fullmatch(name)
        if match:
            codes[int(match.group(1))] = int(bpe)
    if not codes or sorted(codes) != list(range(len(codes))):
        raise ValueError("the vocabulary's visual tokens <|visual token NNNNNN|> are missing or not 0..V-1; is it "
                         "Emu3's tokenizer?")
    return torch.tensor([codes[c] for c in range(len(codes))], dtype=torch.long)


# -- random-weight instances -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Emu3Arch:
    """Sizes of a random-weight Emu3 (``model.arch`` with ``model.pretrained=false``); defaults: tiny.

    The VQ's spatial factor is ``2 ** (len(vq_channel_multiplier) - 1)``: 8 as Emu3's, so the grid follows
    from ``ratio`` and ``image_area`` exactly as the reference computes it."""

    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 1000000.0  # Emu3-Gen's
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1024
    codebook_size: int = 256
    vq_embed_dim: int = 4
    vq_latent_channels: int = 4
    vq_base_channels: int = 32
    vq_channel_multiplier: Sequence[int] = (1, 1, 1, 2)
    vq_num_res_blocks: int = 1
    vq_attn_resolutions: Sequence[int] = ()
    init_std: float = 0.2  # N(0, init_std) for the language model's weights (HF's 0.02 gives flat logits)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.arch: hidden_size must be divisible by num_heads, num_heads by num_kv_heads")
        if self.vq_base_channels % 32:
            raise ValueError("model.arch.vq_base_channels must be a multiple of 32 (GroupNorm of 32 groups)")


def tiny_vocabulary(num_codes: int, words: Sequence[str]) -> dict[str, int]:
    """A small Emu3-style vocabulary: pad, words, digits and ``*``, the special tokens, then the visual tokens
    contiguous at the end as in Emu3's (ids ``151854 + code`` there)."""
    names = [PAD, "<unk>"]
    names += [w for w in dict.fromkeys([*words, *"0123456789*"]) if w not in names]
    names += [END_OF_LINE, END_OF_FRAME, BOS, EOS, IMAGE_TOKEN, IMAGE_START, IMAGE_END]
    names += [VISUAL_TOKEN.format(code=c) for c in range(num_codes)]
    return {name: i for i, name in enumerate(names)}


def tiny_words(*texts: str) -> list[str]:
    """The words and punctuation runs of ``texts`` as the tiny tokenizer splits them."""
    return [w for text in texts for w in re.findall(r"\w+|[^\w\s]+", text)]


TINY_TEXT = ("a photo of the red blue cat dog sky tree cube on table portrait young girl shiba inu",
             POSITIVE_PROMPT, NEGATIVE_PROMPT)


def tiny_tokenizer(vocab: Mapping[str, int]):
    """A whitespace word-level tokenizer over ``vocab`` with Emu3's special tokens split out (tiny models).

    Digits are split one by one, as Emu3's own tokenizer splits them (baaivision/Emu3
    ``emu3/mllm/tokenization_emu3.py`` ``PAT_STR``: its ``\\p{N}`` alternative matches a single digit), so the
    size header ``"{H}*{W}"`` takes one token per digit on both."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    specials = [n for n in vocab if n.startswith("<|")]
    backend.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD)


def emu3_config(arch: Emu3Arch, vocab: Mapping[str, int]):
    """The ``transformers.Emu3Config`` of a random-weight model of ``arch`` sizes over ``vocab``."""
    from transformers import Emu3Config

    text = {"vocab_size": len(vocab), "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
            "num_key_value_heads": arch.num_kv_heads, "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.rms_norm_eps, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
            "pad_token_id": vocab[PAD], "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS]}
    vq = {"codebook_size": arch.codebook_size, "embed_dim": arch.vq_embed_dim,
          "latent_channels": arch.vq_latent_channels, "base_channels": arch.vq_base_channels,
          "channel_multiplier": list(arch.vq_channel_multiplier), "num_res_blocks": arch.vq_num_res_blocks,
          "attn_resolutions": list(arch.vq_attn_resolutions),
          "hidden_size": arch.vq_base_channels * arch.vq_channel_multiplier[-1]}
    return Emu3Config(text_config=text, vq_config=vq, vocabulary_map=dict(vocab))


def random_emu3(arch: Emu3Arch, seed: int, dtype: torch.dtype):
    """(``Emu3ForConditionalGeneration`` with seeded random weights, its tokenizer) for ``arch``."""
    from transformers import Emu3ForConditionalGeneration

    vocab = tiny_vocabulary(arch.codebook_size, tiny_words(*TINY_TEXT))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Emu3ForConditionalGeneration._from_config(emu3_config(arch, vocab), dtype=dtype)
        for module in (*model.model.text_model.modules(), model.lm_head):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=arch.init_std)
    return model, tiny_tokenizer(vocab)


def load_pretrained(repo_id: str, revision: str | None, dtype: torch.dtype):
    """``(Emu3ForConditionalGeneration, tokenizer)`` of a transformers-format Emu3 repo (HF cache, offline-safe)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from transformers import Emu3ForConditionalGeneration, PreTrainedTokenizerFast

    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except (LocalEntryNotFoundError, OSError) as err:
        raise MissingWeightsError(
            f"Emu3 weights {repo_id} are not available (looked in the Hugging Face cache, $HF_HOME/hub; needs "
            "config.json, model.safetensors.index.json + shards, tokenizer.json). On a machine with network "
            f"access run: hf download {repo_id}" + (f" --revision {revision}" if revision else "")
            + " --include '*.json' '*.safetensors' '*.txt' '*.jinja' (or python scripts/prefetch.py "
            "model=emu3_gen); or set model.pretrained=false for a random-weight model") from err
    model, info = Emu3ForConditionalGeneration.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                               trust_remote_code=False, output_loading_info=True)
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        raise ValueError(f"{repo_id} ({path}) does not match transformers' Emu3 classes: "
                         + ", ".join(f"{k} {v[:6]} ({len(v)})" for k, v in problems.items())
                         + "; check the transformers version (requirements.txt) and model.revision")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    return model, tokenizer


class Emu3DraftLayer(JanusDraftLayer):
    """The EAGLE draft layer of an Emu3 target: one Llama layer (no input norm) as ``JanusDraftLayer``, rotated
    at the image-part position of ``x_{t+1}`` with the end-of-line gaps, ``(t + 1) + (t + 1) // W``, as
    Lumina-mGPT's ``ChameleonDraftLayer`` (the constant offset of the image part is left out)."""

    def __init__(self, text_config: Any, norm_eps: float, width: int) -> None:
        super().__init__(text_config, norm_eps)
        self.width = width

    def forward(self, h, positions, cache, mask):
        nxt = (positions if positions.device == h.device else positions.to(h.device)).long() + 1
        pos = nxt + torch.div(nxt, self.width, rounding_mode="floor")
        rope = self.rotary(h, pos if pos.dim() == 2 else pos[None])
        h = h + attention(self.self_attn, h, rope, cache, 0, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# -- the adapter -----------------------------------------------------------------------------------------
class Emu3Gen(EndOfRowBlocks, CodesInVocabulary, ImageARModel):
    """Emu3-Gen text-to-image adapter (see the module docstring); prompts are free text."""

    sjd_init = "random"
    spatial_orders = True  # image cells as positions (end-of-line slots added by LuminaCache), per-query masks
    stand_in_is_end_of_row = True  # a new row's first code is predicted by the row above's end-of-line token
    #: baaivision/Emu3 ``image_generation.py``: PyTorch's SDPA dispatch and TF32 defaults, pixels truncated
    runtime_defaults = Runtime()
    model_name = "Emu3"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the transformers-format snapshot ``load_pretrained`` reads."""
        if not cfg.get("pretrained", True) or not cfg.get("repo_id"):
            return []
        return [RequiredFile("Emu3-Gen weights + vision tokenizer + tokenizer", repo_id=str(cfg["repo_id"]),
                             patterns=HUB_PATTERNS, revision=cfg.get("revision"),
                             must_have=("config.json", "model.safetensors.index.json", "tokenizer.json"))]

    def __init__(
        self,
        sampling: dict | SamplingConfig,
        repo_id: str | None = None,
        revision: str | None = None,
        pretrained: bool = True,
        arch: dict | Emu3Arch | None = None,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        positive_prompt: str = POSITIVE_PROMPT,
        negative_prompt: str = NEGATIVE_PROMPT,
        ratio: str = "1:1",
        image_area: int = IMAGE_AREA,
        init_seed: int = 0,
        prompt_capacity: int = 256,
        runtime: Runtime | None = None,
    ) -> None:
        """``prompt_capacity``: the prefix width of the static decode path's prefill (``static_prefill``; BOS,
        prompt, positive prompt and image header, or the negative prompt's stream, whichever is longer)."""
        super().__init__(sampling, runtime)
        device, dtype = self.runtime.resolve(published=pretrained and model is None)
        self.positive_prompt, self.negative_prompt = positive_prompt, negative_prompt
        self.prompt_capacity = validate.integer("model.prompt_capacity", prompt_capacity, minimum=4)
        model, tokenizer = hf_weights(
            "Emu3", model, tokenizer, pretrained, arch, repo_id, "BAAI/Emu3-Gen-hf", "Emu3Arch",
            lambda: load_pretrained(repo_id, revision, dtype),
            lambda: random_emu3(arch if isinstance(arch, Emu3Arch) else Emu3Arch(**dict(arch)), init_seed, dtype))
        self.emu3 = model
        self.tokenizer = tokenizer
        self.lm = model.model.text_model  # Emu3TextModel
        self.vq = model.model.vqmodel  # Emu3VQVAE
        text = model.config.text_config
        spatial = 2 ** (len(model.config.vq_config.channel_multiplier) - 1)
        self.ratio, self.image_area = ratio, int(image_area)
        self.grid = generate_size(ratio, self.image_area, spatial)
        if min(self.grid) < 1:
            raise ValueError(f"model.image_area={image_area} gives an empty grid {self.grid} at ratio {ratio}")
        vocab = tokenizer.get_vocab()
        self.code_to_bpe_cpu = visual_code_ids(vocab)
        self.codebook_size = int(self.code_to_bpe_cpu.numel())
        if self.codebook_size != model.config.vq_config.codebook_size:
            raise ValueError(f"the tokenizer has {self.codebook_size} visual tokens but the vision tokenizer "
                             f"{model.config.vq_config.codebook_size} codes")
        self.ids = {name: self._token_id(vocab, name)
                    for name in (BOS, END_OF_LINE, IMAGE_START, IMAGE_TOKEN, PAD)}
        self.hidden_size = text.hidden_size
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = self.lm.layers[0].self_attn.head_dim
        self.active_layers = text.num_hidden_layers
        first = int(self.code_to_bpe_cpu[0])
        self.first_code_bpe = first
        self.contiguous_codes = bool(torch.equal(self.code_to_bpe_cpu,
                                                 torch.arange(first, first + self.codebook_size)))
        inv_freq, _ = type(self.lm.rotary_emb).compute_default_rope_parameters(text)
        if text.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError("only Emu3's default RoPE is supported")
        self.register_buffer("code_to_bpe", self.code_to_bpe_cpu.clone(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # float32: moved, never cast
        self.end_of_row_id = self.ids[END_OF_LINE]
        self._row_end_maps()
        self.requires_grad_(False)
        self.place(device, float32=(self.vq,))  # the vision tokenizer decodes in float32

    @staticmethod
    def _token_id(vocab: Mapping[str, int], name: str) -> int:
        if name not in vocab:
            raise ValueError(f"token {name!r} is missing from the Emu3 tokenizer")
        return int(vocab[name])

    # -- prompts ---------------------------------------------------------------------------------------
    def image_header_text(self) -> str:
        """``<|image start|>{H}*{W}<|image token|>`` (processing_emu3.py l.178-182)."""
        return IMAGE_START + SIZE_TEMPLATE.format(H=self.grid[0], W=self.grid[1]) + IMAGE_TOKEN

    def prompt_text(self, prompt: str, positive: bool = True) -> str:
        """BOS + prompt (+ the positive prompt) + the image header, as the reference processor writes it."""
        return BOS + prompt + (self.positive_prompt if positive else "") + self.image_header_text()

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if ids[0] != self.ids[BOS] or ids[-1] != self.ids[IMAGE_TOKEN]:
            raise ValueError("the tokenizer does not keep Emu3's BOS / <|image token|> as single tokens")
        return ids

    def prompt_ids(self, prompt: str) -> list[int]:
        """The conditional stream's prefix: BOS, prompt + positive prompt, image header."""
        return self.encode(self.prompt_text(prompt))

    def negative_ids(self) -> list[int]:
        """The unconditional stream's prefix: BOS, the negative prompt, the image header."""
        return self.encode(self.prompt_text(self.negative_prompt, positive=False))

    # -- the network ------------------------------------------------------------------------------------
    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, kv: StaticKVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Token ids (R, T) at model positions (R, T) -> post-norm hidden states (R, T, H)."""
        h = self.lm.embed_tokens(ids)
        rope = rotary_cos_sin(positions, self.inv_freq, h.dtype)
        for i, layer in enumerate(itertools.islice(self.lm.layers, self.active_layers)):
            h = h + attention(layer.self_attn, layer.input_layernorm(h), rope, kv, i, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm.norm(h)

    def _output(self, hidden: torch.Tensor) -> TargetOutput:
        hidden = per_stream(hidden, self.num_streams)
        return TargetOutput(logits=self.head(hidden), hidden=hidden)

    # -- the adapter interface -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[LuminaCache, TargetOutput]:
        return self._prefill(prompts, extra_slots, streams, None)

    def _prefill(self, prompts: list[str], extra_slots: int, streams: Streams | None,
                 width: int | None) -> tuple[LuminaCache, TargetOutput]:
        """``prefill`` with every stream left-padded to ``width`` prefix slots (None: the longest stream's); the
        static path (a width) takes the model-slot cache (``static_prefill``)."""
        s, b = self.num_streams, len(prompts)
        negative = self.negative_ids() if s == 2 else None
        seqs = [seq for p in prompts for seq in ([self.prompt_ids(p), negative] if s == 2 else [self.prompt_ids(p)])]
        p = self._prefix_width(prompts, seqs, width)  # every stream of every image left-padded to p slots
        rows = self.grid[0]
        kv = StaticKVCache(num_layers=self.active_layers, batch=b, streams=s, num_heads=self.num_kv_heads,
                           max_len=p + self.num_image_tokens + rows + 2 * extra_slots + 2, head_dim=self.head_dim,
                           dtype=self.lm.embed_tokens.weight.dtype, device=self.device)
        kv.prefix_len = p  # the prefix's model slots (``DeviceKVCache.prefix_len`` on the static path)
        pad_id = self.ids[PAD]
        ids = [[pad_id] * (p - len(seq)) + seq for seq in seqs]  # image-major: cond, uncond of each image
        positions = [[0] * (p - len(seq)) + list(range(len(seq))) for seq in seqs]  # from 0 at each start
        kv.set_padding(torch.tensor([[False] * (p - len(seq)) + [True] * len(seq) for seq in seqs]))
        mask = kv.begin_block(p)
        hidden = self._hidden(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                              kv, mask)
        if width is not None:
            return kv, self._output(hidden[:, -1:])
        bases = torch.tensor([len(seq) for seq in seqs], device=self.device).view(b, s).t()  # (S, B)
        cache = LuminaCache(kv=kv, prefix_len=p, width=self.grid[1], position_base=bases,
                            slot=[[] for _ in range(b)], newline=[[] for _ in range(b)])
        return cache, self._output(hidden[:, -1:])

    def token_embedding(self) -> nn.Module:
        return self.lm.embed_tokens

    def output_weight(self) -> torch.Tensor:
        return self.emu3.lm_head.weight

    def codebook(self) -> torch.Tensor:
        """The VQ codebook ``quantize.embedding.weight`` (V, embed_dim)."""
        return self.vq.quantize.embedding.weight.detach()

    @torch.inference_mode()
    def decode_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codes (B, N) in raster order -> the vision tokenizer's float images (B, 3, H, W), about [-1, 1]."""
        codes = tokens.reshape(-1, *self.grid).to(self.device)
        return self.vq.decode(codes).float()

    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return pixels_to_uint8(self.decode_pixels(tokens.reshape(1, -1))[0], self.pixel_rounding)

    def decode_images(self, tokens: torch.Tensor) -> torch.Tensor:
        return pixels_to_uint8(self.decode_pixels(tokens), self.pixel_rounding)

    def make_draft_layer(self, norm_eps: float | None = None) -> Emu3DraftLayer:
        text = self.emu3.config.text_config
        layer = Emu3DraftLayer(text, text.rms_norm_eps if norm_eps is None else norm_eps, self.grid[1])
        return layer.to(device=self.device, dtype=self.lm.embed_tokens.weight.dtype)


def layer_skip_copy(target: Emu3Gen, num_layers: int) -> Emu3Gen:
    """A draft model sharing the target's weights that runs only its first ``num_layers`` decoder layers."""
    return layer_skipping(target, num_layers, target.emu3.config.text_config.num_hidden_layers)
