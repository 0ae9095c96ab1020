"""Short end-to-end check under a real launcher: stock engine vs plugin engine, same data.

    torchrun --standalone --nproc_per_node 4 -m topo_integrations.deepspeed.selfcheck \\
        --topology configs/topologies/virtual-2x2.json --stage 2 --mode hierarchical --out result.json
    deepspeed --num_gpus 4 --module topo_integrations.deepspeed.selfcheck --topology ... --out ...

It uses ``install()`` and plain ``deepspeed.initialize`` (the path unchanged scripts take), trains
the harness model for ``--steps`` steps twice (without and with the block) and writes, from rank 0,
a JSON line: engine class, relative parameter error vs stock, losses, plan. Exit status 0 when the
plugin engine was used and (``hierarchical``) matches stock to 1e-6, else 1. CPU or GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import Mode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topo_integrations.deepspeed.selfcheck")
    ap.add_argument("--topology", help="topology JSON file (default: gathered hostnames)")
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--mode", default="hierarchical", choices=("hierarchical", "selective"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", help="write the JSON result here (rank 0)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    from . import harness as H

    H.prepare_cpu()
    import deepspeed
    import torch.distributed as dist

    from . import install

    install()
    block = H.topo_block(a.mode)
    if a.topology:
        block["topology"] = {"source": "file", "file": a.topology}
    stock, _, _, _ = deepspeed.initialize(model=(m := H.Net()), optimizer=H.make_optimizer("adamw", m.parameters()),
                                          config=H.ds_config(a.stage, clip=0.05))
    H.train(stock, a.steps)
    ref = H.flat_params(stock)
    eng, _, _, _ = deepspeed.initialize(model=(m := H.Net()), optimizer=H.make_optimizer("adamw", m.parameters()),
                                        config=H.ds_config(a.stage, clip=0.05, topo=block))
    losses = H.train(eng, a.steps)
    got = H.flat_params(eng)
    used = hasattr(eng, "topo_align")
    result = {
        "world_size": dist.get_world_size(), "engine": type(eng).__name__, "plugin": used,
        "rel_err_vs_stock": H.rel_err(got, ref), "losses": losses,
        "plan": eng.topo_align.groups.plan.reason if used else None,
        "launcher_env": {k: os.environ.get(k) for k in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")},
    }
    ok = used and (a.mode != Mode.HIERARCHICAL or result["rel_err_vs_stock"] <= 1e-6)
    if dist.get_rank() == 0:
        text = json.dumps(result)
        print(text, flush=True)
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(text + "\n")
    dist.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
