"""What both pretraining entry points share: flags, the "topo_align" block, process start-up, schedule.

The two scripts (``pretrain_deepspeed``, ``pretrain_megatron``) differ only in how the model, the
optimizer and the gradient reduction are built; data, logging, checkpoint cadence and the flags that
choose topo-align's behaviour are defined once here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError, TopoAlignConfig, local_class_defaults
from .data import DEFAULT_MAX_BYTES, DataError, GlobalBatches, build_gpt_datasets, prepare_dataset
from .model import PRESETS, PresetError

__all__ = ["UsageError", "ArgumentParser", "add_common_args", "parse_set", "topo_block", "init_distributed",
           "lr_at", "RunPaths", "run_paths", "virtual_hostname", "fail", "quiet_known_warnings", "EXIT_COLLECTIVE",
           "run_main", "attempt_store"]


def quiet_known_warnings() -> None:
    """Silence the notices every rank would print that say nothing to the user. Called by the entry
    points' ``main()`` (never at import: a library module leaves the process's filters alone).

    megatron-core warns at import, once per module and rank, that it falls back to its own kernels
    without Transformer Engine/Apex; on CPU that is expected, and 16 copies would bury the progress
    bar. torch 2.13 renames the tensor collectives the reducer uses (gloo and NCCL run them
    unchanged), and megatron-core's default config trips its own deprecation notice.
    """
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated")


class UsageError(ValueError):
    """Bad command-line input; the entry point prints one line and exits 2."""


def fail(msg: str) -> None:
    """Print one line and exit 2 (rank 0 only prints; every rank exits)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (``error: ...``, exit status 2) instead of the full usage."""

    def error(self, message: str):  # type: ignore[override]
        if int(os.environ.get("RANK", "0")) == 0:
            sys.stderr.write(f"error: {message} (see --help)\n")
        self.exit(2)


def add_common_args(ap: argparse.ArgumentParser, *, topo_flags: bool = True) -> None:
    """The flags both entry points share. ``topo_flags=False`` leaves out ``--topo-align-config`` and
    ``--topo-align-mode``, which the Megatron script takes from ``add_topo_align_args`` instead."""
    g = ap.add_argument_group("run")
    g.add_argument("--run-name", default=None, help="output folder under --runs-dir (default: derived from the flags)")
    g.add_argument("--runs-dir", default="runs", help="parent folder of every run's output (default: runs)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the run's latest checkpoint (runs/<name>/checkpoints)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend (default: nccl when CUDA is available, else gloo)")
    g.add_argument("--virtual-nodes", type=int, default=0, metavar="K",
                   help="pretend the ranks of this machine are K nodes (rank r on host node<r*K//world>), "
                        "for trying topo-align on one machine; 0 = real hostnames")
    g.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout in seconds")

    g = ap.add_argument_group("model and schedule")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="size preset (default: tiny)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default: the preset's)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per rank per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--train-steps", type=int, default=300, help="optimizer steps in total")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak (cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=20)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)")

    g = ap.add_argument_group("data")
    g.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="an existing megatron-core indexed dataset (PREFIX.bin/.idx) tokenized with the "
                        "byte-level tokenizer; default: built from --corpus")
    g.add_argument("--corpus", default="stdlib",
                   help="'stdlib' (the running Python's standard-library sources, PSF licence) or a text "
                        "file or folder")
    g.add_argument("--corpus-max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    g.add_argument("--data-dir", default=None, help="where the built dataset is cached (default: <runs-dir>/data)")

    g = ap.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval-interval", type=int, default=50, help="validate every N steps (and at 0 and the end)")
    g.add_argument("--eval-batches", type=int, default=8, help="micro-batches per rank per validation")
    g.add_argument("--log-interval", type=int, default=10, help="progress line every N steps (non-TTY output)")
    g.add_argument("--save-interval", type=int, default=50, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard event files")
    g.add_argument("--check-args", action="store_true",
                   help="validate the flags and the topo_align block, then exit (0, or 2 with one line); "
                        "the launch scripts do this before starting any rank")
    g.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="exit (without a final checkpoint) after this step, as if killed; for testing --resume")

    g = ap.add_argument_group("topo-align (the \"topo_align\" block, README.md: Config reference)")
    g.add_argument("--no-topo-align", action="store_true", help="stock framework reduction (the baseline)")
    if topo_flags:
        g.add_argument("--topo-align-config", default=None, metavar="FILE",
                       help="JSON file holding the block (or a DeepSpeed config with a \"topo_align\" key)")
        g.add_argument("--topo-align-mode", choices=("selective", "hierarchical", "flat"), default=None,
                       help="reduction mode (default: selective)")
    g.add_argument("--topology", default=None, metavar="FILE",
                   help="JSON topology file (sets topology.source=file)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any field of the block by dotted name, e.g. --set local.reconcile_interval=8 "
                        "(VALUE is JSON, else a string); repeatable")


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set local.reconcile_interval=8")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


# Block defaults per model preset, used when neither a config file nor --set gives the field. The
# design's default of 5 always-SYNC layers is meant for deep models; on the 4-layer 'tiny' GPT it
# would make every block SYNC and `selective` no different from `hierarchical`. Applied only with a
# `sync.top_fraction` below 1 (a LOCAL class to shape; topo_block).
PRESET_BLOCK_DEFAULTS: dict[str, dict[str, Any]] = {"tiny": {"sync.last_n_layers": 1}}


def topo_block(args: argparse.Namespace, *, base: TopoAlignConfig | None = None,
               explicit: set[str] | frozenset[str] = frozenset(),
               defaults: dict[str, Any] | None = None) -> dict | None:
    """The validated "topo_align" block the flags describe, as a dict; None for a stock run.

    ``base`` is a config already resolved from other flags (Megatron's ``--topo-align*``) and
    ``explicit`` the dotted fields those flags set; ``defaults`` (the entry point's) and the preset's
    defaults apply only without a config file and never override ``explicit`` fields or ``--set``.
    """
    if args.no_topo_align:
        return None
    try:
        if base is not None:
            cfg = base
        else:
            cfg = TopoAlignConfig.from_file(args.topo_align_config) if args.topo_align_config else TopoAlignConfig()
        overrides: dict[str, Any] = {}
        user = parse_set(args.set)
        if not args.topo_align_config:
            # A LOCAL-class default (e.g. the tiny preset's last_n_layers 1) only where a LOCAL class
            # can exist: with every tensor SYNC (`auto` from 2 groups) it would be a key set for
            # nothing, which the engine refuses (reducer/classes/auto_sync.py).
            ours = {**(defaults or {}), **PRESET_BLOCK_DEFAULTS.get(args.model, {})}
            top = user.get("sync.top_fraction", cfg.sync.top_fraction)
            overrides.update({k: v for k, v in local_class_defaults(ours, top).items() if k not in explicit})
        if args.topo_align_mode:
            overrides["mode"] = args.topo_align_mode
        if args.topology:
            if not os.path.isfile(args.topology):
                raise UsageError(f"--topology {args.topology!r}: no such file; give a JSON topology file "
                                 "(see configs/topologies/)")
            overrides["topology.source"] = "file"
            overrides["topology.file"] = args.topology
        overrides.update(user)
        # Apply the source before the file (the validator needs both together), then the rest.
        first = {k: overrides.pop(k) for k in ("topology.source", "topology.file") if k in overrides}
        if first:
            data = cfg.model_dump(exclude_unset=True)
            for k, v in first.items():
                data.setdefault("topology", {})[k.split(".", 1)[1]] = v
            cfg = TopoAlignConfig.from_block(data)
        cfg = cfg.with_overrides(overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    # Only the keys set (by the file, the flags or the defaults above): an adapter refuses a key it
    # cannot honour only when it was set (TopoAlignConfig.explicit_keys).
    return {"enabled": cfg.enabled, "mode": cfg.mode, **cfg.model_dump(mode="json", exclude_unset=True)}


def selective_label(engines: list[dict]) -> str:
    """What `selective` runs with, from the engines' stats (``auto`` resolved at the group count):
    for the run's first line and summary, where the INFO log line of `auto` is not shown."""
    sync = sum(e["sync_elements"] for e in engines)
    total = sync + sum(e["local_elements"] for e in engines)
    wire = "/".join(sorted({e["sync_dtype"] for e in engines}))
    if total and sync == total:
        return f"every tensor SYNC, {wire} wire"
    return f"{sync / max(1, total):.0%} of elements SYNC on the {wire} wire, the rest LOCAL"


def virtual_hostname(rank: int, world_size: int, nodes: int) -> str:
    if nodes < 1 or nodes > world_size or world_size % nodes:
        raise UsageError(f"--virtual-nodes {nodes}: must divide the world size {world_size} "
                         f"(e.g. 2 for {world_size} ranks)")
    return f"node{rank * nodes // world_size}"


def attempt_store(timeout: datetime.timedelta):
    """Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set): the rendezvous store with a key prefix
    of this attempt (``topo_align/attempt_<n>``), else None.

    After a failed attempt torchrun restarts the workers on the same store (its static rendezvous
    keeps one store; ``env://`` makes a new client of the same server), and gloo's connectFullMesh
    can read the peer addresses the previous attempt left there: ``Connection refused`` on every
    further attempt (docs/reliability.md, "Restart recipe"). Each attempt's own prefix keeps them
    apart; every node counts the same attempts when every failure restarts every node's workers."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(not agent and rank == 0), timeout=timeout)
    return dist.PrefixStore(f"topo_align/attempt_{attempt}", base)


def init_distributed(args: argparse.Namespace, *, init_fn=None) -> tuple[int, int, str]:
    """Start the default process group from torchrun's/Slurm's environment; returns (rank, world, backend).

    ``init_fn(backend, timeout)`` replaces ``dist.init_process_group`` (DeepSpeed's
    ``init_distributed``). Already-initialized groups (tests) are reused.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # srun without torchrun: translate Slurm's variables (MASTER_ADDR/PORT come from the script).
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl: CUDA is not available on this machine; use --backend gloo")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # A plain `python -m ...` run: a world of one.
            from ..testing import free_port

            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = attempt_store(timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        if init_fn is not None:
            init_fn(backend, timeout)  # DeepSpeed's init_distributed adopts a group already made
        elif store is None:
            dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.virtual_nodes:
        from ..reducer.plan.planning import HOSTNAME_ENV

        os.environ[HOSTNAME_ENV] = virtual_hostname(rank, world, args.virtual_nodes)
    return rank, world, backend


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``lr``, cosine decay to ``lr * min_lr_ratio`` at ``train_steps``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    span = max(1, args.train_steps - args.warmup_steps)
    frac = min(1.0, (step - args.warmup_steps) / span)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def check_args(args: argparse.Namespace) -> None:
    for name in ("micro_batch_size", "grad_accum", "train_steps", "eval_batches", "log_interval", "eval_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.save_interval < 0:
        raise UsageError(f"--save-interval {args.save_interval}: must be 0 (only at the end) or positive")
    if not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: must be positive")
    if args.stop_after is not None and not 0 < args.stop_after <= args.train_steps:
        raise UsageError(f"--stop-after {args.stop_after}: must be in [1, --train-steps={args.train_steps}]")


@dataclass
class RunPaths:
    run_dir: str
    ckpt_dir: str
    data_dir: str
    cache_dir: str


def run_paths(args: argparse.Namespace, framework: str, block: dict | None) -> RunPaths:
    name = args.run_name or f"gpt-{args.model}-{framework}-{block['mode'] if block else 'stock'}"
    if not name or "/" in name or name in (".", ".."):
        raise UsageError(f"--run-name {name!r}: must be a plain folder name")
    run_dir = os.path.join(args.runs_dir, name)
    data_dir = args.data_dir or os.path.join(args.runs_dir, "data")
    return RunPaths(run_dir=run_dir, ckpt_dir=os.path.join(run_dir, "checkpoints"), data_dir=data_dir,
                    cache_dir=os.path.join(data_dir, "cache"))


# Errors a user can cause with flags or files: one line and exit 2, never a traceback.
USER_ERRORS = (UsageError, ConfigError, DataError, PresetError)


EXIT_COLLECTIVE = 3
"""The exit status of a rank whose collective failed or timed out (``CollectiveError``)."""


def run_main(args: argparse.Namespace, check, run) -> int:
    """Shared ``main`` of the entry points: ``--check-args`` validates only; a run always leaves
    the process group torn down (barrier first, so no rank exits while a peer still sends), except
    after a ``CollectiveError``: the rank prints it in one line and exits with ``EXIT_COLLECTIVE`` at
    once, without a teardown that would wait on the dead peer or link (docs/reliability.md, "What
    the job does on a CollectiveError"), so ``torchrun --max-restarts`` restarts the job from its
    last checkpoint (``--resume``)."""
    from ..reducer.watch.errors import CollectiveError

    if args.check_args:
        try:
            check(args)
        except USER_ERRORS as exc:
            fail(str(exc))
        return 0
    try:
        run(args)
    except USER_ERRORS as exc:
        fail(str(exc))
    except CollectiveError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_COLLECTIVE)
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()
                dist.destroy_process_group()
            except Exception:
                pass
    return 0


def train_valid_batches(args: argparse.Namespace, paths, seq_length: int, rank: int,
                        dp_size: int, dp_rank: int) -> tuple[str, int, GlobalBatches, list]:
    """``(dataset prefix, global batch, training batches, fixed validation batches)`` for both entry points.

    Communication: rank 0 builds the indexed dataset once (cached by corpus digest) and broadcasts
    its path; every rank then opens it and takes its data-parallel share of each global batch.
    """
    if args.data_path:
        prefix = args.data_path
    else:
        box = [None]
        if rank == 0:
            box[0], _ = prepare_dataset(paths.data_dir, corpus=args.corpus, max_bytes=args.corpus_max_bytes)
        dist.broadcast_object_list(box, src=0)
        prefix = box[0]
    global_batch = args.micro_batch_size * args.grad_accum * dp_size
    train_ds, valid_ds = build_gpt_datasets(
        prefix, seq_length=seq_length, seed=args.seed, train_samples=args.train_steps * global_batch,
        valid_samples=args.eval_batches * args.micro_batch_size * dp_size, cache_dir=paths.cache_dir)
    train = GlobalBatches(train_ds, args.micro_batch_size, dp_size, dp_rank, args.grad_accum)
    valid = GlobalBatches(valid_ds, args.micro_batch_size, dp_size, dp_rank, 1).eval_batches(args.eval_batches)
    return prefix, global_batch, train, valid
