"""Fingerprints: what a decoder's images depend on besides the model weights, prompt and seed, stored beside its
records (``records/<decoder>.fingerprint.json``) and digested into every record, so a run keeps only the finished
images that this config would make again (``eval.run.resume.RunRecords`` compares them).

A fingerprint holds the model config, the decoder and drafter configs and the token code version
(``coolsd.fingerprint.TOKEN_CODE_VERSION``), less the keys no image depends on (``normalised``); the run adds the
weights' digest and the machine's numerics signature.

Example: ``decoder_fingerprint(cfg, "sd", cfg.suite.sd)`` is the dict that ``records/sd.fingerprint.json`` holds.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.fingerprint import TOKEN_CODE_VERSION

#: decoder keys that no image depends on: diagnostics, where a cache lives (the LANTERN neighbour table is
#: computed from the VQ codebook, which the weights digest covers), and how a list is batched (``refill``: like
#: ``eval.batch_size``, it changes which images share a step, not an image)
UNFINGERPRINTED = ("track_tv", "sync_phases", "neighbour_cache", "refill")
#: model keys that say where the weights are read from. The fingerprint's ``weights_sha1`` covers what they
#: point to, so they are left out of it: moving a checkout, another mount point on a cluster node or another
#: ``$COOLSD_CACHE`` keeps a folder's records and the AR cache. The drafter's ``checkpoint`` is left out in the
#: same way when the fingerprint carries ``drafter_weights_sha1`` (trained EAGLE heads).
WEIGHT_LOCATIONS = ("gpt_checkpoint", "vq_checkpoint", "weights_dir")
#: model keys added after records were made, left out of the fingerprint at these (their default) values, so
#: older records still match; another value is fingerprinted (``model.compile=true`` makes other bits)
MODEL_DEFAULTS = {"compile": False}
#: model keys that only the static decode path reads (``prompt_capacity``: the fixed prompt width of its
#: prefill, which may change last bits there), left out of the fingerprint of a decoder on the eager path
STATIC_MODEL_KEYS = ("prompt_capacity",)
#: decoder keys added after records were made, left out at their default in the same way (``decoder.path=static``
#: is fingerprinted: its steps may make other last bits on a GPU)
DECODER_DEFAULTS = {"path": "eager"}


def decoder_fingerprint(cfg: DictConfig, name: str, decoder_cfg: DictConfig) -> dict[str, Any]:
    """What a decoder's images depend on besides model weights, prompt and seed: the model config, the decoder
    and drafter configs without ``UNFINGERPRINTED`` keys, and the code version (``normalised``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    dec = OmegaConf.to_container(decoder_cfg, resolve=True)
    return normalised({"code_version": TOKEN_CODE_VERSION, "model": model, "decoder": dec})


def normalised(fp: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint without the keys no image depends on: ``UNFINGERPRINTED`` decoder keys, the weights'
    locations (``WEIGHT_LOCATIONS``, the drafter's ``checkpoint``) once the digest of those weights is in it,
    ``MODEL_DEFAULTS`` and ``DECODER_DEFAULTS`` keys at their default, and ``STATIC_MODEL_KEYS`` off the
    static path. Also applied to a stored fingerprint of an older version, which kept them."""
    fp = dict(fp)
    dec = fp.get("decoder")
    static = isinstance(dec, dict) and dec.get("path") == "static"
    if isinstance(dec, dict):
        dec = {k: v for k, v in dec.items() if k not in UNFINGERPRINTED
               and not (k in DECODER_DEFAULTS and v == DECODER_DEFAULTS[k])}
        if "drafter_weights_sha1" in fp and isinstance(dec.get("drafter"), dict):
            dec["drafter"] = {k: v for k, v in dec["drafter"].items() if k != "checkpoint"}
        fp["decoder"] = dec
    if isinstance(fp.get("model"), dict):
        located = "weights_sha1" in fp
        fp["model"] = {k: v for k, v in fp["model"].items()
                       if not (located and k in WEIGHT_LOCATIONS)
                       and not (k in MODEL_DEFAULTS and v == MODEL_DEFAULTS[k])
                       and not (k in STATIC_MODEL_KEYS and not static)}
    return fp

