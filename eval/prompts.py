"""Prompt sets: the class names of a class-conditional model, or one prompt per line of a text file.

(The MS-COCO 2017 captions protocol, longest caption per image, is added by the evaluation suite.)

Example: ``python run.py data=file data.path=my_prompts.txt eval.num_prompts=100``.
"""
from __future__ import annotations

from pathlib import Path

from coolsd.models.base import ImageARModel


class ClassPrompts:
    """Cycle through the model's class names (``model.class_names``): class 0, 1, ..., 0, 1, ..."""

    def load(self, model: ImageARModel, num_prompts: int) -> list[str]:
        names = list(getattr(model, "class_names", []) or [])
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
