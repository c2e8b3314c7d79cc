"""Drafter distillation at scale (``coolsd.training.data``): batched sampling equals the single-sequence path,
shards split over ranks give the data of one process, finished shards are skipped and foreign ones refused,
distillation prompts that are evaluation prompts are refused, and the paper-scale presets compose."""
from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from coolsd.acceptance import ExactRule
from coolsd.decoding import Decoder
from coolsd.training import data as dd
from tests.helpers import CONFIGS, tiny_llamagen


def single_sequence_shard(model, data: dd.DistillConfig, spec: dd.ShardSpec, prompts: list[str]) -> dict:
    """The data stage as it was before batching: one ``Decoder.generate`` per sample, then teacher forcing."""
    sampler = Decoder("ar", model, ExactRule(), draft_len=0, track_tv=False)
    tokens = torch.stack([sampler.generate(prompts[i], seed=data.seed + i).tokens.cpu()
                          for i in range(spec.start, spec.stop)])
    hidden = model.teacher_force(prompts[spec.start: spec.stop], tokens).to("cpu", torch.float32)
    return {"tokens": tokens, "hidden": hidden}


def shard_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_batched_sampling_equals_the_single_sequence_path(dtype):
    """Tiny LlamaGen in float64, and float32 with the batch-invariant kernels: every sample of a batched shard is
    bitwise the sample of the old one-at-a-time path (same tokens, same stored hidden states)."""
    model = tiny_llamagen(dtype)
    prompts = dd.cycle(model.class_names, 6)
    spec = dd.ShardSpec(0, 0, 6)
    old = single_sequence_shard(model, dd.DistillConfig(storage_dtype="float32"), spec, prompts)
    for batch_size in (1, 4, 6):
        data = dd.DistillConfig(storage_dtype="float32", batch_size=batch_size)
        new = shard_tensors(dd.make_shard(model, data, spec, prompts, None))
        assert torch.equal(new["tokens"], old["tokens"]), batch_size
        assert torch.equal(new["hidden"], old["hidden"]), batch_size


def test_batched_sampling_on_the_embedded_model():
    """The shipped embedded model (float32, batch-invariant kernels): batch 8 = batch 1, sample by sample."""
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        model = instantiate(compose(config_name="config", overrides=["model.device=cpu"]).model)
    prompts = dd.cycle(model.class_names, 8)
    seeds = list(range(8))
    assert torch.equal(dd.sample_tokens(model, prompts, seeds, 8), dd.sample_tokens(model, prompts, seeds, 1))


def test_shards_split_over_ranks_give_the_data_of_one_process(tiny_model, tmp_path):
    data = dd.DistillConfig(num_samples=7, shard_size=2, storage_dtype="float32", batch_size=2)
    prompts = tiny_model.class_names
    one = dd.generate_data(tiny_model, data, tmp_path / "one", prompts, progress=False)
    for rank in (1, 0):  # any order: each rank only makes its own shards
        part = dd.generate_data(tiny_model, data, tmp_path / "two", prompts, progress=False, rank=rank, world=2)
        if rank == 1:
            assert sorted(part["shards"]) == ["shard_00001.safetensors", "shard_00003.safetensors"]
            assert not dd.data_complete(tmp_path / "two", data)
    two = dd.read_manifest(tmp_path / "two")
    assert two["shards"] == one["shards"] and two["fingerprint"] == one["fingerprint"]
    assert dd.data_complete(tmp_path / "two", data)
    dd.wait_for_data(tmp_path / "two", data, timeout_s=1)
    for name in one["shards"]:
        a, b = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rank_worker(directory: str, rank: int, world: int) -> None:
    torch.set_num_threads(1)
    model = tiny_llamagen("float64")
    data = dd.DistillConfig(num_samples=8, shard_size=1, storage_dtype="float32", batch_size=1)
    dd.generate_data(model, data, directory, model.class_names, progress=False, rank=rank, world=world)
    dd.wait_for_data(Path(directory), dataclass_replace(data, wait_poll_s=0.05), timeout_s=120)


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_two_concurrent_ranks_fill_one_manifest(tmp_path):
    """Two processes writing shards into one folder at once: every shard is listed (the manifest lock)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_worker, args=(str(tmp_path), r, 2)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    manifest = dd.read_manifest(tmp_path)
    assert sorted(manifest["shards"]) == [f"shard_{k:05d}.safetensors" for k in range(8)]


def test_rerun_skips_finished_shards_and_refuses_foreign_ones(tiny_model, tmp_path, monkeypatch):
    data = dd.DistillConfig(num_samples=4, shard_size=2, storage_dtype="float32")
    prompts = tiny_model.class_names
    dd.generate_data(tiny_model, data, tmp_path, prompts, progress=False)
    calls = []
    real = dd.make_shard
    monkeypatch.setattr(dd, "make_shard", lambda *a, **k: (calls.append(a[2].index), real(*a, **k))[1])
    dd.generate_data(tiny_model, data, tmp_path, prompts, progress=False)
    assert calls == []
    # a shard made with other settings (another seed) copied into the folder: refused, not mixed in
    other = dd.DistillConfig(num_samples=4, shard_size=2, storage_dtype="float32", seed=5)
    dd.generate_data(tiny_model, other, tmp_path / "other", prompts, progress=False)
    (tmp_path / "shard_00001.safetensors").write_bytes((tmp_path / "other" / "shard_00001.safetensors").read_bytes())
    with pytest.raises(ValueError, match="other settings"):
        dd.generate_data(tiny_model, data, tmp_path, prompts, progress=False)


def test_shard_records_its_settings_digest(tiny_model, tmp_path):
    data = dd.DistillConfig(num_samples=2, shard_size=2, storage_dtype="float32")
    manifest = dd.generate_data(tiny_model, data, tmp_path, tiny_model.class_names, progress=False)
    assert dd.shard_digest(tmp_path / "shard_00000.safetensors") == dd.fingerprint_digest(manifest["fingerprint"])
    # batch size and world size are not settings of the data: the fingerprint leaves them out
    assert "batch_size" not in manifest["fingerprint"]


# -- distillation prompts vs evaluation prompts ----------------------------------------------------------
def test_overlap_with_evaluation_prompts_is_refused_unless_allowed(tmp_path):
    val = tmp_path / "captions_val2017.json"
    val.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "A cat on a  mat."},
                                               {"image_id": 2, "caption": "a dog"}]}))
    refuse = dd.DistillConfig(eval_prompt_files=[str(val), str(tmp_path / "absent.tsv")])
    assert dd.check_eval_overlap(["a red cube", "a bird"], refuse) == {}
    with pytest.raises(ValueError, match="distill.eval_overlap=warn"):
        dd.check_eval_overlap(["a cat on a mat.", "a bird"], refuse)  # case and spacing do not hide it
    warn = dd.DistillConfig(eval_prompt_files=[str(val)], eval_overlap="warn")
    with pytest.warns(UserWarning, match="1 of them"):
        found = dd.check_eval_overlap(["a cat on a mat.", "a bird"], warn)
    assert found == {str(val): ["a cat on a mat."]}
    # data=coco (val2017) is recognised from its config, without the captions file
    with pytest.raises(ValueError, match="overlap the evaluation prompts"):
        dd.check_eval_overlap(["x"], dd.DistillConfig(), "coolsd.prompts.CocoCaptions",
                              "/nowhere/annotations/captions_val2017.json")
    with pytest.raises(ValueError, match="distill.eval_overlap"):
        dd.DistillConfig(eval_overlap="ignore")


def test_train_drafter_refuses_coco_val_prompts(tmp_path):
    """``scripts/train_drafter.py data=coco`` (the evaluation captions) stops before the target is loaded."""
    from coolsd.training.drafter import run

    val = tmp_path / "annotations" / "captions_val2017.json"
    val.parent.mkdir()
    val.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "a cat"}]}))
    overrides = ["model=janus_tiny", "data=coco", f"data.path={val}", f"distill.dir={tmp_path / 'data'}",
                 f"out_dir={tmp_path / 'out'}", "distill.num_samples=2", "model.device=cpu"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train_drafter", overrides=overrides)
    from coolsd.models import janus_pro

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the prompts were checked")

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(janus_pro.JanusPro, "__init__", no_load)
        with pytest.raises(ValueError, match="overlap the evaluation prompts"):
            run(cfg)
    assert not (tmp_path / "data" / "manifest.json").exists()


@pytest.mark.parametrize("preset", ["train_drafter_janus_pro_1b", "train_drafter_janus_pro_7b",
                                    "train_drafter_lumina_mgpt_768", "train_drafter_emu3_gen",
                                    "train_drafter_glm_image"])
def test_paper_scale_presets_compose(preset):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name=preset, return_hydra_config=True)
    assert cfg.hydra.runtime.choices.model == preset[len("train_drafter_"):]
    assert cfg.data.path.endswith("captions_train2017.json")
    data = dd.DistillConfig(**{k: v for k, v in dict(cfg.distill).items()})
    held = data.val_shards * data.shard_size
    assert data.num_samples == 30000 and held == 1500
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    assert cfg.train.steps == 20 * (data.num_samples - held) // per_step  # 20 epochs
    assert dd.check_eval_overlap(["never a caption of val2017"], data) == {}


@pytest.mark.slow  # CI runs it in its -m slow pass (.ci/run)
def test_torchrun_data_stage_on_two_ranks_equals_one_process(tmp_path):
    """``torchrun --nproc_per_node=2 scripts/train_drafter.py stage=data``: each rank makes its shards (gloo on the
    CPU), and the folder holds the very shards one process makes. (7.7 s on the 2-core test machine.)"""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    script = str(root / "scripts" / "train_drafter.py")
    common = ["model=tiny", "model.device=cpu", "stage=data", "train.progress=false", "distill.num_samples=6",
              "distill.shard_size=2", "distill.batch_size=2", "distill.storage_dtype=float32", "distill.wait_poll_s=0.2",
              f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, script, *common, f"distill.dir={tmp_path / 'one'}"], cwd=root, env=env,
                   check=True, timeout=300, capture_output=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", script,
                           *common, f"distill.dir={tmp_path / 'two'}"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = dd.read_manifest(tmp_path / "one"), dd.read_manifest(tmp_path / "two")
    assert one["shards"] == two["shards"] and len(one["shards"]) == 3
    for name in one["shards"]:
        a, b = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert all(torch.equal(a[k], b[k]) for k in a)
