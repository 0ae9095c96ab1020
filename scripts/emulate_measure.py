"""Measure what the emulated links actually deliver, per preset (the table in docs/emulation.md).

    sudo .venv/bin/python scripts/emulate_measure.py configs/topologies/virtual-*.json --repeats 5

For each topology: builds the emulated cluster, then with the TCP probe (topo_integrations/emulate/probe.py)
measures, ``--repeats`` times each, the bulk rate and the median 1-byte round trip of

- ``node uplink``: first node -> second node under the same leaf (two uplinks, one bridge);
- ``spine``: first node of leaf 0 -> first node of leaf 1 (presets with several leaves);
- ``spine, 2 flows``: two concurrent flows from leaf 0 to leaf 1 (shares the oversubscribed spine);
- ``loopback``: a node to itself (the intra-node path its ranks use).

Prints a Markdown table: configured rate, measured median [min-max] Mbit/s and MB/s, RTT median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading

from topo_integrations.emulate import EmulatedCluster
from topo_integrations.topology.file_source import load_topology_file


def _flows(cl: EmulatedCluster, pairs, nbytes: int) -> list[dict]:
    out: list[dict | None] = [None] * len(pairs)

    def one(i, src, dst):
        out[i] = cl.measure(src, dst, nbytes=nbytes, pings=20, port=5201 + i)

    threads = [threading.Thread(target=one, args=(i, s, d)) for i, (s, d) in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise RuntimeError("a probe flow failed")
    return out  # type: ignore[return-value]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("topologies", nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bytes", type=int, default=4_000_000)
    ap.add_argument("--loopback-bytes", type=int, default=200_000_000)
    a = ap.parse_args()
    print("| preset | path | configured | measured Mbit/s, median [min-max] | MB/s | RTT ms (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in a.topologies:
        topo = load_topology_file(path)
        with EmulatedCluster(topo) as cl:
            nodes = cl.nodes
            by_leaf: dict[str, list] = {}
            for n in nodes:
                by_leaf.setdefault(n.leaf, []).append(n)
            cases = []
            same = next((v for v in by_leaf.values() if len(v) > 1), None)
            if same:
                cases.append(("node uplink", [(same[0].host, same[1].host)],
                              f"{same[0].uplink.rate_mbit:g} Mbit/s", a.bytes))
            if cl.layout.spines:
                l0, l1 = list(by_leaf.values())[:2]
                sp = cl.layout.spines[0].shape.rate_mbit
                cases.append(("spine, 1 flow", [(l0[0].host, l1[0].host)], f"{sp:g} Mbit/s (spine)", a.bytes))
                if len(l0) > 1 and len(l1) > 1:
                    # 4x the bytes: the two probes start up to a few 100 ms apart on a loaded machine
                    cases.append(("spine, 2 flows (each)", [(l0[0].host, l1[0].host), (l0[1].host, l1[1].host)],
                                  f"{sp:g} Mbit/s shared", 4 * a.bytes))
            cases.append(("loopback", [(nodes[0].host, nodes[0].host)], "unshaped", a.loopback_bytes))
            for label, pairs, configured, nbytes in cases:
                rates, rtts = [], []
                for _ in range(a.repeats):
                    for r in _flows(cl, pairs, nbytes):
                        rates.append(r["mbit_per_s"])
                        rtts.append(r["rtt_ms"])
                med = statistics.median(rates)
                print(f"| {topo.name} | {label} | {configured} | {med:.0f} [{min(rates):.0f}-{max(rates):.0f}] "
                      f"| {med / 8:.1f} | {statistics.median(rtts):.3f} |", flush=True)
            for note in cl.notes:
                print(f"\nnote ({topo.name}): {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
