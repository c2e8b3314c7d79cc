"""ZipAR (its fixed and adaptive windows), PJD and the SV verifiers on the static decode path
(``coolsd/static/orders.py``: the ``row_window``, ``row_adaptive`` and ``row_jacobi`` steps; ``baselines/sv.py``:
SJD-SV's subsequence test inside the ``jacobi_window`` step): the eager path's tokens and statistics on the tiny
models, no host read inside a step, whole-step compilation without recompiles, and the refusal of VVS.

Each case decodes the same prompts and seeds on both paths in float32: a batch of 3, a second batch of 3 through
the same static workspace (its state restarted in place), and a batch of 1. Where the machine's kernels are not
batch-invariant (``invariance_property``) float32 rounding may flip a rare token: at most one image of seven may
then differ.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from coolsd.decoding import Decoder
from coolsd.static.capture import Runner, StorageLedger, stable_storage
from coolsd.static.loop import static_refusal
from tests.helpers import CONFIGS, invariance_property
from tests.test_static_path import guarded_decode

#: per model: the suite decoders' overrides that make ZipAR and PJD more than AR on its small grid (None: the
#: model's own defaults)
ORDERS = {"embedded": None,
          "tiny": {"zipar": {"window": 3}, "zipar_adaptive": {"window": 3}, "pjd": {"context": 3, "draft_window": 4}},
          "janus_tiny": {"zipar": {"window": 3, "stand_in": "reference"}, "zipar_adaptive": {"window": 3},
                         "pjd": {"context": 2, "draft_window": 8}},
          "llamagen_t2i_tiny": {"zipar": {"window": 2, "first_row_ar": True}, "zipar_adaptive": {"window": 2},
                                "pjd": {"context": 1, "draft_window": 3}},
          "lumina_tiny": {"zipar": {"window": 2}, "zipar_adaptive": {"window": 2},
                          "pjd": {"context": 2, "draft_window": 3}},
          "emu3_tiny": {"zipar": {"window": 1}, "zipar_adaptive": {"window": 1},
                        "pjd": {"context": 1, "draft_window": 2}}}
DECODERS = ("sjd_sv", "gsd_sv", "lantern_sv", "zipar", "zipar_adaptive", "pjd")
#: the default pass: every decoder on the embedded model, ZipAR (both windows), PJD and SJD-SV on the tiny
#: LlamaGen and on Lumina-mGPT; the rest in the -m slow pass
QUICK = {("embedded", name) for name in DECODERS} | {(m, name) for m in ("tiny", "lumina_tiny")
                                                     for name in ("zipar", "zipar_adaptive", "pjd", "sjd_sv")}
CASES = [pytest.param(m, name, marks=() if (m, name) in QUICK else pytest.mark.slow)
         for m in ORDERS for name in DECODERS]
STEP_NAMES = {"zipar": "row_window", "zipar_adaptive": "row_adaptive", "pjd": "row_jacobi"}


def fresh(model_name: str):
    """The model (float32, on the CPU) and its config, composed as ``run.py`` composes them."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model_name}", "model.device=cpu",
                                                       "model.dtype=float32"])
    return instantiate(cfg.model), cfg


@functools.cache
def setup(model_name: str):
    """``fresh``, once per worker."""
    return fresh(model_name)


def build(model_name: str, name: str, path: str, model=None, cfg=None) -> Decoder:
    """A suite decoder on ``path`` (``lantern_sv``: LANTERN in the Jacobi loop with ``sv.enabled``), on the model
    of ``setup`` or on ``model``."""
    if model is None:
        model, cfg = setup(model_name)
    node = OmegaConf.to_container(cfg.suite["lantern_sjd" if name == "lantern_sv" else name], resolve=True)
    if name == "lantern_sv":
        node["sv"]["enabled"] = True
    if "order" in node:
        node["order"].update((ORDERS[model_name] or {}).get(name, {}))
    node["path"] = path
    return instantiate(node, model=model)


def prompts_of(model) -> list[str]:
    names = getattr(model, "class_names", None)
    return list(names[:3]) if names else ["a red cube", "two cats", "a boat"]


def same_generation(a, b) -> bool:
    """The same tokens and statistics (the summed TV up to float64 rounding)."""
    fields = ("iterations", "accepted_hist", "target_forwards", "drafter_forwards", "tv_steps", "tv_measured")
    return (torch.equal(a.tokens, b.tokens) and all(getattr(a.stats, f) == getattr(b.stats, f) for f in fields)
            and math.isclose(a.stats.tv_sum, b.stats.tv_sum, rel_tol=1e-12, abs_tol=1e-15))


@pytest.mark.parametrize(("model_name", "name"), CASES)
def test_static_orders_and_sv_give_the_eager_tokens_and_statistics(model_name, name):
    """ZipAR (fixed and adaptive windows), PJD, SJD-SV, GSD-SV and LANTERN-SV give the eager decoder's tokens and
    statistics on the static path, at batch 3 (twice through one workspace) and alone, on every tiny model (the SV
    rows' TV not measured on both)."""
    eager, static = build(model_name, name, "eager"), build(model_name, name, "static")
    assert static.static.step_name == STEP_NAMES.get(name, "jacobi_window")
    prompts = prompts_of(eager.model)
    pairs = []
    for batch, seeds in ((prompts, [1, 2, 3]), (prompts[::-1], [4, 5, 6]), (prompts[:1], [7])):
        pairs += list(zip(eager.generate_batch(batch, seeds), static.generate_batch(batch, seeds)))
    differ = [i for i, (a, b) in enumerate(pairs) if not same_generation(a, b)]
    if invariance_property(eager.model) == "bitwise":
        assert not differ, f"static != eager for images {differ}"
    else:
        assert len(differ) <= 1, f"static != eager for images {differ}"
    assert [b.stats.batch_size for _, b in pairs] == [3] * 6 + [1]
    if name in STEP_NAMES:  # a spatial order really decodes several rows at once here
        assert all(a.stats.iterations < eager.model.num_image_tokens - 1 for a, _ in pairs)
    else:
        assert not any(b.stats.tv_measured for _, b in pairs)


@pytest.mark.parametrize("model_name", ["embedded", "lumina_tiny"])
@pytest.mark.parametrize("name", ["zipar", "zipar_adaptive", "pjd", "sjd_sv"])
def test_static_order_and_sv_steps_read_nothing_and_iterations_at_most_once(monkeypatch, model_name, name):
    """No host read in all of ZipAR's steps, exactly its schedule's forwards; at most one per iteration of ZipAR's
    adaptive window, PJD and SJD-SV (whether every image has finished), at batch 1 and 3, after the first batch of a
    size built its state."""
    static = build(model_name, name, "static")
    prompts = prompts_of(static.model)
    for batch, seeds in ((prompts[:1], [0]), (prompts, [1, 2, 3])):
        static.generate_batch(batch, seeds)
        guard, calls = guarded_decode(monkeypatch, static, batch, [s + 10 for s in seeds])
        if name == "zipar":
            assert guard.total == 0, guard.where[:3]
            assert calls == static.static.order_step.calls == len(static.order.schedule())
        else:
            assert guard.total <= calls and set(guard.reads) <= {"__bool__"}, guard.where[:3]


@pytest.mark.parametrize("model_name", ["embedded", "lumina_tiny"])
@pytest.mark.parametrize("name", ["zipar", "zipar_adaptive", "pjd", "sjd_sv"])
def test_static_order_and_sv_steps_keep_every_storage_across_iterations_and_batches(monkeypatch, model_name, name):
    """Every step call after the first reads and writes the same storages outside it, over the iterations of two
    batches of one size (``coolsd.static.capture.stable_storage``): one CUDA graph serves every call."""
    static = build(model_name, name, "static")
    ledger, call = StorageLedger(), Runner.__call__

    def recorded(self):
        if self.calls == 0:  # the first call builds the step's state and constants; capture starts after it
            return call(self)
        with ledger.call():
            return call(self)

    monkeypatch.setattr(Runner, "__call__", recorded)
    prompts = prompts_of(static.model)[:2]
    for batch, seeds in ((prompts, [0, 1]), (prompts[::-1], [2, 3])):
        static.generate_batch(batch, seeds)
    assert len(ledger.calls) > 10
    assert stable_storage(ledger.calls) is None, stable_storage(ledger.calls)


def test_static_path_refuses_vvs_only():
    """VVS stays on the eager path, refused with the reason and the eager path; ZipAR's fixed and adaptive windows,
    PJD and the SV verifiers are accepted."""
    model, cfg = setup("embedded")
    node = OmegaConf.to_container(cfg.suite["vvs"], resolve=True)
    node.update(path="static", tree="dynamic")
    with pytest.raises(Exception, match=r"(?s)decoder.path=static.*skip verification.*decoder.path=eager"):
        instantiate(node, model=model)
    for name in DECODERS:
        assert static_refusal(build("embedded", name, "eager")) is None, name


# -- compiled whole on a CPU ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny", "lumina_tiny"])
@pytest.mark.parametrize("name", ["zipar", "zipar_adaptive", "pjd", "sjd_sv"])
def test_static_order_and_sv_steps_compile_whole_without_recompiling(model_name, name):
    """ZipAR's (both windows), PJD's and SJD-SV's steps compile with ``fullgraph=True, dynamic=False`` (``model.compile=true``; a
    graph break raises), are not recompiled across forwards, acceptances and a second batch of the same size
    (dynamo's ``error_on_recompile``), and give the eager path's tokens (the uncompiled model of ``setup``), on
    LlamaGen and on Lumina-mGPT (its end-of-row slots). 20 to 40 s each (``-m slow``)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, cfg = fresh(model_name)
    model.compile = True
    static, eager = build(model_name, name, "static", model, cfg), build(model_name, name, "eager")
    assert static.static.mode == "compiled" and static.static.step_name == STEP_NAMES.get(name, "jacobi_window")
    prompts = prompts_of(model)[:2]
    static.generate_batch(prompts, [0, 1])  # compiles (the step's second call)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch, seeds in ((prompts, [2, 3]), (prompts[::-1], [4, 5])):
            got, want = static.generate_batch(batch, seeds), eager.generate_batch(batch, seeds)
            assert all(torch.equal(g.tokens, w.tokens) for g, w in zip(got, want))
    assert static.static._workspaces[2][1].calls > 4
