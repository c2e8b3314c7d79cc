"""The GPU script of both decode paths (``scripts/gpu_paths.py``, ``eval.bench.gpu_paths``), run dry on the CPU
(``--allow-cpu``: the tiny LlamaGen T2I, nothing captured): every step ends, the report says what was measured and
on what, and the goals are judged from the measurements. About 20 s on one core."""
from __future__ import annotations

import json
import subprocess
import sys

from eval.bench.gpu_paths import GOALS, PAPER_TAU, STEPS, run
from tests.helpers import CONFIGS

ROOT = CONFIGS.parent


def test_the_gpu_script_runs_every_step_dry_on_the_cpu(tmp_path):
    report = run(tmp_path, allow_cpu=True, images=1, repeats=2)
    assert [k for k, v in report["steps"].items() if v["status"] == "done"] == list(STEPS), report["steps"]
    res = report["results"]
    assert res["ar"]["static"]["tokens_equal_eager"] and res["ar"]["captured"]["tokens_equal_eager"]
    assert set(res["iterations"]) == {"eager", "static", "captured"}
    assert set(res["iterations"]["captured"]) == {"sd", "coolsd", "sd_tree", "coolsd_tree", "sjd"}
    assert {f"captured/{name}" for name in PAPER_TAU} <= set(res["projection"])
    for key, value in res["projection"].items():
        path = key.split("/")[0]
        assert value["projected_speedup"] == value["tau"] * res["ar"][path]["ms_per_step"] / value["ms_per_iteration"]
    assert all(state is not None and "met" in state for state in report["goals"].values())
    assert report["goals"]["verify_chain <= 1.3x forward_1"]["met"] == (
        res["blocks"]["verify_chain_ratio"] <= GOALS["verify_ratio"])
    page = (tmp_path / "gpu_paths.md").read_text()
    assert "CPU dry run" in page and "Hardware: CPU" in page and "Goals:" in page
    assert json.loads((tmp_path / "gpu_paths.json").read_text())["cpu_dry_run"] is True


def test_the_gpu_script_skips_steps_past_its_budget_and_names_bad_steps(tmp_path):
    report = run(tmp_path, steps=("blocks", "projection"), allow_cpu=True, repeats=2, budget=0.0)
    assert all(v["status"].startswith("skipped") for v in report["steps"].values())
    out = subprocess.run([sys.executable, "scripts/gpu_paths.py", "--out", str(tmp_path), "--steps", "ar,warp"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "unknown ['warp']" in out.stderr
