"""Image-quality metrics of a run: FID and KID (Inception features), CLIP score, ImageReward, HPSv2.1, class
accuracy; and the intervals and paired tests of every number of a run (``intervals``).

Written after GaParmar/clean-fid ``cleanfid/fid.py``, ``cleanfid/features.py``,
``cleanfid/inception_torchscript.py``; jadohu/LANTERN ``entrypoints/eval_fid_clip.py``; tgxs002/HPSv2
``hpsv2/img_score.py``, ``hpsv2/src/open_clip/transform.py``, ``hpsv2/src/open_clip/factory.py``.

One module per metric family (``base``, ``images``, ``fid`` with the offline FID network ``fid_inception``,
``clip``, ``image_reward``, ``hps``, ``classifier``) and one for the statistics (``intervals``); this package
re-exports every metric's names, so configs name ``eval.metrics.FIDKID`` etc. as their ``_target_``.
Every metric has ``required_files(cfg)`` (its files, from its config alone: ``scripts/prefetch.py``),
``preflight()`` (resolve every file it needs — reference images or features, weights, tokenizer — and fail
with a message naming the file, where it was looked for and the command that fetches it; ``eval.run.experiment``
calls it before the model is built), ``compute(image_paths, prompts, device) -> dict``,
and, for intervals and paired comparisons (``ImageMetric``, ``eval/metrics/intervals.py``) without scoring twice:
``per_image`` (what is resampled: per-image scores, or the generated images' features for FID/KID),
``estimate`` (the point estimates from them; ``compute = estimate(per_image(...))``), ``replicates`` (each
estimate on bootstrap resamples of the images) and ``interval``; ``min_images`` is checked before any image
is generated (FID needs 2: one image has no covariance).

**FID / KID** (``FIDKID``), two protocols, recorded as ``fid_protocol`` in every result:

* ``clean`` — the paper's (LANTERN's evaluation code): each generated and reference image is centre-cropped
  to a square (offsets rounded as torchvision's ``CenterCrop``) and LANCZOS-resized to 256 px (uint8), then
  the ``clean-fid`` package itself takes over (``cleanfid.fid.get_files_features`` with that image transform,
  ``mode="clean"``: PIL bicubic on float images to 299, its ``InceptionV3W`` on ``inception-2015-12-05``;
  FID by ``cleanfid.fid.fid_from_feats``). Equal to ``cleanfid.fid.compute_fid(ref_dir, gen_dir,
  mode="clean", custom_image_tranform=...)`` to 1e-3 (``tests/test_metrics.py``; measured 0.0 on 40 + 40
  images downsampled from 512x384 and 40 + 40 upsampled from 28x28: the features are identical).
* ``torch_fidelity`` — the earlier pipeline, kept as an option: bicubic centre crop (floored offsets) to
  ``image_size``, then torch-fidelity's TF-1 bilinear resize to 299 inside its Inception. Same network, other
  preprocessing: on downsampled images its FIDs differ from the clean protocol's by several per cent (7.9 %
  lower on issue 19's natural-like images, 6.8 % higher on 40 synthetic 512x384 ones), so never mix the two.

KID (unbiased, beside FID at small N) is torch-fidelity's estimator on the protocol's features (100 seeded
subsets; clean-fid's ``kernel_distance`` is the same estimator with unseeded subsets). Reference features are
cached on disk under a key that hashes the reference files' bytes, the protocol, the image size and the
extractor (its weights file's hash).

**CLIP score** (``CLIPScore``): open_clip ``ViT-B-32-quickgelu`` with the ``openai`` weights (trained with
QuickGELU; plain ``ViT-B-32`` builds GELU and is refused with those weights). LANTERN's image path: centre
crop, LANCZOS to 256 px, LANTERN's tensor round trip back to uint8 (``ToTensor``, ``Normalize(0.5, 0.5)``,
``(x + 1) * 127.5`` truncated: 63 of the 256 levels drop by one), then the model's own preprocessing; the
prompt prefixed with "A photo depicts " (the same tokens as LANTERN's insertion after the start token, also
when truncated to 77); reported as a plain mean cosine (not ×100, not clipped at 0).

**HPSv2.1** (``HPSv2``, optional): open_clip ``ViT-H-14`` with ``HPS_v2.1_compressed.pt`` (hub
``xswu/HPSv2``), loaded strictly from its ``state_dict``; HPSv2's own scorer's image path (RGB, to float,
longest side bicubic to 224, zero padding to a square, OpenAI mean/std) on the raw image, the raw prompt, and
its score ``image_features @ text_features.T`` of the normalised features — a cosine, not ×100, no logit
scale, as ``hpsv2.score`` returns it (its leaderboard prints ×100). Checked once against the HPSv2 repository's
own open_clip fork: the same 686 state-dict keys and shapes for ViT-H-14, the same tokens, and equal scores
(3e-8) of a random tiny model.

**Class accuracy** (``ClassAccuracy``): the embedded model's stand-in for CLIP score.

Example: ``python run.py model=llamagen_t2i_512 decoder=coolsd eval=coco5k``; ``python run.py`` (the embedded
model's FID/KID under protocol ``torch_fidelity`` at 28 px, and class accuracy).
"""
from __future__ import annotations

from eval.metrics.base import (COCO_VAL_URL, HPS_FILES, HPS_REPO, IMAGE_SUFFIXES, PROTOCOLS, ImageMetric,
                               MeanScore, file_sha256)
from eval.metrics.classifier import ClassAccuracy, Classifier
from eval.metrics.clip import CLIPScore
from eval.metrics.fid import (FIDKID, ClassifierFeatures, CleanFIDInception, InceptionFeatures,
                              RandomConvFeatures, build_extractor, extract, extract_clean)
from eval.metrics.hps import HPSv2, hps_image_tensor, load_hps_state
from eval.metrics.image_reward import ImageReward
from eval.metrics.images import (LanternResize, center_crop_resize, center_square, image_batches,
                                 lantern_crop_resize, lantern_uint8_round_trip, list_images)

__all__ = ["COCO_VAL_URL", "FIDKID", "HPS_FILES", "HPS_REPO", "IMAGE_SUFFIXES", "PROTOCOLS", "CLIPScore",
           "ClassAccuracy", "Classifier", "ClassifierFeatures", "CleanFIDInception", "HPSv2", "ImageMetric",
           "ImageReward", "InceptionFeatures", "LanternResize", "MeanScore", "RandomConvFeatures",
           "build_extractor", "center_crop_resize", "center_square", "extract", "extract_clean",
           "file_sha256", "hps_image_tensor", "image_batches", "lantern_crop_resize",
           "lantern_uint8_round_trip", "list_images", "load_hps_state"]
