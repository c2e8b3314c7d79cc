"""Training: EAGLE drafters by self-distillation and the embedded default model.

* ``coolsd.training.data``: distillation samples (safetensors shards, resumable) and the batch stream.
* ``coolsd.training.drafter``: the drafter's training loop (``accelerate``), checkpoints, validation.
* ``coolsd.training.embedded``: the embedded Fashion-MNIST model's tokenizer, target and drafter stages.

Example: ``python scripts/train_drafter.py model=tiny``; ``python scripts/train_embedded.py``.
"""
