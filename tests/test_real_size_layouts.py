"""Every checkpoint the harness names, at its published size, loads strictly: exact key names and shapes.

No weights are downloaded or materialised. Each test builds the model at the published size on the meta
device and loads a state dict of meta tensors whose key names and shapes are *data*, derived here from the
published ``config.json`` values and the module structure of the code that wrote each checkpoint — never
from this project's own modules — so a renamed or reshaped parameter (ours, or one of an upgraded
``transformers``) fails here. Where the project has its own loader, the state dict goes through it (files of
meta tensors: ``torch.save`` keeps their shapes and no storage).

| checkpoint | key layout derived from | loaded through |
|---|---|---|
| ``t2i_XL_stage1_256.pt``, ``t2i_XL_stage2_512.pt`` (peizesun/llamagen_t2i) | FoundationVision/LlamaGen ``autoregressive/models/gpt.py`` (``GPT_XL``, ``cls_token_num=120``, ``model_type="t2i"``) | ``LlamaGenT2I(pretrained=True, weights_dir=...)`` |
| ``vq_ds16_t2i.pt`` | LlamaGen ``tokenizer/tokenizer_image/vq_model.py`` ``VQ_16`` (``tests/test_vq.py: reference_keys``) | the same ``LlamaGenT2I`` |
| ``jadohu/llamagen_drafter``, ``jadohu/llamagen2_drafter`` (``config.json`` + ``pytorch_model.bin``) | jadohu/LANTERN ``data/configs/llamagen_t2i{,2}_config.json`` + ``models/drafters/cnets_llamagen.py: Model`` | ``EagleDrafter(checkpoint=..., prefix="all")`` |
| ``deepseek-community/Janus-Pro-1B`` / ``-7B`` | deepseek-ai/Janus-Pro-{1B,7B} ``config.json`` + deepseek-ai/Janus ``janus/models/{modeling_vlm,siglip_vit,projector,vq_model}.py``, renamed as transformers' ``convert_janus_weights_to_hf.py`` does | ``strict_load`` into ``JanusForConditionalGeneration`` inside ``JanusPro`` (``load_pretrained`` refuses missing / unexpected / mismatched keys; ``published_janus_pro``, checked by ``tests/test_adapters.py``) |
| ``Alpha-VLLM/Lumina-mGPT-7B-768`` | Chameleon-7B's ``config.json`` values + Lumina-mGPT ``model/chameleon/modeling_chameleon.py`` (qk-norm per model-parallel shard) and ``convert_chameleon_weights_to_hf.py`` (``model.vqmodel.*`` = the VQGAN's non-decoder keys) | ``build_lumina_lm`` |
| ``leloy/Anole-7b-v0.1-hf`` (Anole-7b, the checkpoint LANTERN and PathSpec load) | Chameleon-7B's ``config.json`` values (jadohu/LANTERN ``data/configs/anole_config.json``, one layer of the same sizes) + transformers' Chameleon layout as jadohu/LANTERN ``models/kv_variants/modeling_anole_kv.py`` declares it (qk-norm per head, ``ChameleonLayerNorm((num_heads, head_dim))``) and ``convert_chameleon_weights_to_hf.py`` (``model.vqmodel.*``) | ``build_lumina_lm`` |
| ``vqgan.ckpt`` (Meta's Chameleon tokenizer) | its ``vqgan.yaml`` + Meta's ``chameleon/vqgan.py`` (taming layout; ``tests/test_lumina.py: meta_decoder_shapes``) | ``load_vqgan`` |
| ``BAAI/Emu3-Gen-hf`` (language model) | BAAI/Emu3-Gen ``config.json`` values + baaivision/Emu3 ``emu3/mllm/modeling_emu3.py`` (``Emu3ForCausalLM``), renamed as transformers' ``conversion_mapping.py`` loads it | ``strict_load`` into ``Emu3ForConditionalGeneration`` |
| ``BAAI/Emu3-Gen-hf`` (vision tokenizer, ``model.vqmodel.*``) | BAAI/Emu3-VisionTokenizer's config (the defaults of baaivision/Emu3 ``emu3/tokenizer/configuration_emu3visionvq.py``) + ``emu3/tokenizer/modeling_emu3visionvq.py`` (``Emu3VisionVQModel``), renamed as transformers' ``convert_emu3_weights_to_hf.py`` wrote the -hf checkpoint (attention 1x1 convolutions as linear weights) and as ``conversion_mapping.py`` loads it | the same ``strict_load``; exact layout of ``Emu3ForConditionalGeneration.model.vqmodel`` |
| ``zai-org/GLM-Image`` (AR stage, ``vision_language_encoder/``) | the defaults of transformers' ``GlmImage*Config`` (documented as zai-org/GLM-Image's) + transformers' ``models/glm_image/modeling_glm_image.py``, the checkpoint's own format | ``strict_load`` into ``GlmImageForConditionalGeneration`` inside ``GlmImage`` (``load_pretrained`` refuses missing / unexpected / mismatched keys; ``published_glm_image``) |
| ``google/flan-t5-xl`` as ``T5EncoderModel`` | its ``config.json`` + the T5 layout of its HF checkpoint (encoder half; ``encoder.embed_tokens`` is the tied alias of ``shared``) | ``strict_load`` into ``T5EncoderModel`` |

Published values that could not be re-read here (no network) are Janus-Pro's, Lumina-mGPT's and Emu3's
``config.json`` sizes; they are the DeepSeek-LLM 1.3B / 7B and Chameleon-7B sizes those repositories and
their papers state, and for Emu3 the defaults of transformers' ``Emu3TextConfig`` and of baaivision/Emu3's
vision-tokenizer configuration class (noted where used). About 20 s on 2 CPU cores.

``PUBLISHED`` builds every adapter at its published size through its own constructor on the meta device
(``Published``); the conformance suite (``tests/test_adapters.py``) checks those layouts and loads them strictly.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from coolsd.models.checkpoints import strict_load
from tests.helpers import CONFIGS
from tests.test_lumina import meta_decoder_shapes
from tests.test_vq import reference_keys as llamagen_vq_keys

Shapes = dict[str, tuple[int, ...]]


def meta_state(shapes: Shapes) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def assert_layout(module: torch.nn.Module, shapes: Shapes, aliases: tuple[str, ...] = ()) -> None:
    """``module``'s state dict has exactly ``shapes`` (plus tied ``aliases``), everything on the meta device."""
    got = {k: tuple(v.shape) for k, v in module.state_dict().items() if k not in aliases}
    assert sorted(set(got) - set(shapes)) == [] and sorted(set(shapes) - set(got)) == []
    assert got == shapes
    assert all(p.device.type == "meta" for p in module.parameters())


def broken(shapes: Shapes) -> tuple[Shapes, Shapes]:
    """Two corrupt variants of a layout: one key renamed, one parameter reshaped."""
    key = sorted(shapes)[len(shapes) // 2]
    renamed = {(k + "_renamed" if k == key else k): s for k, s in shapes.items()}
    reshaped = {k: ((s[0] + 1, *s[1:]) if k == key else s) for k, s in shapes.items()}
    return renamed, reshaped


# -- LlamaGen T2I-XL (FoundationVision/LlamaGen autoregressive/models/gpt.py) ------------------------------------
GPT_XL = {
    "dim": 1280,
    "n_layer": 36,
    "n_head": 20,
    "vocab_size": 16384,
    "caption_dim": 2048,
    "cls_token_num": 120,
    "multiple_of": 256,
}  # GPT_XL + the T2I arguments of sample_t2i.py


def llamagen_gpt_keys(
    dim: int,
    n_layer: int,
    n_head: int,
    vocab_size: int,
    caption_dim: int,
    cls_token_num: int,
    multiple_of: int,
) -> Shapes:
    """``Transformer(ModelArgs(model_type="t2i"))``'s state dict: ``CaptionEmbedder`` (``cap_proj`` = MLP fc1/fc2
    without bias, the ``uncond_embedding`` buffer of 120 x caption_dim), ``tok_embeddings``, blocks with a fused
    ``wqkv`` (n_kv_head = n_head), SwiGLU ``w1/w2/w3`` of ``find_multiple(int(2 * 4 * dim / 3), multiple_of)``,
    two RMSNorms each, the final ``norm`` and ``output``; ``freqs_cis`` is a plain attribute (not saved)."""
    hidden = int(2 * 4 * dim / 3)
    hidden = hidden if hidden % multiple_of == 0 else hidden + multiple_of - hidden % multiple_of
    keys: Shapes = {
        "cls_embedding.cap_proj.fc1.weight": (dim, caption_dim),
        "cls_embedding.cap_proj.fc2.weight": (dim, dim),
        "cls_embedding.uncond_embedding": (cls_token_num, caption_dim),
        "tok_embeddings.weight": (vocab_size, dim),
        "norm.weight": (dim,),
        "output.weight": (vocab_size, dim),
    }
    for i in range(n_layer):
        p = f"layers.{i}."
        keys.update(
            {
                p + "attention.wqkv.weight": (3 * dim, dim),
                p + "attention.wo.weight": (dim, dim),
                p + "feed_forward.w1.weight": (hidden, dim),
                p + "feed_forward.w3.weight": (hidden, dim),
                p + "feed_forward.w2.weight": (dim, hidden),
                p + "attention_norm.weight": (dim,),
                p + "ffn_norm.weight": (dim,),
            }
        )
    return keys


# flan-t5-xl config.json (google/flan-t5-xl): the text encoder as LlamaGen's language/t5.py uses it
FLAN_T5_XL = {
    "vocab_size": 32128,
    "d_model": 2048,
    "d_kv": 64,
    "d_ff": 5120,
    "num_layers": 24,
    "num_heads": 32,
    "relative_attention_num_buckets": 32,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
    "layer_norm_epsilon": 1e-6,
}


def t5_encoder_keys(
    vocab_size: int,
    d_model: int,
    d_kv: int,
    d_ff: int,
    num_layers: int,
    num_heads: int,
    relative_attention_num_buckets: int,
    **_,
) -> Shapes:
    """The encoder half of a T5 v1.1 / Flan-T5 checkpoint (gated-GELU ``wi_0``/``wi_1``, no biases, relative
    attention bias in block 0 only), plus ``shared`` (the token embedding)."""
    inner = d_kv * num_heads
    keys: Shapes = {"shared.weight": (vocab_size, d_model), "encoder.final_layer_norm.weight": (d_model,)}
    for i in range(num_layers):
        p = f"encoder.block.{i}.layer."
        keys.update(
            {
                p + "0.SelfAttention.q.weight": (inner, d_model),
                p + "0.SelfAttention.k.weight": (inner, d_model),
                p + "0.SelfAttention.v.weight": (inner, d_model),
                p + "0.SelfAttention.o.weight": (d_model, inner),
                p + "0.layer_norm.weight": (d_model,),
                p + "1.DenseReluDense.wi_0.weight": (d_ff, d_model),
                p + "1.DenseReluDense.wi_1.weight": (d_ff, d_model),
                p + "1.DenseReluDense.wo.weight": (d_model, d_ff),
                p + "1.layer_norm.weight": (d_model,),
            }
        )
    keys["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
        relative_attention_num_buckets,
        num_heads,
    )
    return keys


@pytest.fixture(scope="module")
def flan_t5_xl():
    """``T5EncoderModel`` of flan-t5-xl's config on the meta device, loaded strictly with its encoder keys."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        encoder = T5EncoderModel(T5Config(**FLAN_T5_XL, is_encoder_decoder=False, use_cache=False)).eval()
    shapes = t5_encoder_keys(**FLAN_T5_XL)
    tied = tuple(getattr(encoder, "_tied_weights_keys", None) or ())
    assert tied == ("encoder.embed_tokens.weight",)
    assert_layout(encoder, shapes, aliases=tied)
    state = meta_state(shapes)
    strict_load(
        encoder, {**state, "encoder.embed_tokens.weight": state["shared.weight"]}, "google/flan-t5-xl"
    )
    return encoder


def test_flan_t5_xl_encoder_layout(flan_t5_xl):
    from transformers import T5Config, T5EncoderModel

    assert sum(p.numel() for p in flan_t5_xl.parameters()) == 1_223_527_424  # flan-t5-xl's encoder half
    with torch.device("meta"):
        other = T5EncoderModel(T5Config(**FLAN_T5_XL, is_encoder_decoder=False))
    for corrupt in broken(t5_encoder_keys(**FLAN_T5_XL)):
        state = meta_state(corrupt)
        with pytest.raises(ValueError, match="does not match"):
            strict_load(other, {**state, "encoder.embed_tokens.weight": state["shared.weight"]}, "corrupt")


def write_pt(path, state: dict[str, torch.Tensor], nest: str | None = "model") -> None:
    torch.save({nest: state, "steps": 1} if nest else state, path)


def t2i_on_meta(size: int, folder, **overrides):
    """``configs/model/llamagen_t2i_{size}.yaml``'s adapter on the meta device, its GPT and VQ loaded through
    ``LlamaGenT2I(pretrained=True)`` from files in ``folder`` with the published key names and shapes (written
    here once)."""
    from coolsd.models.llamagen_t2i import LlamaGenT2I

    if not (folder / "vq_ds16_t2i.pt").is_file():
        gpt = meta_state(llamagen_gpt_keys(**GPT_XL))
        for name in ("t2i_XL_stage1_256.pt", "t2i_XL_stage2_512.pt"):  # the two stages share every shape
            write_pt(folder / name, gpt)
        write_pt(folder / "vq_ds16_t2i.pt", meta_state(llamagen_vq_keys((1, 1, 2, 2, 4))))
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"llamagen_t2i_{size}.yaml"))
    cfg.pop("_target_"), cfg.pop("defaults", None)
    cfg.update(device="meta", weights_dir=str(folder), **overrides)
    with torch.device("meta"):
        return LlamaGenT2I(**cfg)


@pytest.fixture(scope="module")
def xl_targets(tmp_path_factory, flan_t5_xl):
    """LlamaGen T2I-XL stage I and II, built from configs/model/llamagen_t2i_{256,512}.yaml on the meta device and
    loaded through ``LlamaGenT2I(pretrained=True)`` from files with the published key names and shapes."""
    from coolsd.models.llamagen_t2i import HashWordTokenizer

    folder = tmp_path_factory.mktemp("llamagen_t2i")
    models = {size: t2i_on_meta(size, folder, text_encoder=flan_t5_xl, tokenizer=HashWordTokenizer(32128))
              for size in (256, 512)}
    return models, folder


@pytest.mark.parametrize("size, grid", [(256, 16), (512, 32)])
def test_llamagen_t2i_xl_gpt_and_vq16_load_strictly_at_full_size(xl_targets, size, grid):
    models, _ = xl_targets
    model = models[size]
    assert model.grid == (grid, grid) and model.cfg.cls_token_num == 120
    assert_layout(model.gpt, llamagen_gpt_keys(**GPT_XL))
    assert_layout(model.vq, llamagen_vq_keys((1, 1, 2, 2, 4)))
    assert sum(p.numel() for p in model.gpt.parameters()) == 777_678_080  # (+ the 120 x 2048 uncond buffer)


def test_a_renamed_or_reshaped_llamagen_parameter_fails(xl_targets, tmp_path):
    from coolsd.models.llamagen import load_gpt_checkpoint

    models, _ = xl_targets
    for i, corrupt in enumerate(broken(llamagen_gpt_keys(**GPT_XL))):
        write_pt(tmp_path / f"bad{i}.pt", meta_state(corrupt))
        with pytest.raises(RuntimeError):
            load_gpt_checkpoint(models[256].gpt, str(tmp_path / f"bad{i}.pt"), strict=True)


# -- LANTERN's LlamaGen drafters (jadohu/LANTERN data/configs, models/drafters/cnets_llamagen.py) -----------------
LANTERN_CONFIGS = {  # data/configs/llamagen_t2i_config.json / llamagen_t2i2_config.json (as released beside the weights)
    "t2i": {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "caption_dim": 2048,
        "class_dropout_p": 0.0,
        "initializer_range": 0.02,
        "intermediate_size": 3584,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 20,
        "num_hidden_layers": 1,
        "num_key_value_heads": 20,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.32.0.dev0",
        "use_cache": True,
        "vocab_size": 16384,
        "input_type": "t2i",
    },
}
LANTERN_CONFIGS["t2i2"] = {**LANTERN_CONFIGS["t2i"], "input_type": "t2i2"}


def lantern_drafter_keys(config: dict) -> Shapes:
    """``cnets_llamagen.Model`` state dict: its own ``embed_tokens``, ``fc`` (2H -> H, bias) and one
    ``LlamaDecoderLayer`` with index 0 (no ``input_layernorm``); the rotary tables are not saved."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, inter = h // heads, config["intermediate_size"]
    keys: Shapes = {
        "embed_tokens.weight": (config["vocab_size"], h),
        "fc.weight": (h, 2 * h),
        "fc.bias": (h,),
    }
    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}."
        keys.update(
            {
                p + "self_attn.q_proj.weight": (heads * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, heads * d),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if layer:
            keys[p + "input_layernorm.weight"] = (h,)
    return keys


@pytest.mark.parametrize(
    "repo, size, input_type",
    [("jadohu/llamagen_drafter", 256, "t2i"), ("jadohu/llamagen2_drafter", 512, "t2i2")],
)
def test_lanterns_released_drafters_load_strictly(xl_targets, tmp_path, repo, size, input_type):
    from coolsd.drafters.eagle import EagleDrafter

    models, _ = xl_targets
    config = LANTERN_CONFIGS[input_type]
    folder = tmp_path / repo.split("/")[1]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_pt(folder / "pytorch_model.bin", meta_state(lantern_drafter_keys(config)), nest=None)
    drafter_cfg = OmegaConf.load(CONFIGS / "drafter" / f"llamagen_t2i_{size}.yaml")
    assert drafter_cfg.checkpoint == f"hub:{repo}" and drafter_cfg.prefix == "all"
    drafter = EagleDrafter(models[size], checkpoint=str(folder), prefix=drafter_cfg.prefix)
    head = drafter.head
    assert head.prefix == "all"  # read from config.json's input_type: LANTERN trained on every caption slot
    with pytest.raises(ValueError, match="trained with prefix='all' but drafter.prefix='last'"):
        EagleDrafter(models[size], checkpoint=str(folder), prefix="last")  # drafter=eagle's default
    assert head.embedding.shape == (16384, 1280) and head.fc.weight.shape == (1280, 2560) and head.bias
    assert head.layer.intermediate_size == 3584 and head.norm_eps == 1e-6
    expected = 16384 * 1280 + 1280 * 2560 + 1280 + 4 * 1280 * 1280 + 3 * 1280 * 3584 + 1280
    assert sum(p.numel() for p in head.parameters()) + head.embedding.numel() == expected
    for corrupt in broken(lantern_drafter_keys(config)):
        write_pt(folder / "pytorch_model.bin", meta_state(corrupt), nest=None)
        with pytest.raises(ValueError):
            EagleDrafter(models[size], checkpoint=str(folder), prefix="all")
    other = {**config, "input_type": "t2i2" if input_type == "t2i" else "t2i"}  # the other stage's RoPE grid
    (folder / "config.json").write_text(json.dumps(other))
    write_pt(folder / "pytorch_model.bin", meta_state(lantern_drafter_keys(config)), nest=None)
    with pytest.raises(ValueError, match="input_type"):
        EagleDrafter(models[size], checkpoint=str(folder), prefix="all")


# -- Janus-Pro (deepseek-ai/Janus -> transformers' convert_janus_weights_to_hf.py) ----------------------------------
JANUS_PRO = {  # deepseek-ai/Janus-Pro-{1B,7B}/config.json (DeepSeek-LLM 1.3B / 7B language models; SigLIP-L/16-384)
    "1B": {
        "language_config": {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 102400,
            "max_position_embeddings": 16384,
        },
        "aligner": {"depth": 2, "input_dim": 1024, "n_embed": 2048},
        "gen_aligner": {"depth": 2, "input_dim": 8, "n_embed": 2048},
        "gen_head": {"image_token_embed": 2048, "image_token_size": 16384, "n_embed": 2048},
        "gen_vision": {"image_token_size": 16384, "n_embed": 8},
        "image_size": 384,
    },
    "7B": {
        "language_config": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 30,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 102400,
            "max_position_embeddings": 16384,
        },
        "aligner": {"depth": 2, "input_dim": 1024, "n_embed": 4096},
        "gen_aligner": {"depth": 2, "input_dim": 8, "n_embed": 4096},
        "gen_head": {"image_token_embed": 4096, "image_token_size": 16384, "n_embed": 4096},
        "gen_vision": {"image_token_size": 16384, "n_embed": 8},
        "image_size": 384,
    },
}
SIGLIP_L16_384 = {"width": 1024, "layers": 24, "heads": 16, "mlp_ratio": 4, "patch_size": 16}  # siglip_vit.py


def janus_original_keys(cfg: dict) -> Shapes:
    """``MultiModalityCausalLM``'s state dict (deepseek-ai/Janus ``janus/models``): the SigLIP tower
    (``create_siglip_vit``: timm ``VisionTransformer``, no class token, ``global_pool="map"`` so an
    ``attn_pool`` head, LayerNorms with bias, fused ``qkv``), two ``MlpProjector`` (mlp_gelu, depth 2:
    ``layers.0`` and ``layers.2``), the LlamaGen VQ-16 ``gen_vision_model``, ``gen_head`` (``vision_head``),
    ``gen_embed`` and the ``LlamaForCausalLM`` language model."""
    keys: Shapes = {}
    w, mlp, lm = (
        SIGLIP_L16_384["width"],
        SIGLIP_L16_384["width"] * SIGLIP_L16_384["mlp_ratio"],
        cfg["language_config"],
    )
    tokens = (cfg["image_size"] // SIGLIP_L16_384["patch_size"]) ** 2
    vt = "vision_model.vision_tower."
    keys.update(
        {
            vt + "patch_embed.proj.weight": (w, 3, 16, 16),
            vt + "patch_embed.proj.bias": (w,),
            vt + "pos_embed": (1, tokens, w),
            vt + "norm.weight": (w,),
            vt + "norm.bias": (w,),
        }
    )
    for i in range(SIGLIP_L16_384["layers"]):
        b = f"{vt}blocks.{i}."
        for norm in ("norm1", "norm2"):
            keys.update({b + norm + ".weight": (w,), b + norm + ".bias": (w,)})
        keys.update(
            {
                b + "attn.qkv.weight": (3 * w, w),
                b + "attn.qkv.bias": (3 * w,),
                b + "attn.proj.weight": (w, w),
                b + "attn.proj.bias": (w,),
                b + "mlp.fc1.weight": (mlp, w),
                b + "mlp.fc1.bias": (mlp,),
                b + "mlp.fc2.weight": (w, mlp),
                b + "mlp.fc2.bias": (w,),
            }
        )
    pool = vt + "attn_pool."  # AttentionPoolLatent (dropped by the conversion)
    keys.update(
        {
            pool + "latent": (1, 1, w),
            pool + "q.weight": (w, w),
            pool + "q.bias": (w,),
            pool + "kv.weight": (2 * w, w),
            pool + "kv.bias": (2 * w,),
            pool + "proj.weight": (w, w),
            pool + "proj.bias": (w,),
            pool + "norm.weight": (w,),
            pool + "norm.bias": (w,),
            pool + "mlp.fc1.weight": (mlp, w),
            pool + "mlp.fc1.bias": (mlp,),
            pool + "mlp.fc2.weight": (w, mlp),
            pool + "mlp.fc2.bias": (w,),
        }
    )
    for name, proj in (("aligner", cfg["aligner"]), ("gen_aligner", cfg["gen_aligner"])):
        n, d = proj["n_embed"], proj["input_dim"]
        keys.update(
            {
                f"{name}.layers.0.weight": (n, d),
                f"{name}.layers.0.bias": (n,),
                f"{name}.layers.2.weight": (n, n),
                f"{name}.layers.2.bias": (n,),
            }
        )
    keys.update({f"gen_vision_model.{k}": s for k, s in llamagen_vq_keys((1, 1, 2, 2, 4)).items()})
    head = cfg["gen_head"]
    keys.update(
        {
            "gen_head.output_mlp_projector.weight": (head["image_token_embed"], head["n_embed"]),
            "gen_head.output_mlp_projector.bias": (head["image_token_embed"],),
            "gen_head.vision_head.weight": (head["image_token_size"], head["image_token_embed"]),
            "gen_head.vision_head.bias": (head["image_token_size"],),
            "gen_embed.weight": (cfg["gen_vision"]["image_token_size"], cfg["gen_vision"]["n_embed"]),
        }
    )
    h, inter, v = lm["hidden_size"], lm["intermediate_size"], lm["vocab_size"]
    kv = h // lm["num_attention_heads"] * lm["num_key_value_heads"]
    keys.update(
        {
            "language_model.model.embed_tokens.weight": (v, h),
            "language_model.model.norm.weight": (h,),
            "language_model.lm_head.weight": (v, h),
        }
    )
    for i in range(lm["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        keys.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return keys


# The renames of transformers' convert_janus_weights_to_hf.py, restated as (pattern, replacement) on one key.
JANUS_RENAMES = [
    (r"^vision_model\.vision_tower\.attn_pool\..*", None),
    (r"^gen_vision_model\.quantize\.codebook_used$", None),
    (
        r"^vision_model\.vision_tower\.blocks\.(\d+)\.attn\.",
        r"model.vision_model.encoder.layers.\1.self_attn.",
    ),
    (r"^vision_model\.vision_tower\.blocks\.", "model.vision_model.encoder.layers."),
    (r"^vision_model\.vision_tower\.pos_embed$", "model.vision_model.embeddings.position_embedding.weight"),
    (r"^vision_model\.vision_tower\.patch_embed\.proj\.", "model.vision_model.embeddings.patch_embedding."),
    (r"^vision_model\.vision_tower\.norm\.", "model.vision_model.post_layernorm."),
    (r"^(model\.vision_model\..*)\.proj\.", r"\1.projection_layer."),
    (r"^(model\.vision_model\..*)\.norm(\d)\.", r"\1.layer_norm\2."),
    (r"^gen_vision_model\.", "model.vqmodel."),
    (r"^model\.vqmodel\.encoder\.conv_blocks\.", "model.vqmodel.encoder.down."),
    (r"^model\.vqmodel\.decoder\.conv_blocks\.", "model.vqmodel.decoder.up."),
    (r"^(model\.vqmodel\..*)\.res\.", r"\1.block."),
    (r"^(model\.vqmodel\..*)\.mid\.0\.", r"\1.mid.block_1."),
    (r"^(model\.vqmodel\..*)\.mid\.1\.", r"\1.mid.attn_1."),
    (r"^(model\.vqmodel\..*)\.mid\.2\.", r"\1.mid.block_2."),
    (r"^gen_aligner\.layers\.0\.", "model.generation_aligner.fc1."),
    (r"^gen_aligner\.layers\.2\.", "model.generation_aligner.hidden_layers.0."),
    (r"^aligner\.layers\.0\.", "model.aligner.fc1."),
    (r"^aligner\.layers\.2\.", "model.aligner.hidden_layers.0."),
    (r"^gen_head\.output_mlp_projector\.", "model.generation_head.proj_out."),
    (r"^gen_head\.", "model.generation_head."),
    (r"^gen_embed\.", "model.generation_embeddings."),
    (r"^language_model\.lm_head\.weight$", "lm_head.weight"),
    (r"^language_model\.model\.", "model.language_model."),
]


def janus_hf_keys(cfg: dict) -> Shapes:
    """The deepseek-community checkpoint: the original keys renamed, ``qkv`` split into q/k/v, the position
    embedding squeezed to (tokens, width)."""
    out: Shapes = {}
    for key, shape in janus_original_keys(cfg).items():
        for pattern, replacement in JANUS_RENAMES:
            if re.search(pattern, key):
                key = None if replacement is None else re.sub(pattern, replacement, key)
                if key is None:
                    break
        if key is None:
            continue
        if ".qkv." in key:
            for part in ("q_proj", "k_proj", "v_proj"):
                out[key.replace("qkv", part)] = (shape[0] // 3, *shape[1:])
        elif key.endswith("position_embedding.weight"):
            out[key] = shape[1:]
        else:
            out[key] = shape
    return out


def janus_config(cfg: dict):
    """The ``JanusConfig`` that convert_janus_weights_to_hf.py writes from the original config.json."""
    from transformers import JanusConfig, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    text = LlamaConfig(**cfg["language_config"])
    vision = JanusVisionConfig(
        image_size=cfg["image_size"], projection_dim=cfg["aligner"]["n_embed"], depth=cfg["aligner"]["depth"]
    )
    vq = JanusVQVAEConfig(
        embed_dim=cfg["gen_vision"]["n_embed"],
        num_embeddings=cfg["gen_vision"]["image_token_size"],
        projection_dim=cfg["gen_aligner"]["n_embed"],
        depth=cfg["gen_aligner"]["depth"],
        image_token_embed_dim=cfg["gen_head"]["image_token_embed"],
    )
    return JanusConfig(text_config=text, vision_config=vision, vq_config=vq)


# -- Lumina-mGPT-7B-768 (Alpha-VLLM/Lumina-mGPT, a Chameleon-7B fine-tune) -------------------------------------------
CHAMELEON_7B = {
    "vocab_size": 65536,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "model_parallel_size": 1,
    "swin_norm": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
}  # Lumina-mGPT-7B-768 config.json
CHAMELEON_VQGAN_YAML = {  # Meta's tokenizer/vqgan.yaml (Chameleon): model.params
    "embed_dim": 256,
    "n_embed": 8192,
    "ddconfig": {
        "double_z": False,
        "z_channels": 256,
        "resolution": 512,
        "in_channels": 3,
        "out_ch": 3,
        "ch": 128,
        "ch_mult": [1, 1, 2, 2, 4],
        "num_res_blocks": 2,
        "attn_resolutions": [],
        "dropout": 0.0,
    },
    "lossconfig": {"target": "taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator", "params": {}},
}


def meta_encoder_shapes(
    embed_dim: int,
    z_channels: int,
    ch: int,
    ch_mult,
    num_res_blocks: int,
    attn_resolutions,
    resolution: int,
    in_channels: int = 3,
    double_z: bool = False,
    **_,
) -> Shapes:
    """The non-decoder half of Meta's vqgan.py state dict (taming ``Encoder`` + ``quant_conv``)."""
    shapes: Shapes = {}

    def conv(name, cin, cout, k):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c,), (c,)

    def resblock(name, cin, cout):
        norm(f"{name}.norm1", cin), conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout), conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    conv("encoder.conv_in", in_channels, ch, 3)
    block_in, res = ch, resolution
    for level, mult in enumerate(ch_mult):
        for i in range(num_res_blocks):
            resblock(f"encoder.down.{level}.block.{i}", block_in, ch * mult)
            block_in = ch * mult
            if res in attn_resolutions:
                attn(f"encoder.down.{level}.attn.{i}", block_in)
        if level != len(ch_mult) - 1:
            conv(f"encoder.down.{level}.downsample.conv", block_in, block_in, 3)
            res //= 2
    resblock("encoder.mid.block_1", block_in, block_in)
    attn("encoder.mid.attn_1", block_in)
    resblock("encoder.mid.block_2", block_in, block_in)
    norm("encoder.norm_out", block_in)
    conv("encoder.conv_out", block_in, 2 * z_channels if double_z else z_channels, 3)
    conv("quant_conv", z_channels, embed_dim, 1)
    return shapes


def lumina_keys() -> Shapes:
    """Lumina-mGPT-7B-768's safetensors: the Chameleon LM (qk-norm weight/bias of (model_parallel_size, head_dim),
    as its ChameleonLayerNorm and the 7B conversion write them) and ``model.vqmodel.*`` (every non-decoder key of
    vqgan.ckpt, which convert_chameleon_weights_to_hf.py copies)."""
    c = CHAMELEON_7B
    h, inter, v, d = (
        c["hidden_size"],
        c["intermediate_size"],
        c["vocab_size"],
        c["hidden_size"] // c["num_attention_heads"],
    )
    keys: Shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        keys.update({p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"})
        keys.update(
            {
                p + f"self_attn.{n}_norm.{w}": (c["model_parallel_size"], d)
                for n in "qk"
                for w in ("weight", "bias")
            }
        )
        keys.update(
            {
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    vq = {**CHAMELEON_VQGAN_YAML["ddconfig"], "embed_dim": CHAMELEON_VQGAN_YAML["embed_dim"]}
    vq_keys = {
        **meta_encoder_shapes(**vq),
        "quantize.embedding.weight": (CHAMELEON_VQGAN_YAML["n_embed"], vq["embed_dim"]),
        "post_quant_conv.weight": (vq["z_channels"], vq["embed_dim"], 1, 1),
        "post_quant_conv.bias": (vq["z_channels"],),
    }
    keys.update({f"model.vqmodel.{k}": s for k, s in vq_keys.items()})
    return keys


def lumina_lm_layout() -> Shapes:
    """``ChameleonLM``'s state dict at Lumina-mGPT-7B-768's sizes: ``lumina_keys`` without the VQGAN, the qk-norm
    rows expanded per head as ``build_lumina_lm`` loads them."""
    expected = {k: s for k, s in lumina_keys().items() if not k.startswith("model.vqmodel.")}
    heads = {"q": CHAMELEON_7B["num_attention_heads"], "k": CHAMELEON_7B["num_key_value_heads"]}
    expected.update(
        {
            k: (heads[k.rsplit(".", 2)[-2][0]], s[1])
            for k, s in expected.items()
            if k.endswith(("q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"))
        }
    )  # per head
    return expected


def test_lumina_mgpt_7b_768_loads_strictly_through_build_lumina_lm():
    from transformers import ChameleonConfig

    from coolsd.models.lumina_mgpt import build_lumina_lm

    config = ChameleonConfig(**CHAMELEON_7B, vocabulary_map={"<image>": 8711})
    shapes = lumina_keys()
    lm = build_lumina_lm(config, meta_state(shapes), "Alpha-VLLM/Lumina-mGPT-7B-768")
    assert_layout(lm, lumina_lm_layout())
    assert sum(p.numel() for p in lm.parameters()) == 7_013_666_816
    for corrupt in broken({k: s for k, s in shapes.items() if not k.startswith("model.vqmodel.")}):
        with pytest.raises(ValueError, match="does not match"):
            build_lumina_lm(config, meta_state(corrupt), "corrupt")


def anole_keys() -> Shapes:
    """leloy/Anole-7b-v0.1-hf's safetensors: Lumina-mGPT's Chameleon-7B keys with the qk-norm weight and bias per
    head, (num_heads, head_dim), as transformers' ``ChameleonLayerNorm((num_heads, head_dim))`` holds them (LANTERN's
    ``modeling_anole_kv.py`` loads the checkpoint into that module with ``from_pretrained``)."""
    heads = {"q": CHAMELEON_7B["num_attention_heads"], "k": CHAMELEON_7B["num_key_value_heads"]}
    return {k: (heads[k.rsplit(".", 2)[-2][0]], s[1]) if ".self_attn." in k and "_norm." in k else s
            for k, s in lumina_keys().items()}


def test_anole_7b_loads_strictly_through_build_lumina_lm():
    from transformers import ChameleonConfig

    from coolsd.models.lumina_mgpt import build_lumina_lm

    config = ChameleonConfig(**CHAMELEON_7B, vocabulary_map={"<image>": 8711})
    shapes = anole_keys()
    lm = build_lumina_lm(config, meta_state(shapes), "leloy/Anole-7b-v0.1-hf")
    assert_layout(lm, lumina_lm_layout())  # the same module as Lumina-mGPT's, qk-norm rows already per head
    assert sum(p.numel() for p in lm.parameters()) == 7_013_666_816
    for corrupt in broken({k: s for k, s in shapes.items() if not k.startswith("model.vqmodel.")}):
        with pytest.raises(ValueError, match="does not match"):
            build_lumina_lm(config, meta_state(corrupt), "corrupt")


def test_chameleon_vqgan_ckpt_loads_strictly_through_load_vqgan(tmp_path):
    from coolsd.models.chameleon_vqgan import load_vqgan

    dd = CHAMELEON_VQGAN_YAML["ddconfig"]
    decoder = meta_decoder_shapes(
        n_embed=8192,
        embed_dim=256,
        z_channels=dd["z_channels"],
        ch=dd["ch"],
        ch_mult=dd["ch_mult"],
        num_res_blocks=dd["num_res_blocks"],
        attn_resolutions=dd["attn_resolutions"],
        resolution=dd["resolution"],
    )
    full = {**meta_encoder_shapes(embed_dim=256, **dd), **decoder}  # the whole Lightning state_dict
    (tmp_path / "vqgan.yaml").write_text(
        yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel", "params": CHAMELEON_VQGAN_YAML}})
    )
    torch.save({"state_dict": meta_state(full)}, tmp_path / "vqgan.ckpt")
    with torch.device("meta"):
        vqgan = load_vqgan(tmp_path / "vqgan.yaml", tmp_path / "vqgan.ckpt")
    assert_layout(vqgan, decoder)
    assert vqgan.downsample_factor == 16 and vqgan.config.n_embed == 8192
    for corrupt in broken(decoder):
        torch.save(
            {"state_dict": meta_state({**meta_encoder_shapes(embed_dim=256, **dd), **corrupt})},
            tmp_path / "bad.ckpt",
        )
        with torch.device("meta"), pytest.raises((ValueError, RuntimeError)):
            load_vqgan(tmp_path / "vqgan.yaml", tmp_path / "bad.ckpt")


# -- Emu3-Gen (BAAI/Emu3-Gen + BAAI/Emu3-VisionTokenizer, converted to transformers' layout as BAAI/Emu3-Gen-hf) -------
EMU3_GEN = {
    "vocab_size": 184622,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 9216,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "image_area": 518400,
}  # BAAI/Emu3-Gen config.json as transformers' Emu3TextConfig defaults to it; cross-read (2026-12-05, search index) against
#   BAAI/Emu3-Chat's published config.json (same vocab, widths, heads, rope, eps; 32 layers) and a public
#   Emu3-Gen derivative's (image_area 518400, max_position_embeddings 9216); Emu3-Gen's own file not read
EMU3_VISION_TOKENIZER = {
    "codebook_size": 32768,
    "embed_dim": 4,
    "z_channels": 4,
    "ch": 256,
    "ch_mult": [1, 2, 2, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [3],
    "temporal_downsample_factor": 4,
    "in_channels": 3,
    "out_channels": 3,
    "double_z": False,
}  # BAAI/Emu3-VisionTokenizer config.json (the defaults of baaivision/Emu3 emu3/tokenizer/configuration_emu3visionvq.py)


def emu3_lm_keys(c: dict) -> Shapes:
    """The language model's state dict as baaivision/Emu3 ``emu3/mllm/modeling_emu3.py`` ``Emu3ForCausalLM`` writes
    it (Llama layout with grouped K/V), under the ``text_model.`` prefix of the transformers-format checkpoint."""
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    keys: Shapes = {"text_model.model.embed_tokens.weight": (v, h), "text_model.model.norm.weight": (h,),
                    "text_model.lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"text_model.model.layers.{i}."
        keys.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                     p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                     p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                     p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                     p + "post_attention_layernorm.weight": (h,)})
    return keys


def emu3_vision_tokenizer_keys(c: dict) -> Shapes:
    """BAAI/Emu3-VisionTokenizer's state dict as baaivision/Emu3 ``emu3/tokenizer/modeling_emu3visionvq.py``
    ``Emu3VisionVQModel`` writes it: a 2-D encoder (``down.{level}.block/attn``, ``mid``) followed by temporal
    down-sampling convolutions and temporal residual blocks (BatchNorm3d and causal Conv3d), the mirrored
    decoder whose norms are spatial norms conditioned on the quantised codes (GroupNorm + 1x1 ``conv_y`` /
    ``conv_b`` from ``embed_dim`` channels), attention as 1x1 convolutions ``q k v proj_out`` at the stage
    indices ``attn_resolutions``, the codebook, and the (3, 1, 1) causal ``quant_conv`` /
    ``post_quant_conv``."""
    ch, mult, blocks, z, e = c["ch"], c["ch_mult"], c["num_res_blocks"], c["z_channels"], c["embed_dim"]
    keys: Shapes = {}

    def conv(name: str, c_in: int, c_out: int, *kernel: int) -> None:
        keys.update({f"{name}.weight": (c_out, c_in, *kernel), f"{name}.bias": (c_out,)})

    def norm(name: str, channels: int, spatial: bool) -> None:
        if spatial:  # Emu3VisionVQSpatialNorm (add_conv off)
            norm(f"{name}.norm_layer", channels, False)
            conv(f"{name}.conv_y", e, channels, 1, 1)
            conv(f"{name}.conv_b", e, channels, 1, 1)
        else:  # GroupNorm
            keys.update({f"{name}.weight": (channels,), f"{name}.bias": (channels,)})

    def resnet(name: str, c_in: int, c_out: int, spatial: bool) -> None:
        norm(f"{name}.norm1", c_in, spatial)
        conv(f"{name}.conv1", c_in, c_out, 3, 3)
        norm(f"{name}.norm2", c_out, spatial)
        conv(f"{name}.conv2", c_out, c_out, 3, 3)
        if c_in != c_out:
            conv(f"{name}.nin_shortcut", c_in, c_out, 1, 1)

    def attention(name: str, channels: int, spatial: bool) -> None:
        norm(f"{name}.norm", channels, spatial)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{proj}", channels, channels, 1, 1)

    def temporal_resnet(name: str, channels: int) -> None:  # as many channels in as out: no shortcut
        for i in (1, 2):
            stats = ("weight", "bias", "running_mean", "running_var")
            keys.update({f"{name}.norm{i}.{w}": (channels,) for w in stats})
            keys[f"{name}.norm{i}.num_batches_tracked"] = ()
            conv(f"{name}.conv{i}.conv", channels, channels, 3, 3, 3)

    temporal = (c["temporal_downsample_factor"] - 1).bit_length()  # log2: one temporal conv per factor 2
    z_out = 2 * z if c["double_z"] else z
    # encoder
    conv("encoder.conv_in", c["in_channels"], ch, 3, 3)
    block_in = ch
    for level, m in enumerate(mult):
        for b in range(blocks):
            resnet(f"encoder.down.{level}.block.{b}", block_in, ch * m, False)
            block_in = ch * m
            if level in c["attn_resolutions"]:
                attention(f"encoder.down.{level}.attn.{b}", block_in, False)
        if level != len(mult) - 1:
            conv(f"encoder.down.{level}.downsample.conv", block_in, block_in, 3, 3)
    resnet("encoder.mid.block_1", block_in, block_in, False)
    attention("encoder.mid.attn_1", block_in, False)
    resnet("encoder.mid.block_2", block_in, block_in, False)
    norm("encoder.norm_out", block_in, False)
    conv("encoder.conv_out", block_in, z_out, 3, 3)
    for i in range(temporal):
        conv(f"encoder.time_conv.{i}.conv.conv", z_out, z_out, 4, 3, 3)
    for i in range(blocks):
        temporal_resnet(f"encoder.time_res_stack.{i}", z_out)
    # decoder
    for i in range(blocks):
        temporal_resnet(f"decoder.time_res_stack.{i}", z)
    for i in range(temporal):
        conv(f"decoder.time_conv.{i}.conv.conv", z, z, 3, 3, 3)
    block_in = ch * mult[-1]
    conv("decoder.conv_in", z, block_in, 3, 3)
    resnet("decoder.mid.block_1", block_in, block_in, True)
    attention("decoder.mid.attn_1", block_in, True)
    resnet("decoder.mid.block_2", block_in, block_in, True)
    for level in reversed(range(len(mult))):
        for b in range(blocks + 1):
            resnet(f"decoder.up.{level}.block.{b}", block_in, ch * mult[level], True)
            block_in = ch * mult[level]
            if level in c["attn_resolutions"]:
                attention(f"decoder.up.{level}.attn.{b}", block_in, True)
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", block_in, block_in, 3, 3)
    norm("decoder.norm_out", block_in, True)
    conv("decoder.conv_out", block_in, c["out_channels"], 3, 3)
    # codebook and the causal (3, 1, 1) convolutions around it
    keys["quantize.embedding.weight"] = (c["codebook_size"], e)
    conv("quant_conv.conv", z, e, 3, 1, 1)
    conv("post_quant_conv.conv", e, z, 3, 1, 1)
    return keys


#: transformers' ``convert_emu3_weights_to_hf.py`` (which wrote BAAI/Emu3-Gen-hf), restated: its renames of
#: the vision tokenizer's keys, applied in this order after the ``vqmodel.`` prefix. Attention runs as linear
#: layers (SigLIP's attention), so ``q k v proj_out`` are renamed and their (C, C, 1, 1) weights squeezed to
#: (C, C); the attention norms move out of the attention modules; down / mid / up get a module of their own.
EMU3_VQ_CONVERSION = (
    (r"\.q\.", ".q_proj."), (r"\.k\.", ".k_proj."), (r"\.v\.", ".v_proj."), (r"\.proj_out\.", ".out_proj."),
    (r"mid\.attn_1\.norm\.", "mid.attn_norm."), (r"attn\.(\d)\.norm\.", r"attn_norms.\1."),
    (r"\.down\.", ".down_block.down."), (r"\.up\.", ".up_block.up."), (r"\.mid\.", ".middle_block."),
)


def emu3_vq_hf_layout(keys: Shapes) -> Shapes:
    """The vision tokenizer's keys and shapes as BAAI/Emu3-Gen-hf stores them (``vqmodel.*``, converted by
    ``EMU3_VQ_CONVERSION``)."""
    out: Shapes = {}
    for key, shape in keys.items():
        if re.search(r"\.(q|k|v|proj_out)\.weight$", key) and len(shape) == 4:
            shape = shape[:2]  # 1x1 convolution -> linear
        key = "vqmodel." + key
        for pattern, new in EMU3_VQ_CONVERSION:
            key = re.sub(pattern, new, key)
        out[key] = shape
    return out


def emu3_hf_name(key: str) -> str:
    """transformers' load-time renames of an Emu3 checkpoint (``conversion_mapping.py`` ``"emu3"``), restated."""
    for pattern, new in ((r"^text_model\.lm_head", "lm_head"), (r"^text_model\.model", "model.text_model"),
                         (r"^vqmodel", "model.vqmodel")):
        key = re.sub(pattern, new, key)
    return key


def emu3_config():
    from transformers import Emu3Config

    c, vq = EMU3_GEN, EMU3_VISION_TOKENIZER
    text = {k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    vq_config = {"codebook_size": vq["codebook_size"], "embed_dim": vq["embed_dim"],
                 "latent_channels": vq["z_channels"], "base_channels": vq["ch"], "channel_multiplier": vq["ch_mult"],
                 "num_res_blocks": vq["num_res_blocks"], "attn_resolutions": vq["attn_resolutions"],
                 "temporal_downsample_factor": vq["temporal_downsample_factor"],
                 "hidden_size": vq["ch"] * vq["ch_mult"][-1]}
    return Emu3Config(text_config=text, vq_config=vq_config, vocabulary_map={})


def emu3_gen_hf_shapes() -> Shapes:
    """Every key of BAAI/Emu3-Gen-hf as transformers loads it: the language model and the vision tokenizer."""
    keys = {**emu3_lm_keys(EMU3_GEN), **emu3_vq_hf_layout(emu3_vision_tokenizer_keys(EMU3_VISION_TOKENIZER))}
    return {emu3_hf_name(k): s for k, s in keys.items()}


def test_emu3_gen_language_model_loads_strictly_at_full_size():
    """Emu3-Gen's 8B language model (key names and shapes from the original Emu3ForCausalLM, renamed as
    transformers loads the -hf checkpoint) fits transformers' Emu3 classes at the published sizes, and the
    whole checkpoint (with the vision tokenizer of ``test_emu3_vision_tokenizer_loads_strictly_at_full_size``)
    loads strictly; the vision tokenizer built from the published config has Emu3's codebook, 8x spatial
    factor and decoder output."""
    from transformers import Emu3ForConditionalGeneration

    from coolsd.models.emu3 import generate_size

    with torch.device("meta"):
        model = Emu3ForConditionalGeneration(emu3_config())
    full = emu3_gen_hf_shapes()
    shapes = {k: s for k, s in full.items() if not k.startswith("model.vqmodel.")}
    vq_state = meta_state({k: s for k, s in full.items() if k.startswith("model.vqmodel.")})
    lm = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("model.vqmodel.")}
    assert lm == shapes
    assert sum(int(torch.tensor(s).prod()) for s in shapes.values()) == 8_492_011_520  # "8B": 2 x 184,622 x 4,096 + 32 x 218,112,000 + 4,096
    vq = model.model.vqmodel
    assert tuple(vq.quantize.embedding.weight.shape) == (32768, 4) and vq.spatial_scale_factor == 8
    assert tuple(vq.decoder.conv_out.weight.shape) == (3, 256, 3, 3)
    assert generate_size("1:1", EMU3_GEN["image_area"], vq.spatial_scale_factor) == (90, 90)
    for corrupt in broken(shapes):
        with pytest.raises(ValueError, match="does not match"):
            strict_load(model, {**meta_state(corrupt), **vq_state}, "corrupt")
    strict_load(model, meta_state(full), "BAAI/Emu3-Gen-hf")
    cfg = OmegaConf.load(CONFIGS / "model" / "emu3_gen.yaml")
    assert cfg.repo_id == "BAAI/Emu3-Gen-hf" and cfg.image_area == EMU3_GEN["image_area"]
    assert cfg.sampling.cfg_scale == 3.0 and cfg.sampling.top_k == 2048 and cfg.requires_cuda


def test_emu3_vision_tokenizer_loads_strictly_at_full_size():
    """BAAI/Emu3-VisionTokenizer inside BAAI/Emu3-Gen-hf: the key names and shapes of the original
    ``Emu3VisionVQModel`` at the published config (``emu3_vision_tokenizer_keys``), renamed as transformers'
    conversion script wrote the -hf checkpoint (``EMU3_VQ_CONVERSION``) and as its ``conversion_mapping.py``
    loads it, are exactly the ``model.vqmodel.*`` state dict of ``Emu3ForConditionalGeneration`` built from
    the published config (no key missing or extra either way, every shape equal); a renamed or reshaped key
    is refused."""
    from transformers import Emu3ForConditionalGeneration

    original = emu3_vision_tokenizer_keys(EMU3_VISION_TOKENIZER)
    assert len(original) == 495
    assert original["encoder.down.3.attn.1.q.weight"] == (1024, 1024, 1, 1)  # attention at stage 3 only
    assert original["decoder.up.0.block.2.norm2.conv_y.weight"] == (256, 4, 1, 1)  # spatial norm: codes
    assert original["encoder.time_conv.1.conv.conv.weight"] == (4, 4, 4, 3, 3)  # 2 temporal halvings: 4x
    with torch.device("meta"):
        model = Emu3ForConditionalGeneration(emu3_config())
    full = emu3_gen_hf_shapes()
    shapes = {k: s for k, s in full.items() if k.startswith("model.vqmodel.")}
    assert len(shapes) == len(original)  # the renames are one-to-one
    assert shapes["model.vqmodel.encoder.down_block.down.3.attn.1.q_proj.weight"] == (1024, 1024)
    assert shapes["model.vqmodel.decoder.up_block.up.3.attn_norms.0.norm_layer.weight"] == (1024,)
    assert shapes["model.vqmodel.decoder.middle_block.attn_norm.conv_b.bias"] == (1024,)
    assert_layout(model.model.vqmodel, {k.removeprefix("model.vqmodel."): s for k, s in shapes.items()})
    lm_state = meta_state({k: s for k, s in full.items() if not k.startswith("model.vqmodel.")})
    for corrupt in broken(shapes):
        with pytest.raises(ValueError, match="does not match"):
            strict_load(model, {**lm_state, **meta_state(corrupt)}, "corrupt")


# -- every adapter at its published size, for the conformance suite (tests/test_adapters.py) -----------------------
@dataclass(frozen=True)
class Published:
    """An adapter at the size of its published weights, built through its own constructor on the meta device
    (``model.device=meta``: nothing allocated), with the grid and codebook its weights have and the layout each
    submodule must have (``layouts``: ``get_submodule`` path -> keys and shapes derived above from the code that
    wrote each checkpoint). ``tests/test_adapters.py`` checks the layouts and loads them strictly."""

    model: Any
    layouts: dict[str, Shapes]
    grid: tuple[int, int]
    codebook_size: int


def yaml_model(name: str, **overrides) -> dict[str, Any]:
    """``configs/model/<name>.yaml``'s keyword arguments (no ``_target_``, no defaults list), with ``overrides``."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml"), resolve=True)
    cfg.pop("_target_"), cfg.pop("defaults", None)
    return {**cfg, **overrides}


def file_layout(path) -> Shapes:
    """Keys and shapes of a safetensors file, read from its header."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def published_embedded() -> Published:
    """The embedded model (``model=embedded``) with its shipped checkpoints, whose files define its layout."""
    from coolsd.models.llamagen import LlamaGen

    cfg = yaml_model("embedded", device="meta")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the shipped tensors copied into meta weights: a no-op
        model = LlamaGen(**cfg)
    return Published(model, {"gpt": file_layout(cfg["gpt_checkpoint"]), "vq": file_layout(cfg["vq_checkpoint"])},
                     (7, 7), 1024)


def published_llamagen_t2i(size: int) -> Callable[[], Published]:
    def build() -> Published:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as folder:
            model = t2i_on_meta(size, Path(folder), text_encoder="tiny_random")
        return Published(model, {"gpt": llamagen_gpt_keys(**GPT_XL), "vq": llamagen_vq_keys((1, 1, 2, 2, 4))},
                         (size // 16, size // 16), 16384)

    return build


def published_janus_pro(size: str) -> Callable[[], Published]:
    """``configs/model/janus_pro_{1b,7b}.yaml``'s adapter over ``JanusForConditionalGeneration`` of the published
    config (a prebuilt model: the adapter's own loader reads the hub snapshot's safetensors)."""

    def build() -> Published:
        from transformers import JanusForConditionalGeneration

        from coolsd.models.janus_pro import JanusPro, tiny_tokenizer

        shapes = janus_hf_keys(JANUS_PRO[size])
        assert not any("attn_pool" in k or "codebook_used" in k or "qkv" in k for k in shapes)
        cfg = yaml_model(f"janus_pro_{size.lower()}", device="meta")
        assert cfg["repo_id"] == f"deepseek-community/Janus-Pro-{size}"
        with torch.device("meta"):
            hf = JanusForConditionalGeneration(janus_config(JANUS_PRO[size]))
        model = JanusPro(**cfg, model=hf, tokenizer=tiny_tokenizer())
        return Published(model, {"janus": shapes}, (24, 24), 16384)

    return build


def published_lumina_mgpt() -> Published:
    """``configs/model/lumina_mgpt_768.yaml``'s adapter with random weights at Lumina-mGPT-7B's sizes (the
    language model) and the decoder of Meta's VQGAN (``vqgan.yaml``)."""
    from coolsd.models.lumina_mgpt import LuminaMGPT

    init = chameleon_7b_init()
    model = LuminaMGPT(**yaml_model("lumina_mgpt_768", pretrained=False, random_init=init, header="forced",
                                    device="meta"))
    decoder = meta_decoder_shapes(n_embed=CHAMELEON_VQGAN_YAML["n_embed"], **init["vqgan"])
    return Published(model, {"lm": lumina_lm_layout(), "vqgan": decoder}, (48, 48), 8192)


def chameleon_7b_init() -> dict[str, Any]:
    """``random_init`` of the Chameleon adapters at Chameleon-7B's sizes, with the decoder of Meta's VQGAN."""
    c, dd = CHAMELEON_7B, CHAMELEON_VQGAN_YAML["ddconfig"]
    vqgan = {"embed_dim": CHAMELEON_VQGAN_YAML["embed_dim"],
             **{k: dd[k] for k in ("z_channels", "ch", "ch_mult", "num_res_blocks", "attn_resolutions", "resolution")}}
    return {"hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
            "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c["num_key_value_heads"], "vocab_size": c["vocab_size"],
            "num_codes": CHAMELEON_VQGAN_YAML["n_embed"], "shuffle_codes": False, "vqgan": vqgan}


def published_anole() -> Published:
    """``configs/model/anole_7b.yaml``'s adapter with random weights at Anole-7b's sizes (Chameleon-7B's) and the
    decoder of Meta's VQGAN: a plain 32 x 32 grid at 512 px."""
    from coolsd.models.anole import Anole

    init = chameleon_7b_init()
    model = Anole(**yaml_model("anole_7b", pretrained=False, random_init=init, device="meta"))
    decoder = meta_decoder_shapes(n_embed=CHAMELEON_VQGAN_YAML["n_embed"], **init["vqgan"])
    return Published(model, {"lm": lumina_lm_layout(), "vqgan": decoder}, (32, 32), 8192)


def published_emu3_gen() -> Published:
    """``configs/model/emu3_gen.yaml``'s adapter over ``Emu3ForConditionalGeneration`` of the published config (a
    prebuilt model) with a tokenizer of Emu3's special and 32,768 visual tokens."""
    from transformers import Emu3ForConditionalGeneration

    from coolsd.models.emu3 import TINY_TEXT, Emu3Gen, tiny_tokenizer, tiny_vocabulary, tiny_words

    with torch.device("meta"):
        hf = Emu3ForConditionalGeneration(emu3_config())
    tokenizer = tiny_tokenizer(tiny_vocabulary(EMU3_VISION_TOKENIZER["codebook_size"], tiny_words(*TINY_TEXT)))
    model = Emu3Gen(**yaml_model("emu3_gen", device="meta"), model=hf, tokenizer=tokenizer)
    return Published(model, {"emu3": emu3_gen_hf_shapes()}, (90, 90), 32768)


# -- GLM-Image (zai-org/GLM-Image vision_language_encoder/, transformers' GLM-Image layout) ---------------------------
GLM_IMAGE = {
    "text": {"vocab_size": 168064, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
             "num_attention_heads": 32, "num_key_value_heads": 2, "vision_vocab_size": 16512},
    "vision": {"depth": 40, "hidden_size": 1536, "intermediate_size": 6144, "image_size": 2048, "patch_size": 16},
    "vq": {"embed_dim": 2048, "num_embeddings": 16384, "latent_channels": 1536},
}  # the defaults of transformers' GlmImage*Config (auto_docstring checkpoint="zai-org/GLM-Image"), the GLM-4-9B
#   sizes of the model card; zai-org/GLM-Image's own config.json not read (no network); rope values are not shapes


def glm_image_keys(c: dict) -> Shapes:
    """The AR stage's state dict as transformers' GLM-Image classes write it (the checkpoint's own format, released
    with them): GLM-4's text layers (biased q/k/v, fused gate/up MLP, sandwich norms), the vision encoder of
    image-to-image (fused biased qkv, learned 2-D position table), the VQ's quantiser and 1x1 convolutions, and
    ``lm_head`` over the vision vocabulary."""
    t, v, q = c["text"], c["vision"], c["vq"]
    h, head = t["hidden_size"], t["hidden_size"] // t["num_attention_heads"]
    kv = t["num_key_value_heads"] * head
    out = {"model.language_model.embed_tokens.weight": (t["vocab_size"], h),
           "model.language_model.norm.weight": (h,), "lm_head.weight": (t["vision_vocab_size"], h)}
    for i in range(t["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_up_proj.weight": (2 * t["intermediate_size"], h),
                    p + "mlp.down_proj.weight": (h, t["intermediate_size"])})
        for norm in ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"):
            out[p + norm + ".weight"] = (h,)
    d, ps = v["hidden_size"], v["patch_size"]
    out.update({"model.visual.embeddings.position_embedding.weight": ((v["image_size"] // ps) ** 2, d),
                "model.visual.patch_embed.proj.weight": (d, 3, ps, ps), "model.visual.patch_embed.proj.bias": (d,)})
    for i in range(v["depth"]):
        p = f"model.visual.blocks.{i}."
        out.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "norm2.weight": (d,), p + "norm2.bias": (d,),
                    p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                    p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
                    p + "mlp.fc1.weight": (v["intermediate_size"], d), p + "mlp.fc1.bias": (v["intermediate_size"],),
                    p + "mlp.fc2.weight": (d, v["intermediate_size"]), p + "mlp.fc2.bias": (d,)})
    e, lat = q["embed_dim"], q["latent_channels"]
    out.update({"model.vqmodel.quantize.embedding.weight": (q["num_embeddings"], e),
                "model.vqmodel.quant_conv.weight": (e, lat, 1, 1), "model.vqmodel.quant_conv.bias": (e,),
                "model.vqmodel.post_quant_conv.weight": (lat, e, 1, 1), "model.vqmodel.post_quant_conv.bias": (lat,)})
    return out


def glm_image_config():
    from transformers import GlmImageConfig

    text = {**GLM_IMAGE["text"], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]}}
    return GlmImageConfig(text_config=text, vision_config=GLM_IMAGE["vision"], vq_config=GLM_IMAGE["vq"])


def published_glm_image() -> Published:
    """``configs/model/glm_image.yaml``'s adapter over ``GlmImageForConditionalGeneration`` of the published config (a
    prebuilt model) with a tokenizer of GLM-Image's 16,512 vision tokens and grid markers; pixels off (the diffusion
    decoder is not part of the AR stage's checkpoint)."""
    from transformers import GlmImageForConditionalGeneration

    from coolsd.models.glm_image import TINY_TEXT, GlmImage, GlmImageArch, tiny_tokenizer, tiny_vocabulary

    with torch.device("meta"):
        hf = GlmImageForConditionalGeneration(glm_image_config())
    arch = GlmImageArch(codebook_size=GLM_IMAGE["vq"]["num_embeddings"], extra_vision_tokens=128)
    tokenizer = tiny_tokenizer(tiny_vocabulary(arch, TINY_TEXT.split()), "<|dit_token_16384|>")
    model = GlmImage(**yaml_model("glm_image", device="meta", pixel_decoder="codes"), model=hf, tokenizer=tokenizer)
    return Published(model, {"glm": glm_image_keys(GLM_IMAGE)}, (40, 32), 16384)


#: every adapter's published instances (``Adapter.published`` in tests/test_adapters.py names them)
PUBLISHED: dict[str, Callable[[], Published]] = {
    "embedded": published_embedded,
    "llamagen_t2i_256": published_llamagen_t2i(256),
    "llamagen_t2i_512": published_llamagen_t2i(512),
    "janus_pro_1b": published_janus_pro("1B"),
    "janus_pro_7b": published_janus_pro("7B"),
    "lumina_mgpt_768": published_lumina_mgpt,
    "anole_7b": published_anole,
    "emu3_gen": published_emu3_gen,
    "glm_image": published_glm_image,
}
