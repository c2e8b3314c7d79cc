"""Class accuracy (``ClassAccuracy``): the embedded model's Fashion-MNIST classifier, its stand-in for CLIP score.

Example: ``python run.py`` (the embedded model's default metrics).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from coolsd.required_files import RequiredFile
from eval.metrics.base import MeanScore
from eval.metrics.intervals import wilson_interval

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


def load_classifier(checkpoint: str) -> tuple[Classifier, Path]:
    """The shipped Fashion-MNIST classifier in eval mode, and the file it came from (a clear error if absent)."""
    from safetensors.torch import load_file

    path = Path(checkpoint).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"classifier checkpoint not found: {path} (the embedded model's; "
                                "python scripts/train_embedded.py --stages classifier trains it)")
    model = Classifier()
    model.load_state_dict(load_file(str(path)))
    return model.eval(), path


class ClassAccuracy(MeanScore):
    """Accuracy of a Fashion-MNIST classifier on generated images against their prompt class.

    It stands in for CLIP score on the embedded model (no CLIP weights exist offline) and is named
    "class accuracy" in every table, never "CLIP". Interval: Wilson's score interval of a proportion.
    """

    key = "class_accuracy"

    def __init__(self, checkpoint: str, class_names: Sequence[str]) -> None:
        self.model, _ = load_classifier(checkpoint)
        self.class_names = list(class_names)

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The classifier's checkpoint (the embedded model's, in ``coolsd/assets/embedded/``)."""
        return [RequiredFile("class-accuracy classifier", local=str(cfg["checkpoint"]),
                             manual="python scripts/train_embedded.py --stages classifier")]

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
        return wilson_interval(float(np.sum(values)), len(values), level)
