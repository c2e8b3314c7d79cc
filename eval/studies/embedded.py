"""The embedded default model's evaluation instruments and model card: a Fashion-MNIST classifier, the FID/KID
reference features, and the ``evaluate`` stage that measures the model and writes ``MODEL_CARD.md``.

Stages 5–7 of the embedded pipeline (``coolsd.training.embedded`` holds stages 1–4 and the driver):

5. ``classifier`` — a small CNN that scores generated images against their prompt class.
6. ``reference`` — Inception features of 500 and classifier features of 2,000 class-balanced test images (the
   FID/KID references of run.py's Inception and classifier-feature scores).
7. ``evaluate`` — the model card: FID/KID of 500 AR samples, real train images and tokenizer
   reconstructions vs 500 test images, class accuracy, accepted length and speedup of ``sd`` and COOL-SD.

Example::

    python scripts/train_embedded.py --stages evaluate --force evaluate
"""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.datasets import CLASS_NAMES
from coolsd.io import atomic_write_bytes
from coolsd.sampling import SamplingConfig
from coolsd.training.embedded import (CONFIGS, ROOT, ROUNDING, SAMPLING, STAGES, balanced_indices, cosine_lr,
                                      load_target, load_vq, model_overrides, sample_batch, save_json,
                                      save_safetensors, to_unit)
from eval.metrics import Classifier

CLASSIFIER_REFERENCE = "fid_reference_classifier_test2000.npy"
RELAXED_DELTAS = (1.1, 1.5, 2.0, 3.0)  # COOL-SD strengths measured by the model card (paper: 1.1 and 2.0)


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



def measure_speed(args) -> dict[str, float]:
    """Mean accepted length, batch-1 latency and speedup of ar, sd and COOL-SD at ``RELAXED_DELTAS`` (4-token
    chains) through run.py's machinery.

    The decoders take turns image by image (image i with every decoder, then image i + 1), so a slow spell of
    the machine hits all of them alike: timed one after another, AR's and sd's latencies drifted apart by
    20–30% between runs on a 2-core VM."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    torch.set_num_threads(args.threads)  # as run.py's default eval (configs/eval/embedded.yaml: 2)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
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
        f"{args.drafter_steps} steps (batch {args.drafter_batch}); stored in float16; see `drafter/config.json` |",
        f"| drafter_weak | the same head and pipeline on {args.weak_drafter_samples} images, "
        f"{args.weak_drafter_steps} steps: the claims experiment's weak drafter (`drafter=embedded_weak`; vanilla SD "
        "accepts 2.43 tokens per step on EAGLE-1's tree, 1.91 on the 4-token chain, 64 images) | stored in float16; "
        "see `drafter_weak/config.json` |",
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


