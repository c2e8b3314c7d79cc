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
from omegaconf import OmegaConf

from coolsd.required_files import RequiredFile, files_of, locate, resolve
from tests.helpers import CONFIGS

ROOT = CONFIGS.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# LANTERN's released stage-II LlamaGen T2I drafter config (jadohu/LANTERN data/configs/llamagen_t2i2_config.json,
# the fields the fit reads; tests/test_real_size_layouts.py has it whole)
LANTERN_T2I2 = {"hidden_size": 1280, "num_attention_heads": 20, "num_key_value_heads": 20, "intermediate_size": 3584,
                "num_hidden_layers": 1, "vocab_size": 16384, "rms_norm_eps": 1e-6, "input_type": "t2i2"}


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
    fake_hub_file(hub, "jadohu/llamagen2_drafter", "config.json", json.dumps(LANTERN_T2I2))  # fits T2I-XL 512 px
    fake_hub_file(hub, "jadohu/llamagen2_drafter", "pytorch_model.bin")
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
    from eval.run.experiment import run_experiment

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


# -- issue 45 item 4: decoders checked before the target is built, every job of a sweep, GPU-hour estimates ----------
def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def no_weights_read(monkeypatch):
    """Reading a weight file fails the test: the target's GPT, VQ and T5, and every drafter checkpoint
    (``load_state_dict``); the stand-in the checks build is the target class without any of them."""
    import coolsd.drafters.eagle as eagle
    import coolsd.models.llamagen as llamagen
    import coolsd.models.llamagen_t2i as llamagen_t2i
    import coolsd.models.vq as vq

    def fail(*args, **kwargs):
        raise AssertionError("a weight file was read before the decoders were checked")

    for module, name in ((llamagen, "load_gpt_checkpoint"), (vq, "load_vq_checkpoint"), (llamagen_t2i, "load_t5"),
                         (eagle, "load_state_dict"), (eagle, "load_eagle")):
        monkeypatch.setattr(module, name, fail)


def test_a_bad_decoder_value_is_caught_without_building_the_target(no_weights_read):
    """``decoder=coolsd decoder.schedule=expo``: the decoder's own error (key and allowed values) before any weight
    is read, for the embedded model and for LlamaGen T2I-XL (built on the meta device: nothing allocated); the
    default run's six decoders pass, with nothing left unchecked, and the run's random state is untouched."""
    import torch

    from eval.run.preflight import DecoderConfigError, stand_in, validate_decoders
    from eval.run.suite import select_decoders

    state = torch.get_rng_state()
    for model in ("embedded", "llamagen_t2i_512"):
        cfg = compose_run(f"model={model}", "decoder=coolsd", "decoder.schedule=expo", "eval=quick", "logger=none")
        with pytest.raises(DecoderConfigError) as err:
            validate_decoders(cfg, select_decoders(cfg, decoder_overridden=True))
        assert "decoder[coolsd] (coolsd.cool.CoolSD): decoder.schedule must be one of ['exponential', 'linear', " \
               "'uniform'], got 'expo'" in str(err.value)
        assert "python scripts/prefetch.py --check" in str(err.value)
    big = stand_in(OmegaConf.to_container(cfg.model, resolve=True))
    assert big.meta and {p.device.type for p in big.model.parameters()} == {"meta"}
    assert big.sizes["hidden_size"] == 1280 and big.sizes["num_image_tokens"] == 1024
    cfg = compose_run()
    assert validate_decoders(cfg, select_decoders(cfg, decoder_overridden=False)) == []
    assert torch.equal(torch.get_rng_state(), state)


def test_the_jacobi_decoders_of_emu3_gen_are_checked_on_its_stand_in(no_weights_read):
    """Emu3-Gen has a stand-in recipe (eval.run.preflight.RECIPES): the Jacobi family of its presets is checked
    without its weights (nothing left unchecked), and a bad value is named."""
    from eval.run.preflight import DecoderConfigError, stand_in, validate_decoders
    from eval.run.suite import select_decoders

    cfg = compose_run("model=emu3_gen", "decoder=sjd", "compare=jacobi", "model.device=cpu", "eval=quick",
                      "logger=none")
    assert validate_decoders(cfg, select_decoders(cfg, decoder_overridden=True)) == []
    small = stand_in(OmegaConf.to_container(cfg.model, resolve=True))
    assert small.model.num_image_tokens == 90 * 90 and not small.exact  # the run's grid, tiny widths
    assert small.sizes is None and "BAAI/Emu3-Gen-hf/config.json" in small.why  # real sizes: beside the weights
    cfg = compose_run("model=emu3_gen", "decoder=sjd_sv", "decoder.sv.alpha=2", "model.device=cpu", "eval=quick",
                      "logger=none")
    with pytest.raises(DecoderConfigError, match="decoder.sv.alpha"):
        validate_decoders(cfg, select_decoders(cfg, decoder_overridden=True))


def test_a_drafter_that_does_not_fit_the_target_is_caught_from_its_config(tmp_path, hub, no_weights_read):
    """A drafter folder whose config.json (this project's format) is 128 wide for the 256-wide embedded target,
    and LANTERN's stage-I drafter (a 16x16 RoPE grid) for the 32x32 stage-II T2I model: each is named with the
    differing field, from its config.json alone; a drafter trained with another prefix convention too."""
    from eval.run.preflight import DecoderConfigError, validate_decoders
    from eval.run.suite import select_decoders

    config = json.loads((ROOT / "coolsd/assets/embedded/drafter/config.json").read_text())
    cases = []
    for name, changes in (("narrow", {"hidden_size": 128}), ("all_prefix", {"prefix": "all"})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        (folder / "model.safetensors").write_text("never read")
        cases.append(["decoder=sd", f"drafter.checkpoint={folder}"])
    fake_hub_file(hub, "jadohu/llamagen_drafter", "config.json", json.dumps({**LANTERN_T2I2, "input_type": "t2i"}))
    cases.append(["model=llamagen_t2i_512", "decoder=coolsd", "drafter.checkpoint=hub:jadohu/llamagen_drafter"])
    expected = ["{'hidden_size': (128, 256)}", "trained with prefix='all' but drafter.prefix='last'",
                "'input_type': ('t2i (256 image tokens)', 1024)"]
    for overrides, text in zip(cases, expected):
        cfg = compose_run(*overrides)
        with pytest.raises(DecoderConfigError, match="drafter") as err:
            validate_decoders(cfg, select_decoders(cfg, decoder_overridden=True))
        assert text in str(err.value), str(err.value)


def job_lines(out: str) -> dict[int, str]:
    """{job number: its line} of the ``-m`` listing."""
    return {int(line.split()[0][1:]): line for line in out.splitlines() if line.startswith("#")}


def test_prefetch_lists_every_row_of_the_llamagen_table_with_its_gpu_hours(hub, tmp_path, monkeypatch, capsys):
    """``--check -m experiment=table_llamagen`` offline: the five rows of the sweep, in Hydra's job order, each with
    its decoders and a GPU-hour estimate on the papers' latencies (AR's batched and timed images counted once), and
    the missing weights; exit code 1. The estimate says it is one and where its numbers come from."""
    monkeypatch.setenv("COCO_DIR", str(tmp_path / "coco"))
    code = prefetch_main()(["--check", "-m", "experiment=table_llamagen"])
    out = capsys.readouterr().out
    assert code == 1
    lines = job_lines(out)
    rows = ["sd_eagle1", "lantern_pp", "sjd", "coolsd_d1.1", "coolsd_d2"]
    assert sorted(lines) == list(range(5))
    decoders = ["ar,sd", "ar,lantern_pp", "ar,sjd", "ar,coolsd", "ar,coolsd"]
    hours = []
    for num, (row, names) in enumerate(zip(rows, decoders)):
        fields = lines[num].split()
        assert fields[1:4] == [f"row={row}", "experiment=table_llamagen", names], lines[num]
        hours.append(float(fields[4].rstrip("*")))
        assert "missing: LlamaGen T2I GPT weights" in lines[num]
    # job 0: (2 warm-up + 1,000 timed) x (AR 10.13 + SD 4.99 s) + 4,000 batched x 15.12 s / 7.4, in hours
    assert hours[0] == pytest.approx((1002 * 15.12 + 4000 * 15.12 / 7.4) / 3600, abs=0.05)
    # job 1: AR's batched images reused and AR timed in job 0 (eval.ar_timing=table): LANTERN++ alone
    assert hours[1] == pytest.approx((1002 * 4.70 + 4000 * 4.70 / 7.4) / 3600, abs=0.05)
    assert hours[4] < hours[3]  # delta = 2 accepts more
    assert "5 job(s): 0 OK, 5 with a problem" in out and "GPU-hours are an estimate" in out
    assert "[paper] llamagen_t2i_512 ar: 10.13 s/image - COOL-SD paper main table" in out
    assert "hf download peizesun/llamagen_t2i t2i_XL_stage2_512.pt" in out


def test_a_sweep_with_one_bad_job_flags_exactly_that_job(capsys):
    """Three schedules swept on the embedded model (its files ship with the repo): only the job with the bad one
    fails, and its line names the key and the allowed values."""
    code = prefetch_main()(["--check", "-m", "decoder=coolsd", "decoder.schedule=exponential,expo,linear",
                            "eval=quick", "logger=none"])
    out = capsys.readouterr().out
    lines = job_lines(out)
    assert code == 1 and sorted(lines) == [0, 1, 2]
    assert lines[0].endswith("  OK") and lines[2].endswith("  OK")
    assert "decoder.schedule=expo" in lines[1] and "decoder.schedule must be one of" in lines[1]
    assert "3 job(s): 2 OK, 1 with a problem" in out


def test_the_sweep_expands_exactly_as_hydras_multirun(tmp_path):
    """``eval.sweep.jobs.expand_sweep`` against Hydra's own multirun (basic launcher, a task that records each job's
    overrides): an experiment's sweeper params and command-line commas give the same jobs in the same order."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from eval.sweep.jobs import expand_sweep

    for overrides in (["experiment=tiny_table"], ["decoder=sd", "decoder.draft_len=2,3", "eval.num_prompts=1,2"]):
        seen = []
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            _, jobs = expand_sweep("config", overrides)
            GlobalHydra.instance().hydra.multirun(
                config_name="config", task_function=lambda cfg: seen.append(list(HydraConfig.get().overrides.task)),
                overrides=[*overrides, f"hydra.sweep.dir={tmp_path}"], with_log_configuration=False)
        assert jobs == seen and len(jobs) == (5 if len(overrides) == 1 else 4)


def test_run_py_stops_on_a_bad_decoder_value_before_any_weight_is_read(tmp_path, no_weights_read):
    """The same check inside ``run.py``'s order of work: ``decoder.schedule=expo`` stops the run after the file
    check and before the target's weights are read; nothing is written into the run folder but its markers."""
    from eval.run.experiment import run_experiment
    from eval.run.preflight import DecoderConfigError

    cfg = compose_run("decoder=coolsd", "decoder.schedule=expo", "eval=quick", "logger=none", "eval.num_prompts=2")
    with pytest.raises(DecoderConfigError, match="decoder.schedule must be one of"):
        run_experiment(cfg, output_dir=tmp_path / "run", decoder_overridden=True)
    assert not (tmp_path / "run" / "records").exists()
