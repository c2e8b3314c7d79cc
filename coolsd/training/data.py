"""Distillation data for EAGLE drafters: the stored samples and the batches training streams from them.

For each sample, a token sequence (``distill.source=self_distill``: sampled by the target itself with the
AR decoder under the prompts of the ``data`` group, e.g. ``data=file data.path=prompts.txt``; ``images``: codes
of real images, given as codes or encoded through the adapter's VQ) is teacher-forced through the target
(prefill + one forward over all image tokens) and the last-layer hidden states of every CFG stream are stored:
``hidden`` (S, N+1, H) = ``f_{-1} .. f_{N-1}``, or (S, C+N, H) with every condition slot when
``head.prefix=all`` (the EAGLE drafter's prefix convention, ``coolsd.drafters.eagle``: LANTERN's, whose
training data prepend 119 zero ids to the codes of LlamaGen T2I's 120 caption slots). Samples go into
safetensors shards written atomically; ``manifest.json`` lists the finished shards and a rerun skips them
(resumable; sample ``i`` always uses seed ``distill.seed + i``, so a regenerated shard is identical).

**At scale** (``distill.batch_size``, ranks): the target samples ``distill.batch_size`` sequences per
``Decoder.generate_batch`` call (AR, every image in step; each sample still uses its own seed stream, so on a
batch-invariant model a sample is bitwise the one a batch of 1 gives: ``tests/test_distill.py``), and the
hidden states come from one batched teacher-forced pass per ``distill.batch_size`` samples (at most 64).
Shards are fixed by sample index and shard ``k`` belongs to rank ``k % world`` (the rank and world of
``coolsd.launch.launch_environment``: torchrun, a SLURM task or a submitit task, handed to ``accelerate``), so the
data do not depend on the number of ranks. Each shard is written atomically and carries the digest of the
settings that made it (``fingerprint_sha1`` in its metadata); ranks add their shards to ``manifest.json`` under a
file lock (``filelock``). A rerun skips the listed shards and refuses one made with other settings.

**Disk** (``storage_need``): before the first shard is written, rank 0 prints what the missing shards will take,
computed from the shapes (``hidden`` (S, P+N, H) in ``distill.storage_dtype`` plus the int64 codes, per sample),
and the free space of ``distill.dir``; when the need exceeds it, every rank stops before writing
(``distill.low_disk=refuse``; ``warn`` goes on).

**Waits** (several ranks): a rank whose shards are done polls the folder for the others' (``wait_for_data``); after
``timeout_s`` without a new shard it stops with the missing shards and the ranks that were to write them. The
manifest lock is waited for at most as long.

``ShardStream`` turns the shards into training batches of pairs ``(f_t, x_{t+1}) -> f_{t+1}``: an endless,
seeded, resumable stream split across data-parallel ranks (``coolsd.training.drafter`` trains on it).

Written after jadohu/LANTERN ``entrypoints/generate_train_data.py`` and
``entrypoints/train_drafter/data_utils.py`` (EAGLE's recipe).

Example::

    python scripts/train_drafter.py model=tiny stage=data distill.num_samples=4096
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from coolsd.acceptance import ExactRule
from coolsd.decoding import Decoder
from coolsd.fingerprint import file_digest, weights_digest
from coolsd.io import atomic_write_bytes, remove_stale_temps
from coolsd.models.base import ImageARModel, check_prefix
from coolsd.models.checkpoints import load_state_dict

DATA_FORMAT = "coolsd-drafter-data"
MANIFEST = "manifest.json"
SOURCES = ("self_distill", "images")
OVERLAP_MODES = ("refuse", "warn")  # distillation prompts that are also evaluation prompts
LOW_DISK_MODES = ("refuse", "warn")  # the missing shards need more than the free space of distill.dir
SHARD_LOCK = ".manifest.lock"  # ranks add their shards to manifest.json under this file lock
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DistillConfig:
    """``distill.*``: where training samples live and how they are made (see the module docstring)."""

    dir: str | None = None
    source: str = "self_distill"
    num_samples: int = 256
    shard_size: int = 32
    seed: int = 0
    storage_dtype: str = "bfloat16"
    images_path: str | None = None
    val_shards: int = 1
    batch_size: int = 16
    eval_overlap: str = "refuse"
    eval_prompt_files: Sequence[str] = ()
    wait_poll_s: float = 10.0
    low_disk: str = "refuse"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"distill.source must be one of {SOURCES}, got {self.source!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"distill.storage_dtype must be one of {sorted(STORAGE_DTYPES)}, "
                             f"got {self.storage_dtype!r}")
        if self.num_samples < 1 or self.shard_size < 1:
            raise ValueError("distill.num_samples and distill.shard_size must be >= 1")
        if self.source == "images" and not self.images_path:
            raise ValueError("distill.source=images needs distill.images_path (a .safetensors/.pt/.npz file with "
                             "`codes` (M, N) or `images` (M, 3, H, W), optionally `labels` (M,))")
        if self.val_shards < 0:
            raise ValueError(f"distill.val_shards must be >= 0, got {self.val_shards}")
        if self.batch_size < 1:
            raise ValueError(f"distill.batch_size must be >= 1, got {self.batch_size}")
        if self.eval_overlap not in OVERLAP_MODES:
            raise ValueError(f"distill.eval_overlap must be one of {OVERLAP_MODES}, "
                             f"got {self.eval_overlap!r}")
        if self.low_disk not in LOW_DISK_MODES:
            raise ValueError(f"distill.low_disk must be one of {LOW_DISK_MODES}, got {self.low_disk!r}")


# -- data generation -------------------------------------------------------------------------------------
TEACHER_BATCH = 64  # at most this many sequences per teacher-forced pass (ImageARModel.teacher_force)


def cycle(prompts: Sequence[str], count: int) -> list[str]:
    """``count`` prompts, cycling through ``prompts``."""
    if not prompts:
        raise ValueError("the prompt set is empty: choose prompts with data=<classes|file|fixed|coco> "
                         "(e.g. data=file data.path=prompts.txt)")
    return [prompts[i % len(prompts)] for i in range(count)]


def load_image_codes(model: ImageARModel, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes (M, N) and optional labels (M,) from a codes/images file; images go through ``model.vq``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"distill.images_path not found: {p}")
    if p.suffix == ".npz":
        import numpy as np

        with np.load(p) as arrays:
            content = {k: torch.from_numpy(arrays[k]) for k in arrays.files}
    else:
        content = load_state_dict(p)
    labels = content.get("labels")
    if "codes" in content:
        codes = content["codes"].long()
    elif "images" in content:
        vq = getattr(model, "vq", None)
        if vq is None:
            raise ValueError(f"{type(model).__name__} has no `vq` to encode images; store `codes` instead")
        images = content["images"]
        if images.dtype == torch.uint8:
            images = images.float() / 127.5 - 1.0  # [0, 255] -> [-1, 1]
        weight = next(vq.parameters())
        with torch.inference_mode():
            codes = torch.cat([vq.encode_to_indices(images[i : i + 16].to(weight.device, weight.dtype)).cpu()
                               for i in range(0, images.shape[0], 16)])
    else:
        raise ValueError(f"{p} holds neither `codes` (M, N) nor `images` (M, C, H, W); found {sorted(content)}")
    if codes.dim() != 2 or codes.shape[1] != model.num_image_tokens:
        raise ValueError(f"codes from {p} have shape {tuple(codes.shape)}, expected (M, {model.num_image_tokens})")
    if codes.min() < 0 or codes.max() >= model.codebook_size:
        raise ValueError(f"codes from {p} fall outside the codebook [0, {model.codebook_size})")
    return codes, labels


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` holds samples ``[start, stop)`` in file ``name``."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"shard_{self.index:05d}.safetensors"


def shard_specs(num_samples: int, shard_size: int) -> list[ShardSpec]:
    return [ShardSpec(i, s, min(s + shard_size, num_samples))
            for i, s in enumerate(range(0, num_samples, shard_size))]


def data_fingerprint(model: ImageARModel, data: DistillConfig, prompts: Sequence[str],
                     model_config: dict | None, prefix: str = "last") -> dict[str, Any]:
    """What the stored samples depend on; a resumed run must match it (including the target's weights and
    the image-code file's contents: a retrained target at the same checkpoint path must not reuse features
    of the old one)."""
    return {
        "weights_sha1": weights_digest(model),
        "images_sha1": file_digest(data.images_path) if data.images_path else None,
        "target": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_config": {k: v for k, v in (model_config or {}).items() if k != "device"},
        "num_streams": model.num_streams,
        "num_image_tokens": model.num_image_tokens,
        "hidden_size": model.hidden_size,
        "codebook_size": model.codebook_size,
        "source": data.source,
        "num_samples": data.num_samples,
        "shard_size": data.shard_size,
        "seed": data.seed,
        "storage_dtype": data.storage_dtype,
        "images_path": data.images_path,
        "prompts_sha1": hashlib.sha1("\n".join(prompts).encode()).hexdigest(),
        "prefix": prefix,
    }


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def make_shard(model: ImageARModel, data: DistillConfig, spec: ShardSpec, prompts: list[str],
               codes: torch.Tensor | None, prefix: str = "last",
               fingerprint_sha1: str | None = None) -> bytes:
    """Generate (or teacher-force) the samples of one shard and serialise them as safetensors bytes.

    ``hidden`` holds the prefix slots the ``prefix`` convention feeds (1 or all C) and then f_0 .. f_{N-1}."""
    from safetensors.torch import save

    shard_prompts = prompts[spec.start : spec.stop]
    if codes is None:
        batch = sample_tokens(model, shard_prompts, [data.seed + i for i in range(spec.start, spec.stop)],
                              data.batch_size)
    else:
        batch = codes[spec.start : spec.stop].cpu()  # (M, N)
    step = min(TEACHER_BATCH, data.batch_size)  # distill.batch_size is what fits the GPU
    hidden = [model.teacher_force(shard_prompts[j : j + step], batch[j : j + step], prefix)
              for j in range(0, len(batch), step)]
    hidden = torch.cat(hidden).to("cpu", STORAGE_DTYPES[data.storage_dtype])
    tensors = {
        "tokens": batch,  # (M, N)
        "hidden": hidden.contiguous(),  # (M, S, P+N, H), P = 1 (prefix=last) or C (prefix=all)
        "sample_index": torch.arange(spec.start, spec.stop),
    }
    return save(tensors, metadata={"format": DATA_FORMAT, "prompts": json.dumps(shard_prompts),
                                   "fingerprint_sha1": fingerprint_sha1 or "",
                                   "batch_size": str(data.batch_size)})


def sample_tokens(model: ImageARModel, prompts: Sequence[str], seeds: Sequence[int],
                  batch_size: int) -> torch.Tensor:
    """AR samples of the target (M, N), ``batch_size`` sequences per ``Decoder.generate_batch`` call; sample
    ``b`` uses the stream of ``seeds[b]`` whatever its batch."""
    sampler = Decoder("ar", model, ExactRule(), draft_len=0, track_tv=False)
    out = []
    for j in range(0, len(prompts), batch_size):
        gens = sampler.generate_batch(list(prompts[j : j + batch_size]), list(seeds[j : j + batch_size]))
        out.extend(g.tokens.cpu() for g in gens)
    return torch.stack(out)


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


def shard_digest(path: Path) -> str | None:
    """The settings digest a shard file was made with (None: a shard written before shards carried one)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("fingerprint_sha1") or None


def generate_data(model: ImageARModel, data: DistillConfig, directory: str | os.PathLike,
                  prompts: Sequence[str], model_config: dict | None = None, progress: bool = True,
                  prefix: str = "last", rank: int = 0, world: int = 1,
                  wait_timeout_s: float | None = None) -> dict:
    """Write this rank's missing shards into ``directory``; return the manifest (resumable).

    ``prefix``: the drafter's prefix convention the samples are made for (``head.prefix``). Of ``world``
    ranks, rank ``r`` makes the shards ``k`` with ``k % world == r`` (the others may still be missing when it
    returns: ``wait_for_data``). Before anything is written, the disk the missing shards need is compared with
    the free space of ``directory`` (``storage_need``; rank 0 prints both); ``wait_timeout_s`` bounds the wait
    for the manifest's file lock (None: no limit).

    ``prompts`` (cycled) condition the samples; with ``source=images`` and ``labels`` in the file, sample
    ``i``'s prompt is its label instead (class-conditional models).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world} processes")
    directory = Path(directory)
    codes, labels = (None, None)
    if data.source == "images":
        codes, labels = load_image_codes(model, data.images_path)
        if codes.shape[0] < data.num_samples:
            raise ValueError(f"distill.images_path holds {codes.shape[0]} samples < distill.num_samples "
                             f"({data.num_samples})")
    if labels is not None:
        prompts = [str(int(v)) for v in labels[: data.num_samples]]
    else:
        prompts = cycle(prompts, data.num_samples)
    check_prefix(prefix)
    fingerprint = data_fingerprint(model, data, prompts, model_config, prefix)
    digest = fingerprint_digest(fingerprint)
    checked_manifest(directory, fingerprint)  # read only: a folder of other settings is refused first
    missing = missing_shards(directory, data)  # every rank's: they share the folder's disk
    need = storage_need(model, data, directory, missing, prompts, prefix)
    check_storage(need, directory, data, report=rank == 0)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(directory)  # a write killed mid-way (live writers of other ranks keep their locks)
    with manifest_lock(directory, wait_timeout_s):
        manifest = checked_manifest(directory, fingerprint)
        if not (directory / MANIFEST).is_file():
            write_manifest(directory, manifest)
    specs = [s for s in shard_specs(data.num_samples, data.shard_size) if s.index % world == rank]
    todo = []
    for spec in specs:
        path = directory / spec.name
        if spec.name in manifest["shards"] and path.is_file():
            stored = shard_digest(path)
            if stored is not None and stored != digest:
                raise ValueError(f"{path} was made with other settings than this run's (its settings digest "
                                 f"{stored} != {digest}); delete that shard (or the folder) or choose "
                                 "another distill.dir")
            continue
        todo.append(spec)
    desc = f"drafter data shards (rank {rank}/{world})" if world > 1 else "drafter data shards"
    for spec in tqdm(todo, desc=desc, disable=not progress):
        blob = make_shard(model, data, spec, prompts, codes, prefix, digest)
        atomic_write_bytes(directory / spec.name, blob)
        with manifest_lock(directory, wait_timeout_s):  # other ranks may have added shards: read, add, write
            manifest = checked_manifest(directory, fingerprint)
            manifest["shards"][spec.name] = {"start": spec.start, "stop": spec.stop}
            write_manifest(directory, manifest)
    with manifest_lock(directory, wait_timeout_s):
        return checked_manifest(directory, fingerprint)


@contextmanager
def manifest_lock(directory: Path, timeout_s: float | None = None) -> Iterator[None]:
    """The file lock under which ranks read and rewrite ``manifest.json``, waited for at most ``timeout_s``."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(directory / SHARD_LOCK), timeout=-1 if timeout_s is None else timeout_s)
    try:
        lock.acquire()
    except Timeout as err:
        raise TimeoutError(
            f"{directory / SHARD_LOCK} has been held by another process for {timeout_s / 60:g} min "
            "(dist.timeout_min), where a rank holds it only to add a shard to manifest.json: that process "
            "hangs, or its node went down while the network filesystem keeps its lock. Stop every rank of this "
            "run, delete the lock file, and rerun the same command (finished shards are kept)") from err
    try:
        yield
    finally:
        lock.release()


# -- disk ------------------------------------------------------------------------------------------------
SHARD_HEADER_BYTES = 1024  # a shard's safetensors header without its prompts: tensor entries, digest, format


class DiskSpaceError(OSError):
    """The missing shards need more than the free space of ``distill.dir``."""


@dataclass(frozen=True)
class StorageNeed:
    """What the missing shards of a data folder will take and what its filesystem has free (bytes)."""

    shards: int
    samples: int
    sample_bytes: int  # one sample: its hidden states, its codes (int64) and its index
    shape: str  # the hidden states of one sample, e.g. "2 streams × 577 × 4096 × bfloat16"
    need: int  # every missing shard, headers included
    free: int
    folder: Path  # where the free space was read: distill.dir, or its nearest existing parent


def human_bytes(count: float) -> str:
    """Decimal units, as the README's disk table: ``9.46 MB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 999.5 or unit == "TB":
            return f"{count:.3g} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    raise AssertionError("unreachable")


def stored_prefix_slots(model: ImageARModel, prompt: str, prefix: str) -> int:
    """``P``, the prefix slots a stored sample holds: 1 for ``last``; for ``all`` every condition slot, read from
    one prefill of ``prompt``."""
    if prefix == "last":
        return 1
    with torch.inference_mode():
        _, first = model.prefill([prompt], extra_slots=0)
    return int(model.prefix_states(first, prefix).shape[2])


def storage_need(model: ImageARModel, data: DistillConfig, directory: Path, missing: Sequence[ShardSpec],
                 prompts: Sequence[str], prefix: str = "last") -> StorageNeed:
    """The disk the ``missing`` shards take, from the shapes ``make_shard`` stores: per sample ``hidden`` (S, P+N, H)
    in ``distill.storage_dtype``, the codes (N,) and the index as int64; per shard a header (its prompts as JSON,
    at most twice escaped, and ``SHARD_HEADER_BYTES``). ``free``: ``shutil.disk_usage`` of ``directory`` (of its
    nearest existing parent before it is made)."""
    n, h, streams = model.num_image_tokens, model.hidden_size, model.num_streams
    slots = stored_prefix_slots(model, prompts[0], prefix) if missing else 1
    dtype = STORAGE_DTYPES[data.storage_dtype]
    sample = streams * (slots + n) * h * torch.empty((), dtype=dtype).element_size() + 8 * n + 8
    need = sum((s.stop - s.start) * sample + SHARD_HEADER_BYTES
               + 2 * len(json.dumps(list(prompts[s.start:s.stop]))) for s in missing)
    folder = Path(directory).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    shape = f"{streams} stream{'s' if streams > 1 else ''} × {slots + n} × {h} × {data.storage_dtype}"
    return StorageNeed(shards=len(missing), samples=sum(s.stop - s.start for s in missing), sample_bytes=sample,
                       shape=shape, need=need, free=shutil.disk_usage(folder).free, folder=folder)


def check_storage(need: StorageNeed, directory: Path, data: DistillConfig, report: bool = True) -> None:
    """Print the need and the free space (``report``: rank 0), and stop before anything is written when the need
    exceeds it (``distill.low_disk=refuse``; ``warn``: a warning, then on)."""
    if not need.shards:
        return
    if report:
        print(f"drafter data: {need.shards} shards ({need.samples} samples) to write into {directory}, all "
              f"ranks together: about {human_bytes(need.need)} ({need.shape} = {human_bytes(need.sample_bytes)} "
              f"per sample with its codes); free there: {human_bytes(need.free)}", flush=True)
    if need.need <= need.free:
        return
    message = (f"the drafter data need about {human_bytes(need.need)} for the {need.shards} shards still to "
               f"write into {directory}, but only {human_bytes(need.free)} are free there ({need.folder}). Put "
               "them on a larger disk with distill.dir=<folder>, or store fewer samples (distill.num_samples) or "
               "smaller ones (distill.storage_dtype=bfloat16, half of float32)")
    if data.low_disk == "refuse":
        raise DiskSpaceError(message + ", or pass distill.low_disk=warn to write anyway (a filesystem that "
                                       "reports its free space wrongly). Nothing was written")
    warnings.warn(message + " (distill.low_disk=warn: writing anyway)", stacklevel=3)


def checked_manifest(directory: Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The folder's manifest (a new one if none), refused when it was made with other settings."""
    manifest = read_manifest(directory)
    if manifest is None:
        return {"format": DATA_FORMAT, "version": 1, "fingerprint": fingerprint, "shards": {}}
    old = {**manifest.get("fingerprint", {}), "prefix": manifest_prefix(manifest)}
    if old != fingerprint:
        diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
        raise ValueError(f"distill.dir {directory} holds samples made with other settings (stored vs now: "
                         f"{diff}); choose another distill.dir or delete that folder")
    return manifest


def missing_shards(directory: Path, data: DistillConfig) -> list[ShardSpec]:
    """The shards of ``data`` not yet listed in ``directory``'s manifest and on disk."""
    listed = (read_manifest(directory) or {}).get("shards", {})
    return [s for s in shard_specs(data.num_samples, data.shard_size)
            if s.name not in listed or not (directory / s.name).is_file()]


def wait_for_data(directory: Path, data: DistillConfig, timeout_s: float | None = None,
                  world: int = 1) -> None:
    """Poll the folder every ``distill.wait_poll_s`` until every shard is listed and on disk (the other ranks'
    shards): no collective, so ranks that finish early wait without a process-group timeout.

    ``timeout_s``: the longest wait without a new shard (None: no limit); then a ``TimeoutError`` names the shards
    still missing and the ranks of ``world`` that were to write them (shard ``k`` is rank ``k % world``'s)."""
    count, since = -1, time.monotonic()
    while missing := missing_shards(directory, data):
        now = time.monotonic()
        if len(missing) != count:
            count, since = len(missing), now
        elif timeout_s is not None and now - since > timeout_s:
            raise TimeoutError(missing_ranks_message(directory, data, missing, world, timeout_s))
        time.sleep(data.wait_poll_s)


def missing_ranks_message(directory: Path, data: DistillConfig, missing: Sequence[ShardSpec], world: int,
                          timeout_s: float) -> str:
    by_rank: dict[int, list[str]] = {}
    for spec in missing:
        by_rank.setdefault(spec.index % world, []).append(spec.name)
    total = len(shard_specs(data.num_samples, data.shard_size))

    def names(shards: list[str]) -> str:
        return ", ".join(shards[:4]) + (f" and {len(shards) - 4} more" if len(shards) > 4 else "")

    ranks = "; ".join(f"rank {r} of {world} was to write {names(by_rank[r])}" for r in sorted(by_rank))
    who = f"Rank{'s' if len(by_rank) > 1 else ''} {', '.join(map(str, sorted(by_rank)))}"
    return (f"the drafter data in {directory} still miss {len(missing)} of {total} shards after "
            f"{timeout_s / 60:g} min without a new one (dist.timeout_min): {ranks} (shard k is made by rank "
            f"k % {world}). {who} stopped or hang: read their logs (an error, out of memory, a lost node), and "
            "check that every rank writes into this same folder (a filesystem shared by the nodes). Finished "
            "shards are kept: rerun the same command to make only the missing ones, or raise dist.timeout_min "
            "if one shard (distill.shard_size samples) takes longer")


# -- distillation prompts vs evaluation prompts ----------------------------------------------------------
def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def read_prompt_file(path: Path) -> list[str]:
    """Prompts of an evaluation set: a COCO captions file (``annotations[].caption``: every caption of every
    image), a JSON list of strings, a PartiPrompts-style TSV (column ``Prompt``) or one prompt per line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        content = json.loads(text)
        if isinstance(content, dict) and "annotations" in content:
            return [str(a["caption"]) for a in content["annotations"]]
        if isinstance(content, list):
            return [str(c["caption"] if isinstance(c, dict) else c) for c in content]
        raise ValueError(f"{path}: neither a COCO captions file nor a list of prompts")
    if path.suffix == ".tsv":
        import csv

        rows = csv.DictReader(text.splitlines(), delimiter="\t")
        return [row["Prompt"] for row in rows if row.get("Prompt")]
    return [line for line in text.splitlines() if line.strip()]


def eval_overlap(prompts: Sequence[str], files: Sequence[str | os.PathLike]) -> dict[str, list[str]]:
    """The distillation prompts found in each evaluation prompt file that exists (matched after lower-casing
    and collapsing whitespace), per file; files that do not exist are left out."""
    wanted = {_normal(p): p for p in prompts}
    found: dict[str, list[str]] = {}
    for f in files:
        path = Path(f).expanduser()
        if not path.is_file():
            continue
        hits = sorted({wanted[n] for n in map(_normal, read_prompt_file(path)) if n in wanted})
        if hits:
            found[str(path)] = hits
    return found


def check_eval_overlap(prompts: Sequence[str], data: DistillConfig, data_target: str | None = None,
                       data_path: str | None = None) -> dict[str, list[str]]:
    """Refuse (``distill.eval_overlap=refuse``) or warn (``warn``) when distillation prompts are evaluation
    prompts: a drafter distilled on the evaluation captions (``data=coco`` reads val2017, the evaluation set
    of ``eval=coco5k``) has seen the test prompts. ``data_target``/``data_path``: the ``data`` group's
    ``_target_`` and ``path``, so ``data=coco`` on val2017 is recognised without its file."""
    found = eval_overlap(prompts, data.eval_prompt_files)
    if data_target == "coolsd.prompts.CocoCaptions" and data_path and "val2017" in Path(str(data_path)).name:
        found.setdefault(str(Path(data_path).expanduser()), list(prompts))
    if not found:
        return found
    where = "; ".join(f"{len(hits)} of them in {path} (e.g. {hits[0]!r})" for path, hits in found.items())
    message = (f"the drafter's distillation prompts ({len(set(prompts))} distinct) overlap the evaluation "
               f"prompts: {where}. A drafter distilled on the evaluation prompts has seen the test set; use the "
               "training captions (data=coco_train, MS-COCO 2017 train) or another prompt file "
               "(data=file data.path=...)")
    if data.eval_overlap == "refuse":
        raise ValueError(message + ", or pass distill.eval_overlap=warn to continue anyway")
    warnings.warn(message + " (distill.eval_overlap=warn: continuing)", stacklevel=2)
    return found


def manifest_prefix(manifest: dict[str, Any]) -> str:
    """The prefix convention a data folder was made for (folders from before the option: ``last``)."""
    return manifest.get("fingerprint", {}).get("prefix", "last")


# -- streaming batches -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Training pairs of ``B`` sequences. With ``P`` stored prefix slots (1 for ``prefix=last``): ``features``
    (prefix slots 0..P−1, then f_{0..N−2}) with ``tokens`` (P−1 zero ids, then x_{0..N−1}) at pair positions
    ``−P .. N−2``; the last ``N`` pairs predict ``targets`` f_{0..N−1} (the prefix pairs are context only)."""

    tokens: torch.Tensor  # (B, P-1+N)
    features: torch.Tensor  # (B, P-1+N, H)
    targets: torch.Tensor  # (B, N, H)


def pair_positions(n: int, device: torch.device | str, prefix_slots: int = 1) -> torch.Tensor:
    """Pair positions of ``prefix_slots`` prefix slots and ``n`` image tokens: ``−prefix_slots .. n−2``."""
    return torch.arange(-prefix_slots, n - 1, device=device)


def training_pairs(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stored sample -> ``(features, pair tokens, targets)`` of the drafter's prefix convention.

    ``hidden`` (..., P+N, H) = the P fed prefix slots (the last one ``f_{-1}``) then ``f_0 .. f_{N-1}``;
    ``tokens`` (N,). Returns features (..., P−1+N, H), token ids (P−1+N,) (zeros, then x_0 .. x_{N−1}) and
    targets (..., N, H) = ``f_0 .. f_{N-1}``.
    """
    n = tokens.shape[-1]
    p = hidden.shape[-2] - n
    if p < 1:
        raise ValueError(f"stored hidden states have {hidden.shape[-2]} rows for {n} tokens; expected P + N, P >= 1")
    pair_tokens = torch.cat([tokens.new_zeros(p - 1), tokens])
    return hidden[..., :-1, :], pair_tokens, hidden[..., p:, :]


class ShardStream:
    """Endless, resumable stream of training batches over a list of shards, split across DDP ranks.

    Epoch ``e`` visits the shards in a seeded random order and each shard's rows in a seeded random order;
    global item ``g`` goes to rank ``g % world``. ``cursor`` (global items consumed) is the whole state,
    so a resumed stream continues exactly. One shard is held in memory at a time.
    """

    def __init__(self, directory: Path, shards: list[str], sizes: list[int], batch_size: int, seed: int,
                 uncond_prob: float, rank: int = 0, world: int = 1, device: str | torch.device = "cpu",
                 cursor: int = 0) -> None:
        if not shards:
            raise ValueError("no training shards: raise distill.num_samples or lower distill.val_shards")
        self.directory, self.shards, self.sizes = directory, shards, sizes
        self.total = sum(sizes)
        self.batch_size, self.seed, self.uncond_prob = batch_size, seed, uncond_prob
        self.rank, self.world, self.device = rank, world, device
        self.cursor = cursor
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        self._orders: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def _epoch_order(self, epoch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            shard_order = torch.randperm(len(self.shards), generator=gen)
            rows = [torch.randperm(self.sizes[s], generator=gen) for s in range(len(self.shards))]
            self._orders = {epoch: (shard_order, rows)}
        return self._orders[epoch]

    def _item(self, g: int) -> tuple[int, int]:
        """Global item index -> (shard, row)."""
        epoch, offset = divmod(g, self.total)
        shard_order, rows = self._epoch_order(epoch)
        for s in shard_order.tolist():
            if offset < self.sizes[s]:
                return s, int(rows[s][offset])
            offset -= self.sizes[s]
        raise AssertionError("offset past the epoch")

    def _shard(self, s: int) -> dict[str, torch.Tensor]:
        if self._loaded is None or self._loaded[0] != s:
            from safetensors.torch import load_file

            self._loaded = (s, load_file(str(self.directory / self.shards[s])))
        return self._loaded[1]

    def next_batch(self) -> Batch:
        tokens, features, targets = [], [], []
        for i in range(self.batch_size):
            g = self.cursor + i * self.world + self.rank
            s, row = self._item(g)
            shard = self._shard(s)
            hidden = shard["hidden"][row]  # (S, P+N, H)
            stream = 0
            if hidden.shape[0] == 2 and self.uncond_prob > 0:
                gen = torch.Generator().manual_seed(self.seed * 7_919 + g)
                stream = int(torch.rand((), generator=gen) < self.uncond_prob)
            f, x, target = training_pairs(hidden[stream], shard["tokens"][row])
            tokens.append(x)
            features.append(f)
            targets.append(target)
        self.cursor += self.batch_size * self.world
        return Batch(tokens=torch.stack(tokens).to(self.device),
                     features=torch.stack(features).to(self.device, torch.float32),
                     targets=torch.stack(targets).to(self.device, torch.float32))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


def split_shards(manifest: dict[str, Any], val_shards: int) -> tuple[list[str], list[str]]:
    """Training and held-out shard names: the last ``val_shards`` shards are held out (if more than one)."""
    names = sorted(manifest["shards"], key=lambda n: manifest["shards"][n]["start"])
    held = min(val_shards, max(len(names) - 1, 0))
    return names[: len(names) - held], names[len(names) - held :]


def data_complete(directory: Path, data: DistillConfig) -> bool:
    """Whether ``directory`` holds every shard of ``data`` (listed in its manifest and on disk)."""
    return not missing_shards(directory, data)
