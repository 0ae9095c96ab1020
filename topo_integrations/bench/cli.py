"""`topo-align bench`: train the same GPT side by side under each system on one emulated cluster.

    topo-align bench [--preset 2x2|2x2-long|4x2-long|8x1-long|4x1|2leaf|2leaf8] [--systems a,b,...]
                     [--steps N] [--quick] [--out-dir DIR] [--markdown FILE] [--img-dir DIR]
                     [--target-loss X] ...

Thin command-line shim over :mod:`topo_integrations.bench` (driver, systems, report). Exit code 0
when every requested system ran or was reported "not run (reason)", 1 when a system failed, 2 on
bad input or where namespaces cannot be made (not root).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

__all__ = ["add_arguments", "run", "main", "QUICK"]

PROG = "topo-align bench"

QUICK = dict(steps=6, micro_batch=2, layers=2, hidden=64, heads=2, seq_length=32, eval_batches=1, warmup_steps=2,
             reconcile_interval=2)
"""--quick: a few steps of a tiny GPT (CI smoke test); figures from it mean nothing."""

MODELS = {
    "default": {},
    "deep": dict(layers=16, hidden=64, heads=4, seq_length=64, micro_batch=4, sync_last_n_layers=5),
}
"""--model: `deep` is a 16-layer x 64-wide GPT (0.8M parameters, micro-batch 4 of 64 tokens): few
FLOPs per byte, so with slow uplinks (--uplink-mbit 50) the links dominate the step as on a real
cluster, and selective's default (last 5 layers + 15% SYNC) keeps a minority of the elements SYNC."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .driver import PRESETS
    from .systems import SYSTEMS

    p.add_argument("--preset", default="2x2", choices=sorted(PRESETS),
                   help="emulated cluster: 2x2 (default; 2 nodes x 2 ranks, 200 Mbit/s uplinks), 4x1, 2leaf, 2leaf8; "
                        "2x2-long: the long-horizon comparison (deep GPT, 100 Mbit/s, equal wall-clock budget, "
                        "validation curves; docs/benchmarks.md), 4x2-long and 8x1-long: the same at 4 and 8 islands")
    p.add_argument("--systems", default=None, metavar="A,B,...",
                   help="comma-separated subset, in run order (default: the preset's, else all but the optional "
                        f"torchft peers): {', '.join(SYSTEMS)}, post-local-sgd-hN (post-local SGD averaging every N "
                        "steps), torchft-diloco-hN / torchft-localsgd-hN (torchft syncing every N steps)")
    p.add_argument("--localsgd-sweep", default=None, metavar="H,H,...",
                   help="also run post-local SGD at each of these averaging periods (systems post-local-sgd-hN)")
    p.add_argument("--quick", action="store_true", help="a few steps of a tiny model (smoke test)")
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="workload shape: default (4 x 256; 2x2-long: deep) or deep (16 x 64, communication-bound); "
                        "--layers/--hidden/... override it")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per system, interleaved A B C A B C ... (default 1); the table gives the "
                        "median run and the spread, and flags a spread over 25%%")
    p.add_argument("--topo-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a topo_align key for every topo-align system, e.g. local.reconcile_dtype=bf16 "
                        "(VALUE read as JSON, else a string); repeatable")
    p.add_argument("--comm-share", action=argparse.BooleanOptionalAction, default=None,
                   help="also run ds-zero0 with every link unshaped and report the share of its step spent "
                        "communicating (default: on for the long presets only)")
    p.add_argument("--eval-interval", type=int, default=None, metavar="N",
                   help="validation loss on held-out data every N steps, off the clock and the byte counters, "
                        "after averaging the replicas of the local methods (2x2-long: 25)")
    p.add_argument("--lr-schedule", default=None, choices=("cosine", "constant"),
                   help="after the warm-up: cosine to 0.1x at --steps (default) or constant (2x2-long; required "
                        "with an equal budget)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="every system, the reference too, trains for S seconds (default with 2x2-long: "
                        "ds-zero0's time for --steps steps in the same round)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="most steps one run may take under an equal budget (default 8 x --steps)")
    p.add_argument("--steps", type=int, default=None, help="training steps per system (default 40)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per rank per step (default 8)")
    p.add_argument("--layers", type=int, default=None, help="GPT layers (default 4)")
    p.add_argument("--hidden", type=int, default=None, help="GPT hidden size (default 256: 3.3M parameters)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default 128)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="LR warm-up steps (default 6)")
    p.add_argument("--reconcile-interval", type=int, default=None,
                   help="post-local SGD averaging period and topo-align's local.reconcile_interval (default: "
                        "4 for post-local SGD, the schema default of local.reconcile_interval for topo-align)")
    p.add_argument("--localsgd-warmup", type=int, default=None,
                   help="global DDP steps before post-local SGD goes local (default: the LR warm-up)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="target training loss (default: 1.02 x the final loss of stock DeepSpeed ZeRO-0)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--uplink-mbit", type=float, default=None, help="override every node uplink (Mbit/s)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="per-system time limit (default 900 s)")
    p.add_argument("--out-dir", default="runs/bench", help="results.json, per-system logs (default runs/bench)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="write this preset's section (table, goals, plots) into FILE, e.g. docs/benchmarks.md")
    p.add_argument("--section", default=None, metavar="NAME",
                   help="name of the --markdown section and of the plots (default PRESET[-MODEL][-quick]); "
                        "give one per variant so that a --topo-set run does not replace the plain one")
    p.add_argument("--from-results", default=None, metavar="RESULTS.json",
                   help="run nothing: re-render the table, goals and plots of a saved results.json")
    p.add_argument("--img-dir", default=None, metavar="DIR",
                   help="where the PNG plots go (default: docs/img beside --markdown, else OUT_DIR)")


def _spec(args: argparse.Namespace):
    from .driver import PRESETS, BenchSpec
    from .systems import DEFAULT_SYSTEMS

    preset = PRESETS[args.preset]
    kw: dict = dict(preset.defaults)
    kw.update(MODELS[_model(args)])
    if args.quick:
        kw.update(QUICK)
    kw["topo_set"] = _topo_set(args.topo_set)
    if args.budget_s is not None:
        kw["equal_budget"] = True
    for name in ("steps", "micro_batch", "layers", "hidden", "heads", "seq_length", "lr", "warmup_steps",
                 "reconcile_interval", "localsgd_warmup", "target_loss", "seed", "uplink_mbit", "repeats",
                 "comm_share", "eval_interval", "lr_schedule", "budget_s", "max_steps"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.timeout is not None:
        kw["timeout_s"] = args.timeout
    systems = (preset.systems or DEFAULT_SYSTEMS) if args.systems is None else \
        tuple(s.strip() for s in args.systems.split(",") if s.strip())
    sweep = (f"post-local-sgd-h{h}" for h in _sweep(args.localsgd_sweep))
    systems += tuple(k for k in sweep if k not in systems)
    return BenchSpec(preset=args.preset, systems=systems, out_dir=args.out_dir, **kw)


def _model(args: argparse.Namespace) -> str:
    from .driver import PRESETS

    return args.model or PRESETS[args.preset].model or "default"


def _sweep(text: str | None) -> list[int]:
    from .driver import BenchError

    if text is None:
        return []
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise BenchError(f"--localsgd-sweep {text!r}: expected averaging periods >= 1, e.g. 2,8,16")
    return [int(t) for t in items]


def _topo_set(items: list[str]) -> dict:
    import json

    from .driver import BenchError

    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise BenchError(f"--topo-set {item!r}: expected KEY=VALUE, e.g. local.reconcile_dtype=bf16")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def write_section(path: str, preset: str, text: str) -> None:
    """Replace this preset's marked section of ``path`` (or append it)."""
    begin, end = f"<!-- bench:{preset}:begin -->", f"<!-- bench:{preset}:end -->"
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(new)
    os.replace(path + ".tmp", path)


def _load_results(path: str, spec) -> dict:
    import json

    from .driver import BenchError
    from .report import summarize

    try:
        with open(path, encoding="utf-8") as fh:
            results = json.load(fh)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--from-results {path!r}: cannot read it ({exc})") from None
    if results.get("format") != "topo-align/bench/v1":
        raise BenchError(f"--from-results {path!r}: not a topo-align bench results file")
    spec.preset = results["preset"]
    return summarize(results, target_loss=spec.target_loss)


def run(args: argparse.Namespace) -> int:
    from ..emulate.signals import Stopped, stop_signals_raise
    from .driver import PRESETS, BenchError, run_bench
    from .report import markdown, plot

    try:
        spec = _spec(args)
        spec.check()
        if args.section is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}", args.section):
            raise BenchError(f"--section {args.section!r}: use lower-case letters, digits and '-' (at most 41), "
                             "e.g. 2x2-deep-lean")
    except BenchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    command = "topo-align bench " + " ".join(shlex.quote(a) for a in (getattr(args, "_argv", None) or sys.argv[2:]))
    try:
        if args.from_results:
            results = _load_results(args.from_results, spec)
        else:
            # SIGTERM/SIGHUP as well as Ctrl-C unwind through the cluster's cleanup (ranks, namespaces).
            with stop_signals_raise():
                results = run_bench(spec, log=lambda m: print(m, file=sys.stderr, flush=True), command=command)
    except BenchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Stopped as stop:
        print(f"{PROG}: stopped by signal {stop.signum}; emulated cluster removed", file=sys.stderr)
        return 128 + stop.signum
    img_dir = args.img_dir or (os.path.join(os.path.dirname(os.path.abspath(args.markdown)), "img") if args.markdown
                               else args.out_dir)
    # The section (and image) name: preset, model when not the default, quick.
    model = _model(args)
    name = args.section or (spec.preset + (f"-{model}" if model not in ("default", PRESETS[spec.preset].model) else "")
                            + ("-quick" if args.quick else ""))
    stem = f"bench-{name}"
    images = plot(results, img_dir, stem)
    if args.markdown:
        rel = {k: os.path.relpath(v, os.path.dirname(os.path.abspath(args.markdown))) for k, v in images.items()}
        write_section(args.markdown, name, markdown(results, rel))
    from .report import table

    print(table(results))
    for g in results.get("goals", []):
        print(f"goal: {g['goal']}: {g['met']}: {g['detail']}")
    if results.get("comm_share"):
        print(f"communication share: {results['comm_share'].get('detail')}")
    return 1 if any(e.get("status") == "failed" for e in results["systems"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
