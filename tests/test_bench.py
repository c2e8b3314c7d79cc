"""``eval.bench.efficiency`` (and its CLI, ``scripts/bench.py``): smoke runs on the tiny model (timings are not
asserted), cost-model identities.

About 10 s on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.drafters.eagle import EagleDrafter, EagleHead
from coolsd.drafters.model_drafter import ModelDrafter
from coolsd.kv_cache import DeviceKVCache
from coolsd.models.llamagen import layer_skip_copy
from coolsd.types import DecodeStats
from eval.bench import efficiency as bench
from tests.helpers import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["images=1", "warmup=0", "cost.repeats=2", "cost.burst=1", "cost.warmup=0", "cost.block_sizes=[1,2]",
         "throughput.batch_sizes=[1,2]", "throughput.images=2"]


def test_cli_smoke_run_writes_table_and_record(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "scripts/bench.py", "model=tiny", *SMALL, "decoders=[ar,sd,sd_tree]",
         "+variants={sd_tree:{decoder:sd,tree:mc_sim_7b_63}}", "cost.trees=[]",
         f"out_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| decoder | T | τ |" in proc.stdout
    record = json.loads((tmp_path / "tiny_cpu.json").read_text())
    assert (tmp_path / "tiny_cpu.md").read_text().startswith("# Benchmark: tiny_cpu")
    # both paths (paths: [eager, static]); the tiny model's layer-skip drafter runs on both, chain and tree
    assert set(record["decoders"]) == {"ar", "sd", "sd_tree", "ar@static", "sd@static", "sd_tree@static"}
    assert record["setup"]["static_refused"] == {}
    assert "## Throughput" in proc.stdout  # img/s per batch size, and each gain over batch 1 among the goals
    assert set(record["throughput"]["sd"]["img_s"]) == {"1", "2"}  # JSON keys
    assert any("batch-1 img/s" in g["goal"] for g in record["goals"])
    tree = record["decoders"]["sd_tree"]
    assert tree["verify_tokens"] == 26 and tree["tree"] == "mc_sim_7b_63"
    assert record["decoders"]["sd"]["verify_tokens"] == 5
    assert set(record["costs"]["eager"]["forward_s"]) == {"1", "2", "5"}  # the sd chain block is always timed
    assert record["costs"]["eager"]["tree_tokens"] == {"mc_sim_7b_63": 26}
    ar = record["decoders"]["ar"]
    assert ar["accepted_length"] == 1.0 and ar["ideal_speedup"] == pytest.approx(1.0)
    for row in record["decoders"].values():
        assert row["latency_s"] > 0 and row["ideal_speedup"] > 0 and row["efficiency"] > 0
    assert record["environment"]["torch"] and record["setup"]["image_tokens"] == 64
    goals = [g["goal"] for g in record["goals"]]
    assert [g.split(":")[0] for g in goals if "efficiency" in g] == ["sd", "sd@static"]
    every = {"ar", "sd", "sd_tree", "ar@static", "sd@static", "sd_tree@static"}
    assert {g.split(":")[0] for g in goals if "overhead" in g} == every
    assert {g.split(":")[0] for g in goals if "img/s" in g} == every


def test_random_drafter_variants_and_paper_lengths(tmp_path):
    cfg = compose_bench([*SMALL, "decoders=[ar,coolsd,coolsd_d2]", "drafter_weights=random",
                         "+variants={coolsd_d2:{decoder:coolsd,delta:2.0}}",
                         "accepted_lengths={coolsd_d2:3.34}", "cost.trees=[]", f"out_dir={tmp_path}",
                         "name=t"])
    record = bench.run_bench(cfg, "tiny")
    rows = record["decoders"]
    assert rows["coolsd"]["drafter"] == rows["coolsd_d2"]["drafter"] == "EagleDrafter"
    assert rows["coolsd"]["tau_source"] == "measured" and rows["coolsd_d2"]["tau_source"] == "paper"
    assert rows["coolsd_d2"]["tau"] == 3.34 and rows["coolsd_d2"]["efficiency_basis"] == "projected"
    assert record["config"]["variants"]["coolsd_d2"]["delta"] == 2.0


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="cuda_graphs"):
        bench.run_bench(compose_bench(["cuda_graphs=true"]), "tiny")
    with pytest.raises(ValueError, match="decoders"):
        bench.run_bench(compose_bench(["decoders=[sd]"]), "tiny")
    with pytest.raises(ValueError, match="drafter_weights"):
        bench.run_bench(compose_bench(["drafter_weights=trained"]), "tiny")


def compose_bench(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="bench", overrides=["model=tiny", *overrides])


def test_ideal_overhead_and_efficiency_follow_the_cost_model(tiny_model):
    """Exact identities on made-up costs and statistics: ideal = τ c_1 / (c_d + c_v(T)), overhead =
    iteration − forwards, efficiency = measured ÷ ideal, projected = τ t_AR / t_iter."""
    drafter = ModelDrafter(tiny_model, draft_model=lambda target: layer_skip_copy(target, 1))
    sd = Decoder("sd", tiny_model, ExactRule(), draft_len=4, drafter=drafter)
    ar = Decoder("ar", tiny_model, ExactRule())
    key = bench.drafter_key(sd)
    costs = bench.Costs(
        context=32, forward_s={1: 1.0, 5: 2.0}, probs_s={1: 0.1, 5: 0.3}, sample_s=0.05, tree_tokens={},
        tree_forward_s={}, graph_forward_s={}, graph_tree_forward_s={},
        drafters={key: bench.DrafterCost(key, 0.25, 0.05),
                  "NullDrafter": bench.DrafterCost("NullDrafter", 0.0, 0.0)},
    )

    def stats(iterations: int, latency: float, drafter_forwards: int) -> DecodeStats:
        return DecodeStats(num_tokens=64, iterations=iterations, accepted_hist=(iterations,),
                           target_forwards=0, drafter_forwards=drafter_forwards, latency_s=latency,
                           prefill_s=0.5, draft_s=0.0, verify_s=0.0, accept_s=0.0, observe_s=0.0,
                           diagnostics_s=0.0, tv_sum=0.0, tv_steps=0)

    ar_row = bench.summarize("ar", [stats(63, 0.5 + 63 * 1.3, 0)], ar, costs, None, None)
    assert ar_row.ideal_speedup == 1.0 and ar_row.iteration_s == pytest.approx(1.3)
    assert ar_row.overhead_s == pytest.approx(0.3)  # 1.3 s per token − the 1-token forward
    ref = {"latency_s": ar_row.latency_s, "iteration_s": ar_row.iteration_s}
    row = bench.summarize("sd", [stats(21, 0.5 + 21 * 4.0, 84)], sd, costs, ref, None)
    tau, c_1, c_d, c_v = 63 / 21, 1.0 + 0.1 + 0.05, 4 * (0.25 + 0.05), 2.0 + 0.3 + 0.05
    assert row.tau == pytest.approx(tau) and row.drafter_forwards_per_iter == pytest.approx(4.0)
    assert row.ideal_speedup == pytest.approx(tau * c_1 / (c_d + c_v))
    assert row.forwards_s == pytest.approx(4 * 0.25 + 2.0) and row.overhead_s == pytest.approx(4.0 - 3.0)
    assert row.measured_speedup == pytest.approx(ar_row.latency_s / (0.5 + 21 * 4.0))
    assert row.efficiency == pytest.approx(row.measured_speedup / row.ideal_speedup)
    assert row.projected_speedup == pytest.approx(tau * 1.3 / 4.0)
    paper = bench.summarize("sd", [stats(21, 0.5 + 21 * 4.0, 84)], sd, costs, ref, 2.5)
    assert paper.tau == 2.5 and paper.accepted_length == pytest.approx(tau)
    assert paper.efficiency == pytest.approx(paper.projected_speedup / paper.ideal_speedup)


@pytest.mark.parametrize("layouts", [pytest.param(["column_major", "row_major"], id="layouts"),
                                     pytest.param(["column_major", "compiled"], id="compiled",
                                                  marks=pytest.mark.slow)])
def test_layout_comparison_times_each_model_variant_at_batch_1_and_batched(tmp_path, layouts):
    """``layouts=[...]``: every decoder on each model variant, interleaved; the first layout's ratio is 1, the
    tokens of a variant with the same arithmetic in float64 are the same, img/s at the largest batch size."""
    cfg = compose_bench(["images=2", "warmup=1", "decoders=[ar,sd]", f"layouts=[{','.join(layouts)}]",
                         "throughput.batch_sizes=[1,3]", "throughput.images=3", "model.dtype=float64",
                         f"out_dir={tmp_path}", "name=t"])
    record = bench.run_bench(cfg, "tiny")
    rows = record["layouts"]
    assert list(rows) == layouts and record["setup"]["throughput_batch"] == 3
    for n in ("ar", "sd"):
        assert rows[layouts[0]][n]["ratio_to_first"] == 1.0 and rows[layouts[0]][n]["same_tokens_as_first"] == 2
        assert all(rows[lay][n]["img_s"] > 0 and rows[lay][n]["median_latency_s"] > 0 for lay in layouts)
    assert rows[layouts[1]]["ar"]["same_tokens_as_first"] == 2  # float64: the variants' rounding never flips a token
    assert "img/s" in (tmp_path / "t_layouts.md").read_text()


def test_throughput_of_chosen_decoders_in_fixed_batches_with_their_tau(tmp_path):
    """``throughput.decoders`` picks the decoders, ``throughput.batches`` fixes the batches per size (a GPU
    preset's budget), each cell records its images' mean accepted length, and a decoder with a paper τ gets
    a projected img/s line; ``call_counts=false`` skips the counting decode."""
    cfg = compose_bench([*SMALL, "decoders=[ar,sd,coolsd]", "throughput.decoders=[ar,sd]",
                         "throughput.batches=1", "throughput.batch_sizes=[1,3]", "call_counts=false",
                         "accepted_lengths={sd:2.42}", "cost.trees=[]", f"out_dir={tmp_path}", "name=t"])
    record = bench.run_bench(cfg, "tiny")
    assert record["complete"] and set(record["throughput"]) == {"ar", "sd"}
    assert record["throughput"]["sd"]["images"] == {1: 1, 3: 3}
    assert record["throughput"]["ar"]["tau"] == {1: 1.0, 3: 1.0} and record["throughput"]["sd"]["tau"][3] >= 1.0
    assert record["call_counts"] == {}
    text = (tmp_path / "t.md").read_text()
    assert "projected img/s at the paper's τ = 2.42" in text and "Incomplete" not in text
    with pytest.raises(ValueError, match="throughput.decoders names decoders that are not run"):
        bench.run_bench(compose_bench([*SMALL, "throughput.decoders=[sjd]", "decoders=[ar]", f"out_dir={tmp_path}"]),
                        "tiny")


def test_the_latency_part_is_written_before_the_throughput_run(tmp_path, monkeypatch):
    """A bench stopped during its throughput run (a GPU lease ending) keeps its cost model and latencies."""
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("the lease ended")

    monkeypatch.setattr(bench, "measure_throughput", stopped)
    cfg = compose_bench([*SMALL, "decoders=[ar,sd]", "cost.trees=[]", f"out_dir={tmp_path}", "name=t"])
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(cfg, "tiny")
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["complete"] is False and record["throughput"] == {}
    assert set(record["decoders"]) == {"ar", "sd", "ar@static", "sd@static"}
    assert "**Incomplete**" in (tmp_path / "t.md").read_text()


def test_a_misspelt_accepted_length_stops_before_the_model_is_built(monkeypatch):
    monkeypatch.setattr(bench, "instantiate", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match="accepted_lengths names decoders that are neither"):
        bench.run_bench(compose_bench(["accepted_lengths={colsd:2.7}"]), "tiny")
    cfg = compose_bench(["bench=lumina_mgpt_7b"])  # the GPU presets compose (their sizes are built on a GPU only)
    assert cfg.model.random_init.vocab_size == 65536 and cfg.decoders == ["ar", "sd", "coolsd"]
    assert compose_bench(["bench=llamagen_xl_512"]).throughput.decoders == ["ar", "sd"]


def test_both_paths_are_timed_side_by_side_each_over_its_own_ar(tmp_path):
    """``paths: [eager, static]``: every decoder the static path runs is timed there too, interleaved with the
    eager ones, labelled ``<name>@static``, its speedup over ``ar@static``; the page says which path is which."""
    cfg = compose_bench(["bench=embedded_random", *SMALL, "decoders=[ar,sd,sjd]", "variants={}", "cost.trees=[]",
                         "throughput.batch_sizes=[]", "call_counts=false", f"out_dir={tmp_path}", "name=p"])
    record = bench.run_bench(cfg, "embedded")
    rows = record["decoders"]
    assert set(rows) == {"ar", "sd", "sjd", "ar@static", "sd@static", "sjd@static"}
    assert record["setup"]["paths"] == ["eager", "static"] and record["setup"]["static_steps"] == "eager"
    for name in ("sd", "sjd"):
        for suffix, ar in (("", "ar"), ("@static", "ar@static")):
            row = rows[name + suffix]
            assert row["measured_speedup"] == pytest.approx(rows[ar]["latency_s"] / row["latency_s"])
    assert rows["sd@static"]["accepted_length"] == rows["sd"]["accepted_length"]  # the same tokens
    page = (tmp_path / "p.md").read_text()
    assert "| sd@static |" in page and "speedup is over ar@static" in page
    with pytest.raises(ValueError, match="paths must list eager and/or static"):
        bench.run_bench(compose_bench(["paths=[graph]"]), "tiny")


def test_static_rows_use_the_static_cost_model(tiny_model):
    """A ``@static`` row: forwards = the networks of one iteration in one call (the static target forward alone
    without a drafter network), c_d = one ``static_propose``, c_1 and c_v(T) one verify each; the eager row keeps
    the eager costs."""
    drafter = EagleDrafter(target=tiny_model, head=EagleHead(tiny_model, init_seed=0), extra_slots=8)
    sd = Decoder("sd", tiny_model, ExactRule(), draft_len=4, drafter=drafter, path="static")
    ar = Decoder("ar", tiny_model, ExactRule(), path="static")
    costs = bench.Costs(context=32, forward_s={1: 1.0, 5: 2.0}, probs_s={1: 0.1, 5: 0.3}, sample_s=0.05,
                        tree_tokens={}, tree_forward_s={}, graph_forward_s={}, graph_tree_forward_s={},
                        drafters={"EagleDrafter": bench.DrafterCost("EagleDrafter", 0.25, 0.05),
                                  "NullDrafter": bench.DrafterCost("NullDrafter", 0.0, 0.0)})
    ar_key, sd_key = bench.static_block_key(ar), bench.static_block_key(sd)
    assert sd_key == "chain T=5, +5 slots" and bench.static_drafter_key(sd) == "EagleDrafter, L=4"
    static = bench.StaticCosts(
        mode="compiled", context=32, ar_block=ar_key, networks_s={f"EagleDrafter, L=4; {sd_key}": 1.4},
        step_s={"sd@static": 1.6}, overhead_ci_s={"sd@static": (0.1, 0.3)},
        blocks={ar_key: bench.StaticBlockCost(1, None, 70, 0.5, 0.55),
                sd_key: bench.StaticBlockCost(5, None, 74, 0.9, 1.0)},
        drafters={bench.static_drafter_key(ar): bench.StaticDrafterCost("NullDrafter, L=0", 0, 0, 0, 0, 0),
                  "EagleDrafter, L=4": bench.StaticDrafterCost("EagleDrafter, L=4", 4, 0.3, 0.1, 0.01, 0.7)})
    assert static.drafters["EagleDrafter, L=4"].separate_s == pytest.approx(0.3 + 3 * 0.1)

    def stats(iterations: int, latency: float, drafter_forwards: int) -> DecodeStats:
        return DecodeStats(num_tokens=64, iterations=iterations, accepted_hist=(iterations,), target_forwards=0,
                           drafter_forwards=drafter_forwards, latency_s=latency, prefill_s=0.5, draft_s=0.0,
                           verify_s=0.0, accept_s=0.0, observe_s=0.0, diagnostics_s=0.0, tv_sum=0.0, tv_steps=0)

    ar_row = bench.summarize("ar@static", [stats(63, 0.5 + 63 * 0.6, 0)], ar, costs, None, None, static)
    assert ar_row.forwards_s == pytest.approx(0.5) and ar_row.overhead_s == pytest.approx(0.1)
    assert ar_row.cost_path == "static (compiled)" and ar_row.ideal_speedup == pytest.approx(1.0)
    ref = {"latency_s": ar_row.latency_s, "iteration_s": ar_row.iteration_s}
    row = bench.summarize("sd@static", [stats(21, 0.5 + 21 * 2.0, 80)], sd, costs, ref, None, static)
    # the overhead of a static row with a step probe: step − forwards, both probes (the decode's iteration is 2.0)
    assert row.forwards_s == pytest.approx(1.4) and row.overhead_s == pytest.approx(1.6 - 1.4)
    assert row.overhead_frac == pytest.approx(0.2 / 1.6) and row.step_s == 1.6 and row.iteration_s == pytest.approx(2)
    assert row.overhead_ci_s == (0.1, 0.3) and ar_row.overhead_ci_s is None
    assert row.ideal_speedup == pytest.approx(3 * 0.55 / (0.7 + 1.0))
    eager = bench.summarize("sd", [stats(21, 0.5 + 21 * 2.0, 80)], sd, costs, ref, None, static)
    assert eager.cost_path == "eager" and eager.forwards_s == pytest.approx(80 / 21 * 0.25 + 2.0)
    # an eager row's target forwards timed inside its decodes replace the cost model's (21 iterations, 31.5 s)
    timed = bench.summarize("sd", [stats(21, 0.5 + 21 * 2.0, 80)], sd, costs, ref, None, static, [31.5])
    assert timed.forwards_s == pytest.approx(80 / 21 * 0.25 + 1.5) and timed.ideal_speedup == eager.ideal_speedup


def test_a_probe_pair_is_timed_back_to_back_in_alternating_order():
    """``Probes.add_pair``: each round calls both once untimed, then ``burst`` timed calls of each, the pair's order
    flipping from call to call, in the place of the first; a plain probe keeps its burst."""
    order: list[str] = []
    probes = bench.Probes(bench.Timer(torch.device("cpu")))
    probes.add("plain", lambda: order.append("p"))
    probes.add_pair("step", lambda: order.append("s"), "forwards", lambda: order.append("f"))
    probes.add("last", lambda: order.append("l"))
    probes.round(3)
    assert "".join(order) == "pppp" + "sf" + "sf" + "fs" + "sf" + "llll"
    assert [len(probes.samples[k]) for k in ("plain", "step", "forwards", "last")] == [3, 3, 3, 3]


def test_static_probes_run_the_static_forward_and_the_drafters_static_step(tiny_model, monkeypatch):
    """The static cost model's probes call ``model.static_forward`` over a ``DeviceKVCache`` (never the eager
    ``forward_block``) and the drafter's ``static_propose``, each through a ``Runner`` in the static loop's mode."""
    cfg = compose_bench(["decoders=[ar,sd,sjd]", "drafter_weights=random", "cost.trees=[]"])
    decoders = bench.build_decoders(cfg, tiny_model, "static")
    assert set(decoders) == {"ar@static", "sd@static", "sjd@static"}
    probes = bench.Probes(bench.Timer(tiny_model.device))
    with torch.inference_mode():
        model = bench.StaticCostModel(decoders, tiny_model, "zero", 8, 0, probes)
    calls: dict[str, list] = {"static_forward": [], "forward_block": [], "static_propose": []}
    static_forward, static_propose = tiny_model.static_forward, EagleDrafter.static_propose

    def counting_static_forward(cache, *args, **kwargs):
        calls["static_forward"].append(type(cache))
        return static_forward(cache, *args, **kwargs)

    def counting_propose(self, *args, **kwargs):
        calls["static_propose"].append(args[3])  # depth
        return static_propose(self, *args, **kwargs)

    # patched in the instance's dict, which the undo empties again (setattr's undo would leave the bound
    # methods there, and a layer-skip copy of the session's model would then run the target's own)
    monkeypatch.setitem(vars(tiny_model), "static_forward", counting_static_forward)
    monkeypatch.setitem(vars(tiny_model), "forward_block", lambda *a, **k: calls["forward_block"].append(a))
    monkeypatch.setattr(EagleDrafter, "static_propose", counting_propose)
    with torch.inference_mode():
        probes.round(1)  # every probe: one untimed call and one timed
    blocks = [bench.static_block_key(decoders[k]) for k in ("ar@static", "sd@static", "sjd@static")]
    assert blocks[:2] == ["chain T=1, +1 slots", "chain T=5, +5 slots"]
    assert [k.split("/", 2)[2] for k in probes.fns if k.startswith("static/forward/")] == blocks
    # forward and verify of every block, and sd's networks of one iteration: two calls each (untimed, timed)
    # (and the round's throwaway transition call of the first probe, the T = 1 forward)
    assert calls["static_forward"] == [DeviceKVCache] * 2 * (2 * len(blocks) + 2) and not calls["forward_block"]
    assert calls["static_propose"] == [4, 4]  # sd's chain of L = 4; sjd's Jacobi window has no network
    shared = probes.fns["static/transition"]
    assert shared is probes.fns[f"static/forward/{blocks[0]}"] and shared.runner.calls == 4
    assert all(fn.runner.mode == "eager" and fn.runner.calls == 2 for fn in probes.fns.values() if fn is not shared)
    assert {k.split("/")[1] for k in probes.fns} == {"transition", "forward", "verify", "drafter_feed", "drafter_step",
                                                    "drafter_pipeline", "drafter_propose", "networks"}
    costs = model.costs()
    assert costs.ar_block == blocks[0] and costs.blocks[blocks[1]].slots == costs.blocks[blocks[0]].slots + 4
    assert set(costs.networks_s) == {f"EagleDrafter, L=4; {blocks[1]}"}
    jacobi = bench.static_drafter_key(decoders["sjd@static"])
    assert costs.drafters["EagleDrafter, L=4"].propose_s > 0 and costs.drafters[jacobi].depth == 0


def test_a_draft_models_static_costs_time_its_drafting_and_forwards(tiny_model, monkeypatch):
    """A ``ModelDrafter`` on the static path (a chain and a static tree sharing one drafter): its drafting
    costs time (``propose``: one ``static_propose``), its row's forwards are the draft model's forwards of one
    iteration (the feed, a chain's L − 1 one-token forwards or a tree's level expansions) and the target's
    static forward, and the probes leave both decoders' tokens as they were."""
    drafter = ModelDrafter(tiny_model, draft_model=lambda target: layer_skip_copy(target, 1))
    static = {"path": "static"}
    decoders = {"ar@static": Decoder("ar", tiny_model, ExactRule(), **static),
                "sd@static": Decoder("sd", tiny_model, ExactRule(), draft_len=4, drafter=drafter, **static),
                "sd_tree@static": Decoder("sd_tree", tiny_model, ExactRule(), drafter=drafter,
                                          tree="mc_sim_7b_63", **static)}
    probes = bench.Probes(bench.Timer(tiny_model.device))
    with torch.inference_mode():
        before = {label: dec.generate("zero", 3).tokens for label, dec in decoders.items()}
        model = bench.StaticCostModel(decoders, tiny_model, "zero", 32, 0, probes)
        for label, dec in decoders.items():
            model.add_step(label, dec, "zero", 0)
        probes.round(3)
        after = {label: dec.generate("zero", 3).tokens for label, dec in decoders.items()}
    assert all(torch.equal(before[label], after[label]) for label in decoders)
    costs = model.costs()
    chain, tree = (bench.static_drafter_key(decoders[k]) for k in ("sd@static", "sd_tree@static"))
    assert chain == "ModelDrafter(1 layers), L=4" and tree == "ModelDrafter(1 layers), L=5 (mc_sim_7b_63)"
    for key in (chain, tree):
        d = costs.drafters[key]
        assert min(d.feed_s, d.step_s, d.pipeline_s, d.propose_s) > 0
    block = bench.static_block_key(decoders["sd@static"])
    assert costs.networks_s[f"{chain}; {block}"] > costs.blocks[block].forward_s
    calls: list[str] = []  # whose static forwards one call of each row's forwards makes

    def counting(who: str, forward):
        def call(*args, **kwargs):
            calls.append(who)
            return forward(*args, **kwargs)
        return call

    for who, net in (("draft", drafter.model), ("target", tiny_model)):
        monkeypatch.setitem(vars(net), "static_forward", counting(who, net.static_forward))
    with torch.inference_mode():
        for label in ("sd@static", "sd_tree@static"):
            calls.clear()
            probes.fns[f"static/step_forwards/{label}"]()
            # the feed, then a chain's 3 one-token forwards or the tree's 4 level expansions
            assert calls.count("target") == 1 and calls.count("draft") == (4 if label == "sd@static" else 5)


def test_both_paths_costs_are_kept_in_one_record_keyed_by_path(tmp_path):
    """``record["costs"]`` holds the eager and the static cost model; every row says whose costs it used, and the
    page shows the static path's cost model."""
    cfg = compose_bench([*SMALL, "decoders=[ar,sd]", "drafter_weights=random", "cost.trees=[]",
                         "throughput.batch_sizes=[]", "call_counts=false", f"out_dir={tmp_path}", "name=k"])
    record = bench.run_bench(cfg, "tiny")
    assert set(record["costs"]) == {"eager", "static"}
    static = record["costs"]["static"]
    assert static["mode"] == "eager" and set(static["blocks"]) == {"chain T=1, +1 slots", "chain T=5, +5 slots"}
    assert static["ar_block"] == "chain T=1, +1 slots" and set(record["costs"]["eager"]["forward_s"]) == {1, 2, 5}
    rows = record["decoders"]
    assert {k: r["cost_path"] for k, r in rows.items()} == {"ar": "eager", "sd": "eager", "ar@static": "static (eager)",
                                                            "sd@static": "static (eager)"}
    # a static row's forwards: its networks probe, timed back to back with its step (Probes.add_pair)
    assert rows["sd@static"]["forwards_s"] == static["step_forwards_s"]["sd@static"] > 0
    assert rows["ar@static"]["forwards_s"] == static["step_forwards_s"]["ar@static"] > 0
    assert set(static["networks_s"]) == {"EagleDrafter, L=4; chain T=5, +5 slots"}
    assert rows["ar"]["overhead_s"] > 0  # the eager AR's forward timed inside its own iterations
    for label in ("ar@static", "sd@static"):  # each static decoder's own step, timed in the cost model's rounds
        assert rows[label]["step_s"] == static["step_s"][label] > 0
        assert rows[label]["overhead_s"] == pytest.approx(rows[label]["step_s"] - rows[label]["forwards_s"])
        low, high = rows[label]["overhead_ci_s"]
        assert low <= high and f"[{1e3 * low:.3f}, {1e3 * high:.3f}]" in (tmp_path / "k.md").read_text()
    assert rows["sd"]["step_s"] is None
    page = (tmp_path / "k.md").read_text()
    assert "## Cost model, static path (ms; steps: eager;" in page and "| sd@static |" in page
    assert "| static (eager) |" in page and "| EagleDrafter, L=4 |" in page
    saved = json.loads((tmp_path / "k.json").read_text())
    assert saved["decoders"]["sd@static"]["cost_path"] == "static (eager)"


def test_no_committed_bench_record_has_a_negative_overhead():
    """Every decoder row of every bench record under ``results/bench`` (``decoders.<row>.overhead_s``): an
    iteration takes at least the network forwards the cost model puts inside it (a static row: unless noise put
    the difference below 0 inside its own 95 % interval)."""
    assert bench.negative_overheads(ROOT / "results" / "bench") == []


def test_negative_overheads_and_the_paired_interval(tmp_path):
    """A negative overhead is reported unless its row's 95 % interval reaches 0; the interval of a constant
    difference is that difference, and a per-call step count divides the step's samples."""
    rows = {"ar": {"overhead_s": -0.001, "overhead_frac": -0.2}, "a@static": {"overhead_s": -0.001,
            "overhead_ci_s": [-0.002, 0.0005]}, "b@static": {"overhead_s": -0.002, "overhead_ci_s": [-0.003, -0.001]},
            "c": {"overhead_s": 0.001}}
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.json").write_text(json.dumps({"decoders": rows}))
    (tmp_path / "other.json").write_text(json.dumps({"rows": [1]}))
    found = bench.negative_overheads(tmp_path)
    assert len(found) == 2 and found[0].startswith("sub/r.json: ar -1.000 ms") and "b@static" in found[1]
    assert bench.paired_interval([3.0] * 5, [1.0] * 5) == (2.0, 2.0)
    assert bench.paired_interval([16.0] * 5, [1.0] * 5, per_call=8) == (1.0, 1.0)


def test_the_target_clock_times_the_forwards_inside_a_decode(tiny_model):
    """``TargetClock``: the seconds of a decode's ``forward_block`` calls, within its wall time; the model's own
    method is back afterwards."""
    ar = Decoder("ar", tiny_model, ExactRule())
    clock = bench.TargetClock(tiny_model, bench.Timer(tiny_model.device))
    stats, seconds = clock.generate(ar, "zero", 0)
    assert 0 < seconds < stats.latency_s - stats.prefill_s
    assert "forward_block" not in vars(tiny_model)


@pytest.mark.parametrize("model", ["lumina_tiny", "janus_tiny"])
def test_the_other_adapters_bench_runs_both_paths(tmp_path, model):
    """The bench on an adapter with structural slots (Lumina-mGPT's end-of-row slots, its static cache a
    ``RowEndKVCache``) or per-image prompt lengths (Janus-Pro): AR, SD with the model's own draft model and SJD run on
    both paths, the static rows costed by the static path's probes over the model's own static cache."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[f"model={model}", *SMALL, "decoders=[ar,sd,sjd]",
                                                      "cost.trees=[]", "throughput.batch_sizes=[]",
                                                      "call_counts=false", f"out_dir={tmp_path}", "name=m"])
    record = bench.run_bench(cfg, model)
    assert set(record["decoders"]) == {"ar", "sd", "sjd", "ar@static", "sd@static", "sjd@static"}
    assert record["setup"]["static_refused"] == {}
    static = record["costs"]["static"]
    drafting = [d["propose_s"] for key, d in static["drafters"].items() if key.startswith("ModelDrafter")]
    assert len(drafting) == 1 and drafting[0] > 0, static["drafters"]
    assert all(record["decoders"][k]["cost_path"].startswith("static") for k in ("ar@static", "sd@static"))
