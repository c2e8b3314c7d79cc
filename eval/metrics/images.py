"""Image paths of the metrics: centre crops and resizes (torch-fidelity's and LANTERN's), reference folders.

Written after GaParmar/clean-fid and jadohu/LANTERN
``entrypoints/eval_fid_clip.py`` (see ``eval.metrics``). Example: ``lantern_crop_resize(image, 256)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from eval.metrics.base import COCO_VAL_URL, IMAGE_SUFFIXES

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
