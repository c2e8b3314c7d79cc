"""Paper tables and plots (``eval.report.paper_tables``, ``eval.report.paper_plots``,
``scripts/make_tables.py``) and the experiment configs that feed them.

Golden tables come from the fixture records in ``tests/golden/runs`` (made-up numbers under two real model
names: duplicates, a method missing on one model, a metric missing in one row, an ablation option that
varies).
The fixtures carry made-up 95 % intervals (``<metric>_ci``), except ``lumina/3_coolsd`` and
``llamagen/2_coolsd_old`` (runs "made before intervals": their values are never bold).
To regenerate the golden files after an intended change of the layout::

    python scripts/make_tables.py tests/golden/runs --name fixture_table --published --out /tmp/g --no-plots
    cp /tmp/g/tables/fixture_table.md /tmp/g/tables/fixture_table.tex tests/golden/

The multirun test runs ``experiment=tiny_table`` (5 rows on the random-weight tiny model, 2 prompts) end to
end and turns it into a table and plots: 17-35 s on 2 shared CPU cores; the whole file takes 40-75 s.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from eval.records.run_json import current_record
from eval.report import paper_plots as plots
from eval.report import paper_tables as mt
from tests.helpers import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
FIXTURES = GOLDEN / "runs"
# the paper's tables and sweeps (and tiny_table); the embedded claims experiments are tests/test_claims.py's
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml") if not p.stem.startswith("embedded"))
ROWS = sorted(p.stem for p in (CONFIGS / "row").glob("*.yaml"))


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
            "MPLBACKEND": "Agg"}


def lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


@pytest.fixture(scope="module")
def fixture_tables(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tables")
    mt.write_tables([FIXTURES], name="fixture_table", published=True, out=out)
    return out / "tables"


@pytest.mark.parametrize("ext", ["md", "tex"])
def test_tables_match_golden_files(fixture_tables, ext):
    produced = (fixture_tables / f"fixture_table.{ext}").read_text()
    assert lines(produced) == lines((GOLDEN / f"fixture_table.{ext}").read_text())


def table_cells(md: str) -> dict[tuple[str, str], list[str]]:
    """{(model, method): cells} of a markdown table (bold marks kept)."""
    rows, model = {}, None
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 2 and cells[1] != "method":
            model = cells[0] or model
            rows[(model, cells[1])] = cells[2:]
    return rows


def test_duplicates_keep_the_newest_and_missing_runs_stay_empty(fixture_tables, tmp_path):
    measured = (fixture_tables / "fixture_table.md").read_text().split(mt.PUBLISHED_TITLE)[0]
    rows = table_cells(measured)
    llamagen, lumina = mt.MODEL_LABELS["llamagen_t2i_512_lantern"], mt.MODEL_LABELS["lumina_mgpt_768"]
    # COOL-SD δ=1.1 on LlamaGen ran twice: the newer run (3_coolsd, accepted length 2.74) wins, whatever the
    # folder order, and a note names the dropped run; N per row (images, timed images)
    assert rows[(llamagen, "COOL-SD δ=1.1 (exponential schedule)")][4] == "2.74 ± 0.02"
    assert rows[(llamagen, "COOL-SD δ=1.1 (exponential schedule)")][0] == "5,000 (1,000)"
    assert rows[(lumina, "SJD")][0] == "1,000"
    assert "dropped runs/llamagen/2_coolsd_old" in measured
    # SJD never ran on LlamaGen, COOL-SD δ=2 never on Lumina-mGPT: every cell is "—", nothing is filled in
    assert set(rows[(llamagen, "SJD")]) == {"—"}
    assert set(rows[(lumina, "COOL-SD δ=2 (exponential schedule)")]) == {"—"}
    assert rows[(lumina, "COOL-SD δ=1.1 (exponential schedule)")][1] == "—"  # that run did not score CLIP
    # the CSV holds the measured rows (raw numbers and interval ends, empty where missing) and the published
    # rows, marked
    table = pd.read_csv(fixture_tables / "fixture_table.csv")
    measured_rows = table[table["kind"] == "measured"]
    assert len(measured_rows) == 12 and set(table["kind"]) == {"measured", "published", "reported"}
    cool = measured_rows[(measured_rows["model"] == "lumina_mgpt_768")
                         & (measured_rows["decoder"] == "coolsd")]
    assert len(cool) == 1 and np.isnan(cool["clip_score"].iloc[0]) and np.isnan(cool["fid_lo"].iloc[0])
    sd = measured_rows[(measured_rows["model"] == "llamagen_t2i_512_lantern") & (measured_rows["decoder"] == "sd")]
    assert (sd["fid_lo"].iloc[0], sd["fid"].iloc[0], sd["fid_hi"].iloc[0]) == (20.716, 20.95, 21.236)
    assert sd["num_images"].iloc[0] == 5000 and sd["num_timed"].iloc[0] == 1000
    # reordering the folders does not change which duplicate is kept
    moved = tmp_path / "runs"
    shutil.copytree(FIXTURES, moved)
    (moved / "llamagen" / "2_coolsd_old").rename(moved / "llamagen" / "9_coolsd_old")
    kept, notes = mt.deduplicate(mt.measurements(mt.find_records([moved])))
    cool = [m for m in kept if m.model == "llamagen_t2i_512_lantern" and m.options.get("delta") == 1.1
            and m.options.get("schedule") == "exponential"]
    assert [m.source for m in cool] == ["runs/llamagen/3_coolsd"]
    assert any("dropped runs/llamagen/9_coolsd_old" in n for n in notes)


def test_bold_marks_only_a_significantly_best_value(fixture_tables):
    measured, published = (fixture_tables / "fixture_table.md").read_text().split(mt.PUBLISHED_TITLE)
    rows = table_cells(measured)
    llamagen, lumina = mt.MODEL_LABELS["llamagen_t2i_512_lantern"], mt.MODEL_LABELS["lumina_mgpt_768"]
    # columns: N, CLIP, FID, KID, accepted length, latency, speedup, TV per step
    best = rows[(llamagen, "COOL-SD δ=2 (exponential schedule)")]
    assert best[4:7] == ["**3.33 ± 0.02**", "**3.76 ± 0.02**", "**2.73 ± 0.03×**"]  # intervals apart from δ=1.5's
    # AR's FID 20.91 is the lowest on LlamaGen but its interval overlaps vanilla SD's (20.95): not bold
    assert rows[(llamagen, "AR")][2] == "20.91 ± 0.26" and rows[(llamagen, "vanilla SD (EAGLE-1 tree)")][2] == \
        "20.95 ± 0.26"
    # COOL-SD has Lumina-mGPT's best accepted length and speedup, but that run has no intervals: never bold
    assert rows[(lumina, "COOL-SD δ=1.1 (exponential schedule)")][4:7] == ["3.12", "63.00", "2.70×"]
    assert not any("**" in c for (model, _), cells in rows.items() if model == lumina for c in cells)
    assert rows[(lumina, "AR")][3] == rows[(lumina, "SJD")][3].split(" ±")[0] == "0.0051"  # a tie: never bold
    assert not any(cells[7].startswith("**") for cells in rows.values())  # TV per step: a diagnostic
    assert "28.99" in published and "28.99" not in measured  # published numbers stay in their own table
    assert not any("**" in line for line in published.splitlines() if line.startswith("| "))  # no intervals


def test_bold_depends_on_significance():
    def frame(intervals):
        rows = [{"model_label": "m", "method": name, "_order": ((0, ""), i, name, ()), "speedup": value,
                 "speedup_ci": ci, "num_images": 100, "num_timed": 100}
                for i, (name, value, ci) in enumerate(intervals)]
        return pd.DataFrame(rows)

    column = [c for c in mt.COLUMNS if c.key == "speedup"]
    apart = mt.layout(frame([("a", 2.0, (1.9, 2.1)), ("b", 2.5, (2.4, 2.6))]), column)
    assert [c.bold for r in apart for c in r.cells] == [False, True]
    overlapping = mt.layout(frame([("a", 2.0, (1.8, 2.45)), ("b", 2.5, (2.4, 2.6))]), column)
    assert [c.bold for r in overlapping for c in r.cells] == [False, False]
    assert [c.text for r in apart for c in r.cells] == ["2.00 ± 0.10×", "2.50 ± 0.10×"]
    # a third, worse row does not matter: the comparison is with the runner-up
    three = mt.layout(frame([("a", 2.0, (1.9, 2.1)), ("b", 2.5, (2.4, 2.6)), ("c", 1.0, (0.9, 1.1))]), column)
    assert [c.bold for r in three for c in r.cells] == [False, True, False]


def test_small_fid_samples_are_marked_biased(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "lumina", runs / "lumina")
    path = runs / "lumina" / "0_sd" / "run.json"
    record = json.loads(path.read_text())
    for metrics in record["per_decoder"].values():
        metrics["fid_num_images"] = 500
    path.write_text(json.dumps(record))
    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([runs])))[0])
    tables = mt.build_tables(frame, [], "t", mt.COLUMN_KEYS)
    rows = table_cells(tables.markdown)
    model = mt.MODEL_LABELS["lumina_mgpt_768"]
    assert rows[(model, "vanilla SD (EAGLE-1 tree)")][2] == "29.07 ± 0.55†"
    assert rows[(model, "SJD")][2] == "29.00 ± 0.55"  # its run scored 1,000 images
    assert mt.BIAS_NOTE in tables.markdown and "KID" in mt.BIAS_NOTE
    assert r"$^\dagger$" in tables.latex


def test_a_row_made_under_two_arithmetics_is_marked(tmp_path):
    """A row resumed on another GPU kind (``eval.numerics_mismatch=accept``) carries its mix into the table."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "lumina", runs / "lumina")
    path = runs / "lumina" / "0_sd" / "run.json"
    record = json.loads(path.read_text())
    record["per_decoder"]["sd"]["numerics_signatures"] = {"a" * 40: 600, "b" * 40: 400}
    path.write_text(json.dumps(record))
    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([runs])))[0])
    tables = mt.build_tables(frame, [], "t", mt.COLUMN_KEYS)
    methods = {method for _, method in table_cells(tables.markdown)}
    assert "vanilla SD (EAGLE-1 tree) ‡" in methods and "SJD" in methods and "SJD ‡" not in methods
    assert "several float32 arithmetics" in tables.markdown


def test_a_pathrelax_row_says_it_is_lossy(tmp_path):
    """PathRelax beside SJD in a Jacobi table: its label says "lossy", since no TV column can (its verification is
    not a token test, so its TV is not measured; the notes say why the cell is empty). The row preset is the one
    ``experiment=table_jacobi_lumina`` and ``table_jacobi_emu3`` sweep (the authors' 2 paths x 12)."""
    for name in ("table_jacobi_lumina", "table_jacobi_emu3"):
        assert "pathrelax" in sweep(compose_with([f"experiment={name}"], hydra_cfg=True))["row"]
    decoder = OmegaConf.to_container(compose_with(["experiment=table_jacobi_lumina", "row=pathrelax"]).decoder,
                                     resolve=True)
    assert decoder["name"] == "pathrelax" and decoder["draft_len"] == 24 and decoder["drafter"]["paths"] == 2
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "lumina", runs / "lumina")
    shutil.copytree(runs / "lumina" / "1_sjd", runs / "lumina" / "4_pathrelax")  # SJD's numbers, PathRelax's config
    path = runs / "lumina" / "4_pathrelax" / "run.json"
    record = json.loads(path.read_text())
    metrics = {**record["per_decoder"]["sjd"], "mean_accepted_length": 2.6, "tv_per_step": None,
               "tv_measured": False}
    metrics.pop("tv_per_step_ci")
    record.update(decoder="pathrelax", metrics=metrics, per_decoder={"ar": record["per_decoder"]["ar"],
                                                                     "pathrelax": metrics})
    record["config"]["decoder"] = decoder
    path.write_text(json.dumps(record))
    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([runs])))[0])
    tables = mt.build_tables(frame, [], "t", mt.COLUMN_KEYS)
    rows = table_cells(tables.markdown)
    model = mt.MODEL_LABELS["lumina_mgpt_768"]
    methods = [method for m, method in rows if m == model]
    assert methods.index("SJD") < methods.index("PathRelax (lossy)") < methods.index("vanilla SD (EAGLE-1 tree)")
    assert rows[(model, "PathRelax (lossy)")][-1] == "—" and rows[(model, "SJD")][-1] != "—"  # TV per step
    assert mt.TV_NOTE in tables.markdown and "PathRelax" in mt.TV_NOTE
    no_tv = mt.build_tables(frame[frame["decoder"] != "pathrelax"], [], "t", mt.COLUMN_KEYS)
    assert mt.TV_NOTE not in no_tv.markdown  # the note only where a row's TV is not measured


#: the reported-only methods (``published_numbers.csv`` rows with a ``reason``) and the ones without any number
REPORTED = {"CSD (content-aware SD)", "CASCADE", "MuLo-SD (2× drafter)", "MuLo-SD (4× drafter)",
            "SJD2 (SJD2 paper, 592 steps)", "SJD2 (SJD-PAC paper)", "SSD", "SSD, r=2 (80 steps)", "Hawk", "SJD++",
            "Entropy-aware SJD (535.5 steps)", "Entropy-aware SJD (1,594.5 steps)",
            "ADT-Tree (abstract, MS-COCO 2017)", "ADT-Tree (abstract, PartiPrompts)",
            "HB-SJD (batch 8-64, low end of the range)", "HB-SJD (batch 8-64, high end of the range)",
            "Lock-step batched SJD (HB-SJD paper's baseline)"}
NO_NUMBERS = {"CSD (content-aware SD)", "CASCADE", "SJD++"}  # abstracts only: every number stays empty


def test_reported_rows_print_apart_marked_reported_with_their_reason(fixture_tables):
    """Methods the harness does not reproduce print in their own table after the published one, whatever was
    measured, each with its venue, benchmark, source and reason; a number the paper does not give stays "—" (the
    CSV: empty), never filled in; they never enter the measured or the published table."""
    md = (fixture_tables / "fixture_table.md").read_text()
    assert md.count(mt.REPORTED_TITLE) == 1 and md.index(mt.PUBLISHED_TITLE) < md.index(mt.REPORTED_TITLE)
    before, reported = md.split(mt.REPORTED_TITLE)
    header = next(line for line in reported.splitlines() if line.startswith("| model |"))
    titles = [c.strip() for c in header.strip("|").split("|")]
    assert titles[2:4] == ["venue / arXiv", "benchmark"] and titles[-2:] == ["source", "why not reproduced"]
    assert {"FID ↓", "speedup (×) ↑"} <= set(titles)
    rows = table_cells(reported)
    assert {method for _, method in rows} == REPORTED
    assert not any(method in before for method in REPORTED)  # not in the measured nor the published table
    csv_rows = pd.read_csv(mt.PUBLISHED_CSV)
    for (model, method), cells in rows.items():  # a method may be reported for several models (SJD2, SSD)
        row = csv_rows[(csv_rows["method"] == method) & (csv_rows["model"] == model)].iloc[0]
        assert cells[-1] == row["reason"] and cells[-1] != "—" and pd.isna(row["decoder"])  # its reason, no decoder
        numbers = cells[2:-2]  # between venue/benchmark and source/reason
        if method in NO_NUMBERS:
            assert set(numbers) == {"—"}, (method, numbers)
            assert row[["clip_score", "fid", "mean_accepted_length", "latency_s", "speedup"]].isna().all()
        else:
            assert cells[-2] != "—" and any(c != "—" for c in numbers), method  # a cited table, a number from it
    hawk = rows[("Lumina-mGPT 7B", "Hawk")]
    assert hawk[titles.index("FID ↓") - 2] == "—" and hawk[titles.index("speedup (×) ↑") - 2] == "1.71×"
    mulo = rows[("LlamaGen-XL (512 px)", "MuLo-SD (2× drafter)")]
    assert (mulo[titles.index("FID ↓") - 2], mulo[titles.index("speedup (×) ↑") - 2]) == ("54.30", "1.40×")
    table = pd.read_csv(fixture_tables / "fixture_table.csv")
    kept = table[table["kind"] == "reported"]
    assert set(kept["method"]) == REPORTED and kept["decoder"].isna().all() and kept["reason"].notna().all()
    assert kept.loc[kept["method"].isin(NO_NUMBERS), ["fid", "speedup"]].isna().all().all()
    assert "\\caption{Reported, not reproduced" in (fixture_tables / "fixture_table.tex").read_text()


def test_adt_tree_and_hb_sjd_print_with_their_sources(fixture_tables):
    """ADT-Tree (arXiv 2512.21857) prints its abstract's two speedups, each row with its source and the reason its
    released code cannot be run for it (LANTERN's code; the flag goes unread, cited by commit and lines); HB-SJD
    (arXiv 2608.18183) prints its abstract's range at batch 8-64 (both ends) and its lock-step baseline, the source
    saying which batch gives which end is not stated. Fails if a row or its source goes missing."""
    md = (fixture_tables / "fixture_table.md").read_text().split(mt.REPORTED_TITLE)[1]
    header = next(line for line in md.splitlines() if line.startswith("| model |"))
    titles = [c.strip() for c in header.strip("|").split("|")][2:]  # the cells after model and method
    rows = {method: dict(zip(titles, cells)) for (_, method), cells in table_cells(md).items()}
    for method, benchmark, speedup in (("ADT-Tree (abstract, MS-COCO 2017)", "MS-COCO 2017", "3.13×"),
                                       ("ADT-Tree (abstract, PartiPrompts)", "PartiPrompts", "3.05×")):
        row = rows[method]
        assert row["speedup (×) ↑"] == speedup and row["benchmark"] == benchmark
        assert "arXiv 2512.21857" in row["venue / arXiv"] and "abstract (arXiv 2512.21857v1)" in row["source"]
        reason = row["why not reproduced"]
        for cited in ("Haodong-Lei-Ray/ADT-Tree@6526280", "jadohu/LANTERN@3a56e45",
                      "entrypoints/generate_images.py lines 59-60", "models/ea_model_anole.py lines 1017-1031"):
            assert cited in reason, (method, cited)
    metrics = [title for title in titles if title.endswith(("↑", "↓"))]
    for method, speedup in (("HB-SJD (batch 8-64, low end of the range)", "1.30×"),
                            ("HB-SJD (batch 8-64, high end of the range)", "1.49×"),
                            ("Lock-step batched SJD (HB-SJD paper's baseline)", "0.94×")):
        hb = rows[method]
        assert hb["venue / arXiv"] == "arXiv 2608.18183" and "which batch gives which end is not stated" in hb["source"]
        assert hb["speedup (×) ↑"] == speedup and "decoder.refill" in hb["why not reproduced"]
        assert all(hb[title] == "—" for title in metrics if title != "speedup (×) ↑")  # nothing else is given


def test_published_rows_of_reproduced_methods_follow_the_measured_decoders(fixture_tables, tmp_path):
    """A reproduced method's published rows print only when its decoder was measured (all of them when nothing
    was); the reported rows print either way. The fixture measured ar, sd, sjd, lantern_pp and coolsd."""
    md = (fixture_tables / "fixture_table.md").read_text()
    published = table_cells(md.split(mt.PUBLISHED_TITLE)[1].split(mt.REPORTED_TITLE)[0])
    methods = {method for _, method in published}
    assert {"SJD (SJD-SV paper, MS-COCO, NFE 1058.6)", "AR (VVS paper)",
            "EAGLE-2, dynamic tree (MuLo-SD paper)"} <= methods  # ar, sjd, sd: measured
    for absent in ("SJD-SV (SJD-SV paper, MS-COCO, NFE 866.8)", "GSD-SV (SJD-SV paper, PartiPrompts, NFE 721.5)",
                   "LANTERN-SV in the Jacobi loop (SJD-SV paper, PartiPrompts, NFE 552.9)",
                   "VVS, uniform skipping (VVS paper)", "LANTERN (VVS paper)"):
        assert absent not in methods  # sjd_sv, gsd_sv, lantern_sjd, vvs, lantern: not measured here
    alone = mt.write_tables([], published=True, out=tmp_path).tables.markdown
    published = table_cells(alone.split(mt.PUBLISHED_TITLE)[1].split(mt.REPORTED_TITLE)[0])
    frame = mt.published_frame()
    assert set(frame.loc[frame["kind"] == "published", "decoder"]) >= {"sjd_sv", "gsd_sv", "lantern_sjd", "vvs"}
    assert {m for _, m in published} == set(frame.loc[frame["kind"] == "published", "method"])
    assert {m for _, m in table_cells(alone.split(mt.REPORTED_TITLE)[1])} == REPORTED
    sv = published[("Lumina-mGPT 7B", "SJD-SV (SJD-SV paper, MS-COCO, NFE 866.8)")]
    assert sv == ["0.3133", "30.76", "—", "2.74", "32.92", "2.63×"]  # CLIP, FID, IR, length, latency, speedup
    vvs = published[("LlamaGen-XL stage II (512 px)", "VVS, uniform skipping (VVS paper)")]
    assert vvs[1] == "47.19" and vvs[-1] == "1.76×"
    bad = tmp_path / "bad.csv"
    table = pd.read_csv(mt.PUBLISHED_CSV)
    table.loc[table["method"] == "Hawk", "decoder"] = "sd"  # a row with a decoder and a reason
    table.to_csv(bad, index=False)
    with pytest.raises(ValueError, match="never both or neither"):
        mt.published_frame(bad)


def test_published_numbers_match_the_spec():
    spec = ROOT.parent / "shared" / "docs" / "algorithms.md"
    if not spec.is_file():
        pytest.skip(f"{spec} not present in this checkout")
    text = spec.read_text().split("## Published numbers")[1]
    published = pd.read_csv(mt.PUBLISHED_CSV)
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 6 or cells[0] in ("target", "---"):
            continue
        target, method, clip, fid, length, speedup = cells
        model = "Lumina-mGPT 7B" if target.startswith("Lumina") else "LlamaGen-XL"
        label = {"vanilla SD (EAGLE-1)": "vanilla SD (EAGLE-1 tree)",
                 "LANTERN++": "LANTERN++ (k, λ not reported)"}
        row = published[(published["model"] == model) & (published["method"] == label.get(method, method))]
        assert len(row) == 1, (target, method)
        values = row.iloc[0]
        assert (values["clip_score"], values["fid"], values["mean_accepted_length"], values["speedup"]) == (
            float(clip), float(fid), float(length), float(speedup.rstrip("×")))


def test_published_image_reward_matches_the_spec():
    spec = ROOT.parent / "shared" / "docs" / "algorithms.md"
    if not spec.is_file():
        pytest.skip(f"{spec} not present in this checkout")
    sentence = spec.read_text().split("ImageReward in the same table:")[1].split("SJD on")[0].replace("−", "-")
    lumina, llamagen = (" ".join(part.split()) for part in sentence.split(";"))
    lantern_pp, cool = "LANTERN++ (k, λ not reported)", "COOL-SD δ=1.1"
    expected = {  # (model, method in the CSV) -> (name in the spec's sentence, that model's part of it)
        ("Lumina-mGPT 7B", "AR"): ("AR", lumina), ("Lumina-mGPT 7B", "vanilla SD (EAGLE-1 tree)"): ("EAGLE-1", lumina),
        ("Lumina-mGPT 7B", lantern_pp): ("LANTERN++", lumina), ("Lumina-mGPT 7B", cool): (cool, lumina),
        ("LlamaGen-XL", "vanilla SD (EAGLE-1 tree)"): ("EAGLE-1", llamagen),
        ("LlamaGen-XL", lantern_pp): ("LANTERN++", llamagen), ("LlamaGen-XL", cool): (cool, llamagen),
        ("LlamaGen-XL", "COOL-SD δ=2"): ("δ=2", llamagen)}
    published = pd.read_csv(mt.PUBLISHED_CSV)
    for (model, method), (name, text) in expected.items():
        value = float(text.split(name + " ")[1].split(",")[0].split()[0].rstrip(".,"))
        row = published[(published["model"] == model) & (published["method"] == method)]
        assert len(row) == 1 and row.iloc[0]["image_reward"] == value, (model, method, value)
    assert published["image_reward"].notna().sum() == len(expected)


def test_captions_name_the_fid_protocol(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES, runs)
    paths = sorted(runs.rglob("run.json"))
    for path in paths:  # every fixture run on the paper's protocol, one of them with ImageReward
        record = json.loads(path.read_text())
        for metrics in record["per_decoder"].values():
            metrics["fid_protocol"] = "clean"
        if path == paths[0]:
            for metrics in record["per_decoder"].values():
                metrics["image_reward"] = -0.1
        path.write_text(json.dumps(record))
    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([runs])))[0])
    title = mt.caption(frame, "t")
    assert title.endswith(f"FID/KID: {mt.PROTOCOLS['clean']}.") and "clean-fid" in title
    assert "image_reward" in [c.key for c in mt.present_columns([frame], mt.COLUMN_KEYS)]
    record = json.loads(paths[1].read_text())
    for metrics in record["per_decoder"].values():
        metrics["fid_protocol"] = "torch_fidelity"
    paths[1].write_text(json.dumps(record))
    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([runs])))[0])
    assert "protocols differ between rows: clean (" in mt.caption(frame, "t")
    assert "not comparable" in mt.caption(frame, "t") and "torch_fidelity (" in mt.caption(frame, "t")
    assert mt.caption(frame.drop(columns=["fid", "kid"]), "t").endswith("same run (rows come from different "
                                                                         "runs: compare speedups, not latencies).")


def test_plots_are_written_non_empty_png_and_pdf(tmp_path):
    kept, _ = mt.deduplicate(mt.measurements(mt.find_records([FIXTURES])))
    paths = plots.make_plots(mt.measured_frame(kept), tmp_path, "fixture")
    stems = {"fixture_fid_vs_speedup", "fixture_clip_vs_speedup", "fixture_accepted_length_vs_strength",
             "fixture_tv_vs_accepted_length"}
    assert {(p.stem, p.suffix) for p in paths} == {(s, e) for s in stems for e in (".png", ".pdf")}
    for path in paths:
        assert path.stat().st_size > 5000, path
        if path.suffix == ".png":
            pixels = np.asarray(Image.open(path).convert("L"))
            assert pixels.std() > 10 and (pixels < 128).mean() > 0.005, path  # lines and text, not blank
        else:
            assert path.read_bytes().startswith(b"%PDF")


def sweep_records(tmp_path: Path) -> Path:
    """A draft-length sweep of vanilla SD (L = 4, 2, 3 in folder order) and a δ sweep of COOL-SD, each run
    with its AR, made from the LlamaGen fixture."""
    base = json.loads((FIXTURES / "llamagen" / "0_sd" / "run.json").read_text())
    runs = tmp_path / "sweep"
    for k, (decoder, options, speedup, fid) in enumerate([
            ("sd", {"draft_len": 4}, 2.3, 20.99), ("sd", {"draft_len": 2}, 1.8, 20.96), ("sd", {"draft_len": 3}, 2.1, 20.97),
            ("coolsd", {"delta": 2.0}, 2.7, 21.2), ("coolsd", {"delta": 1.1}, 2.3, 21.0)]):
        record = json.loads(json.dumps(base))
        config = {"_target_": "x", "name": decoder, "tree": None, "draft_len": 4, **options}
        record["decoder"] = decoder
        record["config"]["decoder"] = config
        record["started"] = f"2026-01-0{k + 1}T00:00:00"
        metrics = dict(record["per_decoder"]["sd"])
        metrics.update(speedup=speedup, speedup_ci=[speedup - 0.05, speedup + 0.05], fid=fid,
                       fid_ci=[fid - 0.2, fid + 0.2])
        record["per_decoder"] = {"ar": record["per_decoder"]["ar"], decoder: metrics}
        folder = runs / f"{k}_{decoder}"
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps(record))
    return runs


def test_a_sweep_is_drawn_as_one_curve_in_the_order_of_its_option(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = mt.measured_frame(mt.deduplicate(mt.measurements(mt.find_records([sweep_records(tmp_path)])))[0])
    curves = {curve: group for _, curve, group in plots.sweep_curves(frame, "speedup", "fid")}
    assert set(curves) == {"AR", "vanilla SD (chain)", "COOL-SD"}  # one curve per method, not one per L
    assert list(curves["vanilla SD (chain)"]["strength"]) == [2, 3, 4]  # joined in the order of L
    assert list(curves["COOL-SD"]["strength"]) == [1.1, 2.0]
    assert set(frame.loc[frame["decoder"] == "sd", "method"]) == {f"vanilla SD (chain, L={n})" for n in (2, 3, 4)}
    fig, ax = plt.subplots()
    drawn = plots.draw_curve(ax, curves["vanilla SD (chain)"], "speedup", "fid", "C0", "vanilla SD (chain)", True)
    assert list(drawn["sweep"].get_xdata()) == [1.8, 2.1, 2.3]  # the sweep line, L = 2, 3, 4
    assert [p[2] for p in drawn["points"]] == ["L=2", "L=3", "L=4"]
    front = list(zip(drawn["front"].get_xdata(), drawn["front"].get_ydata()))
    assert front == plots.pareto_front([(1.8, 20.96), (2.1, 20.97), (2.3, 20.99)], lower_is_better=True)
    plt.close(fig)
    paths = plots.make_plots(frame, tmp_path / "figures", "sweep")
    assert {p.stem for p in paths} >= {"sweep_fid_vs_speedup", "sweep_accepted_length_vs_strength"}


def test_tables_are_written_next_to_their_input_folder(tmp_path):
    runs = sweep_records(tmp_path)
    assert mt.write_tables([runs], name="t").out == runs.resolve()
    assert (runs / "tables" / "t.md").is_file() and not (ROOT / "results" / "tables" / "t.md").exists()
    assert mt.output_folder([runs / "0_sd", runs / "1_sd" / "run.json"], None) == runs.resolve()
    assert mt.output_folder([], None) is None and mt.output_folder([runs], "elsewhere") == Path("elsewhere")
    with pytest.raises(mt.UsageError, match="--out"):
        mt.write_tables([], published=True)  # no input folder: --out is required
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--published", "--no-plots"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "say where to write with --out" in proc.stderr  # the CLI's usage error


def test_pareto_front_and_labels():
    points = [(1.0, 20.9), (2.0, 21.0), (2.5, 21.3), (2.4, 21.1), (2.7, 21.2)]
    front = [(1.0, 20.9), (2.0, 21.0), (2.4, 21.1), (2.7, 21.2)]  # (2.5, 21.3) is dominated by (2.7, 21.2)
    assert plots.pareto_front(points, lower_is_better=True) == front
    assert plots.pareto_front([(1.0, 0.3), (2.0, 0.31)], lower_is_better=False) == [(2.0, 0.31)]
    assert mt.method_label("coolsd", {"delta": 1.1, "tree": "mc_sim_7b_63"}, []) == "COOL-SD δ=1.1"
    assert mt.method_label("sd", {"tree": None, "draft_len": 4}, []) == "vanilla SD (chain, L=4)"
    assert mt.method_label("lantern_pp", {"k": 10, "lam": 5.0, "resample": "optimal"}, ["resample"]) == \
        "LANTERN++ k=10, λ=5 (G* resampling)"
    assert mt.method_label("lantern", {"k": 1000, "delta": 0.1}, [], skip=("delta",)) == "LANTERN k=1000"
    # a draft-length sweep of vanilla SD: L once (it was "vanilla SD (chain, L=2, L=2)"); its curve without L
    assert mt.method_label("sd", {"tree": None, "draft_len": 2}, ["draft_len"]) == "vanilla SD (chain, L=2)"
    assert mt.method_label("sd", {"tree": None, "draft_len": 2}, ["draft_len"], skip=("draft_len",)) == \
        "vanilla SD (chain)"
    assert mt.method_label("coolsd", {"delta": 2.0, "draft_len": 3, "tree": None}, ["draft_len"]) == \
        "COOL-SD δ=2 (L=3)"
    assert mt.tex_escape("COOL-SD δ=2 (G* resampling, naive_extend_57 tree) 2.7×") == \
        r"COOL-SD $\delta$=2 ($G^*$ resampling, naive\_extend\_57 tree) 2.7$\times$"


class FakeFile:
    def __init__(self, name: str, text: str) -> None:
        self.name, self.text = name, text

    def download(self, root: str, replace: bool = False):
        path = Path(root) / self.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text)
        return open(path)


class FakeRun:
    def __init__(self, run_id: str, files: dict[str, str], summary: dict, config: dict) -> None:
        self.path = ["me", "coolsd", run_id]
        self._files = {name: FakeFile(name, text) for name, text in files.items()}
        self.summary, self.config = summary, config
        self.created_at = "2026-01-08T10:00:00"
        self.metadata = {"gpu": "NVIDIA H100 80GB HBM3"}

    def files(self):
        return list(self._files.values())

    def file(self, name: str) -> FakeFile:
        return self._files[name]


class FakeApi:
    def __init__(self, runs: list[FakeRun]) -> None:
        self._runs = runs

    def runs(self, project: str) -> list[FakeRun]:
        assert project == "me/coolsd"
        return self._runs


def test_wandb_runs_are_read_from_run_json_or_rebuilt_from_the_summary():
    record = json.loads((FIXTURES / "lumina" / "1_sjd" / "run.json").read_text())
    table = {"columns": ["decoder", "latency_s", "mean_accepted_length", "speedup", "speedup_ci_hi", "speedup_ci_lo"],
             "data": [["ar", 10.0, 1.0, 1.0, 1.0, 1.0], ["coolsd", 4.0, 2.8, 2.5, 2.6, 2.4]]}
    path = "media/table/per_decoder_1_abc.table.json"
    summary = {"metrics/latency_s": 4.0, "metrics/speedup": 2.5, "decoder": "coolsd", "model": "tiny",
               "per_decoder": {"_type": "table-file", "path": path}}
    config = {"decoder": {"name": "coolsd", "delta": 2.0, "tree": None}, "suite": {"ar": {"name": "ar"}}}
    api = FakeApi([FakeRun("a1", {"run.json": json.dumps(record)}, {}, {}),
                   FakeRun("b2", {path: json.dumps(table)}, summary, config)])
    found = mt.wandb_records("me/coolsd", api=api)
    assert [s for _, s in found] == ["wandb:me/coolsd/a1", "wandb:me/coolsd/b2"]
    assert found[0][0] == current_record(record)  # as read_run reads it: today's class paths and keys
    rebuilt = {m.decoder: m for m in mt.measurements([found[1]])}
    assert rebuilt["coolsd"].model == "tiny"
    assert rebuilt["coolsd"].options == {"delta": 2.0, "tree": None, "path": "eager", "refill": False}
    assert rebuilt["coolsd"].metrics["speedup"] == 2.5 and rebuilt["ar"].metrics["latency_s"] == 10.0
    assert rebuilt["coolsd"].metrics["speedup_ci"] == [2.4, 2.6] and "speedup_ci_lo" not in rebuilt["coolsd"].metrics


# ------------------------------------------------------------------------------------- experiment configs


def compose_with(overrides: list[str], hydra_cfg: bool = False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_cfg)


def sweep(cfg) -> dict[str, list]:
    """The experiment's ``hydra.sweeper.params`` as {key: [values]}."""
    params = cfg.hydra.sweeper.params
    return {key: [yaml.safe_load(v) for v in str(value).split(",")] for key, value in params.items()}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_its_sweep_values_exist(name):
    text = (CONFIGS / "experiment" / f"{name}.yaml").read_text().splitlines()
    assert text[0] == "# @package _global_"  # Hydra reads the package only from the very first lines
    assert re.fullmatch(rf"# python run\.py -m experiment={name}", text[1]), text[1]
    cfg = compose_with([f"experiment={name}"], hydra_cfg=True)
    assert cfg.experiment_name == name and cfg.compare == "none" and list(cfg.tags)
    if not name.startswith("tiny"):  # the paper's protocol, whatever evaluation the model defaults to
        assert cfg.hydra.runtime.choices.eval == "coco5k" and cfg.eval.num_prompts == 5000
    params = sweep(cfg)
    assert params, "an experiment is a sweep: set hydra.sweeper.params"
    for key, values in params.items():
        if key == "row":
            assert set(values) <= set(ROWS), f"unknown rows {set(values) - set(ROWS)}"
        else:
            assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", f"{name}: no key {key}"


@pytest.fixture(scope="module")
def tiny_model():
    return instantiate(compose_with(["model=tiny"]).model)


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if not e.startswith("tiny")])
def test_every_sweep_point_builds_a_decoder_on_the_tiny_model(name, tiny_model, tmp_path, monkeypatch):
    """Each row / option value of a real-model experiment, with the tiny model and drafter swapped in."""
    monkeypatch.setenv("COOLSD_CACHE", str(tmp_path))
    cfg = compose_with([f"experiment={name}"], hydra_cfg=True)
    params = sweep(cfg)
    tiny_drafter = OmegaConf.to_container(compose_with(["model=tiny"]).drafter, resolve=True)
    points = [[]]
    for key, values in params.items():
        points = [p + [(key, v)] for p in points for v in values]
    for point in points:
        rows = [v for k, v in point if k == "row"]
        chosen = compose_with([f"experiment={name}", *(f"row={r}" for r in rows)]) if rows else cfg
        dec = OmegaConf.create(OmegaConf.to_container(chosen.decoder, resolve=True))
        for key, value in point:
            if key != "row":
                OmegaConf.update(dec, key.removeprefix("decoder."), value)
        extra = {}
        if dec.get("drafter") is not None and "EagleDrafter" in str(dec.drafter.get("_target_")) \
                and "VVS" in str(dec.get("_target_")):  # VVS feeds target features: an untrained tiny EAGLE head
            dec.drafter = None
            extra["drafter"] = EagleDrafter(tiny_model, head=EagleHead(tiny_model))
        elif dec.get("drafter") is not None and "JacobiDrafter" not in str(dec.drafter.get("_target_")):
            dec.drafter = tiny_drafter
        decoder = instantiate(dec, model=tiny_model, **extra)
        assert isinstance(decoder, Decoder) and decoder.name == dec.name


def test_rows_compose_and_the_tiny_table_matches_the_llamagen_table():
    for row in ROWS:
        text = (CONFIGS / "row" / f"{row}.yaml").read_text().splitlines()
        assert text[0] == "# @package _global_" and text[1].startswith("# python run.py experiment="), row
    tiny = sweep(compose_with(["experiment=tiny_table"], hydra_cfg=True))
    assert tiny == sweep(compose_with(["experiment=table_llamagen"], hydra_cfg=True))
    cfg = compose_with(["experiment=tiny_table", "row=sd_eagle1"])
    assert cfg.decoder.name == "sd" and cfg.decoder.tree == "naive_extend_57" and cfg.model.gpt.dim == 64


# the tree and LANTERN++ resampling path each paper table's code base uses (docs/reference-behaviour.md, LANTERN;
# Janus-Pro has no published LANTERN++ code: the harness uses Lumina-mGPT's)
TABLE_TREES = {"table_llamagen": ("naive_extend_57", "reference_q"), "tiny_table": ("naive_extend_57", "reference_q"),
               "table_lumina": ("mc_sim_7b_63", "reference"), "table_janus_pro": ("mc_sim_7b_63", "reference"),
               "table_anole": ("naive_extend_57", "reference_q")}


@pytest.mark.parametrize("name", sorted(TABLE_TREES))
def test_every_static_tree_row_of_a_table_shares_its_tree_and_lantern_pp_runs_its_published_path(name):
    tree, resample = TABLE_TREES[name]
    rows = sweep(compose_with([f"experiment={name}"], hydra_cfg=True))["row"]
    trees = {}
    for row in [*rows, "lantern_pp_ablation"]:
        decoder = compose_with([f"experiment={name}", f"row={row}"]).decoder
        if decoder.name != "sjd":
            trees[row] = decoder.tree
        if row == "lantern_pp":
            assert decoder.resample == resample, (name, decoder.resample)
        if row == "lantern_pp_ablation":
            assert decoder.resample != resample and decoder.resample in ("reference", "reference_q")
    assert set(trees.values()) == {tree}, trees


@pytest.mark.slow  # CI runs it in its -m slow pass (.ci/run)
def test_tiny_table_multirun_becomes_a_table_and_plots(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    proc = subprocess.run([sys.executable, "run.py", "-m", "experiment=tiny_table", "eval.warmup=0",
                           f"hydra.sweep.dir={runs}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sorted(runs.glob("*/run.json"))
    assert len(records) == 5
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", str(runs), "--out", str(results)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (results / "tables" / "tiny_table.md").read_text()
    methods = [line.split("|")[2].strip() for line in md.splitlines() if line.startswith("| ")][1:]
    assert methods == ["AR", "SJD", "vanilla SD (naive_extend_57 tree)", "LANTERN++ k=10, λ=5", "COOL-SD δ=1.1",
                       "COOL-SD δ=2"]
    assert "2 images per method" in md and "—" not in md.split("\n\n")[1]  # every row measured
    for path in records:  # each row's cells are its own run's numbers
        record = json.loads(path.read_text())
        metrics = record["metrics"]
        assert f"{metrics['mean_accepted_length']:.2f}" in md and f"{metrics['speedup']:.2f} ±" in md
    assert (results / "tables" / "tiny_table.tex").read_text().count(r"\\") >= 7
    for stem in ("accepted_length_vs_strength", "tv_vs_accepted_length"):
        for ext in ("png", "pdf"):
            assert (results / "figures" / f"tiny_table_{stem}.{ext}").stat().st_size > 5000


def test_a_compare_set_s_overrides_are_the_options_of_its_decoders():
    """``compare=jacobi`` runs suite entries with the set's overrides (SJD at the family's window): the table
    takes those options, so the run's SJD is not mistaken for the suite's (dropped as a duplicate of it)."""
    suite = {"ar": {"name": "ar", "draft_len": 0}, "sjd": {"name": "sjd", "draft_len": 7, "drafter": {"init": "auto"}}}
    sets = {"all": {"sjd": {}}, "jacobi": {"sjd": {"draft_len": 31, "drafter": {"init": "random"}}}}

    def record(compare):
        return {"decoder": "ar", "model": "embedded", "per_decoder": {"ar": {}, "sjd": {}},
                "config": {"decoder": suite["ar"], "suite": suite, "compare": compare, "compare_sets": sets}}

    default, jacobi = (next(m for m in mt.measurements([(record(c), c)]) if m.decoder == "sjd")
                       for c in ("auto", "jacobi"))
    assert default.options["draft_len"] == 7 and default.options["drafter"] == {"init": "auto"}
    assert jacobi.options["draft_len"] == 31 and jacobi.options["drafter"] == {"init": "random"}
