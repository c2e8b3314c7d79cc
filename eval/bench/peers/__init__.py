"""Peers: our decoders timed against their authors' own code on the same weights (``scripts/bench_peers.py``).

``comparison`` measures and reports, ``worker`` runs a peer's side in its own process, ``patches`` redirects a
peer's CUDA-only calls to the CPU, ``contract`` is what every glue module (``llamagen``, ``lantern``, ...) provides.
"""
