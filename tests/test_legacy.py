"""Run folders from before ``eval/`` became sub-packages (issue 56) still load and still count as finished: their
``run.json`` names classes by the old paths (``eval.runner.EvalSuite``, ``eval.prompts.ClassPrompts``, ...), which
``eval.records.legacy`` maps to today's wherever a stored ``run.json`` is read.

The map's own tests take well under a second; the end-to-end test runs ``run.py`` twice on the lookup model, then
``scripts/make_tables.py`` and the report on its folder: 10-25 s on 2 shared CPU cores.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from coolsd.fingerprint import TOKEN_CODE_VERSION
from eval.records.legacy import (ADDED_DECODER_KEYS, ADDED_EVAL_KEYS, MOVED_MODULES, MOVED_NAMES, MOVED_PACKAGES,
                                 current_config, current_target, current_targets)
from eval.records.run_json import read_run
from eval.report.html_page import write_report
from eval.run.experiment import finished_record
from tests.test_run import LOOKUP, ROOT, run_py

#: class paths a run.json of the flat layout holds -> the paths today's configs compose
MOVED = {
    "eval.runner.EvalSuite": "eval.run.suite.EvalSuite",
    "eval.stats.Bootstrap": "eval.metrics.intervals.Bootstrap",
    "eval.logging.WandbLogger": "eval.run.loggers.WandbLogger",
    "eval.logging.NullLogger": "eval.run.loggers.NullLogger",
    "eval.prompts.ClassPrompts": "coolsd.prompts.ClassPrompts",
    "eval.prompts.FixedPrompts": "coolsd.prompts.FixedPrompts",
    "eval.image_reward.ImageReward": "eval.metrics.ImageReward",
}
OLD = {new: old for old, new in MOVED.items()}


def run_config(path, today: bool = False) -> dict:
    """A run's resolved config, as ``run.json`` stores it, with each class path given by ``path(old path)``;
    ``today``: with the decoder and eval keys added since (``decoder.path``, ``eval.code_mismatch``, ...), as
    today's configs compose it."""
    return {
        "model": {"_target_": "coolsd.models.lookup.LookupModel", "image_size": 8},
        "decoder": {"_target_": "coolsd.decoding.Decoder", "name": "sd", "draft_len": 2,
                    "rule": {"_target_": "baselines.exact.ExactRule"}, **(ADDED_DECODER_KEYS if today else {})},
        "data": {"_target_": path("eval.prompts.ClassPrompts")},
        "eval": {"_target_": path("eval.runner.EvalSuite"), "num_prompts": 2, "seed": 0,
                 **(ADDED_EVAL_KEYS if today else {}),
                 "bootstrap": {"_target_": path("eval.stats.Bootstrap"), "resamples": 100, "seed": 0, "level": 0.95},
                 "metrics": [{"_target_": "eval.metrics.FIDKID", "protocol": "torch_fidelity"},
                             {"_target_": path("eval.image_reward.ImageReward")}]},
        "logger": {"_target_": path("eval.logging.WandbLogger"), "mode": "offline"},
        "dist": {"poll_s": 10.0},
    }


def finished_folder(folder: Path, config: dict, decoders=("ar", "sd")) -> Path:
    """A complete run folder: ``run.json`` with ``config``, every decoder's fingerprint and records (no images)."""
    (folder / "records").mkdir(parents=True)
    n = config["eval"]["num_prompts"]
    for name in decoders:
        (folder / "records" / f"{name}.fingerprint.json").write_text(json.dumps({"code_version": TOKEN_CODE_VERSION}))
        (folder / "records" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"index": i, "prompt": "p", "seed": i}) + "\n" for i in range(n)))
    record = {"decoder": "sd", "num_prompts": n, "config": config,
              "per_decoder": {name: {"num_images": n} for name in decoders}}
    (folder / "run.json").write_text(json.dumps(record))
    return folder


def test_the_old_class_paths_map_to_todays():
    for old, new in MOVED.items():
        assert current_target(old) == new
    assert current_target("eval.metrics.FIDKID") == "eval.metrics.FIDKID"  # did not move
    assert current_target("eval.runner.run_experiment") == "eval.run.experiment.run_experiment"
    assert current_target("eval.records.RunRecords") == "eval.run.resume.RunRecords"
    assert current_target("eval.peers.llamagen.SPEC") == "eval.bench.peers.llamagen.SPEC"
    assert current_target("eval.claims.statistics.Claim") == "eval.studies.claims.analysis.Claim"
    assert current_targets(run_config(str)) == run_config(lambda old: MOVED[old])
    assert current_config(run_config(str)) == run_config(lambda old: MOVED[old], today=True)


def test_every_new_path_of_the_map_exists():
    for old, new in MOVED_NAMES.items():
        module, _, name = new.rpartition(".")
        assert hasattr(importlib.import_module(module), name), f"{old} -> {new}: no such name"
    for new in [*MOVED_MODULES.values(), *MOVED_PACKAGES.values()]:
        importlib.import_module(new)


def test_todays_class_paths_are_left_as_they_are():
    """A run.json written by this version reads back unchanged: no target of any config moves again."""
    targets = set()

    def walk(node):
        if isinstance(node, dict):
            targets.update(v for k, v in node.items() if k == "_target_" and isinstance(v, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in (ROOT / "configs").rglob("*.yaml"):
        walk(yaml.safe_load(path.read_text()))
    assert "eval.run.suite.EvalSuite" in targets and "coolsd.prompts.ClassPrompts" in targets
    assert {t: current_target(t) for t in targets if current_target(t) != t} == {}
    assert not any(t.startswith(old + ".") for t in targets for old in MOVED_MODULES)


def test_a_finished_row_of_the_old_layout_is_still_finished(tmp_path):
    """A run.json of the flat layout, without the decoder keys added since (``decoder.path``), is the row today's
    config composes: finished."""
    today = OmegaConf.create(run_config(lambda old: MOVED[old], today=True))
    folder = finished_folder(tmp_path / "old", run_config(str))
    found = finished_record(folder, today)
    assert found is not None and found["config"] == run_config(lambda old: MOVED[old], today=True)
    static = OmegaConf.create({**run_config(lambda old: MOVED[old]), "decoder": {
        **run_config(str)["decoder"], "path": "static"}})
    assert finished_record(folder, static) is None  # the row was made on the eager path
    assert read_run(folder / "run.json")["config"]["eval"]["_target_"] == "eval.run.suite.EvalSuite"
    other = OmegaConf.create({**run_config(lambda old: MOVED[old]), "decoder": {"name": "sd", "draft_len": 3}})
    assert finished_record(folder, other) is None  # a config that differs otherwise is still not finished


def old_layout(record_path: Path) -> None:
    """Rewrite a run.json as the flat eval/ layout wrote it: today's class paths back to the old ones."""
    def back(node):
        if isinstance(node, dict):
            return {k: OLD.get(v, v) if k == "_target_" else back(v) for k, v in node.items()}
        return [back(v) for v in node] if isinstance(node, list) else node

    record = json.loads(record_path.read_text())
    record["config"] = back(record["config"])
    record_path.write_text(json.dumps(record, indent=2))


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_an_old_run_folder_is_finished_and_loads_in_the_tables_and_the_report(tmp_path):
    folder = tmp_path / "row"
    args = [*LOOKUP, "decoder=sd", "eval.num_prompts=2", f"hydra.run.dir={folder}"]
    run_py(*args)
    old_layout(folder / "run.json")
    text = (folder / "run.json").read_text()
    assert '"eval.runner.EvalSuite"' in text and '"eval.prompts.FixedPrompts"' in text
    assert "nothing to do" in run_py(*args).stdout  # recognised as finished: no model built, nothing generated
    assert (folder / "run.json").read_text() == text

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", str(folder), "--out", str(tmp_path / "t"),
                           "--no-plots", "--name", "old"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 run records" in proc.stdout and (tmp_path / "t" / "tables" / "old.md").is_file()
    page = write_report(folder).read_text()
    assert "<h2>Results" in page and "vanilla SD" in page and "speedup" in page
