"""LlamaGen's VQ image tokenizer (``VQ-16`` / ``VQ-8``): conv encoder/decoder around an L2-normed codebook.

An image in ``[-1, 1]`` is encoded to a ``(H / f, W / f)`` grid of codebook indices (``f`` = 16 or 8), and a
grid of indices is decoded back to pixels. Parameter and buffer names and shapes match the reference exactly,
so the released checkpoints (e.g. ``vq_ds16_t2i.pt``, a ``torch.save`` dict with key ``"model"``) load as-is.

Independent re-implementation after FoundationVision/LlamaGen ``tokenizer/tokenizer_image/vq_model.py``, MIT
(itself derived from taming-transformers and MaskGIT). Unlike the reference, ``ch``, ``num_res_blocks`` and
the image channel counts are configurable, so tests can build tiny instances, and ``encoder="patch"`` swaps in
a patch-local encoder (``PatchEncoder``, not in LlamaGen) for small models whose codes should stay local.

Example::

    vq = load_vq_checkpoint(VQ_MODELS["VQ-16"](), "pretrained_models/vq_ds16_t2i.pt").eval()
    codes = vq.encode_to_indices(images)                   # (B, 256) for 256x256 images
    pixels = vq.decode_to_uint8(codes, grid=(16, 16))      # (B, 3, 256, 256) uint8
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from coolsd.models.base import pixels_to_uint8
from coolsd.models.checkpoints import load_state_dict

# The reference keeps a rolling window of the most recent code assignments for a usage statistic; its length
# is fixed (not tied to the codebook size), and released checkpoints carry it, so it is part of the layout.
CODEBOOK_USAGE_WINDOW = 65536
GROUPNORM_GROUPS = 32
ENCODERS = ("conv", "patch")


@dataclass(frozen=True)
class VQConfig:
    """Architecture of one VQ tokenizer. Sequences are stored as tuples; lists are accepted and converted."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    entropy_loss_ratio: float = 0.0
    encoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    dropout_p: float = 0.0
    ch: int = 128
    num_res_blocks: int = 2
    in_channels: int = 3
    out_channels: int = 3
    # "conv": LlamaGen's encoder (3x3 convs, GroupNorm, attention: every code sees the whole image).
    # "patch": ``PatchEncoder``, each code sees only its own f x f pixel patch (the decoder is unchanged).
    encoder: str = "conv"

    def __post_init__(self) -> None:
        for name in ("encoder_ch_mult", "decoder_ch_mult"):
            mult = tuple(getattr(self, name))
            object.__setattr__(self, name, mult)
            if not mult or any(not isinstance(m, int) or m <= 0 for m in mult):
                raise ValueError(f"VQConfig.{name} must be a non-empty sequence of positive ints, got {mult}")
        positive = ("codebook_size", "codebook_embed_dim", "z_channels", "ch", "num_res_blocks",
                    "in_channels", "out_channels")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"VQConfig.{name} must be a positive int, got {value!r}")
        # Every GroupNorm sits on ch * mult channels, so ch being a multiple of the group count suffices.
        if self.ch % GROUPNORM_GROUPS != 0:
            raise ValueError(
                f"VQConfig.ch must be a multiple of {GROUPNORM_GROUPS} (GroupNorm groups), got {self.ch}"
            )
        if self.encoder not in ENCODERS:
            raise ValueError(f"VQConfig.encoder must be one of {sorted(ENCODERS)}, got {self.encoder!r}")
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"VQConfig.dropout_p must lie in [0, 1), got {self.dropout_p}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)


# -- building blocks -----------------------------------------------------------------------------------------
def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=GROUPNORM_GROUPS, num_channels=channels, eps=1e-6, affine=True)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=padding)


def _conv1x1(in_ch: int, out_ch: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=1, padding=0)


class ResnetBlock(nn.Module):
    """Pre-activation residual block (2x GroupNorm, SiLU, 3x3 conv); 1x1 ``nin_shortcut`` if widths differ."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.norm1 = _group_norm(in_channels)
        self.conv1 = _conv3x3(in_channels, out_channels)
        self.norm2 = _group_norm(out_channels)
        self.dropout = nn.Dropout(p=dropout)
        self.conv2 = _conv3x3(out_channels, out_channels)
        if in_channels != out_channels:
            self.nin_shortcut = _conv1x1(in_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = self.nin_shortcut(x) if self.in_channels != self.out_channels else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with 1x1-conv projections and a residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = _conv1x1(channels, channels)
        self.k = _conv1x1(channels, channels)
        self.v = _conv1x1(channels, channels)
        self.proj_out = _conv1x1(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, c, h * w).transpose(1, 2)  # (B, HW, C)

        q, k, v = tokens(self.q(normed)), tokens(self.k(normed)), tokens(self.v(normed))
        out = F.scaled_dot_product_attention(q, k, v)  # (B, HW, C), scale 1 / sqrt(C)
        out = out.transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Halve H and W with a stride-2 3x3 conv after zero-padding one row/column on the bottom/right."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = _conv3x3(channels, channels, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Double H and W by nearest-neighbour repetition, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = _conv3x3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``res`` blocks, per-block ``attn`` (coarsest level only), optional resampler.

    The resampler is registered as ``downsample`` (encoder) or ``upsample`` (decoder), as in the reference.
    """

    def __init__(self, in_ch: int, out_ch: int, num_blocks: int, with_attn: bool, dropout: float,
                 resample: str | None) -> None:
        super().__init__()
        self.res = nn.ModuleList()
        self.attn = nn.ModuleList()
        width = in_ch
        for _ in range(num_blocks):
            self.res.append(ResnetBlock(width, out_ch, dropout=dropout))
            width = out_ch
            if with_attn:
                self.attn.append(AttnBlock(out_ch))
        self.resample_name = resample
        if resample == "downsample":
            self.downsample = Downsample(out_ch)
        elif resample == "upsample":
            self.upsample = Upsample(out_ch)
        elif resample is not None:
            raise ValueError(f"unknown resampler {resample!r}")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.res):
            h = block(h)
            if len(self.attn) > 0:
                h = self.attn[i](h)
        if self.resample_name is not None:
            h = getattr(self, self.resample_name)(h)
        return h


def _mid_stack(channels: int, dropout: float) -> nn.ModuleList:
    return nn.ModuleList([
        ResnetBlock(channels, channels, dropout=dropout),
        AttnBlock(channels),
        ResnetBlock(channels, channels, dropout=dropout),
    ])


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) -> features (B, z_channels, H / f, W / f), f = 2 ** (len(ch_mult) - 1)."""

    def __init__(self, in_channels: int = 3, ch: int = 128, ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, dropout: float = 0.0, z_channels: int = 256) -> None:
        super().__init__()
        self.conv_in = _conv3x3(in_channels, ch)
        last = len(ch_mult) - 1
        self.conv_blocks = nn.ModuleList()
        width = ch
        for level, mult in enumerate(ch_mult):
            self.conv_blocks.append(_Level(
                in_ch=width, out_ch=ch * mult, num_blocks=num_res_blocks, with_attn=level == last,
                dropout=dropout, resample=None if level == last else "downsample",
            ))
            width = ch * mult
        self.mid = _mid_stack(width, dropout=dropout)
        self.norm_out = _group_norm(width)
        self.conv_out = _conv3x3(width, z_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _PointwiseBlock(nn.Module):
    """Residual MLP at every grid position on its own: LayerNorm over channels, 1x1 conv, SiLU, 1x1 conv."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.fc1 = _conv1x1(channels, 2 * channels)
        self.dropout = nn.Dropout(p=dropout)
        self.fc2 = _conv1x1(2 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x + self.fc2(self.dropout(F.silu(self.fc1(h))))


class PatchEncoder(nn.Module):
    """Image (B, in_channels, H, W) -> (B, z_channels, H / f, W / f), each output from its own f x f patch.

    A stride-f ``f x f`` conv then ``num_res_blocks + 1`` per-position residual MLPs; no GroupNorm (its
    statistics span the image) and no attention. Codes are therefore local, like a k-means patch tokenizer:
    identical patches (e.g. blank background) always get the same code, which keeps the token sequence
    predictable, while the (unchanged, convolutional) decoder still blends neighbouring patches. Not part of
    LlamaGen; ``VQConfig(encoder="patch")`` selects it (the embedded Fashion-MNIST model).
    """

    def __init__(self, in_channels: int = 3, ch: int = 128, ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, dropout: float = 0.0, z_channels: int = 256) -> None:
        super().__init__()
        factor = 2 ** (len(ch_mult) - 1)
        width = ch * ch_mult[-1]
        self.patchify = nn.Conv2d(in_channels, width, kernel_size=factor, stride=factor)
        self.blocks = nn.ModuleList(_PointwiseBlock(width, dropout) for _ in range(num_res_blocks + 1))
        self.norm_out = nn.LayerNorm(width, eps=1e-6)
        self.conv_out = _conv1x1(width, z_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patchify(x)
        for block in self.blocks:
            h = block(h)
        h = self.norm_out(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv_out(F.silu(h))


class Decoder(nn.Module):
    """Features (B, z_channels, h, w) -> image (B, out_channels, h * f, w * f); levels run coarsest first."""

    def __init__(self, z_channels: int = 256, ch: int = 128, ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, dropout: float = 0.0, out_channels: int = 3) -> None:
        super().__init__()
        last = len(ch_mult) - 1
        width = ch * ch_mult[last]
        self.conv_in = _conv3x3(z_channels, width)
        self.mid = _mid_stack(width, dropout=dropout)
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            self.conv_blocks.append(_Level(
                in_ch=width, out_ch=ch * ch_mult[level], num_blocks=num_res_blocks + 1,
                with_attn=level == last, dropout=dropout, resample=None if level == 0 else "upsample",
            ))
            width = ch * ch_mult[level]
        self.norm_out = _group_norm(width)
        self.conv_out = _conv3x3(width, out_channels)

    @property
    def last_layer(self) -> torch.Tensor:
        return self.conv_out.weight

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# -- quantizer -----------------------------------------------------------------------------------------------
def entropy_loss(affinity: torch.Tensor, temperature: float = 0.01) -> torch.Tensor:
    """Mean per-sample entropy minus entropy of the mean assignment, softmax of ``affinity / temperature``."""
    logits = affinity.reshape(-1, affinity.shape[-1]) / temperature  # (N, V)
    probs = F.softmax(logits, dim=-1)
    log_probs = F.log_softmax(logits + 1e-5, dim=-1)
    mean_probs = probs.mean(dim=0)  # (V,)
    batch_entropy = -(mean_probs * torch.log(mean_probs + 1e-5)).sum()
    sample_entropy = -(probs * log_probs).sum(dim=-1).mean()
    return sample_entropy - batch_entropy


class VectorQuantizer(nn.Module):
    """Nearest-codeword lookup with a straight-through gradient; cosine distance when ``l2_norm``.

    ``forward(z)`` returns ``(z_q, (vq_loss, commit_loss, entropy_loss, usage), (None, None, indices))`` like
    the reference: losses are ``None`` and usage ``0`` outside training; ``indices`` is flat over (B, h, w).
    """

    def __init__(self, n_e: int, e_dim: int, beta: float = 0.25, entropy_loss_ratio: float = 0.0,
                 l2_norm: bool = True, show_usage: bool = True) -> None:
        super().__init__()
        self.n_e = n_e
        self.e_dim = e_dim
        self.beta = beta
        self.entropy_loss_ratio = entropy_loss_ratio
        self.l2_norm = l2_norm
        self.show_usage = show_usage
        self.embedding = nn.Embedding(n_e, e_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / n_e, 1.0 / n_e)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, p=2, dim=-1))
        if show_usage:
            self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USAGE_WINDOW))

    def normalized_codebook(self) -> torch.Tensor:
        """The codebook as used for lookup: (V, D), unit rows when ``l2_norm``."""
        weight = self.embedding.weight
        return F.normalize(weight, p=2, dim=-1) if self.l2_norm else weight

    def _distances(self, z_flat: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        # ||z - e||^2 expanded; z_flat (N, D), codebook (V, D) -> (N, V)
        return (z_flat.pow(2).sum(dim=1, keepdim=True) + codebook.pow(2).sum(dim=1)
                - 2.0 * z_flat @ codebook.t())

    def nearest_indices(self, z: torch.Tensor) -> torch.Tensor:
        """Codeword index at every position of ``z`` (B, D, h, w) -> (B, h, w); no losses, no usage update."""
        b, d, h, w = z.shape
        z_flat = z.permute(0, 2, 3, 1).reshape(-1, d)  # (B*h*w, D)
        if self.l2_norm:
            z_flat = F.normalize(z_flat, p=2, dim=-1)
        return self._distances(z_flat, self.normalized_codebook()).argmin(dim=1).view(b, h, w)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple]:
        z = z.permute(0, 2, 3, 1).contiguous()  # (B, h, w, D)
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        z_flat = z.view(-1, self.e_dim)  # (N, D)
        codebook = self.normalized_codebook()
        dist = self._distances(z_flat, codebook)  # (N, V)
        indices = dist.argmin(dim=1)  # (N,)
        z_q = codebook[indices].view(z.shape)  # (B, h, w, D)

        vq_loss = commit_loss = ent_loss = None
        usage: float = 0
        if self.training:
            if self.show_usage:
                self._record_usage(indices)
                usage = len(torch.unique(self.codebook_used)) / self.n_e
            vq_loss = torch.mean((z_q - z.detach()) ** 2)
            commit_loss = self.beta * torch.mean((z_q.detach() - z) ** 2)
            if self.entropy_loss_ratio != 0:
                ent_loss = self.entropy_loss_ratio * entropy_loss(-dist)
            else:
                ent_loss = dist.new_zeros(())  # the reference's 0 * loss, without the (N, V) softmax

        z_q = z + (z_q - z).detach()  # straight-through estimator
        z_q = z_q.permute(0, 3, 1, 2)  # (B, D, h, w)
        return z_q, (vq_loss, commit_loss, ent_loss, usage), (None, None, indices)

    @torch.no_grad()
    def _record_usage(self, indices: torch.Tensor) -> None:
        window = self.codebook_used
        recent = indices[-window.numel():].to(window.dtype)
        n = recent.numel()
        window.copy_(torch.cat([window[n:], recent]))

    def get_codebook_entry(self, indices: torch.Tensor, shape: tuple[int, ...] | None = None,
                           channel_first: bool = True) -> torch.Tensor:
        """Look up (normalised) codewords; ``shape`` is (B, D, h, w) if ``channel_first`` or (B, h, w, D)."""
        z_q = self.normalized_codebook()[indices]  # (*indices.shape, D)
        if shape is None:
            return z_q
        if channel_first:
            b, d, h, w = shape
            return z_q.reshape(b, h, w, d).permute(0, 3, 1, 2).contiguous()  # (B, D, h, w)
        return z_q.reshape(shape)


# -- full model ----------------------------------------------------------------------------------------------
class VQModel(nn.Module):
    """Encoder, 1x1 ``quant_conv`` to the codebook dim, quantizer, 1x1 ``post_quant_conv``, decoder."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = (Encoder if config.encoder == "conv" else PatchEncoder)(
            in_channels=config.in_channels, ch=config.ch, ch_mult=config.encoder_ch_mult,
            num_res_blocks=config.num_res_blocks, dropout=config.dropout_p, z_channels=config.z_channels,
        )
        self.decoder = Decoder(
            z_channels=config.z_channels, ch=config.ch, ch_mult=config.decoder_ch_mult,
            num_res_blocks=config.num_res_blocks, dropout=config.dropout_p, out_channels=config.out_channels,
        )
        self.quantize = VectorQuantizer(
            n_e=config.codebook_size, e_dim=config.codebook_embed_dim, beta=config.commit_loss_beta,
            entropy_loss_ratio=config.entropy_loss_ratio, l2_norm=config.codebook_l2_norm,
            show_usage=config.codebook_show_usage,
        )
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, kernel_size=1)

    @property
    def downsample_factor(self) -> int:
        return self.config.downsample_factor

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple]:
        """(B, C, H, W) -> (quant (B, D, h, w), losses, info); ``info[2]`` holds the flat indices (B*h*w,)."""
        h = self.quant_conv(self.encoder(x))  # (B, D, h, w)
        return self.quantize(h)

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, code_b: torch.Tensor, shape: tuple[int, ...] | None = None,
                    channel_first: bool = True) -> torch.Tensor:
        """Indices -> image; ``shape`` is the latent shape (B, D, h, w) (channel-first by default)."""
        quant = self.quantize.get_codebook_entry(code_b, shape=shape, channel_first=channel_first)
        return self.decode(quant)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        quant, losses, _ = self.encode(x)
        return self.decode(quant), losses

    @torch.no_grad()
    def encode_to_indices(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) in [-1, 1] -> codes (B, h*w), raster order; the usage window is not updated."""
        h = self.quant_conv(self.encoder(images))  # (B, D, h, w)
        return self.quantize.nearest_indices(h).flatten(start_dim=1)  # (B, h*w)

    @torch.no_grad()
    def decode_to_uint8(self, indices: torch.Tensor, grid: tuple[int, int] | None = None,
                        rounding: str = "half_up") -> torch.Tensor:
        """Codes (B, h*w) -> images (B, C, H, W) uint8; ``grid`` = (h, w), square when omitted.

        ``rounding``: ``coolsd.models.base.pixels_to_uint8`` (default ``half_up``: LlamaGen's image saving)."""
        b, n = indices.shape
        if grid is None:
            side = math.isqrt(n)
            if side * side != n:
                raise ValueError(f"{n} codes per image do not form a square grid; pass grid=(h, w)")
            grid = (side, side)
        gh, gw = grid
        if gh * gw != n:
            raise ValueError(f"grid {tuple(grid)} holds {gh * gw} codes, indices have {n} per image")
        pixels = self.decode_code(indices, shape=(b, self.config.codebook_embed_dim, gh, gw))
        return pixels_to_uint8(pixels, rounding)

    def codebook(self) -> torch.Tensor:
        """The raw (not normalised) embedding weight (V, D), detached; lookups normalise it when l2_norm."""
        return self.quantize.embedding.weight.detach()


# -- registry and loading ------------------------------------------------------------------------------------
def _factory(ch_mult: tuple[int, ...]) -> Callable[..., VQModel]:
    def build(**overrides: Any) -> VQModel:
        fields: dict[str, Any] = {"encoder_ch_mult": ch_mult, "decoder_ch_mult": ch_mult}
        fields.update(overrides)
        return VQModel(VQConfig(**fields))

    return build


VQ_16 = _factory((1, 1, 2, 2, 4))
VQ_8 = _factory((1, 2, 2, 4))
VQ_MODELS: dict[str, Callable[..., VQModel]] = {"VQ-16": VQ_16, "VQ-8": VQ_8}


def load_vq_checkpoint(model: VQModel, path: str | os.PathLike, use_ema: bool = False) -> VQModel:
    """Load weights into ``model`` (in place) and return it.

    ``path``: a ``torch.save`` file holding a raw state_dict or a dict with ``"model"`` (``"ema"`` only when
    ``use_ema``), or a ``.safetensors`` file. Loading is non-strict, but every parameter must be present;
    buffers (the ``quantize.codebook_used`` usage window) may be absent and extra keys are ignored.
    """
    path = os.fspath(path)
    state = load_state_dict(path, nested_keys=("ema",) if use_ema else ("model",))
    missing_params = [name for name, _ in model.named_parameters() if name not in state]
    if missing_params:
        shown = ", ".join(missing_params[:10])
        more = f" (+{len(missing_params) - 10} more)" if len(missing_params) > 10 else ""
        raise KeyError(f"{path}: checkpoint lacks {len(missing_params)} model parameters: {shown}{more}")
    model.load_state_dict(state, strict=False)
    return model
