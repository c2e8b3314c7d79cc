"""From one process to a cluster (issue 34, items 1-2): ranks from SLURM variables (through submitit) and from
torchrun give the records of one process; rank 0 waits for the others through their markers on disk, not a
collective; the SLURM launcher preset; stable sweep folders; a submitit job interrupted and requeued resumes
its records."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from coolsd.launch import BatchStepError, launch_environment
from eval.records.image_records import load_records
from eval.records.rank_markers import RankMarkers
from eval.run.shards import dist_options
from tests.helpers import sbatch_of

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
COMMON = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=[sd]",
          "eval.save_images=true", "eval.num_prompts=6", "eval.warmup=0", "eval.reuse_ar=false"]
DECODERS = ("ar", "sd")
#: variables by which a parent process could place a child in some run (cleared for the children here)
PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in PLACEMENT and not k.startswith(("SLURM_", "SUBMITIT_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_py(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: ``COMMON`` in one process."""
    out = tmp_path_factory.mktemp("one_process")
    run_py(*COMMON, f"hydra.run.dir={out}")
    return out


def assert_same_records(reference: Path, other: Path, n: int = 6) -> None:
    """Every decoder's records hold the same images (tokens, accepted lengths, PNG bytes) in both folders."""
    for name in DECODERS:
        a, b = load_records(reference / "records", name), load_records(other / "records", name)
        assert sorted(a) == sorted(b) == list(range(n)), name
        for i in range(n):
            assert a[i]["tokens"] == b[i]["tokens"], (name, i)
            assert a[i]["stats"]["accepted_hist"] == b[i]["stats"]["accepted_hist"], (name, i)
            assert (reference / a[i]["image"]).read_bytes() == (other / b[i]["image"]).read_bytes(), (name, i)


# -- where the ranks come from ---------------------------------------------------------------------------------
SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}


@pytest.fixture
def placement(monkeypatch):
    """A clean slate: no torchrun, SLURM or submitit variables (restored afterwards, including the
    ``SUBMITIT_EXECUTOR`` that ``launch_environment`` sets for a SLURM task)."""
    for key in [*PLACEMENT, *(k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_")))]:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    return monkeypatch


def test_ranks_come_from_slurm_through_submitit_and_from_torchrun(placement):
    assert launch_environment().source == "single" and launch_environment().world == 1
    for key, value in SLURM_TASK.items():
        placement.setenv(key, value)
    env = launch_environment()  # srun python run.py: submitit's SLURM environment reads the task's place
    assert (env.source, env.rank, env.world, env.local_rank) == ("submitit", 5, 8, 1)
    assert env.init_method.startswith("tcp://gpu07:")  # the job's first node; a port drawn from the job id
    assert env.init_method == launch_environment().init_method  # every task draws the same port
    placement.setenv("MASTER_PORT", "29999")
    assert launch_environment().init_method == "tcp://gpu07:29999"
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():  # srun torchrun ...: torchrun's
        placement.setenv(key, value)
    env = launch_environment()
    assert (env.source, env.rank, env.world, env.local_rank, env.init_method) == ("torchrun", 3, 4, 3, "env://")


def test_a_batch_step_without_srun_stops_at_once_with_the_fix(placement, tmp_path):
    """``sbatch --ntasks=8`` whose script runs ``python run.py`` without ``srun``: one process that SLURM calls task
    0 of 8. It stops before anything loads (it would wait for 7 tasks that never come), and says how to start them;
    one task in its batch script, or a task of an ``srun`` step, runs."""
    batch = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    for key, value in batch.items():
        placement.setenv(key, value)
    with pytest.raises(BatchStepError, match=r"srun --kill-on-bad-exit=1 python \S+\.py"):
        launch_environment()
    placement.setenv("SLURM_STEP_ID", "batch")  # not a numbered step either
    with pytest.raises(BatchStepError, match="SLURM_NTASKS=8"):
        launch_environment()
    placement.setenv("SLURM_NTASKS", "1")
    assert launch_environment().world == 1
    env = clean_env(**batch)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "run.py", *COMMON, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "BatchStepError" in proc.stderr and "Nothing was started" in proc.stderr
    assert "srun --kill-on-bad-exit=1 python run.py" in proc.stderr
    assert time.monotonic() - started < 60 and not (tmp_path / "run" / "records").exists()


def test_dist_keys_are_checked_and_the_start_up_timeout_is_short():
    cfg = compose_with([])
    assert dist_options(cfg.dist) == {"startup_timeout_min": 10.0, "timeout_min": 720.0, "poll_s": 10.0,
                                      "stale_min": 30.0}
    with pytest.raises(ValueError, match="dist.timeout_min must be a number > 0"):
        dist_options({"timeout_min": 0})
    with pytest.raises(TypeError, match="dist.poll_s"):
        dist_options({"poll_s": "often"})
    with pytest.raises(ValueError, match="unknown keys \\['timeout'\\]"):
        dist_options({"timeout": 5})


# -- rank 0 waits on markers, not in a collective ------------------------------------------------------------------
def test_rank_zero_waits_for_markers_and_names_a_failed_or_silent_rank(tmp_path):
    fast = {"poll_s": 0.02, "stale_min": 0.01}  # 0.6 s without a heartbeat counts as dead
    zero = RankMarkers(tmp_path, 0, 3, "attempt-a", **fast)
    ones = [RankMarkers(tmp_path, k, 3, "attempt-a", **fast) for k in (1, 2)]
    for m in ones:
        m.start()
    time.sleep(0.1)
    ones[0].finish({"sd": 2})
    ones[1].finish({"sd": 1})
    done = zero.wait_for([1, 2])
    assert sorted(done) == [1, 2] and done[1]["records"] == {"sd": 2} and done[2]["beat"] >= 1

    # a marker of an earlier attempt (a requeued job) does not count: rank 2 gave no sign in this one
    again = RankMarkers(tmp_path, 0, 3, "attempt-b", **fast)
    RankMarkers(tmp_path, 1, 3, "attempt-b", **fast).finish()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 2 of 3 has given no sign of life .*no marker of this attempt"):
        again.wait_for([1, 2])
    assert time.monotonic() - t0 < 10

    # a rank that stopped on an error: rank 0 stops waiting at once, with the error
    failing = RankMarkers(tmp_path, 2, 3, "attempt-b", **fast)
    failing.start()
    failing.fail(MemoryError("CUDA out of memory"))
    with pytest.raises(RuntimeError, match="rank 2 of 3 failed on .*MemoryError: CUDA out of memory"):
        again.wait_for([1, 2])

    # a rank that came to a meeting (published its value) and failed before rank 0's next poll did come to it:
    # the meeting returns its value, and rank 0's next wait stops with the error (CI once caught rank 0 between
    # the two and it stopped before making its own shard)
    met = RankMarkers(tmp_path, 0, 2, "attempt-m", **fast)
    late = RankMarkers(tmp_path, 1, 2, "attempt-m", **fast)
    late.start()
    late.publish("meeting1", {"signature": "x"})
    late.fail(RuntimeError("rank 1 ran out of memory"))
    assert met.wait_for([1], published="meeting1")[1]["published"]["meeting1"] == {"signature": "x"}
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed on .*rank 1 ran out of memory"):
        met.wait_for([1])

    # a rank whose heartbeat stops (killed): reported with its host and pid after stale_min
    RankMarkers(tmp_path, 1, 3, "attempt-c", **fast).finish()
    dying = RankMarkers(tmp_path, 2, 3, "attempt-c", **fast)
    dying.start()
    time.sleep(0.1)
    dying.stop()  # what a SIGKILL leaves: a marker that says running and never changes again
    with pytest.raises(RuntimeError, match=rf"rank 2 of 3 has given no sign of life .*pid {os.getpid()}"):
        RankMarkers(tmp_path, 0, 3, "attempt-c", **fast).wait_for([1, 2])


def test_other_ranks_wait_for_rank_zero_and_stop_when_it_stops(tmp_path):
    """Ranks > 0 leave only once rank 0 has finished (all leave the process group together); rank 0 failing or
    being requeued (SystemExit) ends their wait without an error of theirs; rank 0 going silent raises."""
    fast = {"poll_s": 0.02, "stale_min": 0.01}
    for attempt, end in (("done", None), ("requeued", SystemExit(144))):
        zero, one = RankMarkers(tmp_path, 0, 2, attempt, **fast), RankMarkers(tmp_path, 1, 2, attempt, **fast)
        zero.start()
        one.finish({"sd": 1})
        zero.finish() if end is None else zero.fail(end)
        assert one.wait_for([0], raise_on_failure=False)[0]["state"] == ("done" if end is None else "failed")
    silent = RankMarkers(tmp_path, 0, 2, "silent", **fast)
    silent.start()
    silent.stop()
    with pytest.raises(RuntimeError, match="rank 0 of 2 has given no sign of life"):
        RankMarkers(tmp_path, 1, 2, "silent", **fast).wait_for([0], raise_on_failure=False)


# -- several processes give the records of one ---------------------------------------------------------------------
@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_two_slurm_tasks_give_the_records_of_one_process(one_process, tmp_path):
    """Two gloo processes placed only by SLURM's variables (as ``srun --ntasks=2 python run.py`` would), read by
    submitit's TorchDistributedEnvironment."""
    out = tmp_path / "slurm"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = clean_env(SLURM_JOB_ID="777", SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "run.py", *COMMON, f"hydra.run.dir={out}", "dist.poll_s=0.2"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert sorted(p.name for p in (out / "records").glob("*.jsonl")) == [
        "ar.rank0.jsonl", "ar.rank1.jsonl", "sd.rank0.jsonl", "sd.rank1.jsonl"]
    assert_same_records(one_process, out)
    record = json.loads((out / "run.json").read_text())
    assert record["world_size"] == 2 and record["per_decoder"]["sd"]["num_images"] == 6
    marker = json.loads((out / "ranks" / "rank1.json").read_text())
    assert marker["state"] == "done" and marker["records"] == {"ar": 3, "sd": 3}
    assert json.loads((out / "ranks" / "rank0.json").read_text())["state"] == "done"  # written after run.json


@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_rank_zero_stops_with_the_error_of_a_rank_that_failed(tmp_path):
    """Rank 1 fails after the start-up collectives (its generation raises): rank 0 makes its own shard, then
    stops with rank 1's error at once instead of waiting, and rank 0's finished records stay for a rerun."""
    out = tmp_path / "failing"
    port = free_port()
    failing = ("import runpy, sys\n"
               "import eval.run.generator\n"
               "def boom(self, done):\n"
               "    raise RuntimeError('rank 1 ran out of memory')\n"
               "eval.run.generator.Generator.run = boom\n"
               "sys.argv = ['run.py', *sys.argv[1:]]\n"
               "runpy.run_path('run.py', run_name='__main__')\n")
    procs = []
    for rank in (0, 1):
        env = clean_env(SLURM_JOB_ID="778", SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = ["run.py"] if rank == 0 else ["-c", failing]
        procs.append(subprocess.Popen([sys.executable, *command, *COMMON, f"hydra.run.dir={out}", "dist.poll_s=0.2"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (_, err0), (_, err1) = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode != 0 and "rank 1 ran out of memory" in err1
    assert procs[0].returncode != 0, err0[-3000:]
    assert "rank 1 of 2 failed on" in err0 and "RuntimeError: rank 1 ran out of memory" in err0, err0[-3000:]
    assert json.loads((out / "ranks" / "rank1.json").read_text())["state"] == "failed"
    assert sorted(load_records(out / "records", "sd")) == [0, 2, 4]  # rank 0's shard, kept
    assert not (out / "run.json").exists()


@pytest.mark.slow
def test_torchrun_gives_the_records_of_one_process(one_process, tmp_path):
    out = tmp_path / "torchrun"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "run.py", *COMMON, f"hydra.run.dir={out}",
                           "dist.poll_s=0.2"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_records(one_process, out)
    assert json.loads((out / "run.json").read_text())["world_size"] == 2
    assert json.loads((out / "ranks" / "rank1.json").read_text())["state"] == "done"


def slurm_pair(tmp_path, job: str, port: int, extra: tuple[str, ...], rank1: list[str] | None):
    """Rank 0 (run.py) and, unless ``rank1`` is None, rank 1 (``rank1``: python arguments) of a 2-task SLURM step."""
    procs = []
    for rank in (0, 1):
        if rank == 1 and rank1 is None:
            continue
        env = clean_env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                        SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
                        SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = ["run.py"] if rank == 0 else rank1
        procs.append(subprocess.Popen([sys.executable, *command, *COMMON, f"hydra.run.dir={tmp_path}", *extra],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p, *p.communicate(timeout=300)) for p in procs]


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_a_task_that_never_starts_stops_the_others_within_the_start_up_timeout(tmp_path):
    """Rank 1 of 2 never comes (it died before joining): rank 0 stops after dist.startup_timeout_min (6 s here),
    not after the 12 h of dist.timeout_min, and says what to look for; nothing was generated."""
    started = time.monotonic()
    [(proc, _, err)] = slurm_pair(tmp_path / "run", "779", free_port(), ("dist.startup_timeout_min=0.1",), None)
    assert proc.returncode != 0 and "could not join the process group" in err and "dist.startup_timeout_min" in err
    assert time.monotonic() - started < 90 and not (tmp_path / "run" / "records").exists()


DIES_IN_LOAD = ("import os, runpy, sys\n"
                "import eval.run.experiment\n"
                "def dies(model):\n"
                "    {}\n"
                "eval.run.experiment.check_batch_invariance = dies\n"
                "sys.argv = ['run.py', *sys.argv[1:]]\n"
                "runpy.run_path('run.py', run_name='__main__')\n")


@pytest.mark.parametrize("death", [pytest.param("raise MemoryError('CUDA out of memory while loading')",
                                                marks=pytest.mark.slow), "os._exit(9)"])
def test_a_rank_that_dies_while_loading_stops_the_others_through_its_marker(tmp_path, death):
    """After joining, ranks meet through their markers (the numerics self-check), not the process group: a rank
    that fails while loading the model stops rank 0 at once with its error; one killed without a word (os._exit)
    stops it once its heartbeat is dist.stale_min (3 s here) old."""
    fast = ("dist.poll_s=0.2", "dist.stale_min=0.05")
    (zero, _, err0), (one, _, _) = slurm_pair(tmp_path / "run", "780", free_port(), fast,
                                              ["-c", DIES_IN_LOAD.format(death)])
    assert one.returncode != 0 and zero.returncode != 0
    expected = "CUDA out of memory while loading" if "Memory" in death else "has given no sign of life"
    assert "rank 1 of 2" in err0 and expected in err0, err0[-3000:]
    assert not list((tmp_path / "run" / "records").glob("*.jsonl"))


# -- sweep folders and the launcher presets -------------------------------------------------------------------------
def compose_with(overrides: list[str], hydra_cfg: bool = False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_cfg)


EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", [None, *EXPERIMENTS])
def test_sweep_folders_are_named_after_the_experiment_not_the_clock(name):
    cfg = compose_with([f"experiment={name}"] if name else [], hydra_cfg=True)
    raw = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
    assert "now:" not in str(raw), raw
    own = name and OmegaConf.select(OmegaConf.load(CONFIGS / "experiment" / f"{name}.yaml"), "hydra.sweep.dir")
    # an experiment's own folder (results/runs/<name>), else config.yaml's multirun/<experiment name or "sweep">
    expected = f"results/runs/{name}" if own else f"multirun/{cfg.experiment_name}" if name else "multirun/sweep"
    assert cfg.hydra.sweep.dir == expected
    assert raw["subdir"] in ("${hydra.job.override_dirname}", "${claims.regime}", "${claims_more.key}")


def test_slurm_preset_writes_the_sbatch_options_and_allows_requeues(monkeypatch, tmp_path):
    """The preset's keys reach sbatch through the real launcher (submission stopped just before ``sbatch``)."""
    cfg = compose_with(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab",
                        "hydra.launcher.gpus_per_node=4", "hydra.launcher.mem_gb=256",
                        f"hydra.sweep.dir={tmp_path}", "hydra.job.name=run"], hydra_cfg=True)
    executor, sbatch = sbatch_of(monkeypatch, cfg, ["decoder=sd"])
    assert executor.max_num_timeout == 20
    for line in ("--time=1440", "--gpus-per-node=4", "--ntasks-per-node=4", "--partition=gpu", "--account=lab",
                 "--mem=256GB", "--signal=USR2@300", "--cpus-per-task=8", "--requeue", "export SLURM_KILL_BAD_EXIT=1"):
        assert line in sbatch, line


def sweep_job(sweep: Path) -> Path:
    (job,) = [p.parent for p in sweep.glob("*/run.json")]
    return job


@pytest.mark.slow  # CI's -m slow pass (the default suite stays under 10 min on 2 cores)
def test_a_requeued_submitit_job_resumes_its_records(one_process, tmp_path):
    """A sweep through submitit's local executor gives the records of one process; then the requeue path that a
    time-out or pre-emption takes (the launcher's ``checkpoint``: the same job resubmitted, here run from the
    job's submitted pickle in a fresh process) finishes a job whose last records were lost, in the same folder."""
    sweep = tmp_path / "sweep"
    run_py("-m", "hydra/launcher=slurm_local", *COMMON, f"hydra.sweep.dir={sweep}")
    job = sweep_job(sweep)
    assert job.name.startswith("compare=[sd],data.prompts=[a,b,c],data=fixed,drafter=lookup,eval.num_prompts=6,")
    assert job.parent == sweep  # the job folder is named after its overrides, sorted
    assert_same_records(one_process, job)

    for name in DECODERS:  # the job was killed after its first 2 images of each decoder
        log = job / "records" / f"{name}.jsonl"
        log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
    (job / "run.json").unlink()
    (pickled,) = list((sweep / ".submitit").glob("*/*_submitted.pkl"))
    job_id = pickled.parent.name
    # what submitit's signal handler does on USR2 (the launcher's checkpoint, dumped over the submitted pickle),
    # then what the requeued task runs (process_job), in a fresh process placed as the job's task
    requeue = ("import sys\n"
               "from submitit.core import job_environment, submission, utils\n"
               "d = utils.DelayedSubmission.load(sys.argv[1])\n"
               "assert job_environment._checkpoint(d, sys.argv[1], d._timeout_countdown) == ''\n"
               "again = utils.DelayedSubmission.load(sys.argv[1])\n"
               "assert again.function.checkpoint.__qualname__ == 'BaseSubmititLauncher.checkpoint'\n"
               "assert again.args[:4] == d.args[:4]\n"  # the same overrides, folder key and job number
               "submission.process_job(sys.argv[2])\n")
    task = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": job_id, "SUBMITIT_LOCAL_NTASKS": "1",
            "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}
    proc = subprocess.run([sys.executable, "-c", requeue, str(pickled), str(sweep / ".submitit" / "%j")], cwd=ROOT,
                          env=clean_env(**task), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sweep_job(sweep) == job and (job / "run.json").is_file()
    assert_same_records(one_process, job)
    for name in DECODERS:  # only the lost images were generated again
        assert len((job / "records" / f"{name}.jsonl").read_text().splitlines()) == 6


@pytest.mark.slow
def test_a_submitit_job_with_two_tasks_gives_the_records_of_one_process(one_process, tmp_path):
    """``tasks_per_node=2`` on submitit's local executor: two ranks placed by submitit's job environment."""
    sweep = tmp_path / "sweep"
    run_py("-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=2", *COMMON, "dist.poll_s=0.2",
           f"hydra.sweep.dir={sweep}")
    job = sweep_job(sweep)
    assert "dist.poll_s" not in job.name  # dist.* changes no image: not part of the job folder's name
    assert_same_records(one_process, job)
    assert json.loads((job / "run.json").read_text())["world_size"] == 2
    assert json.loads((job / "ranks" / "rank1.json").read_text())["records"] == {"ar": 3, "sd": 3}


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the job's tasks through /proc (Linux)")
@pytest.mark.parametrize("tasks", [1, 2])
def test_a_submitit_job_signalled_mid_run_is_requeued_and_resumes(tmp_path, tasks):
    """The whole path on submitit's local executor: the job's tasks get USR2 (what SLURM sends before the time
    limit) after the first images; submitit checkpoints through the launcher on rank 0 and requeues (rank 1, if
    any, stops waiting for rank 0); the new attempt resumes the same folder and the records are those of an
    uninterrupted process, none made twice."""
    sweep = tmp_path / "sweep"
    n = 100  # the lookup model makes ~200 images/s here: a window of ~1 s to signal the tasks in
    args = [*COMMON, f"eval.num_prompts={n}", "dist.poll_s=0.2"]
    reference = tmp_path / "reference"
    run_py(*args, f"hydra.run.dir={reference}")
    proc = subprocess.Popen([sys.executable, "run.py", "-m", "hydra/launcher=slurm_local",
                             f"hydra.launcher.tasks_per_node={tasks}", *args, f"hydra.sweep.dir={sweep}"], cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    signalled = None
    while time.monotonic() < deadline and proc.poll() is None:
        logs = list(sweep.glob("*/records/ar*.jsonl"))
        if logs and len(logs[0].read_text().splitlines()) >= 2:
            found = [t for c in children(proc.pid) for t in children(c)]  # hydra -> controller -> tasks
            if len(found) == tasks:
                for task in found:
                    os.kill(task, signal.SIGUSR2)
                signalled = sum(len(p.read_text().splitlines()) for p in sweep.glob("*/records/ar*.jsonl"))
                break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert signalled is not None and signalled < n, "the job finished before it could be signalled"
    job = sweep_job(sweep)
    logs = "".join(p.read_text() for p in sorted((sweep / ".submitit").rglob("*_log.*")))
    assert "this job is preempted" in logs and "Requeued job" in logs, logs[-3000:]
    if tasks == 2:  # rank 1 stopped waiting for the requeued rank 0 at once (not after dist.stale_min)
        assert "rank 1: rank 0 stopped (SystemExit: 144)" in logs, logs[-3000:]
    assert_same_records(reference, job, n)
    # nothing generated twice, but for the timed prompt the signal interrupted: a prompt of the timed subset that
    # some decoder had not timed is timed again for every decoder (README, "Timed subset of a resumed run")
    repeated = {}
    for name in DECODERS:
        lines = [json.loads(line) for p in (job / "records").glob(f"{name}*.jsonl") for line in p.read_text().splitlines()]
        counts = Counter(r["index"] for r in lines)
        repeated[name] = {i for i, c in counts.items() if c > 1}
        assert all(c <= 2 for c in counts.values()) and len(lines) == n + len(repeated[name]), name
        assert len(repeated[name]) <= tasks, (name, repeated[name])  # one interrupted prompt per rank at most
        assert all(r.get("timed") for r in lines if r["index"] in repeated[name]), name
    assert set(repeated["ar"]) >= set(repeated["sd"]), repeated  # AR is re-timed wherever SD is
    assert json.loads((job / "run.json").read_text())["world_size"] == tasks


NO_MODEL = ("import runpy, sys\n"
            "import eval.run.experiment\n"
            "def nothing(*args, **kwargs):\n"
            "    raise AssertionError('a finished row built something')\n"
            "eval.run.experiment.instantiate = nothing\n"
            "eval.run.experiment.Shards = nothing\n"
            "sys.argv = ['run.py', *sys.argv[1:]]\n"
            "runpy.run_path('run.py', run_name='__main__')\n")


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_a_finished_row_exits_at_once_without_loading_anything(one_process):
    """Resubmitting a finished sweep (or a requeue after the row finished): the row's run.json holds this config,
    complete, so the job prints its summary and exits: no process group, no model, no scoring. Another config in
    the same folder is not mistaken for it."""
    before = (one_process / "run.json").read_text()
    proc = subprocess.run([sys.executable, "-c", NO_MODEL, *COMMON, f"hydra.run.dir={one_process}"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is complete for this config" in proc.stdout and "nothing to do" in proc.stdout
    assert (one_process / "run.json").read_text() == before
    other = subprocess.run([sys.executable, "-c", NO_MODEL, *COMMON, "eval.bootstrap.resamples=500",
                            f"hydra.run.dir={one_process}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                           timeout=120)
    assert other.returncode != 0 and "a finished row built something" in other.stderr
