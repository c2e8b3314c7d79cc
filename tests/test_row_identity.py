"""One row, one code, one attempt (issue 59, items 1 and 2): records carry the digest of the code that made their
tokens (``eval.records.code_digest``) and an edited rule is refused, made again or kept and marked, never silently
reused (``eval.code_mismatch``); a row folder has a lease (``eval.records.lease``), so a second live attempt stops
at once, naming the first, and a stale one is taken over; ``scripts/status.py`` prints the command that resubmits
only the failed and stale rows of a sweep, and that command is run here.

The code edit is simulated in the child process: ``eval.records.code_digest.file_identity`` digests the source of
``coolsd/acceptance.py`` with one statement added (``EDIT``), as if the file had been edited, so the checkout stays
as it is while every other part of the run (digests, stored identities, the resume, the finished-row check) is the
real one.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coolsd.io import atomic_write_json
from eval.records.code_digest import ROOT, CodeIdentity, code_of, decoder_code, file_identity
from eval.records.lease import LEASE_FILE, Lease, LeaseHeld
from eval.records.rank_markers import RankMarkers
from eval.report.sweep_status import report, resubmit_commands, sweep_status

COMMON = ["model=lookup", "drafter=lookup", "data=fixed", "data.prompts=[a,b,c]", "logger=none", "compare=[sd]",
          "eval.num_prompts=4", "eval.speed_prompts=2", "eval.batch_size=2", "eval.warmup=0", "eval.threads=1"]
EDITED = "coolsd/acceptance.py"
#: run.py with ``EDITED`` digested as if one statement had been added to it (module doc)
EDIT = ("import runpy, sys\n"
        "import eval.records.code_digest as cd\n"
        "real, target = cd.file_identity, sys.argv[1]\n"
        "def edited(path):\n"
        "    digest, imports = real(path)\n"
        "    if str(path).endswith(target):\n"
        "        import ast, hashlib\n"
        "        tree = cd._strip_docstrings(ast.parse(path.read_text() + '\\nEDITED_RULE = 1\\n'))\n"
        "        digest = hashlib.sha1(ast.dump(tree, annotate_fields=True, include_attributes=False).encode())"
        ".hexdigest()\n"
        "    return digest, imports\n"
        "cd.file_identity = edited\n"
        "sys.argv = ['run.py', *sys.argv[2:]]\n"
        "runpy.run_path('run.py', run_name='__main__')\n")


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**out, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
            "COOLSD_CACHE": str(tmp_path / "cache"), **extra}


def run(tmp_path: Path, *args: str, edited: bool = False, ok: bool = True, **extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", EDIT, EDITED, *args] if edited else [sys.executable, "run.py", *args]
    proc = subprocess.run(command, cwd=ROOT, env=env(tmp_path, **extra), capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / "records" / f"{name}.jsonl").read_text().splitlines()]


# -- the digest ---------------------------------------------------------------------------------------------------
def test_the_digest_ignores_docstrings_comments_and_layout_and_sees_every_other_change(tmp_path):
    base = "'''Module doc.'''\nimport math\n\n\ndef rule(p, q):\n    '''Its doc.'''\n    return min(1.0, p / q)\n"
    same = ("'''Another module doc.'''\nimport math  # a comment\n\ndef rule(p,\n         q):\n    '''Changed doc.'''\n"
            "    # why\n    return min(1.0,   p / q)\n")
    other = base.replace("min(1.0, p / q)", "min(1.0, 2 * p / q)")
    digests = []
    for k, text in enumerate((base, same, other)):
        path = tmp_path / f"m{k}.py"
        path.write_text(text)
        digests.append(file_identity(path)[0])
    assert digests[0] == digests[1] != digests[2]


def test_a_decoder_digests_the_modules_it_reaches_and_the_static_path_only_on_it():
    model = {"_target_": "coolsd.models.lookup.LookupModel"}
    sd = {"_target_": "coolsd.decoding.Decoder", "rule": {"_target_": "baselines.exact.ExactRule"}}
    lantern = {**sd, "rule": {"_target_": "baselines.lantern.LanternRule"}}
    eager = decoder_code(model, sd)
    assert {"coolsd/decoding.py", "coolsd/acceptance.py", "baselines/exact.py", "coolsd/models/lookup.py"} \
        <= set(eager.files)
    assert not any(f.startswith("coolsd/static/") for f in eager.files)
    static = decoder_code(model, {**sd, "path": "static"})
    assert {"coolsd/static/loop.py", "coolsd/static/capture.py"} <= set(static.files)
    assert static.digest != eager.digest
    assert "baselines/lantern.py" in decoder_code(model, lantern).files
    assert "baselines/lantern.py" not in eager.files  # an edit of LANTERN does not touch vanilla SD's records
    old = CodeIdentity({**eager.files, "coolsd/acceptance.py": "0" * 40}, eager.python)
    assert eager.changed(old) == ["coolsd/acceptance.py"]
    assert code_of(["coolsd.decoding"]).files == code_of(["coolsd.decoding"]).files  # stable


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_an_edited_rule_is_refused_rerun_or_accepted_never_reused(tmp_path):
    """A finished row, then the same command after an edit of the acceptance code: refused before anything loads
    (naming the file); with ``eval.code_mismatch=rerun`` every record is made again by today's code; with
    ``accept`` the old records are kept, run.json names the file and the table marks the row §. An unfinished row
    (no run.json) is refused by the resume in the same way."""
    folder = tmp_path / "row"
    run(tmp_path, *COMMON, f"hydra.run.dir={folder}")
    before = {r["index"]: r["code"] for r in records(folder, "sd")}
    assert len(set(before.values())) == 1 and None not in before.values()
    refused = run(tmp_path, *COMMON, f"hydra.run.dir={folder}", edited=True, ok=False)
    assert refused.returncode != 0
    assert f"decoder 'sd': its code changed since its records were made: {EDITED}" in refused.stderr
    assert "Nothing was loaded" in refused.stderr and "eval.code_mismatch=rerun" in refused.stderr

    kept = tmp_path / "kept"  # an unfinished row (no run.json): the resume refuses it the same way
    run(tmp_path, *COMMON, f"hydra.run.dir={kept}")
    (kept / "run.json").unlink()
    again = run(tmp_path, *COMMON, f"hydra.run.dir={kept}", edited=True, ok=False)
    assert again.returncode != 0 and "holds records made by other code" in again.stderr and EDITED in again.stderr
    run(tmp_path, *COMMON, f"hydra.run.dir={kept}", "eval.code_mismatch=accept", edited=True)
    record = json.loads((kept / "run.json").read_text())
    assert record["code"]["accepted_mismatch"]["sd"] == [EDITED]
    assert [r["code"] for r in records(kept, "sd")] == list(before.values())  # kept, not made again
    assert "| sd § |" in (kept / "table.md").read_text() and "§ this decoder's images" in (kept / "table.md").read_text()

    run(tmp_path, *COMMON, f"hydra.run.dir={folder}", "eval.code_mismatch=rerun", edited=True)
    record = json.loads((folder / "run.json").read_text())
    now = record["per_decoder"]["sd"]["code_digest"]
    assert now != before[0] and record["code"]["rerun"]["sd"] == [EDITED]
    assert {r["code"] for r in records(folder, "sd")} == {now}  # every record made again by the edited code
    assert record["per_decoder"]["sd"]["code_digests"] == {now: 4}


# -- one attempt per row -------------------------------------------------------------------------------------------
def test_a_second_live_attempt_on_a_row_stops_at_once_naming_the_first(tmp_path):
    folder = tmp_path / "row"
    first = Lease(folder, stale_min=30, poll_s=3600).acquire()  # a live attempt (this process) holds the row
    try:
        t0 = time.perf_counter()
        proc = run(tmp_path, *COMMON, f"hydra.run.dir={folder}", ok=False)
        took = time.perf_counter() - t0
        assert proc.returncode != 0 and "is being written by another attempt" in proc.stderr
        assert f"pid {os.getpid()}" in proc.stderr and "before writing anything" in proc.stderr
        assert not (folder / "records").exists() and not (folder / "ranks").exists()  # nothing written or clobbered
        assert took < 60, took  # at once: no model, no generation
        assert Lease.read(folder)["owner"] == first.owner  # the first attempt keeps its lease
    finally:
        first.release()
    assert not (folder / LEASE_FILE).exists()


def test_a_stale_lease_is_taken_over_and_said_so_and_a_requeue_of_the_same_job_takes_its_own(tmp_path, caplog):
    folder = tmp_path / "row"
    dead = Lease(folder, stale_min=30, poll_s=3600).acquire()
    dead._stop.set()  # its holder died: the heartbeat stops
    lease = json.loads((folder / LEASE_FILE).read_text())
    lease["heartbeat"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)).isoformat()
    atomic_write_json(folder / LEASE_FILE, lease)
    with caplog.at_level("WARNING", logger="coolsd"):
        second = Lease(folder, stale_min=30, poll_s=3600).acquire()
    assert second.took_over["owner"] == dead.owner and "taking over the lease" in caplog.text
    assert Lease.read(folder)["owner"] == second.owner
    dead.lost = None
    with pytest.raises(LeaseHeld, match="being written by another attempt"):  # and now it is live again
        Lease(folder, stale_min=30, poll_s=3600).acquire()
    second.release()

    os.environ["SLURM_JOB_ID"] = "4242"
    try:
        before = Lease(folder, stale_min=30, poll_s=3600).acquire()  # attempt 1 of job 4242, killed by a requeue
        before._stop.set()
        again = Lease(folder, stale_min=30, poll_s=3600).acquire()  # its live-looking lease: the same job, taken
        assert again.took_over["owner"] == before.owner
        again.release()
    finally:
        del os.environ["SLURM_JOB_ID"]


def test_a_lease_whose_process_on_this_host_has_ended_is_taken_over_at_once(tmp_path, caplog):
    """A local run killed with SIGKILL leaves a fresh-looking lease: its pid is gone on this host, so the next
    attempt takes it over at once instead of waiting dist.stale_min (tests/test_eval.py kills and resumes a run)."""
    folder = tmp_path / "row"
    dead = Lease(folder, stale_min=30, poll_s=3600).acquire()
    dead._stop.set()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    lease = json.loads((folder / LEASE_FILE).read_text())
    atomic_write_json(folder / LEASE_FILE, {**lease, "pid": proc.pid})  # heartbeat fresh, its process gone
    with caplog.at_level("WARNING", logger="coolsd"):
        second = Lease(folder, stale_min=30, poll_s=3600).acquire()
    assert second.took_over["pid"] == proc.pid and f"its process (pid {proc.pid}) on this host has ended" in caplog.text
    second.release()
    atomic_write_json(folder / LEASE_FILE, {**lease, "host": "another-host", "pid": proc.pid})  # not ours to judge
    with pytest.raises(LeaseHeld, match="being written by another attempt"):
        Lease(folder, stale_min=30, poll_s=3600).acquire()


def test_status_counts_a_live_lease_as_running(tmp_path):
    """A refused second attempt rewrites the row's Hydra files; the row still reads as running while its lease
    lives."""
    folder = tmp_path / "row"
    (folder / "records").mkdir(parents=True)
    lease = Lease(folder, stale_min=30, poll_s=3600).acquire()
    try:
        (state,) = sweep_status(folder)
        assert state.state == "running" and f"pid {os.getpid()}" in state.detail
    finally:
        lease.release()


# -- resubmitting only the failed and stale rows -------------------------------------------------------------------
@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
def test_status_prints_the_command_that_resubmits_only_failed_and_stale_rows_and_it_works(tmp_path):
    """A real sweep of three rows; one is then made to look failed and one stale (their run.json removed, their
    markers as a failed and a silently dead attempt leave them). status prints one command for those two rows
    (their swept key joined by commas, the sweep's own folder); running it finishes exactly those two, leaves the
    done row alone, and status then reports every row done."""
    sweep = tmp_path / "sweep"
    args = ["-m", *[a for a in COMMON if not a.startswith("compare")], "compare=none", "decoder=sd",
            "decoder.draft_len=1,2,3", f"hydra.sweep.dir={sweep}"]
    run(tmp_path, *args)
    rows = {int(f.name.split("decoder.draft_len=")[1][0]): f for f in sweep.iterdir() if f.is_dir()}
    assert sorted(rows) == [1, 2, 3]
    assert all((f / "run.json").is_file() for f in rows.values())
    done_before = (rows[1] / "run.json").stat().st_mtime_ns
    for n in (2, 3):
        (rows[n] / "run.json").unlink()
    failed = RankMarkers(rows[2], 0, 1, "a2", poll_s=3600.0)
    failed.start()
    failed.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
    stale = RankMarkers(rows[3], 0, 1, "a3", poll_s=3600.0)
    stale.start()
    stale.stop()
    marker = json.loads((rows[3] / "ranks" / "rank0.json").read_text())
    marker["time"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)).isoformat()
    atomic_write_json(rows[3] / "ranks" / "rank0.json", marker)

    text, code = report(sweep)
    states = {s.folder.name: s.state for s in sweep_status(sweep)}
    assert code == 1 and sorted(states.values()) == ["done", "failed", "stale"]
    (command,) = resubmit_commands(sweep, sweep_status(sweep))
    assert command in text and "decoder.draft_len=2,3" in command and "draft_len=1" not in command
    assert f"hydra.sweep.dir={sweep.resolve()}" in command
    words = shlex.split(command)
    assert words[:3] == ["python", "run.py", "-m"]
    proc = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (rows[1] / "run.json").stat().st_mtime_ns == done_before  # the done row was not run again
    text, code = report(sweep)
    assert code == 0 and "Resubmit" not in text, text
    assert len(list(sweep.glob("*/run.json"))) == 3  # no new row folder: the rows resumed their own
