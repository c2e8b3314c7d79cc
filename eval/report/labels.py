"""Method labels as the papers write them: ``COOL-SD δ=1.1``, ``LANTERN++ k=10, λ=5``, ``vanilla SD (chain, L=4)``.

Shared by the per-run table and plot (``eval.report.run_table``) and the paper tables and plots
(``eval.report.paper_tables``, ``eval.report.paper_plots``). A label is the paper's name, its headline options
(δ, k, λ), then in parentheses the options that are always noted (the tree of vanilla SD) and those that
differ between rows of the same method; each option appears once (a chain's draft length is part of its tree
text). A sweep's curve is labelled without the swept option, which the plots write beside each point.

Example: ``python scripts/make_tables.py results/runs/sweep_coolsd_delta`` (the curve "COOL-SD", points δ=1.1, …).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

DECODER_LABELS = {  # the order is the tables' method order
    "ar": "AR", "sjd": "SJD", "scd_mc": "SCD-MC", "scd_gs": "SCD-GS", "sjd_pac": "SJD-PAC", "gsd": "GSD",
    "pathrelax": "PathRelax (lossy)",  # lossy, and no TV column can say so: its path choice is not a token test
    "sd": "vanilla SD", "lantern": "LANTERN", "lantern_pp": "LANTERN++", "coolsd": "COOL-SD", "zipar": "ZipAR",
    "zipar_adaptive": "adaptive ZipAR", "pjd": "PJD", "sjd_sv": "SJD-SV (unofficial)", "gsd_sv": "GSD-SV (unofficial)",
    "lantern_sjd": "LANTERN (Jacobi)", "vvs": "VVS"}
#: decoders with an ``sv`` block (``baselines/sv.py``): their name with the subsequence test (off, on); on, it is
#: "unofficial" (its rule comes from a secondary description of the paper, not from the paper's text or code)
SV_LABELS = {"sjd_sv": ("SJD (SV off)", "SJD-SV (unofficial)"), "gsd_sv": ("GSD (SV off)", "GSD-SV (unofficial)"),
             "lantern_sjd": ("LANTERN (Jacobi)", "LANTERN-SV (Jacobi, unofficial)")}
#: the subsequence test's defaults (``baselines.sv.SubsequenceVerifier``): noted in a label only where a row differs
SV_DEFAULTS = {"fallback": True, "fallback_uniform": "same", "reject_at": "run_start", "earlier_runs": "keep",
               "zero_prob": "ride"}
HEADLINE = {"coolsd": ("delta",), "lantern": ("delta", "k"), "lantern_pp": ("k", "lam"),
            "gsd": ("group_size",), "zipar": ("window",), "zipar_adaptive": ("window",),
            "pjd": ("context", "draft_window"), "sjd_sv": ("alpha",), "gsd_sv": ("group_size", "alpha"),
            "lantern_sjd": ("delta", "k", "alpha"), "vvs": ("skip_policy",)}  # always labelled (α only where the subsequence test is on)
ALWAYS_NOTED = {"sd": ("tree",)}  # always in the label's parenthesis
STRENGTH = {"coolsd": "delta", "lantern": "delta", "lantern_pp": "lam", "gsd": "group_size",
            "zipar": "window", "zipar_adaptive": "window", "pjd": "context"}  # relaxation strength (ZipAR:
#              its window, PJD: its context; smaller is faster and coarser)
SWEEP_KEYS = ("delta", "lam", "k", "draft_len", "window", "context", "draft_window", "alpha")  # the options a sweep varies, by priority
SYMBOLS = {"delta": "δ", "lam": "λ", "nu": "ν", "mu": "μ", "draft_len": "L", "group_size": "G", "window": "s",
           "context": "c", "draft_window": "W", "alpha": "α"}
SWEEP_NAMES = {"delta": "relaxation strength δ", "lam": "relaxation strength λ", "k": "neighbourhood size k",
               "draft_len": "draft length L", "window": "ZipAR window s", "context": "PJD context c",
               "draft_window": "PJD draft window W", "alpha": "SV suffix share α"}
TREES = {None: "chain", "mc_sim_7b_63": "EAGLE-1 tree", "dynamic": "EAGLE-2 tree"}
RESAMPLING = {"reference": "reference resampling", "reference_q": "q-side resampling",
              "optimal": "G* resampling"}
# decoder keys that do not change what a decoder computes, or are shown elsewhere
BOOKKEEPING = {"_target_", "name", "track_tv", "sync_phases", "neighbour_cache"}


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def decoder_options(decoder_cfg: dict[str, Any]) -> dict[str, Any]:
    """What identifies a decoder configuration: its options minus bookkeeping keys."""
    options = {k: v for k, v in decoder_cfg.items() if k not in BOOKKEEPING}
    options["path"] = options.get("path", "eager")  # a record from before decoder.path: the eager loop
    options["refill"] = options.get("refill", False)  # a record from before decoder.refill: lock-step batches
    order = options.pop("order", None)  # a generation order's options are the method's (ZipAR's window)
    if isinstance(order, dict):
        options.update({k: v for k, v in order.items() if k not in ("_target_", "_partial_")})
    if options.get("tree") != "dynamic":
        options.pop("dynamic_tree", None)  # only read by the dynamic tree
    sv = options.pop("sv", None)  # SJD-SV's block: on/off, and its options only where it is on
    if isinstance(sv, dict):
        options["sv"] = bool(sv.get("enabled"))
        if options["sv"]:
            options.update({k: v for k, v in sv.items() if k != "enabled"})
    return options


def value_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        if "checkpoint" in value:
            return Path(str(value["checkpoint"])).name
        if "_target_" in value:
            return str(value["_target_"]).rsplit(".", 1)[-1]
        return json.dumps(value, sort_keys=True)
    return str(value)


def option_text(key: str, value: Any, options: dict[str, Any], skip: Sequence[str] = ()) -> str:
    """One option as labels show it: ``δ=1.1``, ``EAGLE-1 tree``, ``chain, L=4``, ``G* resampling``."""
    if key == "tree":
        text = TREES.get(value, f"{value} tree")
        chain_length = value is None and "draft_len" in options and "draft_len" not in skip
        return f"{text}, L={options['draft_len']}" if chain_length else text
    if key == "resample":
        return RESAMPLING.get(value, f"{value} resampling")
    if key == "skip_policy":  # VVS: "uniform 5", "dynamic 0.70"
        if value == "dynamic":
            return f"dynamic {float(options.get('similarity_threshold', 0.7)):.2f}"
        return f"{value} {value_text(options.get('skip_interval', 5))}"
    if key == "schedule":
        return f"{value} schedule"
    if key == "drafter":
        return f"drafter {value_text(value)}"
    if key == "sv":
        return "subsequence verification" if value else "token verification"
    if key == "path":
        return f"{value} path"
    if key == "refill":
        return "refilled rows" if value else "lock-step batches"
    return f"{SYMBOLS.get(key, key)}={value_text(value)}"


def method_label(decoder: str, options: dict[str, Any], noted: Sequence[str], skip: Sequence[str] = ()) -> str:
    """The paper's name, its headline options, then ``noted`` options in parentheses (``skip`` left out; each
    option once: a chain's ``L`` is in its tree text, so a noted ``draft_len`` is not repeated)."""
    name = DECODER_LABELS.get(decoder, decoder)
    if decoder in SV_LABELS and "sv" in options:
        name = SV_LABELS[decoder][bool(options["sv"])]
    parts = [name]
    head = [option_text(k, options[k], options, skip) for k in HEADLINE.get(decoder, ())
            if k in options and k not in skip]
    if head:
        parts.append(", ".join(head))
    keys: list[str] = []
    if decoder in SV_LABELS:  # the name says whether the test is on; its options only where not the default
        noted = [k for k in noted if k != "sv" and not (k in SV_DEFAULTS and options.get(k, SV_DEFAULTS[k])
                                                        == SV_DEFAULTS[k])]
    for k in (*ALWAYS_NOTED.get(decoder, ()), *noted):
        if k not in skip and k not in keys and k not in HEADLINE.get(decoder, ()) and (k in options or k == "tree"):
            keys.append(k)
    if "tree" in keys and options.get("tree") is None:
        keys = [k for k in keys if k != "draft_len"]  # "chain, L=4" already says it
    extra = [option_text(k, options.get(k), options, skip) for k in keys]
    if extra:
        parts.append("(" + ", ".join(extra) + ")")
    return " ".join(parts)


def point_label(key: str | None, value: Any) -> str:
    """The text beside a sweep's point: ``δ=1.1``, ``L=3`` ("" without a sweep option)."""
    def absent(v: Any) -> bool:
        return v is None or (isinstance(v, float) and v != v)  # None, or NaN from a pandas column

    if absent(key) or absent(value):
        return ""
    return f"{SYMBOLS.get(key, key)}={value_text(float(value) if isinstance(value, (int, float)) else value)}"
