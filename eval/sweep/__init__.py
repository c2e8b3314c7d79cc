"""A command's jobs before submission: ``jobs`` expands a sweep as ``run.py -m`` would and checks every job,
``costs`` estimates its GPU-hours from a cited latency table (``gpu_costs.csv``).
"""
