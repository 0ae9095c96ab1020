#!/usr/bin/env python
"""Run `topo-align bench` on several emulated presets one after another and write docs/benchmarks.md.

    sudo OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_presets.py [--presets 2x2,4x1,2leaf] [-- BENCH ARGS...]

Each preset gets its own section of the Markdown file (replaced on re-runs) and its own
runs/bench-<preset>/ folder. Exit code: the worst of the runs' (0 ok, 1 a system failed, 2 bad input).
"""

from __future__ import annotations

import argparse
import sys

from topo_integrations.bench import cli as bench_cli


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="2x2,4x1,2leaf")
    ap.add_argument("--markdown", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    worst = 0
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        bench_args = ["--preset", preset, "--out-dir", f"runs/bench-{preset}", "--markdown", args.markdown, *rest]
        print(f"== topo-align bench {' '.join(bench_args)}", file=sys.stderr, flush=True)
        worst = max(worst, bench_cli.main(bench_args))
    return worst


if __name__ == "__main__":
    sys.exit(main())
