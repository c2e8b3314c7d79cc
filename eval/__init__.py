"""Evaluation: everything around the core's decoders that measures them, one sub-package per concept.

``records`` the run folder on disk; ``metrics`` image quality and the intervals of every number; ``report`` what a
person reads (run table, report page, paper tables and plots, evaluation card, sweep status); ``run`` one
``run.py`` invocation; ``sweep`` a command's jobs and their GPU-hours before submission; ``bench`` efficiency,
call counts, GPU checks and the peers' own code; ``studies`` the paper's claims and the embedded model's card.
Each package imports only those listed before it (``tests/test_layout.py``).
"""
