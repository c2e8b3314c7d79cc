"""The evaluation card (``eval/report/evaluation_card.py``, issue 46 item 3): every field from a composed config
and from a run.json alone, ``run.py`` writing and printing it, and the tables stating it and refusing rows of
different protocols.

The run test runs ``run.py`` on the lookup model (4 prompts, ar + sd) once for the module: 10-20 s on 2 shared CPU
cores; the two ``make_tables.py`` calls take 3-6 s each.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eval.report import evaluation_card as ec
from eval.report import paper_tables as mt
from tests.helpers import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "golden" / "runs"
LOOKUP = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=[sd]",
          "eval.num_prompts=4", "eval.warmup=0", "eval.reuse_ar=false"]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def assert_plain(card: dict) -> None:
    """Every field, in order, each a string, a number or null (the HTML report renders it as it is)."""
    assert tuple(card) == ec.FIELDS
    assert all(v is None or isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in card.values()), card
    assert json.loads(json.dumps(card)) == card


def test_the_default_run_s_card_states_every_field_of_its_protocol():
    card = ec.evaluation_card(composed())
    assert_plain(card)
    assert card["prompts"] == "the model's 10 class names, cycled"
    assert (card["images per decoder"], card["timed images"], card["reference images"]) == (1000, 20, 2000)
    assert card["reference set"].startswith("Fashion-MNIST test images, class-balanced")
    assert "128-d penultimate layer" in card["feature extractor"] and card["extractor weights"] == \
        "file classifier.safetensors"
    assert "no further resize" in card["resize and crop"]
    assert card["image seeds"].startswith("image i: seed 0 + i") and "every decoder" in card["image seeds"]
    assert card["bootstrap"].startswith("1,000 resamples, seed 0, 95 % intervals")
    assert (card["CFG scale"], card["top-k"], card["top-p"], card["temperature"]) == (2.0, 0, 1.0, 1.0)
    assert card["precision"] == "float32" and card["device"].startswith("auto")
    assert card["image metrics"] == "FID, KID (classifier features), class accuracy"
    assert card["CLIP score"] is None and card["HPS"] is None and card["hardware"] is None  # not applicable here
    lines = ec.card_lines(card)
    assert lines[0].startswith("Evaluation card") and "- reference images: 2,000" in lines
    assert "- top-k: 0 (off)" in lines and not any(line.startswith("- CLIP score") for line in lines)


def test_the_paper_protocol_s_card_names_reference_resize_extractors_and_sampling():
    card = ec.evaluation_card(composed("model=llamagen_t2i_512", "eval=coco5k_hps"))
    assert_plain(card)
    assert card["prompts"].startswith("MS-COCO captions (captions_val2017.json), the longest caption")
    assert (card["reference set"], card["reference images"]) == ("MS-COCO 2017 val images (val2017)", 5000)
    assert "LANCZOS to 256 px" in card["resize and crop"] and "clean-fid mode=clean" in card["resize and crop"]
    assert "to 299 px" in card["resize and crop"]
    assert card["feature extractor"].startswith("Inception-v3 (clean-fid's") and \
        card["extractor weights"] == "pt_inception-2015-12-05"
    assert "ViT-B-32-quickgelu, openai weights" in card["CLIP score"]
    assert "THUDM/ImageReward" in card["ImageReward"] and card["HPS"].startswith("HPSv2.1 (open_clip ViT-H-14")
    assert (card["images per decoder"], card["timed images"]) == (5000, 1000)
    assert (card["CFG scale"], card["top-k"]) == (7.5, 1000)
    assert card["precision"].startswith("auto (bfloat16 on CUDA")


def test_a_run_without_image_metrics_says_so_and_leaves_their_fields_null():
    card = ec.evaluation_card(composed("eval=quick"))
    assert_plain(card)
    assert card["image metrics"] == "no image metrics"
    scorers = ("reference set", "reference images", "resize and crop", "feature extractor", "extractor weights",
               "CLIP score", "ImageReward", "HPS", "class accuracy")
    assert all(card[f] is None for f in scorers)
    lines = "\n".join(ec.card_lines(card))
    assert "- image metrics: no image metrics" in lines and "reference" not in lines


def test_a_run_json_made_before_cards_gets_one_saying_what_it_does_not_record():
    record = json.loads((FIXTURES / "lumina" / "0_sd" / "run.json").read_text())
    assert "evaluation_card" not in record and "eval" not in record["config"]
    card = ec.record_card(record)
    assert_plain(card)
    assert (card["images per decoder"], card["hardware"], card["world size"]) == (1000, "NVIDIA A100-SXM4-80GB", 8)
    assert card["prompts"] == card["top-k"] == card["reference set"] == ec.NOT_RECORDED


def test_the_key_holds_what_changes_numbers_and_unknown_values_never_conflict():
    base = ec.evaluation_card(composed())
    machine = {**base, "device": "cuda", "hardware": "NVIDIA H200", "world size": 8, "batch size": "other"}
    assert ec.card_key(machine) == ec.card_key(base) and ec.conflicts(base, machine) == []
    assert ec.conflicts(base, {**base, "top-k": 5}) == ["top-k"]
    assert ec.conflicts(base, {**base, "precision": "bfloat16", "images per decoder": 5000}) == \
        ["images per decoder", "precision"]
    assert ec.conflicts(base, {**base, "top-k": ec.NOT_RECORDED, "CLIP score": "open_clip ..."}) == []
    assert set(ec.KEY_FIELDS) | set(ec.UNKEYED) == set(ec.FIELDS)


@pytest.fixture(scope="module")
def lookup_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("lookup")
    proc = subprocess.run([sys.executable, "run.py", *LOOKUP, f"hydra.run.dir={out}"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_run_py_writes_the_card_into_run_json_and_prints_it_under_its_table(lookup_run):
    out, stdout = lookup_run
    record = json.loads((out / "run.json").read_text())
    card = record["evaluation_card"]
    assert_plain(card)
    assert card == ec.record_card(record)  # the tables rebuild the same card from the record
    assert (card["images per decoder"], card["timed images"]) == (4, 4)
    assert card["prompts"].startswith("3 prompts written in the config ('a', 'b', 'c'")
    assert card["image metrics"] == "no image metrics" and card["device"] == "cpu"
    assert card["hardware"].startswith("CPU ") and card["world size"] == 1
    lines = ec.card_lines(card)
    table = (out / "table.md").read_text()
    assert "\n".join(lines) in stdout and "\n".join(lines) in table
    assert stdout.index(lines[0]) < stdout.index(" prompts -> ")  # under the table, before the summary line


def make_tables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/make_tables.py", *args, "--no-plots"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120, check=False)


def test_make_tables_refuses_rows_of_different_cards_unless_asked(lookup_run, tmp_path):
    out, _ = lookup_run
    runs = tmp_path / "runs"
    shutil.copytree(out, runs / "a", ignore=shutil.ignore_patterns("images", "records", "*.png", "*.pdf"))
    record = json.loads((out / "run.json").read_text())
    record["config"]["model"]["sampling"]["top_k"] = 2  # another protocol ...
    record["config"]["decoder"]["draft_len"] += 1  # ... for another row of the same table
    record["started"] = "2099-01-01T00:00:00+00:00"
    (runs / "b").mkdir()
    (runs / "b" / "run.json").write_text(json.dumps(record))

    refused = make_tables(str(runs), "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2, refused.stdout[-2000:]
    message = refused.stderr
    assert "different evaluation protocols" in message and "top-k" in message and "--mixed-protocols" in message
    assert "runs/a" in message and "runs/b" in message and "'2' in runs/b" in message
    assert not (tmp_path / "refused" / "tables").exists()

    mixed = make_tables(str(runs), "--out", str(tmp_path / "mixed"), "--name", "t", "--mixed-protocols")
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    md = (tmp_path / "mixed" / "tables" / "t.md").read_text()
    caption = md.splitlines()[0]
    assert "Mixed evaluation protocols (--mixed-protocols)" in caption and "differ in top-k" in caption
    notes = [line for line in md.splitlines() if line.startswith("- Evaluation card")]
    assert any("every row" in n and "images per decoder: 4" in n for n in notes)
    per_row = [n for n in notes if "(runs/" in n]
    assert len(per_row) == 3 and all("top-k:" in n for n in per_row)  # AR and both SD rows
    assert any("runs/b" in n and "top-k: 2" in n for n in per_row)
    assert any("runs/a" in n and "top-k: 0 (off)" in n for n in per_row)
    assert r"Evaluation card" in (tmp_path / "mixed" / "tables" / "t.tex").read_text()


def test_tables_state_one_card_when_the_rows_agree(lookup_run, tmp_path):
    out, _ = lookup_run
    written = mt.write_tables([out / "run.json"], name="one", out=tmp_path)
    md = written.tables.markdown
    assert "Mixed evaluation protocols" not in md
    line = next(n for n in md.splitlines() if n.startswith("- Evaluation card of every row"))
    assert "top-k: 0 (off)" in line and "image metrics: no image metrics" in line and "device: cpu" in line


def test_cards_are_compared_within_each_model_and_stated_per_model_where_models_differ(tmp_path):
    """Each model's rows share its sampling, so two models of one table may differ (each gets its card line); two
    rows of one model may not. The published rows are not checked."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES, runs)
    for path in sorted(runs.rglob("run.json")):
        record = json.loads(path.read_text())
        top_k = 2000 if "lumina" in path.parts else 1000
        record["config"]["model"] = {"sampling": {"cfg_scale": 3.0, "top_k": top_k}, "dtype": "bfloat16"}
        path.write_text(json.dumps(record))
    written = mt.write_tables([runs], name="t", out=tmp_path / "ok", published=True)
    md = written.tables.markdown
    assert "Mixed evaluation protocols" not in md
    assert "precision: bfloat16" in next(n for n in md.splitlines() if n.startswith("- Evaluation card of every row"))
    assert "top-k: 2,000" in next(n for n in md.splitlines() if n.startswith("- Evaluation card, Lumina-mGPT"))
    assert "top-k: 1,000" in next(n for n in md.splitlines() if n.startswith("- Evaluation card, LlamaGen-XL"))
    odd = runs / "llamagen" / "4_coolsd_d2" / "run.json"
    record = json.loads(odd.read_text())
    record["config"]["model"]["dtype"] = "float32"
    odd.write_text(json.dumps(record))
    with pytest.raises(mt.ProtocolMismatch, match=r"LANTERN sampling\), precision: 'bfloat16' in .*; 'float32' in "
                                                   r"runs/llamagen/4_coolsd_d2 \(COOL-SD δ=2"):
        mt.write_tables([runs], name="t", out=tmp_path / "refused", published=True)
