"""Safe checkpoint reading and hub downloads shared by every model adapter and drafter.

Checkpoints are read with ``safetensors`` or ``torch.load(weights_only=True)``; nothing in a downloaded
file is ever executed. Missing files raise an error that names the file, where it was looked for and the
command that fetches it.

Adapters look every file up before they build a model (``missing_together`` collects what is absent, so one
error lists it all), and load state dicts with ``strict_load`` (exact key names and shapes, or an error that
names the differences).

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
    problem = local_file_missing(path, fetch_hint)
    if problem:
        raise MissingWeightsError(problem)
    path = Path(path).expanduser()
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


def local_file_missing(path: str | os.PathLike, fetch_hint: str | None = None) -> str | None:
    """Why the local weights file ``path`` cannot be read (where it was looked for, and ``fetch_hint``: how to
    get it), or None when it is there."""
    path = Path(path).expanduser()
    if path.is_file():
        return None
    hint = f" Fetch it with: {fetch_hint}" if fetch_hint else ""
    return f"weights file not found: {path} (looked in {path.parent.resolve()}).{hint}"


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


def missing_together(what: str, errors: Sequence[str]) -> None:
    """Raise one ``MissingWeightsError`` listing every missing file of ``what`` (nothing if ``errors`` is empty)."""
    if errors:
        raise MissingWeightsError(f"{what}: " + (errors[0] if len(errors) == 1 else
                                                 "".join(f"\n  - {e}" for e in errors)))


def hub_cached(repo_id: str, filenames: Sequence[str], revision: str | None = None) -> str | None:
    """Offline only: the first of ``filenames`` found in the Hugging Face cache for ``repo_id``; ``None`` if
    none is. Online it returns ``""`` (the files are downloaded on first use)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return ""
    for name in filenames:
        path = try_to_load_from_cache(repo_id, name, revision=revision)
        if isinstance(path, str):
            return path
    return None


def strict_load(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str, hint: str = "",
                assign: bool = False) -> None:
    """Load ``state`` into ``module`` with exact key names and shapes; otherwise raise a ``ValueError`` that
    names the missing, unexpected and reshaped keys, the ``source`` and ``hint`` (what to check)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = [f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or reshaped:
        raise ValueError(f"{source} does not match {type(module).__name__}'s parameters: missing {missing[:6]} "
                         f"({len(missing)}), unexpected {unexpected[:6]} ({len(unexpected)}), reshaped "
                         f"{reshaped[:6]} ({len(reshaped)})" + (f"; {hint}" if hint else ""))
    module.load_state_dict(state, strict=True, assign=assign)
