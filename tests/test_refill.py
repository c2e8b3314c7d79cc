"""Refilling finished rows on the static path (``decoder.refill``, ``coolsd.static.StaticLoop.generate_stream``): a
queue of prompts through fewer rows gives every image its lock-step tokens and statistics in fewer step calls; AR
runs lock-step batches; the option's errors; the harness's bookkeeping of a refilled queue; and the study
``eval.bench.refill`` end to end on a tiny setting.

The equalities are those of ``tests/test_static_path.py``'s static-vs-eager test and under its setting: the
embedded model in float32, uncompiled, where a forward's bits do not depend on its batch neighbours
(``invariance_property``: bitwise where the start-up self-check passes, else at most one image of the queue may
differ). The summed TV of a relaxed rule is compared to 1e-5 relative: its diagnostic (``summed_tv``) is not
batch-invariant even in lock-step (an image alone and in a batch differ there in the sixth digit).
"""
from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from baselines.exact import ExactRule
from baselines.jacobi import JacobiDrafter
from coolsd.decoding import Decoder
from coolsd.drafters.base import Drafter
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.kv_cache import DeviceKVCache
from coolsd.rng import SAMPLE, Streams
from tests.helpers import CONFIGS, invariance_property
from tests.test_static_path import build, embedded  # noqa: F401  (embedded: the module's fixture)

PROMPTS = ["dress", "bag", "sneaker", "coat", "bag", "dress", "coat"]
SEEDS = [20, 21, 22, 23, 24, 25, 26]
WIDTH = 3
#: a chain, a chain with a relaxed rule, a static tree, a Jacobi window
DECODERS = ("sd", "lantern", "sd_static_tree", "sjd")


def lock_step(decoder: Decoder, prompts, seeds, width: int) -> list:
    gens = []
    for s0 in range(0, len(prompts), width):
        gens += decoder.generate_batch(prompts[s0:s0 + width], seeds[s0:s0 + width])
    return gens


def assert_refill_equals_lock_step(decoder: Decoder, prompts, seeds, width: int, between=None):
    """``prompts`` through ``width`` rows refilled as each image finishes give their lock-step images (at most one
    differing where the machine's linears are not batch-invariant); ``between()`` is called after the lock-step
    batches, before the refilled queue, and its value returned."""
    lock = lock_step(decoder, prompts, seeds, width)
    value = between() if between is not None else None
    stream = decoder.static.generate_stream(prompts, seeds, list(range(len(prompts))), width)
    differ = [i for i, (a, b) in enumerate(zip(lock, stream)) if not same_image(a, b)]
    assert not differ if invariance_property(decoder.model) == "bitwise" else len(differ) <= 1, differ
    return value


def same_image(a, b) -> bool:
    """The same tokens and statistics (the TV to 1e-5 relative, module doc)."""
    fields = ("iterations", "accepted_hist", "target_forwards", "drafter_forwards", "tv_steps", "num_tokens")
    return (torch.equal(a.tokens, b.tokens) and all(getattr(a.stats, f) == getattr(b.stats, f) for f in fields)
            and math.isclose(a.stats.tv_sum, b.stats.tv_sum, rel_tol=1e-5, abs_tol=1e-12))


def runner_calls(decoder: Decoder) -> int:
    return sum(runner.calls for _, runner in decoder.static._workspaces.values())


@pytest.fixture(scope="module")
def decoded(embedded):  # noqa: F811
    """name -> (lock-step images, refilled images, lock-step step calls, refilled step calls), decoded once."""
    model, cfg = embedded
    done: dict = {}

    def get(name: str):
        if name not in done:
            decoder = build(cfg, model, name, "static")
            decoder.generate_batch(PROMPTS[:WIDTH], [0, 1, 2])  # builds the width's workspace and constants
            before = runner_calls(decoder)
            lock = lock_step(decoder, PROMPTS, SEEDS, WIDTH)
            middle = runner_calls(decoder)
            stream = decoder.static.generate_stream(PROMPTS, SEEDS, list(range(len(PROMPTS))), WIDTH)
            done[name] = (lock, stream, middle - before, runner_calls(decoder) - middle, decoder)
        return done[name]

    return get


@pytest.mark.parametrize("name", DECODERS)
def test_refilled_images_equal_their_lock_step_images(embedded, decoded, name):  # noqa: F811
    """7 prompts through 3 rows, each row refilled as its image finishes: every image has its lock-step tokens,
    iteration count, accepted histogram, forwards and TV; statistics stay per image (the width as batch size, a
    latency of its own no longer than the queue's wall time)."""
    model, _ = embedded
    lock, stream, _, _, decoder = decoded(name)
    assert len(stream) == len(PROMPTS)
    differ = [i for i, (a, b) in enumerate(zip(lock, stream)) if not same_image(a, b)]
    if invariance_property(model) == "bitwise":
        assert not differ, f"refilled != lock-step for images {differ}"
    else:
        assert len(differ) <= 1, f"refilled != lock-step for images {differ}"
    assert all(g.stats.batch_size == WIDTH for g in stream)
    assert all(0 < g.stats.prefill_s < g.stats.latency_s <= decoder.static.stream_s + 1e-9 for g in stream)
    assert len({g.stats.latency_s for g in stream}) > 1  # each image its own latency


def test_refilling_takes_fewer_step_calls_than_lock_step(decoded):
    """Images finishing at different iterations: lock-step runs each batch to its slowest image; refilling ends
    after fewer step calls (each row's idle iterations go to the next image). The calls are exactly what the
    iteration counts imply for lock-step (the max of each chunk)."""
    lock, stream, lock_calls, stream_calls, _ = decoded("sd")
    iterations = [g.stats.iterations for g in lock]
    assert len(set(iterations)) > 1  # the images finish at different times
    assert lock_calls == sum(max(iterations[s0:s0 + WIDTH]) for s0 in range(0, len(lock), WIDTH))
    assert max(iterations) <= stream_calls < lock_calls
    assert stream_calls >= -(-sum(iterations) // WIDTH)  # no more rows than the width


def test_ar_through_generate_stream_is_lock_step(embedded):  # noqa: F811
    """Plain AR needs no refilling: its queue runs lock-step batches of the width, with lock-step's images and
    step calls (N − 1 per batch); a list no longer than the width is one batch for every decoder."""
    model, cfg = embedded
    decoder = build(cfg, model, "ar", "static")
    lock = lock_step(decoder, PROMPTS[:5], SEEDS[:5], WIDTH)
    before = runner_calls(decoder)
    stream = decoder.static.generate_stream(PROMPTS[:5], SEEDS[:5], list(range(5)), WIDTH)
    assert runner_calls(decoder) - before == 2 * (model.num_image_tokens - 1)
    assert all(same_image(a, b) for a, b in zip(lock, stream))
    assert [g.stats.batch_size for g in stream] == [3, 3, 3, 2, 2]


def test_refill_option_errors(embedded):  # noqa: F811
    """``decoder.refill``: not a boolean, with the eager path, or with a drafter that cannot restart chosen rows:
    each error names what to set."""
    model, _ = embedded
    with pytest.raises(TypeError, match=r"decoder.refill must be true or false"):
        Decoder("ar", model, ExactRule(), path="static", refill="yes")
    with pytest.raises(ValueError, match=r"decoder.refill=true needs decoder.path=static.*decoder.refill=false"):
        Decoder("ar", model, ExactRule(), path="eager", refill=True)

    class Unrestartable(JacobiDrafter):
        static_refill = Drafter.static_refill

    with pytest.raises(ValueError, match=r"cannot restart chosen rows.*decoder.refill=false"):
        Decoder("sjd", model, ExactRule(), draft_len=3, drafter=Unrestartable(model, init="random"), path="static",
                refill=True)
    with pytest.raises(NotImplementedError, match="static_refill"):
        Unrestartable(model).static_refill(torch.tensor([0]), None, torch.tensor([0]), None, 3)
    assert Decoder("ar", model, ExactRule(), path="static", refill=True).refill


def test_refill_option_composes_and_runs_through_generate_stream(embedded):  # noqa: F811
    """``decoder.refill=true`` composed from the YAMLs (every decoder config has the key) makes
    ``Decoder.generate_stream`` refill; a wrong composition (refill on the eager path) fails when instantiated."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    model, _ = embedded
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.device=cpu", "decoder=sjd", "decoder.path=static",
                                                       "decoder.refill=true"])
        eager = compose(config_name="config", overrides=["decoder=sjd", "decoder.refill=true"])
    decoder = instantiate(cfg.decoder, model=model)
    assert decoder.refill and decoder.static is not None
    gens = decoder.generate_stream(PROMPTS[:4], SEEDS[:4], width=2)
    assert len(gens) == 4 and decoder.stream_s == decoder.static.stream_s > 0
    with pytest.raises(InstantiationException, match="decoder.refill=true needs decoder.path=static"):
        instantiate(eager.decoder, model=model)


def test_row_wise_resets_leave_the_other_rows_alone():
    """``Streams.reseed_rows`` gives a row a fresh stream's draws; ``DeviceKVCache.load_rows`` copies every CFG
    stream's rows of an image (image ``i`` owns cache rows ``i·S .. i·S + S − 1``) and its length, nothing else."""
    streams = Streams.persistent_for(3, "cpu")
    streams.reseed([1, 2, 3])
    streams.reseed_rows(torch.tensor([2, 0]), [9, 7])
    t = torch.tensor([4, 4, 4])
    for row, seed in ((0, 7), (1, 2), (2, 9)):
        assert torch.equal(streams.uniform(t, SAMPLE, 3)[row], Streams([seed], "cpu").uniform(t[:1], SAMPLE, 3)[0])

    from coolsd.kv_cache import StaticKVCache

    def cache(batch: int, fill: float, lengths: list[int]) -> StaticKVCache:
        c = StaticKVCache(num_layers=2, batch=batch, num_heads=1, max_len=6, head_dim=2, dtype=torch.float32,
                          device="cpu", streams=2)
        c.k.fill_(fill)
        c.v.fill_(-fill)
        c.lengths = lengths
        return c

    device = DeviceKVCache.of(cache(3, 1.0, [2, 2, 2]))
    device.load_rows(torch.tensor([2]), cache(1, 5.0, [3]))
    assert device.lengths.tolist() == [2, 2, 3]
    assert (device.keys[1][4:, :, :3] == 5).all() and (device.values[0][4:, :, :3] == -5).all()
    assert (device.keys[0][:4, :, :2] == 1).all() and (device.keys[0][4:, :, 3:] == 0).all()
    with pytest.raises(ValueError, match="load_rows"):
        device.load_rows(torch.tensor([0, 1]), cache(1, 5.0, [3]))


def test_prefix_all_drafter_and_padded_captions_refill_as_lock_step():
    """A text-to-image model whose captions are padded (masked prefix slots) and an EAGLE drafter fed the whole
    prefix (``prefix: all``: the refilled rows' prefix pairs go through a drafter cache of their own and are copied
    in): refilled images equal their lock-step ones."""
    from tests.test_llamagen_t2i import tiny_t2i

    model = tiny_t2i(dtype="float32")
    drafter = EagleDrafter(model, head=EagleHead(model, init_seed=3, prefix="all"), prefix="all", extra_slots=8)
    decoder = Decoder("sd", model, ExactRule(), draft_len=2, drafter=drafter, path="static")
    prompts = ["a red cat", "a dog on a very long road in the rain", "blue", "a house", "green tree"]
    seeds = [5, 6, 7, 8, 9]
    assert_refill_equals_lock_step(decoder, prompts, seeds, 2)


def test_a_refilled_queue_is_one_throughput_batch():
    """The harness: a refilling decoder's batched set is the pre-flight batch and then one queue (AR, or a decoder
    without refilling, keeps its batches), and the throughput counts a queue's images (``batch_images``), not its
    width."""
    from types import SimpleNamespace

    from eval.run.experiment import _batches
    from eval.run.generator import Generator

    def decoder(refill: bool, plain_ar: bool = False):
        return SimpleNamespace(refill=refill, static=object(), plain_ar=plain_ar)

    harness = SimpleNamespace(decoders={"sd": decoder(True), "ar": decoder(True, plain_ar=True), "sjd": decoder(False)},
                              suite=SimpleNamespace(batch_size=3, preflight=True))
    harness._refills = lambda name: Generator._refills(harness, name)
    indices = list(range(10))
    assert Generator._chunks(harness, "sd", indices) == [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9]]
    for name in ("ar", "sjd"):
        assert Generator._chunks(harness, name, indices) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    harness.suite.preflight = False
    assert Generator._chunks(harness, "sd", indices) == [indices]
    records = [{"batch_id": "a", "batch_s": 2.0, "batch_images": 7, "stats": {"batch_size": 3}} for _ in range(7)]
    records += [{"batch_id": "b", "batch_s": 1.0, "stats": {"batch_size": 3}} for _ in range(3)]
    assert _batches(records) == {"a": (7, 2.0), "b": (3, 1.0)}


@pytest.mark.slow  # run.py end to end (about 10 s)
def test_a_run_with_refill_records_one_queue(tmp_path):
    """``python run.py decoder=sd decoder.path=static decoder.refill=true``: SD's batched images after the pre-flight
    batch are one queue (one ``batch_id``, ``batch_images``, each image its own latency), AR's stay batches, and the
    throughput counts the queue's images."""
    import json

    from tests.test_run import run_py

    run_py("decoder=sd", "decoder.path=static", "decoder.refill=true", "eval.num_prompts=7", "eval.speed_prompts=1",
           "eval.batch_size=2", "eval.threads=1", "logger=none", f"hydra.run.dir={tmp_path}")
    records = {name: [json.loads(line) for line in (tmp_path / "records" / f"{name}.jsonl").open()]
               for name in ("sd", "ar")}
    queue = [r for r in records["sd"] if r.get("batch_images")]
    assert sorted(r["index"] for r in queue) == [3, 4, 5, 6] and len({r["batch_id"] for r in queue}) == 1
    assert all(r["batch_images"] == 4 and r["stats"]["batch_size"] == 2 for r in queue)
    assert all(r["stats"]["latency_s"] <= r["batch_s"] for r in queue)
    assert not any(r.get("batch_images") for r in records["ar"])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["per_decoder"]["sd"]["throughput_images"] == 4 and run["per_decoder"]["sd"]["throughput_batch_size"] == 2


def test_refill_study_end_to_end(embedded, tmp_path):  # noqa: F811
    """``eval.bench.refill.refill_study`` on a tiny setting (uncompiled, width 2, K = 2, one round, AR and SD): both
    ways timed per decoder, the paired ratio, the waste, the step calls, the agreement, and both files."""
    import json

    from eval.bench.refill import refill_study

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[
            "bench=embedded_refill", "decoders=[ar,sd]", "variants={}", "refill.widths=[2]", "refill.queue=2",
            "refill.rounds=1", "refill.compile=false", "threads=1", f"out_dir={tmp_path}", "name=r"])
    record = refill_study(cfg, "embedded")
    assert record["complete"] and set(record["cells"]) == {"ar@static", "sd@static"}
    for key, by_width in record["cells"].items():
        cell = by_width["2"]
        assert cell["images"] == 4 and len(cell["lockstep_walls_s"]) == len(cell["refill_walls_s"]) == 1
        assert cell["lockstep_images_per_s"] > 0 and cell["refill_images_per_s"] > 0 and cell["ratio"] > 0
        assert cell["ratio_ci"] is None  # one round: no interval
        assert cell["images_agreeing"] == 4 or invariance_property(embedded[0]) != "bitwise"
        assert 0 <= cell["lockstep_waste"] < 1 and cell["refill_steps"] <= cell["lockstep_steps"]
    assert record["cells"]["ar@static"]["2"]["lockstep_waste"] == 0.0
    assert json.loads((tmp_path / "r.json").read_text())["setup"]["widths"] == [2]
    page = (tmp_path / "r.md").read_text()
    assert "| sd | 2 |" in page and "refilled ÷ lock-step" in page
