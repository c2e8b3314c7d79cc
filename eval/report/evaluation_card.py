"""The evaluation card: the protocol that made a run's numbers, as one small ordered dict.

Users of the field's repositories ask most often which protocol produced a number (deepseek-ai/Janus#22: the
FID protocol was given only in an issue). Every run knows it; the card states it in one place: the prompts,
the number of images per decoder and the timed subset, the seed policy, the FID/KID reference set and its
size, the resize and crop, the feature extractor and its weights, the other scorers (CLIP score, ImageReward,
HPSv2.1, class accuracy), the model's sampling (CFG scale, top-k, top-p, temperature), precision and device.

``evaluation_card(config, run)`` builds it from a resolved config (``configs/config.yaml`` composed) and, where
a run exists, its ``run.json`` record (the device a run resolved, the hardware, the reference size the FID
metric counted); ``record_card(record)`` builds it from a ``run.json`` alone, so the tables make cards for runs
that predate it. Values are strings, numbers or null: ``None`` where a field does not apply (no FID under
``eval=quick``: the card says "no image metrics"), ``NOT_RECORDED`` where the record does not say (old records
without their ``eval`` or ``model`` config). ``eval.run.experiment`` writes it to
``run.json["evaluation_card"]`` and prints ``card_lines`` under the run's table; ``eval.report.paper_tables``
puts it in every table's notes.

``card_key`` is the part of a card that must agree for two rows' numbers to share a column of one model's
group in a table (``eval.report.paper_tables``): everything that changes an image or a number — prompts, images
per decoder, timed subset and warm-up, the decode path (eager or static: latencies and speedups of the two are not
comparable), seeds, bootstrap, the reference set and size, resize and crop, extractor
and weights, the other scorers, CFG scale, top-k, top-p, temperature and precision (a bfloat16 and a float32 run
sample other tokens), how AR was timed (``AR timing``: in every run, or once per table and GPU kind), and the GPU
model (``GPU``: a latency column must not mix an A100's and an H100's seconds; the tables refuse it unless told,
``--mixed-hardware``, and then say so in the caption). Left out: the device, the full hardware text (CPU model and
threads) and world size (the last bits of the arithmetic are tracked separately, ``coolsd.numerics`` and the
tables' ‡ mark), the batch size of the untimed images (images do not depend on it) and the "image metrics"
summary (each scorer has its own field). A field that is ``None`` or ``NOT_RECORDED`` in either card never conflicts: a row without FID has no
FID to compare.

Example: ``python run.py`` prints the default run's card under its table; ``record_card(json.load(open(
"outputs/<date>/<time>/run.json")))`` rebuilds it from a record.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NOT_RECORDED = "not recorded"

#: every field of a card, in order
FIELDS = ("prompts", "images per decoder", "timed images", "timing", "AR timing", "decode path", "batch size",
          "image seeds", "bootstrap",
          "image metrics", "reference set", "reference images", "resize and crop", "feature extractor",
          "extractor weights", "CLIP score", "ImageReward", "HPS", "class accuracy", "CFG scale", "top-k", "top-p",
          "temperature", "precision", "device", "GPU", "hardware", "world size")
#: fields that may differ between rows of one table column (module doc says why)
UNKEYED = ("batch size", "image metrics", "device", "hardware", "world size")
KEY_FIELDS = tuple(f for f in FIELDS if f not in UNKEYED)

#: ``coolsd.sampling.SamplingConfig``'s defaults: what a model's ``sampling`` block leaves out
SAMPLING_DEFAULTS = {"cfg_scale": 1.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
#: reference feature files shipped with the embedded model (``eval/studies/embedded.py`` made them)
KNOWN_REFERENCES = {
    "fid_reference_classifier_test2000.npy": ("Fashion-MNIST test images, class-balanced (200 per class)", 2000),
    "fid_reference_test500.npy": ("Fashion-MNIST test images, class-balanced (50 per class)", 500),
}
COCO_VAL_IMAGES = 5000
INCEPTION_WEIGHTS = "pt_inception-2015-12-05"


def _plain(config: Any) -> dict[str, Any]:
    """A resolved config as plain containers (a DictConfig is resolved here)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True)


def _target(spec: Mapping[str, Any]) -> str:
    """The class name of a config's ``_target_`` (``eval.metrics.FIDKID`` -> ``FIDKID``)."""
    return str(spec.get("_target_") or "").rsplit(".", 1)[-1]


def _file_name(path: Any) -> str:
    """A path's file name (paths differ between machines; the card names the file)."""
    return Path(str(path)).name


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


# ------------------------------------------------------------------------------------------------ prompts


def prompts_text(data: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """The prompt set of ``configs/data/*.yaml`` (``coolsd.prompts``) in words."""
    kind = _target(data)
    if kind == "ClassPrompts":
        names = list(model.get("class_names") or [])
        return f"the model's {len(names)} class names, cycled" if names else "the model's class names, cycled"
    if kind == "CocoCaptions":
        selection = data.get("selection", "longest")
        how = ("the longest caption per image, images by id" if selection == "longest"
               else f"one random caption per image (seed {data.get('seed', 0)})")
        return f"MS-COCO captions ({_file_name(data.get('path'))}), {how}"
    if kind == "FixedPrompts":
        prompts = [str(p) for p in data.get("prompts") or []]
        digest = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:10]
        shown = ", ".join(repr(p) for p in prompts[:3]) + (", ..." if len(prompts) > 3 else "")
        return f"{_count(len(prompts), 'prompt')} written in the config ({shown}; sha1 {digest}), cycled"
    if kind == "FilePrompts":
        return f"the prompt file {_file_name(data.get('path'))}, one prompt per line"
    if kind == "PartiPrompts":
        category = data.get("category")
        return f"PartiPrompts ({_file_name(data.get('path'))}), " + (f"category {category}" if category
                                                                       else "every category")
    return kind or NOT_RECORDED


# ---------------------------------------------------------------------------------------------- metrics


def metric_name(spec: Mapping[str, Any]) -> str:
    """What a metric of ``eval.metrics`` reports, as the tables title it."""
    kind = _target(spec)
    if kind == "FIDKID":
        extractor = spec.get("extractor", "inception")
        return {"inception": "FID, KID", "classifier": "FID, KID (classifier features)"}.get(
            extractor, f"FID, KID ({extractor} features, not an FID)")
    return {"CLIPScore": "CLIP score", "ImageReward": "ImageReward", "HPSv2": "HPSv2.1",
            "ClassAccuracy": "class accuracy"}.get(kind, kind)


def reference_text(spec: Mapping[str, Any]) -> str:
    """The FID/KID reference set in words (no machine's path)."""
    if spec.get("reference_stats"):
        return f"precomputed statistics {_file_name(spec['reference_stats'])} (clean-fid .npz: mean and covariance)"
    if spec.get("reference_features"):
        name = _file_name(spec["reference_features"])
        known = KNOWN_REFERENCES.get(name)
        return f"{known[0]}, features file {name}" if known else f"precomputed features {name}"
    folder = _file_name(str(spec.get("reference_dir", "")).rstrip("/"))
    return "MS-COCO 2017 val images (val2017)" if folder == "val2017" else f"the images of the folder {folder}"


def reference_size(spec: Mapping[str, Any]) -> int | None:
    """The number of reference images from the config alone: a shipped features file's, else the file's rows,
    else the folder's images (capped by ``max_reference``); None when it cannot be known here."""
    if spec.get("reference_stats"):
        return spec.get("reference_count")
    if spec.get("reference_features"):
        name = _file_name(spec["reference_features"])
        if name in KNOWN_REFERENCES:
            return KNOWN_REFERENCES[name][1]
        path = Path(str(spec["reference_features"])).expanduser()
        if path.is_file():
            import numpy as np

            return int(np.load(path, mmap_mode="r").shape[0])
        return None
    cap = spec.get("max_reference")
    folder = Path(str(spec.get("reference_dir", ""))).expanduser()
    if folder.is_dir():
        from eval.metrics.base import IMAGE_SUFFIXES

        n = sum(1 for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    elif folder.name == "val2017":
        n = COCO_VAL_IMAGES
    else:
        return cap
    return min(n, cap) if cap else n


def resize_text(spec: Mapping[str, Any]) -> str:
    """The FID pipeline's resize and crop (``eval.metrics.fid``, ``eval.metrics.images``)."""
    size = spec.get("image_size", 256)
    protocol, extractor = spec.get("protocol", "clean"), spec.get("extractor", "inception")
    if protocol == "clean":
        return (f"centre square crop (offsets rounded), LANCZOS to {size} px (LANTERN's), then clean-fid "
                "mode=clean: PIL bicubic on float images to 299 px")
    crop = f"centre square crop (offsets floored), bicubic to {size} px"
    if extractor == "inception":
        return f"{crop}, then torch-fidelity's TF-1 bilinear resize to 299 px (protocol torch_fidelity)"
    if extractor == "classifier":
        return f"{crop} (none for 28-px images), grey (mean of RGB), no further resize (protocol torch_fidelity)"
    return f"{crop} (protocol torch_fidelity)"


def extractor_text(spec: Mapping[str, Any]) -> str:
    protocol, extractor = spec.get("protocol", "clean"), spec.get("extractor", "inception")
    if extractor == "inception":
        net = "clean-fid's InceptionV3W" if protocol == "clean" else "torch-fidelity's inception-v3-compat"
        return f"Inception-v3 ({net}), 2048-d pool features"
    if extractor == "classifier":
        return "the embedded model's Fashion-MNIST classifier, its 128-d penultimate layer (after ReLU)"
    return f"{extractor} features (a seeded random conv net: a plumbing check, not an FID)"


def weights_text(spec: Mapping[str, Any]) -> str:
    extractor, weights = spec.get("extractor", "inception"), spec.get("weights_path", "auto")
    if extractor == "inception":
        if weights in ("auto", None) or _file_name(weights).startswith(("inception-2015-12-05",
                                                                         INCEPTION_WEIGHTS)):
            return INCEPTION_WEIGHTS
        return f"file {_file_name(weights)}"
    if extractor == "classifier":
        return f"file {_file_name(weights)}"
    return f"random, seed {spec.get('seed', 1234)}"


def clip_text(spec: Mapping[str, Any]) -> str:
    pretrained = spec.get("pretrained", "openai")
    weights = "random weights (tests)" if not pretrained else (
        f"{pretrained} weights" if "/" not in str(pretrained) else f"weights file {_file_name(pretrained)}")
    size = spec.get("image_size", 256)
    path = f"LANTERN's centre crop + LANCZOS to {size} px" if size else "the raw image"
    return (f"open_clip {spec.get('model_name', 'ViT-B-32-quickgelu')}, {weights}, prefix "
            f"{spec.get('prefix', 'A photo depicts ')!r}, {path}, mean cosine")


def hub_text(pretrained: Any) -> str:
    if pretrained is None:
        return "random weights (tests)"
    text = str(pretrained)
    return f"hub {text.removeprefix('hub:')}" if text.startswith("hub:") else f"local {_file_name(text)}"


def image_reward_text(spec: Mapping[str, Any]) -> str:
    return f"ImageReward-v1.0 (BLIP ViT-L/16 + med BERT), {hub_text(spec.get('pretrained', 'hub:THUDM/ImageReward'))}"


def hps_text(spec: Mapping[str, Any]) -> str:
    version = spec.get("version", "v2.1")
    return (f"HPS{version} (open_clip {spec.get('model_name', 'ViT-H-14')}, "
            f"{hub_text(spec.get('pretrained', 'hub:xswu/HPSv2'))}), HPSv2's image path, "
            f"{'fp16 autocast' if spec.get('amp') else 'float32'}")


def accuracy_text(spec: Mapping[str, Any]) -> str:
    names = list(spec.get("class_names") or [])
    return f"Fashion-MNIST classifier (file {_file_name(spec.get('checkpoint'))}), {len(names)} classes"


def _joined(texts: Sequence[str]) -> str | None:
    """One field from several metrics of a kind (``None`` for none)."""
    return " + ".join(texts) if texts else None


# -------------------------------------------------------------------------------------------------- card


def evaluation_card(config: Any, run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The card of a resolved config (dict or DictConfig) and, where it ran, its ``run.json`` record ``run``.

    A config alone says what a run of it will do (device ``auto``, precision ``auto`` unresolved; no
    hardware); with ``run`` the device, precision, hardware, world size and the FID reference size are the
    run's. Fields in ``FIELDS`` order; the module doc says what ``None`` and ``NOT_RECORDED`` mean."""
    cfg = _plain(config)
    run = dict(run or {})
    card: dict[str, Any] = {}
    card.update(_eval_fields(cfg, run))
    card.update(_metric_fields(cfg.get("eval"), run))
    card.update(_sampling_fields(cfg.get("model")))
    card.update(_machine_fields(cfg.get("model"), run))
    return {f: card.get(f) for f in FIELDS}


def record_card(record: Mapping[str, Any]) -> dict[str, Any]:
    """The card of a ``run.json`` record (also one made before cards existed)."""
    return evaluation_card(record.get("config") or {}, record)


#: ``AR timing`` text of ``eval.ar_timing`` (``eval.run.experiment.ar_timing``)
AR_TIMING = {
    "run": "in this run, interleaved per prompt with the run's decoders (the speedup divides latencies of one process)",
    "table": ("once per table and GPU kind (eval.ar_timing=table): the row that claimed it times AR interleaved per "
              "prompt with its decoder; every other row times its decoder alone and divides that row's AR latency on "
              "the same prompts, seeds and GPU kind (run.json ar_timing names the row)"),
}

#: ``decode path`` text of a run's path and static steps (``eval.run.experiment.decode_path``)
DECODE_PATHS = {("eager", None): "eager (the papers' loop)", ("static", "graph"): "static, captured in CUDA graphs",
                ("static", "compiled"): "static, compiled whole", ("static", "eager"): "static, uncaptured steps"}


def _decode_path(cfg: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    """How a run's decoders ran: its record's ``decode_path`` and ``static_steps``, else its config's
    ``decoder.path`` (a record made before the option existed: eager)."""
    path = run.get("decode_path") or (cfg.get("decoder") or {}).get("path") or "eager"
    steps = run.get("static_steps") if path == "static" else None
    return DECODE_PATHS.get((path, steps), f"{path} path" + (f", {steps} steps" if steps else ""))


def _eval_fields(cfg: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    suite, data, model = cfg.get("eval"), cfg.get("data"), cfg.get("model") or {}
    per_decoder = run.get("per_decoder") or {}
    recorded_timed = next((m.get("num_timed") for m in per_decoder.values() if m.get("num_timed") is not None), None)
    out: dict[str, Any] = {"prompts": prompts_text(data, model) if data else NOT_RECORDED,
                           "decode path": _decode_path(cfg, run)}
    if not suite:  # a record made without its eval config: what the record itself counted
        uncertainty = run.get("uncertainty") or {}
        out.update({
            "images per decoder": run.get("num_prompts", NOT_RECORDED),
            "timed images": recorded_timed if recorded_timed is not None else NOT_RECORDED,
            "timing": NOT_RECORDED, "batch size": NOT_RECORDED, "image seeds": NOT_RECORDED,
            "bootstrap": _bootstrap_text(uncertainty) if uncertainty.get("resamples") else NOT_RECORDED})
        return out
    n = int(run.get("num_prompts") or suite.get("num_prompts") or 0)
    timed = min(suite.get("speed_prompts") or n, n)
    warmup = int(suite.get("warmup") or 0)
    out["images per decoder"] = n
    out["timed images"] = timed
    warm = f"after {_count(warmup, 'untimed warm-up image')} per decoder" if warmup else "no untimed warm-up image"
    out["timing"] = (f"{'every prompt' if timed == n else f'the first {timed:,} prompts'} at batch 1, decoders "
                     f"interleaved per prompt, {warm}")
    out["AR timing"] = AR_TIMING.get(suite.get("ar_timing", "run"), str(suite.get("ar_timing")))
    out["batch size"] = (f"the other {n - timed:,} images in batches of {suite.get('batch_size', 1)}"
                         if timed < n else None)
    out["image seeds"] = (f"image i: seed {suite.get('seed', 0)} + i (its own counter-based stream, coolsd.rng), "
                          "the same for every decoder")
    out["bootstrap"] = _bootstrap_text(suite.get("bootstrap") or {})
    return out


def _bootstrap_text(boot: Mapping[str, Any]) -> str:
    return (f"{int(boot.get('resamples', 1000)):,} resamples, seed {boot.get('seed', 0)}, "
            f"{100 * float(boot.get('level', 0.95)):g} % intervals, the same resampled prompts for every decoder")


def _metric_fields(suite: Mapping[str, Any] | None, run: Mapping[str, Any]) -> dict[str, Any]:
    scorers = ("reference set", "reference images", "resize and crop", "feature extractor", "extractor weights",
               "CLIP score", "ImageReward", "HPS", "class accuracy")
    if not suite:
        return {"image metrics": NOT_RECORDED, **{f: NOT_RECORDED for f in scorers}}
    specs = [dict(m) if isinstance(m, Mapping) else {"_target_": str(m)} for m in suite.get("metrics") or []]
    if not specs:
        return {"image metrics": "no image metrics", **{f: None for f in scorers}}
    fids = [s for s in specs if _target(s) == "FIDKID"]
    counted = next((m.get("fid_num_reference") for m in (run.get("per_decoder") or {}).values()
                    if m.get("fid_num_reference") is not None), None)
    sizes = [reference_size(s) for s in fids]
    if counted is not None and len(fids) == 1:
        sizes = [int(counted)]  # what the run's FID counted
    by_kind = {kind: [s for s in specs if _target(s) == kind] for kind in ("CLIPScore", "ImageReward", "HPSv2",
                                                                             "ClassAccuracy")}
    return {
        "image metrics": ", ".join(metric_name(s) for s in specs),
        "reference set": _joined([reference_text(s) for s in fids]),
        "reference images": (sizes[0] if len(sizes) == 1 else
                             _joined([f"{n:,}" if n is not None else "?" for n in sizes])),
        "resize and crop": _joined([resize_text(s) for s in fids]),
        "feature extractor": _joined([extractor_text(s) for s in fids]),
        "extractor weights": _joined([weights_text(s) for s in fids]),
        "CLIP score": _joined([clip_text(s) for s in by_kind["CLIPScore"]]),
        "ImageReward": _joined([image_reward_text(s) for s in by_kind["ImageReward"]]),
        "HPS": _joined([hps_text(s) for s in by_kind["HPSv2"]]),
        "class accuracy": _joined([accuracy_text(s) for s in by_kind["ClassAccuracy"]]),
    }


def _sampling_fields(model: Mapping[str, Any] | None) -> dict[str, Any]:
    names = {"CFG scale": "cfg_scale", "top-k": "top_k", "top-p": "top_p", "temperature": "temperature"}
    if not model:
        return {f: NOT_RECORDED for f in names}
    sampling = model.get("sampling") or {}
    return {f: sampling.get(key, SAMPLING_DEFAULTS[key]) for f, key in names.items()}


def _machine_fields(model: Mapping[str, Any] | None, run: Mapping[str, Any]) -> dict[str, Any]:
    platform = (run.get("numerics") or {}).get("platform") or {}
    env = run.get("environment") or {}
    device = str(platform["device"]).split(":")[0] if platform.get("device") else None
    if device is None and model:
        device = str(model.get("device", "auto"))
        if device == "auto" and run:  # a run record without the self-check: auto took CUDA where it was usable
            device = "cuda" if env.get("cuda") else "cpu"
    if device is None:
        device = NOT_RECORDED
    if not model:
        precision = NOT_RECORDED
    elif "dtype" not in model:
        precision = "the model's own (no model.dtype)"
    elif model["dtype"] != "auto":
        precision = str(model["dtype"])
    elif device in ("cuda", "cpu"):
        precision = "bfloat16" if device == "cuda" else "float32"
    else:
        precision = "auto (bfloat16 on CUDA, float32 on the CPU)"
    gpu = None
    if run:
        gpu = str(env["gpu"]) if env.get("gpu") else ("none (CPU)" if env else NOT_RECORDED)
    if not run:
        hardware, world = None, None
    elif env.get("gpu"):
        hardware, world = str(env["gpu"]), run.get("world_size", 1)
    else:
        cpu = platform.get("cpu") or env.get("processor") or "unknown"
        threads = platform.get("threads") or env.get("torch_threads")
        hardware = f"CPU {cpu}" + (f", {_count(int(threads), 'thread')}" if threads else "")
        world = run.get("world_size", 1)
    if device == "auto":
        device = "auto (CUDA if usable, else the CPU)"
    return {"precision": precision, "device": device, "GPU": gpu, "hardware": hardware, "world size": world}


# --------------------------------------------------------------------------------------- keys and text


def card_key(card: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The fields that must agree for two rows to share a table column (``KEY_FIELDS``, module doc), as
    (field, value) pairs; compare two keys with ``conflicts``."""
    return tuple((f, card.get(f)) for f in KEY_FIELDS)


def known(value: Any) -> bool:
    """Whether a card value states something (not ``None``, not ``NOT_RECORDED``)."""
    return value is not None and value != NOT_RECORDED


def conflicts(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The key fields on which two cards disagree; a field unknown in either (``known``) never does."""
    left, right = dict(card_key(a)), dict(card_key(b))
    return [f for f in KEY_FIELDS if known(left[f]) and known(right[f]) and left[f] != right[f]]


def value_text(value: Any) -> str:
    """A card value as prose: 1,000 for counts, 7.5 / 0 for numbers, text as is."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def field_text(field: str, value: Any) -> str:
    """``top-k: 0 (off)``, ``CFG scale: 2``, ``prompts: ...``."""
    text = value_text(value)
    if field == "top-k" and value == 0:
        text += " (off)"
    elif field == "top-p" and value == 1.0:
        text += " (off)"
    return f"{field}: {text}"


def card_lines(card: Mapping[str, Any]) -> list[str]:
    """The card as markdown: a heading line, then one bullet per field that applies (``None`` ones left out)."""
    lines = ["Evaluation card (the protocol of these numbers; run.json `evaluation_card`):"]
    lines += [f"- {field_text(f, card[f])}" for f in card if card[f] is not None]
    return lines
