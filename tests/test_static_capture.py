"""Capture is safe by construction: every tensor a static step reads or writes outside itself keeps its storage
across the iterations of a batch and across batches of one size (``coolsd.static.capture.StorageLedger``), the
condition under which one CUDA graph or compiled function serves every call. Shown for the four step kinds (AR,
an EAGLE chain, a static tree, a Jacobi window) on the tiny LlamaGen, and shown to fail on a planted allocation.
"""
from __future__ import annotations

import pytest
import torch

from baselines.jacobi import JacobiDrafter
from coolsd.acceptance import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.kv_cache import DeviceKVCache
from coolsd.static.capture import Runner, StorageLedger, stable_storage
from tests.helpers import tiny_llamagen


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(dtype="float32")


def decoder_of(model, kind: str) -> Decoder:
    eagle = EagleDrafter(model, head=EagleHead(model, init_seed=1))
    if kind == "ar":
        return Decoder("ar", model, ExactRule(), path="static")
    if kind == "chain":
        return Decoder("sd", model, ExactRule(), draft_len=3, drafter=eagle, path="static")
    if kind == "tree":
        return Decoder("sd_tree", model, ExactRule(), drafter=eagle, path="static", tree="mc_sim_7b_63")
    return Decoder("sjd", model, ExactRule(), draft_len=5, path="static",
                   drafter=JacobiDrafter(model, init="random"))


def ledger_of(monkeypatch, decoder: Decoder, batches: list[tuple[list[str], list[int]]]) -> list:
    """The storages of every step call after the first (which builds the step's lazy constants) over ``batches``
    of one size."""
    ledger = StorageLedger()
    call = Runner.__call__

    def recorded(self):
        if self.calls == 0:  # the first call fills the constants a step reads; capture starts after it
            return call(self)
        with ledger.call():
            return call(self)

    monkeypatch.setattr(Runner, "__call__", recorded)
    for prompts, seeds in batches:
        decoder.generate_batch(prompts, seeds)
    return ledger.calls


BATCHES = [(["one", "two"], [0, 1]), (["three", "four"], [2, 3])]


@pytest.mark.parametrize("kind", ["ar", "chain", "tree", "jacobi_window"])
def test_static_steps_keep_every_storage_across_iterations_and_batches(model, monkeypatch, kind):
    decoder = decoder_of(model, kind)
    assert decoder.static.step_name == kind
    calls = ledger_of(monkeypatch, decoder, BATCHES)
    assert len(calls) > 10
    read, written = calls[0]
    assert read and written  # parameters and the workspace are read, the workspace and the cache written
    assert stable_storage(calls) is None, stable_storage(calls)


def test_the_check_fails_on_a_planted_allocation(model, monkeypatch):
    """A cache whose ``keep`` rebinds its lengths to a new tensor (the tokens are still right eagerly, but a replayed
    graph would read the old lengths) is caught."""
    keep = DeviceKVCache.keep

    def rebinding(self, counts, index=None):
        keep(self, counts, index)
        self.lengths = self.lengths.clone()  # the planted allocation

    monkeypatch.setattr(DeviceKVCache, "keep", rebinding)
    calls = ledger_of(monkeypatch, decoder_of(model, "chain"), BATCHES[:1])
    problem = stable_storage(calls)
    assert problem is not None and "made anew" in problem


def test_the_ledger_tells_intermediates_from_outside_tensors():
    outside, ledger = torch.zeros(4), StorageLedger()
    with ledger.call():
        inner = outside + 1  # read outside, made inner
        inner.mul_(2)  # writes inner only
        outside.add_(inner)  # reads inner, writes outside
    read, written = ledger.calls[0]
    assert read == {outside.untyped_storage().data_ptr()}
    assert written == {outside.untyped_storage().data_ptr()}


@pytest.mark.parametrize("kernel", ["math", "matmul"])
def test_compiled_attention_is_one_library_call_with_the_eager_bits(kernel):
    """Inside ``torch.compile`` the attention of a static step runs as one opaque op (``library_attention``) with
    the eager kernel of ``model.attention_kernel``, so a compiled step's tokens stay the eager ones bit for bit."""
    import torch._dynamo

    from coolsd.kv_cache import padding_invariant_attention
    from coolsd.models.base import attend, attention_context

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1, 16, generator=gen), torch.randn(2, 4, 40, 16, generator=gen),
               torch.randn(2, 4, 40, 16, generator=gen))
    mask = torch.where(torch.arange(40) < 23, 0.0, float("-inf")).expand(2, 1, 1, 40).contiguous()
    calls = []

    def step(q, k, v, mask):
        return attend(q, k, v, mask, False, (1, 16))

    def backend(gm, example_inputs):
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    with attention_context(kernel), padding_invariant_attention(True):
        eager = step(q, k, v, mask)
        compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)(q, k, v, mask)
        inductor = torch.compile(step, fullgraph=True, dynamic=False)(q, k, v, mask)
    assert any("coolsd.attention" in c for c in calls) and not any("matmul" in c or "scaled_dot" in c for c in calls)
    assert torch.equal(compiled, eager) and torch.equal(inductor, eager)
