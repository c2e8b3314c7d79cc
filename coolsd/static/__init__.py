"""The static decode path (``decoder.path=static``): every decode state on the device, one fixed-shape step per
iteration, no host read inside it, captured in CUDA graphs on a GPU and compiled on a CPU (``model.compile``).

The eager loop (``coolsd.decoding``) is the papers' setting: its shapes follow each iteration (the longest draft
that fits, finished images leaving the batch), so a GPU waits on the Python that drives it. This path runs the
same algorithms (the same drafters, rules, draws and commits) the way speed-built stacks do (pytorch-labs/gpt-fast
``decode_n_tokens``/``speculative_decode``; SGLang's EAGLE graph runners): ``loop`` holds the state and the named
steps (``ar``, ``chain``, ``jacobi_window``), ``capture`` runs a step eagerly, compiled or from a CUDA graph.

Example: ``python run.py decoder=sd decoder.path=static eval.num_prompts=20``.
"""
from coolsd.static.loop import STEPS, StaticLoop, Workspace

__all__ = ["STEPS", "StaticLoop", "Workspace"]
