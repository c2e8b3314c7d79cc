"""Reliability (issue 21): file modes follow the umask, stale temporaries are cleaned without touching a live
writer's, prompt counts and config types fail early naming the key, tree files fail naming the file, and a
damaged record line is reported and regenerated.

(The drafter-resume ``before`` test is in ``test_eagle.py``, the LANTERN TV brute force in ``test_relaxed.py``.)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from coolsd import io as cio
from coolsd.io import atomic_write_bytes, remove_stale_temps
from coolsd.trees import TreeShape
from tests.helpers import CONFIGS, tiny_llamagen

ROOT = CONFIGS.parent
LOOKUP = ["model=lookup", "drafter=lookup", "data=fixed", "logger=none"]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# -- 3. file modes ---------------------------------------------------------------------------------------
def write_every_kind(folder: Path, model) -> list[Path]:
    """Call each writer of the project once into ``folder``; return the files they wrote."""
    from coolsd.drafters.eagle import EagleHead, save_eagle
    from coolsd.io import atomic_write_json
    from coolsd.neighbours import latent_neighbours
    from coolsd.training import data as dd
    from coolsd.training import drafter as td
    from eval.records.image_records import JsonlLog, save_png
    from eval.report.run_table import save_grid, speed_quality_plot

    atomic_write_json(folder / "run.json", {"a": 1})
    atomic_write_bytes(folder / "table.md", b"| decoder |\n")
    save_png(folder / "images" / "sd" / "00000.png", torch.zeros(3, 8, 8, dtype=torch.uint8))
    save_grid(folder / "grid_sd.png", folder, [{"image": "images/sd/00000.png"}])
    per_decoder = {"ar": {"speedup": 1.0, "tv_per_step": 0.0}, "sd": {"speedup": 2.0, "tv_per_step": 0.1}}
    assert speed_quality_plot(per_decoder, folder / "speed_quality.png", 1)
    log = JsonlLog(folder / "records" / "sd.jsonl", key="index")
    log.append({"index": 0})
    (folder / "records" / "ar.jsonl").write_bytes(b'{"index": 0}\n{"ind')  # a torn tail, repaired on open
    JsonlLog(folder / "records" / "ar.jsonl", key="index")
    head = EagleHead(model)
    save_eagle(head, folder / "drafter")
    accelerator = td.make_accelerator(td.TrainConfig(), model.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    accelerator.prepare(head, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    step = td.save_checkpoint(accelerator, folder / "ckpt", 1, head, cursor=0, keep=2, training={})
    data = dd.DistillConfig(num_samples=1, shard_size=1, storage_dtype="float32")
    dd.generate_data(model, data, folder / "data", model.class_names, progress=False)
    latent_neighbours(model.codebook(), 3, "l2_raw", str(folder / "neighbours"))
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    atomic_write_bytes(folder / "cache" / "inception.pt", buf.getvalue())
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {"run.json", "table.md", "00000.png", "grid_sd.png", "speed_quality.png", "speed_quality.pdf",
            "sd.jsonl", "ar.jsonl", "config.json", "model.safetensors", "trainer.json", "optimizer.bin",
            "scheduler.bin", "random_states_0.pkl", "manifest.json",
            "shard_00000.safetensors", "inception.pt"} <= {p.name for p in files}
    assert step.is_dir() and any(p.name.startswith("neighbours_") for p in files)
    return files


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_every_writer_follows_the_umask(tmp_path, mask, expected):
    model = tiny_llamagen()
    with umask(mask):
        files = write_every_kind(tmp_path, model)
    wrong = {str(p.relative_to(tmp_path)): oct(mode(p)) for p in files if mode(p) != expected}
    assert not wrong, f"expected {oct(expected)} under umask {oct(mask)}: {wrong}"
    folders = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert all(mode(p) == 0o777 & ~mask for p in folders), {str(p): oct(mode(p)) for p in folders}


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_a_whole_run_writes_files_others_can_read(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "run.py", *LOOKUP, "eval.num_prompts=2", "eval.warmup=0",
                           f"hydra.run.dir={out}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: os.umask(0o022))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"run.json", "table.md", "grid_sd.png", "sd.jsonl", "00000.png"} <= {p.name for p in files}
    wrong = {str(p.relative_to(out)): oct(mode(p)) for p in files if mode(p) != 0o644}
    assert not wrong


# -- 11. stale temporaries ---------------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from coolsd import io
fd, tmp = io._create_temp(Path(sys.argv[1]))
print(tmp, flush=True)
time.sleep(120)
"""


def test_stale_temps_are_removed_but_a_live_writers_is_kept(tmp_path):
    crashed = tmp_path / ".run.json.k3x9q2ab.tmp"  # a writer killed mid-write: its lock died with it
    crashed.write_bytes(b'{"half')
    old_style = tmp_path / ".00001.png.x1y2.tmp"  # the earlier mkstemp naming
    old_style.write_bytes(b"torn")
    others = [tmp_path / "notes.tmp", tmp_path / ".hidden", tmp_path / "run.json.tmp"]
    for p in others:
        p.write_text("user file")
    (tmp_path / ".step_0000006.tmp").mkdir()  # a checkpoint folder being assembled: not a temp file
    live = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "table.md")], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        held = Path(live.stdout.readline().strip())
        assert held.is_file() and re.fullmatch(r"\.table\.md\.[0-9a-f]{8}\.tmp", held.name)
        atomic_write_bytes(tmp_path / "run.json", b"{}\n")  # the first write into a folder sweeps it
        assert not crashed.exists() and not old_style.exists()
        assert held.exists(), "a temporary another live process is writing was deleted"
        assert all(p.exists() for p in others) and (tmp_path / ".step_0000006.tmp").is_dir()
        assert remove_stale_temps(tmp_path) == []
    finally:
        live.kill()  # the process this test started, by its handle
        live.wait()
    assert remove_stale_temps(tmp_path) == [held]  # its writer died: now it is stale
    assert json.loads((tmp_path / "run.json").read_text()) == {}


def test_without_locks_only_old_temps_count_as_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(cio, "_try_lock", lambda fd: None)  # a filesystem without flock
    fresh, old = tmp_path / ".a.png.0123abcd.tmp", tmp_path / ".b.png.4567cdef.tmp"
    fresh.write_bytes(b"x")
    old.write_bytes(b"x")
    hours_ago = time.time() - 2 * cio.STALE_AFTER_S
    os.utime(old, (hours_ago, hours_ago))
    assert remove_stale_temps(tmp_path) == [old] and fresh.exists()


def test_opening_a_records_folder_sweeps_it(tmp_path):
    from eval.records.image_records import JsonlLog

    stale = tmp_path / "records" / ".sd.jsonl.ab12cd34.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"{")
    JsonlLog(tmp_path / "records" / "sd.jsonl", key="index")
    assert not stale.exists()


# -- 8. damaged record lines -------------------------------------------------------------------------------
def test_a_corrupt_record_line_is_reported_and_counts_as_unfinished(tmp_path):
    from eval.records.image_records import JsonlLog

    path = tmp_path / "sd.jsonl"
    path.write_bytes(b'{"index": 0, "x": 1}\n'
                     b'{"index": 1, "tokens": [1, 2\x00\x00\x00\n'  # a damaged block, newline-terminated
                     b'{"prompt": "no index"}\n'
                     b'\xff\xfe not utf-8\n'
                     b'{"index": 4, "x": 4}\n')
    with pytest.warns(UserWarning) as caught:
        log = JsonlLog(path, key="index")
    assert sorted(log.done) == [0, 4]
    messages = [str(w.message) for w in caught]
    for line in (2, 3, 4):
        assert any(f"{path}:{line}:" in m and "generated again" in m for m in messages), messages
    log.append({"index": 1, "x": 11})
    with pytest.warns(UserWarning):
        assert sorted(JsonlLog(path, key="index").done) == [0, 1, 4]


@pytest.mark.slow  # an end-to-end run (CI's -m slow pass)
def test_a_run_regenerates_the_image_of_a_corrupt_record_line(tmp_path):
    args = [sys.executable, "run.py", *LOOKUP, "compare=none", "decoder=sd", "eval.num_prompts=3",
            "eval.warmup=0", f"hydra.run.dir={tmp_path}"]
    subprocess.run(args, cwd=ROOT, env=env(), check=True, capture_output=True, timeout=300)
    log = tmp_path / "records" / "sd.jsonl"
    lines = log.read_text().splitlines()
    original = json.loads(lines[1])
    log.write_text("\n".join([lines[0], lines[1][:40] + "#garbage", lines[2]]) + "\n")
    proc = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{log}:2:" in proc.stderr
    from eval.records.image_records import load_records

    with pytest.warns(UserWarning, match=re.escape(f"{log}:2:")):
        records = load_records(tmp_path / "records", "sd")
    assert sorted(records) == [0, 1, 2] and records[1]["tokens"] == original["tokens"]
    assert json.loads((tmp_path / "run.json").read_text())["per_decoder"]["sd"]["num_images"] == 3


# -- 5. prompt counts --------------------------------------------------------------------------------------
def test_a_short_prompt_set_is_an_error_naming_the_key_and_the_file(tmp_path):
    from coolsd.prompts import CocoCaptions, FilePrompts, PartiPrompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n\na bird\n")
    assert FilePrompts(str(prompts)).load(None, 3) == ["a cat", "a dog", "a bird"]
    assert FilePrompts(str(prompts)).load(None, None) == ["a cat", "a dog", "a bird"]
    with pytest.raises(ValueError, match=r"eval\.num_prompts=5.*" + re.escape(str(prompts)) + r".* only 3 prompts"):
        FilePrompts(str(prompts)).load(None, 5)
    parti = tmp_path / "PartiPrompts.tsv"
    parti.write_text("Prompt\tCategory\tChallenge\tNote\nA red cube\tArtifacts\tBasic\t\nA lion\tAnimals\tBasic\t\n")
    with pytest.raises(ValueError, match=r"eval\.num_prompts=5.*" + re.escape(str(parti)) + r".*only 2 prompts"):
        PartiPrompts(str(parti)).load(None, 5)
    with pytest.raises(ValueError, match=r"images=2.*category 'Animals'.*only 1 prompt;"):
        PartiPrompts(str(parti), category="Animals").load(None, 2, key="images")
    coco = tmp_path / "captions_val2017.json"
    coco.write_text(json.dumps({"annotations": [{"image_id": 1, "id": 1, "caption": "a cat"}]}))
    with pytest.raises(ValueError, match=r"eval\.num_prompts=2.*" + re.escape(str(coco)) + r".*only 1 prompt;"):
        CocoCaptions(str(coco)).load(None, 2)
    coco.write_text(json.dumps({"annotations": []}))
    with pytest.raises(ValueError, match=re.escape(str(coco)) + ".*no captions"):
        CocoCaptions(str(coco)).load(None, 1)
    coco.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(coco)) + ".*not a COCO captions file"):
        CocoCaptions(str(coco)).load(None, 1)


def test_a_run_with_too_few_prompts_fails_before_generating(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\nc\n")
    proc = subprocess.run([sys.executable, "run.py", "model=lookup", "drafter=lookup", "logger=none", "data=file",
                           f"data.path={prompts}", "eval.num_prompts=5", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "eval.num_prompts=5" in proc.stderr and str(prompts) in proc.stderr
    assert not (tmp_path / "run" / "run.json").exists() and not (tmp_path / "run" / "records").exists()


# -- 6. config types and ranges ----------------------------------------------------------------------------
def compose_with(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@contextlib.contextmanager
def fails_naming(key: str):
    """A TypeError or ValueError (Hydra wraps it when instantiating) whose message starts with ``key``."""
    with pytest.raises(Exception, match=re.escape(key) + " must ") as caught:
        yield
    assert isinstance(caught.value.__cause__ or caught.value, (TypeError, ValueError))


DECODER_CASES = [
    ("coolsd", "decoder.delta=abc", "decoder.delta"),
    ("coolsd", "decoder.delta=0", "decoder.delta"),
    ("coolsd", "decoder.nu=fast", "decoder.nu"),
    ("coolsd", "decoder.mu=[1]", "decoder.mu"),
    ("coolsd", "decoder.schedule=cosine", "decoder.schedule"),
    ("coolsd", "decoder.dynamic_tree.depth=2.5", "decoder.dynamic_tree.depth"),
    ("lantern", "decoder.delta=abc", "decoder.delta"),
    ("lantern", "decoder.delta=1.5", "decoder.delta"),
    ("lantern", "decoder.k=2.5", "decoder.k"),
    ("lantern", "decoder.k=abc", "decoder.k"),
    ("lantern", "decoder.dynamic_tree.top_k=abc", "decoder.dynamic_tree.top_k"),
    ("lantern", "+decoder.dynamic_tree.width=3", "decoder.dynamic_tree"),
    ("lantern_pp", "decoder.lam=abc", "decoder.lam"),
    ("lantern_pp", "decoder.lam=0.5", "decoder.lam"),
    ("lantern_pp", "decoder.resample=best", "decoder.resample"),
    ("sd", "decoder.track_tv=maybe", "decoder.track_tv"),
    ("sd", "drafter.extra_slots=1.5", "drafter.extra_slots"),
    *[(name, "decoder.draft_len=2.5", "decoder.draft_len") for name in ("ar", "sd", "sjd", "coolsd", "lantern",
                                                                        "lantern_pp")],
    *[(name, "decoder.draft_len=abc", "decoder.draft_len") for name in ("sd", "coolsd", "lantern")],
]


@pytest.mark.parametrize("decoder,override,key", DECODER_CASES, ids=[f"{d}:{o}" for d, o, _ in DECODER_CASES])
def test_bad_decoder_values_fail_at_construction_naming_the_key(decoder, override, key):
    model = instantiate(compose_with(["model=tiny"]).model)
    extra = ["drafter=eagle", "drafter.checkpoint=not_read"] if "extra_slots" in override else []
    cfg = compose_with(["model=tiny", f"decoder={decoder}", *extra, override])
    with fails_naming(key):
        instantiate(cfg.decoder, model=model)


@pytest.mark.parametrize("override,key", [
    ("eval.num_prompts=abc", "eval.num_prompts"), ("eval.num_prompts=2.5", "eval.num_prompts"),
    ("eval.warmup=-1", "eval.warmup"), ("eval.seed=x", "eval.seed"), ("eval.threads=0", "eval.threads"),
    ("eval.speed_prompts=1.5", "eval.speed_prompts"), ("eval.save_images=3", "eval.save_images"),
])
def test_bad_eval_values_name_the_key(override, key):
    cfg = compose_with(["eval=quick", override])
    with fails_naming(key):
        instantiate(cfg.eval)


@pytest.mark.parametrize("override,key", [
    ("model.sampling.temperature=hot", "sampling.temperature"), ("model.sampling.top_k=2.5", "sampling.top_k"),
    ("model.sampling.top_p=abc", "sampling.top_p"), ("model.sampling.cfg_scale=nan", "sampling.cfg_scale"),
])
def test_bad_sampling_values_name_the_key(override, key):
    cfg = compose_with(["model=tiny", override])
    with fails_naming(key):
        instantiate(cfg.model)


def test_checker_messages_say_what_is_allowed():
    from coolsd import validate

    with pytest.raises(TypeError, match=r"decoder\.draft_len must be an integer >= 0, got 2\.5 \(float\)"):
        validate.integer("decoder.draft_len", 2.5, minimum=0)
    with pytest.raises(ValueError, match=r"decoder\.delta must be a number in \[0, 1\], got 2"):
        validate.number("decoder.delta", 2, minimum=0, maximum=1)
    with pytest.raises(TypeError, match="must be an integer"):
        validate.integer("k", True)
    assert validate.number("x", 3) == 3.0 and validate.integer("y", None, optional=True) is None


# -- 7. tree files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,problem", [
    ("{not json", "not valid JSON"),
    ('{"name": "t"}', "no `paths`"),
    ("[[0], [1]]", "no `paths`"),
    ('{"paths": []}', "non-empty list"),
    ('{"paths": [[0], [-1]]}', "integers >= 0"),
    ('{"paths": [[0], [1.5]]}', "integers >= 0"),
    ('{"paths": [[0], []]}', "non-empty list of child ranks"),
    ('{"paths": [[0], [1], [0]]}', "more than once"),
    ('{"paths": [[0], [0, 0], [0, 0]]}', "more than once"),
    ('{"paths": [[0], [2]]}', "skips a sibling"),
])
def test_bad_tree_files_fail_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "my_tree.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(problem)):
        TreeShape.load(str(path))


def test_a_good_tree_file_still_loads(tmp_path):
    path = tmp_path / "small.json"
    path.write_text('{"name": "small", "paths": [[1], [0], [0, 0]]}')
    assert TreeShape.load(str(path)).paths == ((0,), (1,), (0, 0))


def test_a_prompt_that_is_no_class_fails_before_the_model_is_built(tmp_path):
    """The model's checkpoint points nowhere: had the model been built first, the error would be about weights."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sneaker\na cat on a sofa\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "run.py", "data=file", f"data.path={prompts}", "eval.num_prompts=2",
                           "eval.metrics=[]", "logger=none", f"model.gpt_checkpoint={tmp_path / 'absent.safetensors'}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "['a cat on a sofa'] are not classes" in proc.stderr
    assert "MissingWeightsError" not in proc.stderr and "not found" not in proc.stderr.lower()
    assert not (tmp_path / "run" / "images").exists()


def test_records_do_not_depend_on_where_the_neighbour_cache_lives(tmp_path):
    """The LANTERN neighbour table's cache location is not part of a record's fingerprint: records made when an
    older version fingerprinted it (or under another $COOLSD_CACHE) are reused, new ones join them, and a real
    difference is still refused."""
    from coolsd.fingerprint import TOKEN_CODE_VERSION, json_digest
    from eval.run.resume import RunRecords
    from eval.run.shards import Shards

    fp = {"code_version": TOKEN_CODE_VERSION, "model": {"x": 1}, "decoder": {"name": "lantern", "k": 64}}
    old = {**fp, "decoder": {**fp["decoder"], "neighbour_cache": "/root/.cache/coolsd/neighbours"}}
    prompts = ["a", "b", "c"]
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "lantern.fingerprint.json").write_text(json.dumps(old))
    lines = [{"index": i, "prompt": prompts[i], "seed": i, "fingerprint": json_digest([json_digest(old), prompts[i], i])}
             for i in range(2)]
    (tmp_path / "records" / "lantern.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = RunRecords(tmp_path, {"lantern": fp}, "auto", Shards())
    assert sorted(records.check(prompts, 0)["lantern"]) == [0, 1]
    assert json.loads((tmp_path / "records" / "lantern.fingerprint.json").read_text()) == old  # kept
    new = {"index": 2, "prompt": "c", "seed": 2, "fingerprint": records.image_digest("lantern", "c", 2)}
    with open(tmp_path / "records" / "lantern.jsonl", "a") as fh:
        fh.write(json.dumps(new) + "\n")
    again = RunRecords(tmp_path, {"lantern": fp}, "auto", Shards())
    assert sorted(again.check(prompts, 0)["lantern"]) == [0, 1, 2]
    from omegaconf import OmegaConf

    from eval.records.fingerprints import decoder_fingerprint

    cfg = OmegaConf.create({"model": {"x": 1}})
    for where in ("/root/.cache/coolsd/neighbours", "/elsewhere"):  # what the run computes, wherever the cache is
        dec = OmegaConf.create({**fp["decoder"], "neighbour_cache": where, "track_tv": True})
        assert decoder_fingerprint(cfg, "lantern", dec) == fp
    other = RunRecords(tmp_path, {"lantern": {**fp, "decoder": {**fp["decoder"], "k": 32}}}, "auto", Shards())
    with pytest.raises(RuntimeError, match="decoder.k"):
        other.check(prompts, 0)


def test_records_survive_a_moved_checkout_and_a_changed_weights_digest_is_refused(tmp_path):
    """Where the weights are read from (model.gpt_checkpoint, vq_checkpoint, weights_dir; the drafter's
    checkpoint once its weights digest is in the fingerprint) is not fingerprinted: records made in a checkout
    at another path (stored by an older version with the paths) are reused; other weights are refused; a
    drafter without a weights digest (a layer-skip copy) still has its checkpoint fingerprinted."""
    from coolsd.fingerprint import json_digest
    from eval.run.resume import RunRecords
    from eval.run.shards import Shards

    def fingerprint(root, target="t1", drafter="d1"):
        return {"code_version": 2, "weights_sha1": target, "drafter_weights_sha1": drafter,
                "model": {"dim": 256, "gpt_checkpoint": f"{root}/target.safetensors",
                          "vq_checkpoint": f"{root}/vq.safetensors"},
                "decoder": {"name": "sd", "drafter": {"checkpoint": f"{root}/drafter", "prefix": "last"}}}

    old = fingerprint("/old/checkout/coolsd/assets/embedded")
    prompts = ["a", "b"]
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "sd.fingerprint.json").write_text(json.dumps(old))
    lines = [{"index": i, "prompt": prompts[i], "seed": i, "fingerprint": json_digest([json_digest(old), prompts[i], i])}
             for i in range(2)]
    (tmp_path / "records" / "sd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    moved = fingerprint("/new/place/coolsd/assets/embedded")
    assert sorted(RunRecords(tmp_path, {"sd": moved}, "auto", Shards()).check(prompts, 0)["sd"]) == [0, 1]
    for other, key in ((fingerprint("/new", target="t2"), "weights_sha1"),
                       (fingerprint("/new", drafter="d2"), "drafter_weights_sha1"),
                       ({**moved, "model": {**moved["model"], "dim": 128}}, "model.dim")):
        with pytest.raises(RuntimeError, match=key):
            RunRecords(tmp_path, {"sd": other}, "auto", Shards()).check(prompts, 0)
    undigested = {k: v for k, v in moved.items() if k != "drafter_weights_sha1"}
    stored = RunRecords(tmp_path / "fresh", {"sd": undigested}, "auto", Shards()).fingerprints["sd"]
    assert stored["decoder"]["drafter"]["checkpoint"] == "/new/place/coolsd/assets/embedded/drafter"
    assert "gpt_checkpoint" not in stored["model"]
