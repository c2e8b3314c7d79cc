"""Time our decoders against their authors' own code on the same tiny weights (eval/bench/peers/comparison.py
explains).

    python scripts/bench_peers.py --peer llamagen=../LlamaGen --peer lantern=../LANTERN \
        --python sjd=.peers/venv/bin/python --peer sjd=../Accelerating-T2I-AR-with-SJD --prompts 20

Each --peer NAME=DIR is a clone of the peer's repository at the commit eval/bench/peers/NAME.py pins (the error says
the clone command). --keep <earlier .json> keeps that table's rows, as measured, for the peers this run does not
measure (``python scripts/bench_peers.py --keep results/bench/peers_cpu.json`` rewrites the table with every peer's
current reason for not running, its rows unchanged). Peers that pin other package versions than ours (the Lumina-mGPT-based ones: transformers
4.47.1) run under --python NAME=<interpreter of a venv made with --system-site-packages over ours>; see
docs/benchmark.md "Against the authors' code". Writes results/bench/peers_cpu.{md,json} (--out).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch: idle threads sleep while the other side runs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.bench.peers import comparison  # noqa: E402


def pairs_of(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} takes NAME=PATH, got {value!r}")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", action="append", default=[], help="NAME=<checkout>; known: "
                        + ", ".join(comparison.PEERS))
    parser.add_argument("--python", action="append", default=[], help="NAME=<interpreter> for that peer's side")
    parser.add_argument("--prompts", type=int, default=20, help="timed prompts per pair (at least 20 for a table)")
    parser.add_argument("--prompt-file", default=None, help="one prompt per line (default: data=fixed, cycled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="untimed images per side first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side (null: torch's default)")
    parser.add_argument("--only", action="append", default=[], help="our decoder names to run (default: all pairs)")
    parser.add_argument("--out", default="results/bench/peers_cpu.md")
    parser.add_argument("--device", default="CPU", help="the table's heading (CPU; the peer bench is CPU-only)")
    parser.add_argument("--keep", default=None, help="an earlier table's .json: keep its rows, as measured, for "
                                                     "every peer this run does not measure (e.g. to add a peer)")
    parser.add_argument("--path", default="eager", choices=("eager", "static"),
                        help="our decode path (decoder.path): the papers' eager loop or the static path")
    parser.add_argument("--compile", action="store_true",
                        help="ours with model.compile=true (the static step compiled whole; the warm-up images "
                             "compile it, untimed; no anatomy table: a compiled step has no phases to hook)")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        raise SystemExit("--prompts must be at least 1")
    peers = {k: Path(v).expanduser().resolve() for k, v in pairs_of(args.peer, "--peer").items()}
    pythons = pairs_of(args.python, "--python")
    prompts = comparison.prompts_for(args.prompts, args.prompt_file)
    record = comparison.run(peers, pythons, prompts, args.seed, args.warmup, args.threads, args.only, path=args.path,
                            compiled=args.compile)
    command = "python scripts/bench_peers.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    meta = comparison.meta_for(command, len(prompts), args.seed, args.warmup, args.threads, args.device, args.path,
                               args.compile)
    if args.keep:
        import json

        record, meta = comparison.keep(record, meta, json.loads(Path(args.keep).read_text()))
    out = Path(args.out)
    comparison.write(out, record, meta)
    print(comparison.markdown(record["rows"], record["skipped"], meta, record["specs"]).split("\n## ")[0])
    faster = sum(1 for r in record["rows"] if comparison.verdict(r) != "ours slower")
    kept = sum(1 for r in record["rows"] if r["peer"] in meta.get("kept", {}).get("peers", ()))
    print(f"{len(record['rows']) - kept} pairs measured" + (f" and {kept} kept" if kept else "")
          + f", ours at least as fast in {faster}; "
          f"{len(record['skipped'])} peers not run; wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
