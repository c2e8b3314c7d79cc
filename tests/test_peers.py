"""The peer bench (eval/bench/peers/): pairing and interleaving, the device patches, the worker process, the
statistics and the report, on a fake peer (tests/peer_fake.py); and, where a clone of a peer is given, its glue
against our decoder on the same weights.

Statistical tests state their seed and false-alarm probability. The real peers need their clones; those tests
skip with the command that gets them (COOLSD_PEERS=<folder holding the clones, named as the repositories>).
About 20 s on one core (two worker processes start).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.bench.peers import comparison
from eval.bench.peers.contract import Pair, PeerImage
from eval.bench.peers.patches import DevicePatches
from eval.bench.peers.worker import check_requirements
from tests import peer_fake


# -- pairing --------------------------------------------------------------------------------------------------------
def test_interleaving_gives_both_sides_the_same_prompts_and_seeds_alternating_who_goes_first():
    calls = []

    def side(name):
        def call(prompt, seed):
            calls.append((name, prompt, seed))
            return PeerImage(seconds=1.0, tokens=4, target_forwards=4)
        return call

    a, b = comparison.interleave(side("ours"), side("theirs"), ["p0", "p1", "p2", "p3"], seed=10, warmup=2)
    assert len(a) == len(b) == 4
    warm, timed = calls[:4], calls[4:]
    assert {s for _, _, s in warm}.isdisjoint({s for _, _, s in timed})   # warm-up images are not timed ones
    assert [c[0] for c in timed] == ["ours", "theirs", "theirs", "ours", "ours", "theirs", "theirs", "ours"]
    for i in range(4):
        pair = [c for c in timed if c[2] == 10 + i]
        assert {c[0] for c in pair} == {"ours", "theirs"} and {c[1] for c in pair} == {f"p{i}"}


# -- device patches -----------------------------------------------------------------------------------------------
def test_patches_send_cuda_calls_to_the_cpu_count_them_and_are_removed_afterwards():
    original = torch.Tensor.cuda, torch.zeros, torch.cuda.synchronize, torch.Tensor.to
    patches = DevicePatches(["tensor_cuda", "factory_cuda", "cuda_sync", "to_cuda", "module_cuda"])
    with patches:
        x = torch.zeros(3, device="cuda").cuda().to("cuda")
        y = torch.ones(2, device=torch.device("cuda")).to(device="cuda:0")
        torch.nn.Linear(2, 2).cuda()
        torch.cuda.synchronize()
        with patches:   # re-entrant
            torch.cuda.synchronize()
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert patches.hits == {"factory_cuda": 2, "tensor_cuda": 1, "to_cuda": 2, "module_cuda": 1, "cuda_sync": 2}
    assert (torch.Tensor.cuda, torch.zeros, torch.cuda.synchronize, torch.Tensor.to) == original
    assert any("(2 calls)" in line for line in patches.describe())
    assert torch.zeros(1).to(torch.float64).dtype == torch.float64   # non-device .to untouched while installed
    timers = DevicePatches(["cuda_event"])
    with timers:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        end.synchronize()
    assert 0 <= start.elapsed_time(end) < 1000 and timers.hits == {"cuda_event": 2}
    with pytest.raises(ValueError, match="unknown device patches.*known"):
        DevicePatches(["cuda_graphs"])


def test_without_patches_the_fake_peer_fails_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the fake peer's CUDA calls for real")
    call = peer_fake.build(Path("."), {"tokens": 4, "sleep": 0.0, "tau": 1.0}, peer_fake.SPEC.pairs[0])
    with pytest.raises((AssertionError, RuntimeError)):
        call({}, 0)


def test_requirements_are_checked_with_the_venv_command():
    check_requirements(("torch==" + __import__("importlib.metadata").metadata.version("torch"),))
    with pytest.raises(RuntimeError, match=r"transformers .* \(needs 0\.0\.1\).*venv --system-site-packages"):
        check_requirements(("transformers==0.0.1",))


# -- checkouts ---------------------------------------------------------------------------------------------------------
def test_checkout_must_be_a_git_tree_at_the_pinned_commit(tmp_path):
    spec = peer_fake.SPEC
    with pytest.raises(FileNotFoundError, match="git clone https://github.com/example/fake-peer"):
        comparison.check_checkout(spec, tmp_path / "absent")
    with pytest.raises(ValueError, match="not a git checkout"):
        comparison.check_checkout(spec, tmp_path)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=env)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-q", "--allow-empty", "-m", "x"], check=True, env=env)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with pytest.raises(ValueError, match=f"at commit {head}.*checkout {'0' * 40}"):
        comparison.check_checkout(spec, tmp_path)
    comparison.check_checkout(spec.__class__(**{**spec.__dict__, "commit": head}), tmp_path)


# -- statistics --------------------------------------------------------------------------------------------------------
def test_paired_ratio_interval_covers_the_true_ratio_and_cancels_shared_drift():
    """Seed 0: theirs = drift_i · lognormal noise (σ 0.1), ours = 0.8 · drift_i · noise'; the drift (a factor 1 to
    3 shared by both sides of prompt i) would swamp an unpaired comparison. A 95 % interval misses 0.8 with
    probability 0.05 (the false-alarm probability of this test)."""
    rng = np.random.default_rng(0)
    drift = rng.uniform(1, 3, 20)
    theirs = drift * np.exp(rng.normal(0, 0.1, 20))
    ours = 0.8 * drift * np.exp(rng.normal(0, 0.1, 20))
    r = comparison.ratio_interval(ours, theirs)
    lo, hi = r["interval"]
    assert lo < 0.8 < hi and hi < 1.0 and r["n"] == 20
    assert comparison.ratio_interval([1.0], [2.0])["interval"] is None


def test_two_sample_test_sees_a_shifted_accepted_length_and_not_an_equal_one():
    """Seed 1: 30 per-image τ per side. Same distribution: a two-sided 5 % test passes with probability 0.95; a
    shift of 1.5 standard deviations is found with power > 0.999 at this size."""
    rng = np.random.default_rng(1)
    same = comparison.two_sample(rng.normal(2.0, 0.3, 30), rng.normal(2.0, 0.3, 30))
    shifted = comparison.two_sample(rng.normal(2.0, 0.3, 30), rng.normal(2.45, 0.3, 30))
    assert same["p"] > 0.05 and shifted["p"] < 0.001
    assert comparison.two_sample([1.0] * 5, [1.0] * 5)["p"] == 1.0   # AR: every τ is 1


def _result(tau_theirs: float, ratio: float, difference: str = "") -> comparison.PairResult:
    rng = np.random.default_rng(2)
    ours = [PeerImage(seconds=float(s), tokens=65, target_forwards=33) for s in rng.uniform(1, 2, 20)]
    theirs = [PeerImage(seconds=o.seconds / ratio, tokens=65, target_forwards=1 + round(64 / tau_theirs))
              for o in ours]
    return comparison.PairResult(peer="fake", pair=Pair("sd", "theirs", difference=difference), ours=ours,
                             theirs=theirs, patches={"cuda_sync": 3}, worker={"versions": {"torch": "x"}})


def test_summary_and_report_mark_slower_pairs_and_unexplained_statistics():
    rows = comparison.summarize([_result(2.0, 1.25), _result(3.0, 0.8, difference="carries q")])
    assert comparison.verdict(rows[0]) == "ours slower" and comparison.verdict(rows[1]) == "ours faster"
    assert rows[0]["same_statistics"] and not rows[1]["same_statistics"]
    text = comparison.markdown(rows, {"other": "no checkout given"}, {
        "device": "CPU", "command": "c", "date": "d", "prompts": 20, "seed": 0, "warmup": 2, "threads": 1,
        "cpu": "x", "torch": "t", "transformers": "v"}, {"fake": peer_fake.SPEC})
    assert "| fake | `sd` | theirs | 20 |" in text and "1.25 [1.25, 1.25] | ours slower" in text
    assert "cuda_sync: 3 calls" in text and "Differs on purpose: carries q" in text
    assert "explained by the difference above" in text


def test_keep_adds_peers_to_a_table_and_keeps_earlier_rows_as_measured(tmp_path):
    """``--keep``: rows of peers this run does not measure come from the earlier record with the spec recorded with
    them; a peer whose glue is not written (PJD: ``SPEC.not_run``) is listed with its reason, and so is a peer that
    cannot run (VVS: ``SPEC.cpu``), whether or not a checkout is given; a kept table with another protocol is
    refused."""
    import dataclasses
    import json

    from eval.bench.peers import pjd, vvs

    meta = {"device": "CPU", "command": "first", "date": "d0", "prompts": 20, "seed": 0, "warmup": 2, "threads": 1,
            "cpu": "x", "torch": "t", "transformers": "v", "path": "eager"}
    rows = comparison.summarize([_result(2.0, 0.8)])
    comparison.write(tmp_path / "old.md", {"rows": rows, "skipped": {"vvs": "old reason"},
                                           "specs": {"fake": peer_fake.SPEC}, "images": {"fake/sd": {"ours": []}}},
                     meta)
    earlier = json.loads((tmp_path / "old.json").read_text())
    now = comparison.run({}, {}, ["a cat"], 0, 0, 1, log=lambda text: None)
    assert now["rows"] == [] and now["skipped"]["pjd"] == pjd.NOT_RUN and now["skipped"]["vvs"] == vvs.SPEC.cpu
    assert "no checkout given" in now["skipped"]["llamagen"]
    record, merged = comparison.keep(now, {**meta, "command": "second", "date": "d1"}, earlier)
    assert record["rows"] == earlier["rows"] and "fake" not in record["skipped"] and "pjd" in record["skipped"]
    assert dataclasses.asdict(record["specs"]["fake"]) == dataclasses.asdict(peer_fake.SPEC)
    assert merged["kept"]["peers"] == ["fake"] and merged["kept"]["command"] == "first"
    assert record["images"] == {"fake/sd": {"ours": []}}
    text = comparison.markdown(record["rows"], record["skipped"], merged, record["specs"])
    assert "Written by `second` on d1, measuring no pair; the rows of fake are kept as measured by `first` on d0" in text
    assert "| fake | `sd` | theirs | 20 |" in text and f"**Not run:** {pjd.NOT_RUN}" in text
    assert "### pjd: [boyaliao/PJD]" in text and "(this writing;" not in text  # the same machine
    with pytest.raises(ValueError, match="prompts=20, this run with prompts=5"):
        comparison.keep(now, {**meta, "prompts": 5}, earlier)
    # keeping a table that itself kept those rows names the run that measured them
    comparison.write(tmp_path / "kept.md", record, merged)
    _, again = comparison.keep(now, {**meta, "command": "third"}, json.loads((tmp_path / "kept.json").read_text()))
    assert again["kept"]["command"] == "first" and again["kept"]["date"] == "d0"
    with pytest.raises(NotImplementedError, match="no checkout of boyaliao/PJD"):
        pjd.build(tmp_path, {}, pjd.SPEC.pairs[0])


# -- the worker, end to end -----------------------------------------------------------------------------------------
def test_a_fake_peer_runs_in_its_worker_with_its_patches_and_the_table_reads_right(monkeypatch, tmp_path):
    monkeypatch.setattr(peer_fake, "export", lambda ours, pair: {
        "tokens": int(ours.model.num_image_tokens), "sleep": 0.02, "tau": 1.0, "fail": False})
    result = comparison.measure_pair(peer_fake, tmp_path, peer_fake.SPEC.pairs[0], ["a cat", "a dog"] * 3, seed=0,
                                 warmup=1, threads=1, python=None, models={})
    assert len(result.ours) == len(result.theirs) == 6
    assert all(x.seconds >= 0.02 for x in result.theirs)   # their time is measured in their process
    assert [x.codes for x in result.theirs] == [(s,) for s in range(6)]   # seed i went to prompt i
    assert result.patches == {"tensor_cuda": 6, "factory_cuda": 6, "cuda_sync": 6} or torch.cuda.is_available()
    row = comparison.summarize([result])[0]
    assert row["tau"]["ours"] == row["tau"]["theirs"] == 1.0 and row["same_statistics"]
    theirs, ours = (comparison.anatomy_figures(result.anatomy[side]) for side in ("theirs", "ours"))
    assert theirs["loop_ms_token"] >= 20 / max(result.theirs[0].tokens - 1, 1) * 0.9   # the sleep is loop time
    assert theirs["forward_calls"] > 0 and theirs["forward_ms"] > 0   # the Linear's torch calls and time
    assert ours["forward_ms"] > 0 and ours["loop_calls_token"] > 0
    assert "## Where the time goes" in "\n".join(comparison.anatomy_lines([row]))
    assert row["ratio"]["interval"][1] < 1.0   # ours (the lookup model's AR, ~1 ms) beats a 20 ms sleep


def test_a_failing_peer_reports_its_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(peer_fake, "export", lambda ours, pair: {"fail": True})
    with pytest.raises(RuntimeError, match="(?s)failed on build.*the fake peer refuses to build"):
        comparison.measure_pair(peer_fake, tmp_path, peer_fake.SPEC.pairs[0], ["a cat"], seed=0, warmup=0,
                            threads=1, python=None, models={})


def test_the_script_lists_peers_not_given_with_their_clone_command(tmp_path):
    out = tmp_path / "peers.md"
    proc = subprocess.run([sys.executable, "scripts/bench_peers.py", "--prompts", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=comparison.ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "0 pairs measured" in proc.stdout
    assert "git clone https://github.com/FoundationVision/LlamaGen" in text
    assert out.with_suffix(".json").is_file()
    bad = subprocess.run([sys.executable, "scripts/bench_peers.py", "--peer", "nobody=/tmp"], capture_output=True,
                         text=True, cwd=comparison.ROOT, timeout=300)
    assert bad.returncode != 0 and "unknown peer" in bad.stderr


# -- PathRelax: the acceptance fixtures and the pair ---------------------------------------------------------------
def test_pathrelax_fixture_file_holds_the_generators_inputs_and_verdicts_that_follow_from_its_uniforms():
    """tests/golden/pathrelax_acceptance.json was made by their sampler at the pinned commit from
    ``pathrelax.fixture_cases()``: the stored inputs are those cases bitwise (float32), and every stored verdict
    follows from the stored uniforms under the test the file states (u < min(1, p/q) in float32, the first longest
    path chosen, the residual a distribution)."""
    import json

    from eval.bench.peers import pathrelax

    record = json.loads((comparison.ROOT / "tests/golden/pathrelax_acceptance.json").read_text())
    assert record["source"]["commit"] == pathrelax.SPEC.commit
    assert record["source"]["command"].startswith("python -m eval.bench.peers.pathrelax fixtures")
    cases = pathrelax.fixture_cases()
    assert [c["name"] for c in record["cases"]] == [c["name"] for c in cases] and len(cases) >= 40
    tags = set()
    for stored, made in zip(record["cases"], cases):
        tokens = torch.tensor(stored["draft_tokens"])
        q = torch.tensor(stored["draft_prob"], dtype=torch.float32)
        p = torch.tensor(stored["target_prob"], dtype=torch.float32)
        assert torch.equal(tokens, made["draft_tokens"]) and torch.equal(q, made["draft_prob"])
        assert torch.equal(p, made["target_prob"])
        assert (tokens[:, 0] == tokens[0, 0]).all() and (p[:, 0] == p[0, 0]).all()   # one root
        u = torch.tensor(stored["u"], dtype=torch.float32)
        paths, l1, _ = p.shape
        ratio = (p[torch.arange(paths)[:, None], torch.arange(l1 - 1), tokens[:, 1:]]
                 / q[torch.arange(paths)[:, None], torch.arange(1, l1), tokens[:, 1:]]).clamp(max=1)
        first = ((u < ratio).long().cumprod(-1).sum(-1) + 1).tolist()
        assert first == stored["first_misaligned"]
        assert stored["matched_num"] == max(first) and stored["chosen_path"] == first.index(max(first))
        residual = stored["residual"]
        assert (residual is None) == (stored["matched_num"] == l1)
        if residual is not None:
            assert abs(sum(residual) - 1) < 1e-5
        tags.update(stored["tags"])
    assert {"free", "forced", "tie", "zeros", "q_zero_at_draft"} <= tags
    assert any(c["chosen_path"] > 0 for c in record["cases"]) and any(c["residual"] is None for c in record["cases"])


def test_pathrelax_fixture_maker_records_the_uniforms_and_residuals_the_sampler_used():
    """On a stand-in of their sampler (tests/peer_fake.py ``TreeSampler``): the uniforms replayed from the
    generator's state are those it read, and the residuals kept per path are those it returned."""
    from eval.bench.peers import pathrelax

    case = pathrelax.build_case("t", 3, 4, 16, seed=5, script=["aar", "aaaa", ""], keep=6)
    samplers = []

    def make(**kwargs):
        samplers.append(peer_fake.TreeSampler(**kwargs))
        return samplers[-1]

    verdict = pathrelax.run_their_sampler(make, case, seed=7)
    fake = samplers[0]
    tokens = case["draft_tokens"]
    assert torch.equal(verdict["u"], fake.rs[torch.arange(3)[:, None], torch.arange(1, 5), tokens[:, 1:]])
    assert verdict["first_misaligned"][:2] == [3, 5] and verdict["chosen_path"] == 1
    assert verdict["matched_num"] == 5 and verdict["residual"] is None
    kept = [r for r in verdict["residual_per_path"] if r is not None]
    assert len(kept) == len(fake.returned) and all(torch.equal(a, b) for a, b in zip(kept, fake.returned))
    assert verdict["residual_per_path"][1] is None


def test_pathrelax_pair_runs_their_tree_and_refuses_another():
    """Ours runs their Grouped_Tree_2 (2 paths of 12, random fresh drafts) on the SJD peers' tiny Lumina; the export
    refuses another tree, the worker side another method."""
    from eval.bench.peers import pathrelax as glue

    assert comparison.PEERS["pathrelax"] == "eval.bench.peers.pathrelax"
    pair = glue.SPEC.pairs[0]
    ours = comparison.build_ours(glue, pair, {})
    assert (ours.drafter.paths, ours.draft_len, ours.drafter.init) == (2, 24, "random")
    payload = glue.export(ours, pair)
    assert payload["window"] == 25 and payload["grid"] == tuple(ours.model.grid)
    other = glue.SPEC.__class__(**{**glue.SPEC.__dict__, "pairs": (Pair(
        pair.ours, pair.theirs, overrides=(*pair.overrides, "decoder.drafter.paths=3", "decoder.draft_len=36")),)})
    wide = type(sys)("wide_pathrelax")
    wide.__dict__.update(glue.__dict__, SPEC=other)
    with pytest.raises(ValueError, match="decoder.drafter.paths=2 decoder.draft_len=24"):
        glue.export(comparison.build_ours(wide, other.pairs[0], {}), other.pairs[0])
    with pytest.raises(ValueError, match="no method"):
        glue.build(Path("."), payload, Pair("pathrelax", "lantern"))


# -- real peers (their clones needed) ---------------------------------------------------------------------------------
def peer_checkout(name: str) -> Path:
    """The clone of peer ``name`` under $COOLSD_PEERS, at its pinned commit; else skip with the command."""
    glue = comparison.load_glue(name)
    spec = glue.SPEC
    folder = os.environ.get("COOLSD_PEERS")
    where = Path(folder or "<peers>") / spec.repo.split("/")[1]
    if not folder or not where.is_dir():
        pytest.skip(f"needs a clone of {spec.repo}: {comparison.clone_command(spec, str(where))} and "
                    f"COOLSD_PEERS={where.parent}")
    comparison.check_checkout(spec, where)
    return where


def test_llamagen_generate_gives_our_ar_tokens_under_greedy_sampling():
    """With top-k 1 both sides are deterministic: their `generate` on our weights and our caption must give our AR
    decoder's tokens exactly (the same network, conditioning, CFG and token order)."""
    from eval.bench.peers import llamagen

    checkout = peer_checkout("llamagen")
    pair = llamagen.SPEC.pairs[0]
    spec = llamagen.SPEC
    greedy = spec.__class__(**{**spec.__dict__, "model_overrides": (*spec.model_overrides, "model.sampling.top_k=1")})
    glue = type(sys)("greedy_llamagen")
    glue.__dict__.update(llamagen.__dict__, SPEC=greedy)
    ours = comparison.build_ours(glue, pair, {})
    with comparison.PeerWorker() as worker:
        worker.ask("build", "eval.bench.peers.llamagen", str(checkout), llamagen.export(ours, pair), pair, 1)
        for prompt in ("a red bus", "a cat on a sofa"):
            theirs = worker.ask("run", llamagen.inputs(ours, prompt), 0)
            mine = ours.generate(prompt, 0)
            assert list(theirs.codes) == mine.tokens.flatten().tolist()
            assert theirs.target_forwards == mine.stats.target_forwards


def test_our_side_can_run_compiled_on_the_static_path_and_the_table_says_so():
    """``--compile`` builds ours with ``model.compile=true`` (on the static path: the step compiled whole, its
    runner in compiled mode; a model of its own, not the uncompiled pairs' shared one), and the table's heading
    says so."""
    from eval.bench.peers import lantern as glue

    models: dict = {}
    plain = comparison.build_ours(glue, glue.SPEC.pairs[0], models, "static")
    ours = comparison.build_ours(glue, glue.SPEC.pairs[0], models, "static", compiled=True)
    assert ours.static.mode == "compiled" and ours.model.compile and ours.model is not plain.model
    assert plain.static.mode == "eager" and not plain.model.compile
    meta = {"device": "CPU", "command": "c", "date": "d", "prompts": 20, "seed": 0, "warmup": 2, "threads": 1,
            "cpu": "x", "torch": "t", "transformers": "v", "path": "static", "compiled": True}
    text = comparison.markdown([], {}, meta, {})
    assert text.startswith("# Each decoder against its authors' code (CPU, ours on the static decode path, "
                           "compiled (`model.compile=true`))")
