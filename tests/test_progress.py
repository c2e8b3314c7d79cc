"""Live progress of a run (``eval.run.loggers.Progress``): images done, running accepted length and img/s per
decoder reach the console and the logger while the run generates, every N batches or T seconds, then the final
summary."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hydra import compose, initialize_config_dir

from eval.run.loggers import NullLogger, Progress, WandbLogger
from tests.helpers import CONFIGS


@dataclass
class FakeStats:
    num_tokens: int
    iterations: int


class FakeLogger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def log_progress(self, metrics: dict) -> None:
        self.calls.append(("log_progress", dict(metrics)))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reports_every_n_batches_with_pooled_accepted_length_and_rate():
    logger, lines = FakeLogger(), []
    progress = Progress(logger, every=2, every_s=1e9, write=lines.append, clock=Clock())
    progress.start({"ar": 4, "sd": 4})
    progress.add("sd", [FakeStats(num_tokens=9, iterations=4), FakeStats(num_tokens=9, iterations=2)], 2.0)
    assert logger.calls == [] and lines == []  # one batch: not yet
    progress.add("ar", [FakeStats(num_tokens=9, iterations=8)] * 2, 4.0)
    assert len(logger.calls) == 1
    m = logger.calls[0][1]
    assert m["progress/sd/images"] == 2 and m["progress/ar/images"] == 2
    assert m["progress/sd/accepted_length"] == pytest.approx(16 / 6)  # pooled: (8 + 8) / (4 + 2), not mean of ratios
    assert m["progress/ar/accepted_length"] == 1.0
    assert m["progress/sd/img_per_s"] == pytest.approx(1.0) and m["progress/ar/img_per_s"] == pytest.approx(0.5)
    assert m["progress/images"] == 4 and m["progress/total"] == 8
    assert lines[0].startswith("progress: ") and "sd 2/4 img, accepted length 2.67, 1.00 img/s" in lines[0]
    progress.finish()
    assert len(logger.calls) == 2 and lines[-1].startswith("generation done: ")


def test_reports_after_every_s_seconds_even_between_batch_counts():
    logger, clock = FakeLogger(), Clock()
    progress = Progress(logger, every=1000, every_s=30.0, write=lambda s: None, clock=clock)
    progress.start({"sd": 10})
    progress.add("sd", [FakeStats(5, 2)], 1.0)
    clock.now = 29.0
    progress.add("sd", [FakeStats(5, 2)], 1.0)
    assert logger.calls == []
    clock.now = 31.0
    progress.add("sd", [FakeStats(5, 2)], 1.0)
    assert [c[1]["progress/sd/images"] for c in logger.calls] == [3]
    clock.now = 40.0
    progress.add("sd", [FakeStats(5, 2)], 1.0)
    assert len(logger.calls) == 1  # 9 s since the last report


def test_bad_frequencies_are_refused():
    with pytest.raises(ValueError, match="progress_every"):
        Progress(NullLogger(), every=0)


class RecordingLogger(NullLogger):
    """A logger for ``run_experiment`` that records the order of its calls."""

    calls: list[tuple[str, object]] = []

    def begin(self, record, out_dir) -> None:
        RecordingLogger.calls.append(("begin", record["decoder"]))

    def log_progress(self, metrics) -> None:
        RecordingLogger.calls.append(("log_progress", dict(metrics)))

    def log_run(self, record, out_dir) -> None:
        RecordingLogger.calls.append(("log_run", record["per_decoder"]))


def test_run_reports_progress_during_generation_and_the_summary_at_the_end(tmp_path, capsys):
    from eval.run.experiment import run_experiment

    RecordingLogger.calls = []
    overrides = ["model=lookup", "drafter=lookup", "data=fixed", "logger=none", "decoder=sd",
                 "logger._target_=tests.test_progress.RecordingLogger", "logger.progress_every=1",
                 "eval.num_prompts=4", "eval.batch_size=2", "eval.speed_prompts=1", "eval.warmup=0",
                 "eval.reuse_ar=false"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_experiment(cfg, tmp_path)
    kinds = [k for k, _ in RecordingLogger.calls]
    assert kinds[0] == "begin" and kinds[-1] == "log_run"
    progress = [m for k, m in RecordingLogger.calls if k == "log_progress"]
    # 1 timed image per decoder + 2 batches of the other 3 per decoder, each reported, plus the final report
    assert len(progress) >= 4
    assert progress[0]["progress/images"] < progress[-1]["progress/images"] == 8
    last = progress[-1]
    assert last["progress/ar/accepted_length"] == 1.0 and last["progress/sd/images"] == 4
    assert last["progress/sd/img_per_s"] > 0
    summary = RecordingLogger.calls[-1][1]
    assert summary["sd"]["mean_accepted_length"] == pytest.approx(last["progress/sd/accepted_length"])
    assert "generation done: " in capsys.readouterr().out


def test_wandb_offline_run_shows_progress_and_the_summary(tmp_path, monkeypatch):
    """An offline W&B run is opened at ``begin``; progress rows and the final summary land in the same run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(mode="offline", project="test")
    record = {"decoder": "sd", "config": {"experiment_name": None}, "job": {}}
    logger.begin(record, tmp_path)
    run = logger._run
    assert run is not None
    logged = []
    monkeypatch.setattr(run, "log", lambda data, *a, **k: logged.append(dict(data)))
    progress = Progress(logger, every=1, write=lambda s: None)
    progress.start({"sd": 1})
    progress.add("sd", [FakeStats(5, 2)], 0.5)
    assert logged and logged[0]["progress/sd/images"] == 1
    monkeypatch.setattr(logger, "_log", lambda wandb, r, rec, out, cells: logged.append({"final": r.id}))
    logger.log_run({**record, "per_decoder": {}}, tmp_path)
    assert logged[-1] == {"final": run.id} and logger._run is None  # the summary went into the same run
    assert list((tmp_path / "wandb").glob("offline-run-*"))
