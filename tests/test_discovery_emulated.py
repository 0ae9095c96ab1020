"""`topology.probe` on the emulated cluster (issue 24; docs/emulation.md): 2 nodes x 2 ranks, node
uplinks shaped to 200 Mbit/s, so each of the two rails crossing an uplink gets 100 Mbit/s =
0.0125 GB/s per GPU (the `virtual-2x2` leaf tier). The probe must measure that within 30% and the
plan must be decided on it (inter tier 'leaf', origin measured). Emulated: real kernel links at the
configured rate on one host. Skips with the reason when namespaces cannot be made.

This file is also the worker every rank runs (``python tests/test_discovery_emulated.py --out F``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPO_2X2 = ROOT / "configs" / "topologies" / "virtual-2x2.json"
LEAF_GBPS = 0.0125  # virtual-2x2: leaf.bandwidth_gbps (200 Mbit/s uplink shared by 2 ranks)
LEAF_US = 500.0  # virtual-2x2: leaf.latency_us, node to node one way (emulate/layout.py: half per end)


def worker(out: str) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from topo_integrations import TopoAlignConfig
    from topo_integrations.reducer import discover_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    cfg = TopoAlignConfig.model_validate({"mode": "hierarchical", "topology": {"probe": True},
                                          "fallback": {"timeout_s": 120}})
    plan = discover_plan(cfg)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(plan.to_json()))
    dist.barrier()
    # Tear the default group down before exit: left to interpreter shutdown, gloo's threads can
    # abort the process ("terminate called without an active exception", ~1 run in 8 on CI).
    dist.destroy_process_group()
    return 0


def _unavailable() -> str | None:
    from topo_integrations.emulate.netns import probe_unavailable_reason

    return probe_unavailable_reason()


@pytest.mark.emulated
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_probe_measures_the_shaped_uplink_and_the_plan_uses_it(tmp_path):
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    from topo_integrations.emulate import EmulatedCluster
    from topo_integrations.topology.file_source import load_topology_file

    out = tmp_path / "plan.json"
    with EmulatedCluster(load_topology_file(TOPO_2X2)) as cl:
        res = cl.launch([sys.executable, __file__, "--out", str(out)], timeout=240,
                        port=random.randint(30000, 45000))
    assert res.exit_code == 0, res.reason
    plan = json.loads(out.read_text())
    print(f"measured leaf {plan['inter_bandwidth_gbps']:.5g} GB/s, {plan['inter_latency_us']:.4g} us; "
          f"island {plan['intra_bandwidth_gbps']:.4g} GB/s, {plan['intra_latency_us']:.4g} us")
    assert plan["inter_tier"] == "leaf" and plan["inter_origin"] == "measured"
    assert abs(plan["inter_bandwidth_gbps"] - LEAF_GBPS) <= 0.3 * LEAF_GBPS, plan["inter_bandwidth_gbps"]
    # a 2-rank all-reduce of 1 element crosses the link at least once: its 2 ring steps hold the
    # shaped one-way delay, so each holds about half of it (the fastest of 5: load only adds)
    assert plan["inter_latency_us"] >= LEAF_US / 4, plan["inter_latency_us"]
    assert plan["intra_origin"] == "measured"
    # loopback inside a node is far faster than the shaped uplink: the plan groups by node
    assert plan["hierarchical"] and plan["intra_groups"] == [[0, 1], [2, 3]]
    assert f"{plan['inter_bandwidth_gbps']:g} GB/s (measured)" in plan["reason"]


if __name__ == "__main__":
    sys.exit(worker(sys.argv[sys.argv.index("--out") + 1]))
