"""The metric protocol shared by every image-quality metric (``ImageMetric``, ``MeanScore``) and helpers.

One module per metric family (as torchmetrics and clean-fid lay them out);
``eval.metrics`` re-exports every name. Example: ``python run.py`` (the embedded model's metrics).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from coolsd.models.checkpoints import MissingWeightsError
from eval.metrics.intervals import shifted_interval, t_interval

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
PROTOCOLS = ("clean", "torch_fidelity")
COCO_VAL_URL = "http://images.cocodataset.org/zips/val2017.zip"
HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


# ------------------------------------------------------------------------------------ metric protocol


class ImageMetric:
    """What the runner needs of an image-quality metric besides ``preflight``: per-image values, point
    estimates from them, bootstrap replicates of each estimate and its interval (``eval/metrics/intervals.py``)."""

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
        return shifted_interval(estimate[key], replicates[key], level)

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
        return t_interval(values, level)



def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _missing_hub_file(what: str, repo: str, filename: str, where: str, setting: str) -> MissingWeightsError:
    return MissingWeightsError(
        f"{what}: {filename} from the Hugging Face repo {repo} is not available (looked in {where}). On a machine "
        f"with network access run: hf download {repo} {filename}; or give a local file: {setting}")


def _hub_cache(cache_dir: str | None) -> str:
    if cache_dir:
        return str(Path(cache_dir).expanduser())
    from huggingface_hub import constants

    return f"the Hugging Face cache {constants.HF_HUB_CACHE}"
