"""A gloo all-reduce job for the emulated cluster: flat ring, then hierarchical, with the bytes each
node's uplink carried in each phase (read from the node's own interface counters).

    topo-align emulate --topology configs/topologies/virtual-2x2.json --bytes-json bytes.json -- \\
        python scripts/emulate_allreduce.py --numel 1000000 --iters 3

Launched once per rank with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR set; ranks of a
node are consecutive (the emulator numbers them as in the topology). Phases, each between barriers:

  1. ``flat``: ``all_reduce`` of ``numel`` fp32 over all ranks (gloo ring, rank order);
  2. ``hierarchical``: ``reduce_scatter_tensor`` inside the node, ``all_reduce`` of the shard over the
     rail (local rank i of every node), ``all_gather_into_tensor`` inside the node.

Each rank checks the result (the sum over ranks of rank+1) and prints one JSON line:
``{"rank", "host", "phases": {"flat": {"seconds", "node_tx_bytes"}, ...}}``; ``node_tx_bytes`` is the
delta of ``/sys/class/net/eth0/statistics/tx_bytes`` over the phase, the same for every rank of a node.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist


def _tx_bytes(iface: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as fh:
        return int(fh.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    # torch 2.13 marks the *_tensor collectives deprecated (renamed *_single); they still work on gloo.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local, k = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world % k or a.numel % k:
        raise SystemExit(f"world {world} and numel {a.numel} must be multiples of ranks per node {k}")
    nodes = world // k
    # Every rank creates every group, in the same order (torch.distributed requires it).
    intra = [dist.new_group(list(range(n * k, n * k + k))) for n in range(nodes)][rank // k]
    rail = [dist.new_group([n * k + i for n in range(nodes)]) for i in range(k)][local]
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
    expect = float(world * (world + 1) // 2)

    def flat() -> torch.Tensor:
        x = torch.full((a.numel,), float(rank + 1))
        dist.all_reduce(x)
        return x

    def hierarchical() -> torch.Tensor:
        x = torch.full((a.numel,), float(rank + 1))
        shard = torch.empty(a.numel // k)
        dist.reduce_scatter_tensor(shard, x, group=intra)
        dist.all_reduce(shard, group=rail)
        dist.all_gather_into_tensor(x, shard, group=intra)
        return x

    phases = {}
    for name, fn in (("flat", flat), ("hierarchical", hierarchical)):
        dist.barrier()
        b0 = _tx_bytes(iface)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            x = fn()
            if not torch.all(x == expect):
                raise SystemExit(f"rank {rank}: {name} gave {x[:4].tolist()}..., expected {expect}")
        secs = time.perf_counter() - t0
        dist.barrier()
        phases[name] = {"seconds": secs, "node_tx_bytes": _tx_bytes(iface) - b0}
    print(json.dumps({"rank": rank, "local_rank": local, "host": socket.gethostname(),
                      "numel": a.numel, "iters": a.iters, "phases": phases}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
