#!/usr/bin/env python
"""What `method: auto` chooses, by slow-tier link speed, for one workload (issue 38; docs/costmodel.md,
section 6). Everything here is simulated (the cost model of topo_integrations.sim), not measured.

    .venv/bin/python scripts/method_choice.py              # the table, markdown
    .venv/bin/python scripts/method_choice.py --groups 8 --compute-s 2

The workload of tests/test_method_auto.py by default: islands of 8 GPUs (NVLink 230 GB/s, 2 us), a
7B model's bf16 gradient, 10 s of compute per step, the last N layers 10 % of the gradient, no
drift-promotion budget; the slow tier at each link speed per GPU with 7 us of latency.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from topo_integrations.sim import SimOptions  # noqa: E402
from topo_integrations.sim.choose import MethodInputs, choose_for_groups  # noqa: E402

GBITS = (400.0, 100.0, 25.0, 10.0, 5.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.01)


def _inputs(groups: int, group_size: int, gbit: float, params: float, compute_s: float,
            origin: str = "given") -> MethodInputs:
    """The workload of the module docstring with the slow tier at ``gbit`` Gbit/s per GPU."""
    return MethodInputs(groups, group_size, gbit / 8, 7.0, origin, params, "bf16", compute_s, "given",
                        options=SimOptions(last_n_share=0.1, promote_fraction=0.0))


def table(groups: int, group_size: int, params: float, compute_s: float) -> str:
    rows = ["| slow tier, Gbit/s per GPU | choice | keys it sets | predicted step, s x steps to flat quality: "
            "hierarchical / int8 / local (H) | runner-up |", "|---:|---|---|---|---|"]
    for g in GBITS:
        c = choose_for_groups(_inputs(groups, group_size, g, params, compute_s))
        keys = ", ".join(f"`{k}` {v:g}" if isinstance(v, float) else f"`{k}` {v}"
                         for k, v in c.config.items() if k != "mode")
        s, f = c.step_s, c.steps_factor
        cap = ", capped" if c.h_capped else ""
        priced = " / ".join(f"{s[k]:.2f} x {f[k]:.2f}" for k in ("hierarchical", "int8", "local"))
        rows.append(f"| {g:g} | **{c.method}** | {keys} | {priced} (H {c.reconcile_interval}{cap}) | {c.runner_up} |")
    return "\n".join(rows)


def block() -> str:
    """docs/costmodel.md's block: the default workload's table, then the log line at 2 Gbit/s."""
    inp = _inputs(4, 8, 2.0, 7e9, 10.0, origin="leaf, file")
    return (f"Simulated: 4 islands of 8 GPUs, 7e+09 bf16 gradient elements per GPU, 10 s of compute per step.\n\n"
            f"{table(4, 8, 7e9, 10.0)}\n\n```text\n{choose_for_groups(inp).line()}\n```")


def quality_table() -> str:
    """sim/quality.py's points, the plane fitted to them and the steps factor at 2-128 islands."""
    from topo_integrations.sim.quality import ALPHA, POINTS, quality_cost, steps_factor

    rows = ["| candidate | islands | H | measured gap to flat (3 seeds) | fitted | steps to flat quality, x flat's |",
            "|---|---:|---:|---:|---:|---:|"]
    for p in POINTS:
        rows.append(f"| {p.method} | {p.islands} | {p.interval or '-'} | {p.gap * 100:+.2f} % "
                    f"| {quality_cost(p.method, p.islands, p.interval) * 100:+.2f} % "
                    f"| {steps_factor(p.method, p.islands, p.interval):.2f} |")
    for n in (16, 128):
        for method, h in (("int8", None), ("local", 16), ("local", 64)):
            rows.append(f"| {method} | {n} | {h or '-'} | not measured | "
                        f"{quality_cost(method, n, h) * 100:+.2f} % | {steps_factor(method, n, h):.2f} |")
    return "\n".join(rows) + (f"\n\nLoss exponent ALPHA = {ALPHA:g}: a gap c costs (1 + c) ** (1 / {ALPHA:g}) "
                               "x flat's steps.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=4, help="islands (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="GPUs per island (default 8)")
    p.add_argument("--params", type=float, default=7e9, help="gradient elements per GPU (default 7e9)")
    p.add_argument("--compute-s", type=float, default=10.0, help="forward+backward seconds per step (default 10)")
    p.add_argument("--quality", action="store_true", help="print sim/quality.py's table instead")
    a = p.parse_args(argv)
    if a.quality:
        print(quality_table())
        return 0
    print(f"Simulated: {a.groups} islands of {a.group_size} GPUs, {a.params:.3g} bf16 gradient elements per GPU, "
          f"{a.compute_s:g} s of compute per step.\n")
    print(table(a.groups, a.group_size, a.params, a.compute_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
