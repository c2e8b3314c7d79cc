"""Where a decode's time goes: ``efficiency`` (the cost model, ideal speedups, throughput), ``call_counts`` (torch
calls and host synchronisations per phase), ``peers/`` (our decoders against their authors' code),
``gpu_smoke`` (a first GPU node's pass/fail table) and ``gpu_check_llamagen`` (LlamaGen-XL's numerics on a GPU).
"""
