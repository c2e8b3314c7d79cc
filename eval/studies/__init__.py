"""Studies over many runs: ``claims/`` decides the COOL-SD paper's claims on paired bootstrap replicates;
``embedded`` holds the embedded model's evaluation instruments and its model card.
"""
