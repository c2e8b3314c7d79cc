"""The class paths of earlier versions: every class that moved when ``eval/`` became sub-packages (issue 56), old
path -> new path, so a run folder written before the move still reads as this version names its classes.

A stored ``run.json`` keeps the resolved config of its run, ``_target_`` paths included
(``eval.runner.EvalSuite``, ``eval.prompts.ClassPrompts``, ``eval.stats.Bootstrap``, ...). ``current_targets``
rewrites them to the paths that today's configs compose (``eval.run.suite.EvalSuite``,
``coolsd.prompts.ClassPrompts``, ``eval.metrics.intervals.Bootstrap``), so a finished row is still recognised as
finished (``eval.run.experiment.finished_record`` compares the configs) and the tables, the report and the
claims see one name per class (``eval.records.run_json.read_run``). Only ``_target_`` values change; no other
key or value. The decoders' fingerprints (``records/<decoder>.fingerprint.json``) name model, decoder and
drafter classes of ``coolsd`` and ``baselines``, none of which moved, so they need no map.

Example: ``current_target("eval.runner.EvalSuite")`` is ``"eval.run.suite.EvalSuite"``; a path that did not move
comes back unchanged.
"""
from __future__ import annotations

from typing import Any

#: every public class of a module that moved, every name of a module that was split (``eval.records``,
#: ``eval.distributed``, ``eval.runner``) and every name that was folded into another module's, old path -> the
#: path today's configs use
MOVED_NAMES = {
    "eval.prompts.ClassPrompts": "coolsd.prompts.ClassPrompts",
    "eval.prompts.FilePrompts": "coolsd.prompts.FilePrompts",
    "eval.prompts.FixedPrompts": "coolsd.prompts.FixedPrompts",
    "eval.prompts.CocoCaptions": "coolsd.prompts.CocoCaptions",
    "eval.prompts.PartiPrompts": "coolsd.prompts.PartiPrompts",
    "eval.records.JsonlLog": "eval.records.image_records.JsonlLog",
    "eval.records.RunRecords": "eval.run.resume.RunRecords",
    "eval.distributed.RankMarkers": "eval.records.rank_markers.RankMarkers",
    "eval.distributed.Shards": "eval.run.shards.Shards",
    "eval.runner.EvalSuite": "eval.run.suite.EvalSuite",
    "eval.generator.Generator": "eval.run.generator.Generator",
    "eval.ar_cache.ARCache": "eval.run.ar_cache.ARCache",
    "eval.preflight.DecoderConfigError": "eval.run.preflight.DecoderConfigError",
    "eval.preflight.Checked": "eval.run.preflight.Checked",
    "eval.preflight.Recipe": "eval.run.preflight.Recipe",
    "eval.preflight.StandIn": "eval.run.preflight.StandIn",
    "eval.logging.Progress": "eval.run.loggers.Progress",
    "eval.logging.NullLogger": "eval.run.loggers.NullLogger",
    "eval.logging.WandbLogger": "eval.run.loggers.WandbLogger",
    "eval.stats.Bootstrap": "eval.metrics.intervals.Bootstrap",
    "eval.stats.ReferenceStats": "eval.metrics.intervals.ReferenceStats",
    "eval.image_reward.ImageRewardArch": "eval.metrics.image_reward.ImageRewardArch",
    "eval.image_reward.VisionTransformer": "eval.metrics.image_reward.VisionTransformer",
    "eval.image_reward.TextEncoder": "eval.metrics.image_reward.TextEncoder",
    "eval.image_reward.ImageRewardModel": "eval.metrics.image_reward.ImageRewardModel",
    "eval.image_reward.ImageReward": "eval.metrics.ImageReward",
    "eval.html_report.ReportError": "eval.report.html_page.ReportError",
    "eval.html_report.Row": "eval.report.html_page.Row",
    "eval.html_report.Column": "eval.report.html_page.Column",
    "eval.html_report.Folder": "eval.report.html_page.Folder",
    "eval.html_report.Table": "eval.report.html_page.Table",
    "eval.html_report.Verdicts": "eval.report.html_page.Verdicts",
    "eval.tables.Column": "eval.report.paper_tables.Column",
    "eval.tables.Measurement": "eval.report.paper_tables.Measurement",
    "eval.tables.Cell": "eval.report.paper_tables.Cell",
    "eval.tables.TableRow": "eval.report.paper_tables.TableRow",
    "eval.tables.UsageError": "eval.report.paper_tables.UsageError",
    "eval.tables.ProtocolMismatch": "eval.report.paper_tables.ProtocolMismatch",
    "eval.tables.CardRow": "eval.report.paper_tables.CardRow",
    "eval.tables.Tables": "eval.report.paper_tables.Tables",
    "eval.tables.Written": "eval.report.paper_tables.Written",
    "eval.status.StatusError": "eval.report.sweep_status.StatusError",
    "eval.status.RowStatus": "eval.report.sweep_status.RowStatus",
    "eval.status.Row": "eval.report.sweep_status.Row",
    "eval.status.Job": "eval.report.sweep_status.Job",
    "eval.jobs.JobCheck": "eval.sweep.jobs.JobCheck",
    "eval.jobs.FileResolver": "eval.sweep.jobs.FileResolver",
    "eval.costs.Cost": "eval.sweep.costs.Cost",
    "eval.costs.Estimate": "eval.sweep.costs.Estimate",
    "eval.bench.Timer": "eval.bench.efficiency.Timer",
    "eval.bench.Probes": "eval.bench.efficiency.Probes",
    "eval.bench.DrafterCost": "eval.bench.efficiency.DrafterCost",
    "eval.bench.Costs": "eval.bench.efficiency.Costs",
    "eval.bench.ForwardProbe": "eval.bench.efficiency.ForwardProbe",
    "eval.bench.CostModel": "eval.bench.efficiency.CostModel",
    "eval.bench.Verify": "eval.bench.efficiency.Verify",
    "eval.bench.DecoderResult": "eval.bench.efficiency.DecoderResult",
    "eval.call_counts.CallCounter": "eval.bench.call_counts.CallCounter",
    "eval.call_counts.PhaseCounter": "eval.bench.call_counts.PhaseCounter",
    "eval.call_counts.DecodeCounts": "eval.bench.call_counts.DecodeCounts",
    "eval.peers.runner.PeerWorker": "eval.bench.peers.comparison.PeerWorker",
    "eval.peers.runner.PairResult": "eval.bench.peers.comparison.PairResult",
    "eval.peers.base.PeerImage": "eval.bench.peers.contract.PeerImage",
    "eval.peers.base.Pair": "eval.bench.peers.contract.Pair",
    "eval.peers.base.PeerSpec": "eval.bench.peers.contract.PeerSpec",
    "eval.claims.statistics.Comparison": "eval.studies.claims.analysis.Comparison",
    "eval.claims.statistics.Claim": "eval.studies.claims.analysis.Claim",
    "eval.claims.data.Point": "eval.studies.claims.data.Point",
    "eval.claims.data.Regime": "eval.studies.claims.data.Regime",
    "eval.peers.worker.Worker": "eval.bench.peers.worker.Worker",
    "eval.peers.patches.DevicePatches": "eval.bench.peers.patches.DevicePatches",
    "eval.bench.WARMUP_SEED": "eval.run.suite.WARMUP_SEED",
    "eval.distributed.launch_environment": "coolsd.launch.launch_environment",
    "eval.generator.WARMUP_SEED": "eval.run.suite.WARMUP_SEED",
    "eval.records.MODEL_DEFAULTS": "eval.records.fingerprints.MODEL_DEFAULTS",
    "eval.records.UNFINGERPRINTED": "eval.records.fingerprints.UNFINGERPRINTED",
    "eval.records.WEIGHT_LOCATIONS": "eval.records.fingerprints.WEIGHT_LOCATIONS",
    "eval.records.atomic_write_json": "coolsd.io.atomic_write_json",
    "eval.records.decoder_fingerprint": "eval.records.fingerprints.decoder_fingerprint",
    "eval.records.environment": "eval.records.environment.environment",
    "eval.records.git_commit": "eval.records.environment.git_commit",
    "eval.records.load_records": "eval.records.image_records.load_records",
    "eval.records.normalised": "eval.records.fingerprints.normalised",
    "eval.records.record_signatures": "eval.records.image_records.record_signatures",
    "eval.records.save_png": "eval.records.image_records.save_png",
    "eval.runner.NUMERICS_MISMATCH": "eval.run.suite.NUMERICS_MISMATCH",
    "eval.runner.RESUME": "eval.run.suite.RESUME",
    "eval.runner.select_decoders": "eval.run.suite.select_decoders",
    "eval.peers.runner.WARMUP_SEED": "eval.run.suite.WARMUP_SEED",
    "eval.peers.runner.environment": "eval.records.environment.environment",
    "eval.status.RANK_FILE": "eval.records.image_records.RECORD_FILE",
}

#: every module that moved, old -> new: any other name of it (a function, a private class) follows its module
MOVED_MODULES = {
    "eval.ar_cache": "eval.run.ar_cache",
    "eval.bench": "eval.bench.efficiency",
    "eval.call_counts": "eval.bench.call_counts",
    "eval.card": "eval.report.evaluation_card",
    "eval.claims.statistics": "eval.studies.claims.analysis",
    "eval.costs": "eval.sweep.costs",
    "eval.distributed": "eval.run.shards",
    "eval.embedded": "eval.studies.embedded",
    "eval.fid_inception": "eval.metrics.fid_inception",
    "eval.generator": "eval.run.generator",
    "eval.gpu_check": "eval.bench.gpu_check_llamagen",
    "eval.gpu_smoke": "eval.bench.gpu_smoke",
    "eval.html_report": "eval.report.html_page",
    "eval.image_reward": "eval.metrics.image_reward",
    "eval.jobs": "eval.sweep.jobs",
    "eval.labels": "eval.report.labels",
    "eval.logging": "eval.run.loggers",
    "eval.peers.base": "eval.bench.peers.contract",
    "eval.peers.runner": "eval.bench.peers.comparison",
    "eval.plots": "eval.report.paper_plots",
    "eval.prefetch": "eval.run.prefetch",
    "eval.preflight": "eval.run.preflight",
    "eval.prompts": "coolsd.prompts",
    "eval.records": "eval.records.image_records",
    "eval.report": "eval.report.run_table",
    "eval.runner": "eval.run.experiment",
    "eval.stats": "eval.metrics.intervals",
    "eval.status": "eval.report.sweep_status",
    "eval.tables": "eval.report.paper_tables",
}

#: packages that moved whole: their modules follow them (``eval.peers.llamagen`` -> ``eval.bench.peers.llamagen``)
MOVED_PACKAGES = {
    "eval.claims": "eval.studies.claims",
    "eval.peers": "eval.bench.peers",
}


def current_target(path: str) -> str:
    """``path`` (``package.module.Name``) as this version names it."""
    if path in MOVED_NAMES:
        return MOVED_NAMES[path]
    module, _, name = path.rpartition(".")
    if module in MOVED_MODULES:  # exact: eval.report, eval.bench, eval.records are packages now
        return f"{MOVED_MODULES[module]}.{name}"
    for old, new in MOVED_PACKAGES.items():
        if module == old or module.startswith(old + "."):
            return f"{new}{module[len(old):]}.{name}"
    return path


def current_targets(obj: Any) -> Any:
    """A copy of ``obj`` (a config: dicts and lists, any depth) with every ``_target_`` as this version names it."""
    if isinstance(obj, dict):
        return {k: current_target(v) if k == "_target_" and isinstance(v, str) else current_targets(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [current_targets(v) for v in obj]
    return obj


#: decoder keys later versions added, with the value every earlier run behaved as: a stored config without them is
#: read with them (``current_config``), so a finished row from before still matches today's composed config
ADDED_DECODER_KEYS = {"path": "eager", "refill": False}
#: ``eval`` keys added later (issue 59), with the value an earlier run behaved as (``preflight``, ``code_mismatch``
#: change no number: ``eval.run.experiment.finished_record`` leaves them out of its comparison anyway)
ADDED_EVAL_KEYS = {"code_mismatch": "refuse", "ar_timing": "run", "preflight": True}


def current_config(config: dict[str, Any]) -> dict[str, Any]:
    """A stored run config as this version composes it: ``current_targets``, and ``ADDED_DECODER_KEYS`` filled in
    where missing in ``decoder`` and every ``suite`` entry (the decoder configs of a run), ``ADDED_EVAL_KEYS`` in
    its ``eval``."""
    config = current_targets(config)
    nodes = [config.get("decoder")] + list((config.get("suite") or {}).values())
    for node in nodes:
        if isinstance(node, dict) and "_target_" in node:
            for key, value in ADDED_DECODER_KEYS.items():
                node.setdefault(key, value)
    suite = config.get("eval")
    if isinstance(suite, dict) and suite.get("_target_") == "eval.run.suite.EvalSuite":
        for key, value in ADDED_EVAL_KEYS.items():
            suite.setdefault(key, value)
    return config
