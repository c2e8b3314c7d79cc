"""The one GPU command (``scripts/gpu.py``, ``eval.bench.gpu``) rehearsed on the CPU: its dry run imports only what
the offline GPU nodes hold (every other package blocked), prints the plan's estimate first (within five minutes on
the H200, from the committed timing table) and the goals last; the budget stops a step between two images with the
report written; the node's package list and the import blocking behave as on a node. About 30 s on one core."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coolsd.decoding import Decoder
from eval.bench.gpu import node
from eval.bench.gpu.plan import DEFAULT_BUDGET, TIMING_TABLE, estimate, load_table, run_plan
from eval.bench.gpu.steps import STEPS, default_steps
from tests.helpers import CONFIGS

ROOT = CONFIGS.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_the_import_blocked_dry_run_runs_every_default_step_and_prints_estimate_then_goals(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    estimate_line = next(line for line in lines if "estimate" in line)
    seconds = float(estimate_line.split("estimate ")[1].split(" s")[0])
    assert seconds <= DEFAULT_BUDGET and "min) against a budget of 300 s" in estimate_line
    assert lines.index(estimate_line) < next(i for i, line in enumerate(lines) if "preflight: starting" in line)
    goal_rows = [line for line in lines if line.startswith("| ") and "goal" not in line]
    assert lines[-1].startswith("(CPU dry run") and len(goal_rows) == 5 and lines[-8] == "| goal | measured | verdict |"
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["dry_run"] and [s for s, v in report["steps"].items() if v["status"] == "done"] == [
        s.name for s in default_steps()], report["steps"]
    assert not report["results"]["preflight"]["mismatches"]
    assert "ftfy-free" in report["model"]["caption_cleaning"] and "CPU dry run" in (tmp_path / "gpu.md").read_text()
    table = json.loads((tmp_path / "gpu_step_seconds.json").read_text())
    assert table["gpu"].startswith("CPU dry run") and table["steps"]["ar"]["measured"] is True


def test_the_other_models_captured_ar_step_runs_import_blocked_on_the_tiny_configs(tmp_path):
    """``--steps models_ar``: Janus-Pro and Lumina-mGPT on the static path (their tiny configs on a dry run), each
    with its ms per AR step and projected s per image, in gpu.json and gpu.md."""
    proc = subprocess.run([sys.executable, "scripts/gpu.py", "--dry-run", "--steps", "models_ar", "--out",
                           str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())["results"]["models_ar"]
    assert {k: v["image_tokens"] for k, v in result.items() if k != "count"} == {"janus_pro_1b": 64,
                                                                                "lumina_mgpt_7b": 16}
    assert all(v["ms_per_step"] > 0 and v["path"] == "static (dry run)" for k, v in result.items() if k != "count")
    assert "| janus_tiny (dry run) | static (dry run) | 64 |" in (tmp_path / "gpu.md").read_text()


def test_the_default_plan_fits_five_minutes_on_the_h200_and_every_step_has_a_table_entry():
    table = load_table()
    assert table["gpu"] == "NVIDIA H200" and TIMING_TABLE.name == "gpu_step_seconds.json"
    assert estimate(table, default_steps()) <= DEFAULT_BUDGET
    assert set(STEPS) | {"setup"} <= set(table["steps"])
    for name, entry in table["steps"].items():
        assert entry["measured"] == entry["source"].startswith(("one ", "scripts/", "measured")), name
    assert [s.name for s in default_steps()] == ["preflight", "blocks", "ar", "iterations", "eager_ar", "throughput"]
    assert not any(s.wheels for s in default_steps())  # the default plan needs nothing the node lacks


def test_a_spent_budget_stops_a_step_after_an_image_with_its_json_and_markdown_written(tmp_path, monkeypatch):
    """A clock that jumps 100 s with every image: the first of two AR images fits the 150-s budget, the second
    (expected to take what the first took) does not; the eager image (the table expects 23 s) fits the 50 s left,
    and the step after it finds the budget spent."""
    clock = {"t": 0.0}
    generate = Decoder.generate

    def slow(self, *args, **kwargs):
        clock["t"] += 100.0
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "generate", slow)
    report = run_plan(tmp_path, [STEPS["ar"], STEPS["eager_ar"], STEPS["throughput"]], budget=150.0, dry_run=True,
                      clock=lambda: clock["t"])
    state = report["steps"]["ar"]
    assert state["status"] == "stopped (budget)" and state["stopped"].startswith("after 1 of 2 images")
    assert report["steps"]["eager_ar"]["status"] == "done"
    assert report["steps"]["throughput"]["status"] == "skipped (the budget was spent)"
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["results"]["ar"]["images"] == 1 and written["steps"]["ar"]["stopped"] == state["stopped"]
    assert "stopped (budget) (after 1 of 2 images" in (tmp_path / "gpu.md").read_text()


def test_a_failed_preflight_stops_the_plan(tmp_path, monkeypatch):
    from eval.bench.gpu import steps
    from eval.bench.gpu.plan import PreflightFailed, Step

    def mismatch(session):
        raise PreflightFailed("embedded/sd: static = eager fails")

    plan = [Step("preflight", "", mismatch), STEPS["eager_ar"]]
    monkeypatch.setattr(steps, "xl_model", lambda session: pytest.fail("nothing runs after a failed preflight"))
    report = run_plan(tmp_path, plan, dry_run=True)
    assert report["steps"]["preflight"]["status"] == "failed: embedded/sd: static = eager fails"
    assert report["steps"]["eager_ar"]["status"] == "not run (the preflight failed)"


def test_the_command_names_unknown_steps_lists_its_steps_and_refuses_without_a_gpu(tmp_path):
    bad = subprocess.run([sys.executable, "scripts/gpu.py", "--steps", "ar,warp"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown ['warp']" in bad.stderr
    listed = subprocess.run([sys.executable, "scripts/gpu.py", "--list"], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and "bench_lumina" in listed.stdout and "estimate 285 s" in listed.stdout
    refused = subprocess.run([sys.executable, "scripts/gpu.py", "--out", str(tmp_path / "x")], cwd=ROOT,
                             env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "needs a GPU" in refused.stderr and not (tmp_path / "x").exists()


# -- the node ---------------------------------------------------------------------------------------------------------
def test_the_node_list_is_dated_and_blocks_what_the_node_lacks():
    text = node.NODE_PACKAGES.read_text()
    assert "read 2026-11-17" in text.splitlines()[0]
    have = node.node_distributions()
    assert {"torch", "transformers", "numpy", "safetensors", "huggingface-hub", "pyyaml"} <= have
    assert not {"hydra-core", "omegaconf", "ftfy", "open-clip-torch", "torch-fidelity", "wandb"} & have
    blocked = node.missing_modules()
    assert {"hydra", "omegaconf", "ftfy", "open_clip", "torch_fidelity", "wandb"} <= blocked  # all installed here
    assert not {"torch", "transformers", "numpy", "yaml", "coolsd", "eval", "json"} & blocked
    with_wheels = node.missing_modules(present=node.wheel_names())
    assert not {"hydra", "omegaconf", "ftfy", "antlr4"} & with_wheels and "wandb" in with_wheels


def test_a_blocked_module_cannot_be_imported_and_probing_finds_nothing():
    code = ("import importlib.util, sys; from eval.bench.gpu import node; node.block_imports(frozenset({'omegaconf'}))\n"
            "assert importlib.util.find_spec('omegaconf') is None\n"
            "try:\n    import omegaconf\nexcept ModuleNotFoundError:\n    print('blocked')\n"
            "import coolsd, coolsd.decoding, coolsd.static, baselines.jacobi, eval.bench.gpu.steps; print('core ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["blocked", "core ok"], proc.stderr[-2000:]
    with_hydra = subprocess.run([sys.executable, "-m", "eval.bench.gpu.node", "--block", "omegaconf", "-c"], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=120)
    assert with_hydra.returncode != 0  # "-c" is no script: the runner runs files only


def test_the_core_imports_no_config_metric_or_logging_package_at_module_level():
    """The decode path, the static path and the GPU command, imported with every package the node lacks blocked."""
    code = ("from eval.bench.gpu import node; node.block_imports(node.missing_modules())\n"
            "import coolsd, coolsd.decoding, coolsd.static, coolsd.models, coolsd.drafters.eagle, baselines.jacobi\n"
            "import coolsd.models.llamagen_t2i, coolsd.models.janus_pro, coolsd.models.lumina_mgpt, coolsd.models.emu3\n"
            "import eval.bench.gpu.plan, eval.bench.gpu.steps, eval.bench.gpu.report, eval.bench.gpu_check_llamagen\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.slow
def test_the_wheels_for_the_hydra_steps_fit_their_budget(tmp_path):
    """Downloads from the package registry (``pip download``/``pip wheel``): the five wheels, at most 10 MiB."""
    wheels = node.fetch_wheels(tmp_path)
    names = {w.name.split("-")[0].lower() for w in wheels}
    assert names == {"hydra_core", "omegaconf", "antlr4_python3_runtime", "ftfy", "wcwidth"}
    assert sum(w.stat().st_size for w in wheels) <= node.WHEEL_BUDGET
