"""Reliability (issue 21): file modes follow the umask, stale temporaries are cleaned without touching a live
writer's, prompt counts and config types fail early naming the key, tree files fail naming the file, and a
damaged record line is reported and regenerated.

(The drafter-resume ``before`` test is in ``test_eagle.py``, the LANTERN TV brute force in ``test_relaxed.py``.)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from coolsd import io as cio
from coolsd.io import atomic_write_bytes, remove_stale_temps
from coolsd.trees import TreeShape
from tests.helpers import CONFIGS, tiny_llamagen

ROOT = CONFIGS.parent
LOOKUP = ["model=lookup", "drafter=lookup", "data=fixed", "logger=none"]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# -- 3. file modes ---------------------------------------------------------------------------------------
def write_every_kind(folder: Path, model) -> list[Path]:
    """Call each writer of the project once into ``folder``; return the files they wrote."""
    from coolsd.drafters.eagle import EagleHead, save_eagle
    from coolsd.neighbours import latent_neighbours
    from eval.records import JsonlLog, atomic_write_json, save_png
    from eval.report import speed_quality_plot
    from eval.runner import save_grid
    from scripts import train_drafter as td

    atomic_write_json(folder / "run.json", {"a": 1})
    atomic_write_bytes(folder / "table.md", b"| decoder |\n")
    save_png(folder / "images" / "sd" / "00000.png", torch.zeros(3, 8, 8, dtype=torch.uint8))
    save_grid(folder / "grid_sd.png", folder, [{"image": "images/sd/00000.png"}])
    per_decoder = {"ar": {"speedup": 1.0, "tv_per_step": 0.0}, "sd": {"speedup": 2.0, "tv_per_step": 0.1}}
    assert speed_quality_plot(per_decoder, folder / "speed_quality.png", 1)
    log = JsonlLog(folder / "records" / "sd.jsonl", key="index")
    log.append({"index": 0})
    (folder / "records" / "ar.jsonl").write_bytes(b'{"index": 0}\n{"ind')  # a torn tail, repaired on open
    JsonlLog(folder / "records" / "ar.jsonl", key="index")
    head = EagleHead(model)
    save_eagle(head, folder / "drafter")
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    step = td.save_checkpoint(folder / "ckpt", 1, head, optimizer, scheduler, cursor=0, keep=2, training={})
    data = td.DistillConfig(num_samples=1, shard_size=1, storage_dtype="float32")
    td.generate_data(model, data, folder / "data", model.class_names, progress=False)
    latent_neighbours(model.codebook(), 3, "l2_raw", str(folder / "neighbours"))
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    atomic_write_bytes(folder / "cache" / "inception.pt", buf.getvalue())
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {"run.json", "table.md", "00000.png", "grid_sd.png", "speed_quality.png", "speed_quality.pdf",
            "sd.jsonl", "ar.jsonl", "config.json", "model.safetensors", "trainer.pt", "manifest.json",
            "shard_00000.safetensors", "inception.pt"} <= {p.name for p in files}
    assert step.is_dir() and any(p.name.startswith("neighbours_") for p in files)
    return files


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_every_writer_follows_the_umask(tmp_path, mask, expected):
    model = tiny_llamagen()
    with umask(mask):
        files = write_every_kind(tmp_path, model)
    wrong = {str(p.relative_to(tmp_path)): oct(mode(p)) for p in files if mode(p) != expected}
    assert not wrong, f"expected {oct(expected)} under umask {oct(mask)}: {wrong}"
    folders = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert all(mode(p) == 0o777 & ~mask for p in folders), {str(p): oct(mode(p)) for p in folders}


def test_a_whole_run_writes_files_others_can_read(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "run.py", *LOOKUP, "eval.num_prompts=2", "eval.warmup=0",
                           f"hydra.run.dir={out}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: os.umask(0o022))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"run.json", "table.md", "grid_sd.png", "sd.jsonl", "00000.png"} <= {p.name for p in files}
    wrong = {str(p.relative_to(out)): oct(mode(p)) for p in files if mode(p) != 0o644}
    assert not wrong


# -- 11. stale temporaries ---------------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from coolsd import io
fd, tmp = io._create_temp(Path(sys.argv[1]))
print(tmp, flush=True)
time.sleep(120)
"""


def test_stale_temps_are_removed_but_a_live_writers_is_kept(tmp_path):
    crashed = tmp_path / ".run.json.k3x9q2ab.tmp"  # a writer killed mid-write: its lock died with it
    crashed.write_bytes(b'{"half')
    old_style = tmp_path / ".00001.png.x1y2.tmp"  # the earlier mkstemp naming
    old_style.write_bytes(b"torn")
    others = [tmp_path / "notes.tmp", tmp_path / ".hidden", tmp_path / "run.json.tmp"]
    for p in others:
        p.write_text("user file")
    (tmp_path / ".step_0000006.tmp").mkdir()  # a checkpoint folder being assembled: not a temp file
    live = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "table.md")], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        held = Path(live.stdout.readline().strip())
        assert held.is_file() and re.fullmatch(r"\.table\.md\.[0-9a-f]{8}\.tmp", held.name)
        atomic_write_bytes(tmp_path / "run.json", b"{}\n")  # the first write into a folder sweeps it
        assert not crashed.exists() and not old_style.exists()
        assert held.exists(), "a temporary another live process is writing was deleted"
        assert all(p.exists() for p in others) and (tmp_path / ".step_0000006.tmp").is_dir()
        assert remove_stale_temps(tmp_path) == []
    finally:
        live.kill()  # the process this test started, by its handle
        live.wait()
    assert remove_stale_temps(tmp_path) == [held]  # its writer died: now it is stale
    assert json.loads((tmp_path / "run.json").read_text()) == {}


def test_without_locks_only_old_temps_count_as_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(cio, "_try_lock", lambda fd: None)  # a filesystem without flock
    fresh, old = tmp_path / ".a.png.0123abcd.tmp", tmp_path / ".b.png.4567cdef.tmp"
    fresh.write_bytes(b"x")
    old.write_bytes(b"x")
    hours_ago = time.time() - 2 * cio.STALE_AFTER_S
    os.utime(old, (hours_ago, hours_ago))
    assert remove_stale_temps(tmp_path) == [old] and fresh.exists()


def test_opening_a_records_folder_sweeps_it(tmp_path):
    from eval.records import JsonlLog

    stale = tmp_path / "records" / ".sd.jsonl.ab12cd34.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"{")
    JsonlLog(tmp_path / "records" / "sd.jsonl", key="index")
    assert not stale.exists()


# -- 8. damaged record lines -------------------------------------------------------------------------------
def test_a_corrupt_record_line_is_reported_and_counts_as_unfinished(tmp_path):
    from eval.records import JsonlLog

    path = tmp_path / "sd.jsonl"
    path.write_bytes(b'{"index": 0, "x": 1}\n'
                     b'{"index": 1, "tokens": [1, 2\x00\x00\x00\n'  # a damaged block, newline-terminated
                     b'{"prompt": "no index"}\n'
                     b'\xff\xfe not utf-8\n'
                     b'{"index": 4, "x": 4}\n')
    with pytest.warns(UserWarning) as caught:
        log = JsonlLog(path, key="index")
    assert sorted(log.done) == [0, 4]
    messages = [str(w.message) for w in caught]
    for line in (2, 3, 4):
        assert any(f"{path}:{line}:" in m and "generated again" in m for m in messages), messages
    log.append({"index": 1, "x": 11})
    with pytest.warns(UserWarning):
        assert sorted(JsonlLog(path, key="index").done) == [0, 1, 4]


def test_a_run_regenerates_the_image_of_a_corrupt_record_line(tmp_path):
    args = [sys.executable, "run.py", *LOOKUP, "compare=none", "decoder=sd", "eval.num_prompts=3",
            "eval.warmup=0", f"hydra.run.dir={tmp_path}"]
    subprocess.run(args, cwd=ROOT, env=env(), check=True, capture_output=True, timeout=300)
    log = tmp_path / "records" / "sd.jsonl"
    lines = log.read_text().splitlines()
    original = json.loads(lines[1])
    log.write_text("\n".join([lines[0], lines[1][:40] + "#garbage", lines[2]]) + "\n")
    proc = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{log}:2:" in proc.stderr
    from eval.records import load_records

    with pytest.warns(UserWarning, match=re.escape(f"{log}:2:")):
        records = load_records(tmp_path / "records", "sd")
    assert sorted(records) == [0, 1, 2] and records[1]["tokens"] == original["tokens"]
    assert json.loads((tmp_path / "run.json").read_text())["per_decoder"]["sd"]["num_images"] == 3
