"""Every decoder of a run checked before its target model is built: option values and the drafter-target fit.

A bad decoder value (``decoder.schedule=expo``) or a drafter trained for another model used to fail only after
the target (7B on the paper's tables) had loaded. ``validate_decoders`` runs first, without reading a weight.
Measured on 2 shared CPU cores: 0.15 s for ``decoder=coolsd`` on the embedded model, 0.2-0.6 s for the default
run's six decoders (half of it the two LANTERN neighbour tables of the stand-in's codebook); a real-size
model's first check in a process adds the seconds of importing ``transformers`` and the meta device's kernels,
which its build needs anyway:

1. **The target's stand-in.** The configured adapter class is built from its own config with its weight files
   turned off (``RECIPES``): LlamaGen with its checkpoints unset and LlamaGen T2I with random weights and a
   stand-in T5, both at the run's sizes (on the meta device when the published weights need a GPU,
   ``requires_cuda: true``, so nothing of their size is allocated); Janus-Pro, Lumina-mGPT and Emu3-Gen at their tiny
   random-weight sizes (their real sizes live beside the weights), keeping the class traits the decoders read
   (``sjd_init``, ``spatial_orders``) and Lumina-mGPT's grid.
2. **Every decoder option.** Each decoder config the run compares (``eval.run.suite.select_decoders``) is
   instantiated against the stand-in, as the run instantiates it against the target, so a bad value raises
   the decoder's own error, naming the key and the allowed values. Two things are not built: LANTERN's
   neighbour table is not cached (``decoder.neighbour_cache``), and an EAGLE drafter gets a head built from
   its checkpoint's ``config.json`` instead of its weights (step 3), then runs ``EagleDrafter``'s own checks
   (``drafter.extra_slots``, ``drafter.prefix`` and the prefix it was trained with).
3. **The drafter-target fit.** An EAGLE checkpoint's ``config.json`` (this project's format, or a released
   EAGLE / LANTERN drafter's HF-Llama config) is compared with the target's draft-layer sizes, field by field,
   as ``coolsd.drafters.eagle.load_eagle`` compares them after reading the weights: the stand-in's own
   ``make_draft_layer`` (LlamaGen), or, for Janus-Pro and Lumina-mGPT, the sizes in the cached hub
   ``config.json`` of their weights (pretrained) or in ``model.arch`` / ``model.random_init`` (random weights).
   A ``config.json`` that is not here is the file check's to report (``eval.run.prefetch``); the fit is then
   listed as not checked.

A model class with no recipe is refused before it loads (a problem, not a note: its decoders would otherwise be
checked only after a 7B load), unless the class says how to build it without weights itself: a classmethod
``stand_in_config(node) -> dict`` returning the config keys to change (``Recipe.no_weights``'s contract).

Problems raise one ``DecoderConfigError`` listing each (``decoder[<suite name>] (<class>): <its error>``);
what could not be checked comes back as notes: an error that may come from the stand-in rather than the
config (anything but a value or type error; a draft model sized on a tiny stand-in) never stops a run.
``eval.run.experiment`` calls it right after ``select_decoders``; ``scripts/prefetch.py`` calls it for every job
of a sweep.

Example: ``python scripts/prefetch.py --check decoder=coolsd decoder.schedule=expo`` (names the key and the
allowed schedules, builds nothing).
"""
from __future__ import annotations

import contextlib
import functools
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import coolsd.resolvers  # noqa: F401  (the ${asset:} resolver)
from coolsd.drafters.eagle import (CONFIG_FILE, FORMAT, HUB_PREFIX, TRAIN_HINT, EagleDrafter, EagleHead,
                                   arch_mismatch, head_sizes, released_prefix)
from coolsd.models.base import ImageARModel
from coolsd.required_files import RequiredFile, locate

EAGLE = "coolsd.drafters.eagle.EagleDrafter"
#: drafters whose checks do not depend on the target's sizes (their errors count on a tiny stand-in too)
SIZE_FREE_DRAFTERS = (EAGLE, "baselines.jacobi.JacobiDrafter")
#: errors that say a config value is wrong (anything else raised while building on the stand-in is a note)
CONFIG_ERRORS = (ValueError, TypeError, LookupError, ImportError, AttributeError)


class DecoderConfigError(ValueError):
    """A decoder of the run is misconfigured; the message names each decoder, the key and what is allowed."""


@dataclass
class Checked:
    """What ``validate_decoders`` found: ``problems`` (raised) and ``notes`` (what it could not check)."""

    owners: dict[str, list[str]] = field(default_factory=dict)  # problem -> who has it (one drafter, many decoders)
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [f"{', '.join(owners)}: {text}" for text, owners in self.owners.items()]

    def problem(self, owner: str, text: str) -> None:
        self.owners.setdefault(text, []).append(owner)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


# -- the target's stand-in -------------------------------------------------------------------------------------
def _hub_config(node: Mapping[str, Any], repo_key: str) -> str | None:
    """Local path of the ``config.json`` beside a pretrained model's weights (the hub cache only), or None."""
    repo = str(node.get(repo_key))
    return locate(RequiredFile(f"{repo} config", repo_id=repo, filename="config.json", revision=node.get("revision")))


def _sizes(hidden: int, heads: int, kv_heads: int | None, intermediate: int, codes: int, image_tokens: int,
           head_dim: int | None = None) -> dict[str, Any]:
    """The draft-layer sizes a drafter must fit (``FIT_FIELDS``): no ``kv_heads`` means one per head, no
    ``head_dim`` the width over the heads."""
    return {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads or heads,
            "head_dim": head_dim or hidden // heads, "intermediate_size": intermediate, "vocab_size": codes,
            "num_image_tokens": image_tokens}


def _janus_sizes(node: Mapping[str, Any], model: ImageARModel) -> dict[str, Any] | str:
    """Janus-Pro's draft-layer sizes (``JanusDraftLayer``: the text model's): from its weights' ``config.json``
    when pretrained, else from ``model.arch``."""
    from coolsd.models.janus_pro import JanusArch

    if not node.get("pretrained", True):
        arch = JanusArch(**dict(node.get("arch") or {}))
        return _sizes(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.intermediate_size,
                      arch.codebook_size, (arch.image_size // arch.patch_size) ** 2)
    path = _hub_config(node, "repo_id")
    if path is None:
        return f"the target's sizes come from {node.get('repo_id')}/config.json, which is not here"
    from transformers import JanusConfig

    config = JanusConfig.from_json_file(path)
    return _text_sizes(config.text_config, config.vq_config.num_embeddings, config.vq_config.num_patches ** 2)


def _text_sizes(text: Any, codes: int, image_tokens: int) -> dict[str, Any]:
    """The draft-layer sizes of a transformers text config (a Llama-like model's) over ``codes`` image codes."""
    return _sizes(text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.intermediate_size,
                  codes, image_tokens, getattr(text, "head_dim", None))


def _lumina_sizes(node: Mapping[str, Any], model: ImageARModel) -> dict[str, Any] | str:
    """Lumina-mGPT's draft-layer sizes (``ChameleonDraftLayer``): from its language model's ``config.json`` when
    pretrained (the codebook: the image tokens of its ``vocabulary_map``), else from ``model.random_init``; the
    grid is the configured width and height's (the stand-in's)."""
    from coolsd.models.lumina_mgpt import RandomInit, image_code_ids

    if not node.get("pretrained", True):
        init = RandomInit(**dict(node.get("random_init") or {}))
        return _sizes(init.hidden_size, init.num_attention_heads, init.num_key_value_heads, init.intermediate_size,
                      init.num_codes, model.num_image_tokens)
    path = _hub_config(node, "hub_repo")
    if path is None:
        return f"the target's sizes come from {node.get('hub_repo')}/config.json, which is not here"
    from transformers import ChameleonConfig

    config = ChameleonConfig.from_json_file(path)
    return _sizes(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                  config.intermediate_size, int(image_code_ids(config.vocabulary_map or {}).numel()),
                  model.num_image_tokens)


def _emu3_sizes(node: Mapping[str, Any], model: ImageARModel) -> dict[str, Any] | str:
    """Emu3-Gen's draft-layer sizes (its Llama text model's): from its weights' ``config.json`` when pretrained
    (the codebook: the vision tokenizer's ``codebook_size``), else from ``model.arch``; the grid is the
    stand-in's (``ratio`` and ``image_area`` as the run's)."""
    from coolsd.models.emu3 import Emu3Arch

    if not node.get("pretrained", True):
        arch = Emu3Arch(**dict(node.get("arch") or {}))
        return _sizes(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.intermediate_size,
                      arch.codebook_size, model.num_image_tokens)
    path = _hub_config(node, "repo_id")
    if path is None:
        return f"the target's sizes come from {node.get('repo_id')}/config.json, which is not here"
    from transformers import Emu3Config

    config = Emu3Config.from_json_file(path)
    return _text_sizes(config.text_config, config.vq_config.codebook_size, model.num_image_tokens)


@dataclass(frozen=True)
class Recipe:
    """How to build an adapter class without its weights: ``no_weights(node)`` -> the config keys to change.
    ``sizes(node, stand_in)``: the draft-layer sizes a drafter must fit, for classes whose stand-in is built at
    tiny sizes (their real sizes live beside the weights, or would take gigabytes to build even on the meta
    device's terms); ``None``: the stand-in has the run's sizes and its own draft layer says them."""

    no_weights: Callable[[Mapping[str, Any]], dict[str, Any]]
    sizes: Callable[[Mapping[str, Any], ImageARModel], dict[str, Any] | str] | None = None


RECIPES: dict[str, Recipe] = {
    "coolsd.models.llamagen.LlamaGen": Recipe(lambda node: {"gpt_checkpoint": None, "vq_checkpoint": None}),
    "coolsd.models.llamagen_t2i.LlamaGenT2I": Recipe(
        lambda node: {"pretrained": False, "text_encoder": "tiny_random", "tokenizer": None}),
    "coolsd.models.janus_pro.JanusPro": Recipe(lambda node: {"pretrained": False, "arch": {}}, _janus_sizes),
    "coolsd.models.lumina_mgpt.LuminaMGPT": Recipe(lambda node: {"pretrained": False, "random_init": None},
                                                   _lumina_sizes),
    "coolsd.models.anole.Anole": Recipe(lambda node: {"pretrained": False, "random_init": None}, _lumina_sizes),
    "coolsd.models.emu3.Emu3Gen": Recipe(lambda node: {"pretrained": False, "arch": {}}, _emu3_sizes),
    "coolsd.models.lookup.LookupModel": Recipe(lambda node: {}),
}


@dataclass(frozen=True)
class StandIn:
    """The target's stand-in: the adapter built without weights, on the meta device when ``meta``, and the
    draft-layer sizes a drafter must fit (``None``: unknown, with ``why``)."""

    model: ImageARModel
    meta: bool
    sizes: dict[str, Any] | None
    why: str = ""
    exact: bool = True  # built at the run's sizes (False: Janus-Pro's and Lumina-mGPT's tiny stand-ins)
    heads: list[EagleHead] = field(default_factory=list)  # the one EAGLE head every stand-in drafter shares

    def head(self) -> EagleHead:
        """An EAGLE head of the stand-in (no trained prefix), built once: the stand-in drafters only hold it."""
        if not self.heads:
            with torch.device("meta") if self.meta else contextlib.nullcontext():
                self.heads.append(EagleHead(self.model, prefix=None))
        return self.heads[0]


class NoStandIn(ValueError):
    """A model class with no way to build it without weights (no ``RECIPES`` entry, no ``stand_in_config``)."""


def recipe_of(model_cfg: Mapping[str, Any]) -> Recipe | None:
    """The class's recipe: its ``RECIPES`` entry, else one from its own ``stand_in_config`` classmethod, else None."""
    target = str(model_cfg.get("_target_", ""))
    if target in RECIPES:
        return RECIPES[target]
    module, _, name = target.rpartition(".")
    try:
        import importlib

        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    own = getattr(cls, "stand_in_config", None)
    return Recipe(lambda node: dict(own(node))) if callable(own) else None


def stand_in(model_cfg: Mapping[str, Any]) -> StandIn | str:
    """The configured target built without weights (``recipe_of``), or why its sizes are not known; raises
    ``NoStandIn`` for a class without a recipe. A full-size stand-in of a model whose published weights need
    a GPU (``requires_cuda``) is built on the meta device; the others on the CPU (at these sizes faster than the
    meta device's first use)."""
    target = str(model_cfg.get("_target_", ""))
    recipe = recipe_of(model_cfg)
    if recipe is None:
        raise NoStandIn(
            f"the model class {target} cannot be checked before it loads: it has no stand-in recipe "
            "(eval/run/preflight.py RECIPES). Add one there, or give the class a classmethod stand_in_config(node) "
            "returning the config keys that build it without its weights (docs/extending.md); nothing was loaded")
    meta = bool(model_cfg.get("requires_cuda", False)) and recipe.sizes is None
    node = {k: v for k, v in model_cfg.items() if k != "defaults"}
    node.update(recipe.no_weights(model_cfg))
    if "device" in node:
        node["device"] = "meta" if meta else "cpu"
    if "requires_cuda" in node:
        node["requires_cuda"] = False
    with torch.device("meta") if meta else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = instantiate(node)
    if recipe.sizes is None:
        where = StandIn(model, meta, None)
        try:
            sizes = head_sizes(where.head())
        except NotImplementedError as err:  # an adapter without a draft layer: no EAGLE drafter can fit it
            return StandIn(model, meta, None, str(err).split(";")[0])
        return replace(where, sizes=sizes)
    sizes = recipe.sizes(model_cfg, model)
    if isinstance(sizes, str):
        return StandIn(model, meta, None, sizes, exact=False)
    return StandIn(model, meta, sizes, exact=False)


# -- the drafter-target fit ----------------------------------------------------------------------------------
def checkpoint_config(checkpoint: str) -> dict[str, Any] | None:
    """A drafter checkpoint's ``config.json`` (a folder or ``hub:<repo>``, the hub cache only), None if not here."""
    if checkpoint.startswith(HUB_PREFIX):
        path = locate(RequiredFile("EAGLE drafter config", repo_id=checkpoint[len(HUB_PREFIX):], filename=CONFIG_FILE))
    else:
        candidate = Path(checkpoint).expanduser() / CONFIG_FILE
        path = str(candidate) if candidate.is_file() else None
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise ValueError(f"the drafter checkpoint {checkpoint}'s {CONFIG_FILE} ({path}) is not JSON ({err}); fetch "
                         "or write it again") from None


def checked_eagle(target: ImageARModel, checkpoint: str | None = None, head: EagleHead | None = None,
                  extra_slots: int = 64, prefix: str = "last", *, where: StandIn, found: Checked,
                  owner: str) -> EagleDrafter:
    """``EagleDrafter`` as the run builds it, with a head made from the checkpoint's ``config.json`` (not its
    weights) after the fit check: its own checks of ``drafter.*`` run, then the trained-prefix check."""
    if checkpoint is None or head is not None:  # nothing to read: EagleDrafter's own error (or a prebuilt head)
        return EagleDrafter(target, checkpoint=checkpoint, head=head, extra_slots=extra_slots, prefix=prefix)
    config = checkpoint_config(str(checkpoint))
    if config is None:
        found.note(f"the fit of drafter {checkpoint} to the target was not checked (its {CONFIG_FILE} is not here; "
                   "the file check lists it)")
    elif where.sizes is None:
        found.note(f"the fit of drafter {checkpoint} to the target was not checked ({where.why})")
    else:
        mismatch = arch_mismatch(config, where.sizes)
        if mismatch:
            raise ValueError(f"drafter checkpoint {checkpoint} was trained for another architecture (field: "
                             f"checkpoint vs target) {mismatch}; " + TRAIN_HINT)
    drafter = EagleDrafter(target, head=where.head(), extra_slots=extra_slots, prefix=prefix)
    trained = None if config is None else (config.get("prefix", "last") if config.get("format") == FORMAT
                                           else released_prefix(config))
    if trained is not None and trained != prefix:
        raise ValueError(f"the drafter {checkpoint} was trained with prefix={trained!r} but drafter.prefix="
                         f"{prefix!r}; set drafter.prefix={trained}")
    return drafter


# -- the decoders ----------------------------------------------------------------------------------------------
def _cause(error: BaseException) -> BaseException:
    """The decoder's own error inside Hydra's ``InstantiationException``."""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    return error


def check_decoder(name: str, decoder_cfg: Any, where: StandIn, found: Checked) -> None:
    """Instantiate one decoder config against the stand-in (EAGLE drafters from their config, LANTERN's table
    uncached); its error becomes a problem, an error of the stand-in itself a note."""
    node = OmegaConf.to_container(decoder_cfg, resolve=True) if isinstance(decoder_cfg, DictConfig) \
        else dict(decoder_cfg)
    owner = f"decoder[{name}] ({node.get('_target_')})"
    extra: dict[str, Any] = {}
    if "neighbour_cache" in node:
        node["neighbour_cache"] = None  # a table of the stand-in's codebook must not reach the cache
    drafter = node.get("drafter")
    sized = isinstance(drafter, Mapping) and drafter.get("_target_") not in SIZE_FREE_DRAFTERS
    if isinstance(drafter, Mapping) and drafter.get("_target_") == EAGLE:
        options = {k: v for k, v in drafter.items() if k not in ("_target_", "_partial_")}
        extra["drafter"] = functools.partial(checked_eagle, **options, where=where, found=found, owner=owner)
        node.pop("drafter")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run warns once, with the target's own sizes
            instantiate(node, model=where.model, **extra)
    except Exception as error:  # noqa: BLE001  sorted below: a config error is a problem, the rest a note
        cause = _cause(error)
        text = str(cause).strip() or type(cause).__name__
        if isinstance(cause, (*CONFIG_ERRORS, InstantiationException)) and (where.exact or not sized):
            found.problem(owner, text)
        else:  # the stand-in's own limits (a meta tensor read, a draft model sized on a tiny stand-in)
            found.note(f"{owner}: not checked before the build ({type(cause).__name__}: "
                       f"{text.splitlines()[0][:160]})")


def check_decoders(cfg: DictConfig, decoder_cfgs: Mapping[str, Any]) -> Checked:
    """Every decoder of ``decoder_cfgs`` (suite name -> config) against the stand-in of ``cfg.model``."""
    found = Checked()
    with torch.random.fork_rng(devices=[]):  # the stand-in's random weights leave the run's RNG as it was
        _check_all(cfg, decoder_cfgs, found)
    return found


def _check_all(cfg: DictConfig, decoder_cfgs: Mapping[str, Any], found: Checked) -> None:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        where = stand_in(model_cfg)
    except NoStandIn as error:
        found.problem(f"model ({model_cfg.get('_target_')})", str(error))
        return
    except Exception as error:  # noqa: BLE001  a value of the model's own config is the run's problem
        cause = _cause(error)
        recipe = recipe_of(model_cfg)
        owner = f"model ({model_cfg.get('_target_')})"
        if isinstance(cause, CONFIG_ERRORS) and recipe is not None and recipe.sizes is None:
            found.problem(owner, str(cause))
        else:
            found.note(f"{owner}: its stand-in could not be built ({type(cause).__name__}: "
                       f"{str(cause).splitlines()[0][:160] if str(cause) else ''}); its decoders are checked "
                       "when the run builds them")
        return
    if isinstance(where, str):
        found.note(where)
        return
    for name, decoder_cfg in decoder_cfgs.items():
        check_decoder(name, decoder_cfg, where, found)


def validate_decoders(cfg: DictConfig, decoder_cfgs: Mapping[str, Any]) -> list[str]:
    """Raise ``DecoderConfigError`` naming every misconfigured decoder of the run (option values, drafter fit)
    before the target is built; return what could not be checked (notes)."""
    found = check_decoders(cfg, decoder_cfgs)
    if found.problems:
        raise DecoderConfigError(
            f"{len(found.problems)} decoder problem(s), found before the target model was built:\n"
            + "".join(f"  - {p}\n" for p in found.problems)
            + "Fix the value on the command line (or in configs/decoder/, configs/drafter/); "
              "python scripts/prefetch.py --check <overrides> checks a run without building it (-m: every job "
              "of a sweep).")
    return found.notes

