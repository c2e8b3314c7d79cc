"""The decoding half of Meta's Chameleon VQGAN (the image tokenizer of Chameleon, Anole and Lumina-mGPT).

``transformers``' ``ChameleonVQVAE`` holds only the encoder and the quantizer, so images cannot be decoded
with it. This module is the decoder: codebook lookup (8192 codes x 256 dims in the released tokenizer),
the 1x1 ``post_quant_conv`` and the taming-transformers style decoder, with parameter names equal to Meta's
checkpoint (``quantize.embedding.weight``, ``post_quant_conv.*``, ``decoder.conv_in.*``,
``decoder.mid.block_1.*``, ``decoder.mid.attn_1.*``, ``decoder.up.{level}.block.{i}.*``,
``decoder.up.{level}.attn.{i}.*``, ``decoder.up.{level}.upsample.conv.*``, ``decoder.norm_out.*``,
``decoder.conv_out.*``), so ``vqgan.ckpt`` loads by key name. The architecture is read from Meta's
``vqgan.yaml`` (``model.params``: ``n_embed``, ``embed_dim``, ``ddconfig``).

Written after Alpha-VLLM/Lumina-mGPT ``lumina_mgpt/model/chameleon_vae_ori/{vqgan,image_tokenizer}.py``
(Meta's code, itself from CompVis/taming-transformers): studied and rewritten, reusing this project's
residual / attention / upsampling blocks (``coolsd.models.vq``), whose parameter names and arithmetic are
the same (GroupNorm(32, eps 1e-6), SiLU, 3x3 convs, single-head attention scaled by 1/sqrt(C)).

Decoded pixels are mapped to uint8 as the reference does: clamp to [-1, 1], scale to [0, 255], truncate.

Example::

    vqgan = load_vqgan("ckpts/chameleon/tokenizer/vqgan.yaml", "ckpts/chameleon/tokenizer/vqgan.ckpt")
    image = vqgan.decode_to_uint8(codes.reshape(1, -1), grid=(48, 48))[0]   # (3, 768, 768) uint8
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coolsd.models.base import pixels_to_uint8
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.vq import GROUPNORM_GROUPS, AttnBlock, ResnetBlock, Upsample

# Keys of Meta's ``ddconfig`` that only the encoder, the losses or training read; the decoder ignores them.
ENCODER_ONLY_KEYS = frozenset({"double_z", "in_channels", "use_linear_attn"})
# Keys of ``model.params`` besides the architecture (training and checkpoint bookkeeping).
PARAMS_IGNORED = frozenset({"lossconfig", "ckpt_path", "ignore_keys", "image_key", "colorize_nlabels",
                            "monitor", "scheduler_config", "lr_g_factor", "sane_index_shape", "remap"})
# Prefixes of checkpoint entries outside the decoding half (encoder, pre-quantization conv, GAN losses).
UNUSED_PREFIXES = ("encoder.", "quant_conv.", "loss.")
DECODING_PREFIXES = ("decoder.", "quantize.", "post_quant_conv.")


@dataclass(frozen=True)
class ChameleonVQGANConfig:
    """Architecture of the decoding half (Meta's names: ``model.params`` + its ``ddconfig`` of vqgan.yaml)."""

    n_embed: int = 8192
    embed_dim: int = 256
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = ()
    resolution: int = 512
    out_ch: int = 3
    dropout: float = 0.0
    tanh_out: bool = False
    attn_type: str = "vanilla"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions))
        for name in ("n_embed", "embed_dim", "z_channels", "ch", "num_res_blocks", "resolution", "out_ch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"vqgan.{name} must be a positive int, got {value!r}")
        if not self.ch_mult or min(self.ch_mult) <= 0:
            raise ValueError(f"vqgan.ch_mult must be a non-empty list of positive ints, got {self.ch_mult}")
        if self.ch % GROUPNORM_GROUPS:
            raise ValueError(f"vqgan.ch must be a multiple of {GROUPNORM_GROUPS} (GroupNorm groups), "
                             f"got {self.ch}")
        if self.attn_type not in ("vanilla", "none"):
            raise ValueError(f"vqgan.attn_type must be 'vanilla' or 'none', got {self.attn_type!r}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ChameleonVQGANConfig:
        """From the ``model.params`` of Meta's vqgan.yaml (``n_embed``, ``embed_dim``, ``ddconfig``)."""
        params = dict(params)
        if params.get("remap") is not None:
            raise ValueError("vqgan.yaml sets model.params.remap; remapped codebooks are not supported "
                             "(Chameleon's tokenizer has none)")
        dd = dict(params.pop("ddconfig", {}))
        if dd.get("use_linear_attn"):
            raise ValueError("vqgan.yaml sets ddconfig.use_linear_attn; the Chameleon decoder has vanilla "
                             "attention")
        if dd.pop("give_pre_end", False):
            raise ValueError("vqgan.yaml sets ddconfig.give_pre_end; the decoder must produce pixels")
        known = {f.name for f in fields(cls)}
        arch = {k: v for k, v in dd.items() if k not in ENCODER_ONLY_KEYS}
        arch.update({k: params.pop(k) for k in ("n_embed", "embed_dim") if k in params})
        unknown = sorted(set(arch) - known) + sorted(set(params) - PARAMS_IGNORED)
        if unknown:
            raise ValueError(f"vqgan.yaml has keys this decoder does not know: {unknown}; expected ddconfig "
                             f"keys {sorted(known | ENCODER_ONLY_KEYS)}")
        return cls(**arch)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ChameleonVQGANConfig:
        import yaml

        path = Path(path).expanduser()
        if not path.is_file():
            raise MissingWeightsError(f"VQGAN config not found: {path}")
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        try:
            params = config["model"]["params"]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a Chameleon vqgan.yaml (no model.params)") from err
        return cls.from_params(params)


class _CodebookQuantizer(nn.Module):
    """Holds the codebook under Meta's name (``quantize.embedding``); lookup only."""

    def __init__(self, n_embed: int, embed_dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / n_embed, 1.0 / n_embed)

    def lookup(self, codes: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Codes (B, h*w) in raster order -> latent (B, embed_dim, h, w)."""
        h, w = grid
        z = self.embedding(codes.reshape(codes.shape[0], h, w))  # (B, h, w, D)
        return z.permute(0, 3, 1, 2).contiguous()


class _Mid(nn.Module):
    def __init__(self, channels: int, dropout: float, attention: bool) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout=dropout)
        self.attn_1 = AttnBlock(channels) if attention else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels, dropout=dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class _UpLevel(nn.Module):
    """One resolution level: ``block`` (residual blocks), ``attn`` (one per block or none), ``upsample``."""

    def __init__(self, in_ch: int, out_ch: int, num_blocks: int, attention: bool, upsample: bool,
                 dropout: float) -> None:
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()
        width = in_ch
        for _ in range(num_blocks):
            self.block.append(ResnetBlock(width, out_ch, dropout=dropout))
            width = out_ch
            if attention:
                self.attn.append(AttnBlock(out_ch))
        self.has_upsample = upsample
        if upsample:
            self.upsample = Upsample(out_ch)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[i](h)
        return self.upsample(h) if self.has_upsample else h


class ChameleonDecoder(nn.Module):
    """Latent (B, z_channels, h, w) -> pixels (B, out_ch, h*f, w*f), f = 2 ** (len(ch_mult) - 1).

    ``up[level]`` is stored finest first (``up.0`` is full resolution) and run coarsest first, as in Meta's
    layout; attention blocks sit at the levels whose nominal resolution (``resolution / 2**level``) is
    listed in ``attn_resolutions`` (none in Chameleon's tokenizer, apart from the middle block).
    """

    def __init__(self, cfg: ChameleonVQGANConfig) -> None:
        super().__init__()
        levels = len(cfg.ch_mult)
        width = cfg.ch * cfg.ch_mult[-1]
        res = cfg.resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(cfg.z_channels, width, kernel_size=3, padding=1)
        self.mid = _Mid(width, cfg.dropout, attention=cfg.attn_type == "vanilla")
        built: list[_UpLevel] = []
        for level in reversed(range(levels)):
            out = cfg.ch * cfg.ch_mult[level]
            built.append(_UpLevel(width, out, cfg.num_res_blocks + 1, attention=res in cfg.attn_resolutions,
                                  upsample=level != 0, dropout=cfg.dropout))
            width = out
            if level != 0:
                res *= 2
        self.up = nn.ModuleList(reversed(built))  # index = level, finest first
        self.norm_out = nn.GroupNorm(GROUPNORM_GROUPS, width, eps=1e-6, affine=True)
        self.conv_out = nn.Conv2d(width, cfg.out_ch, kernel_size=3, padding=1)
        self.tanh_out = cfg.tanh_out

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        h = self.conv_out(nn.functional.silu(self.norm_out(h)))
        return torch.tanh(h) if self.tanh_out else h


class ChameleonVQGAN(nn.Module):
    """Codes -> images: ``quantize`` (codebook), ``post_quant_conv``, ``decoder`` (Meta's parameter names)."""

    def __init__(self, cfg: ChameleonVQGANConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quantize = _CodebookQuantizer(cfg.n_embed, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, kernel_size=1)
        self.decoder = ChameleonDecoder(cfg)

    @property
    def downsample_factor(self) -> int:
        return self.config.downsample_factor

    def codebook(self) -> torch.Tensor:
        """The raw codebook vectors (n_embed, embed_dim)."""
        return self.quantize.embedding.weight

    def decode_codes(self, codes: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Codes (B, h*w) in raster order -> float pixels (B, out_ch, h*f, w*f), nominally in [-1, 1]."""
        weight = self.post_quant_conv.weight
        z = self.quantize.lookup(codes.to(weight.device), grid).to(weight.dtype)
        return self.decoder(self.post_quant_conv(z))

    @torch.inference_mode()
    def decode_to_uint8(self, codes: torch.Tensor, grid: tuple[int, int], rounding: str = "truncate") -> torch.Tensor:
        """Codes (B, h*w) -> uint8 images (B, 3, h*f, w*f): clamp to [-1, 1], map to [0, 255], then
        ``rounding`` (``coolsd.models.base.pixels_to_uint8``; default ``truncate``, as Meta's tokenizer)."""
        return pixels_to_uint8(self.decode_codes(codes, grid), rounding)


class _LightningPlaceholder:
    """Inert stand-in for the Lightning objects a training checkpoint pickles beside its weights.

    It runs no code: the unpickler may create it and set its state, and the loader never reads it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


# Globals a PyTorch-Lightning training checkpoint may hold outside ``state_dict`` (the callback classes key
# ``callbacks``); each is mapped to the inert placeholder, so ``weights_only=True`` can read the file.
LIGHTNING_GLOBALS = (
    "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
)


def read_vqgan_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of ``vqgan.ckpt`` (a Lightning checkpoint, weights under ``state_dict``) or safetensors.

    Read with ``torch.load(weights_only=True)``; the only non-tensor globals allowed are the Lightning
    callback classes of ``LIGHTNING_GLOBALS``, which become inert placeholders.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingWeightsError(f"VQGAN weights not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    allowed = [(_LightningPlaceholder, name) for name in LIGHTNING_GLOBALS]
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        refused = found.group(1) if found else "(see the cause below)"
        target = path.with_suffix(".safetensors")
        command = ("python -c \"import torch, safetensors.torch as s; s.save_file(torch.load("
                   f"'{path}', weights_only=False)['state_dict'], '{target}')\"")
        raise ValueError(
            f"{path} cannot be read safely: torch.load(weights_only=True) refuses the pickled object "
            f"{refused}. Convert the file once, on a machine where you trust it, to safetensors: {command} "
            "(a vqgan.safetensors beside vqgan.yaml is used when vqgan.ckpt is absent)"
        ) from err
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} holds no VQGAN state dict (expected a dict of tensors, or one under "
                         "'state_dict')")
    return obj


def decoding_state(state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Select the decoding half of a full VQGAN state dict; anything not known to belong elsewhere fails."""
    stray = [k for k in state if not k.startswith(DECODING_PREFIXES + UNUSED_PREFIXES)]
    if stray:
        raise ValueError(f"{source} has keys that belong to no part of Meta's VQGAN: {stray[:8]}")
    return {k: v for k, v in state.items() if k.startswith(DECODING_PREFIXES)}


def load_vqgan(config: str | Path | ChameleonVQGANConfig, weights: str | Path) -> ChameleonVQGAN:
    """Build the decoder from ``vqgan.yaml`` (or a config) and load ``vqgan.ckpt`` strictly by key name."""
    cfg = config if isinstance(config, ChameleonVQGANConfig) else ChameleonVQGANConfig.from_yaml(config)
    model = ChameleonVQGAN(cfg)
    state = decoding_state(read_vqgan_state(weights), str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the decoder built from its config: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]}; are vqgan.yaml and vqgan.ckpt from "
                         "the same download?")
    return model.eval()
