"""Fashion-MNIST (Xiao et al., 2017) from the IDX files of Debian's ``dataset-fashion-mnist`` package.

``apt-get install dataset-fashion-mnist`` puts ``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` under
``/usr/share/datasets/fashion-mnist/``; any folder with the same four files works (``--data-dir``).
Only the embedded model's training scripts read it; ``python run.py`` never needs it.

Example: ``images, labels = load_fashion_mnist("train")`` -> uint8 (60000, 28, 28), int64 (60000,).
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
CLASS_NAMES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped) -> numpy array of its dtype and shape."""
    path = Path(path)
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(split: str, data_dir: str | Path = DEFAULT_DIR) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 28, 28), labels int64 (N,)) of the ``train`` or ``test`` split."""
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = Path(data_dir).expanduser()
    paths = [folder / name for name in FILES[split]]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files missing: {missing}. Install them with "
                                "`apt-get install dataset-fashion-mnist` (Debian) or pass --data-dir")
    return read_idx(paths[0]), read_idx(paths[1]).astype(np.int64)
