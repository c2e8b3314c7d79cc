"""Every file one ``run.py`` invocation needs, from its composed config alone: listed, looked up, fetched.

The list is the union of what each configured class declares (``required_files(cfg)`` classmethods, walked by
``coolsd.required_files.files_of``): the target model (weights, VQ, text encoder, tokenizer), the drafter of
every decoder the run compares (``eval.run.suite.select_decoders``: ``decoder=sjd`` alone needs no drafter),
the prompt set (COCO captions) and every metric of ``eval.metrics`` (FID reference images and Inception,
CLIP, ImageReward, HPS weights). ``scripts/prefetch.py`` runs it on a login node (fetching what the hub
gives); ``eval.run.experiment`` runs ``check_run_files`` before the target model is built, so a job stops in
seconds with the file, where it was looked for and the command, instead of after loading a 7B model.

Example: ``python scripts/prefetch.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k``.
"""
from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.required_files import (MissingFilesError, RequiredFile, Resolution, files_of, missing_message,
                                   resolve, unique)


def run_files(cfg: DictConfig, decoder_cfgs: Mapping[str, Any]) -> list[RequiredFile]:
    """The files of a run: model, the drafters of ``decoder_cfgs`` (name -> decoder config), prompts, metrics."""
    files = files_of(cfg.model, "model")
    for name, decoder in decoder_cfgs.items():
        files += files_of(decoder, f"decoder[{name}]")
    files += files_of(cfg.data, "data")
    files += files_of(cfg.eval, "eval")
    return unique(files)


def resolve_all(files: list[RequiredFile], download: bool = True) -> list[Resolution]:
    """``resolve`` each file: present, fetched (hub download, or a local conversion), or missing with why."""
    return [resolve(f, download=download) for f in files]


def prefetch_command(overrides: list[str] | None) -> str:
    """The command that fetches a run's files, with the run's own overrides."""
    return " ".join(["python scripts/prefetch.py", *(shlex.quote(o) for o in overrides or [])])


def check_run_files(cfg: DictConfig, decoder_cfgs: Mapping[str, Any], overrides: list[str] | None = None) -> None:
    """Raise ``MissingFilesError`` naming every missing file of the run (where it was looked for, its fetch
    command and ``python scripts/prefetch.py <overrides>``); online, hub files are fetched now (a download that
    fails then fails here, before anything is built)."""
    rows = resolve_all(run_files(cfg, decoder_cfgs), download=True)
    missing = [r for r in rows if not r.ok]
    if missing:
        raise MissingFilesError(missing_message(missing, prefetch_command(overrides)))


def run_overrides() -> list[str]:
    """This process's Hydra command-line overrides (``[]`` outside a Hydra app), for the prefetch command."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
