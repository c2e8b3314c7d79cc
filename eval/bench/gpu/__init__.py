"""The one GPU command (``scripts/gpu.py``): ``plan`` (steps, budget, timing table, report after every image),
``steps`` (what each step measures), ``report`` (the goals and the page), ``node`` (what the offline GPU nodes'
Python holds, the import-blocked CPU rehearsal and the carried wheels).

Each module imports only what the nodes hold; Hydra, OmegaConf and the metric and logging packages are imported
only inside the named steps that need them.
"""
