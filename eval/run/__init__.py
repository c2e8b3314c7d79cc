"""One ``run.py`` invocation: settings, checks before the model loads, generation on every rank, scoring, record.

``suite`` the settings and the compared decoders; ``prefetch`` and ``preflight`` every file and decoder option
checked before the target is built; ``shards`` the ranks and their meetings; ``resume`` the finished records a run
keeps; ``ar_cache`` AR images shared between runs; ``generator`` one rank's images; ``loggers`` W&B or none;
``experiment`` the whole run, from config to ``run.json``.
"""
