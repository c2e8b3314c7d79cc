"""The EAGLE drafter: guided q, cache/position plumbing, checkpoints (ours and LANTERN's), training data,
training (accumulation, resume, it actually helps) and the Hydra wiring.

Runs in about 60 s on one CPU core; the torchrun (DDP, gloo) run is marked slow.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from baselines.exact import ExactRule
from coolsd.decoding import Decoder
from coolsd.rng import Streams
from coolsd.drafters.eagle import EagleDrafter, EagleHead, load_eagle, resolve_checkpoint, save_eagle
from coolsd.models.checkpoints import MissingWeightsError
from coolsd.models.llamagen import apply_rope, rope_2d_table
from coolsd.sampling import logits_to_probs, stream_probs
from coolsd.training import data as dd
from coolsd.training import drafter as td
from tests.helpers import CONFIGS, tiny_llamagen

ROOT = CONFIGS.parent


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train_drafter", overrides=["model.device=cpu", "wandb.mode=disabled",
                                                                "train.progress=false", *overrides])


def random_codes(path: Path, count: int, model, seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, model.codebook_size, (count, model.num_image_tokens), generator=gen)
    save_file({"codes": codes, "labels": torch.arange(count) % 10}, str(path))
    return path


class RecordingDrafter(EagleDrafter):
    """Keeps (position, q of the first draft) of every iteration."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_q: list[tuple[int, torch.Tensor]] = []

    def propose(self, last_tokens, t, limit, depth, tree=None):
        draft = super().propose(last_tokens, t, limit, depth, tree)
        if draft.draft_len:
            self.first_q.append((int(t[0]) - 1, draft.q[0, 0].clone()))
        return draft


# -- the drafter -----------------------------------------------------------------------------------------
def test_guided_q_is_the_guidance_formula_applied_to_its_two_streams():
    model = tiny_llamagen("float64", temperature=0.8, top_k=50)  # CFG scale 2
    head = EagleHead(model, init_seed=1)
    drafter = EagleDrafter(model, head=head)
    _, out = model.prefill(["three"])
    drafter.begin(["three"], out, torch.tensor([5]), Streams([0], "cpu"))
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 3, model.hidden_size, generator=gen, dtype=torch.float64)  # (S, T, H)
    tokens, positions = torch.tensor([5, 9, 2]), torch.tensor([-1, 0, 1])
    q = drafter.step(features[:, None], tokens[None], positions[None]).q[0]  # (T, V)
    with torch.no_grad():  # each stream alone, teacher-forced (no cache)
        cond = head.logits(head(features[:1], tokens, positions))[0]
        uncond = head.logits(head(features[1:], tokens, positions))[0]
    s = model.sampling.cfg_scale
    expected = logits_to_probs(uncond + s * (cond - uncond), model.sampling)
    torch.testing.assert_close(q, expected, rtol=1e-6, atol=1e-7)
    # a broken variant (the conditional stream alone) is far from it
    assert (logits_to_probs(cond, model.sampling) - q).abs().max() > 1e-2


def test_chain_drafts_match_the_teacher_forced_drafter_and_trees_reuse_the_step(tiny_model):
    """Cached drafting (pending pairs, rollback, pair positions) equals one teacher-forced pass."""
    head = EagleHead(tiny_model, init_seed=3)
    drafter = RecordingDrafter(tiny_model, head=head)
    gen = Decoder("sd", tiny_model, ExactRule(), draft_len=3, drafter=drafter).generate("two", seed=5)
    assert gen.stats.mean_accepted_length >= 1.0 and gen.stats.drafter_forwards > 0
    hidden = tiny_model.teacher_force(["two"], gen.tokens[None])[0]  # (S, N+1, H)
    with torch.no_grad():
        f_hat = head(hidden[:, :-1], gen.tokens, dd.pair_positions(gen.tokens.shape[0], "cpu"))
        q_tf = stream_probs(head.logits(f_hat), tiny_model.sampling)  # pair j -> token j + 1
    assert len(drafter.first_q) > 10
    for position, q in drafter.first_q:
        torch.testing.assert_close(q, q_tf[position], rtol=1e-9, atol=1e-12)
    # a one-path static tree drafts exactly like the chain (same expansions, same random draws)
    chain = Decoder("sd", tiny_model, ExactRule(), draft_len=5, drafter=EagleDrafter(tiny_model, head=head))
    tree = Decoder("sd", tiny_model, ExactRule(), draft_len=5, tree="chain",
                   drafter=EagleDrafter(tiny_model, head=head))
    a, b = chain.generate("one", seed=3), tree.generate("one", seed=3)
    assert torch.equal(a.tokens, b.tokens) and a.stats.accepted_hist == b.stats.accepted_hist


@pytest.mark.parametrize("tree", [None, "mc_sim_7b_63", "dynamic"])
def test_greedy_sd_with_the_eagle_drafter_equals_greedy_ar(tree):
    model = tiny_llamagen("float64", temperature=0.0)
    ar = Decoder("ar", model, ExactRule()).generate("seven", seed=0).tokens
    drafter = EagleDrafter(model, head=EagleHead(model, init_seed=4))
    sd = Decoder("sd", model, ExactRule(), draft_len=4, tree=tree, drafter=drafter).generate("seven", seed=0)
    assert torch.equal(sd.tokens, ar)


def test_pair_t_gets_the_targets_rotation_of_token_t_plus_1(tiny_model):
    layer = tiny_model.make_draft_layer()
    c, n = tiny_model.cfg.cls_token_num, tiny_model.num_image_tokens
    for t in range(-1, n - 1):
        assert torch.equal(layer.freqs_cis[t + 1], tiny_model.gpt.freqs_cis[c + t + 1])
    assert not layer.freqs_cis[n].any()  # past the grid: the reference's zero padding row


def test_prefix_all_equals_last_on_a_one_slot_condition_and_needs_prefix_states(tiny_model, tmp_path):
    """A class-conditional LlamaGen has one condition slot: both conventions feed the same pairs. An adapter
    whose prefill has no ``prefix_hidden`` refuses ``prefix: all``; a checkpoint records its convention."""
    head = EagleHead(tiny_model, init_seed=2)
    out = {}
    for prefix in ("last", "all"):
        head.prefix = prefix
        drafter = RecordingDrafter(tiny_model, head=head, prefix=prefix)
        out[prefix] = Decoder("sd", tiny_model, ExactRule(), draft_len=3, drafter=drafter).generate("two", seed=1)
        out[prefix + "_q"] = drafter.first_q
        assert drafter.cache.max_len == 1 + tiny_model.num_image_tokens + 2 * drafter.extra_slots
    assert torch.equal(out["last"].tokens, out["all"].tokens)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(out["last_q"], out["all_q"]))
    from coolsd.models.lookup import LookupModel

    lookup = LookupModel(vocab=3, grid=(2, 2), sampling={"cfg_scale": 1.0})
    _, first = lookup.prefill("x")
    with pytest.raises(ValueError, match="prefix_hidden"):
        lookup.prefix_states(first, "all")
    head.prefix = "all"
    save_eagle(head, tmp_path / "all")
    assert json.loads((tmp_path / "all" / "config.json").read_text())["prefix"] == "all"
    with pytest.raises(ValueError, match="trained with prefix='all'"):
        EagleDrafter(tiny_model, checkpoint=str(tmp_path / "all"))  # drafter.prefix defaults to last
    assert EagleDrafter(tiny_model, checkpoint=str(tmp_path / "all"), prefix="all").head.prefix == "all"
    with pytest.raises(ValueError, match="prefix must be one of"):
        EagleDrafter(tiny_model, head=EagleHead(tiny_model), prefix="first")


# -- checkpoints -----------------------------------------------------------------------------------------
def test_save_load_round_trip_gives_identical_logits(tiny_model, tmp_path):
    head = EagleHead(tiny_model, init_seed=6)
    save_eagle(head, tmp_path / "ckpt", training={"steps": 0})
    loaded = EagleDrafter(tiny_model, checkpoint=str(tmp_path / "ckpt")).head
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(2, 7, tiny_model.hidden_size, generator=gen, dtype=torch.float64)
    tokens, positions = torch.randint(0, tiny_model.codebook_size, (7,), generator=gen), torch.arange(-1, 6)
    with torch.no_grad():
        assert torch.equal(loaded.logits(loaded(features, tokens, positions)),
                           head.logits(head(features, tokens, positions)))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["hidden_size"] == tiny_model.hidden_size and config["target"].endswith("LlamaGen")
    assert not any(k.startswith(("gpt.", "target")) for k in load_file(str(tmp_path / "ckpt" / "model.safetensors")))


def reference_llama_drafter(w: dict[str, torch.Tensor], eps: float, heads: int, features, tokens, positions,
                            grid: int, base: float) -> torch.Tensor:
    """HF-Llama / EAGLE semantics written out from the released key names (no input norm, 2-D RoPE of
    cell t + 1, causal attention, SwiGLU MLP, no final norm)."""
    h = F.linear(torch.cat([w["embed_tokens.weight"][tokens][None].expand(features.shape[0], -1, -1), features],
                           -1), w["fc.weight"], w["fc.bias"])  # (B, T, H)
    b, t, dim = h.shape
    hd = dim // heads
    table = rope_2d_table(grid, hd, base, prefix=0)[positions + 1]
    q = apply_rope(F.linear(h, w["layers.0.self_attn.q_proj.weight"]).view(b, t, heads, hd), table).transpose(1, 2)
    k = apply_rope(F.linear(h, w["layers.0.self_attn.k_proj.weight"]).view(b, t, heads, hd), table).transpose(1, 2)
    v = F.linear(h, w["layers.0.self_attn.v_proj.weight"]).view(b, t, heads, hd).transpose(1, 2)
    att = (q @ k.transpose(-1, -2) / hd**0.5).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    a = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, dim)
    h = h + F.linear(a, w["layers.0.self_attn.o_proj.weight"])
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w["layers.0.post_attention_layernorm.weight"]
    mlp = F.linear(F.silu(F.linear(x, w["layers.0.mlp.gate_proj.weight"])) * F.linear(x, w["layers.0.mlp.up_proj.weight"]),
                   w["layers.0.mlp.down_proj.weight"])
    return h + mlp


def test_a_lantern_named_checkpoint_loads_and_computes_the_reference_layer(tiny_model, tmp_path):
    h, v = tiny_model.hidden_size, tiny_model.codebook_size
    inter = tiny_model.make_draft_layer().intermediate_size
    gen = torch.Generator().manual_seed(2)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.1

    weights = {  # jadohu/LANTERN cnets_llamagen.Model state-dict names (no input_layernorm on layer 0)
        "fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h), "embed_tokens.weight": rnd(v, h),
        "layers.0.self_attn.q_proj.weight": rnd(h, h), "layers.0.self_attn.k_proj.weight": rnd(h, h),
        "layers.0.self_attn.v_proj.weight": rnd(h, h), "layers.0.self_attn.o_proj.weight": rnd(h, h),
        "layers.0.mlp.gate_proj.weight": rnd(inter, h), "layers.0.mlp.up_proj.weight": rnd(inter, h),
        "layers.0.mlp.down_proj.weight": rnd(h, inter), "layers.0.post_attention_layernorm.weight": 1 + rnd(h),
    }
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": tiny_model.cfg.n_head,
              "num_key_value_heads": tiny_model.cfg.n_head, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": v, "model_type": "llama"}
    folder = tmp_path / "lantern"
    folder.mkdir()
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))
    head = load_eagle(tiny_model, str(folder))
    assert head.embedding is not None and torch.equal(head.embedding, weights["embed_tokens.weight"])
    features = rnd(2, 9, h)
    tokens, positions = torch.randint(0, v, (9,), generator=gen), torch.arange(-1, 8)
    with torch.no_grad():
        ours = head(features, tokens, positions)
    expected = reference_llama_drafter(weights, 1e-6, tiny_model.cfg.n_head, features, tokens, positions,
                                       tiny_model.grid[0], tiny_model.cfg.rope_base)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)  # RMSNorm and RoPE run in float32
    # an architecture mismatch is refused with the differing field named
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": inter + 32}))
    with pytest.raises(ValueError, match="intermediate_size"):
        load_eagle(tiny_model, str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "input_type": "t2i"}))  # a 16x16-grid drafter
    with pytest.raises(ValueError, match="input_type"):
        load_eagle(tiny_model, str(folder))


def test_a_missing_drafter_names_the_file_and_the_command(tiny_model, tmp_path):
    with pytest.raises(MissingWeightsError, match=r"config\.json.*scripts/train_drafter\.py.*jadohu/llamagen_drafter"):
        EagleDrafter(tiny_model, checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(MissingWeightsError, match="hf download jadohu/llamagen_drafter"):
        resolve_checkpoint("hub:jadohu/llamagen_drafter")  # tests run with HF_HUB_OFFLINE=1


def test_decoders_load_the_eagle_drafter_by_config(tiny_model, tmp_path):
    save_eagle(EagleHead(tiny_model), tmp_path / "ckpt")
    names = [p.stem for p in sorted((CONFIGS / "decoder").glob("*.yaml"))
             if OmegaConf.to_container(OmegaConf.load(p)).get("drafter") == "${drafter}"]
    assert "sd" in names
    for name in names:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"decoder={name}", "drafter=eagle",
                                                           f"drafter.checkpoint={tmp_path / 'ckpt'}"])
        decoder = instantiate(cfg.decoder, model=tiny_model)
        assert isinstance(decoder.drafter, EagleDrafter), name


# -- training data ---------------------------------------------------------------------------------------
def test_data_generation_resumes_without_duplicating_or_losing_shards(tiny_model, tmp_path, monkeypatch):
    data = dd.DistillConfig(num_samples=5, shard_size=2, storage_dtype="float32")  # 3 shards, self-distilled
    prompts = tiny_model.class_names
    reference = dd.generate_data(tiny_model, data, tmp_path / "ref", prompts, progress=False)
    real_make_shard, calls = dd.make_shard, []

    def crash_on_third(*args, **kwargs):
        calls.append(args[2].index)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_make_shard(*args, **kwargs)

    monkeypatch.setattr(dd, "make_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        dd.generate_data(tiny_model, data, tmp_path / "run", prompts, progress=False)
    run = tmp_path / "run"
    manifest = dd.read_manifest(run)
    assert sorted(manifest["shards"]) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    # a crash between a shard's rename and the manifest update, and a write killed mid-way
    del manifest["shards"]["shard_00001.safetensors"]
    dd.write_manifest(run, manifest)
    (run / ".shard_00002.safetensors.x1y2.tmp").write_bytes(b"torn")
    calls.clear()
    monkeypatch.setattr(dd, "make_shard", lambda *a, **k: (calls.append(a[2].index), real_make_shard(*a, **k))[1])
    manifest = dd.generate_data(tiny_model, data, run, prompts, progress=False)
    assert calls == [1, 2]  # shard 0 was skipped
    assert manifest["shards"] == reference["shards"] and not list(run.glob("*.tmp"))
    indices = torch.cat([load_file(str(run / n))["sample_index"] for n in sorted(manifest["shards"])])
    assert indices.tolist() == [0, 1, 2, 3, 4]
    for name in manifest["shards"]:
        ours, ref = load_file(str(run / name)), load_file(str(tmp_path / "ref" / name))
        assert all(torch.equal(ours[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="other settings"):
        dd.generate_data(tiny_model, dd.DistillConfig(num_samples=6, shard_size=2, storage_dtype="float32"), run,
                         prompts)


def test_retrained_target_weights_do_not_reuse_stale_samples(tmp_path):
    """Same config and checkpoint path, new weights (a retrained target): the stored features are stale."""
    model = tiny_llamagen()
    data = dd.DistillConfig(num_samples=2, shard_size=2, storage_dtype="float32")
    dd.generate_data(model, data, tmp_path, model.class_names, progress=False)
    dd.generate_data(model, data, tmp_path, model.class_names, progress=False)  # unchanged: resumes
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="weights_sha1"):
        dd.generate_data(model, data, tmp_path, model.class_names, progress=False)


def test_image_source_encodes_images_through_the_vq_and_teacher_forces(tiny_model, tmp_path):
    side = tiny_model.grid[0] * tiny_model.vq.downsample_factor
    images = torch.randint(0, 256, (3, 3, side, side), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    save_file({"images": images, "labels": torch.tensor([4, 1, 7])}, str(tmp_path / "images.safetensors"))
    data = dd.DistillConfig(source="images", images_path=str(tmp_path / "images.safetensors"), num_samples=3,
                         shard_size=4, storage_dtype="float32")
    manifest = dd.generate_data(tiny_model, data, tmp_path / "data", [], progress=False)
    shard = load_file(str(tmp_path / "data" / next(iter(manifest["shards"]))))
    codes = tiny_model.vq.encode_to_indices(images.float() / 127.5 - 1.0)
    assert torch.equal(shard["tokens"], codes)
    expected = tiny_model.teacher_force(["1"], codes[1][None])[0].float()  # label 1 -> prompt "1"
    assert torch.equal(shard["hidden"][1], expected)
    assert shard["hidden"].shape == (3, 2, tiny_model.num_image_tokens + 1, tiny_model.hidden_size)


# -- training --------------------------------------------------------------------------------------------
def test_gradient_accumulation_equals_one_big_batch(tiny_model):
    gen = torch.Generator().manual_seed(0)
    n, h = tiny_model.num_image_tokens, tiny_model.hidden_size
    batch = dd.Batch(tokens=torch.randint(0, tiny_model.codebook_size, (8, n), generator=gen),
                     features=torch.randn(8, n, h, generator=gen, dtype=torch.float64),
                     targets=torch.randn(8, n, h, generator=gen, dtype=torch.float64))

    def part(lo, hi):
        return dd.Batch(batch.tokens[lo:hi], batch.features[lo:hi], batch.targets[lo:hi])

    def stepped(micro):
        cfg = td.TrainConfig(grad_clip=0.0, noise_std=0.0, grad_accum=len(micro))
        accelerator = td.make_accelerator(cfg, tiny_model.device)
        head = EagleHead(tiny_model, init_seed=0)
        before = [p.detach().clone() for p in head.parameters()]
        optimizer = torch.optim.SGD(head.parameters(), lr=1.0)  # parameter change = −gradient
        net, optimizer = accelerator.prepare(head, optimizer)
        td.train_step(accelerator, net, head, micro, optimizer, None, cfg)
        return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, head.parameters())])

    full = stepped([batch])
    accumulated = stepped([part(0, 4), part(4, 8)])
    torch.testing.assert_close(accumulated, full, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(stepped([part(4, 8)]), full, rtol=1e-3)  # a "last micro-batch only" bug


def test_training_resumes_exactly_after_an_interruption(tiny_model, tmp_path, monkeypatch):
    codes = random_codes(tmp_path / "codes.safetensors", 8, tiny_model)
    common = ["distill.source=images", f"distill.images_path={codes}", f"distill.dir={tmp_path / 'data'}",
              "distill.num_samples=8", "distill.shard_size=4", "distill.storage_dtype=float32", "train.steps=12",
              "train.batch_size=2", "train.checkpoint_every=6", "train.val_every=1000", "train.lr=1e-3",
              "train.warmup_steps=3", "val.at_start=false", "val.num_images=1"]
    straight = td.run(compose_train(*common, f"out_dir={tmp_path / 'a'}"), model=tiny_model)
    real_step, calls = td.train_step, []

    def crash_after_eight(*args, **kwargs):
        calls.append(1)
        if len(calls) > 8:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(td, "train_step", crash_after_eight)
    with pytest.raises(KeyboardInterrupt):
        td.run(compose_train(*common, f"out_dir={tmp_path / 'b'}"), model=tiny_model)
    assert td.latest_checkpoint(tmp_path / "b").name == "step_0000006"
    monkeypatch.setattr(td, "train_step", real_step)
    td.run(compose_train(*common, f"out_dir={tmp_path / 'b'}", "resume=true"), model=tiny_model)
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = tmp_path / "a" / "steps" / "step_0000012"
    assert straight.steps == 12 and json.loads((last / "trainer.json").read_text()) == {"step": 12, "cursor": 24}
    assert {p.name for p in last.iterdir()} == {"config.json", "model.safetensors", "trainer.json", "state"}
    assert {p.name for p in (last / "state").iterdir()} == {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"}


def test_a_resumed_training_reports_the_original_pre_training_validation(tiny_model, tmp_path, monkeypatch):
    """`before` (the validation at step 0) travels with the step checkpoints: a resumed run reports and
    writes the original one, not `{}` (printed as `before nan`)."""
    codes = random_codes(tmp_path / "codes.safetensors", 8, tiny_model)
    common = ["distill.source=images", f"distill.images_path={codes}", f"distill.dir={tmp_path / 'data'}",
              "distill.num_samples=8", "distill.shard_size=4", "distill.storage_dtype=float32", "train.steps=6",
              "train.batch_size=2", "train.checkpoint_every=3", "train.val_every=1000", "train.lr=1e-3",
              "train.warmup_steps=2", "val.at_start=true", "val.num_images=1", "val.max_samples=2"]
    straight = td.run(compose_train(*common, f"out_dir={tmp_path / 'a'}"), model=tiny_model)
    assert set(straight.before) == {"val/accepted_length", "val/agreement"}
    real_step, calls = td.train_step, []

    def crash_after_four(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(td, "train_step", crash_after_four)
    with pytest.raises(KeyboardInterrupt):
        td.run(compose_train(*common, f"out_dir={tmp_path / 'b'}"), model=tiny_model)
    monkeypatch.setattr(td, "train_step", real_step)
    latest = td.latest_checkpoint(tmp_path / "b")
    assert latest.name == "step_0000003" and td.stored_before(latest) == straight.before
    # a checkpoint written before `before` was stored: measured again on the untrained head
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    old = td.latest_checkpoint(tmp_path / "c") / "config.json"
    config = json.loads(old.read_text())
    del config["training"]["before"]
    old.write_text(json.dumps(config))
    for name in ("b", "c"):
        resumed = td.run(compose_train(*common, f"out_dir={tmp_path / name}", "resume=true"), model=tiny_model)
        assert resumed.before == straight.before, name
        written = json.loads((tmp_path / name / "config.json").read_text())["training"]["before"]
        assert written == straight.before, name


def train_tiny(tmp_path: Path, init_std: float) -> td.TrainResult:
    """300 CPU steps on 256 random-code sequences teacher-forced through the tiny model (float32)."""
    model = tiny_llamagen("float32")
    codes = random_codes(tmp_path / "codes.safetensors", 256, model, seed=1)
    cfg = compose_train(
        f"model.init_std={init_std}", "distill.source=images", f"distill.images_path={codes}",
        f"distill.dir={tmp_path / 'data'}", f"out_dir={tmp_path / 'drafter'}", "distill.num_samples=256",
        "distill.shard_size=64", "distill.storage_dtype=float32", "train.steps=300", "train.batch_size=8",
        "train.lr=3e-3", "train.warmup_steps=20", "train.noise_std=0", "train.uncond_prob=0.5",
        "train.checkpoint_every=300", "train.val_every=1000", "val.num_images=32")
    result = td.run(cfg)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["training"]["after"] == result.after
    trained = instantiate(OmegaConf.create({"_target_": "coolsd.drafters.eagle.EagleDrafter", "_partial_": True,
                                            "checkpoint": str(tmp_path / "drafter")}))
    assert isinstance(trained(target=instantiate(cfg.model)), EagleDrafter)
    return result


@pytest.mark.slow  # trains a head (CI's -m slow pass; the CLI smoke test trains in the default suite)
def test_training_raises_the_accepted_length(tmp_path):
    """A few hundred CPU steps lift the real SD accepted length (draft_len 4, 32 held-out prompt/seed pairs)
    above the untrained head with the same init seed. Measured on the random-weight tiny model:
    1.497 -> 1.563 with this project's per-image random streams (1.428 -> 1.631 on 8 pairs with the earlier
    shared generator), agreement 1 − TV 0.330 -> 0.372. Its next-token distribution is a near-chaotic
    function of the context (init_std 0.2), so even a well-trained head gains little beyond the marginal;
    the smoother variant below shows the larger effect."""
    result = train_tiny(tmp_path, init_std=0.2)
    before, after = result.before["val/accepted_length"], result.after["val/accepted_length"]
    assert after - before > 0.03, (before, after)
    assert result.after["val/agreement"] > result.before["val/agreement"] + 0.02


@pytest.mark.slow
def test_training_raises_the_accepted_length_of_a_smoother_target(tmp_path):
    """The tiny architecture with init_std 0.1 (learnable structure): measured 2.083 -> 2.453 with
    transformers' warm-up + cosine (2.083 -> 2.523 with the hand-written schedule it replaced, whose warm-up
    ran one step earlier; with that schedule the accelerate loop gives the old loop's weights bit for bit)."""
    result = train_tiny(tmp_path, init_std=0.1)
    before, after = result.before["val/accepted_length"], result.after["val/accepted_length"]
    assert after - before > 0.3, (before, after)


def test_cli_smoke_data_training_validation_and_wandb(tmp_path):
    """``scripts/train_drafter.py`` in one process: self-distilled data, 2 steps, the report line, an offline
    W&B run, the per-model default folders relative to the working directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_drafter.py"), "model=tiny",
                           "model.device=cpu", "wandb.mode=offline", "train.progress=false", "distill.num_samples=4",
                           "distill.shard_size=2", "distill.storage_dtype=float32", "train.steps=2",
                           "train.batch_size=2", "val.num_images=1", f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "drafter written to checkpoints/drafter_tiny after 2 steps" in proc.stdout
    assert "accepted length (sd, draft_len=4) before" in proc.stdout and "INFO" not in proc.stdout
    out = tmp_path / "checkpoints" / "drafter_tiny"
    assert (out / "model.safetensors").is_file() and (out / "steps" / "step_0000002" / "trainer.json").is_file()
    assert (tmp_path / "outputs" / "drafter_data" / "tiny" / "manifest.json").is_file()
    assert list((out / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_torchrun_ddp_on_cpu(tmp_path):
    model = tiny_llamagen("float32")
    codes = random_codes(tmp_path / "codes.safetensors", 16, model)
    common = ["model.device=cpu", "wandb.mode=offline", "train.progress=false", "distill.source=images",
              f"distill.images_path={codes}", f"distill.dir={tmp_path / 'data'}", "distill.num_samples=16",
              "distill.shard_size=4", "distill.storage_dtype=float32", f"out_dir={tmp_path / 'out'}",
              "train.steps=6", "train.batch_size=2", "train.checkpoint_every=3", "val.num_images=1",
              f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    script = str(ROOT / "scripts" / "train_drafter.py")
    subprocess.run([sys.executable, script, "stage=data", *common], cwd=ROOT, env=env, check=True, timeout=300)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           script, "stage=train", *common], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accepted length" in proc.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    # resumed at step 3 (each rank restores its own RNG state and data cursor): byte-identical final weights
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "out" / "steps" / "step_0000003", resumed / "steps" / "step_0000003")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           script, "stage=train", *common, f"out_dir={resumed}", "resume=true"], check=False,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
