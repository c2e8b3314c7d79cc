"""GLM-Image (Zhipu AI, 2026), the autoregressive first stage of ``zai-org/GLM-Image``, as an adapter.

The target runs on ``transformers``' GLM-Image classes (``GlmImageForConditionalGeneration``: a GLM-4-9B text
model with 2 KV heads, partial multi-axis rotary positions and an ``lm_head`` over the 16,512-token vision
vocabulary, whose first 16,384 ids are the visual codes). Like the Janus-Pro adapter it runs the decoder layers
itself over the HF modules' weights with the project's static KV cache (``JanusCache``: each image's prompt
length kept on the device) and applies ``lm_head`` to the code rows only. The tokens are rendered by the diffusion
decoder of ``diffusers``' GLM-Image pipeline (``model.pixel_decoder``; the ``glm_image`` extra).

What the adapter reproduces of the reference (diffusers ``pipelines/glm_image/pipeline_glm_image.py``
``generate_prior_tokens``; transformers ``models/glm_image`` ``processing_glm_image.py`` and
``modeling_glm_image.py`` ``get_rope_index``), each a model option:

* **Prompt.** The chat template writes the caption as it is; the processor appends the two target grids and the
  image-start token: ``{caption}<sop>{H} {W}<eop><sop>{h} {w}<eop><|dit_token_16384|>`` (``prepare_inputs_layout``),
  ``H x W`` the full grid (``model.height`` / ``model.width`` px at 32 px a token, ``_get_target_shape``) and
  ``h x w`` the preview grid, ``int(sqrt(H/W) * 16)`` x ``int(sqrt(W/H) * 16)`` (16 = ``model.preview_side``,
  the reference's ``factor // 2``); tokenized without added special tokens.
* **Layout.** Generation decodes the preview grid first and then the full grid, with no token between them,
  then the end-of-image token (``max_new_tokens = h w + H W + 1``; the pipeline keeps the full grid's tokens,
  ``_extract_large_image_tokens``). Here both grids are **one image sequence** of ``h w + H W`` codes that every
  decoder decodes (so every decoder speeds up the preview too, and AR, the speedup's denominator, decodes the same
  tokens as the reference); the decoders see it as a ``grid`` of ``h w / W + H`` rows of ``W`` codes (the
  preview's codes fill whole rows of the full grid's width, which the adapter requires: true at every square size
  whose width divides 256, e.g. 1024 px: 8 + 32 rows of 32; another size is refused, naming the keys). The
  preview's rows are a sequence layout, not its geometry: spatial heuristics (ZipAR's row windows, SJD's
  ``repeat_horizon`` init) read them as rows of ``W``; positions are always the model's own.
* **Multi-axis rotary positions** (``get_rope_index``): prompt token ``j`` at ``(j, j, j)`` (temporal, height,
  width; left padding masked, positions from 0 at each prompt's start); with ``P`` prompt tokens, preview cell
  ``(r, c)`` at ``(P, P + r, P + c)``, full-grid cell ``(r, c)`` at ``(Q, Q + r, Q + c)``, ``Q = P + max(h, w)``;
  the rotary frequencies split ``mrope_section`` ways (8 / 12 / 12 of 32 on the published model, cycling over the
  three axes) over the first ``partial_rotary_factor`` of each head.
* **No classifier-free guidance in this stage**: the pipeline calls ``generate(**inputs, do_sample=True)`` on one
  stream; guidance (1.5) belongs to the diffusion decoder. A ``sampling.cfg_scale`` other than 1 is refused.
* **Sampling** of the checkpoint's ``generation_config.json`` (as vllm-omni's GLM-Image tests restate it:
  ``temperature=0.9, top_p=0.75, top_k=16512``): temperature 0.9, top-p 0.75, no top-k (``top_k`` = the whole
  vision vocabulary).
* **Visual-token constraint**: decoders see codes ``0..16383`` only; the reference samples over all 16,512
  ``lm_head`` outputs, so it may draw the image-start / end-of-image id or an unused one inside a grid (and then
  stop early). Here the full sequence is always decoded: the end-of-image token is never run, and the grids hold
  codes only (a **deliberate deviation**, the visual-token restriction every adapter of this project makes).
* **Pixels** (``model.pixel_decoder=diffusers``): the full grid's codes, upsampled 2x nearest as the pipeline does
  (``_upsample_token_ids``), as ``prior_token_ids`` of ``diffusers.GlmImagePipeline`` (its DiT, VAE, glyph
  encoder and scheduler from the same repository) at its defaults: 50 steps, guidance 1.5, every image's noise
  drawn from ``model.pixel_seed`` alone (so its pixels do not depend on its batch). ``decode_images`` gets codes only, so the glyph encoder sees no quoted text (the
  pipeline's ``get_glyph_texts`` of an empty caption; deviation: prompts with quoted text lose that hint).
  ``tiny_diffusers`` builds a random tiny pipeline in process (tests); ``codes`` paints each code of the full grid
  in a colour from its codebook vector (plumbing without diffusers; not GLM-Image's pixels). A run with
  ``diffusers`` where diffusers is not installed stops before any weight is read, naming the extra.

Deliberate deviations besides those above: the weights run in bf16 on CUDA but top-p and softmax in float32
(``coolsd.sampling``; the reference works in the logits' dtype); PyTorch's SDPA dispatch.

Weights: ``zai-org/GLM-Image`` (a diffusers-format repository): the AR stage from ``vision_language_encoder/``, its
tokenizer from ``processor/``, fetched into the Hugging Face cache; the pixel decoder's ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/`` and ``scheduler/`` with ``pixel_decoder=diffusers``. ``pretrained=false`` builds
a random tiny model of ``arch`` sizes with a word-level tokenizer made in code (tests, ``model=glm_image_tiny``).

Written after transformers ``models/glm_image`` (``modeling_glm_image.py``, ``processing_glm_image.py``), diffusers
``pipelines/glm_image/pipeline_glm_image.py`` and vllm-omni's GLM-Image tests (the sampling settings).

Example: ``python run.py model=glm_image decoder=coolsd``; ``python run.py model=glm_image_tiny`` (random weights).
"""
from __future__ import annotations

import copy
import importlib.util
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coolsd import validate
from coolsd.models.base import (
    ImageARModel,
    Runtime,
    attention_context,
    hf_weights,
    layer_skipping,
    per_stream,
    pixels_to_uint8,
)
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.janus_pro import JanusCache
from coolsd.required_files import RequiredFile
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput

REPO_ID = "zai-org/GLM-Image"
AR_FOLDER = "vision_language_encoder"  # the AR stage's subfolder of the diffusers-format repository
TOKENIZER_FOLDER = "processor"
PIXEL_FOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
GRID_BOS = "<sop>"  # the processor's grid_bos_token
GRID_EOS = "<eop>"  # grid_eos_token
IMAGE_START = "<|dit_token_{code}|>"  # the tokenizer's bos_token is <|dit_token_16384|> (the image-start id)
FACTOR = 32  # px per AR token (processing_glm_image.py _get_target_shape)
PREVIEW_SIDE = 16  # the preview grid's side at ratio 1 (_get_target_shape: factor // 2)
PIXEL_DECODERS = ("diffusers", "tiny_diffusers", "codes")
EXTRA = "pip install -e '.[glm_image]'   (or: pip install diffusers==0.42.1)"


def target_shape(height: int, width: int, preview_side: int = PREVIEW_SIDE) -> tuple[int, int, int, int]:
    """``(H, W, h, w)``: the full grid and the preview grid in tokens for an image of ``height x width`` px
    (processing_glm_image.py ``_get_target_shape``, with ``preview_side`` for its ``factor // 2``)."""
    token_h, token_w = height // FACTOR, width // FACTOR
    if min(token_h, token_w) < 1:
        raise ValueError(f"model.height and model.width must be at least {FACTOR} px, got {height} x {width}")
    ratio = token_h / token_w
    return token_h, token_w, int(math.sqrt(ratio) * preview_side), int(math.sqrt(1 / ratio) * preview_side)


def image_positions(grid: tuple[int, int], preview: tuple[int, int], extra: int) -> torch.Tensor:
    """Each image token's rotary position (N + extra, 3) relative to the prompt length ``P`` (add ``P`` to all
    three): the preview grid at base 0, the full grid at base ``max(h, w)``, cell ``(r, c)`` at ``(b, b + r,
    b + c)`` (modeling_glm_image.py ``get_rope_index``'s decode positions); ``extra`` positions after the last
    token continue from the end marker ``(e, e, e)``, ``e = max(h, w) + max(H, W)`` (never an image token's)."""
    rows = []
    base = 0
    for h, w in (preview, grid):
        r = torch.arange(h).repeat_interleave(w)
        c = torch.arange(w).repeat(h)
        rows.append(torch.stack([torch.full_like(r, base), base + r, base + c], dim=-1))
        base += max(h, w)
    tail = base + torch.arange(extra)
    rows.append(tail[:, None].expand(-1, 3))
    return torch.cat(rows)


def mrope_axes(section: Sequence[int]) -> torch.Tensor:
    """The position axis (0 temporal, 1 height, 2 width) of each rotary frequency: chunk ``i`` of
    ``mrope_section`` reads axis ``i % 3`` (``GlmImageTextRotaryEmbedding.recomposition_frequencies``)."""
    return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])


def rotary(pos3: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (R, T, rotary_dim) of positions ``pos3`` (R, T, 3), the float32 arithmetic of
    ``GlmImageTextRotaryEmbedding.forward`` (its attention scaling is 1 for the default type)."""
    angles = pos3.index_select(-1, axes).float() * inv_freq  # (R, T, F): frequency f on its axis
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def attention(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any, layer: int,
              mask: torch.Tensor | None) -> torch.Tensor:
    """Self-attention of a ``GlmImageTextAttention`` (its biased q/k/v projections, partial rotary) on ``x``
    (R, T, H); K/V through ``cache.write`` (``None``: causal over ``x``), ``mask`` from ``cache.begin_block``."""
    from transformers.models.glm_image.modeling_glm_image import apply_rotary_pos_emb

    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)  # (R, Hq, T, D)
    k = attn.k_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)  # (R, Hkv, T, D)
    v = attn.v_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rope)
    if cache is not None:
        k, v = cache.write(layer, k, v)  # (R, Hkv, end, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None and mask is None,
                                         scale=attn.scaling, enable_gqa=attn.num_key_value_groups > 1)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def decoder_layer(layer: nn.Module, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any, i: int,
                  mask: torch.Tensor | None, input_norm: bool = True) -> torch.Tensor:
    """One ``GlmImageTextDecoderLayer``: sandwich norms around attention and the gated MLP (``input_norm=False``:
    an EAGLE draft layer, whose fused input has no input norm)."""
    x = layer.input_layernorm(h) if input_norm else h
    h = h + layer.post_self_attn_layernorm(attention(layer.self_attn, x, rope, cache, i, mask))
    return h + layer.post_mlp_layernorm(layer.mlp(layer.post_attention_layernorm(h)))


# -- random-weight instances -----------------------------------------------------------------------------
@dataclass(frozen=True)
class GlmImageArch:
    """Sizes of a random-weight GLM-Image AR stage (``model.arch`` with ``model.pretrained=false``); defaults: tiny.
    ``mrope_section`` must sum to ``head_dim * partial_rotary_factor / 2``."""

    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 128
    partial_rotary_factor: float = 0.5  # GLM-4's
    mrope_section: Sequence[int] = (2, 3, 3)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    codebook_size: int = 256
    extra_vision_tokens: int = 8  # ids after the codes in the vision vocabulary (image start / end, unused)
    vq_embed_dim: int = 8
    init_std: float = 0.2  # N(0, init_std) for the text model's weights (HF's 0.02 gives flat logits)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.arch: hidden_size must be divisible by num_heads, num_heads by num_kv_heads")
        rot = int(self.hidden_size // self.num_heads * self.partial_rotary_factor)
        if 2 * sum(self.mrope_section) != rot:
            raise ValueError(f"model.arch.mrope_section must sum to {rot // 2} (half the rotary dimensions)")
        if self.extra_vision_tokens < 2:
            raise ValueError("model.arch.extra_vision_tokens must be at least 2 (image start and end)")


TINY_TEXT = "a photo of the red blue cat dog sky tree cube on table portrait young girl shiba inu"


def tiny_vocabulary(arch: GlmImageArch, words: Sequence[str]) -> dict[str, int]:
    """A small GLM-Image-style vocabulary: the visual codes at ids ``0..V-1`` and the image start / end after them
    (``<|dit_token_N|>``, as the published vocabulary's first 16,386 ids), the rest of the vision vocabulary, then
    pad, unknown, the grid markers, digits and words."""
    v = arch.codebook_size
    names = [IMAGE_START.format(code=c) for c in range(v + arch.extra_vision_tokens)]
    names += ["<pad>", "<unk>", GRID_BOS, GRID_EOS]
    names += [w for w in dict.fromkeys([*"0123456789", *words]) if w not in names]
    return {name: i for i, name in enumerate(names)}


def tiny_tokenizer(vocab: Mapping[str, int], image_start: str):
    """A whitespace word-level tokenizer over ``vocab`` with the special tokens split out (tiny models)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    specials = [n for n in vocab if n.startswith("<") and n.endswith(">")]
    backend.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=image_start,
                                   pad_token="<pad>")


def glm_image_config(arch: GlmImageArch, vocab: Mapping[str, int]):
    """The ``transformers.GlmImageConfig`` of a random-weight model of ``arch`` sizes over ``vocab`` (a one-block
    vision encoder, which text-to-image never runs)."""
    from transformers import GlmImageConfig

    v = arch.codebook_size
    text = {"vocab_size": len(vocab), "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
            "num_key_value_heads": arch.num_kv_heads, "rms_norm_eps": arch.rms_norm_eps,
            "max_position_embeddings": 4096, "attention_dropout": 0.0,
            "vision_vocab_size": v + arch.extra_vision_tokens, "pad_token_id": vocab["<pad>"], "eos_token_id": v + 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta,
                                "partial_rotary_factor": arch.partial_rotary_factor,
                                "mrope_section": list(arch.mrope_section)}}
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "image_size": 32,
              "patch_size": 16}
    vq = {"embed_dim": arch.vq_embed_dim, "num_embeddings": v, "latent_channels": 32}
    return GlmImageConfig(text_config=text, vision_config=vision, vq_config=vq, image_start_token_id=v,
                          image_end_token_id=v + 1, image_token_id=vocab["<unk>"])


def random_glm_image(arch: GlmImageArch, seed: int, dtype: torch.dtype):
    """(``GlmImageForConditionalGeneration`` with seeded random weights, its tokenizer) for ``arch``."""
    from transformers import GlmImageForConditionalGeneration

    vocab = tiny_vocabulary(arch, TINY_TEXT.split())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GlmImageForConditionalGeneration._from_config(glm_image_config(arch, vocab), dtype=dtype)
        for module in (*model.model.language_model.modules(), model.lm_head):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=arch.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.normal_(module.bias, mean=0.0, std=arch.init_std)
        nn.init.normal_(model.model.vqmodel.quantize.embedding.weight)
    return model, tiny_tokenizer(vocab, IMAGE_START.format(code=arch.codebook_size))


def snapshot(repo_id: str, revision: str | None, folders: Sequence[str], what: str) -> str:
    """The local snapshot of ``folders`` of ``repo_id`` (Hugging Face cache, offline-safe), or one
    ``MissingWeightsError`` naming what is missing and the command that fetches it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = [f"{folder}/*" for folder in folders]
    try:
        return snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns)
    except (LocalEntryNotFoundError, OSError) as err:
        raise MissingWeightsError(
            f"GLM-Image {what} ({repo_id}: {', '.join(f + '/' for f in folders)}) are not available (looked in the "
            "Hugging Face cache, $HF_HOME/hub). On a machine with network access run: hf download "
            f"{repo_id}" + (f" --revision {revision}" if revision else "") + " --include "
            + " ".join(f"'{p}'" for p in patterns) + " (or python scripts/prefetch.py model=glm_image); or set "
            "model.pretrained=false for a random-weight model") from err


def load_pretrained(repo_id: str, revision: str | None, dtype: torch.dtype):
    """``(GlmImageForConditionalGeneration, tokenizer)`` of the AR stage of a diffusers-format GLM-Image repo."""
    from transformers import GlmImageForConditionalGeneration, PreTrainedTokenizerFast

    path = snapshot(repo_id, revision, (AR_FOLDER, TOKENIZER_FOLDER), "AR-stage weights and tokenizer")
    model, info = GlmImageForConditionalGeneration.from_pretrained(
        f"{path}/{AR_FOLDER}", dtype=dtype, use_safetensors=True, trust_remote_code=False, output_loading_info=True)
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        raise ValueError(f"{repo_id}/{AR_FOLDER} does not match transformers' GLM-Image classes: "
                         + ", ".join(f"{k} {v[:6]} ({len(v)})" for k, v in problems.items())
                         + "; check the transformers version (requirements.txt) and model.revision")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/{TOKENIZER_FOLDER}/tokenizer.json")
    return model, tokenizer


def require_diffusers() -> None:
    """Stop, naming the extra, where diffusers' GLM-Image pipeline cannot be imported."""
    if importlib.util.find_spec("diffusers") is None:
        raise ImportError("GLM-Image renders its tokens with diffusers' GlmImagePipeline (model.pixel_decoder="
                          f"diffusers), and diffusers is not installed here. Install the extra: {EXTRA}. For "
                          "speed-only runs without pixels: model.pixel_decoder=codes eval.save_images=false")


def tiny_pixel_pipeline(seed: int = 0):
    """A ``diffusers.GlmImagePipeline`` of tiny random modules (a 2-layer DiT over the AR codes, a 4-level VAE,
    a one-layer T5 glyph encoder, ByT5's byte tokenizer) for tests: the path from codes to pixels, no download."""
    require_diffusers()
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = GlmImageTransformer2DModel(
            patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            text_embed_dim=16, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=16384)
        # 8x down-sampling (4 levels) and the DiT's 2x2 patches: 16 px a patch, one patch per upsampled AR code
        vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8,) * 4, layers_per_block=1,
                            latent_channels=4, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2))
    for module in (transformer, vae, text_encoder):
        module.eval()  # built in training mode: T5's dropout would draw
    return GlmImagePipeline(tokenizer=ByT5Tokenizer(), processor=None, text_encoder=text_encoder,
                            vision_language_encoder=None, vae=vae, transformer=transformer,
                            scheduler=FlowMatchEulerDiscreteScheduler())


def load_pixel_pipeline(repo_id: str, revision: str | None, dtype: torch.dtype, device: torch.device):
    """``diffusers.GlmImagePipeline`` without its AR stage: the DiT, VAE, glyph encoder and scheduler of the repo."""
    require_diffusers()
    from diffusers import GlmImagePipeline

    path = snapshot(repo_id, revision, PIXEL_FOLDERS, "diffusion decoder (pixel_decoder=diffusers)")
    pipe = GlmImagePipeline.from_pretrained(path, vision_language_encoder=None, processor=None, dtype=dtype)
    return pipe.to(device)


class GlmImageDraftLayer(nn.Module):
    """The EAGLE draft layer of a GLM-Image target: one ``GlmImageTextDecoderLayer`` of the text model's size
    without its input norm (the first layer of EAGLE's drafter reads the ``fc``-fused input). The pair
    ``(f_t, x_{t+1})`` at pair position ``t`` is rotated at the multi-axis position of image token ``t + 1``
    (``image_positions``; the prompt length, the same on all three axes, is left out: rotary attention sees
    differences only)."""

    def __init__(self, text_config: Any, norm_eps: float, positions: torch.Tensor, axes: torch.Tensor,
                 inv_freq: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.glm_image.modeling_glm_image import GlmImageTextDecoderLayer

        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers = 1
        cfg.rms_norm_eps = norm_eps
        base = GlmImageTextDecoderLayer(cfg, layer_idx=0)
        self.self_attn, self.mlp = base.self_attn, base.mlp
        self.post_self_attn_layernorm = base.post_self_attn_layernorm
        self.post_attention_layernorm = base.post_attention_layernorm
        self.post_mlp_layernorm = base.post_mlp_layernorm
        self.register_buffer("positions", positions.clone(), persistent=False)
        self.register_buffer("axes", axes.clone(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = self.self_attn.head_dim
        self.intermediate_size = cfg.intermediate_size

    def _apply(self, fn, recurse=True):
        kept = self.inv_freq  # float32: moved, never cast
        super()._apply(fn, recurse)
        self.inv_freq = kept.to(self.positions.device)
        return self

    def forward(self, h, positions, cache, mask):
        index = (positions + 1).clamp(0, self.positions.shape[0] - 1)
        pos3 = self.positions[index if index.dim() == 2 else index[None]]  # (1|R, T, 3)
        rope = rotary(pos3, self.inv_freq, self.axes, h.dtype)
        return decoder_layer(self, h, rope, cache, 0, mask, input_norm=False)


# -- the adapter -----------------------------------------------------------------------------------------
class GlmImage(ImageARModel):
    """GLM-Image's AR stage as a text-to-image adapter (see the module docstring); prompts are free text."""

    sjd_init = "random"
    spatial_orders = True  # any cells as positions (a position table), per-query masks over a static cache
    #: the AR stage's reference: PyTorch's SDPA dispatch and TF32 defaults; pixels as diffusers' ``numpy_to_pil``
    #: rounds them (``(x * 255).round()``: half to even)
    runtime_defaults = Runtime(pixel_rounding="half_even")
    model_name = "GLM-Image"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the AR stage and its tokenizer; with ``pixel_decoder=diffusers`` the pixel decoder."""
        files = []
        repo, revision = cfg.get("repo_id"), cfg.get("revision")
        if cfg.get("pretrained", True) and repo:
            files.append(RequiredFile("GLM-Image AR stage + tokenizer", repo_id=str(repo), revision=revision,
                                      patterns=(f"{AR_FOLDER}/*", f"{TOKENIZER_FOLDER}/*"),
                                      must_have=(f"{AR_FOLDER}/config.json",
                                                 f"{AR_FOLDER}/model.safetensors.index.json",
                                                 f"{TOKENIZER_FOLDER}/tokenizer.json")))
        if cfg.get("pixel_decoder") == "diffusers" and repo:
            files.append(RequiredFile("GLM-Image diffusion decoder (DiT, VAE, glyph encoder)", repo_id=str(repo),
                                      revision=revision, patterns=tuple(f"{f}/*" for f in PIXEL_FOLDERS),
                                      must_have=("transformer/config.json", "vae/config.json",
                                                 "scheduler/scheduler_config.json")))
        return files

    @classmethod
    def stand_in_config(cls, node: Mapping[str, Any]) -> dict[str, Any]:
        """A tiny random stand-in with the configured layout, for the run's preflight (no weights read; a
        ``pixel_decoder`` that needs diffusers is still refused where it is missing)."""
        return {"pretrained": False, "arch": {}, "repo_id": None}

    def __init__(
        self,
        sampling: dict | SamplingConfig,
        repo_id: str | None = None,
        revision: str | None = None,
        pretrained: bool = True,
        arch: dict | GlmImageArch | None = None,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        height: int = 1024,
        width: int = 1024,
        preview_side: int = PREVIEW_SIDE,
        pixel_decoder: str = "diffusers",
        pixel_steps: int = 50,
        pixel_guidance: float = 1.5,
        pixel_seed: int = 0,
        init_seed: int = 0,
        prompt_capacity: int = 256,
        runtime: Runtime | None = None,
    ) -> None:
        """``height`` / ``width``: the image in px (the processor's ``target_h`` / ``target_w``); ``preview_side``:
        the preview grid's side at ratio 1 (the reference's 16); ``pixel_decoder`` (``PIXEL_DECODERS``) and its
        ``pixel_steps``, ``pixel_guidance``, ``pixel_seed``: the diffusion decoder's settings;
        ``prompt_capacity``: the prompt width of the static decode path's prefill."""
        super().__init__(sampling, runtime)
        self.pixel_decoder = validate.choice("model.pixel_decoder", pixel_decoder, PIXEL_DECODERS)
        if self.pixel_decoder != "codes":
            require_diffusers()  # before any weight is read
        if self.sampling.guided:
            raise ValueError("GLM-Image's AR stage samples one stream without classifier-free guidance (the "
                             "diffusion decoder guides, model.pixel_guidance): set sampling.cfg_scale=1.0")
        device, dtype = self.runtime.resolve(published=pretrained and model is None)
        self.prompt_capacity = validate.integer("model.prompt_capacity", prompt_capacity, minimum=2)
        self.pixel_steps = validate.integer("model.pixel_steps", pixel_steps, minimum=1)
        self.pixel_guidance = float(validate.number("model.pixel_guidance", pixel_guidance, minimum=0.0))
        self.pixel_seed = validate.integer("model.pixel_seed", pixel_seed, minimum=0)
        self.repo_id, self.revision = repo_id, revision
        self.height = validate.integer("model.height", height, minimum=FACTOR)
        self.width = validate.integer("model.width", width, minimum=FACTOR)
        self.preview_side = validate.integer("model.preview_side", preview_side, minimum=1)
        big_h, big_w, small_h, small_w = target_shape(self.height, self.width, self.preview_side)
        if small_h < 1 or small_w < 1 or (small_h * small_w) % big_w:
            raise ValueError(f"model.height={height}, model.width={width}: the preview grid {small_h} x {small_w} "
                             f"does not fill whole rows of the full grid's width {big_w}, which this adapter's "
                             "one-sequence layout needs (module docstring): choose a square size whose width in "
                             f"tokens ({FACTOR} px each) divides {small_h * small_w}, e.g. 1024 x 1024")
        self.full_grid, self.preview_grid = (big_h, big_w), (small_h, small_w)
        self.preview_tokens = small_h * small_w
        self.grid = (self.preview_tokens // big_w + big_h, big_w)
        model, tokenizer = hf_weights(
            "GLM-Image", model, tokenizer, pretrained, arch, repo_id, REPO_ID, "GlmImageArch",
            lambda: load_pretrained(repo_id, revision, dtype),
            lambda: random_glm_image(arch if isinstance(arch, GlmImageArch) else GlmImageArch(**dict(arch)),
                                     init_seed, dtype))
        self.glm = model
        self.tokenizer = tokenizer
        self.lm = model.model.language_model  # GlmImageTextModel
        config, text = model.config, model.config.text_config
        self.codebook_size = int(config.vq_config.num_embeddings)
        if config.image_start_token_id != self.codebook_size or text.vision_vocab_size <= self.codebook_size + 1:
            raise ValueError("the vision vocabulary must hold the codes at 0..V-1 and image start / end at V, V + 1 "
                             "(GLM-Image's layout); is this a GLM-Image checkpoint?")
        self.image_start_id = int(config.image_start_token_id)
        rope = text.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise ValueError("only GLM-Image's default (multi-axis) rotary type is supported")
        inv_freq, _ = type(self.lm.rotary_emb).compute_default_rope_parameters(text)
        axes = mrope_axes(rope.get("mrope_section", [8, 12, 12]))
        if axes.numel() != inv_freq.numel():
            raise ValueError(f"mrope_section {rope.get('mrope_section')} does not cover the {inv_freq.numel()} "
                             "rotary frequencies")
        self.ids = {name: self._token_id(name) for name in (GRID_BOS, GRID_EOS)}
        self.pad_id = int(text.pad_token_id)
        self.hidden_size = text.hidden_size
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = self.lm.layers[0].self_attn.head_dim
        self.active_layers = text.num_hidden_layers
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # float32: moved, never cast
        self.register_buffer("axes", axes, persistent=False)
        self.register_buffer("image_pos", image_positions(self.full_grid, self.preview_grid, 256), persistent=False)
        self.pixels = None  # the diffusion pipeline, built on first use (decode_images)
        self.requires_grad_(False)
        self.place(device, dtype)
        self.inv_freq = inv_freq.float().to(device)

    def _token_id(self, name: str) -> int:
        token = self.tokenizer.convert_tokens_to_ids(name)
        if token is None or token == self.tokenizer.unk_token_id:
            raise ValueError(f"token {name!r} is missing from the GLM-Image tokenizer")
        return int(token)

    # -- prompts ---------------------------------------------------------------------------------------
    def prompt_text(self, prompt: str) -> str:
        """The caption + both target grids + the image-start token (processing_glm_image.py
        ``prepare_inputs_layout``, text-to-image)."""
        (big_h, big_w), (small_h, small_w) = self.full_grid, self.preview_grid
        return (f"{prompt}{GRID_BOS}{big_h} {big_w}{GRID_EOS}{GRID_BOS}{small_h} {small_w}{GRID_EOS}"
                + IMAGE_START.format(code=self.image_start_id))

    def prompt_ids(self, prompt: str) -> list[int]:
        ids = list(self.tokenizer.encode(self.prompt_text(prompt), add_special_tokens=False))
        if not ids or ids[-1] != self.image_start_id:
            raise ValueError("the tokenizer does not keep GLM-Image's image-start token as the prompt's last token")
        return ids

    # -- the network ------------------------------------------------------------------------------------
    def _layers(self, h: torch.Tensor, pos3: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> torch.Tensor:
        """Embeddings (R, T, H) at positions (R, T, 3) -> post-norm hidden states (R, T, H)."""
        rope = rotary(pos3, self.inv_freq, self.axes, h.dtype)
        for i, layer in enumerate(itertools.islice(self.lm.layers, self.active_layers)):
            h = decoder_layer(layer, h, rope, cache, i, mask)
        return self.lm.norm(h)

    def _output(self, hidden: torch.Tensor) -> TargetOutput:
        hidden = per_stream(hidden, self.num_streams)
        return TargetOutput(logits=self.head(hidden), hidden=hidden)

    # -- the adapter interface -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[JanusCache, TargetOutput]:
        """The prompts left-padded to the longest of the batch (the padding masked)."""
        return self._prefill(prompts, extra_slots, None)

    @torch.inference_mode()
    def static_prefill(self, prompts: list[str], extra_slots: int = 64,
                       streams: Streams | None = None) -> tuple[JanusCache, TargetOutput]:
        """``prefill`` with every prompt left-padded to ``model.prompt_capacity``; a longer prompt is refused."""
        return self._prefill(prompts, extra_slots, self.prompt_capacity)

    def _prefill(self, prompts: list[str], extra_slots: int, width: int | None) -> tuple[JanusCache, TargetOutput]:
        seqs = [self.prompt_ids(p) for p in prompts]
        lengths = torch.tensor([len(s) for s in seqs])
        if width is None:
            width = int(lengths.max())
        elif int(lengths.max()) > width:
            i = int(lengths.argmax())
            raise ValueError(f"prompt {prompts[i]!r} is {int(lengths[i])} tokens long (grid header and image start "
                             f"included), more than model.prompt_capacity={width}, the prompt width of the static "
                             f"decode path: set model.prompt_capacity={int(lengths.max())} or more, or "
                             "decoder.path=eager")
        b = len(prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq)
        pad = (width - lengths)[:, None]  # (B, 1)
        ramp = (torch.arange(width)[None, :] - pad).clamp_min(0)  # (B, P): from 0 at each prompt's start
        cache = JanusCache(prefix_lens=lengths.to(self.device), num_layers=self.active_layers, batch=b, streams=1,
                           num_heads=self.num_kv_heads, max_len=width + self.num_image_tokens + extra_slots,
                           head_dim=self.head_dim, dtype=self.lm.embed_tokens.weight.dtype, device=self.device)
        cache.set_padding((torch.arange(width)[None, :] >= pad).to(self.device))
        mask = cache.begin_block(width)
        h = self.lm.embed_tokens(ids.to(self.device))  # (B, P, H)
        hidden = self._layers(h, ramp[..., None].expand(-1, -1, 3).to(self.device), cache, mask)
        return cache, self._output(hidden[:, -1:])

    @torch.inference_mode()
    def forward_block(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        device = self.device
        with self.decode_context():
            return self.static_forward(cache, tokens.to(device), positions.to(device), tree_mask)

    def decode_context(self):
        return attention_context(self.attention_kernel)

    def static_forward(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        """``forward_block`` without its context and copies (the static path's forward over a ``DeviceKVCache``):
        image token ``i`` at ``image_pos[i]`` + its prompt's length on all three axes."""
        h = self.embed(tokens)  # (B, T, H)
        index = positions.clamp(0, self.image_pos.shape[0] - 1)
        pos3 = self.image_pos[index] + cache.prefix_lens[:, None, None]  # (B, T, 3)
        mask = cache.begin_block(tokens.shape[1], tree_mask)
        return self._output(self._layers(h, pos3, cache, mask))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codes are token ids ``0..V-1`` of the text model's embedding."""
        return self.lm.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head``'s code rows (the first V of the vision vocabulary), at least float32."""
        logits = F.linear(hidden, self.glm.lm_head.weight[: self.codebook_size])
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def codebook(self) -> torch.Tensor:
        """The VQ codebook ``vqmodel.quantize.embedding.weight`` (V, 2048 published), raw."""
        return self.glm.model.vqmodel.quantize.embedding.weight.detach()

    def full_grid_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """The full grid's codes (B, H, W) of image sequences (B, N) (the preview's dropped, as the pipeline's
        ``_extract_large_image_tokens``)."""
        return tokens[:, self.preview_tokens:].reshape(-1, *self.full_grid)

    @torch.inference_mode()
    def decode_float(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image sequences (B, N) -> float images (B, 3, height, width) in [0, 1] (``model.pixel_decoder``)."""
        codes = self.full_grid_codes(tokens.reshape(-1, self.num_image_tokens).to(self.device))
        if self.pixel_decoder == "codes":
            colours = self.codebook()[:, :3].float()
            colours = (colours - colours.min(0).values) / (colours.max(0).values - colours.min(0).values + 1e-12)
            image = colours[codes].permute(0, 3, 1, 2)  # (B, 3, H, W)
            return F.interpolate(image, size=(self.height, self.width), mode="nearest")
        if self.pixels is None:
            self.pixels = (tiny_pixel_pipeline() if self.pixel_decoder == "tiny_diffusers"
                           else load_pixel_pipeline(self.repo_id or REPO_ID, self.revision,
                                                    self.lm.embed_tokens.weight.dtype, self.device))
            self.pixels.set_progress_bar_config(disable=True)
        prior = F.interpolate(codes[:, None].float(), scale_factor=2, mode="nearest").long().flatten(1)
        # one generator per image, each seeded alike: an image's diffusion noise does not depend on its batch
        generator = [torch.Generator(device=self.device).manual_seed(self.pixel_seed) for _ in range(len(codes))]
        out = self.pixels(prompt=[""] * codes.shape[0], prior_token_ids=prior, height=self.height, width=self.width,
                          num_inference_steps=self.pixel_steps, guidance_scale=self.pixel_guidance,
                          generator=generator, output_type="pt")
        return out.images.float()

    def decode_images(self, tokens: torch.Tensor) -> torch.Tensor:
        return pixels_to_uint8(self.decode_float(tokens) * 2 - 1, self.pixel_rounding)

    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode_images(tokens.reshape(1, -1))[0]

    def make_draft_layer(self, norm_eps: float | None = None) -> GlmImageDraftLayer:
        text = self.glm.config.text_config
        layer = GlmImageDraftLayer(text, text.rms_norm_eps if norm_eps is None else norm_eps, self.image_pos,
                                   self.axes, self.inv_freq)
        return layer.to(device=self.device, dtype=self.lm.embed_tokens.weight.dtype)


def layer_skip_copy(target: GlmImage, num_layers: int) -> GlmImage:
    """A draft model sharing the target's weights that runs only its first ``num_layers`` decoder layers."""
    return layer_skipping(target, num_layers, target.glm.config.text_config.num_hidden_layers)
