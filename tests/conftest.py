"""Shared fixtures: offline environment, fast CPU settings, tiny models."""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("COOLSD_CACHE", tempfile.mkdtemp(prefix="coolsd-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import tiny_llamagen  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_model():
    """The random-weight class-conditional LlamaGen of ``configs/model/tiny.yaml`` (float64, CFG 2)."""
    return tiny_llamagen(dtype="float64")
