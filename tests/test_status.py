"""The status of a sweep folder (issue 45 item 5, ``eval/report/sweep_status.py``, ``scripts/status.py``) and
one W&B run per row across requeues (item 6, ``eval.run.loggers.run_id``).

The fake sweeps are written with the project's own writers (``RankMarkers``, ``JsonlLog``, ``atomic_write_json``)
and those of Hydra and submitit (``OmegaConf.save`` for ``.hydra/`` and ``multirun.yaml``, ``JobReturn`` pickled by
submitit's ``cloudpickle_dump``), so a change of any of their formats breaks these tests; one slow test reads a
real sweep run through submitit's local executor.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from coolsd.io import atomic_write_json
from eval.records.image_records import JsonlLog
from eval.records.rank_markers import RankMarkers
from eval.report.sweep_status import read_job_result, report, sweep_jobs, sweep_status
from eval.run.loggers import WandbLogger, run_id

ROOT = Path(__file__).resolve().parent.parent
TWO_HOURS = 2 * 3600.0
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
#: PyTorch's message of an asynchronous CUDA error: its last lines are hints, not the error
CUDA_ERROR = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
              "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
              "passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def write_multirun(sweep: Path, rows: list[str]) -> None:
    """Hydra's ``multirun.yaml`` of ``run.py -m experiment=tiny_sweep`` whose experiment sweeps ``row``."""
    sweep.mkdir(parents=True, exist_ok=True)
    OmegaConf.save({"hydra": {
        "sweep": {"dir": str(sweep), "subdir": "${hydra.job.override_dirname}"},
        "sweeper": {"_target_": BASIC_SWEEPER, "max_batch_size": None, "params": {"row": ",".join(rows)}},
        "overrides": {"hydra": ["hydra/launcher=slurm"], "task": ["experiment=tiny_sweep"]},
        "job": {"name": "run", "override_dirname": "experiment=tiny_sweep", "id": "???", "num": "???",
                "config": {"override_dirname": {"kv_sep": "=", "item_sep": ",", "exclude_keys": ["experiment"]}}}}},
        sweep / "multirun.yaml")


def make_row(sweep: Path, row: str, num: int, job_id: str, num_prompts: int = 5) -> Path:
    """A job's folder as Hydra starts it: ``.hydra/`` with the job's config, Hydra config and overrides."""
    folder = sweep / f"row={row}"
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save({"eval": {"num_prompts": num_prompts}, "dist": {"stale_min": 30, "poll_s": 10}},
                   folder / ".hydra" / "config.yaml")
    OmegaConf.save({"hydra": {"job": {"name": "run", "id": job_id, "num": num, "override_dirname": f"row={row}"}}},
                   folder / ".hydra" / "hydra.yaml")
    OmegaConf.save([f"row={row}", "experiment=tiny_sweep"], folder / ".hydra" / "overrides.yaml")
    return folder


def add_records(folder: Path, name: str, indices: list[int], rank: int | None = None) -> None:
    atomic_write_json(folder / "records" / f"{name}.fingerprint.json", {"decoder": {"name": name}})
    log = JsonlLog(folder / "records" / (f"{name}.jsonl" if rank is None else f"{name}.rank{rank}.jsonl"), key="index")
    for i in indices:
        log.append({"index": i, "prompt": f"p{i}", "seed": i, "tokens": [1, 2, 3]})


def running_marker(folder: Path, rank: int, world: int, attempt: str = "a1") -> RankMarkers:
    """Rank ``rank``'s marker as its heartbeat leaves it (``running``), the heartbeat thread stopped."""
    markers = RankMarkers(folder, rank, world, attempt, poll_s=3600.0)
    markers.start()
    markers.stop()
    return markers


def age_marker(folder: Path, rank: int, seconds: float) -> None:
    """Move a marker's heartbeat time ``seconds`` into the past (what a rank that died long ago leaves)."""
    path = folder / "ranks" / f"rank{rank}.json"
    marker = json.loads(path.read_text())
    marker["time"] = (dt.datetime.fromisoformat(marker["time"]) - dt.timedelta(seconds=seconds)).isoformat()
    atomic_write_json(path, marker)


def age_files(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))


def build_sweep(parent: Path) -> Path:
    """A sweep of 5 jobs: one done, one running on 2 ranks, one failed on rank 1, one stale, one not started."""
    sweep = parent / "table"
    write_multirun(sweep, ["done", "running", "failed", "stale", "queued"])
    done = make_row(sweep, "done", 0, "4242_0")
    add_records(done, "ar", range(5))
    atomic_write_json(done / "run.json", {"num_prompts": 5, "per_decoder": {"ar": {}, "sd": {}}, "metrics": {}})

    running = make_row(sweep, "running", 1, "4242_1")  # 5 prompts on 2 ranks: rank 0 takes 0, 2, 4; rank 1: 1, 3
    add_records(running, "ar", [0, 2], rank=0)
    add_records(running, "ar", [1], rank=1)
    add_records(running, "sd", [0], rank=0)
    running_marker(running, 0, 2)
    running_marker(running, 1, 2)

    failed = make_row(sweep, "failed", 2, "4242_2")
    add_records(failed, "ar", [0], rank=0)
    rank0 = running_marker(failed, 0, 2)
    rank1 = RankMarkers(failed, 1, 2, "a1", poll_s=3600.0)
    rank1.start()
    rank1.fail(RuntimeError(CUDA_ERROR))
    rank0.fail(RuntimeError("rank 1 of 2 failed on node7 (pid 11): CUDA error"))  # what rank 0 then says
    logs = sweep / ".submitit" / "4242_2"
    logs.mkdir(parents=True)
    (logs / "4242_2_1_log.err").write_text("Traceback (most recent call last):\n  File \"run.py\", line 1\n"
                                           "RuntimeError: CUDA error: an illegal memory access was encountered\n")
    (logs / "4242_2_0_log.err").write_text("generating: 10%\r generating: 12%\n")

    stale = make_row(sweep, "stale", 3, "4242_3")
    add_records(stale, "ar", [0, 1], rank=0)
    running_marker(stale, 0, 2)
    running_marker(stale, 1, 2)
    age_marker(stale, 0, TWO_HOURS)
    age_marker(stale, 1, TWO_HOURS + 60)
    return sweep


@pytest.fixture
def sweep(tmp_path) -> Path:
    return build_sweep(tmp_path)


def lines_by_row(text: str) -> dict[str, str]:
    return {re.search(r"row=(\w+)", line)[1]: line for line in row_lines(text)}


def row_lines(text: str) -> list[str]:
    """The report's row lines (before its total line; the resubmission command follows that)."""
    lines = text.splitlines()
    return lines[: next(k for k, line in enumerate(lines) if re.match(r"\d+ rows?: ", line))]


def total(text: str) -> str:
    return next(line for line in text.splitlines() if re.match(r"\d+ rows?: ", line))


def test_status_of_a_sweep_names_every_row_its_state_and_the_total(sweep):
    text, code = report(sweep)
    print(text)
    rows = lines_by_row(text)
    assert [line.split()[0] for line in row_lines(text)] == ["done", "running", "failed", "stale", "not"]
    assert rows["done"].startswith("done") and "5 prompts: ar, sd" in rows["done"]
    # per decoder out of the row's prompts, per rank out of its shard, and the freshest heartbeat's age
    assert re.search(r"running\s+row=running\s+ar 3/5 \[r0 2/3 r1 1/2\], sd 1/5 \[r0 1/3\]; heartbeat \d+ s ago "
                     r"\(2 ranks\)", rows["running"]), rows["running"]
    # the first rank to fail, its error's last line (PyTorch's hints after it skipped), the log to read
    assert rows["failed"].startswith("failed")
    assert "rank 1 of 2 on " in rows["failed"]
    assert "RuntimeError: CUDA error: an illegal memory access was encountered; log: " in rows["failed"]
    assert str(sweep / ".submitit" / "4242_2" / "4242_2_1_log.err") in rows["failed"]
    assert rows["stale"].startswith("stale") and "dist.stale_min = 30 min" in rows["stale"]
    assert "ranks 0, 1 silent for at least 2.0 h" in rows["stale"] and "rerun the sweep command" in rows["stale"]
    assert rows["queued"].startswith("not started")
    assert total(text) == "5 rows: 1 done, 1 running, 1 stale, 1 failed, 1 not started"
    assert code == 1

    by_label = {s.label: s for s in sweep_status(sweep)}
    assert by_label["row=failed"].error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert by_label["row=failed"].log == sweep / ".submitit" / "4242_2" / "4242_2_1_log.err"


def test_the_job_list_is_hydras_expansion_of_multirun_yaml(sweep):
    jobs = sweep_jobs(sweep)
    assert [j.folder.name for j in jobs] == ["row=done", "row=running", "row=failed", "row=stale", "row=queued"]
    assert jobs[4].overrides == ("row=queued", "experiment=tiny_sweep") and jobs[4].num == 4


def test_exit_code_and_the_script(sweep, capsys, monkeypatch):
    def run_script(*args: str) -> int:
        monkeypatch.setattr(sys, "argv", ["scripts/status.py", *args])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(ROOT / "scripts" / "status.py"), run_name="__main__")
        return stop.value.code

    assert run_script(str(sweep)) == 1
    assert total(capsys.readouterr().out).startswith("5 rows:")
    assert run_script(str(sweep / "row=done")) == 0  # one run folder
    assert capsys.readouterr().out.splitlines() == ["done  row=done  5 prompts: ar, sd", "1 row: 1 done"]
    assert run_script(str(sweep / ".submitit")) == 2  # nothing to report: says what to give
    assert "no run folder under" in capsys.readouterr().err


def test_rows_of_one_process_failed_requeued_stale_and_running(tmp_path):
    """One process writes no rank markers: the job's end is submitit's result file (a Python error is caught by
    Hydra inside the job: the exception is the pickled JobReturn's value), a requeue is submitit's log line, and
    the age is that of the newest file."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import cloudpickle_dump

    sweep = tmp_path / "sweep"
    make_row(sweep, "failed", 0, "555")
    jobs = sweep / ".submitit"
    (jobs / "555").mkdir(parents=True)
    ret = JobReturn()
    ret.status = JobStatus.FAILED
    ret.return_value = ValueError("decoder.draft_len must be an integer >= 0, got -1")
    cloudpickle_dump(("success", ret), jobs / "555" / "555_0_result.pkl")
    (jobs / "555" / "555_0_log.err").write_text("")
    make_row(sweep, "crashed", 1, "556")
    (jobs / "556").mkdir()
    cloudpickle_dump(("error", "Traceback (most recent call last):\n  ...\nKeyError: 'eval'\n"),
                     jobs / "556" / "556_0_result.pkl")
    make_row(sweep, "requeued", 2, "557")
    (jobs / "557").mkdir()
    (jobs / "557" / "557_0_log.out").write_text(
        "submitit INFO - Starting with JobEnvironment(job_id=557)\nsubmitit WARNING - Caught signal SIGUSR2\n"
        "submitit INFO - Requeued job 557 (19 remaining timeouts)\n")
    stale = make_row(sweep, "stale", 3, "558", num_prompts=4)
    add_records(stale, "ar", [0, 1])
    age_files(stale, TWO_HOURS)
    running = make_row(sweep, "running", 4, "559", num_prompts=4)
    add_records(running, "ar", [0, 1, 2])

    rows = {s.label: s for s in sweep_status(sweep)}
    assert rows["row=failed"].state == "failed"
    assert rows["row=failed"].error == "ValueError: decoder.draft_len must be an integer >= 0, got -1"
    assert rows["row=failed"].log == jobs / "555" / "555_0_log.err"
    assert (rows["row=crashed"].state, rows["row=crashed"].error) == ("failed", "KeyError: 'eval'")
    assert rows["row=requeued"].state == "requeued"
    assert rows["row=stale"].state == "stale" and "no file written for 2.0 h" in rows["row=stale"].detail
    assert rows["row=running"].state == "running" and rows["row=running"].detail.startswith("ar 3/4; last write")
    assert read_job_result(jobs / "555" / "555_0_result.pkl")[0] is False


def test_a_requeued_attempt_then_the_next_attempts_markers(tmp_path):
    """A requeue leaves rank 0's marker ``failed`` with ``SystemExit``: ``requeued``; the next attempt's markers
    (another attempt id) replace it: ``running``."""
    row = make_row(tmp_path, "a", 0, "1")
    rank0 = RankMarkers(row, 0, 2, "first", poll_s=3600.0)
    rank0.start()
    rank0.fail(SystemExit(-1))
    running_marker(row, 1, 2, attempt="first")
    (status,) = sweep_status(row)
    assert status.state == "requeued"
    running_marker(row, 0, 2, attempt="second")
    (status,) = sweep_status(row)
    assert status.state == "running" and "2 ranks" in status.detail


@pytest.mark.slow
def test_status_of_a_real_sweep_through_submitits_local_executor(tmp_path):
    """A real sweep (``hydra/launcher=slurm_local``) with one finished and one failing row: the failing row's
    error comes from submitit's result file (Hydra caught it inside the job: the logs do not hold it)."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=slurm_local", "model=lookup",
                           "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=[sd]",
                           "eval.num_prompts=3", "eval.warmup=0", "eval.reuse_ar=false", "decoder=sd",
                           "decoder.draft_len=2,-1", f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "draft_len" in proc.stderr  # the submitter raises the failed job's error
    text, code = report(sweep)
    print(text)
    states = {s.label.split("decoder.draft_len=")[1].split(",")[0]: s for s in sweep_status(sweep)}
    assert states["2"].state == "done" and states["-1"].state == "failed" and code == 1
    assert "decoder.draft_len must be an integer >= 0, got -1" in states["-1"].error
    assert states["-1"].log.name.endswith("_0_log.err") and states["-1"].log.parent.parent.name == ".submitit"
    assert sorted(j.folder for j in sweep_jobs(sweep)) == sorted(s.folder for s in states.values())
    assert total(text) == "2 rows: 1 done, 1 failed"


# -- one W&B run per row ------------------------------------------------------------------------------------------
def test_wandb_run_id_follows_the_output_folder(tmp_path, monkeypatch):
    """Two attempts of one folder (also when reached through another spelling of its path) open the same W&B run,
    with ``resume="allow"``; another folder another run."""
    import wandb

    calls = []

    class FakeRun:
        def finish(self) -> None:
            return None

    def fake_init(**kwargs):
        calls.append(kwargs)
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    record = {"decoder": "sd", "config": {"experiment_name": "x"}, "job": {}}
    (tmp_path / "row=a").mkdir()
    (tmp_path / "row=b").mkdir()
    for folder in (tmp_path / "row=a", tmp_path / "row=b" / ".." / "row=a", tmp_path / "row=b"):
        WandbLogger(mode="offline").begin(record, folder)
    a, a_again, b = calls
    assert re.fullmatch(r"[0-9a-f]{16}", a["id"])
    assert a["id"] == a_again["id"] == run_id(tmp_path / "row=a") != b["id"]
    assert a["resume"] == b["resume"] == "allow"


def test_offline_wandb_attempts_of_one_folder_share_the_run_id(tmp_path):
    """Offline mode takes the id and ``resume``: each attempt writes ``offline-run-<time>-<id>`` with the row's id."""
    record = {"decoder": "sd", "config": {"experiment_name": None}, "job": {}}
    for _ in range(2):
        logger = WandbLogger(mode="offline", project="test")
        logger.begin(record, tmp_path)
        logger._run.finish()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))  # offline-run-<date>_<time>-<id>[-<n> in 1 s]
    ids = {re.fullmatch(r"offline-run-\d{8}_\d{6}-([0-9a-f]{16})(-\d+)?", r.name)[1] for r in runs}
    assert len(runs) == 2 and ids == {run_id(tmp_path)}
