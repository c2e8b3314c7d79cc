"""Prompt sets: the class names of a class-conditional model, or one prompt per line of a text file.

(The MS-COCO 2017 captions protocol, longest caption per image, is added by the evaluation suite.)

Example: ``python run.py data=file data.path=my_prompts.txt eval.num_prompts=100``.
"""
from __future__ import annotations

from pathlib import Path

from coolsd.models.base import ImageARModel


def class_names_of(source: ImageARModel | list[str] | None) -> list[str]:
    """Class names of a class-conditional model, or a list of names itself (prompts load before the model)."""
    if source is None:
        return []
    names = getattr(source, "class_names", source)
    return list(names or [])


class ClassPrompts:
    """Cycle through the model's class names (``model.class_names``): class 0, 1, ..., 0, 1, ..."""

    def load(self, model: ImageARModel | list[str] | None, num_prompts: int) -> list[str]:
        names = class_names_of(model)
        if not names:
            raise ValueError("data=classes needs a class-conditional model with model.class_names; "
                             "use data=file data.path=<prompts.txt> for text prompts")
        return [names[i % len(names)] for i in range(num_prompts)]


class FilePrompts:
    """One prompt per non-empty line of a UTF-8 text file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self, model: ImageARModel, num_prompts: int) -> list[str]:
        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path} (set data.path)")
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompt file {path} has no prompts")
        return prompts[:num_prompts]


class FixedPrompts:
    """Prompts listed in the config itself (``data.prompts``)."""

    def __init__(self, prompts: list[str]) -> None:
        self.prompts = list(prompts)

    def load(self, model: ImageARModel, num_prompts: int) -> list[str]:
        return [self.prompts[i % len(self.prompts)] for i in range(num_prompts)]


COCO_URL = "http://images.cocodataset.org/annotations/annotations_trainval2017.zip"
PARTI_URL = "https://raw.githubusercontent.com/google-research/parti/main/PartiPrompts.tsv"


class CocoCaptions:
    """MS-COCO 2017 captions (``annotations/captions_val2017.json``).

    ``selection``: ``longest`` — the longest caption of every image, images in ascending id order (the
    LANTERN / COOL-SD protocol; ties keep the first caption in file order); ``random`` — one caption per
    image drawn with ``seed``, images in a seeded random order. The first ``num_prompts`` are used.
    """

    def __init__(self, path: str, selection: str = "longest", seed: int = 0) -> None:
        if selection not in ("longest", "random"):
            raise ValueError(f"data.selection must be 'longest' or 'random', got {selection!r}")
        self.path, self.selection, self.seed = path, selection, seed

    def captions(self) -> list[tuple[int, str]]:
        """(image id, caption) pairs in protocol order."""
        import json
        import random

        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"MS-COCO captions not found at {path}. Download {COCO_URL}, unzip it and point data.path at "
                f"annotations/captions_val2017.json (e.g. export COCO_DIR=<folder holding annotations/>)")
        data = json.loads(path.read_text(encoding="utf-8"))
        by_image: dict[int, list[str]] = {}
        for ann in data["annotations"]:
            by_image.setdefault(int(ann["image_id"]), []).append(" ".join(ann["caption"].split()))
        ids = sorted(by_image)
        if self.selection == "longest":
            return [(i, max(by_image[i], key=len)) for i in ids]
        rng = random.Random(self.seed)
        rng.shuffle(ids)
        return [(i, rng.choice(by_image[i])) for i in ids]

    def load(self, model: ImageARModel, num_prompts: int) -> list[str]:
        return [caption for _, caption in self.captions()[:num_prompts]]


class PartiPrompts:
    """PartiPrompts (``PartiPrompts.tsv``: columns Prompt, Category, Challenge, Note), optional category."""

    def __init__(self, path: str, category: str | None = None) -> None:
        self.path, self.category = path, category

    def load(self, model: ImageARModel, num_prompts: int) -> list[str]:
        import csv

        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"PartiPrompts not found at {path}. Download {PARTI_URL} and set data.path")
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        prompts = [r["Prompt"].strip() for r in rows if self.category in (None, r.get("Category"))]
        return prompts[:num_prompts]
