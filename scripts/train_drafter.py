"""Train an EAGLE drafter for a target model by self-distillation: data generation, training, validation.

The logic lives in ``coolsd.training`` (``data``: distillation shards; ``drafter``: the training loop on
``accelerate``, checkpoints, validation); this entry point composes the config, fills the per-model default
folders and prints the result. The drafter is written to ``out_dir`` (default ``checkpoints/drafter_<model>``)
and is used with ``python run.py drafter=eagle drafter.checkpoint=<out_dir>``.

Examples::

    python scripts/train_drafter.py model=tiny
    python scripts/train_drafter.py model=tiny stage=data distill.num_samples=4096
    torchrun --nproc_per_node=8 scripts/train_drafter.py model=<m> stage=train resume=true
    accelerate launch --multi_gpu --num_processes=8 scripts/train_drafter.py model=<m> stage=train resume=true
    srun --ntasks-per-node=8 --gpus-per-node=8 --kill-on-bad-exit=1 python scripts/train_drafter.py model=<m>
    python scripts/train_drafter.py -m --config-name train_drafter_janus_pro_7b hydra/launcher=slurm_train \
        hydra.launcher.partition=<partition> hydra.launcher.gpus_per_node=8 train.grad_accum=1

Ranks come from ``coolsd.launch.launch_environment`` (torchrun, a SLURM or submitit task, or one process);
``hydra/launcher=slurm_train`` requeues the job on time-out or pre-emption and resumes it.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.training.drafter import run, summary  # noqa: E402


def default_dirs(cfg: DictConfig) -> None:
    """Fill ``out_dir`` / ``distill.dir`` from the chosen model config when they are null."""
    name = HydraConfig.get().runtime.choices.get("model", "model")
    if cfg.out_dir is None:
        cfg.out_dir = f"checkpoints/drafter_{name}"
    if cfg.distill.dir is None:
        cfg.distill.dir = f"outputs/drafter_data/{name}"


@hydra.main(version_base="1.3", config_path="../configs", config_name="train_drafter")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # not a line per checkpoint in the job's log
    default_dirs(cfg)
    start = time.perf_counter()
    result = run(cfg)
    if result is not None and result.main_process:
        print(summary(result, cfg.val.draft_len, time.perf_counter() - start))


if __name__ == "__main__":
    main()
