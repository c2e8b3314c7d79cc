"""The GPU smoke test (``eval.bench.gpu_smoke``, the GPU command's named step ``smoke``): it refuses at once without
CUDA, saying why; its runner
reports every check (a failing one does not stop the others) in a pass/fail table; the checks themselves run on
the CPU with ``--allow-cpu`` (``-m slow``: about 2 min, the compiled check included). Their GPU results are in
``results/bench/h200/``. About 5 s without the slow test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.bench import gpu_smoke

ROOT = Path(__file__).resolve().parent.parent


def test_refuses_without_cuda_and_says_why(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "scripts/gpu.py", "--steps", "smoke", "--out", str(tmp_path / "s")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs a GPU" in proc.stderr and "torch.cuda.is_available() = False" in proc.stderr
    assert "--dry-run" in proc.stderr and not (tmp_path / "s").exists()  # nothing ran, nothing written
    with pytest.raises(SystemExit, match="srun --gpus=1"):
        gpu_smoke.require_cuda(False)


def test_every_check_is_reported_and_a_failure_does_not_stop_the_others(tmp_path, monkeypatch):
    ran = []

    def ok(device, out, *rest):
        ran.append(out)
        return f"fine on {device.type}"

    def broken(device, out):
        raise RuntimeError("first line\nNCCL error: unhandled system error")

    checks = {name: ok for name in gpu_smoke.CHECKS}
    checks["ranks"] = broken
    monkeypatch.setattr(gpu_smoke, "CHECK_FUNCTIONS", checks)
    monkeypatch.setattr(gpu_smoke, "cuda_available", lambda: False)
    record = gpu_smoke.run_smoke(tmp_path, allow_cpu=True)
    assert [r["check"] for r in record["checks"]] == list(gpu_smoke.CHECKS) and len(ran) == len(gpu_smoke.CHECKS) - 1
    status = {r["check"]: r["status"] for r in record["checks"]}
    assert status.pop("ranks") == "fail" and set(status.values()) == {"pass"} and not record["passed"]
    table = (tmp_path / "gpu_smoke.md").read_text()
    assert "| ranks | FAIL |" in table and "NCCL error: unhandled system error" in table
    assert "not a GPU smoke test" in table  # the CPU run says what it is
    assert "Traceback" in (tmp_path / "ranks.error.txt").read_text()
    assert json.loads((tmp_path / "gpu_smoke.json").read_text())["passed"] is False
    with pytest.raises(SystemExit, match="unknown checks"):
        gpu_smoke.run_smoke(tmp_path, ["nccl"], allow_cpu=True)


@pytest.mark.slow
def test_the_checks_pass_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu.py", "--dry-run", "--wheels", "--steps", "smoke",
                           "--out", str(tmp_path)], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tmp_path = tmp_path / "smoke"
    record = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert [r["status"] for r in record["checks"]] == ["pass"] * len(gpu_smoke.CHECKS)
    assert "4 models x 6 decoders finished on cpu" in record["checks"][0]["detail"]
    ranks = next(r for r in record["checks"] if r["check"] == "ranks")["detail"]
    assert ranks.startswith("8 records equal: one process vs torchrun with 2 rank(s) (gloo)")
    acceptance = json.loads((tmp_path / "bf16_acceptance.json").read_text())
    assert acceptance["images"] == 16 and set(acceptance["decoders"]) == set(gpu_smoke.ACCEPTANCE_DECODERS)
