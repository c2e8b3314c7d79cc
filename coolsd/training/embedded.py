"""The embedded default model's training pipeline: VQ tokenizer, class-conditional LlamaGen target, EAGLE
drafter (the stages without evaluation; ``eval.studies.embedded`` adds the classifier, references and model
card).

Every artefact goes to ``coolsd/assets/embedded/`` (``--out``) as safetensors (+ JSON configs), small enough
to ship (< 25 MB together), and is what ``python run.py`` loads. The pipeline runs stage by stage
(``run_stages``); a stage whose output exists is skipped unless ``--force`` names it, so an interrupted run
resumes.

Stages:

1. ``vq`` — a VQ with LlamaGen's decoder and quantizer (``coolsd.models.vq``: 1 → 1 channels, 28×28 → 7×7
   codes, L2-normalised codebook) and a patch-local encoder (``encoder: patch``: each code sees only its own
   4×4 pixels, so blank background is always the same code, as with a k-means patch tokenizer; LlamaGen's
   image-wide encoder spread blank patches over ~580 codes and left the target's distributions flat),
   trained with L1 + L2 reconstruction and the VQ/commitment losses; unused codes are restarted from encoder
   outputs during training.
2. ``tokens`` — the train and test images encoded to 49 codes each (kept in the work folder).
3. ``target`` — LlamaGen GPT (``coolsd.models.llamagen``, class-conditional, a null class for CFG with 10%
   label dropout): AdamW, warm-up + cosine, gradient clipping, a wall-clock budget.
4. ``drafter`` — ``coolsd.training.drafter`` on the new target (teacher-forced real training images; the
   teacher-forced features are regenerated every time, since they depend on the target's weights), stored in
   float16.
5. ``drafter_weak`` — the same on 1,000 sequences for 85 steps: the claims experiment's weak drafter
   (vanilla SD on EAGLE-1's tree accepts about 2.4 tokens per step, the paper's regime).
6.–8. ``classifier``, ``reference``, ``evaluate``: ``eval.studies.embedded``.

The VQ, target and classifier loops are plain single-process loops on a CPU (no process group, no gradient
accumulation, no checkpoints to resume: a stage reruns whole), so they do not use ``accelerate``; their
learning rate follows ``cosine_lr``, whose progress is the larger of the step fraction and the elapsed
share of a wall-clock budget (``--target-minutes``), which the step-indexed ``transformers`` schedules
cannot express.

Example (2 CPU cores, about 60 minutes with the evaluation)::

    python scripts/train_embedded.py
"""
from __future__ import annotations

import io
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.datasets import load_fashion_mnist
from coolsd.io import atomic_write_bytes
from coolsd.kv_cache import StaticKVCache
from coolsd.models.llamagen import GPTConfig, Transformer
from coolsd.models.vq import VQConfig, VQModel
from coolsd.sampling import SamplingConfig, sample, stream_probs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

ASSETS = ROOT / "coolsd" / "assets" / "embedded"
STAGES = ("vq", "tokens", "target", "drafter", "drafter_weak", "classifier", "reference", "evaluate")

# One source of truth: the model config that run.py uses.
MODEL_YAML = CONFIGS / "model" / "embedded.yaml"
_MODEL = OmegaConf.to_container(OmegaConf.load(MODEL_YAML), resolve=False)
VQ_CONFIG, GPT_CONFIG, SAMPLING = _MODEL["vq"], _MODEL["gpt"], _MODEL["sampling"]
ROUNDING = _MODEL["pixel_rounding"]  # decoded pixels -> uint8 as run.py does (coolsd.models.base.pixels_to_uint8)


# -- small helpers -------------------------------------------------------------------------------------------
def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}))


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def save_json(path: Path, obj: dict) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def to_unit(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> float (N, 1, 28, 28) in [-1, 1]."""
    return torch.from_numpy(images).float().div(127.5).sub(1.0).unsqueeze(1)


def balanced_indices(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picks = [rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(10)]
    return np.concatenate(picks)


def cosine_lr(step: int, total: int, warmup: int, base: float, floor: float,
              time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine from ``base`` to ``floor * base``. Progress is the larger of the step
    fraction and ``time_fraction`` (elapsed / wall-clock budget), so a run cut short by its budget still
    anneals fully instead of stopping at a high learning rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return floor * base + (1 - floor) * base * 0.5 * (1 + math.cos(math.pi * progress))


# -- stage 1: VQ ---------------------------------------------------------------------------------------------
def train_vq(args, train_images: np.ndarray) -> None:
    torch.manual_seed(args.seed)
    vq = VQModel(VQConfig(**VQ_CONFIG))
    opt = torch.optim.Adam(vq.parameters(), lr=args.vq_lr, betas=(0.9, 0.99))
    data = to_unit(train_images)
    usage = torch.zeros(VQ_CONFIG["codebook_size"])
    start = time.time()
    bar = tqdm(range(args.vq_steps), desc="vq", dynamic_ncols=True)
    for step in bar:
        idx = torch.randint(len(data), (args.vq_batch,))
        x = data[idx]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.vq_steps, 100, args.vq_lr, 0.05)
        h = vq.quant_conv(vq.encoder(x))  # (B, D, 7, 7)
        quant, (vq_loss, commit_loss, ent_loss, _), (_, _, codes) = vq.quantize(h)
        rec = vq.decode(quant)
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + vq_loss + commit_loss + ent_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            usage.mul_(0.99).index_add_(0, codes, torch.ones_like(codes, dtype=torch.float))
            if step % args.vq_restart_every == args.vq_restart_every - 1 and step < 0.8 * args.vq_steps:
                dead = (usage < 1e-3).nonzero().flatten()
                if dead.numel():  # restart unused codes at random encoder outputs of this batch
                    z = F.normalize(h.permute(0, 2, 3, 1).reshape(-1, h.shape[1]), dim=-1)  # (B*49, D)
                    picks = z[torch.randint(len(z), (dead.numel(),))]
                    vq.quantize.embedding.weight[dead] = picks + 0.01 * torch.randn_like(picks)
                    usage[dead] = 1.0
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", used=int((usage > 1e-3).sum()))
    vq.eval()
    save_safetensors(args.out / "vq.safetensors", vq.state_dict())
    save_json(args.out / "vq_config.json", {**VQ_CONFIG, "steps": args.vq_steps, "seconds": time.time() - start})


def load_vq(args) -> VQModel:
    vq = VQModel(VQConfig(**VQ_CONFIG))
    vq.load_state_dict(load_safetensors(args.out / "vq.safetensors"))
    return vq.eval()


# -- stage 2: tokens -----------------------------------------------------------------------------------------
def encode_all(vq: VQModel, images: np.ndarray, batch: int = 1000) -> np.ndarray:
    codes = [vq.encode_to_indices(to_unit(images[i : i + batch])) for i in range(0, len(images), batch)]
    return torch.cat(codes).numpy().astype(np.int16)


def make_tokens(args, train, test) -> None:
    vq = load_vq(args)
    save_npz(args.work / "tokens.npz", train=encode_all(vq, train[0]), train_labels=train[1],
             test=encode_all(vq, test[0]), test_labels=test[1])


# -- stage 3: target -----------------------------------------------------------------------------------------
def train_target(args) -> None:
    tok = np.load(args.work / "tokens.npz")
    codes = torch.from_numpy(tok["train"].astype(np.int64))
    labels = torch.from_numpy(tok["train_labels"])
    torch.manual_seed(args.seed)
    gpt = Transformer(GPTConfig(**GPT_CONFIG))
    gpt.init_weights(0.02, zero_output=True)
    decay = [p for n, p in gpt.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in gpt.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.target_lr, betas=(0.9, 0.95))
    gpt.train()
    start = time.time()
    losses: list[float] = []
    bar = tqdm(range(args.target_steps), desc="target", dynamic_ncols=True)
    step = 0
    budget = args.target_minutes * 60
    for step in bar:
        elapsed = time.time() - start
        if elapsed > budget:
            break
        idx = torch.randint(len(codes), (args.target_batch,))
        x, y = codes[idx], labels[idx]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.target_steps, 50, args.target_lr, 0.1, elapsed / budget)
        logits, _ = gpt.forward_train(x, y)  # (B, 49, V): output n predicts token n
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-25:]):.3f}")
    gpt.eval()
    state = {k: v.half() for k, v in gpt.state_dict().items()}  # fp16 storage keeps the repo small
    save_safetensors(args.out / "target.safetensors", state)
    save_json(args.out / "target_config.json", {**GPT_CONFIG, "steps": step + 1, "seconds": time.time() - start,
                                                "final_loss_ema": float(np.mean(losses[-25:]))})


def load_target(args) -> Transformer:
    gpt = Transformer(GPTConfig(**GPT_CONFIG))
    gpt.load_state_dict({k: v.float() for k, v in load_safetensors(args.out / "target.safetensors").items()},
                        strict=False)
    return gpt.eval()


@torch.inference_mode()
def sample_batch(gpt: Transformer, labels: torch.Tensor, cfg: SamplingConfig, seed: int) -> torch.Tensor:
    """Batched AR samples (B, 49) with CFG through the shared sampling pipeline (evaluation only)."""
    b = len(labels)
    c = gpt.config
    cache = StaticKVCache(num_layers=c.n_layer, batch=2 * b, num_heads=c.n_head, max_len=1 + c.block_size,
                          head_dim=c.dim // c.n_head, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    cond = torch.cat([labels, torch.full_like(labels, c.num_classes)])  # [cond; uncond]
    h = gpt.condition(cond)
    hidden = gpt.forward_hidden(h, torch.arange(1), cache, cache.begin_block(1))
    out = []
    for i in range(c.block_size):
        logits = gpt.output(hidden[:, -1]).float().view(2, b, -1)  # (S, B, V)
        x = sample(stream_probs(logits, cfg), gen)  # (B,)
        out.append(x)
        if i + 1 < c.block_size:
            emb = gpt.tok_embeddings(torch.cat([x, x]))[:, None]
            hidden = gpt.forward_hidden(emb, torch.tensor([1 + i]), cache, cache.begin_block(1))
    return torch.stack(out, 1)


def model_overrides(args) -> list[str]:
    """Point model=embedded at this run's artefacts (they may live outside the package)."""
    return [f"model.gpt_checkpoint={args.out / 'target.safetensors'}", f"model.vq_checkpoint={args.out / 'vq.safetensors'}"]


# -- stage 4: drafters ---------------------------------------------------------------------------------------
def train_drafter(args, name: str = "drafter", samples: int | None = None, steps: int | None = None) -> None:
    """Self-distil an EAGLE head into ``<out>/<name>`` on ``samples`` teacher-forced training images for
    ``steps`` steps (defaults: ``--drafter-samples``, ``--drafter-steps``), then store it in float16.

    ``drafter`` is the default drafter; ``drafter_weak`` (``--weak-drafter-samples/steps``: 1,000 and 85) the claims
    experiment's weaker one, chosen so that vanilla SD on EAGLE-1's tree accepts about 2.4 tokens per step."""
    from hydra import compose, initialize_config_dir

    from coolsd.training.drafter import run, summary

    samples = args.drafter_samples if samples is None else samples
    steps = args.drafter_steps if steps is None else steps
    tok = np.load(args.work / "tokens.npz")
    rng = np.random.default_rng(args.seed)
    pick = rng.choice(len(tok["train"]), samples, replace=False)
    # Teacher-forced features depend on the target's weights: a rerun after retraining the target starts the
    # drafter's data afresh (the training refuses stale samples; regenerating them takes about a minute).
    data_dir = args.work / f"{name}_data"
    shutil.rmtree(data_dir, ignore_errors=True)
    codes_path = args.work / f"{name}_codes.npz"
    save_npz(codes_path, codes=tok["train"][pick].astype(np.int64), labels=tok["train_labels"][pick])
    overrides = ["model=embedded", *model_overrides(args), f"out_dir={args.out / name}",
                 "distill.source=images", f"distill.images_path={codes_path}",
                 f"distill.num_samples={samples}", f"distill.dir={data_dir}",
                 f"train.steps={steps}", f"train.batch_size={args.drafter_batch}",
                 "train.lr=1e-3", f"train.warmup_steps={min(50, steps // 4)}", f"train.p_w={args.drafter_p_w}",
                 f"train.noise_std={args.drafter_noise}",
                 "train.uncond_prob=0.3", "train.checkpoint_every=100000", "train.grad_clip=0.5",
                 "val.num_images=10", "wandb.mode=disabled",
                 # --seed also seeds the head's initialisation and the batch order (0: the shipped drafters)
                 f"seed={args.seed}", f"train.init_seed={args.seed}"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train_drafter", overrides=overrides)
    start = time.perf_counter()
    print(summary(run(cfg), cfg.val.draft_len, time.perf_counter() - start), flush=True)
    shutil.rmtree(args.out / name / "steps", ignore_errors=True)  # optimizer state: not shipped
    store_float16(args.out / name)


def store_float16(directory: Path) -> None:
    """Rewrite a drafter checkpoint's weights in float16 (as the target is shipped; they are computed in the
    target's dtype), halving it so both drafters fit the 25 MB of shipped assets; ``config.json`` says so."""
    from safetensors.torch import load_file, save

    from coolsd.drafters.eagle import CONFIG_FILE, FORMAT, WEIGHTS_FILE
    from coolsd.io import atomic_write_bytes

    state = load_file(str(directory / WEIGHTS_FILE))
    atomic_write_bytes(directory / WEIGHTS_FILE,
                       save({k: v.half().contiguous() for k, v in state.items()}, metadata={"format": FORMAT}))
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["weights_dtype"] = ("float16 (trained in float32, stored in float16 like target.safetensors; computed "
                               "in the target's dtype)")
    save_json(directory / CONFIG_FILE, config)


# -- driver --------------------------------------------------------------------------------------------------
def load_data(data_dir: str | Path, limit: int | None = None):
    """``(train, test)``, each ``(images uint8 (N, 28, 28), labels (N,))``; ``limit``: the first N of each."""
    train = load_fashion_mnist("train", data_dir)
    test = load_fashion_mnist("test", data_dir)
    if limit:
        train, test = (train[0][:limit], train[1][:limit]), (test[0][:limit], test[1][:limit])
    return train, test


def stage_outputs(args) -> dict[str, Path]:
    """The file each stage writes; a stage whose file exists is skipped unless ``--force`` names it."""
    return {"vq": args.out / "vq.safetensors", "tokens": args.work / "tokens.npz",
            "target": args.out / "target.safetensors", "drafter": args.out / "drafter" / "model.safetensors",
            "drafter_weak": args.out / "drafter_weak" / "model.safetensors",
            "classifier": args.out / "classifier.safetensors",
            "reference": args.out / "fid_reference_test500.npy", "evaluate": args.out / "MODEL_CARD.md"}


def record_stage_time(args, stage: str, seconds: float) -> None:
    """Wall-clock seconds per stage (the latest run of each) in ``timings.json``, for the model card."""
    path = args.out / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[stage] = {"seconds": round(seconds, 1), "threads": args.threads}
    save_json(path, timings)


def run_stages(args, steps: dict[str, Callable[[], None]]) -> None:
    """Run ``steps[stage]()`` for the chosen stages, in pipeline order, recording each one's wall time."""
    outputs = stage_outputs(args)
    for stage in STAGES:
        if stage not in args.stages or (outputs[stage].exists() and stage not in args.force):
            continue
        t0 = time.time()
        steps[stage]()
        seconds = time.time() - t0
        print(f"[train_embedded] {stage} done in {seconds:.0f} s", flush=True)
        record_stage_time(args, stage, seconds)
