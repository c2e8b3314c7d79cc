"""The contract between the peer comparison (``eval.bench.peers.comparison``) and one peer's glue module.

A *peer* is a decoder as its authors published it, run from a user's clone of their repository on the weights,
prompts and sampling settings of one of our decoders. Its glue module (``eval/bench/peers/<peer>.py``) holds no
code of theirs: it imports their modules from the clone, loads our tiny weights into their model classes, and
times one image at a time. It exposes::

    SPEC: PeerSpec                                         # what it is, where it comes from, its pairs
    def export(ours: Decoder, pair: Pair) -> dict           # (our process) weights and settings for their side
    def inputs(ours: Decoder, prompt: str) -> object        # (our process) one prompt's conditioning for them
    def build(checkout: Path, payload: dict, pair: Pair) -> Callable[[object, int], PeerImage]   # (worker)

Their side runs in a worker process (``eval.bench.peers.worker``), with the peer's own interpreter where it needs
other package versions than ours (``PeerSpec.requirements``), so that their imports, global state and
monkeypatches never touch our process; messages are pickled (CPU tensors, numbers, strings). ``build`` runs
once per pair in the worker (untimed; weight loading, their model's setup); the callable it returns generates the
image of ``(inputs, seed)`` with their code and says how long their decode took and how many target forwards it
made. The worker installs the run-time replacements of CUDA-only calls that ``SPEC.patches`` names (device
placement only, ``eval.bench.peers.patches``) around ``build`` and around every call, counting each hit. Glue modules
import nothing but the standard library, torch, ``eval.bench.peers.contract`` and other glue modules at module
level: the worker's interpreter may lack our other dependencies.

For the anatomy pass (where the time goes, one untimed image per side), the returned callable may carry the
peer's target network as ``call.target`` and its drafter network as ``call.drafter`` (``nn.Module`` objects whose
forwards are then timed and their torch calls counted apart from the loop).

The accepted length is computed the same way for both sides: tau = (tokens - 1) / (target forwards - 1), the
prefill forward and the token it makes excluded (plain AR: 1.00), tokens = every grid token the loop commits
(codes, and end-of-row tokens where the model has them).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerImage:
    """One image decoded by a peer (or by us, for the same pair)."""

    seconds: float          # wall time from the start of the prefill to the last grid token (no VQ decode)
    tokens: int             # grid tokens committed (codes, and end-of-row tokens where the model has them)
    target_forwards: int    # target forwards, the prefill included; a CFG pair in one batch counts once
    codes: tuple[int, ...] | None = None   # the image's codebook ids, where the glue can read them

    @property
    def tau(self) -> float:
        """Committed tokens per target forward, prefill excluded (plain AR: 1.00)."""
        return (self.tokens - 1) / max(self.target_forwards - 1, 1)


@dataclass(frozen=True)
class Pair:
    """One decoder of ours against one method of a peer."""

    ours: str                    # our decoder config (configs/decoder/<ours>.yaml)
    theirs: str                  # the peer's method, as its glue names it (e.g. "lantern", "eagle")
    overrides: tuple[str, ...] = ()   # Hydra overrides for our side so both run the same algorithm
    difference: str = ""         # where the peer's rule differs from ours on purpose (shown in the table)


@dataclass(frozen=True)
class PeerSpec:
    """A peer: its repository, the commit this glue was written against, our model it runs on, its pairs."""

    name: str                    # the --peer NAME
    repo: str                    # owner/name on GitHub
    commit: str                  # the pinned commit (40 hex digits); the comparison refuses another
    model: str                   # our model config whose weights both sides load (configs/model/<model>.yaml)
    model_overrides: tuple[str, ...] = ()
    pairs: tuple[Pair, ...] = ()
    patches: tuple[str, ...] = ()   # names of eval.bench.peers.patches.PATCHES this peer needs on a CPU
    requirements: tuple[str, ...] = ()   # package pins their code needs beside our torch (a peer venv), e.g.
                                         # ("transformers==4.47.1",); the worker checks them at start
    cpu: str = ""                # why it cannot run on a CPU ("" = it can)
    not_run: str = ""            # why the pair is not measured although it could run (e.g. no checkout could be had
                                 # to write the glue against); listed as "Not run" with this reason
    notes: tuple[str, ...] = field(default_factory=tuple)   # what else a reader of the table must know
