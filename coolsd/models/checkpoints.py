"""Safe checkpoint reading and hub downloads shared by every model adapter and drafter.

Checkpoints are read with ``safetensors`` or ``torch.load(weights_only=True)``; nothing in a downloaded
file is ever executed. Missing files raise an error that names the file, where it was looked for and the
command that fetches it.

Example: ``load_state_dict("ckpts/t2i_XL_stage1_256.pt", nested_keys=("model",))``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

import torch


class MissingWeightsError(FileNotFoundError):
    """A weights file is absent; the message says where it was looked for and how to fetch it."""


def load_state_dict(
    path: str | os.PathLike,
    nested_keys: Sequence[str] = (),
    fetch_hint: str | None = None,
) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a torch pickle loaded with ``weights_only=True``.

    If the file holds a dict whose tensors sit under one of ``nested_keys`` (e.g. ``"model"`` in LlamaGen
    training checkpoints), that entry is returned.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        hint = f" Fetch it with: {fetch_hint}" if fetch_hint else ""
        raise MissingWeightsError(f"weights file not found: {path} (looked in {path.parent.resolve()}).{hint}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    # reference training checkpoints (LlamaGen) also pickle their argparse namespace under "args"
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    for key in nested_keys:
        if key in obj and isinstance(obj[key], dict):
            return obj[key]
    return obj


def hub_file(repo_id: str, filename: str, local_dir: str | None = None, revision: str | None = None) -> str:
    """Path of ``filename`` from the Hugging Face repo ``repo_id``, downloading it when online.

    Offline (``HF_HUB_OFFLINE=1`` or no network) a cached copy is used; when none exists the error names
    the file and the command that fetches it on a machine with network access.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if local_dir is not None:
        candidate = Path(local_dir).expanduser() / filename
        if candidate.is_file():
            return str(candidate)
    try:
        return hf_hub_download(repo_id=repo_id, filename=filename, revision=revision, local_dir=local_dir)
    except (LocalEntryNotFoundError, OSError) as err:
        where = f"{local_dir}/{filename}" if local_dir else f"the Hugging Face cache ({repo_id})"
        raise MissingWeightsError(
            f"{filename} from {repo_id} is not available (looked in {where}). On a machine with network "
            f"access run: hf download {repo_id} {filename}"
            + (f" --local-dir {local_dir}" if local_dir else "")
        ) from err
