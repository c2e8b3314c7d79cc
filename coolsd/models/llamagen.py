"""LlamaGen (Sun et al., 2024): the GPT image generator and its model adapter.

Architecture written after FoundationVision/LlamaGen ``autoregressive/models/gpt.py`` (MIT): Llama-style
pre-norm decoder (RMSNorm, SwiGLU, fused ``wqkv``, no biases), 2-D RoPE over the image grid, condition
tokens first (a class embedding for ``c2i``, a projected caption for ``t2i``) whose RoPE table is all zeros
(so their q and k vanish; a quirk of the reference that this copy keeps). Parameter names equal the
released checkpoints' (``tok_embeddings``, ``layers.{i}.attention.wqkv``, ``cls_embedding.cap_proj.fc1`` ...).

CFG layout: each image's conditional and unconditional rows are adjacent in the batch (image-major, as every
adapter's cache lays them out; the reference stacks ``[cond; uncond]`` halves, which computes the same); the
unconditional condition is the
null class (``c2i``) or the learned ``uncond_embedding`` (``t2i``).

Example: ``python run.py model=tiny`` (a random-weight class-conditional instance).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from coolsd.kv_cache import StaticKVCache
from coolsd.models.base import (
    ImageARModel,
    Runtime,
    attend,
    attention_context,
    check_prefix,
    layer_skipping,
    per_stream,
    stream_rows,
)
from coolsd.models.checkpoints import local_file_missing, missing_together
from coolsd.models.vq import VQConfig, VQModel
from coolsd.required_files import RequiredFile
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig
from coolsd.types import TargetOutput


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    """Hyper-parameters of the LlamaGen GPT (names as in the reference ``ModelArgs``)."""

    dim: int = 1280
    n_layer: int = 36
    n_head: int = 20
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model.gpt.model_type must be 'c2i' or 't2i', got {self.model_type!r}")
        if self.dim % self.n_head:
            raise ValueError(f"model.gpt.dim ({self.dim}) must be divisible by model.gpt.n_head ({self.n_head})")
        side = math.isqrt(self.block_size)
        if side * side != self.block_size:
            raise ValueError(f"model.gpt.block_size must be a square grid size, got {self.block_size}")


# The reference's named sizes (``GPT_models`` in gpt.py).
GPT_SIZES: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """``fast`` (float32 and half-precision models, ``Transformer.fast_path``): one fused kernel with the weight
        inside, the same call for every dtype. In float32 these are the bits of the reference's
        ``x.float() * rsqrt(mean(x²) + eps)``, ``type_as(x) * weight`` (tests/test_call_counts.py); in bf16 the
        weight multiplies in float32 before the one rounding to bf16, where the reference rounds the normalised
        value first and multiplies in bf16 (a last-bit difference, README "Deviations"). Otherwise (float64) the
        reference's steps."""
        if fast:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return out.type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = int(2 * 4 * cfg.dim / 3)
        if cfg.ffn_dim_multiplier is not None:
            hidden = int(cfg.ffn_dim_multiplier * hidden)
        hidden = find_multiple(hidden, cfg.multiple_of)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.ffn_dropout = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.ffn_dropout(out) if self.training and self.ffn_dropout.p else out  # else the identity


def rope_2d_table(grid: int, head_dim: int, base: float, prefix: int) -> torch.Tensor:
    """(prefix + grid², head_dim/2, 2) cos/sin table; half the pairs rotate with the row, half with the
    column; the ``prefix`` condition positions get zeros (reference quirk)."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # (head_dim/4,)
    angles = torch.outer(torch.arange(grid).float(), freqs)  # (grid, head_dim/4)
    per_cell = torch.cat(
        [angles[:, None, :].expand(-1, grid, -1), angles[None, :, :].expand(grid, -1, -1)], dim=-1
    )  # (grid, grid, head_dim/2): row angles then column angles
    table = torch.stack([per_cell.cos(), per_cell.sin()], dim=-1).flatten(0, 1)  # (grid², head_dim/2, 2)
    return torch.cat([torch.zeros(prefix, head_dim // 2, 2), table])


def rope_rotation(table: torch.Tensor) -> torch.Tensor:
    """A (cos, sin) table (T, D/2, 2) shared or (B, T, D/2, 2) per row -> complex rotations (1|B, T, 1, D/2),
    computed once per forward and applied by every layer (``apply_rope``)."""
    rot = torch.view_as_complex(table)  # (T, D/2) or (B, T, D/2)
    return rot.unsqueeze(-2) if rot.dim() == 3 else rot[None, :, None]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (B, T, H, D) by a (cos, sin) table (see ``rope_rotation``) or by its complex
    rotations, in float32 (or the table's wider dtype).

    One complex product ``(x0 + i x1)(cos + i sin)``: the reference's four real products, difference and sum
    (``x0 cos − x1 sin``, ``x1 cos + x0 sin``) in one kernel instead of ten (bitwise equal on CPU; on a GPU the
    compiler may fuse a product into the sum, a last-bit difference in float32).
    """
    rot = table if table.is_complex() else rope_rotation(table)
    xs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D/2) complex
    return torch.view_as_real(xs * rot).flatten(3).type_as(x)


#: the dtypes of the one fast path of a layer (``RMSNorm(fast=True)``, ``Attention._project_fast``): float32 and half
#: precision take the same torch calls; float64 (tests' exact identities) keeps the reference's general steps
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Float32Rope(nn.Module):
    """Base of the modules that own a ``freqs_cis`` rotation table: casting them to bf16/fp16 keeps the table
    in float32. The reference does the same (its table is a plain attribute, rebuilt in float32 by
    ``setup_caches``); a half-precision table would perturb every cos/sin of the 2-D RoPE."""

    freqs_cis: torch.Tensor

    def rotations(self, rows: torch.Tensor) -> torch.Tensor:
        """``rope_rotation(self.freqs_cis[rows])`` for rows (T,) or (B, T), as (T, 1, D/2) or (B, T, 1, D/2)
        (the same broadcast): rows of the table's complex view, kept while the table is the same tensor."""
        table = self.freqs_cis
        cached = self.__dict__.get("_complex_table")
        if cached is None or cached[0] is not table:
            cached = (table, torch.view_as_complex(table).unsqueeze(-2))  # (N, 1, D/2): rows index it
            self.__dict__["_complex_table"] = cached
        return cached[1][rows]

    def cos_sin(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's cos and sin of rows (T,) or (B, T), each (T, 1, D/2) or (B, T, 1, D/2) (``_rotate``)."""
        table = self.freqs_cis[rows].unsqueeze(-3)  # (…, T, 1, D/2, 2)
        return table[..., 0], table[..., 1]

    def _apply(self, fn, recurse=True):
        table = self.freqs_cis
        super()._apply(fn, recurse)
        if self.freqs_cis.dtype in (torch.bfloat16, torch.float16):
            self.freqs_cis = table.to(device=self.freqs_cis.device, dtype=torch.float32)
        self._weight_facts()
        return self

    def _weight_facts(self) -> None:
        """The weights' device and whether they are float32 (``weights_device``, ``float32``), kept as plain
        attributes that a forward reads without a torch call; refreshed by every ``.to()``, ``.half()``, ...
        (``_apply``)."""
        weight = self.attention.wqkv.weight
        self.weights_device, self.float32 = weight.device, weight.dtype == torch.float32
        self.fast_path = weight.dtype in FAST_DTYPES


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.dim, self.n_head = cfg.dim, cfg.n_head
        self.head_dim = cfg.dim // cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.wqkv = nn.Linear(cfg.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: StaticKVCache | None,
        layer: int,
        mask: torch.Tensor | None,
        fast: bool = False,
    ) -> torch.Tensor:
        """``rope``: complex rotations (1|B, T, 1, D/2) (``rope_rotation``); ``fast``: float32 or half precision
        (the caller checked once), the path with fewer torch calls (``_project_fast``)."""
        if fast and cache is not None:
            q, k, v = self._project_fast(x, rope, cache, layer)
        else:
            b, t, _ = x.shape
            kv = self.n_kv_head * self.head_dim
            q, k, v = self.wqkv(x).split([self.dim, kv, kv], dim=-1)
            q = apply_rope(q.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)  # (B, H, T, D)
            k = apply_rope(k.view(b, t, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
            v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.write(layer, k, v)  # (B, Hkv, end, D)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        causal = cache is None and mask is None
        shape = (cache.block_len, self.head_dim) if cache is not None else None  # q's (T, D), known here
        out = self.wo(attend(q, k, v, mask, causal, shape).transpose(1, 2).flatten(2))  # (B, T, dim)
        return self.resid_dropout(out) if self.training and self.resid_dropout.p else out  # else the identity

    def _project_fast(self, x: torch.Tensor, rope: torch.Tensor, cache: StaticKVCache,
                      layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D) and the cached K/V up to the block end of ``x`` (B, T, dim), one path for float32 and half
        precision with the same torch calls: views of ``wqkv``'s output, q and k rotated together in float32 by one
        complex product (the reference's ``apply_rotary_emb``: ``x.float()``, rotate, ``type_as``; the casts are
        no-ops in float32), k and v written by the cache (which rounds k to its dtype). The general path's values
        (checked in float32 by tests/test_call_counts.py) in 14 torch calls instead of about 30."""
        qk, v = self.wqkv(x).unflatten(-1, (-1, self.head_dim // 2, 2)).split(
            [self.n_head + self.n_kv_head, self.n_kv_head], dim=2)  # (B, T, H + Hkv, D/2, 2) views
        qk = torch.view_as_real(torch.view_as_complex(qk.float()) * rope).flatten(3)  # q and k rotated together
        q, k = qk.split([self.n_head, self.n_kv_head], dim=2)  # (B, T, H|Hkv, D) float32
        return (q.to(x.dtype).transpose(1, 2), *cache.write_tokens(layer, k, v.flatten(3)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, cache, layer, mask, fast: bool = False):
        h = x + self.attention(self.attention_norm(x, fast), rope, cache, layer, mask, fast)
        return h + self.feed_forward(self.ffn_norm(h, fast))


# -- model.compile: piecewise torch.compile of the decode forwards ------------------------------------------
#: the compiled regions of a layer, one compiled function per (region, device type), shared by every layer of
#: every model (parameters are graph inputs, so the target's layers and the EAGLE layer reuse one graph per
#: shape); see ``compiled_region``
_COMPILED: dict[tuple[str, str], Any] = {}


def compiled_region(fn: Any, device: torch.device) -> Any:
    """``fn`` through ``torch.compile`` (``model.compile``): on CUDA mode ``reduce-overhead`` (CUDA graphs, one
    per shape), elsewhere inductor's default. ``dynamic=None``: a second shape of a region (another block size
    or batch) compiles it once more with dynamic sizes instead of once per shape.

    Piecewise, as vLLM's compiled decoders: the cache write and attention, whose key count grows with every
    token and whose masks depend on the batch, stay eager between the two compiled regions of a layer
    (``_project``: input norm, fused qkv projection, RoPE; ``_finish``: output projection, residual, norm,
    SwiGLU, residual), so the compiled graphs see only (rows, block, width) shapes."""
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        cuda = device.type == "cuda"
        # emulate_precision_casts: a float32 cast inside a region rounds as it does eagerly (the reference's
        # x.float() of RMSNorm and RoPE), instead of being dropped by the fused kernels
        _COMPILED[key] = torch.compile(fn, mode="reduce-overhead" if cuda else None, dynamic=None,
                                       options=None if cuda else {"emulate_precision_casts": True})
    return _COMPILED[key]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in real arithmetic (``x0 cos − x1 sin``, ``x0 sin + x1 cos``; compilers fuse it): x (B, T, H,
    D), cos/sin (1|B, T, 1, D/2) float32."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)


def _project(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: bool):
    """A layer's first compiled region: q (B, H, T, D), rotated k and v (B, T, Hkv, D) of its input x (B, T, dim)
    (``norm``: through the layer's input norm; an EAGLE draft layer has none)."""
    a = block.attention
    if norm:
        x = block.attention_norm(x)
    q, k, v = a.wqkv(x).unflatten(-1, (-1, a.head_dim)).split([a.n_head, a.n_kv_head, a.n_kv_head], dim=2)
    return _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin), v


def _finish(block: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """A layer's second compiled region: the attention output (B, H, T, D) -> the layer's output (B, T, dim)."""
    h = x + block.attention.wo(attn.transpose(1, 2).flatten(2))
    return h + block.feed_forward(block.ffn_norm(h))


def compiled_layer(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: StaticKVCache, layer: int, mask: torch.Tensor | None, norm: bool) -> torch.Tensor:
    """One decode layer (a ``TransformerBlock`` or the ``DraftBlock``) with ``model.compile``: the two compiled
    regions around the eager cache write and attention (``compiled_region``)."""
    a = block.attention
    q, k, v = compiled_region(_project, x.device)(block, x, cos, sin, norm)
    k, v = cache.write_tokens(layer, k, v)  # (B, Hkv, end, D)
    if a.n_kv_head != a.n_head:
        k = k.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
        v = v.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
    out = compiled_region(_finish, x.device)(block, x, attend(q, k, v, mask, False))
    # CUDA graphs (reduce-overhead) write every replay of a region into the same static buffer, and the next
    # layer's replay of _finish takes this output as its input: a copy keeps it (the H200's first run refused it)
    return out.clone() if out.is_cuda else out


class DraftBlock(Float32Rope):
    """The EAGLE draft layer of a LlamaGen target: one LlamaGen block without its input norm.

    After jadohu/LANTERN ``models/drafters/cnets_llamagen.py`` (``LlamaDecoderLayer`` with index 0): the
    first (here the only) layer of an EAGLE drafter skips ``input_layernorm``, because its input is the
    ``fc``-fused ``concat[e(x_{t+1}), f_t]``. Attention, SwiGLU feed-forward and the post-attention norm
    are LlamaGen's (fused ``wqkv``, no biases, no dropout).

    Positions: the pair ``(f_t, x_{t+1})`` at pair position ``t`` is rotated with the 2-D RoPE of the grid
    cell of ``x_{t+1}``, i.e. cell ``t + 1`` (the prefill pair, ``t = -1``, gets cell 0). This is the
    reference drafter's ``cls_token_num = 119`` table for a 120-slot prefix: a one-position shift against
    the target, which rotates input ``x_t`` with cell ``t``. Pairs past the last cell (tree drafting near
    the end of the image) get the reference's all-zero padding rows. The other prefix pairs of the
    ``prefix: all`` convention (prefix slot ``j`` of ``C`` at pair position ``j − C``, so ``t <= −2``) get
    the all-zero rotation too: the reference table's 119 zero rows, which zero their queries and keys.

    Example: ``LlamaGen.make_draft_layer()``; ``python scripts/train_drafter.py model=tiny`` trains one.
    """

    def __init__(self, cfg: GPTConfig, norm_eps: float) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, norm_eps)
        self.hidden_size = cfg.dim
        self.num_heads = cfg.n_head
        self.num_kv_heads = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.dim // cfg.n_head
        self.intermediate_size = self.feed_forward.w1.out_features
        grid = math.isqrt(cfg.block_size)
        table = rope_2d_table(grid, self.head_dim, cfg.rope_base, prefix=0)  # (grid², head_dim/2, 2)
        table = torch.cat([table, torch.zeros(1, self.head_dim // 2, 2)])  # one zero row: past the grid
        self.register_buffer("freqs_cis", table, persistent=False)
        self.num_cells = grid * grid
        #: ``model.compile`` of the target that made this layer (``LlamaGenAdapter.make_draft_layer``)
        self.compiled = False
        self._weight_facts()

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKVCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # cell t + 1 of pair position t; past the grid and prefix pairs (t <= -2, clamped to row −1): the zero row
        cells = (positions + 1).clamp(-1, self.num_cells)
        if self.compiled and isinstance(cache, StaticKVCache):  # eager decode steps only (forward_hidden)
            return compiled_layer(self, h, *self.cos_sin(cells), cache, 0, mask, norm=False)
        rope = self.rotations(cells)  # (T|B·T, 1, D/2)
        fast = self.fast_path  # h = fc(...) has the layer's dtype
        h = h + self.attention(h, rope, cache, 0, mask, fast)
        return h + self.feed_forward(self.ffn_norm(h, fast))

    def from_eagle_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-Llama names of a released EAGLE/LANTERN layer (``self_attn.q_proj.weight`` ...) -> ours."""
        if "input_layernorm.weight" in state:
            raise ValueError("the checkpoint's draft layer has an input_layernorm; LlamaGen EAGLE drafters "
                             "(LANTERN cnets_llamagen.py) skip it, so this checkpoint is of another kind")
        rename = {
            "self_attn.o_proj.weight": "attention.wo.weight",
            "mlp.gate_proj.weight": "feed_forward.w1.weight",
            "mlp.up_proj.weight": "feed_forward.w3.weight",
            "mlp.down_proj.weight": "feed_forward.w2.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
        }
        qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        expected = set(rename) | set(qkv)
        if set(state) != expected:
            raise ValueError(f"EAGLE layer keys differ from a LLaMA layer's: missing "
                             f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
        out = {ours: state[theirs] for theirs, ours in rename.items()}
        out["attention.wqkv.weight"] = torch.cat([state[k] for k in qkv], dim=0)  # (q + 2 kv, dim)
        return out


class LabelEmbedder(nn.Module):
    """Class embedding with an extra null class (index ``num_classes``) for CFG."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)  # (B, 1, dim)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Projects text-encoder features (B, T, caption_dim) to the model width; holds the null caption."""

    def __init__(self, caption_dim: int, dim: int, uncond_prob: float, token_num: int) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)
        self.uncond_prob = uncond_prob

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        if self.training and self.uncond_prob > 0:
            drop = torch.rand(caption.shape[0], device=caption.device) < self.uncond_prob
            caption = torch.where(drop[:, None, None], self.uncond_embedding, caption)
        return self.cap_proj(caption)


class Transformer(Float32Rope):
    """The LlamaGen GPT. ``forward_train`` is the teacher-forced pass; ``forward_hidden`` the cached one."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.class_dropout_prob, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        table = rope_2d_table(math.isqrt(cfg.block_size), cfg.dim // cfg.n_head, cfg.rope_base, cfg.cls_token_num)
        self.register_buffer("freqs_cis", table, persistent=False)
        self.compiled = False  # model.compile (LlamaGenAdapter._place): the piecewise compiled decode layers
        self._weight_facts()

    def _weight_facts(self) -> None:
        weight = self.tok_embeddings.weight
        self.weights_device, self.float32 = weight.device, weight.dtype == torch.float32
        self.fast_path = weight.dtype in FAST_DTYPES

    def init_weights(self, std: float, zero_output: bool) -> None:
        """Reference initialisation: N(0, std) for linear and embedding weights, zero output head."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        if zero_output:
            nn.init.zeros_(self.output.weight)

    def condition(self, cond: torch.Tensor) -> torch.Tensor:
        """Condition embeddings (B, cls_token_num, dim) from labels (B,) or captions (B, T, caption_dim)."""
        return self.cls_embedding(cond)[:, : self.config.cls_token_num]

    def forward_hidden(
        self,
        h: torch.Tensor,
        seq_positions: torch.Tensor,
        cache: StaticKVCache | None,
        mask: torch.Tensor | None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Input embeddings (B, T, dim) at sequence positions (T,) shared or (B, T) per row -> post-norm hidden
        states (B, T, dim).

        ``num_layers`` runs only the first blocks (layer-skip drafting); ``None`` runs all. ``model.compile``'s
        piecewise compiled layers serve the eager cache only: a static step (``coolsd.kv_cache.DeviceKVCache``)
        is compiled or captured whole.
        """
        if self.training:
            h = self.tok_dropout(h)  # the identity in eval mode
        if self.compiled and isinstance(cache, StaticKVCache):  # model.compile: eager decode forwards only
            cos, sin = self.cos_sin(seq_positions)
            for i, layer in enumerate(itertools.islice(self.layers, num_layers)):
                h = compiled_layer(layer, h, cos, sin, cache, i, mask, norm=True)
            return self.norm(h)
        rope = self.rotations(seq_positions)  # rope_rotation(self.freqs_cis[seq_positions])
        fast = self.fast_path  # every layer's input has the dtype of the model's embeddings and weights
        for i, layer in enumerate(itertools.islice(self.layers, num_layers)):  # slicing would build a ModuleList
            h = layer(h, rope, cache, i, mask, fast)
        return self.norm(h, fast)

    def forward_train(self, tokens: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass over all image tokens (B, N) -> (logits (B, N, V), hidden (B, N, dim)).

        Output ``n`` predicts image token ``n`` (the last condition position predicts token 0).
        """
        c = self.config.cls_token_num
        h = torch.cat([self.condition(cond), self.tok_embeddings(tokens[:, :-1])], dim=1)  # (B, C+N-1, dim)
        hidden = self.forward_hidden(h, torch.arange(h.shape[1], device=h.device), None, None)[:, c - 1 :]
        return self.output(hidden).float(), hidden


class LlamaGenCache(StaticKVCache):
    """The static KV cache plus the number of condition tokens in front of the image tokens."""

    def __init__(self, prefix_len: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefix_len = prefix_len


class LlamaGenAdapter(ImageARModel):
    """What the class- and text-conditional LlamaGen adapters share.

    The GPT and the VQ, the static cache with the condition prefix in front of the image tokens (optionally
    with padded prefix slots), image-token blocks (positions -> sequence slot ``cls_token_num + i``, 2-D
    RoPE of grid cell ``i``), the output head, the codebook, image decoding and the EAGLE draft layer.
    Subclasses turn a prompt into condition embeddings (``prefill``): ``LlamaGen`` (class labels) and
    ``coolsd.models.llamagen_t2i.LlamaGenT2I`` (flan-t5-xl captions).
    """

    sjd_init = "repeat_horizon"  # the SJD reference's LlamaGen demo setting (test_llamagen.py)
    spatial_orders = True  # 2-D RoPE by grid cell, a static KV cache with per-query masks
    model_type = "c2i"  # the GPTConfig.model_type a subclass serves
    #: FoundationVision/LlamaGen's sampling scripts: decode forwards on the math SDPA kernel (``generate.py``), TF32
    #: on CUDA and images saved as torchvision's ``save_image`` (``sample_t2i.py``)
    runtime_defaults = Runtime(attention_kernel="math", tf32=True, pixel_rounding="half_up")
    compiled_layers = True  # model.compile: the piecewise compiled decode layers (compiled_region)
    model_name = "LlamaGen"

    def _build(
        self,
        gpt: dict | GPTConfig,
        vq: dict | VQConfig,
        gpt_size: str | None,
        init_seed: int,
        init_std: float,
        zero_init_output: bool,
    ) -> None:
        """Configs, then a randomly initialised GPT and VQ (seeded; the global RNG is left untouched)."""
        gpt_fields = dict(gpt) if not isinstance(gpt, GPTConfig) else asdict(gpt)
        if gpt_size is not None:
            if gpt_size not in GPT_SIZES:
                raise ValueError(f"model.gpt_size must be one of {sorted(GPT_SIZES)}, got {gpt_size!r}")
            gpt_fields.update(GPT_SIZES[gpt_size])
        self.cfg = GPTConfig(**gpt_fields)
        if self.cfg.model_type != self.model_type:
            raise ValueError(
                f"{type(self).__module__}.{type(self).__name__} serves model.gpt.model_type="
                f"{self.model_type!r}, got {self.cfg.model_type!r}; class-conditional models use "
                "coolsd.models.llamagen.LlamaGen (model=tiny), text-to-image ones "
                "coolsd.models.llamagen_t2i.LlamaGenT2I (model=llamagen_t2i_256)"
            )
        vq_cfg = vq if isinstance(vq, VQConfig) else VQConfig(**dict(vq))
        if vq_cfg.codebook_size != self.cfg.vocab_size:
            raise ValueError(f"model.vq.codebook_size ({vq_cfg.codebook_size}) must equal "
                             f"model.gpt.vocab_size ({self.cfg.vocab_size})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            self.gpt = Transformer(self.cfg)
            self.gpt.init_weights(init_std, zero_init_output)
            self.vq = VQModel(vq_cfg)
        side = math.isqrt(self.cfg.block_size)
        self.grid = (side, side)
        self.codebook_size = self.cfg.vocab_size
        self.hidden_size = self.cfg.dim
        self.active_layers = self.cfg.n_layer

    def _place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Eval mode on ``device`` in ``dtype``, the VQ in float32 (``ImageARModel.place``); ``runtime.compile``:
        the piecewise compiled decode layers of target and EAGLE drafter (``compiled_region``)."""
        self.gpt.compiled = self.runtime.compile
        self.place(device, dtype, float32=(self.vq,))

    def _new_cache(self, batch: int, extra_slots: int) -> LlamaGenCache:
        c = self.cfg.cls_token_num
        return LlamaGenCache(
            prefix_len=c,
            num_layers=self.active_layers,
            batch=batch,
            streams=self.num_streams,
            num_heads=self.cfg.n_kv_head or self.cfg.n_head,
            max_len=c + self.num_image_tokens + extra_slots,
            head_dim=self.cfg.dim // self.cfg.n_head,
            dtype=self.gpt.tok_embeddings.weight.dtype,
            device=self.device,
        )

    @property
    def device(self) -> torch.device:
        """The GPT's device, read from one weight (the generic property walks the parameter iterator)."""
        return self.gpt.weights_device

    def _output(self, hidden: torch.Tensor) -> TargetOutput:
        """Hidden states of the cache rows (B·S, T, H) -> per-stream output (S, B, T, ·)."""
        hidden = per_stream(hidden, self.num_streams)
        return TargetOutput(logits=self.head(hidden), hidden=hidden)

    def _prefill_condition(
        self, h: torch.Tensor, key_valid: torch.Tensor | None, extra_slots: int
    ) -> tuple[LlamaGenCache, TargetOutput]:
        """Run condition embeddings ``h`` (B·S, C, dim), image-major, through a fresh cache; ``key_valid``
        (B·S, C) marks the prefix slots other tokens may attend to (``None``: all). Returns the output of
        the last slot."""
        cache = self._new_cache(h.shape[0] // self.num_streams, extra_slots)
        if key_valid is not None:
            cache.set_padding(key_valid)
        mask = cache.begin_block(h.shape[1])
        hidden = self.gpt.forward_hidden(
            h, torch.arange(h.shape[1], device=self.device), cache, mask, self.active_layers
        )  # (B·S, C, dim)
        hidden = per_stream(hidden, self.num_streams)  # (S, B, C, dim)
        last = hidden[:, :, -1:]
        return cache, TargetOutput(logits=self.head(last), hidden=last, prefix_hidden=hidden)

    @torch.inference_mode()
    def forward_block(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        device = self.device
        with self.decode_context():  # LlamaGen decodes with the math kernel
            return self.static_forward(cache, tokens.to(device), positions.to(device), tree_mask)

    def decode_context(self):
        return attention_context(self.attention_kernel)

    def static_forward(self, cache, tokens, positions, tree_mask=None) -> TargetOutput:
        """``forward_block`` without its context and copies: tokens and positions on the device, the caller inside
        ``decode_context()``; the static path's forward over a ``DeviceKVCache``."""
        s = self.num_streams
        h = self.gpt.tok_embeddings(tokens)  # (B, T, dim)
        seq = positions + cache.prefix_len  # (B, T)
        if s > 1:  # cache rows are image-major: [image 0's streams, image 1's streams, ...]
            h, seq = stream_rows(h, s), stream_rows(seq, s)
        mask = cache.begin_block(tokens.shape[1], tree_mask)
        hidden = self.gpt.forward_hidden(h, seq, cache, mask, self.active_layers)
        return self._output(hidden)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt.tok_embeddings(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gpt.output(hidden).float()  # float32 logits; the same call in every dtype (a no-op in float32)

    def codebook(self) -> torch.Tensor:
        return self.vq.codebook()

    @torch.inference_mode()
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode_images(tokens.reshape(1, -1))[0]

    @torch.inference_mode()
    def decode_images(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (B, N) -> uint8 images (B, C, H, W) in one VQ decoder pass."""
        return self.vq.decode_to_uint8(tokens.to(self.device), self.grid, self.pixel_rounding)

    def make_draft_layer(self, norm_eps: float | None = None) -> DraftBlock:
        """A fresh ``DraftBlock`` of this GPT's width and heads (see ``ImageARModel.make_draft_layer``)."""
        no_dropout = {"token_dropout_p": 0.0, "resid_dropout_p": 0.0, "ffn_dropout_p": 0.0}
        cfg = GPTConfig(**{**asdict(self.cfg), **no_dropout})
        layer = DraftBlock(cfg, self.cfg.norm_eps if norm_eps is None else norm_eps)
        layer.compiled = self.runtime.compile  # model.compile covers the drafter step too
        return layer.to(device=self.device, dtype=self.gpt.tok_embeddings.weight.dtype)


class LlamaGen(LlamaGenAdapter):
    """Model adapter for LlamaGen class-conditional GPTs (``c2i``; prompts are class names).

    Text-to-image (``t2i``, flan-t5-xl captions) shares this transformer: ``coolsd.models.llamagen_t2i``.
    """

    model_type = "c2i"
    runtime_defaults = LlamaGenAdapter.runtime_defaults.replace(dtype="float32")

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The GPT and VQ checkpoints it is given (``model.gpt_checkpoint``, ``model.vq_checkpoint``; none for
        random weights); local files, e.g. the embedded model's in ``coolsd/assets/embedded/``."""
        files = (("gpt_checkpoint", "LlamaGen GPT checkpoint"), ("vq_checkpoint", "LlamaGen VQ checkpoint"))
        return [RequiredFile(what, local=str(cfg[key]), manual=CHECKPOINT_HINT) for key, what in files if cfg.get(key)]

    def __init__(
        self,
        gpt: dict | GPTConfig,
        vq: dict | VQConfig,
        sampling: dict | SamplingConfig,
        class_names: Sequence[str] = (),
        gpt_size: str | None = None,
        gpt_checkpoint: str | None = None,
        vq_checkpoint: str | None = None,
        init_seed: int = 0,
        init_std: float = 0.02,
        zero_init_output: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        """``gpt_checkpoint``, ``vq_checkpoint``: local checkpoints, both looked up before anything is built (one
        ``MissingWeightsError`` names each missing file and how to make it); none: the seeded random
        initialisation (``init_seed``, ``init_std``, ``zero_init_output``). ``runtime``: ``runtime_defaults``
        with dtype float32."""
        super().__init__(sampling, runtime)
        device, dtype = self.runtime.resolve(published=bool(gpt_checkpoint or vq_checkpoint))
        missing_together("LlamaGen checkpoints are missing (looked up before building the model)",
                         [m for m in (local_file_missing(p, CHECKPOINT_HINT) for p in (gpt_checkpoint, vq_checkpoint)
                                      if p) if m])
        self._build(gpt, vq, gpt_size, init_seed, init_std, zero_init_output)
        self.class_names = list(class_names)
        if self.class_names and len(self.class_names) != self.cfg.num_classes:
            raise ValueError(f"model.class_names has {len(self.class_names)} names but "
                             f"model.gpt.num_classes is {self.cfg.num_classes}")
        if gpt_checkpoint:
            load_gpt_checkpoint(self.gpt, gpt_checkpoint)
        if vq_checkpoint:
            from coolsd.models.vq import load_vq_checkpoint

            load_vq_checkpoint(self.vq, vq_checkpoint)
        self._place(device, dtype)

    def class_index(self, prompt: str) -> int:
        if prompt in self.class_names:
            return self.class_names.index(prompt)
        if prompt.strip().isdigit() and int(prompt) < self.cfg.num_classes:
            return int(prompt)
        allowed = self.class_names or [f"0..{self.cfg.num_classes - 1}"]
        raise ValueError(f"prompt {prompt!r} is not a class of this model; allowed: {allowed}")

    @torch.inference_mode()
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[LlamaGenCache, TargetOutput]:
        label = torch.tensor([self.class_index(p) for p in prompts], device=self.device)
        if self.num_streams == 2:  # each image's [cond, uncond] rows (the null class)
            label = torch.stack([label, torch.full_like(label, self.cfg.num_classes)], dim=1).flatten()
        return self._prefill_condition(self.gpt.condition(label), None, extra_slots)

    @torch.inference_mode()
    def teacher_force(self, prompts: list[str], tokens: torch.Tensor, prefix: str = "last") -> torch.Tensor:
        """Batched: every stream of every sequence in one causal pass (no cache) -> (B, S, N+1, H), or
        (B, S, C+N, H) with every condition slot for ``prefix="all"`` (see ``ImageARModel.teacher_force``)."""
        check_prefix(prefix)
        b = tokens.shape[0]
        labels = torch.tensor([self.class_index(p) for p in prompts], device=self.device)
        if self.num_streams == 2:
            labels = torch.cat([labels, torch.full_like(labels, self.cfg.num_classes)])  # [cond; uncond]
        seq = tokens.to(self.device).repeat(self.num_streams, 1)  # (S*B, N)
        h = torch.cat([self.gpt.condition(labels), self.gpt.tok_embeddings(seq)], dim=1)  # (S*B, C+N, dim)
        hidden = self.gpt.forward_hidden(h, torch.arange(h.shape[1], device=self.device), None, None,
                                         self.active_layers)
        if prefix == "last":
            hidden = hidden[:, self.cfg.cls_token_num - 1 :]  # (S*B, N+1, dim): f_{-1} .. f_{N-1}
        return hidden.view(self.num_streams, b, *hidden.shape[1:]).transpose(0, 1)


#: how the class-conditional adapter's checkpoints are made or named (``required_files``, the missing-file error)
CHECKPOINT_HINT = ("python scripts/train_embedded.py (the embedded model), or set model.gpt_checkpoint / "
                   "model.vq_checkpoint to LlamaGen checkpoints")


def load_gpt_checkpoint(gpt: Transformer, path: str, strict: bool = False) -> None:
    """Load a LlamaGen GPT checkpoint (``torch.save`` dict with key ``model``, or safetensors).

    ``strict``: the checkpoint's keys must equal the GPT's ``state_dict`` keys exactly (the released
    checkpoints do); otherwise extra keys are ignored but every parameter must be present.
    """
    from coolsd.models.checkpoints import load_state_dict

    state = load_state_dict(path, nested_keys=("model", "module", "state_dict"))
    if strict:
        expected = set(gpt.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise RuntimeError(f"{path} does not match the configured LlamaGen GPT: missing {missing[:5]} "
                               f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}); is it a "
                               "checkpoint of this size and model_type (model.gpt_size, model.gpt)?")
        gpt.load_state_dict(state, strict=True)
        return
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "freqs_cis"]
    if missing:
        raise RuntimeError(f"{path} lacks {len(missing)} GPT parameters, e.g. {missing[:5]}; "
                           "is it a LlamaGen GPT checkpoint of the configured size?")


def layer_skip_copy(target: LlamaGenAdapter, num_layers: int) -> LlamaGenAdapter:
    """A draft model sharing the target's weights that runs only its first ``num_layers`` blocks.

    A cheap, training-free drafter of the same family (self-speculation by layer skipping) for models
    without a trained EAGLE head. The copy is shallow: no weights are duplicated.
    """
    return layer_skipping(target, num_layers, target.cfg.n_layer)
