"""Janus-Pro (DeepSeek, 2025; 1B and 7B) as a target model: text-to-image on ``transformers``' Janus classes.

Generation path, as deepseek-ai/Janus ``generation_inference.py`` runs it and ``transformers`` 5.x
``models/janus/modeling_janus.py`` (``JanusForConditionalGeneration.generate(generation_mode="image")``)
reproduces it:

* prompt: BOS + ``"<|User|>: {prompt}\\n\\n<|Assistant|>:"`` (the ``deepseek`` SFT template with an
  empty system prompt) + ``<begin_of_image>``;
* classifier-free guidance: a second stream whose prompt tokens are all replaced by the pad token except
  BOS and ``<begin_of_image>`` (same length, nothing masked), ``u + s (c − u)`` with ``s = 5``, temperature
  1, no top-k or top-p; this adapter's stream order is [cond; uncond] (the original interleaves rows);
* image tokens: 24 × 24 = 576 codes of the LlamaGen-style VQ-16 tokenizer (16384 codes of dim 8) at 384 px,
  embedded by ``generation_embeddings`` + ``generation_aligner`` and read out by ``generation_head`` from the
  language model's post-norm hidden states; plain 1-D RoPE, image token ``i`` at sequence position
  ``len(prompt) + i``.

Where this adapter follows the official recipe and where it deviates on purpose:

* **Precision (deliberate deviation).** The model runs in bf16 on CUDA, but the guidance combination
  ``u + s (c − u)`` and the softmax run in **float32** (the generation head's logits are promoted to float32
  and ``coolsd.sampling`` does all arithmetic in float32, as ``docs/algorithms.md`` states for
  every model); the official recipe and transformers do CFG and softmax in bf16.
* **Guidance** at any scale ≠ 1 (``sampling.cfg_rule=not_one``, as ``generation_inference.py`` always
  combines the streams; transformers' ``generate`` adds its CFG processor only above 1).
* **Attention kernel** ``model.attention_kernel=auto`` (PyTorch's dispatch, as the HF modules use) and
  ``model.tf32=false`` (the recipe leaves PyTorch's TF32 defaults); on a GPU their effect was not measured.
* **Pixels** ``model.pixel_rounding=truncate``: ``np.clip((x + 1) / 2 * 255, 0, 255)`` stored into uint8, as
  the recipe (and transformers' ``JanusImageProcessor.postprocess``) does.

The static decode path (``decoder.path=static``, ``coolsd.static``) runs the same layers through
``static_forward`` over a ``DeviceKVCache`` that keeps each image's prompt length on the device
(``forward_block`` calls it, so both paths share one computation). Its prefill (``static_prefill``) pads
every prompt on the left to the fixed width ``model.prompt_capacity`` (masked, so no token changes), since the
static loop refills one cache of one capacity with every batch's prefill; a longer prompt is refused, naming
the key. The eager path pads to the batch's longest prompt.

The Llama decoder layers run here over the HF modules' own weights (projections, RoPE module, MLP, norms)
with this project's ``StaticKVCache`` and masks, so blocks, draft trees, rollback and KV compaction work as
for every adapter; ``tests/test_janus.py`` checks the logits against ``transformers``' own generation loop.

Weights: ``deepseek-community/Janus-Pro-1B`` / ``-7B`` (converted for ``transformers``), fetched into the
Hugging Face cache on first use. ``pretrained=false`` builds a random-weight model of ``arch`` sizes with a
small character tokenizer instead (tests, plumbing, speed runs without a download).

Example: ``python run.py model=janus_pro_1b decoder=coolsd data=file data.path=prompts.txt``
(random tiny instance: ``python run.py model=janus_tiny data=fixed``).
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coolsd import validate
from coolsd.kv_cache import StaticKVCache
from coolsd.models.base import (
    ImageARModel,
    Runtime,
    attention_context,
    hf_weights,
    layer_skipping,
    per_stream,
    pixels_to_uint8,
    stream_rows,
)
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.required_files import RequiredFile
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput

# The ``deepseek`` conversation template of deepseek-ai/Janus (janus/utils/conversation.py) with an empty
# system prompt, one user turn and an open assistant turn; ``{prompt}`` is the stripped user text.
PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
BOI_TOKEN = "<begin_of_image>"
PAD_TOKEN = "<｜▁pad▁｜>"
# What ``pretrained=true`` downloads: configs, weights, tokenizer files (no demo images or PDFs).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")

# Special tokens of the character tokenizer of random-weight instances (DeepSeek's spellings).
TINY_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", PAD_TOKEN, "<unk>", BOI_TOKEN,
                 "<end_of_image>", "<image_placeholder>")


@dataclass(frozen=True)
class JanusArch:
    """Sizes of a random-weight Janus (``model.arch`` with ``model.pretrained=false``); defaults: tiny.

    ``patch_size`` is the VQ down-sampling factor and must equal ``2 ** (len(vq_channel_multiplier) − 1)``;
    the image grid is ``image_size / patch_size`` on each side. The ``vision_*`` fields size the
    understanding tower, which ``JanusModel`` always holds and generation never runs.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int = 128
    vocab_size: int = 160
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    image_size: int = 128
    patch_size: int = 16
    codebook_size: int = 256
    codebook_dim: int = 8
    vq_base_channels: int = 32
    vq_latent_channels: int = 32
    vq_channel_multiplier: Sequence[int] = (1, 1, 2, 2, 4)
    vq_num_res_blocks: int = 1
    vision_hidden_size: int = 32
    vision_layers: int = 1
    vision_heads: int = 2
    init_std: float = 0.2  # N(0, init_std) for the language model and generation modules' weights

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.arch.hidden_size ({self.hidden_size}) must be divisible by "
                             f"model.arch.num_heads ({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"model.arch.image_size ({self.image_size}) must be a multiple of "
                             f"model.arch.patch_size ({self.patch_size})")
        if self.patch_size != 2 ** (len(self.vq_channel_multiplier) - 1):
            raise ValueError(f"model.arch.patch_size ({self.patch_size}) must equal the VQ up-sampling "
                             f"2 ** (len(model.arch.vq_channel_multiplier) - 1) = "
                             f"{2 ** (len(self.vq_channel_multiplier) - 1)}")
        if self.vq_base_channels % 32 or self.vq_latent_channels % 32:
            raise ValueError("model.arch.vq_base_channels and vq_latent_channels must be multiples of 32 "
                             "(the VQ decoder's GroupNorm uses 32 groups)")
        if self.vocab_size < len(TINY_SPECIALS) + 96:
            raise ValueError(f"model.arch.vocab_size must be >= {len(TINY_SPECIALS) + 96} (the character "
                             "tokenizer of random-weight models)")


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: DeepSeek's special tokens, printable ASCII and newline.

    Random-weight instances use it instead of the 102400-token DeepSeek tokenizer (which needs a download).
    It does not add BOS itself; ``JanusPro.prompt_ids`` does.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate((*TINY_SPECIALS, *chars))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=TINY_SPECIALS[0], eos_token=TINY_SPECIALS[1], pad_token=PAD_TOKEN,
        unk_token="<unk>", additional_special_tokens=list(TINY_SPECIALS[4:]),
    )


def janus_config(arch: JanusArch, tokenizer) -> Any:
    """The ``transformers.JanusConfig`` of a random-weight model with ``arch`` sizes."""
    from transformers import JanusConfig, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    grid = arch.image_size // arch.patch_size
    text = LlamaConfig(
        hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads or arch.num_heads, vocab_size=arch.vocab_size,
        rms_norm_eps=arch.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        max_position_embeddings=arch.max_position_embeddings, initializer_range=arch.init_std,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = JanusVisionConfig(
        hidden_size=arch.vision_hidden_size, num_hidden_layers=arch.vision_layers,
        num_attention_heads=arch.vision_heads, image_size=arch.image_size, patch_size=arch.patch_size,
        projection_dim=arch.hidden_size, num_image_tokens=grid * grid,
    )
    vq = JanusVQVAEConfig(
        embed_dim=arch.codebook_dim, num_embeddings=arch.codebook_size, base_channels=arch.vq_base_channels,
        latent_channels=arch.vq_latent_channels, channel_multiplier=list(arch.vq_channel_multiplier),
        num_res_blocks=arch.vq_num_res_blocks, projection_dim=arch.hidden_size,
        image_token_embed_dim=arch.hidden_size,
    )
    return JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                       image_token_id=tokenizer.convert_tokens_to_ids("<image_placeholder>"))


def load_pretrained(repo_id: str, revision: str | None, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """``(JanusForConditionalGeneration, tokenizer)`` of a hub repo, downloaded into the HF cache once.

    Only safetensors are read and no repository code runs (``trust_remote_code`` stays off). Offline
    without a cached copy this raises ``MissingWeightsError`` with the command that fetches the files.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from transformers import AutoTokenizer, JanusForConditionalGeneration

    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except (LocalEntryNotFoundError, OSError) as err:
        raise MissingWeightsError(
            f"Janus-Pro weights {repo_id} are not available (looked in the Hugging Face cache, "
            f"$HF_HOME/hub). On a machine with network access run: hf download {repo_id}"
            + (f" --revision {revision}" if revision else "")
            + " ; or set model.pretrained=false for a random-weight model"
        ) from err
    model, info = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                                trust_remote_code=False, output_loading_info=True)
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):  # from_pretrained only warns; a renamed or reshaped parameter must not load
        raise ValueError(f"{repo_id} ({path}) does not match transformers' Janus classes: "
                         + ", ".join(f"{k} {v[:6]} ({len(v)})" for k, v in problems.items())
                         + "; check the transformers version (requirements.txt) and model.revision")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model, tokenizer


# -- the Llama decoder layers over HF weights ------------------------------------------------------------
def attention(
    attn: nn.Module,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: StaticKVCache | None,
    layer: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Self-attention of a ``transformers`` ``LlamaAttention`` (its projections) on ``x`` (B, T, H).

    ``rope`` = (cos, sin) (1 or B, T, head_dim) from the model's rotary module. K/V go through ``cache.write``
    (``None``: no cache, causal over ``x``); ``mask`` (B, 1, T, end) bool from ``cache.begin_block``.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)  # (B, Hq, T, D)
    k = attn.k_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
    v = attn.v_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rope)
    if cache is not None:
        k, v = cache.write(layer, k, v)  # (B, Hkv, end, D)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=cache is None and mask is None, scale=attn.scaling,
        enable_gqa=attn.num_key_value_groups > 1,
    )  # (B, Hq, T, D)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def rope_cos_sin(rotary: nn.Module, x: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (1|B, T, head_dim) in ``x``'s dtype of a ``transformers`` ``LlamaRotaryEmbedding`` at
    ``positions`` (1|B, T): its default RoPE from its own ``inv_freq`` and ``attention_scaling``, the float32
    operations its forward makes (so the same values), without the forward's move of ``inv_freq`` to ``x``'s
    device, which a static decode step must not call (``coolsd.sync_guard``; the buffer is on the model's
    device already). Other RoPE types go through the module's forward."""
    if getattr(rotary, "rope_type", "default") != "default":
        return rotary(x, positions)
    angles = positions[..., None].float() * rotary.inv_freq.float()  # (1|B, T, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)
    scale = rotary.attention_scaling
    return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)


def run_layers(
    lm: nn.Module,
    h: torch.Tensor,
    seq_positions: torch.Tensor,
    cache: StaticKVCache | None,
    mask: torch.Tensor | None,
    num_layers: int,
) -> torch.Tensor:
    """The first ``num_layers`` decoder layers of ``lm`` (a ``LlamaModel``) + its final norm.

    Input embeddings (B, T, H) at sequence positions (T,) shared or (B, T) per row -> post-norm hidden
    states (B, T, H).
    """
    rope = rope_cos_sin(lm.rotary_emb, h, seq_positions if seq_positions.dim() == 2 else seq_positions[None])
    for i, layer in enumerate(itertools.islice(lm.layers, num_layers)):  # slicing would build a ModuleList
        h = h + attention(layer.self_attn, layer.input_layernorm(h), rope, cache, i, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return lm.norm(h)


class Float32Rotary(nn.Module):
    """Wraps a ``LlamaRotaryEmbedding`` so its inverse frequencies stay float32 when the owner is cast.

    A bf16 ``inv_freq`` would rotate late positions by visibly wrong angles (3 significant digits).
    """

    def __init__(self, text_config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(text_config)

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self.inner.named_buffers()}  # float32 originals
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            setattr(self.inner, name, buf.to(getattr(self.inner, name).device))
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inner, x, positions)


class JanusDraftLayer(nn.Module):
    """The EAGLE draft layer of a Janus target: one Llama decoder layer of the language model's size.

    Built from ``transformers``' ``LlamaDecoderLayer`` (a copy of the text config with one layer), keeping its
    ``self_attn``, ``mlp`` and ``post_attention_layernorm`` under their HF-Llama names; like the first layer
    of EAGLE's drafter (``cnets.py``, ``index == 0``) it has no ``input_layernorm``, because its input is
    the ``fc``-fused ``concat[e(x_{t+1}), f_t]``.

    Positions: the pair ``(f_t, x_{t+1})`` at pair position ``t`` is rotated with RoPE position ``t + 1``,
    the image index of ``x_{t+1}`` (LANTERN's one-position shift: the token's position, not the position of
    the input that produced ``f_t``; the prefill pair, ``t = -1``, gets position 0). The target places
    ``x_{t+1}`` at ``len(prompt) + t + 1``; the drafter never attends to the prompt, and RoPE attention
    depends only on position differences, so the constant ``len(prompt)`` is left out.

    Example: ``JanusPro.make_draft_layer()``; ``python scripts/train_drafter.py model=janus_tiny
    data.prompts=[a cat]`` trains one.
    """

    def __init__(self, text_config: Any, norm_eps: float) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers = 1
        cfg.rms_norm_eps = norm_eps
        cfg.attention_dropout = 0.0
        base = LlamaDecoderLayer(cfg, layer_idx=0)
        self.self_attn = base.self_attn
        self.mlp = base.mlp
        self.post_attention_layernorm = base.post_attention_layernorm
        self.rotary = Float32Rotary(cfg)
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = self.self_attn.head_dim
        self.intermediate_size = cfg.intermediate_size

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKVCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        positions = positions + 1  # on the device (a static step moves nothing)
        rope = self.rotary(h, positions if positions.dim() == 2 else positions[None])  # (1|R, T, head_dim)
        h = h + attention(self.self_attn, h, rope, cache, 0, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def from_eagle_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A released EAGLE layer's HF-Llama names are this module's names (checked, passed through)."""
        if "input_layernorm.weight" in state:
            raise ValueError("the checkpoint's draft layer has an input_layernorm; EAGLE-1/2 drafters skip "
                             "it in their first layer, so this checkpoint is of another kind")
        expected = {k for k in self.state_dict()}
        if set(state) != expected:
            raise ValueError(f"EAGLE layer keys differ from a Llama layer's: missing "
                             f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
        return dict(state)


class JanusCache(StaticKVCache):
    """The static KV cache plus each image's prompt length (its image token ``i`` sits at position
    ``prefix_lens[b] + i``; prompts are left-padded to the longest, the padding masked)."""

    def __init__(self, prefix_lens: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefix_lens = prefix_lens  # (B,)

    def select(self, images) -> None:
        super().select(images)
        self.prefix_lens = self.prefix_lens[torch.tensor(list(images), device=self.prefix_lens.device)]


# -- the adapter -----------------------------------------------------------------------------------------
class JanusPro(ImageARModel):
    """Model adapter for Janus-Pro text-to-image generation (see the module docstring).

    Exactly one source of weights: ``pretrained=true`` (``repo_id`` from the hub), ``pretrained=false``
    with ``arch`` (random weights and the character tokenizer), or prebuilt ``model`` + ``tokenizer``
    objects (tests; used in their own dtype, moved to ``device``). ``prompt_capacity``: the prompt width of
    the static decode path's prefill (``static_prefill``; tokens, BOS and ``<begin_of_image>`` included).
    """

    sjd_init = "random"  # no SJD reference setting for Janus; uniform initialisation (the Lumina default)
    spatial_orders = True  # 1-D positions by raster cell, a static KV cache with per-query masks
    #: deepseek-ai/Janus ``generation_inference.py``: PyTorch's SDPA dispatch and TF32 defaults, pixels truncated
    runtime_defaults = Runtime()
    model_name = "Janus-Pro"

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """With ``pretrained``: the hub snapshot ``load_pretrained`` reads (configs, safetensors, tokenizer)."""
        if not cfg.get("pretrained", True) or not cfg.get("repo_id"):
            return []
        return [RequiredFile("Janus-Pro weights + tokenizer", repo_id=str(cfg["repo_id"]), patterns=HUB_PATTERNS,
                             revision=cfg.get("revision"),
                             must_have=("config.json", "model.safetensors|model.safetensors.index.json",
                                        "tokenizer.json|tokenizer.model"))]

    def __init__(
        self,
        sampling: dict | SamplingConfig,
        repo_id: str | None = None,
        revision: str | None = None,
        pretrained: bool = True,
        arch: dict | JanusArch | None = None,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        prompt_template: str = PROMPT_TEMPLATE,
        boi_token: str = BOI_TOKEN,
        pad_token: str = PAD_TOKEN,
        init_seed: int = 0,
        prompt_capacity: int = 128,
        runtime: Runtime | None = None,
    ) -> None:
        super().__init__(sampling, runtime)
        device, dtype = self.runtime.resolve(published=pretrained and model is None)
        if "{prompt}" not in prompt_template:
            raise ValueError(f"model.prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        self.prompt_template = prompt_template
        self.prompt_capacity = validate.integer("model.prompt_capacity", prompt_capacity, minimum=2)
        model, tokenizer = hf_weights(
            "Janus", model, tokenizer, pretrained, arch, repo_id, "deepseek-community/Janus-Pro-1B", "JanusArch",
            lambda: load_pretrained(repo_id, revision, dtype),
            lambda: self._random_model(arch, tokenizer, init_seed, dtype))
        self.janus = model
        self.tokenizer = tokenizer
        self.lm = model.model.language_model  # LlamaModel
        text = model.config.text_config
        grid = model.config.vq_config.num_patches
        self.grid = (grid, grid)
        self.codebook_size = model.config.vq_config.num_embeddings
        self.hidden_size = text.hidden_size
        self.active_layers = text.num_hidden_layers
        self.bos_id = self._token_id(tokenizer.bos_token, "the tokenizer's bos_token")
        self.boi_token = boi_token
        self.boi_id = self._token_id(boi_token, "model.boi_token")
        self.pad_id = self._token_id(pad_token, "model.pad_token")
        self.requires_grad_(False)
        self.place(device, float32=(self.janus.model.vqmodel,))  # the VQ decoder in float32 (as LlamaGen's)

    @staticmethod
    def _random_model(arch, tokenizer, init_seed: int, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        from transformers import JanusForConditionalGeneration

        arch = arch if isinstance(arch, JanusArch) else JanusArch(**dict(arch))
        tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = JanusForConditionalGeneration._from_config(janus_config(arch, tokenizer), dtype=dtype)
            generation = model.model
            for part in (generation.language_model, generation.generation_embeddings,
                         generation.generation_aligner, generation.generation_head):
                for module in part.modules():
                    if isinstance(module, (nn.Linear, nn.Embedding)):
                        nn.init.normal_(module.weight, mean=0.0, std=arch.init_std)
        return model, tokenizer

    def _token_id(self, token: str | None, key: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids(token) if token else None
        if ids is None or ids == self.tokenizer.unk_token_id:
            raise ValueError(f"{key} {token!r} is not a token of this tokenizer")
        return int(ids)

    # -- prompts ---------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> torch.Tensor:
        """Token ids (P,) of the conditional stream: BOS, the formatted prompt, ``<begin_of_image>``."""
        text = self.prompt_template.format(prompt=prompt.strip()) + self.boi_token
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        if not ids or ids[0] != self.bos_id:
            ids.insert(0, self.bos_id)
        if ids[-1] != self.boi_id:
            raise ValueError("the tokenizer does not encode the begin-of-image token as the prompt's last "
                             f"token (got id {ids[-1]}, expected {self.boi_id}); check model.boi_token")
        return torch.tensor(ids, dtype=torch.long)

    def stream_ids(self, prompt: str) -> torch.Tensor:
        """(S, P) token ids: the prompt, and with CFG the unconditional copy (pad except BOS and BOI)."""
        ids = self.prompt_ids(prompt)
        if self.num_streams == 1:
            return ids[None]
        keep = (ids == self.bos_id) | (ids == self.boi_id)
        return torch.stack([ids, torch.where(keep, ids, torch.full_like(ids, self.pad_id))])

    # -- the adapter interface -------------------------------------------------------------------------
    def _new_cache(self, prefix_lens: torch.Tensor, width: int, extra_slots: int) -> JanusCache:
        text = self.janus.config.text_config
        return JanusCache(
            prefix_lens=prefix_lens,
            num_layers=self.active_layers,
            batch=prefix_lens.shape[0],
            streams=self.num_streams,
            num_heads=text.num_key_value_heads,
            max_len=width + self.num_image_tokens + extra_slots,
            head_dim=self.lm.layers[0].self_attn.head_dim,
            dtype=self.lm.embed_tokens.weight.dtype,
            device=self.device,
        )

    def _output(self, hidden: torch.Tensor) -> TargetOutput:
        """Hidden states of the cache rows (B·S, T, H) -> per-stream output (S, B, T, ·)."""
        hidden = per_stream(hidden, self.num_streams)
        return TargetOutput(logits=self.head(hidden), hidden=hidden)

    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[JanusCache, TargetOutput]:
        """The prompts left-padded to the longest of the batch (the padding masked)."""
        return self._prefill(prompts, extra_slots, None)

    @torch.inference_mode()
    def static_prefill(self, prompts: list[str], extra_slots: int = 64,
                       streams: Streams | None = None) -> tuple[JanusCache, TargetOutput]:
        """``prefill`` with every prompt left-padded to ``model.prompt_capacity`` (the padding masked), so
        every batch's cache has the one capacity the static path's workspace holds; a longer prompt is
        refused."""
        return self._prefill(prompts, extra_slots, self.prompt_capacity)

    def _prefill(self, prompts: list[str], extra_slots: int,
                 width: int | None) -> tuple[JanusCache, TargetOutput]:
        """``prefill`` padding to ``width`` prompt slots (None: the longest prompt's)."""
        streams = [self.stream_ids(p) for p in prompts]  # (S, P_b) each
        lengths = torch.tensor([ids.shape[1] for ids in streams])
        if width is None:
            width = int(lengths.max())
        elif int(lengths.max()) > width:
            i = int(lengths.argmax())
            raise ValueError(f"prompt {prompts[i]!r} is {int(lengths[i])} tokens long (template, BOS and "
                             f"<begin_of_image> included), more than model.prompt_capacity={width}, the "
                             "prompt width of the static decode path: set "
                             f"model.prompt_capacity={int(lengths.max())} or more, or decoder.path=eager")
        s, b = self.num_streams, len(prompts)
        ids = torch.full((s, b, width), self.pad_id, dtype=torch.long)  # left-padded to the width
        for i, row in enumerate(streams):
            ids[:, i, width - row.shape[1]:] = row
        pad = (width - lengths)[:, None]  # (B, 1)
        positions = (torch.arange(width)[None, :] - pad).clamp_min(0)  # (B, P): from 0 at each prompt's start
        valid = torch.arange(width)[None, :] >= pad  # (B, P)
        cache = self._new_cache(lengths.to(self.device), width, extra_slots)
        cache.set_padding(valid.repeat_interleave(s, dim=0).to(self.device))
        rows = ids.transpose(0, 1).reshape(b * s, width).to(self.device)  # image-major: each image's streams
        h = self.lm.embed_tokens(rows)  # (B·S, P, H)
        mask = cache.begin_block(width)
        hidden = run_layers(self.lm, h, positions.repeat_interleave(s, dim=0).to(self.device), cache, mask,
                            self.active_layers)
        return cache, self._output(hidden[:, -1:])

    @torch.inference_mode()
    def forward_block(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        device = self.device
        with self.decode_context():
            return self.static_forward(cache, tokens.to(device), positions.to(device), tree_mask)

    def decode_context(self):
        return attention_context(self.attention_kernel)

    def static_forward(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        """``forward_block`` without its context and copies: tokens and positions on the device, the caller
        inside ``decode_context()``; the static path's forward over a ``DeviceKVCache``, whose ``prefix_lens``
        (B,) holds each image's prompt length on the device (as ``JanusCache.prefix_lens`` does eagerly)."""
        s = self.num_streams
        h = self.embed(tokens)  # (B, T, H)
        seq = positions + cache.prefix_lens[:, None]  # (B, T): image token i at its prompt's length + i
        if s > 1:  # cache rows are image-major: [image 0's streams, image 1's streams, ...]
            h, seq = stream_rows(h, s), stream_rows(seq, s)
        mask = cache.begin_block(tokens.shape[1], tree_mask)
        hidden = run_layers(self.lm, h, seq, cache, mask, self.active_layers)
        return self._output(hidden)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``generation_aligner(generation_embeddings(x))``: image codes (...) -> (..., H)."""
        return self.janus.prepare_embeddings_for_image_generation(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``generation_head`` (Linear -> GELU -> Linear) -> logits over the codebook, at least float32."""
        logits = self.janus.model.generation_head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def codebook(self) -> torch.Tensor:
        """The VQ codebook ``vqmodel.quantize.embedding.weight`` (V, 8), raw (lookups L2-normalise it)."""
        return self.janus.model.vqmodel.quantize.embedding.weight.detach()

    @torch.inference_mode()
    def decode_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (N,) in raster order -> the VQ decoder's float image (3, H, W), about [-1, 1]."""
        codes = tokens.reshape(1, -1).to(self.device)
        return self.janus.model.vqmodel.decode(codes)[0].float()

    def decode_float(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (N,) in raster order -> float image (3, H, W) in [0, 1]."""
        return ((self.decode_pixels(tokens) + 1.0) / 2.0).clamp(0.0, 1.0)

    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """uint8 image as the official recipe saves it: ``clip((x + 1) / 2 * 255, 0, 255)`` truncated
        (``model.pixel_rounding``, default ``truncate``)."""
        return pixels_to_uint8(self.decode_pixels(tokens), self.pixel_rounding)

    def make_draft_layer(self, norm_eps: float | None = None) -> JanusDraftLayer:
        """A fresh ``JanusDraftLayer`` as wide as the language model (``ImageARModel.make_draft_layer``)."""
        text = self.janus.config.text_config
        layer = JanusDraftLayer(text, text.rms_norm_eps if norm_eps is None else norm_eps)
        return layer.to(device=self.device, dtype=self.lm.embed_tokens.weight.dtype)


def layer_skip_copy(target: JanusPro, num_layers: int) -> JanusPro:
    """A draft model sharing the target's weights that runs only its first ``num_layers`` decoder layers.

    Training-free self-speculation for targets without a trained EAGLE drafter (shallow copy, no weights
    duplicated); the final norm and generation head are the target's.
    """
    return layer_skipping(target, num_layers, target.janus.config.text_config.num_hidden_layers)
