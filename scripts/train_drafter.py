"""Train an EAGLE drafter for a target model by self-distillation: data generation, training, validation.

1. **Data** (``stage=data`` or ``all``): for each sample, a token sequence (``distill.source=self_distill``:
   sampled by the target itself with the AR decoder under the prompts of the ``data`` group, e.g.
   ``data=file data.path=prompts.txt``; ``images``: codes of real images, given as codes or encoded
   through the adapter's VQ) is teacher-forced through the target (prefill + one forward over all
   image tokens) and the last-layer hidden states of every CFG stream are stored: ``hidden`` (S, N+1, H)
   = ``f_{-1} .. f_{N-1}``, or (S, C+N, H) with every condition slot when ``head.prefix=all`` (the EAGLE
   drafter's prefix convention, ``coolsd.drafters.eagle``: LANTERN's, whose training data prepend 119 zero
   ids to the codes of LlamaGen T2I's 120 caption slots). Samples go into safetensors shards written atomically; ``manifest.json``
   lists the finished shards and a rerun skips them (resumable; sample ``i`` always uses seed
   ``distill.seed + i``, so a regenerated shard is identical).
2. **Training** (``stage=train`` or ``all``): pairs ``(f_t, x_{t+1}) -> f_{t+1}`` with EAGLE's loss
   ``SmoothL1(f̂, f) + p_w·CE(softmax(head(f)), head(f̂))`` (p_w = 0.1), AdamW, linear warm-up then cosine,
   gradient accumulation, gradient clipping, bf16 autocast on CUDA, checkpoints every
   ``train.checkpoint_every`` steps and ``resume=true``; multi-GPU through ``torchrun`` (DDP). With CFG a
   sequence is trained on its unconditional stream with probability ``train.uncond_prob`` (LANTERN: 0.1).
   With ``head.prefix=all`` the head is fed the prefix pairs too (slot ``j`` with token id 0, the last
   with ``x_0``, at pair positions ``j − C``), as it will be when decoding; the loss covers the pairs
   ``t = −1 .. N−2`` as with ``last`` (LANTERN also leaves out ``t = −1``, whose prediction drafts
   ``x_1``; here it is trained).
3. **Validation**: teacher-forced agreement ``1 − TV(p, q)`` on held-out shards and the real mean accepted
   length of ``Decoder('sd', ExactRule(), draft_len)`` with this drafter on held-out prompts and seeds,
   before training and after. Step checkpoints carry the "before" metrics, so a resumed run reports and
   writes the original ones (``training.before`` in the drafter's ``config.json``).

Written after jadohu/LANTERN ``entrypoints/train_drafter/{main,data_utils}.py`` and
``entrypoints/generate_train_data.py`` (EAGLE's recipe), without their quirks: here gradient accumulation
accumulates and the warm-up length is set in steps.

The trained drafter is written to ``out_dir`` (``config.json`` + ``model.safetensors``) and is used with
``python run.py drafter=eagle drafter.checkpoint=<out_dir>``.

Examples::

    python scripts/train_drafter.py model=tiny
    python scripts/train_drafter.py model=tiny stage=data distill.num_samples=4096
    torchrun --nproc_per_node=8 scripts/train_drafter.py model=<m> stage=train resume=true
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import CONFIG_FILE, EagleDrafter, EagleHead, save_eagle
from coolsd.io import atomic_write_bytes, remove_stale_temps
from coolsd.models.base import ImageARModel, check_prefix
from coolsd.models.checkpoints import load_state_dict
from coolsd.fingerprint import file_digest, weights_digest
from coolsd.types import pooled_accepted_length
from coolsd.sampling import stream_probs

DATA_FORMAT = "coolsd-drafter-data"
MANIFEST = "manifest.json"
SOURCES = ("self_distill", "images")
STAGES = ("all", "data", "train")
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WANDB_MODES = ("online", "offline", "disabled")


# -- settings (one frozen record per config section, so a typo in YAML fails) ---------------------------
@dataclass(frozen=True)
class DistillConfig:
    """``distill.*``: where training samples live and how they are made (see the module docstring)."""

    dir: str | None = None
    source: str = "self_distill"
    num_samples: int = 256
    shard_size: int = 32
    seed: int = 0
    storage_dtype: str = "bfloat16"
    images_path: str | None = None
    val_shards: int = 1

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"distill.source must be one of {SOURCES}, got {self.source!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"distill.storage_dtype must be one of {sorted(STORAGE_DTYPES)}, "
                             f"got {self.storage_dtype!r}")
        if self.num_samples < 1 or self.shard_size < 1:
            raise ValueError("distill.num_samples and distill.shard_size must be >= 1")
        if self.source == "images" and not self.images_path:
            raise ValueError("distill.source=images needs distill.images_path (a .safetensors/.pt/.npz file with "
                             "`codes` (M, N) or `images` (M, 3, H, W), optionally `labels` (M,))")
        if self.val_shards < 0:
            raise ValueError(f"distill.val_shards must be >= 0, got {self.val_shards}")


@dataclass(frozen=True)
class TrainConfig:
    """``train.*``: optimisation. ``batch_size`` is per process and micro-batch; the effective batch is
    ``batch_size · grad_accum · world_size`` sequences."""

    steps: int = 2000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-4
    betas: Sequence[float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0
    grad_clip: float = 0.5
    grad_clip_mode: str = "value"
    p_w: float = 0.1
    uncond_prob: float = 0.1
    noise_std: float = 0.2
    bf16: bool = True
    init_seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    val_every: int = 500
    progress: bool = True

    def __post_init__(self) -> None:
        if self.grad_accum < 1 or self.batch_size < 1:
            raise ValueError("train.grad_accum and train.batch_size must be >= 1")
        if self.grad_clip_mode not in ("value", "norm"):
            raise ValueError(f"train.grad_clip_mode must be 'value' or 'norm', got {self.grad_clip_mode!r}")
        if not 0.0 <= self.uncond_prob <= 1.0:
            raise ValueError(f"train.uncond_prob must be in [0, 1], got {self.uncond_prob}")


@dataclass(frozen=True)
class ValConfig:
    """``val.*``: held-out prompts (``None``: the model's class names) and seeds for the accepted length."""

    num_images: int = 4
    draft_len: int = 4
    seed: int = 1_000_000
    prompts: Sequence[str] | None = None
    max_samples: int = 16
    at_start: bool = True


@dataclass(frozen=True)
class WandbConfig:
    """``wandb.*``: Weights & Biases (offline by default; ``wandb sync`` uploads later)."""

    mode: str = "offline"
    project: str = "coolsd-drafter"
    entity: str | None = None
    name: str | None = None
    tags: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode must be one of {WANDB_MODES}, got {self.mode!r}")


# -- data generation -------------------------------------------------------------------------------------
TEACHER_BATCH = 64  # sequences per teacher-forced pass (ImageARModel.teacher_force)


def cycle(prompts: Sequence[str], count: int) -> list[str]:
    """``count`` prompts, cycling through ``prompts``."""
    if not prompts:
        raise ValueError("the prompt set is empty: choose prompts with data=<classes|file|fixed|coco> "
                         "(e.g. data=file data.path=prompts.txt)")
    return [prompts[i % len(prompts)] for i in range(count)]


def load_image_codes(model: ImageARModel, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes (M, N) and optional labels (M,) from a codes/images file; images go through ``model.vq``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"distill.images_path not found: {p}")
    if p.suffix == ".npz":
        import numpy as np

        with np.load(p) as arrays:
            content = {k: torch.from_numpy(arrays[k]) for k in arrays.files}
    else:
        content = load_state_dict(p)
    labels = content.get("labels")
    if "codes" in content:
        codes = content["codes"].long()
    elif "images" in content:
        vq = getattr(model, "vq", None)
        if vq is None:
            raise ValueError(f"{type(model).__name__} has no `vq` to encode images; store `codes` instead")
        images = content["images"]
        if images.dtype == torch.uint8:
            images = images.float() / 127.5 - 1.0  # [0, 255] -> [-1, 1]
        weight = next(vq.parameters())
        with torch.inference_mode():
            codes = torch.cat([vq.encode_to_indices(images[i : i + 16].to(weight.device, weight.dtype)).cpu()
                               for i in range(0, images.shape[0], 16)])
    else:
        raise ValueError(f"{p} holds neither `codes` (M, N) nor `images` (M, C, H, W); found {sorted(content)}")
    if codes.dim() != 2 or codes.shape[1] != model.num_image_tokens:
        raise ValueError(f"codes from {p} have shape {tuple(codes.shape)}, expected (M, {model.num_image_tokens})")
    if codes.min() < 0 or codes.max() >= model.codebook_size:
        raise ValueError(f"codes from {p} fall outside the codebook [0, {model.codebook_size})")
    return codes, labels


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` holds samples ``[start, stop)`` in file ``name``."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"shard_{self.index:05d}.safetensors"


def shard_specs(num_samples: int, shard_size: int) -> list[ShardSpec]:
    return [ShardSpec(i, s, min(s + shard_size, num_samples))
            for i, s in enumerate(range(0, num_samples, shard_size))]


def data_fingerprint(model: ImageARModel, data: DistillConfig, prompts: Sequence[str],
                     model_config: dict | None, prefix: str = "last") -> dict[str, Any]:
    """What the stored samples depend on; a resumed run must match it (including the target's weights and
    the image-code file's contents: a retrained target at the same checkpoint path must not reuse features
    of the old one)."""
    return {
        "weights_sha1": weights_digest(model),
        "images_sha1": file_digest(data.images_path) if data.images_path else None,
        "target": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_config": {k: v for k, v in (model_config or {}).items() if k != "device"},
        "num_streams": model.num_streams,
        "num_image_tokens": model.num_image_tokens,
        "hidden_size": model.hidden_size,
        "codebook_size": model.codebook_size,
        "source": data.source,
        "num_samples": data.num_samples,
        "shard_size": data.shard_size,
        "seed": data.seed,
        "storage_dtype": data.storage_dtype,
        "images_path": data.images_path,
        "prompts_sha1": hashlib.sha1("\n".join(prompts).encode()).hexdigest(),
        "prefix": prefix,
    }


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def make_shard(model: ImageARModel, data: DistillConfig, spec: ShardSpec, prompts: list[str],
               codes: torch.Tensor | None, prefix: str = "last") -> bytes:
    """Generate (or teacher-force) the samples of one shard and serialise them as safetensors bytes.

    ``hidden`` holds the prefix slots the ``prefix`` convention feeds (1 or all C) and then f_0 .. f_{N-1}."""
    from safetensors.torch import save

    sampler = Decoder("ar", model, ExactRule(), draft_len=0, track_tv=False)
    tokens = []
    for i in range(spec.start, spec.stop):
        if codes is None:
            x = sampler.generate(prompts[i], seed=data.seed + i).tokens
        else:
            x = codes[i].to(model.device)
        tokens.append(x.cpu())
    batch = torch.stack(tokens)  # (M, N)
    shard_prompts = prompts[spec.start : spec.stop]
    hidden = [model.teacher_force(shard_prompts[j : j + TEACHER_BATCH], batch[j : j + TEACHER_BATCH], prefix)
              for j in range(0, len(batch), TEACHER_BATCH)]
    hidden = torch.cat(hidden).to("cpu", STORAGE_DTYPES[data.storage_dtype])
    tensors = {
        "tokens": torch.stack(tokens),  # (M, N)
        "hidden": hidden.contiguous(),  # (M, S, P+N, H), P = 1 (prefix=last) or C (prefix=all)
        "sample_index": torch.arange(spec.start, spec.stop),
    }
    return save(tensors, metadata={"format": DATA_FORMAT,
                                   "prompts": json.dumps(prompts[spec.start : spec.stop])})


def generate_data(model: ImageARModel, data: DistillConfig, directory: str | os.PathLike,
                  prompts: Sequence[str], model_config: dict | None = None, progress: bool = True,
                  prefix: str = "last") -> dict:
    """Write every missing shard into ``directory``; return the manifest (resumable).

    ``prefix``: the drafter's prefix convention the samples are made for (``head.prefix``).

    ``prompts`` (cycled) condition the samples; with ``source=images`` and ``labels`` in the file, sample
    ``i``'s prompt is its label instead (class-conditional models).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(directory)  # a write killed mid-way (atomic writes never leave one otherwise)
    codes, labels = (None, None)
    if data.source == "images":
        codes, labels = load_image_codes(model, data.images_path)
        if codes.shape[0] < data.num_samples:
            raise ValueError(f"distill.images_path holds {codes.shape[0]} samples < distill.num_samples "
                             f"({data.num_samples})")
    if labels is not None:
        prompts = [str(int(v)) for v in labels[: data.num_samples]]
    else:
        prompts = cycle(prompts, data.num_samples)
    check_prefix(prefix)
    fingerprint = data_fingerprint(model, data, prompts, model_config, prefix)
    manifest = read_manifest(directory)
    if manifest is None:
        manifest = {"format": DATA_FORMAT, "version": 1, "fingerprint": fingerprint, "shards": {}}
    elif {**manifest.get("fingerprint", {}), "prefix": manifest_prefix(manifest)} != fingerprint:
        old = {**manifest.get("fingerprint", {}), "prefix": manifest_prefix(manifest)}
        diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
        raise ValueError(f"distill.dir {directory} holds samples made with other settings (stored vs now: "
                         f"{diff}); choose another distill.dir or delete that folder")
    specs = shard_specs(data.num_samples, data.shard_size)
    todo = [s for s in specs if s.name not in manifest["shards"] or not (directory / s.name).is_file()]
    for spec in tqdm(todo, desc="drafter data shards", disable=not progress):
        atomic_write_bytes(directory / spec.name, make_shard(model, data, spec, prompts, codes, prefix))
        manifest["shards"][spec.name] = {"start": spec.start, "stop": spec.stop}
        write_manifest(directory, manifest)
    return manifest


def manifest_prefix(manifest: dict[str, Any]) -> str:
    """The prefix convention a data folder was made for (folders from before the option: ``last``)."""
    return manifest.get("fingerprint", {}).get("prefix", "last")


# -- streaming batches -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Training pairs of ``B`` sequences. With ``P`` stored prefix slots (1 for ``prefix=last``): ``features``
    (prefix slots 0..P−1, then f_{0..N−2}) with ``tokens`` (P−1 zero ids, then x_{0..N−1}) at pair positions
    ``−P .. N−2``; the last ``N`` pairs predict ``targets`` f_{0..N−1} (the prefix pairs are context only)."""

    tokens: torch.Tensor  # (B, P-1+N)
    features: torch.Tensor  # (B, P-1+N, H)
    targets: torch.Tensor  # (B, N, H)


def pair_positions(n: int, device: torch.device | str, prefix_slots: int = 1) -> torch.Tensor:
    """Pair positions of ``prefix_slots`` prefix slots and ``n`` image tokens: ``−prefix_slots .. n−2``."""
    return torch.arange(-prefix_slots, n - 1, device=device)


def training_pairs(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stored sample -> ``(features, pair tokens, targets)`` of the drafter's prefix convention.

    ``hidden`` (..., P+N, H) = the P fed prefix slots (the last one ``f_{-1}``) then ``f_0 .. f_{N-1}``;
    ``tokens`` (N,). Returns features (..., P−1+N, H), token ids (P−1+N,) (zeros, then x_0 .. x_{N−1}) and
    targets (..., N, H) = ``f_0 .. f_{N-1}``.
    """
    n = tokens.shape[-1]
    p = hidden.shape[-2] - n
    if p < 1:
        raise ValueError(f"stored hidden states have {hidden.shape[-2]} rows for {n} tokens; expected P + N, P >= 1")
    pair_tokens = torch.cat([tokens.new_zeros(p - 1), tokens])
    return hidden[..., :-1, :], pair_tokens, hidden[..., p:, :]


class ShardStream:
    """Endless, resumable stream of training batches over a list of shards, split across DDP ranks.

    Epoch ``e`` visits the shards in a seeded random order and each shard's rows in a seeded random order;
    global item ``g`` goes to rank ``g % world``. ``cursor`` (global items consumed) is the whole state,
    so a resumed stream continues exactly. One shard is held in memory at a time.
    """

    def __init__(self, directory: Path, shards: list[str], sizes: list[int], batch_size: int, seed: int,
                 uncond_prob: float, rank: int = 0, world: int = 1, device: str | torch.device = "cpu",
                 cursor: int = 0) -> None:
        if not shards:
            raise ValueError("no training shards: raise distill.num_samples or lower distill.val_shards")
        self.directory, self.shards, self.sizes = directory, shards, sizes
        self.total = sum(sizes)
        self.batch_size, self.seed, self.uncond_prob = batch_size, seed, uncond_prob
        self.rank, self.world, self.device = rank, world, device
        self.cursor = cursor
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        self._orders: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def _epoch_order(self, epoch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            shard_order = torch.randperm(len(self.shards), generator=gen)
            rows = [torch.randperm(self.sizes[s], generator=gen) for s in range(len(self.shards))]
            self._orders = {epoch: (shard_order, rows)}
        return self._orders[epoch]

    def _item(self, g: int) -> tuple[int, int]:
        """Global item index -> (shard, row)."""
        epoch, offset = divmod(g, self.total)
        shard_order, rows = self._epoch_order(epoch)
        for s in shard_order.tolist():
            if offset < self.sizes[s]:
                return s, int(rows[s][offset])
            offset -= self.sizes[s]
        raise AssertionError("offset past the epoch")

    def _shard(self, s: int) -> dict[str, torch.Tensor]:
        if self._loaded is None or self._loaded[0] != s:
            from safetensors.torch import load_file

            self._loaded = (s, load_file(str(self.directory / self.shards[s])))
        return self._loaded[1]

    def next_batch(self) -> Batch:
        tokens, features, targets = [], [], []
        for i in range(self.batch_size):
            g = self.cursor + i * self.world + self.rank
            s, row = self._item(g)
            shard = self._shard(s)
            hidden = shard["hidden"][row]  # (S, P+N, H)
            stream = 0
            if hidden.shape[0] == 2 and self.uncond_prob > 0:
                gen = torch.Generator().manual_seed(self.seed * 7_919 + g)
                stream = int(torch.rand((), generator=gen) < self.uncond_prob)
            f, x, target = training_pairs(hidden[stream], shard["tokens"][row])
            tokens.append(x)
            features.append(f)
            targets.append(target)
        self.cursor += self.batch_size * self.world
        return Batch(tokens=torch.stack(tokens).to(self.device),
                     features=torch.stack(features).to(self.device, torch.float32),
                     targets=torch.stack(targets).to(self.device, torch.float32))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


def split_shards(manifest: dict[str, Any], val_shards: int) -> tuple[list[str], list[str]]:
    """Training and held-out shard names: the last ``val_shards`` shards are held out (if more than one)."""
    names = sorted(manifest["shards"], key=lambda n: manifest["shards"][n]["start"])
    held = min(val_shards, max(len(names) - 1, 0))
    return names[: len(names) - held], names[len(names) - held :]


# -- loss, step, validation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor
    vloss: torch.Tensor
    ploss: torch.Tensor
    top1: torch.Tensor


def add_feature_noise(features: torch.Tensor, std: float) -> torch.Tensor:
    """EAGLE's uniform input-feature noise: ``(U(0,1) − 0.5) · std · 512 / seq_len``."""
    if std <= 0:
        return features
    return features + (torch.rand_like(features) - 0.5) * std * 512 / features.shape[1]


def drafter_loss(net: torch.nn.Module, head: EagleHead, batch: Batch, p_w: float, noise_std: float = 0.0,
                 autocast: bool = False) -> LossParts:
    """EAGLE's loss on one micro-batch: mean SmoothL1 over positions and features + ``p_w`` · soft CE.

    ``net`` is ``head`` or its DDP wrapper (the forward must go through it for gradient sync).
    """
    device_type = batch.features.device.type
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=autocast):
        n = batch.targets.shape[1]
        prefix_slots = batch.tokens.shape[1] - n + 1
        positions = pair_positions(n, batch.tokens.device, prefix_slots)
        f_hat = net(add_feature_noise(batch.features, noise_std), batch.tokens, positions)[:, -n:]  # (B, N, H)
        logits_hat = head.logits(f_hat).float()  # (B, N, V)
        with torch.no_grad():
            target_logits = head.logits(batch.targets).float()
    work = torch.promote_types(f_hat.dtype, torch.float32)  # bf16 under autocast -> float32
    vloss = F.smooth_l1_loss(f_hat.to(work), batch.targets.to(work), reduction="none").mean(-1).mean()
    target_p = torch.softmax(target_logits, dim=-1)
    ploss = -(target_p * torch.log_softmax(logits_hat, dim=-1)).sum(-1).mean()
    top1 = (logits_hat.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return LossParts(loss=vloss + p_w * ploss, vloss=vloss.detach(), ploss=ploss.detach(), top1=top1)


def train_step(net: torch.nn.Module, head: EagleHead, micro_batches: Sequence[Batch],
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
               cfg: TrainConfig, autocast: bool = False) -> dict[str, float]:
    """One optimizer step over ``len(micro_batches)`` accumulated micro-batches (each loss / k)."""
    k = len(micro_batches)
    totals = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "top1": 0.0}
    for i, batch in enumerate(micro_batches):
        sync = i == k - 1 or not hasattr(net, "no_sync")
        with contextlib.nullcontext() if sync else net.no_sync():
            parts = drafter_loss(net, head, batch, cfg.p_w, cfg.noise_std, autocast)
            (parts.loss / k).backward()
        for name in totals:
            totals[name] += float(getattr(parts, name).detach()) / k
    if cfg.grad_clip > 0:
        if cfg.grad_clip_mode == "value":
            torch.nn.utils.clip_grad_value_(head.parameters(), cfg.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    totals["lr"] = optimizer.param_groups[0]["lr"]
    return totals


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine down to ``min_ratio`` at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def agreement(model: ImageARModel, head: EagleHead, directory: Path, shards: list[str],
              max_samples: int) -> float:
    """Teacher-forced mean ``1 − TV(p, q)`` on held-out samples (both CFG streams, guided like decoding)."""
    from safetensors.torch import load_file

    scores, seen = [], 0
    device = head.fc.weight.device
    for name in shards:
        shard = load_file(str(directory / name))
        for row in range(shard["tokens"].shape[0]):
            if seen >= max_samples:
                break
            hidden = shard["hidden"][row].to(device, torch.float32)  # (S, P+N, H)
            features, tokens, targets = training_pairs(hidden, shard["tokens"][row].to(device))
            n = targets.shape[1]
            positions = pair_positions(n, device, tokens.shape[0] - n + 1)
            f_hat = head(features, tokens, positions)[:, -n:]  # (S, N, H)
            q = stream_probs(head.logits(f_hat)[:, :-1], model.sampling)  # (N-1, V); x_N does not exist
            p = stream_probs(head.logits(targets[:, :-1]), model.sampling)
            scores.append(torch.minimum(p, q).sum(-1).mean().item())
            seen += 1
    return sum(scores) / len(scores) if scores else float("nan")


def accepted_length(model: ImageARModel, head: EagleHead, prompts: Sequence[str], seed: int,
                    draft_len: int) -> float:
    """Mean accepted length (committed tokens / verify forwards, pooled) of SD with this drafter, the
    prompts decoded as one batch (each image as alone)."""
    drafter = EagleDrafter(model, head=head, prefix=head.prefix)
    decoder = Decoder("sd", model, ExactRule(), draft_len=draft_len, drafter=drafter, track_tv=False)
    gens = decoder.generate_batch(list(prompts), [seed + i for i in range(len(prompts))])
    return pooled_accepted_length([g.stats for g in gens])


def validate(model: ImageARModel, head: EagleHead, data_dir: Path, val_shards: list[str], val: ValConfig,
             prompts: list[str]) -> dict[str, float]:
    metrics = {"val/accepted_length": accepted_length(model, head, prompts, val.seed, val.draft_len)}
    if val_shards:
        metrics["val/agreement"] = agreement(model, head, data_dir, val_shards, val.max_samples)
    return metrics


# -- checkpoints -----------------------------------------------------------------------------------------
TRAINER_FILE = "trainer.pt"


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "steps" / f"step_{step:07d}"


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = sorted(p for p in (out_dir / "steps").glob("step_*") if (p / TRAINER_FILE).is_file())
    return done[-1] if done else None


def save_checkpoint(out_dir: Path, step: int, head: EagleHead, optimizer, scheduler, cursor: int,
                    keep: int, training: dict[str, Any]) -> Path:
    """Write ``steps/step_<k>/`` (drafter + optimizer, scheduler, step, data cursor, RNG); a temporary
    folder is renamed into place, so a half-written checkpoint is never picked up by ``resume``."""
    final = step_dir(out_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    save_eagle(head, tmp, training={**training, "step": step})
    state = {
        "step": step,
        "cursor": cursor,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(tmp / TRAINER_FILE, buf.getvalue())
    if final.exists():
        for f in final.iterdir():
            f.unlink()
        final.rmdir()
    os.replace(tmp, final)
    old = sorted(p for p in (out_dir / "steps").glob("step_*") if p.is_dir())
    for stale in old[: max(len(old) - keep, 0)]:
        for f in stale.iterdir():
            f.unlink()
        stale.rmdir()
    return final


def stored_before(path: Path) -> dict[str, float] | None:
    """The pre-training validation metrics a step checkpoint carries (None: written without them)."""
    training = json.loads((path / CONFIG_FILE).read_text()).get("training", {})
    before = training.get("before")
    return dict(before) if isinstance(before, dict) else None


def load_checkpoint(path: Path, head: EagleHead, optimizer, scheduler) -> tuple[int, int]:
    """Restore head weights, optimizer, scheduler and RNG from ``path``; return (step, data cursor)."""
    head.load_state_dict(load_state_dict(path / "model.safetensors"), strict=True)
    state = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"]), int(state["cursor"])


# -- the run ---------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a training run measured; ``before``/``after`` are validation metrics at step 0 / the end."""

    out_dir: Path
    steps: int
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the ``torchrun`` process group when its variables are set (nccl on GPU, gloo on CPU)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank)


class WandbRun:
    """A W&B run on the main process (``mode=disabled`` and other ranks log nothing)."""

    def __init__(self, cfg: WandbConfig, enabled: bool, out_dir: Path, config: dict[str, Any]) -> None:
        self.run = None
        if enabled and cfg.mode != "disabled":
            import wandb

            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, tags=list(cfg.tags),
                                  mode=cfg.mode, dir=str(out_dir.resolve()), config=config,
                                  settings=wandb.Settings(silent=True, console="off"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()


def run(cfg: DictConfig, model: ImageARModel | None = None) -> TrainResult | None:
    """Everything ``scripts/train_drafter.py`` does for a composed config with ``out_dir`` and
    ``distill.dir`` set; ``model`` may be passed to reuse an instance. Returns ``None`` for ``stage=data``."""
    if cfg.stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {cfg.stage!r}")
    if cfg.out_dir is None or cfg.distill.dir is None:
        raise ValueError("out_dir and distill.dir must be set (the command line defaults them per model)")
    data = DistillConfig(**OmegaConf.to_container(cfg.distill, resolve=True))
    train_cfg = TrainConfig(**OmegaConf.to_container(cfg.train, resolve=True))
    val = ValConfig(**OmegaConf.to_container(cfg.val, resolve=True))
    wandb_cfg = WandbConfig(**OmegaConf.to_container(cfg.wandb, resolve=True))
    info = init_distributed()
    torch.manual_seed(cfg.seed + info.rank)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    model_config = OmegaConf.to_container(cfg.model, resolve=True)
    if model is None:
        model = instantiate(cfg.model)
    model.requires_grad_(False)
    model.eval()
    prompt_set = instantiate(cfg.data)
    data_dir, out_dir = Path(cfg.distill.dir), Path(cfg.out_dir)
    again = f"python scripts/train_drafter.py stage=data distill.dir={data_dir} (same overrides)"

    if cfg.stage in ("all", "data"):
        if info.world > 1 and not _data_complete(data_dir, data):
            raise RuntimeError(f"drafter data in {data_dir} is incomplete; generate it in one process first: "
                               + again)
        if info.world == 1:
            generate_data(model, data, data_dir, prompt_set.load(model, None), model_config,
                          progress=train_cfg.progress, prefix=cfg.head.prefix)
        if cfg.stage == "data":
            return None
    manifest = read_manifest(data_dir)
    if manifest is None or not _data_complete(data_dir, data):
        raise FileNotFoundError(f"drafter training data not found or incomplete in {data_dir}; run " + again)
    val_prompts = cycle(list(val.prompts) if val.prompts else prompt_set.load(model, None),
                        val.num_images)
    return train(cfg, model, data, train_cfg, val, wandb_cfg, info, manifest, data_dir, out_dir, val_prompts)


def _data_complete(directory: Path, data: DistillConfig) -> bool:
    manifest = read_manifest(directory)
    if manifest is None:
        return False
    return all(s.name in manifest["shards"] and (directory / s.name).is_file()
               for s in shard_specs(data.num_samples, data.shard_size))


def train(cfg: DictConfig, model: ImageARModel, data: DistillConfig, train_cfg: TrainConfig, val: ValConfig,
          wandb_cfg: WandbConfig, info: DistInfo, manifest: dict[str, Any], data_dir: Path, out_dir: Path,
          val_prompts: list[str]) -> TrainResult:
    device = model.device
    if manifest_prefix(manifest) != cfg.head.prefix:
        raise ValueError(f"the drafter data in {data_dir} were made for head.prefix={manifest_prefix(manifest)} "
                         f"but head.prefix={cfg.head.prefix}; use the same convention, or regenerate the data "
                         "in another distill.dir")
    head = EagleHead(model, bias=bool(cfg.head.bias), own_embedding=False, init_seed=train_cfg.init_seed,
                     prefix=cfg.head.prefix)
    head.float()
    net: torch.nn.Module = head
    if info.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            head, device_ids=[info.local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(head.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                  weight_decay=train_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(train_cfg.warmup_steps, train_cfg.steps, train_cfg.min_lr_ratio))
    start, cursor = 0, 0
    latest = latest_checkpoint(out_dir)
    if latest is not None and not cfg.resume:
        raise FileExistsError(f"{out_dir} holds checkpoints of an earlier run ({latest.name}); pass resume=true "
                              "to continue it, or choose another out_dir")
    train_names, val_names = split_shards(manifest, data.val_shards)
    sizes = [manifest["shards"][n]["stop"] - manifest["shards"][n]["start"] for n in train_names]
    autocast = train_cfg.bf16 and device.type == "cuda"
    training_info: dict[str, Any] = {"data_dir": str(data_dir), "source": data.source,
                                     "num_samples": data.num_samples, "total_steps": train_cfg.steps,
                                     "prefix": cfg.head.prefix, "train": asdict(train_cfg)}
    result = TrainResult(out_dir=out_dir, steps=train_cfg.steps)
    if info.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    logger = WandbRun(wandb_cfg, info.main, out_dir, OmegaConf.to_container(cfg, resolve=True))

    def evaluate(step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if info.main:
            metrics = validate(model, head, data_dir, val_names, val, val_prompts)
            logger.log(metrics, step)
        if info.world > 1:
            dist.barrier()
        return metrics

    # the pre-training validation (`before`) travels with every step checkpoint, so a resumed run reports it
    if latest is not None:
        before = stored_before(latest)
        if before is None:
            # written before checkpoints stored `before`: the untrained head (same init_seed) measures it again
            before = evaluate(0) if val.at_start else {}
        result.before = before
        start, cursor = load_checkpoint(latest, head, optimizer, scheduler)
    elif val.at_start:
        result.before = evaluate(0)
    training_info["before"] = result.before
    stream = ShardStream(data_dir, train_names, sizes, train_cfg.batch_size, cfg.seed, train_cfg.uncond_prob,
                         rank=info.rank, world=info.world, device=device, cursor=cursor)
    bar = tqdm(total=train_cfg.steps, initial=start, desc="train drafter",
               disable=not (info.main and train_cfg.progress))
    head.train()
    for step in range(start, train_cfg.steps):
        micro = [stream.next_batch() for _ in range(train_cfg.grad_accum)]
        metrics = train_step(net, head, micro, optimizer, scheduler, train_cfg, autocast)
        done = step + 1
        result.last = metrics
        bar.update(1)
        if done % train_cfg.log_every == 0 or done == train_cfg.steps:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", top1=f"{metrics['top1']:.3f}")
            logger.log({f"train/{k}": v for k, v in metrics.items()}, done)
        if done % train_cfg.checkpoint_every == 0 or done == train_cfg.steps:
            if info.main:
                save_checkpoint(out_dir, done, head, optimizer, scheduler, stream.cursor,
                                train_cfg.keep_checkpoints, training_info)
            if info.world > 1:
                dist.barrier()
        if done % train_cfg.val_every == 0 and done != train_cfg.steps:
            evaluate(done)
    bar.close()
    head.eval()
    result.after = evaluate(train_cfg.steps)
    if info.main:
        save_eagle(head, out_dir, training={**training_info, "steps": train_cfg.steps,
                                            "before": result.before, "after": result.after})
        logger.finish({"before": result.before, "after": result.after})
    return result


def default_dirs(cfg: DictConfig) -> None:
    """Fill ``out_dir`` / ``distill.dir`` from the chosen model config when they are null."""
    from hydra.core.hydra_config import HydraConfig

    name = HydraConfig.get().runtime.choices.get("model", "model")
    if cfg.out_dir is None:
        cfg.out_dir = f"checkpoints/drafter_{name}"
    if cfg.distill.dir is None:
        cfg.distill.dir = f"outputs/drafter_data/{name}"


@hydra.main(version_base="1.3", config_path="../configs", config_name="train_drafter")
def main(cfg: DictConfig) -> None:
    default_dirs(cfg)
    start = time.perf_counter()
    result = run(cfg)
    if result is not None and int(os.environ.get("RANK", "0")) == 0:
        before = result.before.get("val/accepted_length", float("nan"))
        after = result.after.get("val/accepted_length", float("nan"))
        print(f"drafter written to {result.out_dir} after {result.steps} steps in "
              f"{time.perf_counter() - start:.0f} s; accepted length (sd, draft_len={cfg.val.draft_len}) "
              f"before {before:.3f} -> after {after:.3f}; teacher-forced agreement after "
              f"{result.after.get('val/agreement', float('nan')):.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
