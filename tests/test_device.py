"""No silent CPU fallback (``coolsd.device``): a real model config (``requires_cuda: true``) with its published
weights and ``device: auto`` stops on a machine without CUDA, with the torch build, the driver and CUDA's own
warning, before any weight is read; ``model.device=cpu`` runs it on purpose; the embedded and tiny models keep
``auto`` = the CPU here. CUDA's absence is forced with ``monkeypatch`` (also on a GPU machine). About 5 s."""
from __future__ import annotations

import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from coolsd.device import DeviceError, check_model_device, cuda_diagnosis, resolve_device
from tests.helpers import CONFIGS

pytestmark = pytest.mark.filterwarnings("ignore:CUDA initialization")  # the stand-in's warning, asserted below

REAL = ("janus_pro_1b", "janus_pro_7b", "llamagen_t2i_256", "llamagen_t2i_512", "llamagen_t2i_256_lantern",
        "llamagen_t2i_512_lantern", "lumina_mgpt_768", "anole_7b", "emu3_gen", "glm_image")
SMALL = ("embedded", "tiny", "janus_tiny", "llamagen_t2i_tiny", "lumina_tiny", "anole_tiny", "emu3_tiny", "glm_image_tiny",
         "lookup")
DRIVER_WARNING = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). "
                  "Please update your GPU driver")


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA unusable, as torch reports it when the driver does not fit the build (it warns and says False)."""
    def is_available() -> bool:
        warnings.warn(DRIVER_WARNING)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)


def model_cfg(name: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={name}", *overrides])
    return OmegaConf.to_container(cfg.model, resolve=True)


def test_auto_stops_for_a_model_that_needs_cuda_and_says_why(no_cuda):
    with pytest.raises(DeviceError) as err:
        resolve_device("auto", requires_cuda=True)
    message = str(err.value)
    assert f"torch {torch.__version__}" in message and ("built with CUDA" in message or "CPU-only build" in message)
    assert "NVIDIA driver" in message and "torch.cuda.is_available() = False" in message
    assert "driver on your system is too old" in message  # CUDA's own warning, kept
    assert "model.device=cpu" in message and "Nothing was loaded" in message
    assert resolve_device("auto") == torch.device("cpu")  # a model that does not need CUDA: as before
    assert resolve_device("cpu", requires_cuda=True) == torch.device("cpu")  # on purpose
    with pytest.raises(DeviceError, match="model.device=cuda but CUDA is not usable"):
        resolve_device("cuda")


def test_cuda_diagnosis_names_the_build():
    text = cuda_diagnosis()
    assert str(torch.version.cuda) in text or "CPU-only build" in text


@pytest.mark.parametrize("name", REAL)
def test_every_real_model_config_needs_cuda_unless_device_cpu_is_given(no_cuda, name):
    with pytest.raises(DeviceError, match="requires_cuda"):
        check_model_device(model_cfg(name))
    assert check_model_device(model_cfg(name, "model.device=cpu")) == torch.device("cpu")
    assert check_model_device(model_cfg(name, "model.pretrained=false")) == torch.device("cpu")  # random weights


@pytest.mark.parametrize("name", SMALL)
def test_the_embedded_and_tiny_models_keep_auto(no_cuda, name):
    assert check_model_device(model_cfg(name)) == torch.device("cpu")


def test_the_adapters_stop_before_reading_a_file(no_cuda, monkeypatch):
    """The constructors apply the rule first: no file is looked up (the lookups raise if reached)."""
    import coolsd.models.emu3 as emu3
    import coolsd.models.janus_pro as janus
    import coolsd.models.lumina_mgpt as lumina
    from coolsd.models.llamagen_t2i import LlamaGenT2I

    def reached(*args, **kwargs):
        raise AssertionError("a weights file was looked up")

    monkeypatch.setattr(janus, "load_pretrained", reached)
    monkeypatch.setattr(emu3, "load_pretrained", reached)
    monkeypatch.setattr(lumina, "chameleon_tokenizer_files", reached)
    monkeypatch.setattr(LlamaGenT2I, "_look_up", reached)
    for name, cls in (("janus_pro_7b", janus.JanusPro), ("lumina_mgpt_768", lumina.LuminaMGPT),
                      ("emu3_gen", emu3.Emu3Gen),
                      ("llamagen_t2i_512", LlamaGenT2I)):
        cfg = model_cfg(name)
        cfg.pop("_target_")
        with pytest.raises(DeviceError, match="requires_cuda"):
            cls(**cfg)


@pytest.mark.parametrize("name", ["janus_pro_1b", "emu3_gen"])
def test_run_stops_on_the_device_before_the_model_and_names_the_missing_files(no_cuda, tmp_path, monkeypatch,
                                                                               name):
    """``run.py model=janus_pro_1b`` (or emu3_gen) without CUDA and without weights: the device error, with the
    missing files and their fetch commands appended, and no build."""
    import importlib

    from eval.run.experiment import run_experiment

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={name}", "decoder=ar", "logger=none",
                                                        "eval.num_prompts=1", "eval.warmup=0"])
    module, cls = cfg.model._target_.rsplit(".", 1)
    monkeypatch.setattr(getattr(importlib.import_module(module), cls), "__init__",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DeviceError, match="(?s)model.device=auto found no usable CUDA device.*On top of that, "
                                          r"\d file\(s\) this run needs are missing.*hf download"):
        run_experiment(cfg, output_dir=tmp_path / "run", decoder_overridden=True)