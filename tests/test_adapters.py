"""The adapter contract (``coolsd.models.base.ImageARModel``; ``docs/extending.md``, "A model adapter"), checked for
every adapter on its tiny instance. An adapter joins by adding one line to ``ADAPTERS``: its tiny config, the
overrides that point that config at published weights which are not here, and the name of its published instance
in ``tests/test_real_size_layouts.py`` (``PUBLISHED``). Its parity with the reference implementation stays in its
own test file.

* Runtime options: no adapter's ``__init__`` takes one except through ``runtime`` (``Runtime``); the YAML keys
  still set them, a bad value names the key and what is allowed, a misspelt key fails.
* An image is the same alone and in a batch of three other-prompt images, under AR and under speculative
  decoding with an EAGLE drafter (float64, so the check is the adapter's masking and stream layout, not the
  CPU kernels' batch invariance: ``tests/test_batched.py`` measures that).
* ``prefill``, ``forward_block`` (a causal and a tree block), ``probs``, ``embed``, ``head``, ``codebook``,
  ``decode_images`` and ``teacher_force`` give the documented shapes.
* Published weights that are not here: one ``MissingWeightsError`` names each file ``required_files`` declares,
  where it was looked for and the command that fetches it (offline, an empty Hugging Face cache).
* The published size builds through the adapter on the meta device (``model.device=meta``, nothing allocated)
  with the published layout, which loads strictly; a renamed or reshaped key is refused.
* Adapters with ``static_path``: the static path gives the eager path's tokens and statistics, its steps read
  nothing from the host (AR) or once per iteration (a chain), and a chain's step compiles with
  ``fullgraph=True`` without recompiling (the tiny LlamaGen in the default suite, the others in ``-m slow``).
* Every decoder of the default run goes through ``run.py`` on the tiny instance (the T2I one in the default suite,
  the others in ``-m slow``; the embedded model's default run: ``tests/test_embedded.py``).

About 55 s on 2 CPU cores, 20 s of it the ``run.py`` run and 7-20 s the compiled chain step (the tests it took
over from the model files took about 40 s of it).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.models.base import RUNTIME_KEYS, ImageARModel, Runtime
from coolsd.models.checkpoints import MissingWeightsError, strict_load
from tests.helpers import CONFIGS, default_run_decoders
from tests.test_real_size_layouts import PUBLISHED, assert_layout, broken, meta_state
from tests.test_static_path import guarded_decode, same_generation

ROOT = CONFIGS.parent
#: weights files of this checkpoint name in an empty folder: ``{empty}`` in ``Adapter.weights``
LLAMAGEN_CHECKPOINTS = ("model.gpt_checkpoint={empty}/target.safetensors", "model.vq_checkpoint={empty}/vq.safetensors")


@dataclass(frozen=True)
class Adapter:
    """One adapter's tiny instance: ``configs/model/<config>.yaml``; ``weights``: overrides that make it read
    published weights (``{empty}``: an empty folder); ``published``: its published instance (``PUBLISHED``)."""

    config: str
    weights: tuple[str, ...]
    published: str

    def __str__(self) -> str:
        return self.config


ADAPTERS = [
    Adapter("embedded", LLAMAGEN_CHECKPOINTS, published="embedded"),
    Adapter("tiny", LLAMAGEN_CHECKPOINTS, published="embedded"),  # LlamaGen too: the embedded model is its published one
    Adapter("llamagen_t2i_tiny", ("model.pretrained=true", "model.weights_dir={empty}"), published="llamagen_t2i_256"),
    Adapter("janus_tiny", ("model.pretrained=true", "model.arch=null", "+model.repo_id=deepseek-community/Janus-Pro-1B"),
            published="janus_pro_1b"),
    Adapter("lumina_tiny", ("model.pretrained=true", "+model.tokenizer_dir={empty}"), published="lumina_mgpt_768"),
    Adapter("anole_tiny", ("model.pretrained=true",), published="anole_7b"),
    Adapter("emu3_tiny", ("model.pretrained=true", "model.arch=null", "+model.repo_id=BAAI/Emu3-Gen-hf"),
            published="emu3_gen"),
    Adapter("glm_image_tiny", ("model.pretrained=true", "model.arch=null", "+model.repo_id=zai-org/GLM-Image"),
            published="glm_image"),
]
PROMPTS = {"embedded": ["bag", "dress", "sneaker"], "tiny": ["three", "seven", "zero"]}
TEXT_PROMPTS = ["a red cat", "a blue dog on a table", "a tree"]


def compose_model(config: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=[f"model={config}", *overrides]).model


def adapter_class(adapter: Adapter) -> type[ImageARModel]:
    return get_class(OmegaConf.load(CONFIGS / "model" / f"{adapter.config}.yaml")._target_)


def prompts_of(adapter: Adapter) -> list[str]:
    return PROMPTS.get(adapter.config, TEXT_PROMPTS)


@pytest.fixture(scope="module")
def tiny():
    """``tiny(adapter, dtype)``: the adapter's tiny instance on the CPU (float64 unless asked), built once."""
    built: dict[tuple[str, str], ImageARModel] = {}

    def get(adapter: Adapter, dtype: str = "float64") -> ImageARModel:
        if (adapter.config, dtype) not in built:
            cfg = compose_model(adapter.config, "model.device=cpu", f"model.dtype={dtype}")
            built[adapter.config, dtype] = instantiate(cfg)
        return built[adapter.config, dtype]

    return get


def eagle(model: ImageARModel) -> EagleDrafter:
    return EagleDrafter(model, head=EagleHead(model, init_seed=1))


# -- runtime options ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_runtime_options_come_through_one_runtime_and_the_yaml_sets_them(adapter, tiny):
    """``__init__`` takes no runtime option but ``runtime``; the class's defaults are a ``Runtime``; the model YAML's
    top-level keys (and ``model.<key>=`` on a command line) are the ``Runtime`` the adapter runs with."""
    cls = adapter_class(adapter)
    parameters = inspect.signature(cls.__init__).parameters
    assert "runtime" in parameters and not set(parameters) & set(RUNTIME_KEYS), cls
    assert isinstance(cls.runtime_defaults, Runtime)
    yaml = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{adapter.config}.yaml"))
    expected = cls.runtime_defaults.replace(**{k: yaml[k] for k in RUNTIME_KEYS if k in yaml})
    assert tiny(adapter).runtime == expected.replace(device="cpu", dtype="float64")


def test_a_runtime_value_names_the_key_and_a_misspelt_key_fails():
    from coolsd.models.llamagen import LlamaGen

    for key, value, match in (("device", "gpu", "model.device must be auto, cpu"),
                              ("dtype", "fp32", r"model.dtype must be one of \['auto', 'float32'"),
                              ("attention_kernel", "flash", "model.attention_kernel must be one of"),
                              ("pixel_rounding", "round", "model.pixel_rounding must be one of"),
                              ("tf32", "yes", "model.tf32 must be true or false"),
                              ("batch_invariant", 1, "model.batch_invariant must be true or false"),
                              ("row_block", 3, r"model.row_block must be one of \[1, 2, 4, 8, 16\]"),
                              ("compile", "no", "model.compile must be true or false")):
        with pytest.raises((ValueError, TypeError), match=match):
            LlamaGen(gpt={}, vq={}, sampling={}, **{key: value})  # refused before anything is built
    with pytest.raises(TypeError, match="devcie"):
        LlamaGen(gpt={}, vq={}, sampling={}, devcie="cpu")
    with pytest.raises(TypeError, match="model.devcie is not a runtime option"):
        LlamaGen(gpt={}, vq={}, sampling={}, runtime={"devcie": "cpu"})


def test_a_runtime_in_python_equals_the_keyword_options():
    """An adapter built in plain Python: keyword options change its own defaults, as does a mapping; a ``Runtime``
    is taken as given, the keyword options on top."""
    from tests.helpers import tiny_llamagen

    plain = tiny_llamagen()
    assert plain.runtime == Runtime(device="cpu", dtype="float32", attention_kernel="math", tf32=True,
                                    pixel_rounding="half_up")
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))
    own = {k: v for k, v in cfg.items() if k not in (*RUNTIME_KEYS, "_target_", "defaults")}
    cls = type(plain)
    assert cls(**own, device="cpu").runtime == cls.runtime_defaults.replace(device="cpu")
    assert cls(**own, runtime={"device": "cpu"}).runtime == cls.runtime_defaults.replace(device="cpu")
    given = Runtime(device="cpu", row_block=4)
    assert cls(**own, runtime=given, dtype="float64").runtime == given.replace(dtype="float64")


# -- what every adapter promises ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ar", "sd"])
@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_an_image_is_the_same_alone_and_in_a_batch(adapter, kind, tiny):
    model = tiny(adapter)
    decoder = (Decoder("ar", model, ExactRule()) if kind == "ar" else
               Decoder("sd", model, ExactRule(), draft_len=3, drafter=eagle(model)))
    prompts, seeds = prompts_of(adapter), [3, 4, 5]
    batch = decoder.generate_batch(prompts, seeds)
    for prompt, seed, image in zip(prompts, seeds, batch):
        alone = decoder.generate(prompt, seed)
        assert image.tokens.shape == (model.num_image_tokens,)
        assert torch.equal(alone.tokens, image.tokens), (prompt, seed)
        assert alone.stats.accepted_hist == image.stats.accepted_hist


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@torch.inference_mode()  # as the decoders call them
def test_prefill_forward_and_decode_shapes(adapter, tiny):
    model = tiny(adapter)
    prompts = prompts_of(adapter)[:2]
    s, b, v, h, n = model.num_streams, len(prompts), model.codebook_size, model.hidden_size, model.num_image_tokens
    cache, first = model.prefill(prompts, extra_slots=8)
    assert first.logits.shape == (s, b, 1, v) and first.hidden.shape == (s, b, 1, h)
    p = model.probs(first)
    assert p.shape == (b, 1, v) and torch.allclose(p.sum(-1), torch.ones_like(p[..., 0]))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(v, (b, 3), generator=gen)
    block = model.forward_block(cache, tokens, torch.arange(3).expand(b, -1))
    assert block.logits.shape == (s, b, 3, v) and block.hidden.shape == (s, b, 3, h)
    assert torch.isfinite(block.logits).all()
    cache.keep(3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    nodes = model.forward_block(cache, tokens, torch.tensor([3, 4, 4]).expand(b, -1), tree)
    assert nodes.logits.shape == (s, b, 3, v)
    torch.testing.assert_close(model.head(nodes.hidden), nodes.logits)
    assert model.embed(tokens[0]).shape == (3, h)
    assert model.codebook().dim() == 2 and model.codebook().shape[0] == v
    images = model.decode_images(torch.randint(v, (b, n), generator=gen))
    assert images.dtype == torch.uint8 and images.dim() == 4 and images.shape[:2] in ((b, 1), (b, 3))
    assert model.decode_image(torch.zeros(n, dtype=torch.long)).shape == images.shape[1:]
    assert model.teacher_force(prompts, torch.randint(v, (b, n), generator=gen)).shape == (b, s, n + 1, h)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_missing_weights_name_each_file_where_it_was_looked_for_and_the_fetch_command(adapter, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = compose_model(adapter.config, "model.device=cpu", *(o.replace("{empty}", str(empty)) for o in adapter.weights))
    required = adapter_class(adapter).required_files(OmegaConf.to_container(cfg, resolve=True))
    assert required, "the weights overrides must make the adapter read files"
    with pytest.raises(Exception) as raised:
        instantiate(cfg)
    err = raised.value if isinstance(raised.value, MissingWeightsError) else raised.value.__cause__
    assert isinstance(err, MissingWeightsError), raised.value
    message = str(err)
    assert "looked in" in message
    for f in required:
        assert (f.filename or f.repo_id or f.local) in message, (f, message)
        assert (f"hf download {f.repo_id}" if f.on_hub else f.manual) in message, (f, message)


@pytest.mark.parametrize("name", sorted({a.published for a in ADAPTERS}))
def test_the_published_size_builds_on_the_meta_device_and_loads_strictly(name):
    """The adapter at its published size (``tests/test_real_size_layouts.py``), built through its constructor with
    ``model.device=meta``: every weight on the meta device, the published grid and codebook, and each submodule's
    layout exactly the published checkpoint's, which loads strictly; a renamed or reshaped key is refused."""
    published = PUBLISHED[name]()
    model = published.model
    assert all(type(model) is adapter_class(a) for a in ADAPTERS if a.published == name)
    assert model.runtime.device == "meta" and all(t.device.type == "meta" for t in model.parameters())
    assert (model.grid, model.codebook_size) == (published.grid, published.codebook_size)
    for path, shapes in published.layouts.items():
        module = model.get_submodule(path)
        assert_layout(module, shapes)
        strict_load(module, meta_state(shapes), name)
        for corrupt in broken(shapes):
            with pytest.raises(ValueError, match="does not match"):
                strict_load(module, meta_state(corrupt), "corrupt")


# -- the static path ---------------------------------------------------------------------------------------------
STATIC = [a for a in ADAPTERS if adapter_class(a).static_forward is not ImageARModel.static_forward]


def test_the_static_path_adapters_include_llamagen_and_janus():
    assert {"embedded", "tiny", "llamagen_t2i_tiny", "janus_tiny"} <= {a.config for a in STATIC}


# the embedded model's static path is held to its eager one decoder by decoder in tests/test_static_path.py
STATIC_TINY = [a for a in STATIC if a.config != "embedded"]


@pytest.mark.parametrize("adapter", STATIC_TINY, ids=str)
def test_static_path_gives_the_eager_tokens_and_statistics(adapter, tiny):
    model = tiny(adapter)
    prompts, seeds = prompts_of(adapter), [0, 1, 2]
    for make in (lambda path: Decoder("ar", model, ExactRule(), path=path),
                 lambda path: Decoder("sd", model, ExactRule(), draft_len=3, path=path, drafter=eagle(model)),
                 lambda path: Decoder("sd", model, ExactRule(), path=path, tree="mc_sim_7b_63", drafter=eagle(model))):
        eager, static = make("eager"), make("static")
        for a, b in zip(eager.generate_batch(prompts, seeds), static.generate_batch(prompts, seeds)):
            assert same_generation(a, b), (static.name, static.static.step_name)


@pytest.mark.parametrize("adapter", STATIC_TINY, ids=str)
def test_sync_guard_static_steps_read_nothing_or_once_per_iteration(adapter, tiny, monkeypatch):
    """AR's steps read nothing from the host; a chain and a Jacobi window once per iteration (whether every image
    has finished), after the first batch of a size has built its constants."""
    model = tiny(adapter)
    prompts = prompts_of(adapter)[:2]
    for decoder in (Decoder("ar", model, ExactRule(), path="static"),
                    Decoder("sd", model, ExactRule(), draft_len=3, path="static", drafter=eagle(model)),
                    Decoder("sjd", model, ExactRule(), draft_len=5, path="static",
                            drafter=JacobiDrafter(model, init="random", carry="maximal"))):
        decoder.generate_batch(prompts, [0, 1])
        guard, calls = guarded_decode(monkeypatch, decoder, prompts, [2, 3])
        monkeypatch.undo()
        assert guard.total == 0 if decoder.plain_ar else guard.total <= calls, guard.where[:3]
        assert set(guard.reads) <= {"__bool__"}


@pytest.mark.slow  # moved from the default pass to keep it under 10 minutes on 2 cores (CI runs -m slow)
@pytest.mark.parametrize("adapter", STATIC, ids=str)
def test_static_chain_step_compiles_whole_without_recompiling(adapter, tiny):
    """The chain's step compiles with ``fullgraph=True, dynamic=False`` (a graph break raises) and is not recompiled
    across the positions of an image, the accept outcomes of its iterations, or for a second batch of the same size
    (dynamo's ``error_on_recompile``); every image is complete. The other steps: ``tests/test_static_path.py``."""
    import torch._dynamo

    torch._dynamo.reset()
    model = instantiate(compose_model(adapter.config, "model.device=cpu", "model.dtype=float32"))
    model.compile = True  # model.compile=true: the static step is compiled whole on a CPU
    decoder = Decoder("chain", model, ExactRule(), draft_len=3, path="static", drafter=eagle(model))
    assert decoder.static.mode == "compiled" and decoder.static.step_name == "chain"
    prompts = prompts_of(adapter)[:2]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seeds in ([0, 1], [2, 3]):
            images = decoder.generate_batch(prompts, seeds)
            assert all(int(g.tokens.min()) >= 0 and int(g.tokens.max()) < model.codebook_size for g in images)
            assert all(sum(g.stats.accepted_hist) == g.stats.iterations for g in images)
    assert decoder.static._workspaces[2][1].calls > 2


# -- every decoder through run.py --------------------------------------------------------------------------------
@pytest.mark.slow  # every adapter's run.py end to end (the embedded one in tests/test_embedded.py, by default)
@pytest.mark.parametrize("adapter", [a for a in ADAPTERS if a.config != "embedded"], ids=str)
def test_every_decoder_runs_through_run_py(adapter, tiny, tmp_path):
    """(The embedded model's: ``tests/test_embedded.py``, the default run on two prompts, its FID needing two.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    args = [f"model={adapter.config}", "logger=none", "compare=all", "eval.num_prompts=1", "eval.warmup=0",
            "eval.threads=1", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "run.py", *args], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert set(record["per_decoder"]) == default_run_decoders()
    assert record["per_decoder"]["ar"]["target_forwards_per_image"] == tiny(adapter).num_image_tokens
    for name, metrics in record["per_decoder"].items():
        assert metrics["mean_accepted_length"] >= 1.0, name
        assert len(list((tmp_path / "images" / name).glob("*.png"))) == 1, name
