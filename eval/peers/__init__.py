"""Peers: our decoders timed against their authors' own code on the same weights (``scripts/bench_peers.py``).

``runner`` measures and reports, ``worker`` runs a peer's side in its own process, ``patches`` redirects a peer's
CUDA-only calls to the CPU, ``base`` is the contract every glue module (``llamagen``, ``lantern``, ...) follows.
"""
