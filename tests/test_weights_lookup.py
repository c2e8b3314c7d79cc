"""Weights are looked up before a large model is built: with no files, each real-model config fails at once
with a ``MissingWeightsError`` that names every missing file, where it was looked for and the command that
fetches it, and the process's peak memory hardly grows (building LlamaGen T2I-XL's GPT alone would take
3.1 GB in float32, Janus-Pro-7B or Lumina-mGPT-7B tens of GB).

Each config is instantiated exactly as ``run.py`` does (Hydra ``compose`` + ``instantiate``) in a fresh
subprocess with ``HF_HUB_OFFLINE=1`` and an empty Hugging Face cache; the peak resident set size
(``resource.getrusage(...).ru_maxrss``) is read after every import and again after the failed construction.
About 25 s on 2 CPU cores (three subprocesses, mostly imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import CONFIGS

ROOT = CONFIGS.parent
PEAK_GROWTH_LIMIT_MB = 200  # the smallest model here (GPT-XL) would add > 3000 MB

SCRIPT = r"""
import json, resource, sys
import torch, transformers  # noqa: F401  (import costs stay outside the measurement)
from transformers import ChameleonConfig, Emu3ForConditionalGeneration, JanusForConditionalGeneration, T5EncoderModel  # noqa: F401
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
import coolsd.models.emu3, coolsd.models.janus_pro, coolsd.models.llamagen_t2i, coolsd.models.lumina_mgpt  # noqa: F401
from coolsd.models.checkpoints import MissingWeightsError

with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[2:])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    instantiate(cfg.model)
    result = {"error": None}
except Exception as err:  # Hydra wraps the adapter's error in an InstantiationException
    cause = err if isinstance(err, MissingWeightsError) else err.__cause__
    if not isinstance(cause, MissingWeightsError):
        raise
    result = {"error": str(cause)}
result["growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model=llamagen_t2i_512"],
            [
                "t2i_XL_stage2_512.pt",
                "vq_ds16_t2i.pt",
                "hf download peizesun/llamagen_t2i",
                "google/flan-t5-xl",
                "hf download google/flan-t5-xl",
                "looked in",
            ],
        ),
        pytest.param(
            ["model=janus_pro_7b"],
            ["deepseek-community/Janus-Pro-7B", "hf download deepseek-community/Janus-Pro-7B", "looked in"],
            marks=pytest.mark.slow,  # one adapter in the default suite, the others in CI's -m slow pass
        ),
        pytest.param(
            ["model=lumina_mgpt_768", "model.tokenizer_dir=__EMPTY__"],
            [
                "text_tokenizer.json",
                "vqgan.ckpt",
                "config.json",
                "hf download Alpha-VLLM/Lumina-mGPT-7B-768",
                "looked in",
            ],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["model=emu3_gen"],
            ["BAAI/Emu3-Gen-hf", "hf download BAAI/Emu3-Gen-hf", "model.safetensors.index.json", "looked in"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["llamagen_t2i_512", "janus_pro_7b", "lumina_mgpt_768", "emu3_gen"],
)
def test_missing_weights_fail_before_the_model_is_built(tmp_path, overrides, expected):
    empty = tmp_path / "empty"
    empty.mkdir()
    overrides = [o.replace("__EMPTY__", str(empty)) for o in overrides] + ["model.device=cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CONFIGS), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["error"] is not None, "constructed a real model without its weights"
    for part in expected:
        assert part in result["error"], (part, result["error"])
    assert result["growth_mb"] < PEAK_GROWTH_LIMIT_MB, result
