"""Benchmark: where a decode's time goes, and how close each decoder comes to its ideal speedup.

The measurement lives in ``eval.bench.efficiency`` (cost model, interleaved end-to-end decodes, ideal speedup and
efficiency, overhead per iteration, throughput, goals) and, with ``sweep.batch_sizes``, ``eval.bench.batch_sweep``
(speedup against batch size on both paths) and, with ``refill.widths``, ``eval.bench.refill`` (refilling finished rows
against lock-step batches); this entry point composes ``configs/bench.yaml``, runs
it, and prints the table it wrote to ``results/bench/<name>.md`` (beside ``<name>.json``).

Examples::

    python scripts/bench.py                                   # CPU, the default model, every decoder
    python scripts/bench.py bench=embedded_random             # the embedded model's sizes, random weights
    python scripts/bench.py bench=llamagen_xl_512 cuda_graphs=true
    python scripts/bench.py bench=janus_pro_1b compile=true
    python scripts/bench.py layouts=[column_major,row_block,row_major] images=30   # batch invariance's cost
    python scripts/bench.py bench=embedded_batch_sweep       # speedup against batch size (eval.bench.batch_sweep)
    python scripts/bench.py bench=embedded_refill            # refilling finished rows (eval.bench.refill)
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from eval.bench.batch_sweep import run_sweep  # noqa: E402
from eval.bench.efficiency import run_bench  # noqa: E402
from eval.bench.refill import refill_study  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    model = HydraConfig.get().runtime.choices.get("model") or "model"
    if cfg.refill.widths:
        record = refill_study(cfg, model)
    else:
        record = run_sweep(cfg, model) if cfg.sweep.batch_sizes else run_bench(cfg, model)
    print((Path(cfg.out_dir) / f"{record['setup']['name']}.md").read_text())  # the layouts' table when run


if __name__ == "__main__":
    main()
