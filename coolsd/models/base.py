"""The model-adapter interface: everything a decoder may know about a target model.

Decoders see guided distributions over codebook ids ``[0, V)`` and image-token positions, nothing else.
An adapter hides the CFG batch layout, vocabulary offsets, structural tokens (end-of-row, size tokens),
prompt templates, text encoders and the VQ decoder (design: ``docs/design.md``).

Positions are *image-token indices*: the input token ``x_i`` (the i-th image token, 0-based) sits at
position ``i`` and its output is the distribution of token ``i + 1``. The prefill's output is the
distribution of token 0. Every call serves a batch of ``B`` images (prompts); tensors carry the image
axis after the stream axis: logits and hidden states are (S, B, T, ·), tokens and positions (B, T).

The options every adapter shares (device, dtype, attention kernel, TF32, pixel rounding, batch invariance, row
block, requires_cuda, compile) are one ``Runtime``, folded from the model YAML's keys by ``AdapterMeta`` and
applied by ``ImageARModel.place``; the contract an adapter satisfies is ``docs/extending.md`` ("A model adapter"),
checked for every adapter by ``tests/test_adapters.py``.

Example: ``coolsd.models.llamagen.LlamaGen`` implements it; ``python run.py model=tiny`` uses it.
"""
from __future__ import annotations

import abc
import contextlib
import contextvars
import copy
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from coolsd import validate
from coolsd.device import resolve_device
from coolsd.kv_cache import DeviceKVCache, padding_invariant
from coolsd.rng import Streams
from coolsd.sampling import SamplingConfig, stream_probs
from coolsd.types import TargetOutput

#: What an EAGLE drafter is fed before the first image token (``coolsd.drafters.eagle``): ``last`` = the
#: prefill's last hidden state only; ``all`` = every prefix slot (LANTERN's LlamaGen drafters).
PREFIX_CONVENTIONS = ("last", "all")


def check_prefix(prefix: str) -> None:
    if prefix not in PREFIX_CONVENTIONS:
        raise ValueError(f"drafter prefix must be one of {PREFIX_CONVENTIONS}, got {prefix!r}")


#: ``model.attention_kernel``: the scaled-dot-product-attention kernels of the decode and verify forwards
#: (``forward_block``). ``math``: PyTorch's math kernel only, as FoundationVision/LlamaGen ``generate.py``
#: decodes (``sdp_kernel(enable_flash=False, enable_mem_efficient=False, enable_math=True)`` around
#: ``decode_n_tokens``; its prefill runs outside it, so the prefill here always uses PyTorch's dispatch).
#: ``auto``: PyTorch's dispatch (the transformers-based Janus and Lumina-mGPT references). On a CPU only the
#: plumbing changes; the effect on CUDA bf16 logits has not been measured here. ``matmul`` (LlamaGen-family
#: layers): the same arithmetic written out, ``softmax(q kᵀ / √d + mask) v`` with two batched matmuls —
#: measured on 2 CPU cores about 30% faster than PyTorch's kernels for decode-size query blocks (1-5 queries,
#: 128 rows of 8 heads); the embedded default model uses it.
ATTENTION_KERNELS = ("auto", "math", "matmul")
_MATMUL_ATTENTION = contextvars.ContextVar("matmul_attention", default=False)
#: ``model.pixel_rounding``: how decoded pixels (clamped to [-1, 1], mapped to [0, 255] as (x + 1) / 2 · 255)
#: become uint8, as each reference saves its images (``pixels_to_uint8``).
PIXEL_ROUNDINGS = ("half_up", "truncate", "half_even")


def pixels_to_uint8(pixels: torch.Tensor, rounding: str) -> torch.Tensor:
    """Decoded pixels, nominally in [-1, 1] -> uint8: clamp, ``(x + 1) / 2 · 255`` in float32, then

    * ``half_up``: add 0.5 and truncate, i.e. torchvision ``save_image(normalize=True, value_range=(-1, 1))``
      (``mul(255).add_(0.5).clamp_(0, 255).to(uint8)``), how LlamaGen's ``sample_t2i.py`` and LANTERN's
      ``generate_images.py`` save images;
    * ``truncate``: truncate, as deepseek-ai/Janus ``generation_inference.py`` (``np.clip((x + 1) / 2 * 255,
      0, 255)`` assigned into a uint8 array), transformers' ``JanusImageProcessor.postprocess`` and Meta's
      Chameleon ``ImageTokenizer._pil_from_chw_tensor`` (Lumina-mGPT) do;
    * ``half_even``: ``torch.round`` (half to even; this project's former conversion, kept by the embedded
      model, whose model card was measured with it).
    """
    if rounding not in PIXEL_ROUNDINGS:
        raise ValueError(f"model.pixel_rounding must be one of {PIXEL_ROUNDINGS}, got {rounding!r}")
    x = (pixels.float().clamp(-1.0, 1.0) + 1.0) / 2.0 * 255.0
    if rounding == "half_up":
        x = x + 0.5
    elif rounding == "half_even":
        x = x.round()
    return x.clamp(0.0, 255.0).to(torch.uint8)


def stream_rows(x: torch.Tensor, streams: int) -> torch.Tensor:
    """Per-image rows (B, ...) repeated for every CFG stream, image-major (B·S, ...) as the caches lay them out
    (row ``b·S + s``: an image's streams are adjacent, so dropping finished images moves whole blocks)."""
    if streams == 1:
        return x
    return x.repeat_interleave(streams, dim=0)  # one call: the same contiguous rows as unsqueeze/expand/reshape


def layer_skipping(target: "ImageARModel", num_layers: int, total: int) -> "ImageARModel":
    """A draft model sharing ``target``'s weights that runs only its first ``num_layers`` of ``total`` decoder layers
    (a shallow copy with ``active_layers`` set: no weight duplicated; the final norm and head are the target's): the
    training-free layer-skip drafter every adapter's ``layer_skip_copy`` returns."""
    if not 0 < num_layers <= total:
        raise ValueError(f"drafter.draft_model.num_layers must be in 1..{total}, got {num_layers}")
    draft = copy.copy(target)
    draft.active_layers = num_layers
    return draft


def per_stream(rows: torch.Tensor, streams: int) -> torch.Tensor:
    """Cache rows (B·S, ...), image-major -> the stream axis first (S, B, ...) (a view)."""
    return rows.unflatten(0, (-1, streams)).transpose(0, 1)


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-stream tensors (S, B, ...) -> cache rows (B·S, ...), image-major."""
    return x.transpose(0, 1).flatten(0, 1)


def attention_context(kernel: str) -> contextlib.AbstractContextManager:
    """The context a decode/verify forward runs in for ``model.attention_kernel`` (``ATTENTION_KERNELS``)."""
    if kernel == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    if kernel == "matmul":
        return _matmul_attention()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _matmul_attention():
    token = _MATMUL_ATTENTION.set(True)
    try:
        yield
    finally:
        _MATMUL_ATTENTION.reset(token)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Scaled dot-product attention (B, H, T, D) with an additive ``mask`` (or causal, or none): PyTorch's
    kernels, or written out inside ``attention_context("matmul")`` (see ``padding_invariant_attention``).
    ``shape``: q's (T, D) where the caller knows them (saves reading ``q.shape``).

    Inside ``torch.compile`` (a static step compiled whole) the same eager computation runs as one library call
    (``library_attention``, an opaque custom op): inductor would otherwise lower the attention of a single query
    over the cache to generated loops on a CPU (it rewrites a batched matmul with one row as a multiply and a
    sum), which measured slower than the library's kernels at real lengths; the op keeps the eager kernels, so a
    compiled step's tokens stay the eager ones bit for bit."""
    matmul = _MATMUL_ATTENTION.get()
    if causal:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    head_dim, single = 0, False
    if matmul:
        queries, head_dim = shape if shape is not None else q.shape[-2:]
        single = queries == 1 and padding_invariant()
    if torch.compiler.is_compiling():
        return library_attention(q, k, v, mask, matmul, single, head_dim)
    return _attention(q, k, v, mask, matmul, single, head_dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, matmul: bool,
               single: bool, head_dim: int) -> torch.Tensor:
    """``attend``'s eager computation (not causal): PyTorch's SDPA, or written out (``matmul``, scaled by
    ``head_dim``), a single query run as two equal ones (``single``)."""
    if not matmul:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if single:
        q = torch.cat([q, q], dim=-2)  # materialised: a stride-0 expand takes matmul's slow path (7x)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (head_dim ** -0.5)
    if mask is not None:
        scores = scores + mask
    out = torch.matmul(scores.softmax(-1), v)
    return out[..., :1, :].contiguous() if single else out


@torch.library.custom_op("coolsd::attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? mask, bool matmul, bool single, int head_dim) "
                                "-> Tensor")
def library_attention(q, k, v, mask, matmul, single, head_dim):  # noqa: ANN001, ANN201 (the schema types it)
    """``_attention`` as one opaque op for compiled steps (``attend``)."""
    return _attention(q, k, v, mask, matmul, single, head_dim)


@library_attention.register_fake
def _(q, k, v, mask, matmul, single, head_dim):  # noqa: ANN001, ANN202
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def eager_only(compile: Any, model: str) -> None:
    """``model.compile`` of an adapter without compiled layers: a boolean, refused when true (before any weight
    is read)."""
    if validate.boolean("model.compile", compile):
        raise ValueError(f"model.compile=true is implemented for the LlamaGen adapters (model=embedded, tiny, "
                         f"llamagen_t2i_*); {model} decodes eagerly: set model.compile=false")


def check_reference_options(attention_kernel: str, pixel_rounding: str) -> None:
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention_kernel must be one of {ATTENTION_KERNELS}, got {attention_kernel!r}")
    if pixel_rounding not in PIXEL_ROUNDINGS:
        raise ValueError(f"model.pixel_rounding must be one of {PIXEL_ROUNDINGS}, got {pixel_rounding!r}")


def hf_weights(name: str, model: Any, tokenizer: Any, pretrained: bool, arch: Any, repo_id: str | None,
               example_repo: str, arch_class: str, load: Any, build_random: Any) -> tuple[Any, Any]:
    """The (model, tokenizer) of a transformers-based adapter: a prebuilt pair as given, the hub checkpoint
    ``repo_id`` (``load()``) with ``pretrained``, else random weights of ``arch`` sizes (``build_random()``);
    every wrong combination of ``model.*`` keys is refused before anything is read."""
    if model is not None:
        if tokenizer is None:
            raise ValueError(f"a prebuilt {name} model needs its tokenizer (tokenizer=...)")
        return model, tokenizer
    if pretrained:
        if arch is not None:
            raise ValueError("model.arch sizes a random-weight model; with model.pretrained=true the "
                             "checkpoint's config.json is used: set model.arch=null")
        if not repo_id:
            raise ValueError(f"model.repo_id is required with model.pretrained=true, e.g. {example_repo}")
        return load()
    if arch is None:
        raise ValueError("model.pretrained=false builds random weights of model.arch sizes: set "
                         f"model.arch={{}} (tiny defaults) or a dict of {arch_class} fields")
    return build_random()


def set_tf32(device: torch.device, tf32: bool) -> None:
    """``model.tf32`` on CUDA: ``true`` = LlamaGen's ``sample_t2i.py`` (TF32 for float32 matmuls and cuDNN
    convolutions); ``false`` = PyTorch's defaults (matmul TF32 off, cuDNN TF32 on), which the Janus and
    Lumina-mGPT scripts leave. Process-wide settings; nothing changes on a CPU."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


#: ``model.row_block`` (``batch_invariant_linears``): every CPU linear multiplies a multiple of this many rows
#: (zero rows appended); 1 = off (the default). Measured with MKL 2024.2 (torch 2.14.1), column-major weights,
#: the embedded model's shapes, products of 1–160 rows against the same rows of a 1,280-row product: on a 2-core
#: AMD EPYC (AVX2) 1–3 rows (and 5–7, 9–11 at 2 or 8 threads) gave other last bits, every multiple of 4 the same
#: bits at 1, 2, 3, 4 and 8 threads, so ``row_block=4`` makes the self-check (``coolsd.numerics``) pass there; on
#: the Intel AVX-512 VM of earlier sessions every count from 2 rows up did already. It costs compute where small
#: products are compute-bound: on that AMD VM a batch-1 decode of the embedded model took 1.15–1.25x as long
#: (README, "Bitwise reproducibility").
ROW_BLOCKS = (1, 2, 4, 8, 16)


class RowBlockLinear(nn.Linear):
    """An ``nn.Linear`` whose product always has a multiple of ``row_block`` rows (``batch_invariant_linears``):
    ``x`` (..., in) is flattened to M rows, padded with zero rows to the next multiple, multiplied, and the
    padding dropped. The values of the real rows are those of ``F.linear`` on a product of that many rows."""

    row_block: int = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        pad = -rows % self.row_block
        if not pad:
            return F.linear(x, self.weight, self.bias)
        flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))  # (M + pad, in)
        return F.linear(flat, self.weight, self.bias)[:rows].view(*x.shape[:-1], self.out_features)


def check_row_block(row_block: int) -> int:
    validate.integer("model.row_block", row_block, minimum=1)
    return validate.choice("model.row_block", row_block, ROW_BLOCKS)


def batch_invariant_linears(module: nn.Module, row_block: int = 1) -> int:
    """Store every CPU ``nn.Linear`` weight of ``module`` column-major (the same values, transposed strides), so
    that a row's output does not depend on how many rows share the forward, on the CPUs where that holds: an
    image's logits are then bitwise the same alone, in any batch and after a resume. Whether it holds on the
    machine that runs is measured by the start-up self-check (``coolsd.numerics.check_batch_invariance``).

    Why: MKL picks its float32 GEMM kernel by shape **and by CPU vendor and ISA**, and kernels for few rows sum
    in another order (measured: up to 4e-5 on a linear of the embedded model). On the Intel AVX-512 VM of
    earlier sessions row-major weights split at 16 rows and column-major ones at 2, so a batch-1 CFG forward
    (2 rows) and a batch share one kernel; on a 2-core AMD EPYC (AVX2) both layouts split at 4 rows (and, at 2
    threads, at counts that are not multiples of 4): there ``row_block=4`` also makes every module a
    ``RowBlockLinear`` (products of whole 4-row blocks), which restores the invariance at a measured cost
    (``ROW_BLOCKS``). Speed of the column-major layout (embedded model, interleaved, Intel VM): a batch-1
    one-token forward 5–7 % slower, a 5-token forward and batches of 32 about equal. CUDA weights are left as
    they are: cuBLAS picks kernels by shape too, and the layout's speed there was not measured. Parameters
    shared with a non-linear module (tied embeddings) are skipped. Returns the number of weights changed.
    """
    row_block = check_row_block(row_block)
    shared = {id(p) for m in module.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    changed = 0
    for m in module.modules():
        if not isinstance(m, nn.Linear):
            continue
        w = m.weight
        if w.device.type != "cpu" or id(w) in shared or min(w.shape) <= 1:
            continue
        if row_block > 1 and type(m) in (nn.Linear, RowBlockLinear):
            m.__class__ = RowBlockLinear
            m.row_block = row_block
        if w.is_contiguous():
            w.data = w.data.t().contiguous().t()
            changed += 1
    return changed


#: ``model.dtype``: the torch dtypes by name (``auto``: see ``Runtime.resolve``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class Runtime:
    """Where and how an adapter runs: the options every adapter shares, each the model YAML's top-level key of the
    same name (``model.device=cpu``, ``model.compile=true``). Checked when made, an error naming the key and what
    it allows. An adapter's own defaults are its ``ImageARModel.runtime_defaults``; these field defaults are the
    transformers-based adapters' (PyTorch's kernels and TF32 settings, pixels truncated).

    * ``device``: ``auto`` (CUDA if usable, else the CPU), ``cpu``, ``cuda[:k]`` or ``meta`` (nothing allocated:
      a real size built in seconds); resolved by ``coolsd.device.resolve_device``;
    * ``dtype``: ``auto`` (bfloat16 on CUDA, the references' precision; float32 elsewhere) or a name of ``DTYPES``;
    * ``attention_kernel`` (``ATTENTION_KERNELS``), ``tf32`` (``set_tf32``), ``pixel_rounding``
      (``PIXEL_ROUNDINGS``): how the model's reference decodes and saves its images;
    * ``batch_invariant``: on a CPU, float32 arithmetic whose bits do not depend on the batch (an image alone and
      inside any batch are bitwise equal): linear weights stored column-major (``batch_invariant_linears``) and,
      in the decoding loop, ``padding_invariant_attention``. ``false`` keeps PyTorch's layout, measured 5–7 %
      faster per batch-1 one-token forward of the embedded model (about equal from 5 tokens or 32 images up);
      an image may then differ in the last bits between batch sizes (measured: 3 of 480 default-run images
      changed tokens between batch 1 and batch 32);
    * ``row_block`` (``ROW_BLOCKS``): CPU linears multiply whole blocks of this many rows (``RowBlockLinear``);
    * ``requires_cuda``: with published weights, ``device=auto`` without CUDA stops before any file is read;
    * ``compile``: ``torch.compile`` of the decode layers, implemented by adapters with ``compiled_layers``
      (the others refuse it, naming the model).

    Example: ``LlamaGen(gpt=..., vq=..., sampling=..., device="cpu")`` or ``runtime={"device": "cpu"}`` (changes
    to the adapter's own defaults); ``runtime=Runtime(device="cpu")`` is taken as given (these field defaults).
    """

    device: str = "auto"
    dtype: str = "auto"
    attention_kernel: str = "auto"
    tf32: bool = False
    pixel_rounding: str = "truncate"
    batch_invariant: bool = True
    row_block: int = 1
    requires_cuda: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        device = str(self.device) if isinstance(self.device, torch.device) else self.device
        if not isinstance(device, str) or not _device_name(device):
            raise ValueError(f"model.device must be auto, cpu, cuda, cuda:<index> or meta, got {device!r}")
        object.__setattr__(self, "device", device)
        validate.choice("model.dtype", self.dtype, ("auto", *DTYPES))
        check_reference_options(self.attention_kernel, self.pixel_rounding)
        for key in ("tf32", "batch_invariant", "requires_cuda", "compile"):
            validate.boolean(f"model.{key}", getattr(self, key))
        check_row_block(self.row_block)

    def replace(self, **changes: Any) -> Runtime:
        """A copy with ``changes`` (checked as any ``Runtime``); an unknown key names the options there are."""
        unknown = sorted(set(changes) - set(RUNTIME_KEYS))
        if unknown:
            raise TypeError(f"model.{unknown[0]} is not a runtime option; they are {list(RUNTIME_KEYS)}")
        return dataclasses.replace(self, **changes)

    def resolve(self, published: bool = True) -> tuple[torch.device, torch.dtype]:
        """The device and dtype a model is placed on. ``requires_cuda`` holds only when the adapter reads its
        ``published`` weights (``coolsd.device``: a ``DeviceError`` then, before any file is read); ``dtype=auto``
        is bfloat16 on CUDA, float32 elsewhere."""
        device = resolve_device(self.device, requires_cuda=self.requires_cuda and published)
        if self.dtype == "auto":
            return device, torch.bfloat16 if device.type == "cuda" else torch.float32
        return device, DTYPES[self.dtype]


#: the keys of ``Runtime``: an adapter takes them as keyword arguments (``AdapterMeta``) or as one ``runtime``
RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(Runtime))


def _device_name(device: str) -> bool:
    if device == "auto":
        return True
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        return False
    return True


def runtime_of(defaults: Runtime, runtime: Runtime | Mapping[str, Any] | None, options: Mapping[str, Any]) -> Runtime:
    """The ``Runtime`` an adapter is built with: ``runtime`` as given (a mapping: changes to ``defaults``, the
    adapter's own), else ``defaults``, then the keyword ``options`` of the same names on top."""
    if runtime is None:
        runtime = defaults
    elif not isinstance(runtime, Runtime):
        runtime = defaults.replace(**dict(runtime))
    return runtime.replace(**options) if options else runtime


class AdapterMeta(abc.ABCMeta):
    """Builds an adapter with one ``Runtime``: the keys of ``RUNTIME_KEYS`` among its keyword arguments (a model
    YAML's top-level keys, as Hydra passes them) are folded, with a ``runtime`` argument if given, over the class's
    ``runtime_defaults`` before its ``__init__`` runs, which then takes them as ``runtime`` only. Any other key
    reaches ``__init__`` as it is, so a misspelt one still fails there, naming it. Classes whose
    ``runtime_defaults`` is None take no runtime options (the lookup model)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        defaults = getattr(cls, "runtime_defaults", None)
        if defaults is not None:
            options = {key: kwargs.pop(key) for key in RUNTIME_KEYS if key in kwargs}
            kwargs["runtime"] = runtime_of(defaults, kwargs.pop("runtime", None), options)
        return super().__call__(*args, **kwargs)


def _runtime_option(name: str) -> property:
    """``model.<name>``: the adapter's ``runtime.<name>``; setting it replaces the runtime (a shallow copy of
    the adapter, e.g. a layer-skip drafter, then has its own)."""

    def get(self: ImageARModel) -> Any:
        return getattr(self.runtime, name)

    def set(self: ImageARModel, value: Any) -> None:
        self.runtime = self.runtime.replace(**{name: value})

    return property(get, set, doc=f"``runtime.{name}`` (``Runtime``)")


class BlockCache(Protocol):
    """The decoding state of a batch of prompts, block-addressed per image (``coolsd.kv_cache.StaticKVCache``)."""

    lengths: list[int]

    def keep(self, counts: list[int] | int, index: torch.Tensor | None = None) -> None:
        """Keep the first ``counts[b]`` tokens of each image's latest block, or its block indices
        ``index[b, :counts[b]]``."""

    def rollback(self, lengths: list[int] | int) -> None:
        """Forget everything from slot ``lengths[b]`` on (possibly spanning several blocks)."""

    def select(self, images: list[int]) -> None:
        """Keep only the listed images (finished images leave the batch)."""


class ImageARModel(nn.Module, metaclass=AdapterMeta):
    """Base class of every target model adapter (one image per prompt; CFG streams are internal).

    The contract (``docs/extending.md``, "A model adapter"; ``tests/test_adapters.py`` checks it for every
    adapter): ``__init__`` takes the adapter's own options (weights, prompt template, structural tokens, sizes),
    ``sampling`` and one ``runtime`` (``Runtime``: its keys arrive as keyword arguments, folded by
    ``AdapterMeta``), calls ``super().__init__(sampling, runtime)`` first, resolves its device and dtype with
    ``self.runtime.resolve(published)`` before any file is read, builds or loads, and ends with ``place``.
    """

    codebook_size: int
    grid: tuple[int, int]
    hidden_size: int
    sampling: SamplingConfig
    #: the adapter's runtime options when none is given (``Runtime``): the model family's reference settings.
    #: ``None``: the class takes no runtime options (the lookup model keeps ``runtime``'s defaults)
    runtime_defaults: Runtime | None = None
    #: where and how the model runs (``Runtime``), set by ``__init__``
    runtime: Runtime = Runtime()
    #: whether ``model.compile=true`` is implemented (the LlamaGen adapters' compiled decode layers); the other
    #: adapters refuse it in ``__init__``, naming ``model_name``
    compiled_layers: bool = False
    #: the model family's name in messages (default: the class name)
    model_name: str = ""
    # ``model.<key>`` of the runtime options the decoding code reads (``Runtime``)
    attention_kernel = _runtime_option("attention_kernel")
    tf32 = _runtime_option("tf32")
    pixel_rounding = _runtime_option("pixel_rounding")
    batch_invariant = _runtime_option("batch_invariant")
    row_block = _runtime_option("row_block")
    compile = _runtime_option("compile")
    #: How speculative Jacobi decoding initialises fresh window tokens on this model when
    #: ``decoder.drafter.init=auto`` (``baselines.jacobi.JacobiDrafter``): ``"random"`` (uniform over image
    #: codes) or ``"repeat_horizon"`` (copy the token one column to the left). Adapters declare the
    #: reference setting of their model family; the default is ``"random"``.
    sjd_init: str = "random"
    #: whether ``forward_block`` takes any grid cells as positions with any tree mask over its cache, so the
    #: spatial generation orders of ``coolsd.orders`` (ZipAR) can run on it
    spatial_orders: bool = False
    #: whether the input that predicts a new row's first token is a structural end-of-row token the adapter adds
    #: after the row's last cell (Lumina-mGPT): a spatial order's stand-in at that cell is then hidden from it,
    #: so the end-of-row token sees the row above as far as it is generated, as in the reference ports
    stand_in_is_end_of_row: bool = False

    def __init__(self, sampling: SamplingConfig | Mapping[str, Any] | None = None,
                 runtime: Runtime | None = None) -> None:
        """``sampling``: a ``SamplingConfig`` or its fields; ``runtime``: the adapter's ``Runtime`` (an adapter
        without ``compiled_layers`` refuses ``compile`` here, before any weight is read)."""
        super().__init__()
        if sampling is not None:
            self.sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(**dict(sampling))
        if runtime is not None:
            if not self.compiled_layers:
                eager_only(runtime.compile, self.model_name or type(self).__name__)
            self.runtime = runtime

    def place(self, device: torch.device, dtype: torch.dtype | None = None,
              float32: Iterable[nn.Module] = ()) -> None:
        """The end of an adapter's construction: eval mode, every weight on ``device`` (cast to ``dtype`` if
        given), the ``float32`` modules (VQ decoders) back in float32, CPU linears batch-invariant
        (``runtime.batch_invariant``, ``runtime.row_block``: ``batch_invariant_linears``) and the process's TF32
        setting (``runtime.tf32``: ``set_tf32``)."""
        self.eval()
        self.to(device=device, dtype=dtype)
        for module in float32:
            module.float()
        if self.runtime.batch_invariant:
            batch_invariant_linears(self, self.runtime.row_block)
        set_tf32(device, self.runtime.tf32)

    @property
    def num_image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_streams(self) -> int:
        """2 when classifier-free guidance is on (conditional + unconditional streams), else 1.

        Whether it is on follows ``sampling.cfg_rule`` (``coolsd.sampling``: ``not_one`` or LlamaGen's
        ``above_one``)."""
        return 2 if self.sampling.guided else 1

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @abc.abstractmethod
    def prefill(self, prompts: list[str], extra_slots: int = 64,
                streams: Streams | None = None) -> tuple[BlockCache, TargetOutput]:
        """Encode the prompts into a fresh cache; return it and the output at each last prefix position.

        ``extra_slots`` is the largest block a decoder will forward beyond the image tokens (tree nodes).
        The returned output has ``T == 1``: its logits (S, B, 1, V) give the distributions of image token 0.
        An image's outputs must not depend on the other prompts of the batch (left padding is masked).
        Adapters whose EAGLE drafters may be fed the whole prefix (``prefix: all``) also return
        ``prefix_hidden`` (S, B, C, H), the hidden states of every prefix slot. ``streams`` are the images'
        random streams (``coolsd.rng``), for adapters that sample part of the prefix (Lumina-mGPT's image
        header); others ignore them.
        """

    @abc.abstractmethod
    def forward_block(
        self,
        cache: BlockCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target over ``tokens`` (B, T) at image positions ``positions`` (B, T), appending a block.

        ``tree_mask`` (T, T) shared or (B, T, T) bool: node i attends to node j iff ``tree_mask[..., i, j]``
        (ancestors and itself); ``None`` = causal. Returns logits and hidden states of shape (S, B, T, ·).
        """

    def static_forward(self, cache: Any, tokens: torch.Tensor, positions: torch.Tensor,
                       tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """``forward_block`` for the static decode path (``coolsd.static``): over a
        ``coolsd.kv_cache.DeviceKVCache``, ``tokens`` and ``positions`` already on the device, called inside
        ``decode_context()``, with no host read and no value that depends on a tensor's contents; ``cache`` is the one
        ``static_cache`` built. Adapters that do not implement it are refused by the static path (``static_path``).
        Lumina-mGPT and Emu3 add their end-of-row slots to a block on the device (``coolsd.models.lumina_mgpt``
        ``EndOfRowBlocks``)."""
        raise NotImplementedError(f"{type(self).__name__} has no static forward")

    def static_cache(self, prefilled: Any, levels: tuple[int, ...] | None = None) -> Any:
        """The static path's cache of a batch size (``coolsd.kv_cache.DeviceKVCache``), built over the first batch's
        ``static_prefill`` cache and refilled by every later one (``load``, ``load_rows``); ``static_forward`` runs
        over it. ``levels``: the most nodes at each depth of the blocks the static loop will forward (depth 0: the
        last committed token; None: not known), for adapters that add structural slots to a block and size it from
        them. The default: ``DeviceKVCache.of`` (one slot per image token)."""
        return DeviceKVCache.of(prefilled)

    @property
    def static_path(self) -> bool:
        """Whether this adapter runs the static decode path (implements ``static_forward``)."""
        return type(self).static_forward is not ImageARModel.static_forward

    def static_prefill(self, prompts: list[str], extra_slots: int = 64,
                       streams: Streams | None = None) -> tuple[BlockCache, TargetOutput]:
        """``prefill`` for the static decode path, whose workspace of a batch size is refilled by every
        batch's prefill (``coolsd.static``): a cache of one capacity whatever the prompts. The default is
        ``prefill`` (a capacity that does not depend on the prompts: LlamaGen's condition tokens); adapters
        whose prompts have their own lengths pad them to a fixed width (Janus-Pro's
        ``model.prompt_capacity``)."""
        return self.prefill(prompts, extra_slots=extra_slots, streams=streams)

    def decode_context(self) -> contextlib.AbstractContextManager:
        """The context every decode or verify forward runs in (the attention kernel of ``model.attention_kernel``
        for the adapters that have it); the static path enters it around its steps."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of image tokens (T,) -> (T, H), as the target's first layer sees them."""

    @abc.abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output head: post-norm hidden states (..., H) -> image-code logits (..., V)."""

    @abc.abstractmethod
    def codebook(self) -> torch.Tensor:
        """The VQ codebook vectors (V, D), raw (un-normalised) weights."""

    @abc.abstractmethod
    def decode_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (N,) in raster order -> uint8 image (3, H, W)."""

    def decode_images(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (B, N) -> uint8 images (B, C, H, W); adapters may decode the batch in one pass."""
        return torch.stack([self.decode_image(row) for row in tokens])

    @torch.inference_mode()
    def teacher_force(self, prompts: list[str], tokens: torch.Tensor, prefix: str = "last") -> torch.Tensor:
        """Hidden states ``f_{-1} .. f_{N-1}`` (B, S, N+1, H) of whole token sequences (B, N) under ``prompts``.

        ``f_{-1}`` is the prefill's last hidden state. ``prefix="all"``: every prefix slot's hidden state
        instead of the last one only, (B, S, C+N, H) (the prefill's ``prefix_hidden``; the EAGLE drafter's
        ``prefix: all`` convention). Used to make drafter training data; adapters may override this
        per-sample default with a batched pass.
        """
        check_prefix(prefix)
        out = []
        n = tokens.shape[1]
        for prompt, seq in zip(prompts, tokens):
            cache, first = self.prefill([prompt], extra_slots=0)
            block = self.forward_block(cache, seq.to(self.device)[None], torch.arange(n, device=self.device)[None])
            out.append(torch.cat([self.prefix_states(first, prefix), block.hidden], dim=2)[:, 0])
        return torch.stack(out)

    def prefix_states(self, prefill: TargetOutput, prefix: str) -> torch.Tensor:
        """The prefix hidden states an EAGLE drafter is fed first: (S, B, 1, H) for ``last``, (S, B, C, H) for
        ``all``."""
        if prefix == "last":
            return prefill.hidden[:, :, -1:]
        if prefill.prefix_hidden is None:
            raise ValueError(f"drafter prefix=all needs the hidden states of every prefix slot, but "
                             f"{type(self).__name__}.prefill returns only the last one (prefix_hidden is None); "
                             "use drafter.prefix=last (head.prefix=last for scripts/train_drafter.py)")
        return prefill.prefix_hidden

    def probs(self, out: TargetOutput) -> torch.Tensor:
        """Guided next-token distributions (B, T, V) of a forward's output, through the shared pipeline."""
        return stream_probs(out.logits, self.sampling)

    def make_draft_layer(self, norm_eps: float | None = None) -> nn.Module:
        """One fresh decoder layer of this target's own kind: the body of an EAGLE drafter.

        Used by ``coolsd.drafters.eagle.EagleHead`` (the drafter is ``fc(concat[e(x_{t+1}), f_t])`` -> this
        layer -> the target's frozen ``head``). The layer is randomly initialised, as wide as the target
        (``hidden_size``), has no dropout and no final norm, and owns the target's position encoding.
        ``norm_eps`` overrides the epsilon of its norms (``None``: the target's own).

        The returned module must provide:

        * ``forward(h, positions, cache, mask) -> (R, T, H)``: ``h`` (R, T, H) are the fused inputs,
          R = the CFG streams of a batch of images at decode time (image-major, as the cache) or any batch
          of sequences in training; ``positions`` (T,) shared or (R, T) long are *pair positions*: the pair ``(f_t, x_{t+1})`` sits at position
          ``t``, the image index of the target input that produced ``f_t`` (``t = -1`` for the prefill's
          last hidden state, which is paired with ``x_0``). How a pair position maps onto the target's
          own encoding is the adapter's choice and must be documented there (LlamaGen: the 2-D RoPE of
          grid cell ``t + 1``). ``cache`` is a ``coolsd.kv_cache.StaticKVCache`` with one layer whose
          block the caller has opened with ``begin_block`` (the layer writes its K/V into layer 0), or
          ``None`` for a teacher-forced causal pass over whole sequences; ``mask`` is what ``begin_block``
          returned (``None`` = attend to every cached slot, or causal when ``cache`` is ``None``).
        * attributes ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
          ``intermediate_size`` (ints; the drafter sizes its cache and checkpoint config from them).
        * optionally ``from_eagle_keys(state) -> dict``: converts the parameters of a released EAGLE /
          LANTERN drafter's layer (HF-Llama names without the ``layers.0.`` prefix, e.g.
          ``self_attn.q_proj.weight``) into this module's ``state_dict`` keys; without it such checkpoints
          cannot be loaded for this adapter.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no EAGLE draft layer (make_draft_layer); use a drafter that needs "
            "none, e.g. drafter=<model>'s layer-skip or model drafter, or implement make_draft_layer"
        )
