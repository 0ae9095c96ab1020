"""`topo-align simulate`: argument parsing and running (the `topo-align` CLI imports add_arguments/run).

Bad input raises a ValueError subclass inside; `run` prints its one-line message to stderr and
returns 2 (no traceback).
"""

from __future__ import annotations

import argparse
import math
import sys

from ..config import ConfigError
from ..topology.file_source import load_topology_file
from ..topology.model import TopologyError
from .algorithms import ALGORITHMS
from .compute import DEFAULT_MFU, DEFAULT_SEQ_LENGTH, DEFAULT_TOKENS_PER_STEP, GPU_PEAK_TFLOPS, with_compute_defaults
from .model import DTYPE_BYTES, GRADIENT_DTYPES, RANK_ORDERS, SimError
from .scenario import SimOptions, options_from_block, simulate
from .workload import Workload, workload_from_deepspeed_config, workload_from_megatron_args

_D = SimOptions()  # the defaults the help texts name

__all__ = ["add_arguments", "run", "main", "options_and_workload"]


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def _number_or_auto(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return _float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor auto") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", metavar="FILE", help="JSON topology file (docs/topology-format.md); required "
                   "unless --bench")
    p.add_argument("--bench", metavar="RESULTS.json",
                   help="price the systems of a `topo-align bench` run (its results.json) on the cluster it "
                        "emulated and compare with what it measured (docs/costmodel.md, section 4)")
    p.add_argument("--tolerance", type=_float, default=0.25,
                   help="with --bench: the relative error counted as a match (default 0.25)")
    m = p.add_argument_group("model and layout")
    m.add_argument("--params", type=_float, help="model parameters, e.g. 175e9")
    m.add_argument("--grad-dtype", choices=list(GRADIENT_DTYPES), help="gradient dtype (default bf16)")
    m.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    m.add_argument("--pp", type=int, help="pipeline-parallel size (default 1); DP = GPUs / (TP x PP)")
    m.add_argument("--num-layers", type=int, help="transformer layers (for the last-N share of selective)")
    m.add_argument("--deepspeed-config", metavar="FILE", help="DeepSpeed config: precision and its topo_align block")
    m.add_argument(
        "--megatron-args", metavar="FILE", help="Megatron flags (.args or .json): model, TP/PP, batch, topo-align flags"
    )
    c = p.add_argument_group("compute per step", "6 x params x tokens / (GPUs x MFU x peak), unless --compute-s; "
                             "missing inputs take the defaults of docs/costmodel.md, named in the output")
    c.add_argument("--compute-s", type=_float, help="forward+backward seconds per step")
    c.add_argument("--gpu", metavar="KIND", help=f"GPU kind for the peak ({', '.join(GPU_PEAK_TFLOPS)}; "
                   "default: the topology file's \"gpu\")")
    c.add_argument("--mfu", type=_float, help=f"model FLOPs utilisation (default {DEFAULT_MFU:g})")
    c.add_argument("--peak-tflops", type=_float, help="peak TFLOP/s per GPU (default: from the GPU kind, "
                   "e.g. 312 for A100 bf16)")
    c.add_argument("--tokens-per-step", type=_float,
                   help=f"global batch in tokens (default: from --megatron-args or --deepspeed-config, "
                        f"else {DEFAULT_TOKENS_PER_STEP:.0f})")
    c.add_argument("--seq-length", type=int, metavar="N",
                   help=f"tokens per sample, with --deepspeed-config's train_batch_size (default {DEFAULT_SEQ_LENGTH})")
    o = p.add_argument_group("algorithms and modes")
    o.add_argument("--algorithms", default=",".join(_D.algorithms),
                   help=f"comma list of {', '.join(ALGORITHMS)} "
                        "(default: all but the peers localsgd, diloco and powersgd)")
    o.add_argument("--rank-order", choices=list(RANK_ORDERS), default="leaf",
                   help="leaf: hosts grouped by leaf; scattered: seeded random host order; file: as written")
    o.add_argument("--seed", type=int, default=0, help="seed of the scattered order")
    o.add_argument("--group-by", choices=["island", "leaf"], help="intra group of hierarchical/selective")
    o.add_argument("--bucket-mb", type=_number_or_auto,
                   help="bucket size, MiB, for every algorithm; auto (default): the plugin's algorithms take it "
                        "from the group count as the engine does, the references keep 25")
    o.add_argument("--no-overlap", action="store_true", help="launch all buckets after backward")
    o.add_argument("--inter-dtype", choices=list(GRADIENT_DTYPES), help="wire dtype of the plugin's cross-group phases")
    o.add_argument("--top-fraction", type=_number_or_auto,
                   help=f"selective: SYNC share chosen by importance, or auto: from the group count "
                        f"(default {_D.top_fraction})")
    o.add_argument("--last-n-layers", type=int,
                   help=f"selective: last N layers always SYNC (default {_D.last_n_layers})")
    o.add_argument(
        "--last-n-share",
        type=_float,
        help="selective: share of the gradient in the last N layers (overrides the layer count)",
    )
    o.add_argument("--promote-fraction", type=_float,
                   help=f"selective: SYNC share added by drift promotion (default {_D.promote_fraction:g}, "
                        "local.promote_drift_fraction)")
    o.add_argument("--sync-dtype", choices=["auto", *DTYPE_BYTES],
                   help=f"selective: SYNC wire dtype across groups (default {_D.sync_dtype})")
    o.add_argument("--local-dtype", choices=list(GRADIENT_DTYPES),
                   help=f"selective: LOCAL wire dtype (default {_D.local_dtype})")
    o.add_argument(
        "--reconcile-dtype",
        choices=list(DTYPE_BYTES),
        help=f"selective: wire dtype of the parameters (deltas) averaged at reconciliation "
             f"(default {_D.reconcile_dtype})",
    )
    o.add_argument("--reconcile-interval", type=int,
                   help=f"selective: steps between reconciliations (default {_D.reconcile_interval})")
    o.add_argument("--moments-interval", type=int,
                   help=f"selective: Adam moments averaged at every N-th reconciliation "
                        f"(default {_D.moments_interval})")
    o.add_argument("--moments-dtype", choices=["fp32", "bf16", "fp16"],
                   help=f"selective: wire dtype of the Adam moments averaged at reconciliation "
                        f"(default {_D.moments_dtype})")
    o.add_argument("--localsgd-period", type=int,
                   help=f"localsgd: steps between parameter averagings (default {_D.localsgd_period})")
    o.add_argument("--diloco-period", type=int,
                   help=f"diloco: steps H between pseudo-gradient syncs across islands (default {_D.diloco_period})")
    o.add_argument("--powersgd-rank", type=int,
                   help=f"powersgd: rank of the low-rank approximation (default {_D.powersgd_rank}; "
                        "needs --num-layers)")
    o.add_argument("--async-reconcile", dest="async_reconcile", action="store_true", default=None)
    o.add_argument("--sync-reconcile", dest="async_reconcile", action="store_false")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--plot", metavar="FILE.png", help="write a PNG plot")


def options_and_workload(args: argparse.Namespace) -> tuple[Workload, SimOptions]:
    """Defaults < config files (DeepSpeed / Megatron) < explicit flags."""
    wl = Workload(params=1.0, grad_dtype="bf16")
    params_known = False
    if args.seq_length is not None and args.seq_length < 1:
        raise SimError(f"--seq-length {args.seq_length}; expected an integer >= 1")
    if args.deepspeed_config:
        wl = workload_from_deepspeed_config(args.deepspeed_config, wl, seq_length=args.seq_length)
    if args.megatron_args:
        before = wl.params
        wl = workload_from_megatron_args(args.megatron_args, wl)
        params_known = wl.params != before
    kw = {}
    for flag, field in (("params", "params"), ("grad_dtype", "grad_dtype"), ("tp", "tp"), ("pp", "pp"),
                        ("num_layers", "num_layers"), ("compute_s", "compute_s"), ("mfu", "mfu"),
                        ("peak_tflops", "peak_tflops"), ("tokens_per_step", "tokens_per_step")):
        v = getattr(args, flag, None)
        if v is not None:
            kw[field] = v
    if "params" in kw:
        params_known = True
    if not params_known:
        raise SimError(
            "model size unknown: give --params (e.g. 175e9) or --megatron-args with --num-layers and --hidden-size"
        )
    wl = wl.with_(**kw)
    opt = options_from_block(wl.topo_align, SimOptions())
    okw = {"algorithms": tuple(a.strip() for a in args.algorithms.split(",") if a.strip()),
           "rank_order": args.rank_order, "seed": args.seed}
    for flag in ("group_by", "bucket_mb", "inter_dtype", "top_fraction", "last_n_layers", "last_n_share",
                 "promote_fraction", "sync_dtype", "local_dtype", "reconcile_dtype", "reconcile_interval",
                 "moments_interval", "moments_dtype", "localsgd_period", "diloco_period", "powersgd_rank",
                 "async_reconcile"):
        v = getattr(args, flag, None)
        if v is not None:
            okw[flag] = v
    if args.no_overlap:
        okw["overlap"] = False
    from dataclasses import replace

    return wl, replace(opt, **okw)


def _run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .benchcheck import check_bench, render_markdown

    try:
        if not args.tolerance > 0:
            raise SimError(f"--tolerance {args.tolerance:g}; expected a relative error > 0, e.g. 0.25")
        try:
            results = json.loads(Path(args.bench).read_text())
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise SimError(f"--bench {args.bench}: cannot read JSON ({why})") from None
        rows, notes = check_bench(results, compute_s=args.compute_s)
    except (SimError, TopologyError, KeyError) as exc:
        print(f"topo-align simulate: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(rows, notes, args.tolerance))
    return 0


def _method_choice(topo, wl: Workload, opt: SimOptions, notes: list[str]) -> dict | None:
    """What `method: auto` chooses for this cluster (sim/choose.py), or a note why it cannot."""
    from .choose import choose_for_cli

    try:
        return choose_for_cli(topo, wl, opt).to_json()
    except (SimError, TopologyError) as exc:
        notes.append(f"method auto: not applicable: {exc}")
        return None


def run(args: argparse.Namespace) -> int:
    if args.bench:
        return _run_bench(args)
    try:
        if not args.topology:
            raise SimError("--topology FILE is required (or --bench RESULTS.json)")
        topo = load_topology_file(args.topology)
        wl, opt = options_and_workload(args)
        wl = with_compute_defaults(wl, args.gpu or topo.gpu,
                                   gpu_from="--gpu" if args.gpu else f"{args.topology} (\"gpu\")")
        res = simulate(topo, wl, opt)
        res.method = _method_choice(topo, wl, opt, res.notes)
        if args.plot:
            from .report import plot_png

            try:
                plot_png(res, args.plot)
            except OSError as exc:
                raise SimError(f"--plot {args.plot}: cannot write ({exc.strerror or exc})") from None
    except (SimError, TopologyError, ConfigError) as exc:
        print(f"topo-align simulate: {exc}", file=sys.stderr)
        return 2
    from .report import render_table, to_json_text

    if args.json:
        print(to_json_text(res))
    else:
        render_table(res)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="topo-align simulate",
                                description="Alpha-beta cost model of gradient reduction over a topology (simulated).")
    add_arguments(p)
    return run(p.parse_args(argv))
