"""Resume: the finished records of an output folder that this run may keep, checked against its fingerprints
before any image is made (``RunRecords``).

Rerunning a command with the same output folder (``hydra.run.dir=<folder>``) skips every finished (decoder,
prompt), whichever process or rank finished it. A decoder whose stored fingerprint (``records/<decoder>.fingerprint
.json``, ``eval.records.fingerprints``) differs from this run's, or whose records were made for other prompts or
seeds, is refused (``eval.resume=auto``) or cleared (``overwrite``); records made on a machine of other float32
arithmetic are kept or refused by ``eval.numerics_mismatch``; records made by other code (the digest of the source
that makes a decoder's tokens, ``records/<decoder>.code.json``, ``eval.records.code_digest``) are refused, made
again or kept by ``eval.code_mismatch`` (``refuse``, ``rerun``, ``accept``).

Example: ``python run.py hydra.run.dir=runs/x`` twice: the second run generates nothing that the first finished.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from coolsd.fingerprint import differing_keys, json_digest
from coolsd.io import atomic_write_json
from eval.records.code_digest import CodeIdentity, mismatch_text
from eval.records.fingerprints import normalised
from eval.records.image_records import load_records
from eval.run.shards import Shards


class RunRecords:
    """Every decoder's per-image records of one output folder, checked against this run's fingerprints.

    ``fingerprints[name]`` (a dict) is stored beside the records (``records/<name>.fingerprint.json``); each
    record carries the digest of that dict with its prompt and seed. A folder whose records were made with
    other settings is refused (``eval.resume=auto``) or cleared (``overwrite``) before any image is made.
    ``codes[name]``: the identity of the code that makes decoder ``name``'s tokens (``eval.records.code_digest``),
    stored as ``records/<name>.code.json`` and carried by every record as ``code``; records made by other code are
    refused, cleared or kept by ``code_mismatch`` (``refuse``, ``rerun``, ``accept``).
    """

    def __init__(self, out_dir: Path, fingerprints: dict[str, dict], resume: str, shards: Shards,
                 numerics_mismatch: str = "accept", codes: dict[str, CodeIdentity] | None = None,
                 code_mismatch: str = "refuse") -> None:
        self.dir = out_dir / "records"
        self.out_dir = out_dir
        self.fingerprints = {name: normalised(fp) for name, fp in fingerprints.items()}
        self.digests = {name: json_digest(fp) for name, fp in self.fingerprints.items()}
        self.resume = resume
        self.shards = shards
        self.numerics_mismatch = numerics_mismatch
        #: decoder -> the stored ``numerics`` fingerprint of records this run accepted from another machine
        self.accepted_numerics: dict[str, Any] = {}
        self.codes = dict(codes or {})
        self.code_mismatch = code_mismatch
        #: decoder -> the files whose code changed since the records this run kept (``eval.code_mismatch=accept``)
        self.accepted_code: dict[str, list[str]] = {}
        #: decoder -> the changed files of the records this run deleted to make them again (``rerun``)
        self.rerun_code: dict[str, list[str]] = {}

    def code_path(self, name: str) -> Path:
        return self.dir / f"{name}.code.json"

    def _code_changes(self, name: str) -> tuple[list[str], str]:
        """(the files changed since decoder ``name``'s records were made, the line naming them); nothing for a
        decoder without a code identity here or stored (records made before code digests: judged by
        ``TOKEN_CODE_VERSION``, which the fingerprint holds)."""
        path = self.code_path(name)
        if name not in self.codes or not path.is_file():
            return [], ""
        old = CodeIdentity.from_dict(json.loads(path.read_text()))
        changed = self.codes[name].changed(old)
        return changed, mismatch_text(name, changed, old, self.codes[name]) if changed else ""

    def code_digest(self, name: str) -> str | None:
        """The digest every new record of decoder ``name`` carries (None: no code identity given)."""
        return self.codes[name].digest if name in self.codes else None

    def meta_path(self, name: str) -> Path:
        return self.dir / f"{name}.fingerprint.json"

    def image_digest(self, name: str, prompt: str, seed: int) -> str:
        return json_digest([self.digests[name], prompt, seed])

    def check(self, prompts: list[str], seed: int) -> dict[str, dict[int, dict]]:
        """Finished records per decoder (index -> record) that match; refuses or clears mismatching ones."""
        done: dict[str, dict[int, dict]] = {}
        problems: list[str] = []
        code_problems: list[str] = []
        for name, fp in self.fingerprints.items():
            meta = self.meta_path(name)
            records = load_records(self.dir, name)
            stale = []
            changed, said = self._code_changes(name) if records else ([], "")
            if changed and self.code_mismatch == "rerun":
                if self.shards.rank == 0:
                    self._clear(name)
                self.rerun_code[name] = changed
                records = {}
            elif changed and self.code_mismatch == "accept":
                self.accepted_code[name] = changed
            elif changed:
                code_problems.append(said)
                done[name] = {}
                continue
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
        if code_problems:
            raise RuntimeError(
                f"{self.out_dir} holds records made by other code than this checkout's:\n  - "
                + "\n  - ".join(code_problems)
                + "\nNothing was generated. eval.code_mismatch=rerun DELETES those decoders' records and images in "
                  "this folder and makes them again with today's code; eval.code_mismatch=accept keeps them (run.json "
                  "names the files, the tables mark the row §); or write to a new folder (hydra.run.dir=<new folder>)"
                  ", or restore the code (git stash, git checkout <the commit in run.json>).")
        if problems:
            raise RuntimeError(
                f"{self.out_dir} holds images made with other settings than this run:\n  - "
                + "\n  - ".join(problems)
                + "\nNothing was generated. Either write to a new folder (hydra.run.dir=<new folder>), or give "
                  "eval.resume=overwrite, which DELETES the mismatching decoders' finished records and images in "
                  "this folder before generating them again.")
        if self.shards.rank == 0:  # before the barrier: no rank writes a record before its fingerprint is on disk
            for name, fp in self.fingerprints.items():  # (a requeue right after it would find records without one)
                atomic_write_json(self.meta_path(name), fp)
                if name in self.codes:
                    atomic_write_json(self.code_path(name), self.codes[name].as_dict())
        self.shards.barrier()
        return done

    def _clear(self, name: str) -> None:
        for path in list(self.dir.glob(f"{name}.jsonl")) + list(self.dir.glob(f"{name}.rank*.jsonl")):
            path.unlink()
        self.meta_path(name).unlink(missing_ok=True)
        self.code_path(name).unlink(missing_ok=True)
        images = self.out_dir / "images" / name
        if images.is_dir():
            shutil.rmtree(images)

