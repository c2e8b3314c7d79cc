"""EAGLE-style feature drafter: the draft model of vanilla SD, LANTERN, LANTERN++ and COOL-SD.

The drafter predicts the target's next last-layer feature from the current one (EAGLE-1, Li et al. 2024,
arXiv 2401.15077; the LlamaGen variant of jadohu/LANTERN ``models/drafters/cnets_llamagen.py`` and
``models/ea_model_llamagen.py``, studied and rewritten here)::

    f̂_{t+1} = layer(fc(concat[e(x_{t+1}), f_t]))        q_{t+2} = pipeline(head(f̂_{t+1}))

``e`` and ``head`` are the target's frozen input embedding and output head (read from the target at call
time, not copied), ``fc`` is ``Linear(2H -> H)`` with a bias and ``layer`` is one decoder layer of the
target's own kind with the target's position encoding (``ImageARModel.make_draft_layer``). The pair
``(f_t, x_{t+1})`` sits at *pair position* ``t`` (the image index of the target input that produced
``f_t``; ``t = -1`` for the prefill's last hidden state, paired with ``x_0``).

With classifier-free guidance the drafter runs the conditional and unconditional streams as a batch of 2
(each fed the target's hidden states of that stream and the same token ids) and its two logit rows go
through the shared pipeline ``stream_probs``, so ``q`` is guided exactly like ``p``.

What the drafter is fed before the first image token is its **prefix convention** (``drafter.prefix``),
which must be the one it was trained with:

* ``last`` (default): only the prefill's last hidden state ``f_{-1}``, paired with ``x_0`` at pair
  position −1. The drafter's cache then holds ``N + extra_slots`` pairs. This project's own drafters are
  trained with it unless ``head.prefix=all`` is set; the shipped embedded drafter
  (``coolsd/assets/embedded/drafter``) was, and on a class-conditional LlamaGen (one condition slot) the
  two conventions coincide anyway.
* ``all``: the hidden states of **every prefix slot** (the prefill's ``prefix_hidden``; for LlamaGen T2I
  the 120 caption slots of both CFG streams, padded slots included, none masked in the drafter), paired
  with token id 0 except the last slot, which is paired with ``x_0``. Prefix slot ``j`` of ``C`` sits at
  pair position ``j − C`` (the last at −1); the draft layer rotates slots ``j < C − 1`` with the all-zero
  RoPE row and the last one with grid cell 0. This is what jadohu/LANTERN does with its released LlamaGen
  drafters (``EaModel.initialize_tree``: the target's hidden states of all 120 prefix slots with
  ``input_ids[:, 1:]`` = 119 zeros + the first image token at drafter positions 0..119 of a RoPE table
  with 119 zero rows; its training data prepend the same 119 zero ids), so ``hub:jadohu/llamagen_drafter``
  and ``hub:jadohu/llamagen2_drafter`` need ``prefix: all`` (``configs/drafter/llamagen_t2i_*.yaml``).
  The drafter's cache then holds ``C − 1`` more pairs.

Checkpoints: a directory with ``config.json`` + ``model.safetensors`` (this project's format, written by
``save_eagle`` / ``scripts/train_drafter.py``), or a released EAGLE / LANTERN drafter (``config.json`` +
``pytorch_model.bin`` with HF-Llama key names), or ``hub:<owner>/<repo>`` (e.g. ``hub:jadohu/llamagen_drafter``).

Example: ``python run.py drafter=eagle drafter.checkpoint=checkpoints/drafter_tiny``;
``python run.py model=llamagen_t2i_512 drafter=llamagen_t2i_512`` (LANTERN's drafter, ``prefix: all``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from coolsd import validate
from coolsd.drafters.base import Drafter, chain_valid, empty_draft
from coolsd.io import atomic_write_bytes
from coolsd.kv_cache import DeviceKVCache, StaticKVCache
from coolsd.models.base import (
    ImageARModel,
    attention_context,
    batch_invariant_linears,
    check_prefix,
    per_stream,
    to_rows,
)
from coolsd.models.checkpoints import MissingWeightsError, hub_file, load_state_dict
from coolsd.required_files import RequiredFile
from coolsd.rng import DRAFT, sample
from coolsd.sampling import finite_images, stream_probs
from coolsd.trees import DraftRows, Expansion, TreeShape, draft_dynamic_tree, draft_static_tree
from coolsd.types import Draft, TargetOutput, Verdict

FORMAT = "coolsd-eagle"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EAGLE_WEIGHTS = ("pytorch_model.bin", "model.safetensors")  # what released EAGLE/LANTERN drafters ship
HUB_PREFIX = "hub:"
# LANTERN cnets_llamagen.py: the image-token grid each drafter ``input_type`` hard-codes for its 2-D RoPE
LANTERN_GRID_CELLS = {"c2i": 576, "t2i": 256, "t2i2": 1024}
TRAIN_HINT = ("train one with `python scripts/train_drafter.py model=<model> out_dir=<dir>`, or use a "
              "released LANTERN drafter (LlamaGen-T2I): drafter.checkpoint=hub:jadohu/llamagen_drafter "
              "(stage I) or hub:jadohu/llamagen2_drafter (stage II)")


class EagleHead(nn.Module):
    """``fc`` + one target-kind decoder layer; uses the target's embedding and head at call time.

    ``own_embedding=True`` reserves a frozen embedding table of its own (released LANTERN LlamaGen
    drafters carry ``embed_tokens.weight``, initialised from the target's ``lm_head``, and were trained
    with it); otherwise ``e`` is ``target.embed``. Neither the target nor its embedding/head enter this
    module's ``state_dict``. ``prefix`` records the prefix convention the head is (to be) trained with
    (``last`` / ``all``, see the module doc; ``None``: unknown, as for released checkpoints); ``save_eagle``
    writes it into ``config.json`` and ``EagleDrafter`` refuses a different ``drafter.prefix``.
    """

    def __init__(
        self,
        target: ImageARModel,
        bias: bool = True,
        norm_eps: float | None = None,
        own_embedding: bool = False,
        init_seed: int = 0,
        prefix: str | None = "last",
    ) -> None:
        super().__init__()
        if prefix is not None:
            check_prefix(prefix)
        self.prefix = prefix
        self._target = (target,)  # a tuple, so the target is not registered as a submodule
        h = target.hidden_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            self.fc = nn.Linear(2 * h, h, bias=bias)
            self.layer = target.make_draft_layer(norm_eps=norm_eps)
        self.bias = bias
        self.norm_eps = norm_eps
        self.register_buffer("embedding", None)
        probe = target.embed(torch.zeros(1, dtype=torch.long, device=target.device))
        self.target_dtype = probe.dtype
        if own_embedding:
            self.embedding = torch.zeros(target.codebook_size, h, dtype=probe.dtype, device=probe.device)
        self.to(device=probe.device, dtype=probe.dtype)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.dtype = self.fc.weight.dtype  # read on every step without a torch call; refreshed by .to() etc.
        return out

    @property
    def target(self) -> ImageARModel:
        return self._target[0]

    def arch(self) -> dict[str, Any]:
        """The architecture fields of ``config.json`` (what a checkpoint must match to load)."""
        layer = self.layer
        return {
            "target": f"{type(self.target).__module__}.{type(self.target).__qualname__}",
            "hidden_size": int(layer.hidden_size),
            "num_heads": int(layer.num_heads),
            "num_kv_heads": int(layer.num_kv_heads),
            "head_dim": int(layer.head_dim),
            "intermediate_size": int(layer.intermediate_size),
            "vocab_size": int(self.target.codebook_size),
            "norm_eps": self.norm_eps,
            "bias": self.bias,
            "own_embedding": self.embedding is not None,
        }

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Frozen token embeddings (..., H) of image codes (...)."""
        if torch.is_grad_enabled():  # training; decoding runs in inference mode
            with torch.no_grad():
                return self.embed(tokens)
        if self.embedding is not None:
            return F.embedding(tokens, self.embedding)
        return self.target.embed(tokens)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pairs ``(f_t, x_{t+1})`` -> predicted next features ``f̂_{t+1}`` (R, T, H).

        ``features`` (R, T, H) are ``f_t``; ``tokens`` are ``x_{t+1}``: (T,) shared by every row, or (B, T)
        with R a multiple of B (the CFG streams of B images, image-major: row ``b·S + s``); ``positions``
        are the pair positions ``t``: (T,) shared or (B, T) likewise. ``cache``/``mask`` as in
        ``ImageARModel.make_draft_layer`` (``None``: teacher-forced causal pass).
        """
        rows = features.shape[0]
        dtype = self.dtype
        e = self.embed(tokens)  # (T, H) or (B, T, H)
        if (dtype if self.embedding is not None else self.target_dtype) != dtype:  # the own table has ours
            e = e.to(dtype)
        images = tokens.shape[0] if tokens.dim() == 2 else 0
        if not images:
            e = e.unsqueeze(0).expand(rows, -1, -1)
        elif images != rows:
            e = e.repeat_interleave(rows // images, dim=0)  # = stream_rows: the streams of an image adjacent
        if positions.dim() == 2 and positions.shape[0] != rows:
            positions = positions.repeat_interleave(rows // positions.shape[0], dim=0)
        if features.dtype != dtype:
            features = features.to(dtype)
        h = self.fc(torch.cat([e, features], dim=-1))  # (R, T, H)
        return self.layer(h, positions, cache, mask)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's frozen output head on predicted features (..., H) -> float logits (..., V)."""
        return self.target.head(features if self.dtype == self.target_dtype else features.to(self.target_dtype))


# -- checkpoints ------------------------------------------------------------------------------------------
def save_eagle(head: EagleHead, directory: str | os.PathLike, training: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``directory`` (each file atomically)."""
    from safetensors.torch import save

    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    atomic_write_bytes(directory / WEIGHTS_FILE, save(state, metadata={"format": FORMAT}))
    if head.prefix is None:
        raise ValueError("save_eagle needs the head's prefix convention (EagleHead.prefix: 'last' or 'all')")
    config = {"format": FORMAT, "version": 1, **head.arch(), "prefix": head.prefix, "training": training or {}}
    atomic_write_bytes(directory / CONFIG_FILE, (json.dumps(config, indent=2, default=str) + "\n").encode())
    return directory


def resolve_checkpoint(spec: str) -> tuple[Path, Path]:
    """``(config.json, weights file)`` of a checkpoint directory or a ``hub:<owner>/<repo>`` spec."""
    if spec.startswith(HUB_PREFIX):
        repo = spec[len(HUB_PREFIX):]
        config = Path(hub_file(repo, CONFIG_FILE))
        errors = []
        for name in EAGLE_WEIGHTS:
            try:
                return config, Path(hub_file(repo, name))
            except MissingWeightsError as err:
                errors.append(str(err))
        raise MissingWeightsError(f"EAGLE drafter weights of {repo} are not available: " + " | ".join(errors))
    directory = Path(spec).expanduser()
    config = directory / CONFIG_FILE
    if not config.is_file():
        hint = TRAIN_HINT
        if directory.name.startswith("drafter_"):  # checkpoints/drafter_<model>: name the exact command
            hint = (f"train it with `python scripts/train_drafter.py model={directory.name[len('drafter_'):]}` "
                    f"(written to {spec}); or " + TRAIN_HINT.split(", or ", 1)[1])
        raise MissingWeightsError(f"EAGLE drafter checkpoint not found: {config} (looked in "
                                  f"{directory.resolve()}); {hint}")
    for name in (WEIGHTS_FILE, *EAGLE_WEIGHTS):
        if (directory / name).is_file():
            return config, directory / name
    raise MissingWeightsError(f"EAGLE drafter weights not found: neither {directory / WEIGHTS_FILE} nor "
                              f"{directory / EAGLE_WEIGHTS[0]} exists; {TRAIN_HINT}")


#: the draft layer's sizes a checkpoint's ``config.json`` must match (``arch_mismatch``; ``EagleHead.arch``)
FIT_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def arch_mismatch(config: dict[str, Any], sizes: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint, target)} where a drafter's ``config.json`` does not fit the target's draft layer, whose
    ``sizes`` are ``FIT_FIELDS`` of ``EagleHead.arch`` and ``num_image_tokens``: this project's format compares
    ``FIT_FIELDS``; a released EAGLE / LANTERN drafter (HF-Llama names) its sizes, its single layer and the
    RoPE grid LANTERN trained it on (``input_type``). Read from the config alone (``eval.run.preflight``
    checks a run's drafters with it before the target is built)."""
    if config.get("format") == FORMAT:
        return {k: (config.get(k), sizes[k]) for k in FIT_FIELDS if config.get(k) != sizes[k]}
    heads = config.get("num_attention_heads")
    theirs = {"hidden_size": config.get("hidden_size"), "num_heads": heads,
              "num_kv_heads": config.get("num_key_value_heads") or heads,
              "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size")}
    diff = {k: (v, sizes[k]) for k, v in theirs.items() if v != sizes[k]}
    if config.get("num_hidden_layers", 1) != 1:
        diff["num_hidden_layers"] = (config["num_hidden_layers"], 1)
    cells = LANTERN_GRID_CELLS.get(config.get("input_type"))  # the RoPE grid the drafter was trained with
    if cells is not None and cells != sizes["num_image_tokens"]:
        diff["input_type"] = (f"{config['input_type']} ({cells} image tokens)", sizes["num_image_tokens"])
    return diff


def head_sizes(head: EagleHead) -> dict[str, Any]:
    """The sizes ``arch_mismatch`` compares a checkpoint with, of a head built for its target."""
    arch = head.arch()
    return {**{k: arch[k] for k in FIT_FIELDS}, "num_image_tokens": head.target.num_image_tokens}


def _eagle_to_ours(head: EagleHead, config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict:
    """Map a released EAGLE / LANTERN drafter (HF-Llama key names) onto ``head``'s parameters."""
    layer = head.layer
    if not hasattr(layer, "from_eagle_keys"):
        raise ValueError(f"{type(layer).__name__} (draft layer of {type(head.target).__name__}) cannot read "
                         "EAGLE/LANTERN checkpoints (no from_eagle_keys); " + TRAIN_HINT)
    diff = arch_mismatch(config, head_sizes(head))
    if diff:
        raise ValueError("the EAGLE checkpoint's architecture does not match this target's draft layer "
                         f"(field: checkpoint vs target) {diff}; " + TRAIN_HINT)
    prefix = "layers.0."
    layer_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    out = {f"layer.{k}": v for k, v in layer.from_eagle_keys(layer_state).items()}
    for key in ("fc.weight", "fc.bias"):
        if key in state:
            out[key] = state[key]
    if "embed_tokens.weight" in state:
        out["embedding"] = state["embed_tokens.weight"]
    known = {"fc.weight", "fc.bias", "embed_tokens.weight"}
    stray = [k for k in state if not k.startswith(prefix) and k not in known]
    if stray:
        raise ValueError(f"unexpected keys in the EAGLE checkpoint: {stray[:8]}")
    return out


def released_prefix(config: dict[str, Any]) -> str | None:
    """The prefix convention a released EAGLE / LANTERN drafter was trained with, read from its ``config.json``:
    LANTERN's text-to-image LlamaGen drafters (``input_type`` ``t2i`` / ``t2i2``) were trained on every caption
    slot (``all``, the module doc); ``None`` where the config does not say (then ``drafter.prefix`` decides;
    on a class-conditional model with one condition slot the two conventions coincide)."""
    return "all" if config.get("input_type") in ("t2i", "t2i2") else None


def load_eagle(target: ImageARModel, checkpoint: str) -> EagleHead:
    """Build an ``EagleHead`` for ``target`` from a checkpoint directory or ``hub:`` spec (see module doc)."""
    config_path, weights_path = resolve_checkpoint(checkpoint)
    config = json.loads(config_path.read_text())
    state = load_state_dict(weights_path, nested_keys=("model", "state_dict"))
    if config.get("format") == FORMAT:
        head = EagleHead(target, bias=config["bias"], norm_eps=config["norm_eps"],
                         own_embedding=config["own_embedding"],
                         prefix=config.get("prefix", "last"))  # written before the option existed: last
        mismatch = arch_mismatch(config, head_sizes(head))
        if mismatch:
            raise ValueError(f"drafter checkpoint {checkpoint} was trained for another architecture "
                             f"(field: checkpoint vs target) {mismatch}; " + TRAIN_HINT)
    else:
        head = EagleHead(target, bias="fc.bias" in state, norm_eps=config.get("rms_norm_eps"),
                         own_embedding="embed_tokens.weight" in state, prefix=released_prefix(config))
        state = _eagle_to_ours(head, config, state)
    expected = {k: v.shape for k, v in head.state_dict().items()}
    problems = [f"{k}: missing" for k in expected if k not in state]
    problems += [f"{k}: unexpected" for k in state if k not in expected]
    problems += [f"{k}: shape {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items()
                 if k in state and state[k].shape != s]
    if problems:
        raise ValueError(f"drafter checkpoint {checkpoint} does not fit {type(target).__name__}'s draft "
                         f"head: {problems[:8]}; " + TRAIN_HINT)
    head.load_state_dict(state, strict=True)
    return head


# -- the drafter ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftStep:
    """One drafter forward: predicted features (S, B, T, H), guided draft distributions (B, T, V) and
    whether each image's logits were finite (B,)."""

    features: torch.Tensor
    q: torch.Tensor
    finite: torch.Tensor
    rows: torch.Tensor | None = None  # the features as cache rows (B·S, T, H) (what the next step feeds), if kept


@dataclass(frozen=True)
class StaticPending:
    """The static path's drafter state of one batch size, in buffers updated in place: the drafter cache, the
    pending pairs (the target's features of the committed tokens not fed yet, padded to the most one verify
    commits) with each image's count and first pair position, and the cache lengths after the latest feed."""

    cache: DeviceKVCache
    features: torch.Tensor  # (S, B, K, H)
    tokens: torch.Tensor  # (B, K)
    count: torch.Tensor  # (B,)
    start: torch.Tensor  # (B,)
    after: torch.Tensor  # (B,)
    columns: torch.Tensor  # (K,) 0 .. K − 1

    @classmethod
    def new(cls, cache: StaticKVCache, streams: int, batch: int, width: int, hidden: int,
            dtype: torch.dtype) -> "StaticPending":
        device = cache.k.device
        long = dict(dtype=torch.long, device=device)
        return cls(cache=DeviceKVCache.of(cache), features=torch.zeros(streams, batch, width, hidden, dtype=dtype,
                                                                       device=device),
                   tokens=torch.zeros(batch, width, **long), count=torch.zeros(batch, **long),
                   start=torch.zeros(batch, **long), after=torch.zeros(batch, **long),
                   columns=torch.arange(width, device=device))


class EagleDrafter(Drafter):
    """Chain or tree drafting with an ``EagleHead`` and its own one-layer KV cache, for a batch of images
    (cache rows = the CFG streams of every image).

    State between iterations, per image: the *pending* pairs, i.e. the target's hidden states of committed
    tokens that the drafter cache has not consumed yet, paired with the next committed token ids. ``propose``
    feeds them as one block (padded to the longest image's; each image keeps its own count); later steps
    feed the drafter's own predicted features (EAGLE), one step per chain token or one ``expand`` per tree
    level (``coolsd.trees``). ``observe`` rolls back every speculative entry and queues the verify block's
    hidden states of the committed tokens (``out.hidden`` of the last committed token and the accepted
    nodes, paired with the accepted tokens and ``next_token``), as LANTERN's ``stable_kv`` does.
    ``Draft.forwards`` counts ``EagleHead`` forwards.

    ``prefix``: the prefix convention (module doc): ``last`` (default) or ``all`` (LANTERN's released
    LlamaGen drafters). ``begin`` queues the prefix pairs it implies as every image's first pending block,
    so the first ``propose`` feeds them in one forward, exactly as LANTERN's first ``topK_genrate`` call does.
    """

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The checkpoint ``resolve_checkpoint`` reads: a ``hub:<repo>`` (config.json + weights) or a folder."""
        spec = cfg.get("checkpoint")
        if not spec:
            return []
        spec = str(spec)
        weights = "|".join((WEIGHTS_FILE, *EAGLE_WEIGHTS))
        if spec.startswith(HUB_PREFIX):
            return [RequiredFile("EAGLE drafter", repo_id=spec[len(HUB_PREFIX):],
                                 patterns=(CONFIG_FILE, *EAGLE_WEIGHTS), must_have=(CONFIG_FILE, weights))]
        name = Path(spec).name
        hint = (f"python scripts/train_drafter.py model={name[len('drafter_'):]}   (writes {spec}); or "
                + TRAIN_HINT.split(", or ", 1)[1]) if name.startswith("drafter_") else TRAIN_HINT
        return [RequiredFile("EAGLE drafter", local=spec, must_have=(CONFIG_FILE, weights), manual=hint)]

    def __init__(
        self,
        target: ImageARModel,
        checkpoint: str | None = None,
        head: EagleHead | None = None,
        extra_slots: int = 64,
        prefix: str = "last",
    ) -> None:
        if (checkpoint is None) == (head is None):
            raise ValueError("EagleDrafter needs exactly one of drafter.checkpoint (a directory written by "
                             "scripts/train_drafter.py, or hub:<owner>/<repo>) and head; " + TRAIN_HINT)
        validate.integer("drafter.extra_slots", extra_slots, minimum=1)  # >= the longest draft or tree block
        check_prefix(prefix)
        self.target = target
        self.head = load_eagle(target, checkpoint) if head is None else head
        if head is None and target.batch_invariant:  # a loaded head only decodes (one passed in may train)
            batch_invariant_linears(self.head, target.row_block)
        if self.head.prefix is not None and self.head.prefix != prefix:
            raise ValueError(f"the drafter {checkpoint or 'head'} was trained with prefix={self.head.prefix!r} "
                             f"but drafter.prefix={prefix!r}; set drafter.prefix={self.head.prefix}")
        self.prefix = prefix
        self.extra_slots = extra_slots
        self.cache: StaticKVCache | None = None
        self.streams = None
        self.pending_features: torch.Tensor | None = None  # (S, B, K, H), valid up to pending_count
        self.pending_tokens: torch.Tensor | None = None  # (B, K)
        self.pending_shape: tuple[int, int] = (0, 0)  # pending_tokens.shape, kept on the host
        self.device: torch.device | None = None  # the images' device (set by begin)
        self.pending_count: list[int] = []
        self.pending_start: list[int] = []  # pair position of each image's first pending pair
        self.fed: list[int] | None = None  # pending pairs consumed by the latest propose (None: no forward)
        self.after_feed: list[int] = []  # cache lengths right after the pending block
        self.node_features: torch.Tensor | None = None  # tree drafting: outputs of the latest request
        self.in_step = False  # whether the pending pairs were checked against the loop's positions
        self._static: dict[tuple[int, int, int], StaticPending] = {}  # static path: per (batch, prefix, depth)
        self.static: StaticPending | None = None  # the current batch's

    def new_cache(self, batch: int, prefix_pairs: int = 1, room: int | None = None) -> StaticKVCache:
        """A cache for ``batch`` images: ``prefix_pairs`` prefix pairs (1 with ``prefix: last``, C with ``all``),
        the pairs of image tokens 1..N−1 and ``room`` for the speculative ones (a pending block padded to the
        longest image's, then a draft or tree; None: ``2 · extra_slots``)."""
        layer, weight = self.head.layer, self.head.fc.weight
        return StaticKVCache(
            num_layers=1,
            batch=batch,
            streams=self.target.num_streams,
            num_heads=layer.num_kv_heads,
            max_len=prefix_pairs + self.target.num_image_tokens + (2 * self.extra_slots if room is None else room),
            head_dim=layer.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    @torch.inference_mode()
    def begin(self, prompts, prefill: TargetOutput, first_tokens: torch.Tensor, streams) -> None:
        b = first_tokens.shape[0]
        features = self.target.prefix_states(prefill, self.prefix)  # (S, B, C, H); C = 1 for prefix=last
        c = features.shape[2]
        self.cache = self.new_cache(b, prefix_pairs=c)
        self.streams = streams
        self.pending_features = features
        # prefix slots j < C-1 pair with token id 0 (LANTERN's zero ids), the last slot (f_{-1}) with x_0
        self.pending_tokens = torch.cat([first_tokens.new_zeros(b, c - 1), first_tokens.reshape(b, 1)], dim=1)
        self.pending_shape = (b, c)
        self.device = first_tokens.device
        self.pending_count = [c] * b
        self.pending_start = [-c] * b  # prefix slot j sits at pair position j - C
        self.fed = None
        self.in_step = False

    def select(self, images) -> None:
        index = torch.tensor(list(images), device=self.pending_tokens.device)
        self.pending_features = self.pending_features[:, index]
        self.pending_tokens = self.pending_tokens[index]
        self.pending_shape = (len(images), self.pending_shape[1])
        self.pending_count = [self.pending_count[i] for i in images]
        self.pending_start = [self.pending_start[i] for i in images]
        self.cache.select(images)
        self.in_step = False

    @torch.inference_mode()
    def step(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        feature_rows: torch.Tensor | None = None,
        shape: tuple[int, int] | None = None,
    ) -> DraftStep:
        """One head forward over pairs appended to the cache as a new block (reusable by tree drafting).

        ``features`` (S, B, T, H), ``tokens`` (B, T), ``positions`` (B, T) pair positions, ``tree_mask``
        (T, K) or (B, T, K) over each image's last K cache slots as in ``StaticKVCache.begin_block``
        (``None``: causal). The block stays in the cache until ``observe`` rolls it back. ``rows`` (B,): the
        draft distribution of one row per image only (q is (B, 1, V)); feeding the pending pairs needs no
        more, and the head over the vocabulary is the costly part on large codebooks. ``feature_rows``: the
        same features as cache rows (B·S, T, H) (a previous step's ``DraftStep.rows``), used instead.
        ``shape``: ``tokens.shape`` when the caller knows it (one torch call less).
        """
        with attention_context(getattr(self.target, "attention_kernel", "auto")):  # the target's decode kernel
            return self.step_in_context(features, tokens, positions, tree_mask, rows, feature_rows, shape)

    def step_in_context(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                        tree_mask: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                        feature_rows: torch.Tensor | None = None,
                        shape: tuple[int, int] | None = None) -> DraftStep:
        """``step`` with the caller inside the target's decode context (the static path's steps)."""
        s = self.target.num_streams
        b, t = tokens.shape if shape is None else shape
        mask = self.cache.begin_block(t, tree_mask)
        out_rows = self.head(to_rows(features) if feature_rows is None else feature_rows, tokens, positions,
                             self.cache, mask)  # (B·S, T, H)
        f_hat = per_stream(out_rows, s)  # (S, B, T, H)
        if rows is not None:
            h = out_rows.shape[-1]
            f_hat_q = f_hat.gather(2, rows.view(1, b, 1, 1).expand(s, b, 1, h))
        else:
            f_hat_q = f_hat
        logits = self.head.logits(f_hat_q)  # (S, B, T', V)
        return DraftStep(features=f_hat, q=stream_probs(logits, self.target.sampling), finite=finite_images(logits),
                         rows=out_rows)

    def _feed_pending(self) -> DraftStep:
        """Run every image's pending pairs (the last one holds its last committed token) as one block and keep
        each image's own count; returns the last pair's predicted feature and draft distribution per image."""
        device = self.device
        counts = self.pending_count
        b, width = shape = self.pending_shape  # the pending block, padded to the longest image's (or wider)
        positions = torch.tensor([[s0 + j for j in range(width)] for s0 in self.pending_start], device=device)
        last = torch.tensor([c - 1 for c in counts], device=device)
        out = self.step(self.pending_features, self.pending_tokens, positions, rows=last, shape=shape)
        self.cache.keep(counts)
        self.fed, self.after_feed = list(counts), list(self.cache.lengths)
        if min(counts) == width:  # every image's last pair is the block's last: a view (the next step copies it)
            return DraftStep(features=out.features[:, :, width - 1:], q=out.q, finite=out.finite,
                             rows=out.rows[:, width - 1:])  # (S, B, 1, H), (B·S, 1, H)
        s, b, _, h = out.features.shape
        root = out.features.gather(2, last.view(1, b, 1, 1).expand(s, b, 1, h))  # (S, B, 1, H)
        return DraftStep(features=root, q=out.q, finite=out.finite)

    def iteration_draws(self, depth, tree):
        return ((DRAFT, depth),) if tree is None and depth else ()

    @torch.inference_mode()
    def propose(self, last_tokens, t, limit, depth, tree=None) -> Draft:
        ends = [s + c for s, c in zip(self.pending_start, self.pending_count)]  # = t − 1 of each image
        if not self.in_step:  # checked once per batch (after begin and select): a host sync
            expected = (t - 1).tolist()
            if ends != expected:
                raise RuntimeError(f"EagleDrafter out of step: pending pairs end at {ends}, the loop drafts after "
                                   f"image indices {expected}")
            self.in_step = True
        self.fed = None
        b = len(ends)
        if depth == 0:
            return empty_draft(b, self.target.codebook_size, self.device)
        if tree is not None:
            if isinstance(tree, TreeShape):
                return draft_static_tree(tree, t - 1, limit, self._expand, self.streams, t)
            return draft_dynamic_tree(tree, t - 1, limit, self._expand)
        out = self._feed_pending()
        finite = [out.finite]
        drafted, qs = [], []
        u = self.streams.uniform(t, DRAFT, depth).split(1, dim=1)  # L × (B, 1)
        if depth > 1:  # x_{t+i-1} pairs at t+i-2: (B, 1) each
            positions = torch.tensor([[e + i for i in range(depth - 1)] for e in ends], device=self.device).split(1, 1)
        for i in range(depth):
            if i:
                out = self.step(out.features, drafted[-1], positions[i - 1], feature_rows=out.rows, shape=(b, 1))
                finite.append(out.finite)
            drafted.append(sample(out.q, u[i]))  # q (B, 1, V) -> (B, 1)
            qs.append(out.q)
        return Draft(tokens=torch.cat(drafted, 1), q=torch.cat(qs, 1), valid=chain_valid(limit, depth),
                     forwards=limit.clamp(max=depth),  # read in the loop's host sync
                     finite=finite[0] if depth == 1 else torch.stack(finite).all(0))

    def _expand(self, request: Expansion) -> DraftRows:
        """Tree drafting (``coolsd.trees``): draft distributions (B, F, V) of the requested nodes' children.

        A node's pair is (its parent's predicted feature, its token) at pair position = its image position
        − 1; the root request feeds the pending pairs instead (the root is the last committed token).
        """
        return self._expand_by(request, self._feed_pending, self.step)

    def _expand_by(self, request: Expansion, feed: Callable[[], Any], step: Callable[..., Any]) -> DraftRows:
        """``_expand`` with the path's pending-pair feed and draft step (eager: ``_feed_pending``, ``step``)."""
        out = feed() if request.root else None
        if out is None:
            s, b, _, h = self.node_features.shape
            f = request.parent_index.shape[1]
            features = self.node_features.gather(2, request.parent_index.view(1, b, f, 1).expand(s, b, f, h))
            out = step(features, request.tokens, request.positions - 1, tree_mask=request.mask)
        self.node_features = out.features
        return DraftRows(q=out.q, finite=out.finite)

    @torch.inference_mode()
    def observe(self, out: TargetOutput, p: torch.Tensor, draft: Draft, verdict: Verdict) -> None:
        n = verdict.num_accepted  # (B,)
        accepted = verdict.accepted if verdict.accepted is not None else tuple(n.tolist())  # host counts
        b = len(accepted)
        device = self.device
        counts = [a + 1 for a in accepted]
        width = max(counts) if b else 1
        if draft.is_chain:  # the committed rows are the block's first ones (the verify input's order)
            features = out.hidden[:, :, :width]  # (S, B, W, H): f of the committed tokens
            tokens = draft.tokens[:, : width - 1]
        else:
            path = verdict.path[:, : width - 1]
            rows = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=path.device), path + 1], dim=1)  # (B, W)
            s, _, _, h = out.hidden.shape
            features = out.hidden.gather(2, rows.view(1, b, width, 1).expand(s, b, width, h))
            tokens = draft.tokens.gather(1, path)
        if min(counts) == width:  # every image accepted as many: its next token closes the row
            tokens = torch.cat([tokens, verdict.next_token[:, None]], 1)  # (B, W)
        else:
            tokens = torch.cat([tokens, torch.zeros(b, 1, dtype=torch.long, device=device)], 1)
            tokens[list(range(b)), list(accepted)] = verdict.next_token  # (B, W): accepted tokens, then next_token
        if self.fed is None:  # no forward ran: queue behind what is still pending (one image at a time)
            self._append_pending(features, tokens, counts)
            return
        self.cache.rollback(self.after_feed)  # drop the drafter's speculative entries
        self.pending_start = [s0 + k for s0, k in zip(self.pending_start, self.fed)]
        self.pending_features, self.pending_tokens, self.pending_count = features, tokens, counts
        self.pending_shape = (b, width)
        self.fed = None

    # -- the static decode path (coolsd.static): chains of a fixed length, pending pairs in fixed buffers -----
    static_path = True

    def static_begin(self, prefill: TargetOutput, first_tokens: torch.Tensor, streams, depth: int,
                     room: int | None = None) -> None:
        """Persistent buffers for this batch size (``StaticPending``), refilled: an empty drafter cache, the prefix
        pairs but the last fed at once (none with ``prefix: last``), the last one pending with ``x_0``."""
        b = first_tokens.shape[0]
        features = self.target.prefix_states(prefill, self.prefix)  # (S, B, C, H)
        s, _, c, h = features.shape
        key = (b, c, depth, room)
        state = self._static.get(key)
        if state is None:
            state = self._static[key] = StaticPending.new(self.new_cache(b, prefix_pairs=c, room=room), s, b,
                                                          depth + 1, h,
                                                          features.dtype)
        self.static = state
        self.cache = state.cache
        self.streams = streams
        self.device = first_tokens.device
        state.cache.lengths.zero_()
        with attention_context(getattr(self.target, "attention_kernel", "auto")):
            if c > 1:  # prefix slot j at pair position j − C, with token id 0 (LANTERN's zero ids)
                positions = torch.arange(-c, -1, device=self.device).expand(b, -1)
                self.step_in_context(features[:, :, : c - 1], first_tokens.new_zeros(b, c - 1), positions)
                state.cache.keep(c - 1)
        state.features.zero_()
        state.features[:, :, 0] = features[:, :, c - 1]
        state.tokens.zero_()
        state.tokens[:, 0] = first_tokens
        state.count.fill_(1)
        state.start.fill_(-1)

    def static_refill(self, rows: torch.Tensor, prefill: TargetOutput, first_tokens: torch.Tensor, streams,
                      depth: int, room: int | None = None) -> None:
        """``static_begin`` for the images of ``rows`` only (``Drafter.static_refill``): their drafter cache rows
        emptied (with ``prefix: all``, the new images' prefix pairs but the last fed through a cache of their own
        and copied in), the last prefix pair pending with ``x_0``, in the current batch's buffers."""
        state = self.static
        r = first_tokens.shape[0]
        features = self.target.prefix_states(prefill, self.prefix)  # (S, R, C, H)
        s, _, c, h = features.shape
        if state is None or self._static.get((state.tokens.shape[0], c, depth, room)) is not state:
            raise RuntimeError("EagleDrafter.static_refill: no static batch of this shape is running (call "
                               "static_begin first, with the same prefix, depth and room)")
        self.streams = streams
        state.cache.lengths.index_fill_(0, rows, 0)
        if c > 1:  # the prefix pairs as static_begin feeds them, through a cache of the R images, then copied in
            own = DeviceKVCache.like(self.new_cache(r, prefix_pairs=c, room=room))
            positions = torch.arange(-c, -1, device=self.device).expand(r, -1)
            try:
                self.cache = own
                with attention_context(getattr(self.target, "attention_kernel", "auto")):
                    self.step_in_context(features[:, :, : c - 1], first_tokens.new_zeros(r, c - 1), positions)
                own.keep(c - 1)
            finally:
                self.cache = state.cache
            state.cache.load_rows(rows, own)
        pending = torch.zeros(s, r, state.features.shape[2], h, dtype=state.features.dtype, device=self.device)
        pending[:, :, 0] = features[:, :, c - 1]  # (S, R, K, H)
        state.features.index_copy_(1, rows, pending)
        tokens = torch.zeros(r, state.tokens.shape[1], dtype=torch.long, device=self.device)
        tokens[:, 0] = first_tokens
        state.tokens.index_copy_(0, rows, tokens)
        state.count.index_fill_(0, rows, 1)
        state.start.index_fill_(0, rows, -1)

    def _static_feed(self) -> DraftStep:
        """The pending block of the static path (its fixed width, each image's own count): the root's feature
        (S, B, 1, H) and draft distribution (B, 1, V); the cache keeps each image's pending pairs."""
        state = self.static
        b, width = state.tokens.shape
        last = (state.count - 1).clamp_min(0)  # (B,) the last pending pair (a finished image has none)
        out = self.step_in_context(state.features, state.tokens, state.start[:, None] + state.columns, rows=last,
                                   shape=(b, width))
        self.cache.keep(state.count)
        state.after.copy_(self.cache.lengths)
        s, _, _, h = out.features.shape
        return DraftStep(features=out.features.gather(2, last.view(1, b, 1, 1).expand(s, b, 1, h)), q=out.q,
                         finite=out.finite)

    def _static_expand(self, request: Expansion) -> DraftRows:
        """``_expand`` of the static path: the root request feeds the fixed pending block."""
        return self._expand_by(request, self._static_feed, self.step_in_context)

    def static_propose(self, last_tokens, t, limit, depth, tree=None, cache=None) -> Draft:
        """The pending block, then ``depth − 1`` one-token steps of a chain, or every level of a tree."""
        if tree is not None:
            return self.static_tree_draft(tree, t, limit, cache)
        state = self.static
        b = state.tokens.shape[0]
        out = self._static_feed()
        ends = state.start + state.count  # (B,) = t − 1 of an image still decoding
        u = self.streams.uniform(t, DRAFT, depth)  # (B, L)
        drafted, qs, finite = [], [], [out.finite]
        for i in range(depth):
            if i:  # x_{t+i-1} pairs at t + i − 2
                out = self.step_in_context(out.features, drafted[-1], (ends + (i - 1))[:, None],
                                           feature_rows=out.rows, shape=(b, 1))
                finite.append(out.finite)
            drafted.append(sample(out.q, u[:, i: i + 1]))  # q (B, 1, V) -> (B, 1)
            qs.append(out.q)
        return Draft(tokens=torch.cat(drafted, 1), q=torch.cat(qs, 1), valid=chain_valid(limit, depth),
                     forwards=limit.clamp(max=depth), finite=torch.stack(finite).all(0))

    def static_observe(self, out, p, draft, verdict, active) -> None:
        """Drop the speculative entries; the verify block's rows of the committed tokens (the last committed
        token and the accepted path) become the next pending block, with the accepted tokens and the next one."""
        state = self.static
        n = verdict.num_accepted  # (B,)
        self.cache.rollback(state.after)
        state.start.add_(torch.where(active, state.count, 0))
        b, width = state.tokens.shape
        path = verdict.path[:, : width - 1]  # (B, W − 1): a chain's is 0 .. L − 1
        if draft.is_chain:  # the committed rows are the block's first ones
            state.features.copy_(out.hidden[:, :, :width])
            accepted = draft.tokens[:, : width - 1]
        else:
            rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1)  # (B, W)
            s, _, _, h = out.hidden.shape
            state.features.copy_(out.hidden.gather(2, rows.view(1, b, width, 1).expand(s, b, width, h)))
            accepted = draft.tokens.gather(1, path)
        tokens = torch.cat([accepted, accepted[:, :1]], 1).scatter(1, n[:, None], verdict.next_token[:, None])
        state.tokens.copy_(tokens)  # the accepted drafts, then next_token, then stale slots
        state.count.copy_(torch.where(active, n + 1, 0))

    def _append_pending(self, features: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        old = self.pending_count
        width = max(a + c for a, c in zip(old, counts))
        s, b, _, h = features.shape
        feat = self.pending_features.new_zeros(s, b, width, h)
        tok = self.pending_tokens.new_zeros(b, width)
        for i, (a, c) in enumerate(zip(old, counts)):
            feat[:, i, :a], feat[:, i, a: a + c] = self.pending_features[:, i, :a], features[:, i, :c]
            tok[i, :a], tok[i, a: a + c] = self.pending_tokens[i, :a], tokens[i, :c]
        self.pending_features, self.pending_tokens = feat, tok
        self.pending_shape = (b, width)
        self.pending_count = [a + c for a, c in zip(old, counts)]
