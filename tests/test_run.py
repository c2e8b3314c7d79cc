"""``run.py`` end to end: the default run, multirun sweeps, run.json contents, resuming after a crash."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from run import decoder_chosen
from tests.helpers import default_run_decoders

ROOT = Path(__file__).resolve().parent.parent
LOOKUP = ["model=lookup", "drafter=lookup", "data=fixed", "logger=none"]


def run_py(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_run_without_decoder_writes_record_table_images_and_wandb(tmp_path):
    """No decoder= given: the whole suite runs (the embedded default run is tested in test_embedded.py)."""
    proc = run_py("model=tiny", "eval.num_prompts=2", "eval.threads=1", f"hydra.run.dir={tmp_path}")
    record = json.loads((tmp_path / "run.json").read_text())
    suite = default_run_decoders()  # no decoder= given: all run
    assert record["decoder"] == "sd" and set(record["per_decoder"]) == suite
    for key in ("mean_accepted_length", "latency_s", "speedup", "target_forwards_per_image", "tv_per_step"):
        assert key in record["metrics"]
    assert record["per_decoder"]["ar"]["mean_accepted_length"] == 1.0
    assert record["per_decoder"]["ar"]["target_forwards_per_image"] == 64  # prefill + 63 decode steps
    assert record["git"]["commit"] is None or len(record["git"]["commit"]) == 40
    assert record["environment"]["torch"] and record["config"]["model"]["gpt"]["dim"] == 64
    assert (tmp_path / "table.md").read_text().startswith("| decoder |")
    assert len(list((tmp_path / "images" / "sd").glob("*.png"))) == 2 and (tmp_path / "grid_ar.png").exists()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert "accepted length" in proc.stdout.splitlines()[-1]


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_multirun_sweep_writes_one_record_per_override(tmp_path):
    run_py("-m", *LOOKUP, "decoder=sd", "decoder.draft_len=1,2", "eval.num_prompts=3",
           f"hydra.sweep.dir={tmp_path}")
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/run.json"))]
    assert [r["config"]["decoder"]["draft_len"] for r in records] == [1, 2]
    for r in records:
        assert set(r["per_decoder"]) == {"ar", "sd"}
        assert r["metrics"]["mean_accepted_length"] <= r["config"]["decoder"]["draft_len"] + 1


def test_resume_skips_finished_images_and_survives_a_torn_line(tmp_path):
    args = [*LOOKUP, "eval.num_prompts=4", f"hydra.run.dir={tmp_path}"]
    run_py(*args)
    log = tmp_path / "records" / "sd.jsonl"
    lines = log.read_text().splitlines()
    kept = {json.loads(line)["index"]: line for line in lines[:2]}
    log.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # a crash mid-write
    run_py(*args)
    after = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["index"] for r in after) == [0, 1, 2, 3]
    for r in after:
        if r["index"] in kept:
            assert json.dumps(r) == kept[r["index"]]  # finished records are not regenerated
    assert json.loads((tmp_path / "run.json").read_text())["per_decoder"]["sd"]["num_images"] == 4


def test_compare_auto_follows_the_command_line():
    assert decoder_chosen(["decoder=sd", "eval.num_prompts=2"])
    assert not decoder_chosen(["decoder.draft_len=3", "model=tiny"])
