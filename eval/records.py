"""Run records: atomic file writes, resumable per-image JSONL logs, the environment block of ``run.json``, and
the fingerprints that decide which finished records a run may keep (``RunRecords``).

Outputs are written to a temporary file in the same folder and renamed into place, so a crash never leaves
a half-written image or record. Per-image records are appended one JSON line at a time and flushed; on
restart an unterminated last line (a crash mid-write) is ignored and the image is generated again. A
complete line that is not a JSON record with the log's key (a damaged disk block, a hand edit) is reported
with its file and line number and skipped: that image counts as unfinished and is generated again, every
other record is kept.

Example: every ``python run.py`` writes ``run.json`` and ``records/<decoder>.jsonl`` in its output folder.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
from omegaconf import DictConfig, OmegaConf

from coolsd.fingerprint import TOKEN_CODE_VERSION, differing_keys, json_digest
from coolsd.io import atomic_write_bytes, remove_stale_temps

if TYPE_CHECKING:
    from eval.distributed import Shards


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def save_png(path: str | os.PathLike, image: torch.Tensor) -> None:
    """Save a uint8 image (3, H, W) or (1, H, W) as PNG, atomically."""
    import io

    from PIL import Image

    arr = image.detach().cpu()
    if arr.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 image, got {arr.dtype}")
    arr = arr.permute(1, 2, 0).numpy()
    pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


class JsonlLog:
    """Append-only JSON-lines file of finished items; ``done`` maps a key to its record.

    ``repair``: the process that appends to the file (its owner) also cuts an unterminated tail off the
    file and clears stale temporaries of its folder; a reader of another process's file (``repair=False``,
    e.g. rank 0 reading a live rank's records) only ignores that tail, as the owner may be writing it.
    """

    def __init__(self, path: str | os.PathLike, key: str, repair: bool = True) -> None:
        self.path = Path(path)
        self.key = key
        self.done: dict[Any, dict] = {}
        if repair:
            remove_stale_temps(self.path.parent)
        if self.path.exists():
            self._load(repair)

    def _load(self, repair: bool) -> None:
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]  # drop an unterminated tail left by a crash
        if repair and len(complete) != len(raw):
            atomic_write_bytes(self.path, complete)
        for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                problem = f"is not JSON ({e})"
            else:
                if isinstance(rec, dict) and isinstance(rec.get(self.key), (int, str)):
                    self.done[rec[self.key]] = rec
                    continue
                problem = f"is not a record with an {self.key!r} key"
            # one location for every caller, so a process reports each damaged line once
            warnings.warn(f"{self.path}:{number}: this line {problem}; skipping it, so its item counts as "
                          "unfinished and is generated again (the other records are kept)", stacklevel=1)

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[record[self.key]] = record

    def records(self) -> Iterable[dict]:
        return self.done.values()


def git_commit(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (None outside a git checkout)."""
    cwd = cwd or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True,
                               check=True, timeout=10).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment() -> dict[str, Any]:
    """Hardware and software facts that a timing is only meaningful with."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda_version"] = torch.version.cuda
    return env


def load_records(records_dir: Path, name: str) -> dict[int, dict]:
    """Every finished record of a decoder, from the single-process file and all rank files. Where two files
    hold an image's record (a resume with another number of ranks), the later one wins unless only the earlier
    names an image file (a record whose image was restored from its tokens keeps it)."""
    done: dict[int, dict] = {}
    for path in sorted(records_dir.glob(f"{name}.jsonl")) + sorted(records_dir.glob(f"{name}.rank*.jsonl")):
        for index, rec in JsonlLog(path, key="index", repair=False).done.items():
            if not (index in done and done[index].get("image") and not rec.get("image")):
                done[index] = rec
    return done


#: decoder keys that no image depends on: diagnostics, and where a cache lives (the LANTERN neighbour table is
#: computed from the VQ codebook, which the weights digest covers)
UNFINGERPRINTED = ("track_tv", "sync_phases", "neighbour_cache")
#: model keys that say where the weights are read from. The fingerprint's ``weights_sha1`` covers what they
#: point to, so they are left out of it: moving a checkout, another mount point on a cluster node or another
#: ``$COOLSD_CACHE`` keeps a folder's records and the AR cache. The drafter's ``checkpoint`` is left out in the
#: same way when the fingerprint carries ``drafter_weights_sha1`` (trained EAGLE heads).
WEIGHT_LOCATIONS = ("gpt_checkpoint", "vq_checkpoint", "weights_dir")
#: model keys added after records were made, left out of the fingerprint at these (their default) values, so
#: older records still match; another value is fingerprinted (``model.compile=true`` makes other bits)
MODEL_DEFAULTS = {"compile": False}


def decoder_fingerprint(cfg: DictConfig, name: str, decoder_cfg: DictConfig) -> dict[str, Any]:
    """What a decoder's images depend on besides model weights, prompt and seed: the model config, the decoder
    and drafter configs without ``UNFINGERPRINTED`` keys, and the code version (``normalised``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    dec = OmegaConf.to_container(decoder_cfg, resolve=True)
    return normalised({"code_version": TOKEN_CODE_VERSION, "model": model, "decoder": dec})


def normalised(fp: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint without the keys no image depends on: ``UNFINGERPRINTED`` decoder keys, the weights'
    locations (``WEIGHT_LOCATIONS``, the drafter's ``checkpoint``) once the digest of those weights is in it, and
    ``MODEL_DEFAULTS`` keys at their default.
    Also applied to a stored fingerprint of an older version, which kept them."""
    fp = dict(fp)
    dec = fp.get("decoder")
    if isinstance(dec, dict):
        dec = {k: v for k, v in dec.items() if k not in UNFINGERPRINTED}
        if "drafter_weights_sha1" in fp and isinstance(dec.get("drafter"), dict):
            dec["drafter"] = {k: v for k, v in dec["drafter"].items() if k != "checkpoint"}
        fp["decoder"] = dec
    if isinstance(fp.get("model"), dict):
        located = "weights_sha1" in fp
        fp["model"] = {k: v for k, v in fp["model"].items()
                       if not (located and k in WEIGHT_LOCATIONS) and not (k in MODEL_DEFAULTS and v == MODEL_DEFAULTS[k])}
    return fp


class RunRecords:
    """Every decoder's per-image records of one output folder, checked against this run's fingerprints.

    ``fingerprints[name]`` (a dict) is stored beside the records (``records/<name>.fingerprint.json``); each
    record carries the digest of that dict with its prompt and seed. A folder whose records were made with
    other settings is refused (``eval.resume=auto``) or cleared (``overwrite``) before any image is made.
    """

    def __init__(self, out_dir: Path, fingerprints: dict[str, dict], resume: str, shards: "Shards",
                 numerics_mismatch: str = "accept") -> None:
        self.dir = out_dir / "records"
        self.out_dir = out_dir
        self.fingerprints = {name: normalised(fp) for name, fp in fingerprints.items()}
        self.digests = {name: json_digest(fp) for name, fp in self.fingerprints.items()}
        self.resume = resume
        self.shards = shards
        self.numerics_mismatch = numerics_mismatch
        #: decoder -> the stored ``numerics`` fingerprint of records this run accepted from another machine
        self.accepted_numerics: dict[str, Any] = {}

    def meta_path(self, name: str) -> Path:
        return self.dir / f"{name}.fingerprint.json"

    def image_digest(self, name: str, prompt: str, seed: int) -> str:
        return json_digest([self.digests[name], prompt, seed])

    def check(self, prompts: list[str], seed: int) -> dict[str, dict[int, dict]]:
        """Finished records per decoder (index -> record) that match; refuses or clears mismatching ones."""
        done: dict[str, dict[int, dict]] = {}
        problems: list[str] = []
        for name, fp in self.fingerprints.items():
            meta = self.meta_path(name)
            records = load_records(self.dir, name)
            stale = []
            if meta.is_file():
                old = json.loads(meta.read_text())
                keys = differing_keys(normalised(old), fp)
                if keys and self.numerics_mismatch == "accept" and all(k.startswith("numerics.") for k in keys):
                    self.accepted_numerics[name] = old.get("numerics")  # another machine's records, kept
                    self.fingerprints[name], self.digests[name] = old, json_digest(old)
                    keys = []
                if keys:
                    if any(k.startswith("numerics.") for k in keys):
                        keys = [f"numerics (made on a machine whose float32 arithmetic differs: self-check "
                                f"{old.get('numerics')} there, {fp.get('numerics')} here; eval.numerics_mismatch="
                                "accept keeps them)"] + [k for k in keys if not k.startswith("numerics.")]
                    stale.append(f"decoder {name!r} (records/{name}.jsonl): {', '.join(keys[:8])}"
                                 + (f" and {len(keys) - 8} more" if len(keys) > 8 else ""))
                elif old != fp:  # an older version fingerprinted e.g. a location: keep
                    # its form, whose digest the folder's records carry (and this run's new records will)
                    self.fingerprints[name], self.digests[name] = old, json_digest(old)
            elif records:
                stale.append(f"decoder {name!r}: records/{name}.jsonl has no fingerprint (made by an older version)")
            if not stale:
                bad = [i for i, r in records.items()
                       if i >= len(prompts) or r.get("fingerprint") != self.image_digest(name, prompts[i], seed + i)]
                bad = [i for i in bad if i < len(prompts)]
                if bad:
                    i = bad[0]
                    stale.append(f"decoder {name!r}: {len(bad)} records were made for other prompts or seeds "
                                 f"(e.g. image {i}: prompt {records[i]['prompt']!r} seed {records[i]['seed']} vs "
                                 f"{prompts[i]!r} seed {seed + i})")
            if stale and self.resume == "overwrite":
                if self.shards.rank == 0:
                    self._clear(name)
                records = {}
                stale = []
            problems += stale
            done[name] = {i: r for i, r in records.items() if i < len(prompts)}
        if problems:
            raise RuntimeError(
                f"{self.out_dir} holds images made with other settings than this run:\n  - "
                + "\n  - ".join(problems)
                + "\nNothing was generated. Either write to a new folder (hydra.run.dir=<new folder>), or give "
                  "eval.resume=overwrite, which DELETES the mismatching decoders' finished records and images in "
                  "this folder before generating them again.")
        self.shards.barrier()
        if self.shards.rank == 0:
            for name, fp in self.fingerprints.items():
                atomic_write_json(self.meta_path(name), fp)
        return done

    def _clear(self, name: str) -> None:
        for path in list(self.dir.glob(f"{name}.jsonl")) + list(self.dir.glob(f"{name}.rank*.jsonl")):
            path.unlink()
        self.meta_path(name).unlink(missing_ok=True)
        images = self.out_dir / "images" / name
        if images.is_dir():
            shutil.rmtree(images)


def record_signatures(ordered: dict[str, list[dict]]) -> dict[str, int]:
    """How many of the run's records were made under each numerics signature (older records: ``unknown``)."""
    counts: dict[str, int] = {}
    for recs in ordered.values():
        for r in recs:
            key = r.get("numerics") or "unknown"
            counts[key] = counts.get(key, 0) + 1
    return counts
