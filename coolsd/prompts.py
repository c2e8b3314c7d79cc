"""Prompt sets (the ``data`` config group): the class names of a class-conditional model (``ClassPrompts``), one
prompt per line of a text file (``FilePrompts``), prompts listed in the config (``FixedPrompts``), the MS-COCO 2017
captions, longest caption per image (``CocoCaptions``), and PartiPrompts (``PartiPrompts``). Evaluation runs
(``run.py``) and drafter training (``scripts/train_drafter.py``) both take their prompts from here.

``load(model, num_prompts, key)`` returns exactly ``num_prompts`` prompts, or every prompt of the set once
for ``num_prompts=None``. Class names and config-listed prompts are cycled; a file or a dataset with fewer
prompts than asked for is an error naming ``key`` (the config key that asked, ``eval.num_prompts`` for a
run), the set's size and its file — never a silently shorter run.

Example: ``python run.py data=file data.path=my_prompts.txt eval.num_prompts=100``.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coolsd.models.base import ImageARModel
from coolsd.required_files import RequiredFile

NUM_PROMPTS_KEY = "eval.num_prompts"


def first(prompts: list[str], num_prompts: int | None, source: str, key: str) -> list[str]:
    """The first ``num_prompts`` of ``prompts`` (all for None); an error naming ``key`` if there are fewer."""
    if num_prompts is None:
        return prompts
    if len(prompts) < num_prompts:
        n = len(prompts)
        raise ValueError(f"{key}={num_prompts}, but {source} holds only {n} prompt{'s' if n != 1 else ''}; set "
                         f"{key}={n} to use each of them once, or choose a larger prompt set")
    return prompts[:num_prompts]


def cycled(prompts: list[str], num_prompts: int | None) -> list[str]:
    """``num_prompts`` prompts cycling through ``prompts`` (each once for None)."""
    if num_prompts is None:
        return list(prompts)
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def class_names_of(source: ImageARModel | list[str] | None) -> list[str]:
    """Class names of a class-conditional model, or a list of names itself (prompts load before the model)."""
    if source is None:
        return []
    names = getattr(source, "class_names", source)
    return list(names or [])


class ClassPrompts:
    """Cycle through the model's class names (``model.class_names``): class 0, 1, ..., 0, 1, ..."""

    def load(self, model: ImageARModel | list[str] | None, num_prompts: int | None,
             key: str = NUM_PROMPTS_KEY) -> list[str]:
        names = class_names_of(model)
        if not names:
            raise ValueError("data=classes needs a class-conditional model with model.class_names; "
                             "use data=file data.path=<prompts.txt> for text prompts")
        return cycled(names, num_prompts)


def utf8_text(path: Path, what: str) -> str:
    """The text of ``path``, or a ``ValueError`` that names the file, the first undecodable byte, the config key
    (``what``) and how to convert the file, instead of a bare ``UnicodeDecodeError``."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path} ({what}) is not UTF-8 text: byte {raw[e.start]:#04x} at offset {e.start} (line "
                         f"{line}) cannot be decoded. Convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8 "
                         f"{path.name} > prompts.utf8.txt`) and point {what} at it") from None


class FilePrompts:
    """One prompt per non-empty line of a UTF-8 text file."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """The prompt file (``data.path``)."""
        return [RequiredFile("prompt file", local=str(cfg["path"]), manual="write one prompt per line there "
                             "(or set data.path)")]

    def load(self, model: ImageARModel, num_prompts: int | None, key: str = NUM_PROMPTS_KEY) -> list[str]:
        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path} (set data.path)")
        prompts = [line.strip() for line in utf8_text(path, "data.path").splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompt file {path} has no prompts (set data.path to a file with one prompt per line)")
        return first(prompts, num_prompts, f"the prompt file {path} (data.path)", key)


class FixedPrompts:
    """Prompts listed in the config itself (``data.prompts``), cycled."""

    def __init__(self, prompts: list[str]) -> None:
        self.prompts = list(prompts)
        if not self.prompts:
            raise ValueError("data.prompts is empty; list at least one prompt")

    def load(self, model: ImageARModel, num_prompts: int | None, key: str = NUM_PROMPTS_KEY) -> list[str]:
        return cycled(self.prompts, num_prompts)


COCO_URL = "http://images.cocodataset.org/annotations/annotations_trainval2017.zip"


def coco_url(path: str) -> str:
    """The annotations archive that holds a COCO captions file: 2014's for ``captions_val2014.json`` (the COCO-30k
    protocol, ``data=coco2014``), else 2017's."""
    return COCO_URL.replace("2017", "2014") if "2014" in Path(str(path)).name else COCO_URL
PARTI_URL = "https://raw.githubusercontent.com/google-research/parti/main/PartiPrompts.tsv"


class CocoCaptions:
    """MS-COCO captions (``annotations/captions_val2017.json``; 2014's ``captions_val2014.json`` for COCO-30k).

    ``selection``: ``longest`` — the longest caption of every image, images in ascending id order (the
    LANTERN / COOL-SD protocol; ties keep the first caption in file order); ``random`` — one caption per
    image drawn with ``seed``, images in a seeded random order. The first ``num_prompts`` are used.
    """

    def __init__(self, path: str, selection: str = "longest", seed: int = 0) -> None:
        if selection not in ("longest", "random"):
            raise ValueError(f"data.selection must be 'longest' or 'random', got {selection!r}")
        self.path, self.selection, self.seed = path, selection, seed

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """``captions_val2017.json`` (``data.path``; not on the Hugging Face hub)."""
        path = str(cfg["path"])
        url = coco_url(path)
        year = "2014" if url != COCO_URL else "2017"
        return [RequiredFile(f"MS-COCO {year} val captions", local=path,
                             manual=f"curl -LO {url} && unzip {url.rsplit('/', 1)[1]} -d $COCO_DIR "
                                    f"(so that {path} exists; export COCO_DIR or set data.path)")]

    def captions(self) -> list[tuple[int, str]]:
        """(image id, caption) pairs in protocol order."""
        import json
        import random

        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"MS-COCO captions not found at {path}. Download {coco_url(path.name)}, unzip it and point data.path "
                f"at annotations/{path.name} (e.g. export COCO_DIR=<folder holding annotations/>)")
        hint = "point data.path at MS-COCO's annotations/captions_val2017.json"
        try:
            data = json.loads(utf8_text(path, "data.path"))
            by_image: dict[int, list[str]] = {}
            for ann in data["annotations"]:
                by_image.setdefault(int(ann["image_id"]), []).append(" ".join(ann["caption"].split()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a COCO captions file ({type(e).__name__}: {e}); {hint}") from None
        if not by_image:
            raise ValueError(f"{path} holds no captions (its `annotations` list is empty); {hint}")
        ids = sorted(by_image)
        if self.selection == "longest":
            return [(i, max(by_image[i], key=len)) for i in ids]
        rng = random.Random(self.seed)
        rng.shuffle(ids)
        return [(i, rng.choice(by_image[i])) for i in ids]

    def load(self, model: ImageARModel, num_prompts: int | None, key: str = NUM_PROMPTS_KEY) -> list[str]:
        captions = [caption for _, caption in self.captions()]
        return first(captions, num_prompts, f"the COCO captions file {Path(self.path).expanduser()} (data.path)",
                     key)


class PartiPrompts:
    """PartiPrompts (``PartiPrompts.tsv``: columns Prompt, Category, Challenge, Note), optional category."""

    def __init__(self, path: str, category: str | None = None) -> None:
        self.path, self.category = path, category

    @classmethod
    def required_files(cls, cfg: Mapping[str, Any]) -> list[RequiredFile]:
        """``PartiPrompts.tsv`` (``data.path``)."""
        path = str(cfg["path"])
        return [RequiredFile("PartiPrompts", local=path, manual=f"curl -L -o {path} {PARTI_URL}")]

    def load(self, model: ImageARModel, num_prompts: int | None, key: str = NUM_PROMPTS_KEY) -> list[str]:
        import csv

        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"PartiPrompts not found at {path}. Download {PARTI_URL} and set data.path")
        import io

        reader = csv.DictReader(io.StringIO(utf8_text(path, "data.path"), newline=""), delimiter="\t")
        if "Prompt" not in (reader.fieldnames or []):
            raise ValueError(f"{path} has no `Prompt` column (columns: {reader.fieldnames}); point data.path "
                             f"at PartiPrompts.tsv ({PARTI_URL})")
        rows = list(reader)
        prompts = [(r["Prompt"] or "").strip() for r in rows if self.category in (None, r.get("Category"))]
        prompts = [p for p in prompts if p]
        source = f"PartiPrompts {path} (data.path)" + (f" in category {self.category!r} (data.category)"
                                                         if self.category is not None else "")
        if not prompts:
            raise ValueError(f"{source} holds no prompts; check data.category and data.path")
        return first(prompts, num_prompts, source, key)
