"""The batch-size study's crossover (``eval.bench.batch_sweep.crossover``) on synthetic speedup curves: one
crossing, none, and a noisy one whose single dip below 1 is not a crossover."""
from __future__ import annotations

from eval.bench.crossover import crossover, lockstep_waste


def test_one_crossing():
    curve = {1: (1.8, 1.6, 2.0), 2: (1.6, 1.4, 1.8), 8: (1.1, 0.97, 1.2), 32: (0.8, 0.7, 0.9), 64: (0.7, 0.6, 0.8)}
    assert crossover(curve) == 32


def test_none_up_to_the_largest_batch():
    curve = {1: (2.0, 1.9, 2.1), 16: (1.2, 1.1, 1.3), 64: (0.95, 0.85, 1.05)}  # 64's interval reaches 1
    assert crossover(curve) is None
    assert crossover({}) is None


def test_a_noisy_dip_is_not_a_crossing():
    curve = {1: (1.5, 1.3, 1.7), 2: (0.9, 0.8, 0.99), 4: (1.0, 0.9, 1.1), 8: (0.85, 0.8, 0.9), 16: (0.7, 0.6, 0.8)}
    assert crossover(curve) == 8
    assert crossover({1: (0.8, 0.7, 0.9), 2: (0.7, 0.6, 0.8)}) == 1  # never pays


def test_lockstep_waste_is_the_share_of_row_iterations_on_finished_images():
    assert lockstep_waste([10, 10, 10]) == 0.0
    assert lockstep_waste([5, 10]) == 0.25  # the first image idles 5 of the batch's 2 × 10 row-iterations
    assert lockstep_waste([]) == 0.0


def test_allocated_peak_sees_the_most_memory_held_at_once():
    """Two 4 MiB tensors alive together, then one of 8 MiB after both are freed: the peak is 8 MiB, not 16."""
    import torch

    from eval.bench.batch_sweep import allocated_peak_mb

    def work():
        a, b = torch.ones(1 << 20), torch.ones(1 << 20)  # 4 MiB each, float32
        s = float(a.sum() + b.sum())
        del a, b
        c = torch.ones(1 << 21)  # 8 MiB
        return s + float(c.sum())

    work()
    assert 8.0 <= allocated_peak_mb(work) < 8.5


def test_a_small_sweep_end_to_end(tmp_path):
    """Both paths (static uncompiled here, for speed), every cell's numbers, AR's speedup 1 on each path, the
    crossover table, the JSON record and both figures."""
    import json

    import pytest

    from eval.bench.batch_sweep import run_sweep
    from tests.test_bench import compose_bench

    cfg = compose_bench(["bench=embedded_random", "decoders=[ar,sd]", "variants={}", "sweep.batch_sizes=[1,2]",
                         "sweep.repeats=2", "sweep.compile=false", "throughput.batch_sizes=[]", "call_counts=false",
                         f"out_dir={tmp_path}", "name=s"])
    record = run_sweep(cfg, "embedded")
    cells = record["cells"]
    assert set(cells) == {"ar", "sd", "ar@static", "sd@static"} and record["complete"]
    assert record["wall_min"] >= 0 and "min in all" in (tmp_path / f"{record['setup']['name']}.md").read_text()
    for key, by_b in cells.items():
        assert set(by_b) == {"1", "2"}
        for b, cell in by_b.items():
            assert len(cell["walls_s"]) == 2 and cell["images_per_s"] > 0
            assert cell["peak_memory_mb"] > 0 and 0 < cell["verify_share"] <= 1
            assert (cell["kept_memory_mb"] > 0) == key.endswith("@static")  # the static path's workspace
            if key.startswith("ar"):
                assert cell["speedup"] == pytest.approx(1.0) and cell["accepted_length"] == 1.0
            assert cell["fastest_ar"] in {"ar", "ar@static"}
    assert cells["sd"]["2"]["accepted_length"] == cells["sd@static"]["2"]["accepted_length"]  # the same tokens
    page = (tmp_path / "s.md").read_text()
    assert "## Where speculation stops paying" in page and "| sd |" in page
    assert json.loads((tmp_path / "s.json").read_text())["crossover"].keys() == {"sd", "sd@static"}
    assert (tmp_path / "s_speedup.png").stat().st_size > 10_000 and (tmp_path / "s_throughput.png").is_file()
    html = (tmp_path / "s.html").read_text()  # the page: tables as tables, both figures shown
    assert '<img src="s_speedup.png"' in html and '<img src="s_throughput.png"' in html
    assert html.count("<table") == 3 and "<h2>Where speculation stops paying</h2>" in html


def test_the_bench_page_reads_headings_tables_figures_and_paragraphs(tmp_path):
    from eval.report.bench_page import blocks, write_bench_page

    text = "# T\n\nintro `x`\nmore\n\n## A\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![cap](f.png)\n"
    title, body = blocks(text)
    assert title == "T" and [b["kind"] for b in body] == ["text", "heading", "table", "figure"]
    assert body[0]["text"] == "intro `x` more" and body[2]["rows"] == [["1", "2"]]
    (tmp_path / "p.md").write_text(text)
    html = write_bench_page(tmp_path / "p.md").read_text()
    assert "missing figure: f.png" in html and "<td>2</td>" in html  # f.png is not there
