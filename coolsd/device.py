"""Which device a model runs on: ``model.device`` (``auto`` | ``cpu`` | ``cuda[:k]`` | ``meta``) and the rule that a
model needing a GPU never falls back to the CPU in silence.

A model config whose published weights are billions of parameters (Janus-Pro-1B/7B, LlamaGen T2I-XL,
Lumina-mGPT-7B) says ``requires_cuda: true``. With its published weights (``pretrained: true``) and
``device: auto`` on a machine where CUDA is not usable, it stops before any weight is read, with the reason:
the torch build's CUDA version (``torch.version.cuda``; None = a CPU-only wheel), the NVIDIA driver found
(``/proc/driver/nvidia/version``), the device count and the warning CUDA's initialisation gave (e.g. "The
NVIDIA driver on your system is too old"). ``model.device=cpu`` runs it on the CPU anyway, on purpose.
``device: cuda`` without CUDA stops with the same reason. The embedded and tiny models (no ``requires_cuda``)
keep ``auto`` = CUDA if available, else the CPU. Random-weight instances of the real configs
(``pretrained: false``, tests and plumbing) are not held to the rule.

Example: ``python run.py model=janus_pro_1b model.device=cpu`` (on purpose on a CPU).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

DRIVER_FILE = Path("/proc/driver/nvidia/version")


class DeviceError(RuntimeError):
    """The configured device cannot be used; the message says why and what to set."""


_CUDA_WARNINGS: list[str] = []  # what CUDA's initialisation warned, kept: torch warns only once per process


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, keeping the warning it gives (a driver too old, none found) for
    ``cuda_diagnosis``; the warning still reaches the user."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    for w in caught:
        text = str(w.message).strip()
        if "cuda" in text.lower() and text not in _CUDA_WARNINGS:
            _CUDA_WARNINGS.append(text)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return available


def cuda_diagnosis() -> str:
    """Why CUDA is (not) usable here: torch build, driver, device count and CUDA's own warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        available = cuda_available()
    count = torch.cuda.device_count() if available else 0
    messages = list(_CUDA_WARNINGS)
    build = torch.version.cuda
    parts = [f"torch {torch.__version__} built with CUDA {build}" if build else
             f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"]
    driver = DRIVER_FILE.read_text(errors="replace").splitlines()[0].strip() if DRIVER_FILE.is_file() else None
    parts.append(f"NVIDIA driver: {driver}" if driver else f"no NVIDIA driver found ({DRIVER_FILE} is absent)")
    parts.append(f"torch.cuda.is_available() = {available}, {count} device(s)")
    if messages:
        parts.append("CUDA initialisation said: " + " | ".join(messages))
    return "; ".join(parts)


def resolve_device(device: str, requires_cuda: bool = False, key: str = "model.device") -> torch.device:
    """``auto`` -> CUDA if available else the CPU, unless ``requires_cuda`` (then a ``DeviceError`` with
    ``cuda_diagnosis``); ``cuda[:k]`` without CUDA -> ``DeviceError``; anything else as given."""
    if device == "auto":
        if cuda_available():
            return torch.device("cuda")
        if requires_cuda:
            raise DeviceError(
                f"{key}=auto found no usable CUDA device, and this model needs one (requires_cuda: true; its "
                f"published weights take days per table row on a CPU): {cuda_diagnosis()}. Fix the driver or "
                f"the torch build (pip install torch --index-url https://download.pytorch.org/whl/cu<version>), "
                f"or set {key}=cpu to run it on the CPU on purpose. Nothing was loaded")
        return torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not cuda_available():
        raise DeviceError(f"{key}={device} but CUDA is not usable here: {cuda_diagnosis()}; set {key}=cpu "
                          "(or auto) to run on the CPU")
    return resolved


def check_model_device(model_cfg: Mapping[str, Any]) -> torch.device:
    """The device a model config will run on, from its keys alone (``device``, ``requires_cuda``,
    ``pretrained``), before anything is built; raises ``DeviceError`` as ``resolve_device``."""
    requires = bool(model_cfg.get("requires_cuda", False)) and bool(model_cfg.get("pretrained", True))
    return resolve_device(str(model_cfg.get("device", "auto")), requires_cuda=requires)
