"""Drafter training on a cluster (issue 45, item 1): ranks placed only by SLURM's variables (read through submitit,
handed to accelerate) and by torchrun make the data shards and train the drafter of one process; the data wait
stops with the ranks whose shards are missing; the disk the data need is printed and an impossible need stops
before anything is written; the training launcher preset requeues and resumes.

Two processes against one (same sequences per step): the shards are bitwise equal; the drafters agree to float
rounding only (measured: at most 5.2e-8 apart after 4 steps), because one process sums the gradients of 4 sequences
in one backward and two sum 2 each and average them in DDP's gloo all-reduce: the same maths in another order. A
process that trained alone on half the batch (what every SLURM task did before its rank reached accelerate) ends
3.3e-4 away. SLURM tasks and torchrun workers train bitwise the same drafter (one code path once torchrun's variables
are written). The feature noise is off: each rank draws its own (``set_seed(seed + rank)``), which moves the drafter
4.9e-4 away from one process's.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from coolsd.launch import TORCH_VARS, export_for_torch, launch_environment
from coolsd.training import data as dd
from coolsd.training.drafter import DistConfig
from tests.helpers import sbatch_of
from tests.test_cluster import PLACEMENT, SLURM_TASK, clean_env, free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
SCRIPT = str(ROOT / "scripts" / "train_drafter.py")


@pytest.fixture
def placement(monkeypatch):
    """No torchrun, SLURM or submitit variables (restored afterwards, with those the code under test writes)."""
    for key in [*PLACEMENT, *(k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_")))]:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    return monkeypatch


# -- where the ranks come from ---------------------------------------------------------------------------------
def test_a_slurm_task_gets_torchruns_variables_for_accelerate(placement):
    """``srun python scripts/train_drafter.py``: task 5 of 8 on 2 nodes is told its place in torchrun's variables
    (what accelerate reads); afterwards launch_environment reads the same place through them. One process and
    torchrun are left alone."""
    assert export_for_torch(launch_environment()) == {}
    for key, value in SLURM_TASK.items():
        placement.setenv(key, value)
    placement.setenv("MASTER_PORT", "29411")
    env = launch_environment()
    written = export_for_torch(env)
    assert written == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "gpu07", "MASTER_PORT": "29411"}
    assert {k: os.environ[k] for k in TORCH_VARS} == written
    again = launch_environment()
    assert (again.source, again.rank, again.world, again.local_rank) == ("torchrun", 5, 8, 1)
    assert export_for_torch(again) == {}  # torchrun's variables: nothing to write


def test_dist_timeout_must_be_positive():
    assert DistConfig().timeout_min == 60.0
    with pytest.raises(ValueError, match="dist.timeout_min must be > 0"):
        DistConfig(timeout_min=0)


# -- the data wait ---------------------------------------------------------------------------------------------
def fake_data(folder: Path, data: dd.DistillConfig, present: list[int]) -> None:
    """A data folder whose manifest lists (and whose disk holds) the shards ``present``."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = {}
    for spec in dd.shard_specs(data.num_samples, data.shard_size):
        if spec.index in present:
            (folder / spec.name).write_bytes(b"")
            shards[spec.name] = {"start": spec.start, "stop": spec.stop}
    dd.write_manifest(folder, {"format": dd.DATA_FORMAT, "version": 1, "fingerprint": {}, "shards": shards})


def add_shard(folder: Path, data: dd.DistillConfig, index: int) -> None:
    spec = dd.shard_specs(data.num_samples, data.shard_size)[index]
    (folder / spec.name).write_bytes(b"")
    manifest = dd.read_manifest(folder)
    manifest["shards"][spec.name] = {"start": spec.start, "stop": spec.stop}
    dd.write_manifest(folder, manifest)


def test_the_data_wait_stops_naming_the_ranks_whose_shards_are_missing(tmp_path):
    """Of 6 shards on 3 ranks, rank 1's (1, 4) and rank 2's shard 5 never come: the wait stops after the timeout
    without a new shard, naming each missing shard and the rank that was to write it. A shard that arrives starts
    the timeout again; a complete folder ends the wait at once."""
    data = dd.DistillConfig(num_samples=12, shard_size=2, wait_poll_s=0.02)
    fake_data(tmp_path, data, present=[0, 3])
    adder = threading.Timer(0.3, add_shard, (tmp_path, data, 2))  # rank 2's shard 2, late but in time
    adder.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        dd.wait_for_data(tmp_path, data, timeout_s=0.5, world=3)
    adder.join()
    assert time.monotonic() - started > 0.75  # 0.3 s, then 0.5 s without a new shard
    message = str(err.value)
    assert "still miss 3 of 6 shards" in message and "(dist.timeout_min)" in message
    assert "rank 1 of 3 was to write shard_00001.safetensors, shard_00004.safetensors" in message
    assert "rank 2 of 3 was to write shard_00005.safetensors" in message and "rank 0 of" not in message
    assert "Ranks 1, 2 stopped or hang" in message and "rerun the same command" in message
    for index in (1, 4, 5):
        add_shard(tmp_path, data, index)
    dd.wait_for_data(tmp_path, data, timeout_s=0.5, world=3)
    assert dd.data_complete(tmp_path, data)


# -- the disk the data need -------------------------------------------------------------------------------------
def test_the_storage_need_matches_the_readme_table():
    """The README's feature disk for Janus-Pro-7B (2 CFG streams × 577 × 4096, bfloat16): 9.5 MB per sample and 284
    GB for 30,000 samples; computed here from the shapes (plus the codes and shard headers)."""
    janus_7b = SimpleNamespace(num_image_tokens=576, hidden_size=4096, num_streams=2)
    data = dd.DistillConfig(num_samples=30000, shard_size=100)
    need = dd.storage_need(janus_7b, data, Path("/nonexistent/drafter_data"),
                           dd.shard_specs(data.num_samples, data.shard_size), ["a prompt"] * data.num_samples)
    assert need.sample_bytes == 2 * 577 * 4096 * 2 + 8 * 576 + 8
    assert dd.human_bytes(need.sample_bytes) == "9.46 MB" and dd.human_bytes(need.need) == "284 GB"
    assert need.shape == "2 streams × 577 × 4096 × bfloat16" and need.folder == Path("/")


def test_the_storage_need_is_printed_and_an_impossible_one_stops_before_writing(tiny_model, tmp_path, monkeypatch,
                                                                                  capsys):
    data = dd.DistillConfig(num_samples=6, shard_size=2, storage_dtype="float32", batch_size=2)
    prompts = tiny_model.class_names
    dd.generate_data(tiny_model, data, tmp_path / "made", prompts, progress=False)
    printed = capsys.readouterr().out
    assert "drafter data: 3 shards (6 samples) to write into" in printed
    assert "2 streams × 65 × 64 × float32 = 33.8 kB per sample" in printed and "free there:" in printed
    written = sum(p.stat().st_size for p in (tmp_path / "made").glob("shard_*.safetensors"))
    need = dd.storage_need(tiny_model, data, tmp_path / "made", dd.shard_specs(6, 2), dd.cycle(prompts, 6))
    assert written <= need.need <= 1.05 * written  # the estimate bounds the shards and is close to them

    # a rerun needs nothing more and prints nothing
    dd.generate_data(tiny_model, data, tmp_path / "made", prompts, progress=False)
    assert "drafter data:" not in capsys.readouterr().out

    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    target = tmp_path / "new" / "data"
    with pytest.raises(dd.DiskSpaceError) as err:
        dd.generate_data(tiny_model, data, target, prompts, progress=False, rank=1, world=2)
    message = str(err.value)
    assert f"need about {dd.human_bytes(need.need)}" in message and "only 1 kB are free" in message
    assert "distill.dir=<folder>" in message and "distill.low_disk=warn" in message
    assert "Nothing was written" in message and not (tmp_path / "new").exists()
    assert "drafter data:" not in capsys.readouterr().out  # rank 1 does not print; rank 0 does
    warn = dd.DistillConfig(num_samples=6, shard_size=2, storage_dtype="float32", batch_size=2, low_disk="warn")
    with pytest.warns(UserWarning, match="distill.low_disk=warn: writing anyway"):
        dd.generate_data(tiny_model, warn, target, prompts, progress=False)
    assert dd.data_complete(target, warn)
    with pytest.raises(ValueError, match="distill.low_disk must be one of"):
        dd.DistillConfig(low_disk="ignore")


# -- the launcher preset ----------------------------------------------------------------------------------------
def preset_command() -> tuple[str, list[str]]:
    """The config name and overrides of the first comment line of hydra/launcher/slurm_train.yaml (placeholders
    filled)."""
    lines = (CONFIGS / "hydra" / "launcher" / "slurm_train.yaml").read_text().splitlines()
    command = next(line[2:] for line in lines if line.startswith("# python"))
    words = shlex.split(command)
    assert words[:3] == ["python", "scripts/train_drafter.py", "-m"] and words[3] == "--config-name", words
    overrides = [w.replace("<partition>", "gpu").replace("<account>", "lab") for w in words[5:]]
    return words[4], overrides


def test_the_training_preset_requeues_and_resumes(monkeypatch, tmp_path):
    """The preset's documented command composes; its jobs default to resume=true (a requeued job continues from its
    last checkpoint) while other runs keep resume=false; its sbatch options allow requeues (submission stopped just
    before ``sbatch``, as in tests/test_cluster.py)."""
    from hydra.core.utils import env_override

    name, overrides = preset_command()
    monkeypatch.delenv("COOLSD_TRAIN_RESUME", raising=False)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name=name, overrides=[*overrides, f"hydra.sweep.dir={tmp_path}", "hydra.job.name=t"],
                      return_hydra_config=True)
        plain = compose(config_name=name)
        refused = compose(config_name=name, overrides=[*overrides, "resume=false"], return_hydra_config=True)
    assert cfg.resume is False and plain.resume is False  # outside a job of the preset
    with env_override(cfg.hydra.job.env_set):  # what Hydra does around the task function of each job
        assert cfg.resume is True and plain.resume is True
        assert refused.resume is False  # the command line wins
    assert cfg.train.grad_accum == 1 and cfg.hydra.runtime.choices.model == "janus_pro_7b"
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        folder = compose(config_name=name, overrides=overrides, return_hydra_config=True).hydra.sweep.dir
    assert folder == "multirun/train_drafter/janus_pro_7b"  # not the clock: every attempt logs into it

    executor, sbatch = sbatch_of(monkeypatch, cfg, overrides)
    assert executor.max_num_timeout == 20
    for line in ("#SBATCH --requeue", "--signal=USR2@300", "--gpus-per-node=8", "--ntasks-per-node=8",
                 "--partition=gpu", "--account=lab", "--time=1440", "export SLURM_KILL_BAD_EXIT=1"):
        assert line in sbatch, line


# -- several processes train the drafter of one ------------------------------------------------------------------
def train_args(folder: Path, batch_size: int, *extra: str) -> list[str]:
    """A tiny run, data and training: 4 shards (the last held out), 4 steps of ``batch_size`` sequences per process,
    no feature noise (drawn per rank), no warm-up (so the steps move the weights)."""
    return ["model=tiny", "model.device=cpu", "wandb.mode=disabled", "train.progress=false", "distill.num_samples=8",
            "distill.shard_size=2", "distill.batch_size=2", "distill.storage_dtype=float32", "distill.wait_poll_s=0.1",
            "train.steps=4", f"train.batch_size={batch_size}", "train.noise_std=0", "train.warmup_steps=0",
            "val.num_images=1", "val.at_start=false", f"distill.dir={folder / 'data'}", f"out_dir={folder / 'out'}",
            f"hydra.run.dir={folder / 'hydra'}", *extra]


def slurm_tasks(folder: Path, job: str, tasks: tuple[int, ...], *extra: str) -> list[tuple[int, str, str]]:
    """Tasks ``tasks`` of a 2-task SLURM step on this machine, placed only by SLURM's variables (as ``srun --ntasks=2
    python scripts/train_drafter.py`` would); returns (exit code, stdout, stderr) of each."""
    port = str(free_port())
    procs = []
    for rank in tasks:
        env = clean_env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                        SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
                        SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *train_args(folder, 2, *extra)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append((proc.returncode, out, err))
    return results


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_a_task_that_never_joins_stops_the_other_within_dist_timeout(tmp_path):
    """Task 1 of 2 never starts: task 0 stops when its rendezvous times out (dist.timeout_min, 3 s here) and
    says what to look for; nothing was written."""
    started = time.monotonic()
    [(code, _, err)] = slurm_tasks(tmp_path, "881", (0,), "dist.timeout_min=0.05")
    assert code != 0 and "rank 0 of 2 (submitit) could not join the process group" in err, err[-3000:]
    assert "dist.timeout_min" in err and time.monotonic() - started < 60
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


def assert_same_drafter(reference: Path, other: Path, bitwise: bool = False) -> None:
    """The same data shards (bitwise) and the same trained drafter (to float rounding, or ``bitwise``)."""
    one, two = dd.read_manifest(reference / "data"), dd.read_manifest(other / "data")
    assert one["shards"] == two["shards"] and len(one["shards"]) == 4
    for name in one["shards"]:
        a, b = load_file(str(reference / "data" / name)), load_file(str(other / "data" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a, b = load_file(str(reference / "out" / "model.safetensors")), load_file(str(other / "out" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        if bitwise:
            assert torch.equal(a[key], b[key]), key
        else:  # rounding: 5.2e-8 measured; a process that trained alone on half the batch: 3.3e-4
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=2e-6, msg=key)


def ranks_of_checkpoint(folder: Path) -> list[str]:
    """The RNG states accelerate saved in the last checkpoint: one per rank."""
    return sorted(p.name for p in (folder / "out" / "steps" / "step_0000004" / "state").glob("random_states_*"))


@pytest.mark.slow  # CI's -m slow pass (27 s on 2 cores: 5 processes)
def test_slurm_tasks_and_torchrun_make_the_data_and_drafter_of_one_process(tmp_path):
    """(a) two processes placed only by SLURM's variables and (b) ``torchrun --nproc_per_node=2`` against one process
    with the same sequences per step: the same shards (bitwise) and drafter (to rounding); (a) and (b) bitwise."""
    one, slurm, torchrun = tmp_path / "one", tmp_path / "slurm", tmp_path / "torchrun"
    proc = subprocess.run([sys.executable, SCRIPT, *train_args(one, 4)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks_of_checkpoint(one) == ["random_states_0.pkl"]

    results = slurm_tasks(slurm, "882", (0, 1))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert "drafter written to" in results[0][1] and "drafter written to" not in results[1][1]  # rank 0 reports
    assert "drafter data: 4 shards (8 samples)" in results[0][1] and "drafter data:" not in results[1][1]
    assert ranks_of_checkpoint(slurm) == ["random_states_0.pkl", "random_states_1.pkl"]  # one run of 2 ranks
    assert_same_drafter(one, slurm)

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", SCRIPT, *train_args(torchrun, 2)], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks_of_checkpoint(torchrun) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert_same_drafter(one, torchrun)
    assert_same_drafter(slurm, torchrun, bitwise=True)
