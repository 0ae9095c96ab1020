"""Per-step times of the DeepSpeed adapter's reconciliation steps vs its other steps, sync vs async.

Runs only the `ds-topo-selective` system of `topo-align bench` (DeepSpeed ZeRO-0, `selective`) on an
emulated cluster (needs root: network namespaces; docs/emulation.md), once with
``local.async_reconcile = false`` and once with ``true``, and prints, from each run's results.json,
the slowest rank's step time of the reconciliation steps (every ``reconcile_interval``-th step) next to
the other steps. Figures: docs/deepspeed.md ("Asynchronous reconciliation: measured").

    sudo OMP_NUM_THREADS=1 .venv/bin/python scripts/ds_reconcile_steps.py --steps 24 --out-dir runs/ds-reconcile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from topo_integrations.bench.driver import BenchSpec, run_bench  # noqa: E402


def summarize(results: dict, H: int) -> dict:
    """Reconcile-step vs other-step times (the first step, which pays one-off allocations, left out)."""
    sysres = results["systems"][0]
    if sysres.get("status") != "ok":
        raise SystemExit(f"{sysres['key']}: {sysres.get('status')}: {sysres.get('reason')}")
    t = sysres["result"]["step_times_s"]
    rec = [t[i] for i in range(1, len(t)) if (i + 1) % H == 0]
    other = [t[i] for i in range(1, len(t)) if (i + 1) % H != 0]
    f = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}  # noqa: E731
    return {"reconcile_steps": f(rec), "other_steps": f(other),
            "slowest_step": 1 + max(range(1, len(t)), key=t.__getitem__),
            "slowest_is_reconcile": (1 + max(range(1, len(t)), key=t.__getitem__)) % H == 0,
            "load": [sysres.get("load_start"), sysres.get("load_end")], "step_times_s": t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="2x2")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reconcile-interval", type=int, default=4)
    ap.add_argument("--out-dir", default="runs/ds-reconcile")
    ap.add_argument("--modes", default="sync,async")
    a = ap.parse_args(argv)
    out = {}
    for mode in a.modes.split(","):
        spec = BenchSpec(preset=a.preset, systems=("ds-topo-selective",), steps=a.steps,
                         reconcile_interval=a.reconcile_interval, async_reconcile=(mode == "async"),
                         # a LOCAL class to reconcile (the default makes every tensor SYNC at 2 groups)
                         topo_set={"sync.top_fraction": 0.15, "sync.dtype": "bf16"},
                         out_dir=os.path.join(a.out_dir, mode))
        res = run_bench(spec, command=" ".join(sys.argv))
        out[mode] = summarize(res, a.reconcile_interval)
        s = out[mode]
        print(f"{mode}: reconcile steps median {s['reconcile_steps']['median']:.3f} s "
              f"(min {s['reconcile_steps']['min']:.3f}, max {s['reconcile_steps']['max']:.3f}, "
              f"n {s['reconcile_steps']['n']}); "
              f"other steps median {s['other_steps']['median']:.3f} s (min {s['other_steps']['min']:.3f}, "
              f"max {s['other_steps']['max']:.3f}); slowest step {s['slowest_step']} "
              f"({'a reconcile step' if s['slowest_is_reconcile'] else 'not a reconcile step'}); load {s['load']}",
              flush=True)
    with open(os.path.join(a.out_dir, "summary.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
