"""Train an EAGLE drafter for a target model by self-distillation: data, training, validation.

1. **Data** (``stage=data`` or ``all``): distillation samples in safetensors shards
   (``coolsd.training.data``).
2. **Training** (``stage=train`` or ``all``): pairs ``(f_t, x_{t+1}) -> f_{t+1}`` with EAGLE's loss
   ``SmoothL1(f̂, f) + p_w·CE(softmax(head(f)), head(f̂))`` (p_w = 0.1), AdamW, linear warm-up then cosine,
   gradient accumulation, gradient clipping, bf16 autocast on CUDA, checkpoints every
   ``train.checkpoint_every`` steps and ``resume=true``. With CFG a sequence is trained on its unconditional
   stream with probability ``train.uncond_prob`` (LANTERN: 0.1). With ``head.prefix=all`` the head is fed the
   prefix pairs too (slot ``j`` with token id 0, the last with ``x_0``, at pair positions ``j − C``), as it
   will be when decoding; the loss covers the pairs ``t = −1 .. N−2`` as with ``last`` (LANTERN also leaves
   out ``t = −1``, whose prediction drafts ``x_1``; here it is trained).
3. **Validation**: teacher-forced agreement ``1 − TV(p, q)`` on held-out shards and the real mean accepted
   length of ``Decoder('sd', ExactRule(), draft_len)`` with this drafter on held-out prompts and seeds,
   before training and after. Step checkpoints carry the "before" metrics, so a resumed run reports and
   writes the original ones (``training.before`` in the drafter's ``config.json``).

**Where the ranks come from.** ``coolsd.launch.launch_environment``, as for ``run.py``: torchrun's variables
(also ``accelerate launch`` and ``srun torchrun``), else a SLURM task (``srun python scripts/train_drafter.py``)
or a task of the Hydra submitit launcher (``hydra/launcher=slurm_train``), read through submitit, else one
process. ``accelerate`` reads torchrun's variables only, so for a submitit-placed task ``make_accelerator``
first writes them (``coolsd.launch.export_for_torch``); without that every SLURM task would be rank 0 of 1 and
train its own copy into the same ``out_dir``. ``dist.timeout_min`` (default 60) bounds every wait for another
rank: each collective (the process group's timeout: a barrier while rank 0 validates or checkpoints, a gradient
all-reduce) and, in the data stage, the time without a new shard from the others (``wait_for_data``, which then
names the missing shards and their ranks).

**What Hugging Face libraries do here.** ``accelerate`` (``Accelerator``) joins the process group of those
ranks (nccl on GPU, gloo on CPU: ``Accelerator(cpu=True)`` when the target runs on the CPU), wraps the head
in DDP, accumulates gradients (``accumulate``/``backward``: no gradient sync before the last micro-batch, each
loss divided by ``train.grad_accum``), clips, seeds each rank
(``set_seed(seed, device_specific=True)``: ``seed + rank``), logs to W&B on the main process (its ``wandb``
tracker) and saves and restores the training state (``save_state``/``load_state``: optimizer, scheduler, the
gradient-accumulation counter and every rank's RNG states, read back through ``torch.load`` with
``weights_only=True``, accelerate's default; every rank restores its own RNG state, where the hand-written
checkpoints kept rank 0's only). Accelerate skips RNG states it cannot read with no more than an INFO log
line; the byte-identical resume tests are what would notice. The learning rate follows ``transformers``'
``get_cosine_schedule_with_warmup`` (``get_cosine_with_min_lr_schedule_with_warmup`` when
``train.min_lr_ratio > 0``); its warm-up starts at 0 (step ``s < warmup`` runs at ``lr·s/warmup``; the
hand-written schedule it replaces ran at ``lr·(s+1)/warmup``, so warm-up now ends one step later).

What stays the project's own, and why:

* **bf16 autocast** (``torch.autocast`` in ``drafter_loss``). Accelerate's ``mixed_precision="bf16"`` wraps
  the prepared module's ``forward`` itself, for every call, so the validation decodes and the teacher-forced
  agreement, which run the same head, would run in bf16 too and measure a different drafter than before;
  here only the training forward (and its logits) is autocast, as it was.
* **The data cursor and the step** go into ``trainer.json`` beside accelerate's state, not through
  ``register_for_checkpointing``: accelerate loads registered objects with ``weights_only=False``, and the
  project loads checkpoints only with safetensors or ``torch.load(weights_only=True)``.
* **Checkpoint folders** (``steps/step_<k>/``): written into a temporary folder and renamed into place (a
  half-written checkpoint is never resumed), the newest ``train.keep_checkpoints`` kept, each with a
  loadable drafter (``config.json`` + ``model.safetensors``) and accelerate's state in ``state/``.
  Accelerate's automatic checkpoint naming neither renames atomically nor names folders by step.
* **The head's weights** in a checkpoint are that drafter's ``model.safetensors`` (``save_eagle``: atomic,
  with the umask's file mode), loaded with safetensors; save/load hooks keep accelerate from writing a
  second copy (safetensors' own writer creates 0600 files, against the project's umask rule).
* **The data stream** (``ShardStream``) replaces a ``DataLoader``: one shard in memory at a time and its
  whole state is one integer, so a resumed run continues with the very next batch; with it, resuming at a
  checkpoint gives byte-identical final weights (``tests/test_eagle.py``).

Multi-GPU: ``torchrun --nproc_per_node=<gpus> scripts/train_drafter.py ...``,
``accelerate launch --multi_gpu --num_processes=<gpus> scripts/train_drafter.py ...``,
``srun --ntasks-per-node=<gpus> --kill-on-bad-exit=1 python scripts/train_drafter.py ...`` or
``python scripts/train_drafter.py -m hydra/launcher=slurm_train hydra.launcher.gpus_per_node=<gpus> ...``
(requeued on time-out or pre-emption, resuming); every stage runs on every rank: the data stage shards by
shard index (``coolsd.training.data``: rank ``r`` of ``W`` makes shards ``k % W == r``, then waits on disk
for the rest), training is data-parallel; ``train.batch_size`` is per process and micro-batch. Checkpoints
assume one node or a shared file system (every rank writes its RNG state into the same folder).

Written after jadohu/LANTERN ``entrypoints/train_drafter/main.py`` (EAGLE's recipe), without its quirks: here
gradient accumulation accumulates and the warm-up length is set in steps.

The trained drafter is written to ``out_dir`` (``config.json`` + ``model.safetensors``) and is used with
``python run.py drafter=eagle drafter.checkpoint=<out_dir>``.

Examples::

    python scripts/train_drafter.py model=tiny
    torchrun --nproc_per_node=8 scripts/train_drafter.py model=<m> stage=train resume=true
    srun --ntasks-per-node=8 --gpus-per-node=8 --kill-on-bad-exit=1 python scripts/train_drafter.py model=<m>
"""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.acceptance import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import CONFIG_FILE, WEIGHTS_FILE, EagleDrafter, EagleHead, save_eagle
from coolsd.io import atomic_write_bytes
from coolsd.launch import export_for_torch, join_error, launch_environment
from coolsd.models.base import ImageARModel
from coolsd.models.checkpoints import load_state_dict
from coolsd.device import resolve_device
from coolsd.sampling import stream_probs
from coolsd.training.data import (Batch, DistillConfig, ShardStream, check_eval_overlap, cycle, data_complete,
                                  generate_data, manifest_prefix, pair_positions, read_manifest, split_shards,
                                  training_pairs, wait_for_data)
from coolsd.types import pooled_accepted_length

STAGES = ("all", "data", "train")
WANDB_MODES = ("online", "offline", "disabled")


# -- settings (one frozen record per config section, so a typo in YAML fails) ---------------------------
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


@dataclass(frozen=True)
class DistConfig:
    """``dist.*``: several processes. ``timeout_min`` bounds every wait for another rank: a collective (the
    process group's timeout) and, in the data stage, the time without a new shard of the others."""

    timeout_min: float = 60.0

    def __post_init__(self) -> None:
        if not self.timeout_min > 0:
            raise ValueError(f"dist.timeout_min must be > 0 (minutes), got {self.timeout_min}")



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



def train_step(accelerator, net: torch.nn.Module, head: EagleHead, micro_batches: Sequence[Batch],
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
               cfg: TrainConfig, autocast: bool = False) -> dict[str, float]:
    """One optimizer step over ``len(micro_batches)`` accumulated micro-batches (``train.grad_accum``).

    ``accelerator.accumulate`` skips the gradient sync of every micro-batch but the last and
    ``accelerator.backward`` divides each loss by the number of micro-batches; the step, its clipping and
    the schedule follow the last one.
    """
    if len(micro_batches) != accelerator.gradient_accumulation_steps:
        raise ValueError(f"{len(micro_batches)} micro-batches for an accelerator that accumulates "
                         f"{accelerator.gradient_accumulation_steps}")
    k = len(micro_batches)
    totals = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "top1": 0.0}
    for batch in micro_batches:
        with accelerator.accumulate(net):
            parts = drafter_loss(net, head, batch, cfg.p_w, cfg.noise_std, autocast)
            accelerator.backward(parts.loss)
        for name in totals:
            totals[name] += float(getattr(parts, name).detach()) / k
    if not accelerator.sync_gradients:
        raise RuntimeError("the accumulation counter is out of step with the micro-batches")
    if cfg.grad_clip > 0:
        if cfg.grad_clip_mode == "value":
            accelerator.clip_grad_value_(head.parameters(), cfg.grad_clip)
        else:
            accelerator.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    totals["lr"] = optimizer.param_groups[0]["lr"]
    return totals


def lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``train.warmup_steps``, then cosine down to ``train.min_lr_ratio`` · lr at
    ``train.steps`` (``transformers``' schedules)."""
    from transformers import get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    if cfg.min_lr_ratio > 0:
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    return get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)


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
TRAINER_FILE = "trainer.json"  # step and data cursor; its presence marks a finished checkpoint
STATE_DIR = "state"  # accelerate's save_state: optimizer, scheduler, step counter, RNG of every rank


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "steps" / f"step_{step:07d}"


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = sorted(p for p in (out_dir / "steps").glob("step_*") if (p / TRAINER_FILE).is_file())
    return done[-1] if done else None


def earlier_checkpoint(out_dir: Path) -> Path | None:
    """The newest step folder of any format (also one written before accelerate: ``trainer.pt``)."""
    found = sorted(p for p in (out_dir / "steps").glob("step_*") if p.is_dir())
    return found[-1] if found else None


def save_checkpoint(accelerator, out_dir: Path, step: int, head: EagleHead, cursor: int, keep: int,
                    training: dict[str, Any]) -> Path:
    """Write ``steps/step_<k>/`` on every rank: the drafter at this step (``save_eagle``), accelerate's state
    (``state/``) and ``trainer.json`` (step, data cursor). A temporary folder is renamed into place, so a
    half-written checkpoint is never picked up by ``resume``; the newest ``keep`` checkpoints are kept."""
    final = step_dir(out_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / STATE_DIR))  # every rank: its own RNG state
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_eagle(head, tmp, training={**training, "step": step})
        atomic_write_bytes(tmp / TRAINER_FILE, (json.dumps({"step": step, "cursor": cursor}) + "\n").encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        old = sorted(p for p in (out_dir / "steps").glob("step_*") if p.is_dir())
        for stale in old[: max(len(old) - keep, 0)]:
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    return final


def stored_before(path: Path) -> dict[str, float] | None:
    """The pre-training validation metrics a step checkpoint carries (None: written without them)."""
    training = json.loads((path / CONFIG_FILE).read_text()).get("training", {})
    before = training.get("before")
    return dict(before) if isinstance(before, dict) else None


def load_checkpoint(accelerator, path: Path, head: EagleHead) -> tuple[int, int]:
    """Restore the head's weights, the optimizer, scheduler and RNG states from ``path``; return (step,
    data cursor)."""
    if not (path / TRAINER_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint of this version (no {TRAINER_FILE}; folders "
                                "with trainer.pt were written before training moved to accelerate): finish "
                                "that run with the version that started it, or choose another out_dir")
    head.load_state_dict(load_state_dict(path / WEIGHTS_FILE), strict=True)
    accelerator.load_state(str(path / STATE_DIR))
    state = json.loads((path / TRAINER_FILE).read_text())
    return int(state["step"]), int(state["cursor"])


# -- the run ---------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a training run measured; ``before``/``after`` are validation metrics at step 0 / the end.
    ``main_process``: whether this process is the main one (the one that reports)."""

    out_dir: Path
    steps: int
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    main_process: bool = True


def make_accelerator(train_cfg: TrainConfig, device: torch.device, wandb_cfg: WandbConfig | None = None,
                     dist_cfg: DistConfig | None = None):
    """The ``Accelerator`` of a run whose target lives on ``device``: the CPU backend (gloo) unless it is a
    GPU, ``train.grad_accum`` micro-batches per step, no device moves (the head lives with its target), and
    the W&B tracker unless ``wandb.mode=disabled``. Mixed precision stays off (see the module docstring).

    Its ranks are ``launch_environment``'s: for a SLURM or submitit task the variables ``accelerate`` reads are
    written first (``export_for_torch``); the process group's timeout is ``dist.timeout_min``.

    Its ``save_state``/``load_state`` leave the head's weights out: they are the step's drafter files
    (``save_eagle``, written atomically and with the umask's mode; safetensors' own writer makes 0600
    files)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    dist_cfg = dist_cfg or DistConfig()
    env = launch_environment()
    export_for_torch(env)
    tracking = wandb_cfg is not None and wandb_cfg.mode != "disabled"
    try:
        accelerator = Accelerator(cpu=device.type != "cuda", gradient_accumulation_steps=train_cfg.grad_accum,
                                  device_placement=False, step_scheduler_with_optimizer=False,
                                  log_with="wandb" if tracking else None,
                                  kwargs_handlers=[InitProcessGroupKwargs(
                                      timeout=dt.timedelta(minutes=dist_cfg.timeout_min))])
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
        if env.world == 1:
            raise
        raise join_error(env, f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
                         dist_cfg.timeout_min, "dist.timeout_min", "Nothing was written", err) from err
    if (accelerator.process_index, accelerator.num_processes) != (env.rank, env.world):
        raise RuntimeError(
            f"accelerate placed this process as rank {accelerator.process_index} of "
            f"{accelerator.num_processes}, but its launch environment ({env.source}) says rank {env.rank} of "
            f"{env.world}: remove stray RANK/WORLD_SIZE/LOCAL_RANK (or MPI) variables from the job's "
            "environment, or start it with torchrun or srun alone")
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())
    return accelerator


def run(cfg: DictConfig, model: ImageARModel | None = None) -> TrainResult | None:
    """Everything ``scripts/train_drafter.py`` does for a composed config with ``out_dir`` and
    ``distill.dir`` set; ``model`` may be passed to reuse an instance. Returns ``None`` for ``stage=data``."""
    from accelerate.utils import set_seed

    if cfg.stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {cfg.stage!r}")
    if cfg.out_dir is None or cfg.distill.dir is None:
        raise ValueError("out_dir and distill.dir must be set (the command line defaults them per model)")
    data = DistillConfig(**OmegaConf.to_container(cfg.distill, resolve=True))
    train_cfg = TrainConfig(**OmegaConf.to_container(cfg.train, resolve=True))
    val = ValConfig(**OmegaConf.to_container(cfg.val, resolve=True))
    wandb_cfg = WandbConfig(**OmegaConf.to_container(cfg.wandb, resolve=True))
    dist_cfg = DistConfig(**OmegaConf.to_container(cfg.get("dist") or OmegaConf.create(), resolve=True))
    device = model.device if model is not None else resolve_device(str(cfg.model.get("device", "auto")))
    accelerator = make_accelerator(train_cfg, device, wandb_cfg, dist_cfg)  # before the model: picks the GPU
    set_seed(cfg.seed, device_specific=True)  # seed + rank
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    model_config = OmegaConf.to_container(cfg.model, resolve=True)
    prompt_set = instantiate(cfg.data)
    text_prompts = not list(cfg.model.get("class_names") or [])
    if cfg.stage in ("all", "data") and data.source == "self_distill" and text_prompts:
        # refuse evaluation prompts before the target is loaded (distill.eval_overlap)
        check_eval_overlap(cycle(prompt_set.load(None, None), data.num_samples), data,
                           cfg.data.get("_target_"), cfg.data.get("path"))
    if model is None:
        model = instantiate(cfg.model)
    model.requires_grad_(False)
    model.eval()
    data_dir, out_dir = Path(cfg.distill.dir), Path(cfg.out_dir)
    again = f"python scripts/train_drafter.py stage=data distill.dir={data_dir} (same overrides)"

    if cfg.stage in ("all", "data"):
        prompts = prompt_set.load(model, None)
        # every rank makes its shards (shard k on rank k % world), then waits on disk for the others' shards
        wait_s = 60.0 * dist_cfg.timeout_min
        generate_data(model, data, data_dir, prompts, model_config, progress=train_cfg.progress and
                      accelerator.is_main_process, prefix=cfg.head.prefix, rank=accelerator.process_index,
                      world=accelerator.num_processes, wait_timeout_s=wait_s)
        if accelerator.num_processes > 1:
            wait_for_data(data_dir, data, timeout_s=wait_s, world=accelerator.num_processes)
        if cfg.stage == "data":
            return None
    manifest = read_manifest(data_dir)
    if manifest is None or not data_complete(data_dir, data):
        raise FileNotFoundError(f"drafter training data not found or incomplete in {data_dir}; run " + again)
    val_prompts = cycle(list(val.prompts) if val.prompts else prompt_set.load(model, None),
                        val.num_images)
    return train(cfg, model, data, train_cfg, val, wandb_cfg, accelerator, manifest, data_dir, out_dir,
                 val_prompts)


def train(cfg: DictConfig, model: ImageARModel, data: DistillConfig, train_cfg: TrainConfig, val: ValConfig,
          wandb_cfg: WandbConfig, accelerator, manifest: dict[str, Any], data_dir: Path, out_dir: Path,
          val_prompts: list[str]) -> TrainResult:
    device = model.device
    main = accelerator.is_main_process
    if manifest_prefix(manifest) != cfg.head.prefix:
        raise ValueError(f"the drafter data in {data_dir} were made for head.prefix={manifest_prefix(manifest)} "
                         f"but head.prefix={cfg.head.prefix}; use the same convention, or regenerate the data "
                         "in another distill.dir")
    head = EagleHead(model, bias=bool(cfg.head.bias), own_embedding=False, init_seed=train_cfg.init_seed,
                     prefix=cfg.head.prefix)
    head.float()
    optimizer = torch.optim.AdamW(head.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                  weight_decay=train_cfg.weight_decay)
    net, optimizer, scheduler = accelerator.prepare(head, optimizer, lr_schedule(optimizer, train_cfg))
    start, cursor = 0, 0
    latest = latest_checkpoint(out_dir)
    earlier = earlier_checkpoint(out_dir)
    if earlier is not None and not cfg.resume:
        raise FileExistsError(f"{out_dir} holds checkpoints of an earlier run ({earlier.name}); pass resume=true "
                              "to continue it, or choose another out_dir")
    if cfg.resume and latest is None and earlier is not None:
        load_checkpoint(accelerator, earlier, head)  # says why a folder of the old format cannot be resumed
    train_names, val_names = split_shards(manifest, data.val_shards)
    sizes = [manifest["shards"][n]["stop"] - manifest["shards"][n]["start"] for n in train_names]
    autocast = train_cfg.bf16 and device.type == "cuda"
    training_info: dict[str, Any] = {"data_dir": str(data_dir), "source": data.source,
                                     "num_samples": data.num_samples, "total_steps": train_cfg.steps,
                                     "prefix": cfg.head.prefix, "train": asdict(train_cfg)}
    result = TrainResult(out_dir=out_dir, steps=train_cfg.steps, main_process=main)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    if wandb_cfg.mode != "disabled":
        import wandb

        init = {"entity": wandb_cfg.entity, "name": wandb_cfg.name, "tags": list(wandb_cfg.tags),
                "mode": wandb_cfg.mode, "dir": str(out_dir.resolve()),
                "settings": wandb.Settings(silent=True, console="off")}
        accelerator.init_trackers(wandb_cfg.project, config=OmegaConf.to_container(cfg, resolve=True),
                                  init_kwargs={"wandb": init})

    def evaluate(step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if main:
            metrics = validate(model, head, data_dir, val_names, val, val_prompts)
            accelerator.log(metrics, step=step)
        accelerator.wait_for_everyone()
        return metrics

    # the pre-training validation (`before`) travels with every step checkpoint, so a resumed run reports it
    if latest is not None:
        before = stored_before(latest)
        if before is None:
            # written before checkpoints stored `before`: the untrained head (same init_seed) measures it again
            before = evaluate(0) if val.at_start else {}
        result.before = before
        start, cursor = load_checkpoint(accelerator, latest, head)
    elif val.at_start:
        result.before = evaluate(0)
    training_info["before"] = result.before
    stream = ShardStream(data_dir, train_names, sizes, train_cfg.batch_size, cfg.seed, train_cfg.uncond_prob,
                         rank=accelerator.process_index, world=accelerator.num_processes, device=device,
                         cursor=cursor)
    bar = tqdm(total=train_cfg.steps, initial=start, desc="train drafter",
               disable=not (main and train_cfg.progress))
    head.train()
    for step in range(start, train_cfg.steps):
        micro = [stream.next_batch() for _ in range(train_cfg.grad_accum)]
        metrics = train_step(accelerator, net, head, micro, optimizer, scheduler, train_cfg, autocast)
        done = step + 1
        result.last = metrics
        bar.update(1)
        if done % train_cfg.log_every == 0 or done == train_cfg.steps:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", top1=f"{metrics['top1']:.3f}")
            accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=done)
        if done % train_cfg.checkpoint_every == 0 or done == train_cfg.steps:
            save_checkpoint(accelerator, out_dir, done, head, stream.cursor, train_cfg.keep_checkpoints,
                            training_info)
        if done % train_cfg.val_every == 0 and done != train_cfg.steps:
            evaluate(done)
    bar.close()
    head.eval()
    result.after = evaluate(train_cfg.steps)
    if main:
        save_eagle(head, out_dir, training={**training_info, "steps": train_cfg.steps,
                                            "before": result.before, "after": result.after})
        if accelerator.trackers:
            accelerator.get_tracker("wandb", unwrap=True).summary.update(
                {"before": result.before, "after": result.after})
    accelerator.end_training()  # closes the W&B run and leaves the process group
    return result


def summary(result: TrainResult, draft_len: int, seconds: float) -> str:
    """The one-line report of a training run: where the drafter went and its accepted length before/after."""
    before = result.before.get("val/accepted_length", float("nan"))
    after = result.after.get("val/accepted_length", float("nan"))
    return (f"drafter written to {result.out_dir} after {result.steps} steps in {seconds:.0f} s; accepted length "
            f"(sd, draft_len={draft_len}) before {before:.3f} -> after {after:.3f}; teacher-forced agreement after "
            f"{result.after.get('val/agreement', float('nan')):.3f}")
