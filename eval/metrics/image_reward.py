"""ImageReward (``ImageReward-v1.0``): a learned human-preference score of a text-to-image pair.

What it is: BLIP's ViT-L/16 image encoder (224 px) feeds, through cross-attention, a BERT-base text encoder
(BLIP's "med" configuration); the first output token of the prompt ([CLS]) goes through a 5-layer linear
head, and the reward is normalised as ``(reward - mean) / std`` with the constants ImageReward ships. This is
the "IR" column of the COOL-SD / LANTERN tables. The network is implemented here (modules named as in the
checkpoint, so ``ImageReward.pt`` loads strictly with no key map); the PyPI ``image-reward`` package is not
used (it does not install beside open_clip 3.x nor import under transformers 5; issue 19).

Source: Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation"
(NeurIPS 2023); weights ``ImageReward.pt`` + ``med_config.json`` on the Hugging Face hub
``THUDM/ImageReward``, tokenizer ``bert-base-uncased``.
Written after THUDM/ImageReward ImageReward/ImageReward.py, ImageReward/utils.py,
ImageReward/models/BLIP/{blip.py, blip_pretrain.py, vit.py, med.py}, train/src/ImageReward.py,
train/src/config/med_config.json (studied, not copied).

Reference facts this module relies on (each checked against that code):
- image: ``Resize(224, BICUBIC)`` on the shorter side, ``CenterCrop(224)``, then RGB, ``ToTensor``,
  ``Normalize`` with CLIP's mean/std (``_transform`` in ImageReward.py; resize/crop happen before the RGB
  conversion, kept in that order here).
- text: ``BertTokenizer('bert-base-uncased')`` with ``[DEC]`` added as bos token and ``[ENC]`` as an
  additional special token (vocabulary 30,524, as ``med_config.json``), ``padding="max_length",
  truncation=True, max_length=35``. ImageReward's ``score`` feeds ``input_ids`` unchanged: the first token is
  ``[CLS]``. BLIP's ITM/retrieval models overwrite it with ``enc_token_id``; ImageReward does **not**, neither
  in inference (``ImageReward.score``/``inference_rank``) nor in training (``train/src/ImageReward.py``,
  ``rank_pair_dataset.py``), so this module does not either.
- text encoder: ``BertModel(med_config, add_pooling_layer=False)`` with ``encoder_width`` set to the ViT
  width (1024) by ``BLIP_Pretrain``; bidirectional self-attention (padding mask ``(1 - m) * -10000``), then
  cross-attention to all 197 image tokens (mask of ones), GELU feed-forward; word + absolute position
  embeddings (med.py has no token-type embedding).
- head: ``MLP(768)`` = Linear 768→1024, Dropout, 1024→128, Dropout, 128→64, Dropout, 64→16, 16→1 with
  no activations (they are commented out in the reference); mean 0.16717362830052426, std
  1.0333394966054072.
- checkpoint: ``torch.save(ImageReward.state_dict())`` of the training model, loaded by the reference with
  ``strict=False``. Beyond what the scorer uses it holds BLIP's contrastive projections
  ``blip.vision_proj.*`` / ``blip.text_proj.*`` (built by ``BLIP_Pretrain``, never called by ``score``) and
  the constant buffer ``blip.text_encoder.embeddings.position_ids``; those five keys are dropped by name
  (:data:`UNUSED_CHECKPOINT_KEYS`, the buffer after checking it is ``arange``) and everything else must match
  exactly (``load_state_dict(strict=True)``).

Example::

    from eval.metrics.image_reward import ImageReward
    metric = ImageReward()                    # hub:THUDM/ImageReward, bert-base-uncased
    metric.preflight()                        # resolves files only; raises with the fetch command
    metric.compute(["a.png"], ["a red bus"], device="cuda")
    # -> {"image_reward": ..., "image_reward_num_images": 1}

Fetch the files on a machine with network access:
``hf download THUDM/ImageReward ImageReward.pt med_config.json`` and
``hf download bert-base-uncased vocab.txt tokenizer_config.json``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coolsd.models.checkpoints import MissingWeightsError, hub_file, load_state_dict
from coolsd.required_files import RequiredFile
from eval.metrics.base import MeanScore

HUB_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
TOKENIZER_REPO = "bert-base-uncased"
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json")  # vocab.txt is required, the config is optional
FETCH_WEIGHTS = f"hf download {HUB_REPO} {CHECKPOINT_FILE} {MED_CONFIG_FILE}"

# ImageReward.py: ``self.mean`` / ``self.std`` of the raw head output; the text length of every tokenizer call
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_TEXT_LENGTH = 35
# ImageReward.py ``_transform``: CLIP's normalisation constants
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# BLIP's med_config.json as published with ImageReward (train/src/config/med_config.json). A real load reads
# the hub's med_config.json instead; this copy serves pretrained=None and checkpoint_layout(). ``encoder_width``
# is overwritten with the ViT width (1024) by BLIP_Pretrain, here as there.
MED_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30524,
    "encoder_width": 768,
    "add_cross_attention": True,
}
# blip.py ``create_vit('large', 224)``: ViT-L/16, qkv bias, MLP ratio 4, LayerNorm eps 1e-6
VIT_LARGE = {"image_size": 224, "patch_size": 16, "vision_width": 1024, "vision_layers": 24,
             "vision_heads": 16}
# blip_pretrain.py: contrastive projections (in the checkpoint, unused by the score)
BLIP_EMBED_DIM = 256

UNUSED_CHECKPOINT_KEYS = (
    "blip.vision_proj.weight",
    "blip.vision_proj.bias",
    "blip.text_proj.weight",
    "blip.text_proj.bias",
    "blip.text_encoder.embeddings.position_ids",
)


@dataclass(frozen=True)
class ImageRewardArch:
    """Sizes of the network; the defaults are ImageReward-v1.0's (ViT-L/16 at 224 px + the med BERT)."""

    image_size: int = VIT_LARGE["image_size"]
    patch_size: int = VIT_LARGE["patch_size"]
    vision_width: int = VIT_LARGE["vision_width"]
    vision_layers: int = VIT_LARGE["vision_layers"]
    vision_heads: int = VIT_LARGE["vision_heads"]
    vision_mlp_ratio: float = 4.0
    text_width: int = MED_CONFIG["hidden_size"]
    text_layers: int = MED_CONFIG["num_hidden_layers"]
    text_heads: int = MED_CONFIG["num_attention_heads"]
    text_intermediate: int = MED_CONFIG["intermediate_size"]
    vocab_size: int = MED_CONFIG["vocab_size"]
    max_positions: int = MED_CONFIG["max_position_embeddings"]
    text_layer_norm_eps: float = MED_CONFIG["layer_norm_eps"]
    mlp_sizes: tuple[int, ...] = (1024, 128, 64, 16)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        if self.vision_width % self.vision_heads or self.text_width % self.text_heads:
            raise ValueError("vision_width / text_width must be multiples of their head counts")
        if self.max_positions < MAX_TEXT_LENGTH:
            raise ValueError(f"max_positions must be at least the text length {MAX_TEXT_LENGTH}")
        if len(self.mlp_sizes) != 4:
            raise ValueError(f"mlp_sizes must hold 4 hidden sizes (ImageReward's 1024, 128, 64, 16), "
                             f"got {self.mlp_sizes}")

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


def arch_from_med_config(med_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                         ) -> ImageRewardArch:
    """The architecture of a BLIP ``med_config.json`` (text side) + ViT-L/16 (image side) + ``overrides``."""
    if med_config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"med_config hidden_act {med_config['hidden_act']!r}: only 'gelu' (ImageReward's) "
                         "is built")
    if med_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("med_config position_embedding_type: only 'absolute' (ImageReward's) is built")
    if not med_config.get("add_cross_attention", False):
        raise ValueError("med_config add_cross_attention must be true: ImageReward's text encoder attends "
                         "to the image")
    values: dict[str, Any] = {
        "text_width": int(med_config["hidden_size"]),
        "text_layers": int(med_config["num_hidden_layers"]),
        "text_heads": int(med_config["num_attention_heads"]),
        "text_intermediate": int(med_config["intermediate_size"]),
        "vocab_size": int(med_config["vocab_size"]),
        "max_positions": int(med_config["max_position_embeddings"]),
        "text_layer_norm_eps": float(med_config.get("layer_norm_eps", 1e-12)),
    }
    allowed = {f.name for f in dataclasses.fields(ImageRewardArch)}
    unknown = sorted(set(overrides or {}) - allowed)
    if unknown:
        raise ValueError(f"unknown ImageReward arch keys {unknown}; allowed: {sorted(allowed)}")
    values.update(overrides or {})
    if "mlp_sizes" in values:
        values["mlp_sizes"] = tuple(int(s) for s in values["mlp_sizes"])
    return ImageRewardArch(**values)


def checkpoint_layout(arch: ImageRewardArch | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every key of ``ImageReward.pt`` with its shape and dtype, derived from the reference's modules.

    Written from THUDM/ImageReward's module tree, not from this file's network: ``ImageReward`` =
    ``blip`` (``BLIP_Pretrain``: ``visual_encoder`` = BLIP vit.py ``VisionTransformer``; ``text_encoder`` =
    med.py ``BertModel`` without pooler; ``vision_proj``, ``text_proj``) + ``mlp.layers`` (Linear at
    Sequential indices 0, 2, 4, 6, 7). ``arch=None`` gives the real sizes (ViT-L/16 at 224 px, the published
    med config).
    """
    a = arch or ImageRewardArch()
    f32 = torch.float32
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def linear(name: str, n_in: int, n_out: int) -> None:
        out[f"{name}.weight"] = ((n_out, n_in), f32)
        out[f"{name}.bias"] = ((n_out,), f32)

    def norm(name: str, width: int) -> None:
        out[f"{name}.weight"] = ((width,), f32)
        out[f"{name}.bias"] = ((width,), f32)

    v, vw = "blip.visual_encoder", a.vision_width
    out[f"{v}.cls_token"] = ((1, 1, vw), f32)
    out[f"{v}.pos_embed"] = ((1, a.num_image_tokens, vw), f32)
    out[f"{v}.patch_embed.proj.weight"] = ((vw, 3, a.patch_size, a.patch_size), f32)
    out[f"{v}.patch_embed.proj.bias"] = ((vw,), f32)
    hidden = int(vw * a.vision_mlp_ratio)
    for i in range(a.vision_layers):
        b = f"{v}.blocks.{i}"
        norm(f"{b}.norm1", vw)
        linear(f"{b}.attn.qkv", vw, 3 * vw)
        linear(f"{b}.attn.proj", vw, vw)
        norm(f"{b}.norm2", vw)
        linear(f"{b}.mlp.fc1", vw, hidden)
        linear(f"{b}.mlp.fc2", hidden, vw)
    norm(f"{v}.norm", vw)

    t, tw = "blip.text_encoder", a.text_width
    out[f"{t}.embeddings.position_ids"] = ((1, a.max_positions), torch.int64)
    out[f"{t}.embeddings.word_embeddings.weight"] = ((a.vocab_size, tw), f32)
    out[f"{t}.embeddings.position_embeddings.weight"] = ((a.max_positions, tw), f32)
    norm(f"{t}.embeddings.LayerNorm", tw)
    for i in range(a.text_layers):
        layer = f"{t}.encoder.layer.{i}"
        for block, kv_width in (("attention", tw), ("crossattention", vw)):
            linear(f"{layer}.{block}.self.query", tw, tw)
            linear(f"{layer}.{block}.self.key", kv_width, tw)
            linear(f"{layer}.{block}.self.value", kv_width, tw)
            linear(f"{layer}.{block}.output.dense", tw, tw)
            norm(f"{layer}.{block}.output.LayerNorm", tw)
        linear(f"{layer}.intermediate.dense", tw, a.text_intermediate)
        linear(f"{layer}.output.dense", a.text_intermediate, tw)
        norm(f"{layer}.output.LayerNorm", tw)

    linear("blip.vision_proj", vw, BLIP_EMBED_DIM)
    linear("blip.text_proj", tw, BLIP_EMBED_DIM)

    sizes = (tw, *a.mlp_sizes, 1)
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), itertools.pairwise(sizes)):
        linear(f"mlp.layers.{index}", n_in, n_out)
    return out


# ---------------------------------------------------------------- network (attribute names = checkpoint keys)

def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head softmax(q k^T / sqrt(d) + mask) v of (B, L, C) projections; ``mask`` (B, 1, 1, S)."""
    b, lq, c = q.shape

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, x.shape[1], heads, c // heads).transpose(1, 2)  # (B, H, L, d)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, lq, c)


class _PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels).flatten(2).transpose(1, 2)  # (B, N, C)


class _VitAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(_attention(q, k, v, self.heads))


class _VitMlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _VitBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _VitAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = _VitMlp(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """BLIP's pre-norm ViT: patch conv, [CLS] + learned positions, blocks, final LayerNorm -> all tokens."""

    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        w = arch.vision_width
        self.patch_embed = _PatchEmbed(arch.patch_size, w)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, w))
        self.pos_embed = nn.Parameter(torch.zeros(1, arch.num_image_tokens, w))
        hidden = int(w * arch.vision_mlp_ratio)
        self.blocks = nn.ModuleList(_VitBlock(w, arch.vision_heads, hidden)
                                    for _ in range(arch.vision_layers))
        self.norm = nn.LayerNorm(w, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)  # (B, N, C)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed[:, : x.shape[1] + 1]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # (B, 1 + N, C)


class _BertEmbeddings(nn.Module):
    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.text_width)
        self.position_embeddings = nn.Embedding(arch.max_positions, arch.text_width)
        self.LayerNorm = nn.LayerNorm(arch.text_width, eps=arch.text_layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class _QKV(nn.Module):
    def __init__(self, width: int, kv_width: int) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(kv_width, width)
        self.value = nn.Linear(kv_width, width)


class _DenseNorm(nn.Module):
    """BERT's ``dense`` + residual ``LayerNorm`` (BertSelfOutput / BertOutput)."""

    def __init__(self, n_in: int, width: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _BertAttention(nn.Module):
    def __init__(self, width: int, kv_width: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self = _QKV(width, kv_width)
        self.output = _DenseNorm(width, width, eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        s = self.self
        return self.output(_attention(s.query(x), s.key(context), s.value(context), self.heads, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class _BertLayer(nn.Module):
    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        w, eps = arch.text_width, arch.text_layer_norm_eps
        self.attention = _BertAttention(w, w, arch.text_heads, eps)
        self.crossattention = _BertAttention(w, arch.vision_width, arch.text_heads, eps)
        self.intermediate = _Intermediate(w, arch.text_intermediate)
        self.output = _DenseNorm(arch.text_intermediate, w, eps)

    def forward(self, x: torch.Tensor, text_mask: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x, text_mask)
        x = self.crossattention(x, image_embeds, None)  # every image token is attended (mask of ones)
        return self.output(self.intermediate(x), x)


class _BertEncoder(nn.Module):
    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_BertLayer(arch) for _ in range(arch.text_layers))


class TextEncoder(nn.Module):
    """BLIP's med BERT in "multimodal" mode: bidirectional self-attention + cross-attention to the image."""

    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        self.embeddings = _BertEmbeddings(arch)
        self.encoder = _BertEncoder(arch)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                image_embeds: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)  # (B, L, C)
        # med.py get_extended_attention_mask (encoder): 0 where attended, -10000 on padding
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0  # (B, 1, 1, L)
        for layer in self.encoder.layer:
            x = layer(x, mask, image_embeds)
        return x  # (B, L, C)


class _Blip(nn.Module):
    def __init__(self, arch: ImageRewardArch) -> None:
        super().__init__()
        self.visual_encoder = VisionTransformer(arch)
        self.text_encoder = TextEncoder(arch)


class _RewardHead(nn.Module):
    """ImageReward's ``MLP``: Linear at Sequential indices 0, 2, 4, 6, 7 (dropouts between, no activation)."""

    def __init__(self, width: int, sizes: Sequence[int]) -> None:
        super().__init__()
        a, b, c, d = sizes
        self.layers = nn.Sequential(nn.Linear(width, a), nn.Dropout(0.2), nn.Linear(a, b), nn.Dropout(0.2),
                                    nn.Linear(b, c), nn.Dropout(0.1), nn.Linear(c, d), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ImageRewardModel(nn.Module):
    """The ImageReward network: ``forward(pixels, input_ids, attention_mask) -> (B,)`` normalised rewards."""

    def __init__(self, arch: ImageRewardArch | None = None) -> None:
        super().__init__()
        self.arch = arch or ImageRewardArch()
        self.blip = _Blip(self.arch)
        self.mlp = _RewardHead(self.arch.text_width, self.arch.mlp_sizes)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        image_embeds = self.blip.visual_encoder(pixels)  # (B, 1 + N, Cv)
        text = self.blip.text_encoder(input_ids, attention_mask, image_embeds)  # (B, L, Ct)
        reward = self.mlp(text[:, 0, :].float()).squeeze(-1)  # first token ([CLS]) -> (B,)
        return (reward - REWARD_MEAN) / REWARD_STD


def init_random(model: ImageRewardModel, seed: int = 0) -> ImageRewardModel:
    """Seeded random weights for tests: variance-preserving normal linear/conv weights, small biases and
    embeddings, LayerNorms at identity. Not the reference's training init, whose head (std 1/769 per layer)
    would make every score of a random network the same constant."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.weight.copy_(normal(module.weight.shape, module.weight[0].numel() ** -0.5))
                module.bias.copy_(normal(module.bias.shape, 0.02))
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(normal(module.weight.shape, 0.02))
            elif isinstance(module, VisionTransformer):
                module.cls_token.copy_(normal(module.cls_token.shape, 0.02))
                module.pos_embed.copy_(normal(module.pos_embed.shape, 0.02))
    return model


def drop_unused_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``ImageReward.pt`` minus :data:`UNUSED_CHECKPOINT_KEYS` (the contrastive projections ``vision_proj`` /
    ``text_proj``, which ImageReward's score never calls, and the ``position_ids`` buffer, which must be
    ``arange`` as this module assumes). Keys absent from the file are fine; everything else is kept."""
    sd = dict(state_dict)
    ids = sd.get("blip.text_encoder.embeddings.position_ids")
    if ids is not None and ids.device.type != "meta" and not torch.equal(
            ids.reshape(-1).cpu(), torch.arange(ids.numel(), dtype=ids.dtype)):
        raise ValueError("blip.text_encoder.embeddings.position_ids is not 0..n-1: not an ImageReward "
                         "checkpoint")
    for key in UNUSED_CHECKPOINT_KEYS:
        sd.pop(key, None)
    # the reference copies the file's tensors into a float32 module
    return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


# ---------------------------------------------------------------- inputs

def preprocess(image: Any, image_size: int = 224) -> torch.Tensor:
    """A PIL image -> (3, S, S) float: ImageReward's ``_transform`` (shorter side to S, bicubic; centre crop;
    RGB; [0, 1]; CLIP mean/std), with torchvision's functional ops in the reference's order."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    image = TF.resize(image, image_size, interpolation=InterpolationMode.BICUBIC)
    image = TF.center_crop(image, image_size).convert("RGB")
    return TF.normalize(TF.to_tensor(image), IMAGE_MEAN, IMAGE_STD)


def load_blip_tokenizer(source: str | os.PathLike) -> Any:
    """``bert-base-uncased`` as BLIP's ``init_tokenizer``: + ``[DEC]`` (bos) and ``[ENC]`` special tokens.

    ``source``: a hub id (files from the Hugging Face cache, fetched when online) or a local folder with
    ``vocab.txt``. Files are resolved first: transformers 5 would otherwise silently build an empty tokenizer.
    """
    from transformers import BertTokenizer

    vocab = Path(resolve_tokenizer_files(source))
    tokenizer = BertTokenizer.from_pretrained(str(vocab.parent))
    with open(vocab, encoding="utf-8") as fh:
        n_vocab = sum(1 for line in fh if line.strip())
    if len(tokenizer) < n_vocab:
        raise ValueError(f"tokenizer from {vocab.parent} has {len(tokenizer)} tokens but {vocab} lists "
                         f"{n_vocab}")
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    tokenizer.enc_token_id = tokenizer.convert_tokens_to_ids("[ENC]")  # as BLIP; ImageReward never feeds it
    return tokenizer


def tokenize(tokenizer: Any, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageReward's text input: padded / truncated to 35 tokens; ids unchanged ([CLS] first)."""
    enc = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TEXT_LENGTH,
                    return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _is_local(source: str) -> bool:
    return Path(source).expanduser().exists() or source.startswith((".", "/", "~")) or source.count("/") > 1


def resolve_tokenizer_files(source: str | os.PathLike) -> str:
    """Path of the tokenizer's ``vocab.txt`` (local folder or hub cache); the error says how to fetch it."""
    source = str(source)
    fetch = f"hf download {TOKENIZER_REPO} {' '.join(TOKENIZER_FILES)}"
    if _is_local(source):
        folder = Path(source).expanduser()
        vocab = folder / TOKENIZER_FILES[0]
        if not vocab.is_file():
            raise MissingWeightsError(
                f"ImageReward tokenizer: {TOKENIZER_FILES[0]} not found in {folder} (looked for {vocab}). "
                f"On a machine with network access run: {fetch} --local-dir {folder}")
        return str(vocab)
    try:
        vocab = hub_file(source, TOKENIZER_FILES[0])
    except MissingWeightsError as err:
        raise MissingWeightsError(
            f"ImageReward tokenizer {source}: {TOKENIZER_FILES[0]} is not in the Hugging Face cache "
            f"(HF_HUB_CACHE / ~/.cache/huggingface/hub). On a machine with network access run: "
            f"hf download {source} {' '.join(TOKENIZER_FILES)}") from err
    for optional in TOKENIZER_FILES[1:]:
        try:
            hub_file(source, optional)
        except MissingWeightsError:
            pass  # BertTokenizer's defaults (lower case) are bert-base-uncased's config
    return vocab


def resolve_weights(pretrained: str) -> tuple[str, str]:
    """(ImageReward.pt, med_config.json) of ``hub:<repo>`` (Hugging Face cache) or a local folder."""
    if pretrained.startswith("hub:"):
        repo = pretrained[len("hub:"):]
        found, missing = {}, []
        for name in (CHECKPOINT_FILE, MED_CONFIG_FILE):
            try:
                found[name] = hub_file(repo, name)
            except MissingWeightsError:
                missing.append(name)
        if missing:
            raise MissingWeightsError(
                f"ImageReward weights: {', '.join(missing)} from {repo} not available (looked in the "
                f"Hugging Face cache, HF_HUB_CACHE / ~/.cache/huggingface/hub). On a machine with network "
                f"access run: hf download {repo} {CHECKPOINT_FILE} {MED_CONFIG_FILE}  (or set pretrained to "
                "a folder holding both files)")
        return found[CHECKPOINT_FILE], found[MED_CONFIG_FILE]
    folder = Path(pretrained).expanduser()
    paths = [folder / CHECKPOINT_FILE, folder / MED_CONFIG_FILE]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise MissingWeightsError(
            f"ImageReward weights: {', '.join(missing)} not found in {folder} (looked for "
            f"{', '.join(str(p) for p in paths)}). On a machine with network access run: "
            f"{FETCH_WEIGHTS} --local-dir {folder}  (or use pretrained=hub:{HUB_REPO})")
    return str(paths[0]), str(paths[1])


# ---------------------------------------------------------------- the metric

class ImageReward(MeanScore):
    """The ``image_reward`` metric: mean ImageReward-v1.0 score of generated images against their prompts
    (t interval over images, ``eval.metrics.MeanScore``)."""

    key = "image_reward"

    def __init__(self, pretrained: str | None = f"hub:{HUB_REPO}", tokenizer: Any = TOKENIZER_REPO,
                 batch_size: int = 16, arch: Mapping[str, Any] | None = None) -> None:
        """``pretrained``: ``hub:<repo>`` (``ImageReward.pt`` + ``med_config.json`` through huggingface_hub,
        cached), a local folder holding both, or None for seeded random weights (tests). ``tokenizer``: a hub
        id or local folder (``vocab.txt``), or a ready BLIP tokenizer object (used as given). ``arch``: size
        overrides (:class:`ImageRewardArch` field names) for tiny test instances; None keeps the real
        sizes."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.pretrained, self.tokenizer_source, self.batch_size = pretrained, tokenizer, batch_size
        self.arch_overrides = dict(arch or {})
        self._model: ImageRewardModel | None = None
        self._tokenizer: Any = None

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """``ImageReward.pt`` + ``med_config.json`` (``hub:<repo>`` or a folder) and the tokenizer's ``vocab.txt``
        (a hub id or a folder), as ``preflight`` resolves them."""
        out = []
        pretrained = cfg.get("pretrained", f"hub:{HUB_REPO}")
        if isinstance(pretrained, str) and pretrained.startswith("hub:"):
            out += [RequiredFile("ImageReward weights", repo_id=pretrained[len("hub:"):], filename=name)
                    for name in (CHECKPOINT_FILE, MED_CONFIG_FILE)]
        elif pretrained is not None:
            out.append(RequiredFile("ImageReward weights", local=str(pretrained),
                                    must_have=(CHECKPOINT_FILE, MED_CONFIG_FILE),
                                    manual=f"{FETCH_WEIGHTS} --local-dir {pretrained}"))
        tokenizer = cfg.get("tokenizer", TOKENIZER_REPO)
        if isinstance(tokenizer, (str, os.PathLike)):
            source = str(tokenizer)
            if _is_local(source):
                out.append(RequiredFile("ImageReward tokenizer", local=source, must_have=(TOKENIZER_FILES[0],),
                                        manual=f"hf download {TOKENIZER_REPO} {' '.join(TOKENIZER_FILES)} "
                                               f"--local-dir {source}"))
            else:
                out.append(RequiredFile("ImageReward tokenizer", repo_id=source, filename=TOKENIZER_FILES[0]))
        return out

    def preflight(self) -> None:
        """Resolve checkpoint, med_config and tokenizer files (builds no network); raise naming what is
        missing and the command that fetches it."""
        if self.pretrained is not None:
            _, med_path = resolve_weights(self.pretrained)
            with open(med_path, encoding="utf-8") as fh:
                arch_from_med_config(json.load(fh), self.arch_overrides)
        else:
            arch_from_med_config(MED_CONFIG, self.arch_overrides)
        if isinstance(self.tokenizer_source, (str, os.PathLike)):
            resolve_tokenizer_files(self.tokenizer_source)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            src = self.tokenizer_source
            self._tokenizer = load_blip_tokenizer(src) if isinstance(src, (str, os.PathLike)) else src
        return self._tokenizer

    @property
    def model(self) -> ImageRewardModel:
        """The network, built and loaded on first use (strict load; only the listed unused keys dropped)."""
        if self._model is None:
            if self.pretrained is None:
                model = init_random(ImageRewardModel(arch_from_med_config(MED_CONFIG, self.arch_overrides)))
            else:
                ckpt_path, med_path = resolve_weights(self.pretrained)
                with open(med_path, encoding="utf-8") as fh:
                    arch = arch_from_med_config(json.load(fh), self.arch_overrides)
                state = drop_unused_keys(load_state_dict(ckpt_path, fetch_hint=FETCH_WEIGHTS))
                with torch.device("meta"):
                    model = ImageRewardModel(arch)
                try:
                    model.load_state_dict(state, strict=True, assign=True)
                except RuntimeError as err:
                    raise RuntimeError(f"{ckpt_path} does not match ImageReward-v1.0 built from "
                                       f"{med_path}: {err}") from err
            if len(self.tokenizer) != model.arch.vocab_size:
                raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens (with [DEC], [ENC]) but the "
                                 f"text encoder's vocabulary is {model.arch.vocab_size}: use "
                                 "bert-base-uncased")
            self._model = model.eval()
        return self._model

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | os.PathLike], prompts: Sequence[str],
               device: torch.device | str = "cpu") -> np.ndarray:
        """Normalised reward of each (image, prompt) pair, as ImageReward's ``score`` -> float64 (N,)."""
        from PIL import Image

        if len(image_paths) != len(prompts):
            raise ValueError(f"{len(image_paths)} images but {len(prompts)} prompts")
        model = self.model.to(device)
        out = []
        for start in range(0, len(image_paths), self.batch_size):
            pixels = []
            for path in image_paths[start : start + self.batch_size]:
                with Image.open(path) as im:
                    pixels.append(preprocess(im, model.arch.image_size))
            ids, mask = tokenize(self.tokenizer, prompts[start : start + self.batch_size])
            out.append(model(torch.stack(pixels).to(device), ids.to(device), mask.to(device)).double().cpu())
        return torch.cat(out).numpy() if out else np.zeros(0)

    def details(self, n: int) -> dict[str, Any]:
        return {"image_reward_num_images": n}

    def compute(self, image_paths: Sequence[str | os.PathLike], prompts: Sequence[str],
                device: torch.device | str = "cpu") -> dict[str, Any]:
        return self.estimate(self.per_image(image_paths, prompts, device), torch.device(device))
