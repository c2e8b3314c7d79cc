"""Entry point: compose model / decoder / eval / logger with Hydra, generate, measure, record.

One invocation = one model, one prompt set, the chosen decoder plus the AR baseline (and, with no
``decoder=`` on the command line, every decoder of the suite), all measured in this process on the same
prompts and seeds. Writes ``run.json`` (resolved config, git commit, hardware, flat ``metrics`` of the chosen
decoder, ``per_decoder`` for all) into the Hydra output folder and prints a table and a one-line summary.

Examples::

    python run.py
    python run.py decoder=sd decoder.draft_len=5 eval.num_prompts=32
    python run.py -m decoder=sd decoder.draft_len=2,3,4
"""
from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from eval.run.experiment import run_experiment


def decoder_chosen(task_overrides: list[str]) -> bool:
    """True if the command line picked a decoder (``decoder=...``), which turns ``compare=auto`` off."""
    return any(o.split("=", 1)[0].lstrip("+~") == "decoder" for o in task_overrides)


def job_info(hc) -> dict:
    """What names this job in W&B and ``run.json``: Hydra's job name, the overrides that make it (multirun:
    the swept values, ``hydra.job.override_dirname``), the sweep folder and job number (None when not a sweep)."""
    multirun = hc.mode == RunMode.MULTIRUN
    return {"name": hc.job.name, "override_dirname": hc.job.override_dirname or None,
            "sweep_dir": str(hc.sweep.dir) if multirun else None, "num": hc.job.num if multirun else None}


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    record = run_experiment(
        cfg,
        output_dir=hc.runtime.output_dir,
        decoder_overridden=decoder_chosen(list(hc.overrides.task)),
        choices=dict(hc.runtime.choices),
        job=job_info(hc),
    )
    return float(record.get("metrics", {}).get("speedup", 0.0))  # {} on ranks > 0 of a torchrun job


if __name__ == "__main__":
    main()
