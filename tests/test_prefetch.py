"""``scripts/prefetch.py`` and the runner's file check: every file of a run, looked up offline in a fake Hugging
Face cache (the ``models--<org>--<name>/{refs,snapshots}`` layout ``huggingface_hub`` reads), and a missing
drafter stopping ``run.py`` before the target model is built. Each test takes a few seconds (composition and
imports; nothing is downloaded or built)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from coolsd.required_files import RequiredFile, files_of, locate, resolve
from tests.helpers import CONFIGS

ROOT = CONFIGS.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_file(cache: Path, repo: str, filename: str, text: str = "x") -> Path:
    """``filename`` of ``repo`` in a Hugging Face cache at ``cache``, as a download leaves it (refs/main ->
    snapshots/<commit>/<filename>)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    path = folder / "snapshots" / COMMIT / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def prefetch_main():
    spec = importlib.util.spec_from_file_location("prefetch_script", ROOT / "scripts" / "prefetch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def rows_of(out: str) -> dict[str, str]:
    """{the 'what' column + file: status} of the printed table."""
    rows = {}
    for line in out.splitlines():
        status = line.split(" ", 1)[0]
        if status in ("present", "fetched", "missing"):
            rows[line] = status
    return rows


def status_of(out: str, *parts: str) -> str:
    found = [s for line, s in rows_of(out).items() if all(p in line for p in parts)]
    assert len(found) == 1, (parts, out)
    return found[0]


def test_prefetch_offline_reports_present_and_missing_files_of_janus_coco5k(hub, tmp_path, capsys):
    """model=janus_pro_1b eval=coco5k decoder=coolsd: the Janus snapshot, COCO, the Inception and ImageReward are
    here; the drafter and the CLIP weights are not, and their rows name the manual step. Exit code 1."""
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        fake_hub_file(hub, "deepseek-community/Janus-Pro-1B", name)
    for name in ("ImageReward.pt", "med_config.json"):
        fake_hub_file(hub, "THUDM/ImageReward", name)
    fake_hub_file(hub, "bert-base-uncased", "vocab.txt")
    coco = tmp_path / "coco"
    (coco / "annotations").mkdir(parents=True)
    (coco / "annotations" / "captions_val2017.json").write_text(json.dumps({"annotations": []}))
    (coco / "val2017").mkdir()
    inception = tmp_path / "inception"
    inception.mkdir()
    (inception / "inception-2015-12-05.pt").write_text("x")
    drafter = tmp_path / "drafter_janus_pro_1b"
    code = prefetch_main()(["model=janus_pro_1b", "eval=coco5k", "decoder=coolsd",
                            f"data.path={coco / 'annotations' / 'captions_val2017.json'}",
                            f"eval.metrics.0.reference_dir={coco}/val2017",
                            f"eval.metrics.0.weights_path={inception}", f"drafter.checkpoint={drafter}"])
    out = capsys.readouterr().out
    assert code == 1
    assert status_of(out, "Janus-Pro weights", "deepseek-community/Janus-Pro-1B") == "present"
    assert status_of(out, "MS-COCO 2017 val captions") == "present"
    assert status_of(out, "FID reference images") == "present"
    assert status_of(out, "FID Inception") == "present"
    assert status_of(out, "ImageReward weights", "ImageReward.pt") == "present"
    assert status_of(out, "ImageReward tokenizer", "vocab.txt") == "present"
    assert status_of(out, "EAGLE drafter", str(drafter)) == "missing"
    assert "python scripts/train_drafter.py model=janus_pro_1b" in out
    assert status_of(out, "CLIP score weights") == "missing"
    assert "hf download timm/vit_base_patch32_clip_224.openai open_clip_model.safetensors" in out
    assert "HF_HUB_OFFLINE is set" in out and str(hub) in out  # why, and where it looked
    assert "7 present, 0 fetched, 2 missing" in out


def test_prefetch_of_llamagen_t2i_checks_every_shard_of_a_snapshot(hub, capsys):
    """A snapshot whose index lists a shard that is not cached is missing; the command line's drafter choice
    and ``--check`` (look only) work; the default embedded run needs only its shipped files (exit 0)."""
    for name in ("t2i_XL_stage2_512.pt", "vq_ds16_t2i.pt"):
        fake_hub_file(hub, "peizesun/llamagen_t2i", name)
    for name in ("config.json", "spiece.model", "model-00001-of-00002.safetensors"):
        fake_hub_file(hub, "google/flan-t5-xl", name)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    fake_hub_file(hub, "google/flan-t5-xl", "model.safetensors.index.json", json.dumps(index))
    for name in ("config.json", "pytorch_model.bin"):
        fake_hub_file(hub, "jadohu/llamagen2_drafter", name)
    main = prefetch_main()
    assert main(["--check", "model=llamagen_t2i_512", "decoder=coolsd"]) == 1
    out = capsys.readouterr().out
    assert status_of(out, "LlamaGen T2I GPT weights") == "present"
    assert status_of(out, "LlamaGen VQ-16 weights") == "present"
    assert status_of(out, "EAGLE drafter", "jadohu/llamagen2_drafter") == "present"
    assert status_of(out, "T5 text encoder") == "missing"  # shard 2 of 2 is absent
    fake_hub_file(hub, "google/flan-t5-xl", "model-00002-of-00002.safetensors")
    assert main(["--check", "model=llamagen_t2i_512", "decoder=coolsd"]) == 0
    assert main(["--check", "model=llamagen_t2i_512", "decoder=sjd"]) == 0  # no drafter: none asked for
    out = capsys.readouterr().out
    assert "EAGLE drafter" not in out.split("T5 text encoder")[-1]
    assert main([]) == 0
    assert "coolsd/assets/embedded/drafter" in capsys.readouterr().out


def test_a_hub_file_is_fetched_when_online_and_a_local_one_is_prepared(hub, tmp_path, monkeypatch):
    """Online, ``resolve`` downloads a missing hub file (here a stand-in ``hf_hub_download`` that writes into the
    fake cache) and reports it ``fetched``; a local file with ``prepare`` is made; offline nothing is fetched."""
    import huggingface_hub

    calls = []

    def download(repo_id, filename, revision=None, local_dir=None, cache_dir=None):
        calls.append((repo_id, filename, cache_dir))
        return str(fake_hub_file(Path(cache_dir), repo_id, filename))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    wanted = RequiredFile("HPSv2 weights", repo_id="xswu/HPSv2", filename="HPS_v2.1_compressed.pt")
    assert resolve(wanted).status == "missing" and not calls  # HF_HUB_OFFLINE=1
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    first = resolve(wanted)
    assert first.status == "fetched" and calls == [("xswu/HPSv2", "HPS_v2.1_compressed.pt", str(hub))]
    assert resolve(wanted).status == "present" and len(calls) == 1
    made = tmp_path / "made" / "weights.pt"
    local = RequiredFile("converted", local=str(made), prepare=lambda: (made.parent.mkdir(), made.write_text("w")))
    assert locate(local) is None and resolve(local).status == "fetched" and resolve(local).status == "present"
    absent = RequiredFile("by hand", local=str(tmp_path / "nope"), manual="ask for it")
    result = resolve(absent)
    assert result.status == "missing" and result.file.fetch_command() == "ask for it"


def test_every_metric_and_model_declares_its_files_from_its_config():
    """The classes asked by ``files_of``: HPS (eval=coco5k_hps), Lumina-mGPT (hub shards + Meta's tokenizer
    folder), and nothing for random-weight configs."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        hps = compose(config_name="config", overrides=["model=lumina_mgpt_768", "eval=coco5k_hps"])
        tiny = compose(config_name="config", overrides=["model=janus_tiny"])
    names = {(f.owner, f.name) for f in files_of(hps.eval, "eval")}
    assert ("eval.metrics.3", "xswu/HPSv2:HPS_v2.1_compressed.pt") in names
    lumina = files_of(hps.model, "model")
    assert [f.what for f in lumina] == ["Lumina-mGPT language model", "Chameleon tokenizer + VQGAN"]
    assert "Chameleon" in lumina[1].fetch_command() and lumina[0].repo_id == "Alpha-VLLM/Lumina-mGPT-7B-768"
    assert files_of(tiny.model, "model") == []


def test_run_with_a_missing_drafter_stops_before_the_target_is_built(tmp_path, monkeypatch):
    """The embedded run with ``drafter.checkpoint`` pointing nowhere: ``MissingFilesError`` names the folder, where
    it was looked for and the prefetch command, and the target's constructor is never called."""
    from coolsd.models.llamagen import LlamaGen
    from coolsd.required_files import MissingFilesError
    from eval.runner import run_experiment

    built = []
    monkeypatch.setattr(LlamaGen, "__init__", lambda self, *a, **k: built.append(1) or (_ for _ in ()).throw(
        AssertionError("the target was built")))
    missing = tmp_path / "no_drafter"
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decoder=sd", f"drafter.checkpoint={missing}", "logger=none",
                                                        "eval.num_prompts=2", "eval.metrics=[]"])
    with pytest.raises(MissingFilesError) as err:
        run_experiment(cfg, output_dir=tmp_path / "run", decoder_overridden=True)
    message = str(err.value)
    assert not built
    assert str(missing) in message and "EAGLE drafter" in message and "looked in" in message
    assert "python scripts/prefetch.py" in message and "scripts/train_drafter.py" in message
