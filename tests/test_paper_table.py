"""From a cluster install to a paper table (issue 59, items 3-8): AR timed once per table and GPU kind; failures
shown before the timed phase (W&B before the model, an out-of-memory at the configured batch size, a model class
with no stand-in); the GPU model in the evaluation card and a latency column that refuses two GPUs; AR's cached
images reused across GPU kinds and marked; the cluster install; throughput, speedup at batch > 1 and peak memory
as table columns; FID against clean-fid's reference statistics; ``environment.txt``; LICENSE and CITATION.cff.

The out-of-memory is a mocked allocator (a decoder that raises ``torch.OutOfMemoryError`` above a batch size), run
in a child ``run.py``; the runs use the exactly enumerable lookup model.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from coolsd.models.lookup import LookupModel

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none",
          "eval.num_prompts=6", "eval.speed_prompts=2", "eval.batch_size=2", "eval.warmup=0", "eval.threads=1"]


def compose_with(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def env(tmp_path: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**out, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
            "COOLSD_CACHE": str(tmp_path / "cache")}


def child(tmp_path: Path, code: str | None, *args: str) -> subprocess.CompletedProcess:
    """``run.py <args>`` in a child process, after ``code`` (a patch) when given."""
    command = [sys.executable, "run.py", *args] if code is None else \
        [sys.executable, "-c", code + "\nimport runpy, sys\nsys.argv = ['run.py', *sys.argv[1:]]\n"
         "runpy.run_path('run.py', run_name='__main__')\n", *args]
    return subprocess.run(command, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300)


# -- AR timed once per table ---------------------------------------------------------------------------------------
@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_ar_is_timed_once_per_table_and_the_other_rows_divide_its_latency(tmp_path):
    """Two rows of a table (``eval.ar_timing=table``) with one cache: the first claims AR's timing and times it
    interleaved with its decoder; the second times only its decoder, makes AR's timed-subset images untimed (here
    from the cache) and divides the first row's AR latency; make_tables fills a speedup the run could not (its timing
    row had not finished) with the same number, and the card says how AR was timed."""
    table = [*COMMON, "compare=none", "eval.ar_timing=table"]
    rows = {"sd2": ["decoder=sd", "decoder.draft_len=2"], "sd3": ["decoder=sd", "decoder.draft_len=3"]}
    for name, extra in rows.items():
        proc = child(tmp_path, None, *table, *extra, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (json.loads((tmp_path / n / "run.json").read_text()) for n in rows)
    assert first["ar_timing"]["timed_here"] and not second["ar_timing"]["timed_here"]
    assert second["ar_timing"]["timing_row"] == str((tmp_path / "sd2").resolve())
    ar_second = [json.loads(line) for line in (tmp_path / "sd3" / "records" / "ar.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in ar_second) == list(range(6)) and not any(r["timed"] for r in ar_second)
    timed_first = {json.loads(line)["index"] for line in (tmp_path / "sd2" / "records" / "ar.jsonl").read_text()
                   .splitlines() if json.loads(line)["timed"]}
    assert timed_first == {0, 1}
    speedup = second["per_decoder"]["sd"]["speedup"]
    assert speedup > 0 and "latency_s" not in second["per_decoder"]["ar"]
    assert "once per table and GPU kind" in second["evaluation_card"]["AR timing"]

    del second["per_decoder"]["sd"]["speedup"], second["per_decoder"]["sd"]["speedup_ci"]  # as if still pending
    (tmp_path / "sd3" / "run.json").write_text(json.dumps(second))
    from eval.report import paper_tables

    records = paper_tables.find_records([tmp_path / "sd2", tmp_path / "sd3"])
    paper_tables.shared_speedups(records)
    filled = next(r for r, _ in records if not r["ar_timing"]["timed_here"])["per_decoder"]["sd"]
    assert filled["speedup"] == pytest.approx(speedup) and filled["speedup_ar_from"] == str((tmp_path / "sd2").resolve())
    written = paper_tables.write_tables([tmp_path / "sd2", tmp_path / "sd3"], out=tmp_path / "t", name="t")
    assert "AR timed once per table and GPU kind" in written.tables.markdown


def test_prefetch_of_the_llamagen_table_costs_fewer_gpu_hours_and_says_why(capsys):
    from tests.test_prefetch import prefetch_main

    prefetch_main()(["--check", "-m", "experiment=table_llamagen"])
    out = capsys.readouterr().out
    total = float(re.search(r"GPU-hours in all \(estimate\): paper ([0-9.]+)", out)[1])
    assert total < 27.6, out  # 27.6 when every row timed AR (eval.ar_timing=run)
    assert "AR is timed at batch 1 once per table and GPU kind (eval.ar_timing=table)" in out
    assert re.search(r"4 of 5 jobs take AR's latency from the row that times it .* saved paper [0-9.]+", out)


# -- failures before the timed phase -------------------------------------------------------------------------------
OOM = ("import torch\n"
       "import coolsd.decoding as d\n"
       "real = d.Decoder.generate_batch\n"
       "def allocator(self, prompts, seeds, labels=None):\n"  # the device holds 2 images at a time
       "    if len(prompts) > 2:\n"
       "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (mocked)')\n"
       "    return real(self, prompts, seeds, labels=labels)\n"
       "d.Decoder.generate_batch = allocator\n")


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_an_out_of_memory_batch_size_stops_before_the_timed_phase_naming_the_size_that_fits(tmp_path):
    folder = tmp_path / "row"
    proc = child(tmp_path, OOM, *[a for a in COMMON if "batch_size" not in a], "compare=none", "decoder=sd",
                 "eval.num_prompts=12", "eval.batch_size=8", f"hydra.run.dir={folder}")
    assert proc.returncode != 0
    assert "eval.batch_size=8 does not fit on" in proc.stderr and "eval.batch_size=2 fits" in proc.stderr
    assert "found before the timed phase" in proc.stderr
    timed = [json.loads(line) for f in (folder / "records").glob("*.jsonl") for line in f.read_text().splitlines()
             if json.loads(line)["timed"]]
    assert timed == []  # nothing was timed: the batch came first
    ok = child(tmp_path, OOM, *[a for a in COMMON if "batch_size" not in a], "compare=none", "decoder=sd",
               "eval.num_prompts=12", "eval.batch_size=2", f"hydra.run.dir={folder}")
    assert ok.returncode == 0, ok.stderr[-3000:]


WANDB_FIRST = ("import pathlib, sys\n"
               "import eval.run.loggers as loggers\n"
               "import coolsd.models.lookup as lookup\n"
               "mark = pathlib.Path(sys.argv.pop(1))\n"
               "def begin(self, record, out_dir):\n"
               "    mark.write_text('opened')\n"
               "def load(self, *args, **kwargs):\n"
               "    raise RuntimeError('the model is loading now')\n"
               "loggers.NullLogger.begin = begin\n"
               "lookup.LookupModel.__init__ = load\n")


def test_the_logger_opens_before_any_model_loads_and_every_run_writes_environment_txt(tmp_path):
    mark = tmp_path / "opened"
    proc = child(tmp_path, WANDB_FIRST, str(mark), *COMMON, "compare=none", "decoder=sd",
                 f"hydra.run.dir={tmp_path / 'row'}")
    assert proc.returncode != 0 and "the model is loading now" in proc.stderr
    assert mark.read_text() == "opened"  # W&B (here the logger's begin) came first
    text = (tmp_path / "row" / "environment.txt").read_text()  # written at start, a failed run keeps it
    for line in ("python: ", "torch: ", "cuda (torch built with): ", "nvidia driver: ", "git commit: ",
                 "git dirty diff sha1: ", f"torch=={metadata.version('torch')}", "hydra-core=="):
        assert line in text, line


class NoRecipe(LookupModel):
    """A model class the pre-flight check has no stand-in recipe for."""


class OwnRecipe(LookupModel):
    """A model class that says how to build it without weights."""

    @classmethod
    def stand_in_config(cls, node):
        return {}


def test_a_model_class_without_a_stand_in_is_refused_before_it_loads():
    from eval.run.preflight import DecoderConfigError, validate_decoders
    from eval.run.suite import select_decoders

    for target, refused in ((f"{__name__}.NoRecipe", True), (f"{__name__}.OwnRecipe", False)):
        cfg = compose_with(["model=lookup", "drafter=lookup", "decoder=sd", "compare=none",
                            f"model._target_={target}"])
        decoders = select_decoders(cfg, True)
        if refused:
            with pytest.raises(DecoderConfigError, match="cannot be checked before it loads: it has no stand-in"):
                validate_decoders(cfg, decoders)
        else:
            validate_decoders(cfg, decoders)


# -- GPU kinds -----------------------------------------------------------------------------------------------------
def fixture_rows(tmp_path: Path, gpus: dict[str, str]) -> Path:
    """Copies of the golden fixture's LlamaGen runs, each on the GPU ``gpus[run folder]`` gives (else its own)."""
    out = tmp_path / "runs"
    for folder in ("0_sd", "1_lantern_pp", "3_coolsd"):
        record = json.loads((ROOT / "tests" / "golden" / "runs" / "llamagen" / folder / "run.json").read_text())
        if folder in gpus:
            record["environment"]["gpu"] = gpus[folder]
        for name, metrics in record["per_decoder"].items():  # what a run on a GPU records beside the main table
            metrics.update({"throughput_img_s": 2.5 if name == "ar" else 4.0, "throughput_img_s_ci": [2.2, 2.8],
                            "batch_speedup": 1.0 if name == "ar" else 1.6, "batch_speedup_ci": [1.4, 1.8],
                            "peak_mem_mb": 20480.0 if name == "ar" else 23552.0})
        (out / folder).mkdir(parents=True)
        (out / folder / "run.json").write_text(json.dumps(record))
    return out


def test_a_latency_column_of_two_gpu_models_is_refused_unless_told_and_then_said(tmp_path):
    from eval.report import paper_tables

    runs = fixture_rows(tmp_path, {"3_coolsd": "NVIDIA A100-SXM4-80GB"})
    with pytest.raises(paper_tables.ProtocolMismatch, match="GPU: 'NVIDIA A100-SXM4-80GB' in runs/3_coolsd .*'NVIDIA "
                       "H100 80GB HBM3' in runs/0_sd.*--mixed-hardware keeps them"):
        paper_tables.write_tables([runs], out=tmp_path / "t", name="t")
    written = paper_tables.write_tables([runs], out=tmp_path / "t", name="t", mixed_hardware=True)
    assert "Mixed hardware (--mixed-hardware)" in written.tables.markdown
    assert "NVIDIA A100-SXM4-80GB / NVIDIA H100 80GB HBM3" in written.tables.markdown
    same = paper_tables.write_tables([fixture_rows(tmp_path / "same", {})], out=tmp_path / "t2", name="t")
    assert "Mixed hardware" not in same.tables.markdown and "GPU: NVIDIA H100 80GB HBM3" in same.tables.markdown


def test_make_tables_shows_throughput_speedup_at_batch_above_one_and_peak_memory_when_asked(tmp_path):
    runs = fixture_rows(tmp_path, {})
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", str(runs), "--out", str(tmp_path / "t"),
                           "--no-plots", "--name", "t", "--columns", "num_images", "speedup", "batch_speedup",
                           "throughput_img_s", "peak_mem_mb"], cwd=ROOT, env=env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "t" / "tables" / "t.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| model"))
    for title in ("speedup at batch > 1 (×)", "throughput (images/s, batched)", "peak GPU memory (MiB)"):
        assert title in header, header
    assert "1.60 ± 0.20×" in md and "23552" in md
    default = subprocess.run([sys.executable, "scripts/make_tables.py", str(runs), "--out", str(tmp_path / "d"),
                              "--no-plots", "--name", "d"], cwd=ROOT, env=env(tmp_path), capture_output=True,
                             text=True, timeout=300)
    assert default.returncode == 0 and "peak GPU memory" not in (tmp_path / "d" / "tables" / "d.md").read_text()


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_ar_images_are_shared_across_gpu_kinds_and_marked(tmp_path):
    """The cache key leaves the machine's arithmetic out (another GPU kind takes the same AR images) and keeps the
    code in; a run that takes images made elsewhere keeps their signature, so its AR row is marked ‡."""
    from eval.run.ar_cache import ar_key

    fp = {"code_version": 3, "model": {"x": 1}, "decoder": {"name": "ar"}}
    assert ar_key({**fp, "numerics": {"signature": "h100"}}, "c1") == ar_key({**fp, "numerics": {"signature": "a100"}},
                                                                              "c1")
    assert ar_key(fp, "c1") != ar_key(fp, "c2")
    first = [*COMMON, "compare=none", "decoder=sd", "decoder.draft_len=2"]
    proc = child(tmp_path, None, *first, f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cache,) = (tmp_path / "cache" / "ar").iterdir()
    lines = [json.loads(line) for line in (cache / "records.jsonl").read_text().splitlines()]
    for line in lines:  # as if another GPU kind had made them
        line.update(numerics="another-gpu-signature", hardware="NVIDIA A100-SXM4-80GB")
    (cache / "records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = child(tmp_path, None, *COMMON, "compare=none", "decoder=sd", "decoder.draft_len=3",
                 f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ar = json.loads((tmp_path / "b" / "run.json").read_text())["per_decoder"]["ar"]
    assert ar["numerics_signatures"].get("another-gpu-signature") == 4  # its 4 batched images, reused
    assert "| ar ‡ |" in (tmp_path / "b" / "table.md").read_text()


# -- the install, as docs/cluster.md says it -----------------------------------------------------------------------
def _cluster_install_line() -> str:
    text = (ROOT / "docs" / "cluster.md").read_text()
    block = re.search(r"## 1\. Install\n\n```bash\n(.*?)```", text, re.S)[1]
    (line,) = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.startswith("pip install -e")]
    return line


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _installed_with(names: set[str]) -> set[str]:
    """The distributions that installing ``names`` brings (their requirements, transitively, without extras)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [n for r in requires if "extra ==" not in r for n in _requirement_names([r])]
    return seen


def test_the_cluster_install_installs_what_the_cluster_path_imports():
    """docs/cluster.md installs with ``pip install -e ".[launchers]"``: every third-party module that the harness,
    run.py and the scripts import, and the SLURM launcher plugin, comes from a distribution that line installs
    (pyproject's dependencies and the ``launchers`` extra, with their requirements)."""
    line = _cluster_install_line()
    assert line == 'pip install -e ".[launchers]"', line
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = _requirement_names(project["dependencies"]) | _requirement_names(
        project["optional-dependencies"]["launchers"])
    installed = _installed_with(direct)
    assert {"submitit", "hydra-submitit-launcher"} <= installed
    provides = metadata.packages_distributions()
    files = [*ROOT.glob("coolsd/**/*.py"), *ROOT.glob("baselines/*.py"), *ROOT.glob("eval/**/*.py"), ROOT / "run.py",
             *ROOT.glob("scripts/*.py")]
    own = {"coolsd", "baselines", "eval", "run", "scripts", "tests", "hydra_plugins"}
    optional = {"hpsv2", "ImageReward", "peft", "torch_fidelity", "bitsandbytes", "flash_attn", "triton",
                "diffusers"}  # diffusers: the glm_image extra (GLM-Image's pixels; a run without it is refused first)
    missing = {}
    for path in files:
        if "peers" in path.parts:  # the peer bench imports the authors' repositories it clones
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in own or top in optional:
                    continue
                dists = {d.lower().replace("_", "-") for d in provides.get(top, [])}
                if not dists & installed:
                    missing.setdefault(top, str(path.relative_to(ROOT)))
    assert not missing, f"imported but not installed by {line}: {missing}"


def test_a_slurm_task_without_submitit_names_the_extra(monkeypatch):
    from coolsd import launch

    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ImportError, match=re.escape('pip install -e ".[launchers]"')):
        launch.launch_environment()
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert launch.launch_environment().source == "single"  # one process never needs it


# -- FID reference statistics, COCO-30k ----------------------------------------------------------------------------
def test_fid_against_clean_fid_statistics_equals_fid_against_the_features(tmp_path):
    from cleanfid.fid import fid_from_feats

    from eval.metrics import FIDKID
    from eval.metrics.intervals import Bootstrap

    rng = np.random.default_rng(0)
    reference, generated = rng.normal(size=(400, 16)), rng.normal(0.2, 1.1, size=(300, 16))
    np.savez(tmp_path / "stats.npz", mu=reference.mean(0), sigma=np.cov(reference, rowvar=False))
    metric = FIDKID(reference_stats=str(tmp_path / "stats.npz"), reference_count=400)
    metric.preflight = lambda: None  # no Inception needed: the features are given
    out = metric.estimate(generated, "cpu")
    assert out["fid"] == pytest.approx(float(fid_from_feats(reference, generated)), rel=1e-9)
    assert "kid" not in out and out["fid_num_reference"] == 400
    reps = metric.replicates(generated, Bootstrap(resamples=20).weights(300, "images"), "cpu")
    assert set(reps) == {"fid"} and np.all(np.isfinite(reps["fid"]))
    np.savez(tmp_path / "bad.npz", mean=reference.mean(0))
    with pytest.raises(ValueError, match="keys mu and sigma"):
        FIDKID(reference_stats=str(tmp_path / "bad.npz")).estimate(generated, "cpu")


def test_the_coco30k_preset_takes_reference_statistics_and_2014_captions():
    from eval.report.evaluation_card import evaluation_card

    cfg = compose_with(["model=tiny", "eval=coco30k"])
    assert cfg.eval.num_prompts == 30000 and cfg.data.path.endswith("captions_val2014.json")
    fid = cfg.eval.metrics[0]
    assert fid.reference_stats.endswith(".npz") and fid.reference_dir is None
    card = evaluation_card(OmegaConf.to_container(cfg, resolve=True))
    assert "precomputed statistics" in card["reference set"] and card["reference images"] == 40504


# -- licence and citation ------------------------------------------------------------------------------------------
def test_license_and_citation_exist_and_agree_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "MIT"
    assert citation["version"] == project["version"] and citation["title"] and citation["authors"]


def test_each_run_folder_has_its_environment_on_the_report_page(tmp_path):
    folder = tmp_path / "row"
    proc = child(tmp_path, None, *COMMON, "compare=none", "decoder=sd", f"hydra.run.dir={folder}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (folder / "report.html").read_text()
    assert "environment.txt" in page and "git dirty diff sha1" in page
    shutil.rmtree(folder / "images")
