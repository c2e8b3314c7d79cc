"""The embedded default model: the shipped checkpoints load and generate, the default run works end to end on
a reduced prompt count, and the training pipeline runs a few steps on a small slice of data made here
(the suite never needs Debian's Fashion-MNIST package)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from baselines.exact import ExactRule
from coolsd import ASSET_DIR
from coolsd.datasets import CLASS_NAMES, load_fashion_mnist, read_idx
from coolsd.decoding import Decoder
from tests.helpers import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ASSET_DIR / "embedded"


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def compose_default(overrides=()):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_shipped_artefacts_are_small_and_documented():
    files = [p for p in ASSETS.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"target.safetensors", "vq.safetensors", "classifier.safetensors", "fid_reference_test500.npy",
            "MODEL_CARD.md"} <= names
    assert (ASSETS / "drafter" / "config.json").is_file()
    assert sum(p.stat().st_size for p in files) <= 25 * 10**6  # the 25 MB, decimal
    card = (ASSETS / "MODEL_CARD.md").read_text()
    assert "python scripts/train_embedded.py" in card and "class accuracy" in card.lower()


def test_shipped_checkpoints_load_and_generate_an_image():
    cfg = compose_default()
    assert cfg.model.gpt_checkpoint.endswith("embedded/target.safetensors")
    model = instantiate(cfg.model)
    assert model.class_names == list(CLASS_NAMES) and model.grid == (7, 7)
    sd = instantiate(cfg.suite.sd, model=model)
    gen = sd.generate("sneaker", 0)
    assert gen.tokens.shape == (49,) and int(gen.tokens.max()) < model.codebook_size
    assert gen.stats.mean_accepted_length > 1.5  # a trained drafter, not a random one
    image = model.decode_image(gen.tokens)
    assert image.dtype == torch.uint8 and image.shape == (1, 28, 28)
    ar = Decoder("ar", model, ExactRule())
    assert ar.generate("bag", 0).tokens.shape == (49,)


def test_default_run_end_to_end_on_few_prompts(tmp_path):
    proc = subprocess.run([sys.executable, "run.py", "eval.num_prompts=2", "logger=none", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert set(record["per_decoder"]) == {"ar", "sd", "lantern", "lantern_pp", "sjd", "coolsd"}
    for metrics in record["per_decoder"].values():
        for key in ("mean_accepted_length", "speedup", "fid_classifier", "kid_classifier", "class_accuracy", "tv_per_step"):
            assert key in metrics
    assert (tmp_path / "speed_quality.png").stat().st_size > 0
    assert "class accuracy" in (tmp_path / "table.md").read_text()


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def fake_fashion_mnist(folder: Path, n_train: int = 600, n_test: int = 600) -> None:
    """Synthetic 28x28 images with class-dependent stripes, in the IDX layout of the real files."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, :, 2 * c : 2 * c + 6] = 200
        images = np.clip(images + rng.integers(0, 30, images.shape), 0, 255)
        write_idx(folder / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{split}-labels-idx1-ubyte.gz", labels)


def test_idx_reader_round_trip(tmp_path):
    fake_fashion_mnist(tmp_path, 20, 10)
    images, labels = load_fashion_mnist("train", tmp_path)
    assert images.shape == (20, 28, 28) and labels.tolist() == [i % 10 for i in range(20)]
    assert read_idx(tmp_path / "t10k-labels-idx1-ubyte.gz").shape == (10,)
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist("train", tmp_path / "missing")


@pytest.mark.slow  # CI runs it in its -m slow pass (.ci/run)
def test_training_pipeline_runs_a_few_steps_on_fake_data(tmp_path):
    data, out, work = tmp_path / "data", tmp_path / "assets", tmp_path / "work"
    fake_fashion_mnist(data)
    proc = subprocess.run([sys.executable, "scripts/train_embedded.py", "--data-dir", str(data), "--out", str(out),
                           "--work", str(work), "--stages", "vq", "tokens", "target", "drafter", "drafter_weak",
                           "classifier", "--vq-steps", "3", "--vq-batch", "8", "--target-steps", "3", "--target-batch", "8",
                           "--drafter-samples", "32", "--drafter-steps", "2", "--drafter-batch", "8",
                           "--weak-drafter-samples", "16", "--weak-drafter-steps", "1", "--classifier-epochs", "1",
                           "--threads", "1"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("vq.safetensors", "target.safetensors", "classifier.safetensors", "drafter/model.safetensors",
                 "drafter_weak/model.safetensors"):
        assert (out / name).is_file(), name
    from safetensors.torch import load_file
    for name in ("drafter", "drafter_weak"):  # shipped in float16, and they still load
        assert {v.dtype for v in load_file(str(out / name / "model.safetensors")).values()} == {torch.float16}
        assert "float16" in json.loads((out / name / "config.json").read_text())["weights_dtype"]
    tokens = np.load(work / "tokens.npz")
    assert tokens["train"].shape == (600, 49) and int(tokens["train"].max()) < 1024
    timings = json.loads((out / "timings.json").read_text())  # the model card's per-stage training time
    assert set(timings) == {"vq", "tokens", "target", "drafter", "drafter_weak", "classifier"}
    assert all(t["seconds"] > 0 and t["threads"] == 1 for t in timings.values())
