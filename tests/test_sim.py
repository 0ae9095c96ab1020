"""Cost model (topo_integrations.sim): closed forms to 1e-9 relative, layouts, CLI, and speed at 16k GPUs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from topo_integrations.config import TopoAlignConfig
from topo_integrations.sim import (
    ALGORITHMS,
    QueuedStream,
    SelectiveSpec,
    SimError,
    SimOptions,
    Workload,
    bucket_timeline,
    dp_groups,
    serial_timeline,
    simulate,
)
from topo_integrations.sim.algorithms import (
    double_binary_tree,
    flat_ring,
    hierarchical_2level,
    hierarchical_3level,
    selective,
    split_groups,
)
from topo_integrations.sim.cli import main as sim_main
from topo_integrations.sim.model import Fabric, apply_rank_order
from topo_integrations.sim.peers import diloco, gpt_matrices, local_sgd, powersgd, powersgd_elements
from topo_integrations.sim.workload import megatron_param_count, read_megatron_args
from topo_integrations.topology import Tier, Topology, plan_groups, topology_from_dict

pytestmark = pytest.mark.timeout(60)

GB = 1e9
S = 3.7e9  # bytes per rank; an odd size so no formula is accidentally exact


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def topo(leaves: int, hosts: int, gpus: int, *, isl=(230.0, 2.0), leaf=(24.0, 7.0), spine=(24.0, 10.0, 1.0),
         host=(20.0, 5.0), island_size=None) -> Topology:
    return topology_from_dict({
        "name": "t", "gpus_per_node": gpus, "island_size": island_size,
        "tiers": {"island": {"bandwidth_gbps": isl[0], "latency_us": isl[1]},
                  "host": {"bandwidth_gbps": host[0], "latency_us": host[1]},
                  "leaf": {"bandwidth_gbps": leaf[0], "latency_us": leaf[1]},
                  "spine": {"bandwidth_gbps": spine[0], "latency_us": spine[1], "oversubscription": spine[2]}},
        "leaves": [{"name": f"L{i}", "hosts": [f"h{i}-{j}" for j in range(hosts)]} for i in range(leaves)],
    })


def pure_dp(t: Topology) -> np.ndarray:
    return dp_groups(t.world_size, 1, 1)


# -- closed forms -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 5, 16])
def test_ring_allreduce_closed_form_across_hosts(n):
    t = topo(1, n, 1, leaf=(24.0, 7.0))
    c = flat_ring(Fabric.from_topology(t), pure_dp(t), S)
    expect = 2 * (n - 1) / n * S / (24.0 * GB) + 2 * (n - 1) * 7e-6
    assert rel(c.comm_s(), expect) < 1e-9
    # every byte crosses a NIC under one leaf, nothing else is used
    tb = c.tier_bytes()
    assert rel(tb["leaf"], n * 2 * (n - 1) / n * S) < 1e-9
    assert tb["island"] == tb["spine"] == tb["host"] == 0.0


def test_ring_allreduce_closed_form_inside_island():
    t = topo(1, 1, 8, isl=(230.0, 2.0))
    c = flat_ring(Fabric.from_topology(t), pure_dp(t), S)
    assert rel(c.comm_s(), 2 * 7 / 8 * S / (230 * GB) + 2 * 7 * 2e-6) < 1e-9


def test_ring_multi_gpu_hosts_is_nic_bound_with_pooled_nics():
    # 4 hosts x 8 GPUs: one ring edge per host leaves it; NCCL spreads channels over the 8 NICs.
    t = topo(1, 4, 8, isl=(230.0, 2.0), leaf=(24.0, 7.0))
    n = 32
    c = flat_ring(Fabric.from_topology(t), pure_dp(t), S)
    bw = 2 * (n - 1) / n * S / (8 * 24.0 * GB)
    assert bw > 2 * (n - 1) / n * S / (230 * GB)  # NIC-bound, not NVLink-bound
    assert rel(c.comm_s(), bw + 2 * (n - 1) * 7e-6) < 1e-9


def test_hierarchical_2level_phases_closed_form():
    g, hosts = 4, 3
    t = topo(1, hosts, g, isl=(230.0, 2.0), leaf=(24.0, 7.0))
    fab = Fabric.from_topology(t)
    b2b = hierarchical_2level(fab, pure_dp(t), S, pipelined=False)
    ph = b2b.streams[0].phases
    rs = (g - 1) / g * S / (230 * GB)
    ar = 2 * (hosts - 1) / hosts * (S / g) / (24.0 * GB)
    assert rel(ph[0].bandwidth_s(), rs) < 1e-9 and rel(ph[0].latency_s, (g - 1) * 2e-6) < 1e-9
    assert rel(ph[1].bandwidth_s(), ar) < 1e-9 and rel(ph[1].latency_s, 2 * (hosts - 1) * 7e-6) < 1e-9
    assert rel(ph[2].bandwidth_s(), rs) < 1e-9 and rel(ph[2].latency_s, (g - 1) * 2e-6) < 1e-9
    lat = 2 * (g - 1) * 2e-6 + 2 * (hosts - 1) * 7e-6
    assert rel(b2b.comm_s(), 2 * rs + ar + lat) < 1e-9
    pipe = hierarchical_2level(fab, pure_dp(t), S, pipelined=True)
    assert rel(pipe.comm_s(), max(2 * rs, ar) + lat) < 1e-9
    # The inter wire dtype only scales the rail phase.
    fp32 = hierarchical_2level(fab, pure_dp(t), S, pipelined=False, inter_bytes=2 * S)
    assert rel(fp32.comm_s(), 2 * rs + 2 * ar + lat) < 1e-9


def test_hierarchical_3level_phases_closed_form():
    g, q, L = 4, 3, 2  # 4 GPUs per host, 3 hosts per leaf, 2 leaves
    t = topo(L, q, g, isl=(200.0, 2.0), leaf=(25.0, 7.0), spine=(25.0, 11.0, 1.0))
    c = hierarchical_3level(Fabric.from_topology(t), pure_dp(t), S, pipelined=False)
    ph = c.streams[0].phases
    assert [p.name for p in ph] == ["island reduce-scatter", "leaf-rail reduce-scatter", "spine-rail all-reduce",
                                    "leaf-rail all-gather", "island all-gather"]
    isl = (g - 1) / g * S / (200 * GB)
    leaf = (q - 1) / q * (S / g) / (25 * GB)
    spine = 2 * (L - 1) / L * (S / (g * q)) / (25 * GB)
    for p, bw, lat in zip(ph, (isl, leaf, spine, leaf, isl),
                          ((g - 1) * 2e-6, (q - 1) * 7e-6, 2 * (L - 1) * 11e-6, (q - 1) * 7e-6, (g - 1) * 2e-6)):
        assert rel(p.bandwidth_s(), bw) < 1e-9, p.name
        assert rel(p.latency_s, lat) < 1e-9, p.name
    # the spine phase is the only one that crosses leaves
    assert ph[2].tier_bytes["spine"] > 0 and all(p.tier_bytes["spine"] == 0 for i, p in enumerate(ph) if i != 2)


def test_oversubscribed_spine_ring_leaf_order_vs_scattered():
    # 2 leaves x 2 hosts x 1 GPU, spine 4:1: a leaf's uplinks carry gpus_in_leaf * 24 / 4 = 12 GB/s.
    tiers = {"island": Tier("island", 230.0, 2.0), "host": Tier("host", 20.0, 5.0),
             "leaf": Tier("leaf", 24.0, 7.0), "spine": Tier("spine", 24.0, 10.0, 4.0)}
    inter = Topology.from_hosts([("a", 1), ("b", 1), ("c", 1), ("d", 1)],
                                leaf_of={"a": "L0", "b": "L1", "c": "L0", "d": "L1"}, tiers=tiers)
    n = 4
    per_edge = 2 * (n - 1) / n * S
    cap_up = 2 * 24.0 / 4.0 * GB
    # as listed (interleaved): every edge crosses the spine, 2 per leaf
    c = flat_ring(Fabric.from_topology(inter), pure_dp(inter), S)
    assert rel(c.comm_s(), 2 * per_edge / cap_up + 2 * (n - 1) * 10e-6) < 1e-9
    assert c.tier_seconds()["spine"] > c.tier_seconds()["leaf"]
    # ordered by leaf: one crossing per leaf; uplink time = NIC time... still slower: 12 < 24 GB/s
    ordered = apply_rank_order(inter, "leaf")
    assert [p.host for p in ordered.ranks] == ["a", "c", "b", "d"]
    c2 = flat_ring(Fabric.from_topology(ordered), pure_dp(ordered), S)
    assert rel(c2.comm_s(), per_edge / cap_up + 2 * (n - 1) * 10e-6) < 1e-9
    # at 1:1 the ordered ring is NIC-bound
    flat = ordered.with_tiers(spine=Tier("spine", 24.0, 10.0, 1.0))
    c3 = flat_ring(Fabric.from_topology(flat), pure_dp(flat), S)
    assert rel(c3.comm_s(), per_edge / (24 * GB) + 2 * (n - 1) * 10e-6) < 1e-9


def test_double_binary_tree_closed_form():
    # 4 hosts x 1 GPU: NCCL btree parents [-1, 2, 0, 2], mirrored second tree; ranks 1 and 2 each send 2S.
    t = topo(1, 4, 1, leaf=(24.0, 7.0))
    c = double_binary_tree(Fabric.from_topology(t), pure_dp(t), S)
    assert rel(c.comm_s(), 2 * S / (24 * GB) + 2 * 2 * 7e-6) < 1e-9
    assert rel(c.tier_bytes()["leaf"], 6 * S) < 1e-9  # 3 edges x 2 trees x (S/2 up + S/2 down)


def test_selective_byte_formula():
    g, R = 8, 6
    t = topo(2, 3, g)
    E = 1.3e9
    spec = SelectiveSpec(top_fraction=0.15, last_n_share=0.1, sync_bytes=4, local_bytes=2, reconcile_bytes=4,
                         reconcile_interval=4, async_reconcile=False)
    f = 0.25
    c = selective(Fabric.from_topology(t), pure_dp(t), E, spec)
    tb = c.tier_bytes()
    world = g * R
    inter = 2 * (R - 1) / R * (f * E * 4 / g) + 2 * (R - 1) / R * ((1 - f) * E * 4 / g) / 4
    assert rel((tb["leaf"] + tb["spine"]) / world, inter) < 1e-9
    island = (2 * (g - 1) / g * f * E * 4  # SYNC reduce-scatter + all-gather
              + 2 * (g - 1) / g * (1 - f) * E * 2  # LOCAL all-reduce in the island
              + (g - 1) / g * (1 - f) * E * 4 / 4)  # reconcile all-gather, every 4th step
    assert rel(tb["island"] / world, island) < 1e-9
    # top_fraction = 1 makes selective the back-to-back hierarchical all-reduce in the sync dtype
    full = selective(Fabric.from_topology(t), pure_dp(t), E, SelectiveSpec(top_fraction=1.0, sync_bytes=4))
    h = hierarchical_2level(Fabric.from_topology(t), pure_dp(t), 4 * E, pipelined=False)
    assert rel(full.comm_s(), h.comm_s()) < 1e-9 and not full.background


def test_selective_wires_and_moments_and_local_sgd_formulas():
    """SYNC in the gradient dtype inside the group and in sync.dtype (int8: 1 + 4/256 bytes) across;
    Adam's moments ride on each reconciliation at 8 / moments_interval bytes; post-local SGD: the
    gradient all-reduced inside the group every step, the parameters over every rank every H steps."""
    g, R = 4, 3
    t = topo(1, R, g)
    E = 1e8
    f, H, M = 0.4, 2, 4
    i8 = 1 + 4 / 256
    spec = SelectiveSpec(top_fraction=0.0, last_n_share=f, sync_bytes=i8, grad_bytes=2, local_bytes=2,
                         reconcile_bytes=i8, moments_bytes=8 / M, reconcile_interval=H)
    tb = selective(Fabric.from_topology(t), pure_dp(t), E, spec).tier_bytes()
    world = g * R
    inter = 2 * (R - 1) / R * (f * E * i8 / g) + 2 * (R - 1) / R * ((1 - f) * E * (i8 + 8 / M) / g) / H
    assert rel((tb["leaf"] + tb["spine"]) / world, inter) < 1e-9
    island = (2 * (g - 1) / g * f * E * 2 + 2 * (g - 1) / g * (1 - f) * E * 2
              + (g - 1) / g * (1 - f) * E * (i8 + 8 / M) / H)
    assert rel(tb["island"] / world, island) < 1e-9
    c = local_sgd(Fabric.from_topology(t), pure_dp(t), E, 4, 4, 8)
    ring = flat_ring(Fabric.from_topology(t), pure_dp(t), 4 * E).tier_bytes()
    tb = c.tier_bytes()
    assert rel(tb["leaf"] + tb["spine"], (ring["leaf"] + ring["spine"]) / 8) < 1e-9
    assert rel(tb["island"] / world, 2 * (g - 1) / g * E * 4 + ring["island"] / 8 / world) < 1e-9
    assert c.background_blocking
    with pytest.raises(SimError, match=r"post-local SGD period = 0; expected an integer >= 1"):
        local_sgd(Fabric.from_topology(t), pure_dp(t), E, 4, 4, 0)


def test_diloco_and_powersgd_formulas():
    """DiLoCo: the gradient all-reduced in the island every step, the fp32 pseudo-gradient of the whole
    model over each rail every H steps: 2(R-1)/R * E * 4 / H slow-tier bytes per GPU and step.
    PowerSGD: three chained flat rings (vectors, P, Q) of a GPT's shapes; bytes fall with the rank."""
    g, R = 4, 3
    t = topo(1, R, g)
    fab = Fabric.from_topology(t)
    world, E = g * R, 1e8
    for H in (1, 16, 64, 256):
        c = diloco(fab, pure_dp(t), E, 2, H)
        tb = c.tier_bytes()
        assert rel((tb["leaf"] + tb["spine"]) / world, 2 * (R - 1) / R * E * 4 / H) < 1e-9
        assert rel(tb["island"] / world, 2 * (g - 1) / g * E * 2) < 1e-9
        assert c.background_blocking and c.streams[0].phases[0].latency_s > 0
    # latency and bandwidth of the sync both charged 1/H; a longer H, fewer bytes and a shorter sync
    assert rel(diloco(fab, pure_dp(t), E, 2, 16).background_s(), diloco(fab, pure_dp(t), E, 2, 1).background_s()
               / 16) < 1e-9
    # the shapes add up to the parameters; a 175B, 96-layer GPT has h about 12288
    mats, vec = gpt_matrices(175e9, 96)
    assert rel(sum(n * m * k for n, m, k in mats) + vec, 175e9) < 1e-9 and abs(mats[1][0] - 12288) < 150
    p1, q1, rest1 = powersgd_elements(175e9, 96, 1)
    p4, q4, rest4 = powersgd_elements(175e9, 96, 4)
    assert rel(p4 + q4, 4 * (p1 + q1)) < 1e-9 and rest1 == rest4 == vec
    h = mats[1][0]
    assert rel(p1 + q1, 96 * 16 * h + 51200 + h) < 1e-9  # per layer (3h+h) + 2h + 5h + 5h, embedding V + h
    # a matrix too small to gain (r (n + m) x 2 >= n m) goes whole with the vectors, as PyTorch's hook does
    p, q, rest = powersgd_elements(1e4, 1, 64)
    assert p == q == 0 and rel(rest, 1e4) < 1e-9
    by_rank = {}
    for r in (1, 4):
        c = powersgd(fab, pure_dp(t), E, 175e9, 96, r)
        assert [ph.name for ph in c.streams[0].phases] == ["uncompressed all-reduce", "P all-reduce", "Q all-reduce"]
        assert not c.streams[0].pipelined and not c.background
        by_rank[r] = c.tier_bytes()
        p, q, rest = powersgd_elements(175e9, 96, r)
        ring = flat_ring(fab, pure_dp(t), (p + q + rest) * E / 175e9 * 4).tier_bytes()
        assert all(rel(by_rank[r][k], ring[k]) < 1e-9 for k in ("island", "leaf"))
    hier = hierarchical_2level(fab, pure_dp(t), 2 * E, pipelined=False, inter_bytes=4 * E).tier_bytes()
    assert by_rank[1]["leaf"] < by_rank[4]["leaf"] < hier["leaf"] / 100
    # bad periods, ranks and a missing layer count: one message each, naming what is needed
    with pytest.raises(SimError, match=r"^DiLoCo period = 0; expected an integer >= 1$"):
        diloco(fab, pure_dp(t), E, 2, 0)
    with pytest.raises(SimError, match=r"^PowerSGD rank = 0; expected an integer >= 1$"):
        powersgd(fab, pure_dp(t), E, 175e9, 96, 0)
    with pytest.raises(SimError, match=r"^PowerSGD needs the layer count to shape the gradient's matrices: give "
                       r"--num-layers \(or --megatron-args; Python: Workload\(num_layers=\.\.\.\)\)$"):
        powersgd(fab, pure_dp(t), E, 175e9, None, 4)
    for kw, msg in (({"diloco_period": 0}, "diloco_period = 0; expected an integer >= 1"),
                    ({"powersgd_rank": 2.5}, "powersgd_rank = 2.5; expected an integer >= 1")):
        with pytest.raises(SimError) as exc:
            simulate(t, Workload(E, compute_s=1.0, num_layers=4), SimOptions(algorithms=("diloco",), **kw))
        assert str(exc.value) == msg
    # priced only when asked for, like localsgd; the CLI takes their knobs
    assert not {"localsgd", "diloco", "powersgd"} & set(SimOptions().algorithms)
    res = simulate(t, Workload(E, compute_s=1.0, num_layers=4),
                   SimOptions(algorithms=("diloco", "powersgd"), diloco_period=8, powersgd_rank=2))
    assert rel(res.row("diloco").tier_bytes_per_gpu["leaf"] + res.row("diloco").tier_bytes_per_gpu["spine"],
               2 * (R - 1) / R * E * 4 / 8) < 1e-9


def test_defaults_follow_the_plugin():
    """The cost model prices what a user gets: SimOptions' selective knobs are the schema's defaults."""
    c, o = TopoAlignConfig(), SimOptions()
    assert (o.sync_dtype, o.local_dtype, o.reconcile_dtype, o.moments_dtype) == (
        c.sync.dtype, c.local.dtype, c.local.reconcile_dtype, c.local.moments_dtype)
    assert (o.top_fraction, o.last_n_layers, o.reconcile_interval, o.moments_interval, o.promote_fraction,
            o.async_reconcile) == (c.sync.top_fraction, c.sync.last_n_layers, c.local.reconcile_interval,
                                   c.local.moments_interval, c.local.promote_drift_fraction, c.local.async_reconcile)


def test_bench_check_predicts_the_long_preset_within_25_percent(tmp_path, capsys):
    """Issue 25 item 4 (and issue 31 item 4 at 4 and 8 islands): every system of the measured long
    runs (docs/data/bench-*-long*.json) priced within 25 % on the mean step time and on the
    cross-node bytes per step."""
    from pathlib import Path

    from topo_integrations.sim.benchcheck import check_bench

    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/data/bench-2x2-long.json").read_text())
    rows, notes = check_bench(data, root=root)
    assert len(rows) == len(data["systems"]) >= 10, notes
    bad = [(r.key, round(r.step_err, 3), round(r.bytes_err, 3)) for r in rows
           if abs(r.step_err) > 0.25 or abs(r.bytes_err) > 0.25]
    assert not bad, bad
    assert {r.algorithm for r in rows} >= {"ring", "hier2-b2b", "selective", "localsgd"}
    assert sim_main(["--bench", str(root / "docs/data/bench-2x2-long.json")]) == 0
    out = capsys.readouterr().out
    assert f"{len(rows)} of {len(rows)} systems within 25%" in out
    # the run with the bf16 moment wire (no unshaped ZeRO-0 in it: the main run's compute step), whose
    # selective rows carry moments_dtype into the price
    assert sim_main(["--bench", str(root / "docs/data/bench-2x2-long-moments16.json"), "--compute-s", "0.123"]) == 0
    assert "5 of 5 systems within 25%" in capsys.readouterr().out
    # issue 31 item 4: the long horizon at 4 islands of 2 and 8 islands of one rank (8 ranks each),
    # compute per step from each run's own unshaped ZeRO-0
    for name, n in (("bench-4x2-long", 5), ("bench-8x1-long", 4)):
        assert sim_main(["--bench", str(root / f"docs/data/{name}.json")]) == 0
        assert f"{n} of {n} systems within 25%" in capsys.readouterr().out, name
    # and the `auto` default there (every tensor SYNC on int8; run without --comm-share: compute per
    # step from the 2-group run's unshaped ZeRO-0 of the same preset)
    for name, compute in (("bench-4x2-long-auto", "0.241"), ("bench-8x1-long-auto", "0.251")):
        assert sim_main(["--bench", str(root / f"docs/data/{name}.json"), "--compute-s", compute]) == 0
        out = capsys.readouterr().out
        assert "4 of 4 systems within 25%" in out and "| `selective` |" in out, name
    # and at 2 islands (every tensor SYNC on int8 there too): all but the ZeRO-1 form, whose step is
    # 25 % above the price (DeepSpeed's own work per step, which the model leaves out)
    data = json.loads((root / "docs/data/bench-2x2-long-auto.json").read_text())
    rows, _ = check_bench(data, root=root, compute_s=0.123)
    off = {r.key for r in rows if abs(r.step_err) > 0.25 or abs(r.bytes_err) > 0.25}
    assert off == {"ds-topo-selective-z1"}, off
    sel = next(r for r in rows if r.key == "topo-selective")
    assert abs(sel.step_err) < 0.15 and abs(sel.bytes_err) < 0.05, sel
    for argv, msg in ((["--params", "1e9", "--compute-s", "1"],
                       "--topology FILE is required (or --bench RESULTS.json)"),
                      (["--bench", str(tmp_path / "none.json")], f"--bench {tmp_path / 'none.json'}: cannot read JSON"),
                      (["--bench", _json(tmp_path, {"format": "x"})], "bench results format = 'x'; expected"),
                      (["--bench", "x.json", "--tolerance", "0"], "--tolerance 0; expected a relative error > 0")):
        assert sim_main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err


def _json(tmp_path, obj) -> str:
    p = tmp_path / "r.json"
    p.write_text(json.dumps(obj))
    return str(p)


def test_split_groups_match_planner():
    t = topo(2, 3, 4)
    intra, rails = split_groups(Fabric.from_topology(t), pure_dp(t), "island")
    plan = plan_groups(t)
    assert [tuple(x) for x in intra.tolist()] == list(plan.intra_groups)
    assert [tuple(x) for x in rails.tolist()] == list(plan.inter_groups)


def test_bucket_timeline():
    # 4 buckets of 2 s each arrive every 1 s of a 4 s backward: the queue ends at 9 s, 5 s exposed.
    tl = bucket_timeline(4e9, 1e9, 8.0, 0.0, 4.0, True)
    assert tl.n_buckets == 4 and tl.end_s == pytest.approx(9.0, rel=1e-12) and tl.exposed_s == pytest.approx(5.0)
    assert bucket_timeline(4e9, 1e9, 8.0, 0.0, 4.0, False).exposed_s == pytest.approx(8.0)
    # fast links: only the last bucket is exposed; latency is paid per bucket
    tl = bucket_timeline(4e9, 1.5e9, 0.3, 0.01, 4.0, True)
    assert tl.n_buckets == 3 and tl.exposed_s == pytest.approx(0.01 + 0.3 * 1.0 / 4.0)
    with pytest.raises(SimError, match="bucket size"):
        bucket_timeline(1.0, 0.0, 1.0, 0.0, 1.0, True)


def test_streams_share_one_issuing_queue_and_local_waits_for_the_last_sync_bucket():
    # one part: test_bucket_timeline's queue (4 buckets of 2 s every 1 s of a 4 s backward end at 9 s)
    assert serial_timeline([QueuedStream(4e9, 8.0, 0.0)], 1e9, 4.0, True).end_s == pytest.approx(9.0)
    # SYNC: 2 buckets of 1 s, ready at 2 s and 4 s; LOCAL: 2 buckets of 0.5 s held until 4 s (the end
    # of backward): the queue runs SYNC 2-3, SYNC 4-5, LOCAL 5-5.5-6, so 2 s are exposed; concurrent
    # streams would have exposed max(1, 1) = 1 s.
    tl = serial_timeline([QueuedStream(2e9, 2.0, 0.0), QueuedStream(2e9, 1.0, 0.0, held_until=1.0)], 1e9, 4.0, True)
    assert (tl.n_buckets, tl.busy_s) == (4, pytest.approx(3.0)) and tl.end_s == pytest.approx(6.0)
    assert tl.exposed_s == pytest.approx(2.0)
    # not held, the LOCAL buckets go as they fill, between the SYNC ones: 2-3 (S), 3-3.5 (L), 4-5, 5-5.5
    free = serial_timeline([QueuedStream(2e9, 2.0, 0.0), QueuedStream(2e9, 1.0, 0.0)], 1e9, 4.0, True)
    assert free.end_s == pytest.approx(5.5)
    # the simulated selective row: the LOCAL stream is held until backward's end when top-fraction
    # tensors are SYNC, until the last N layers are done otherwise
    fab = Fabric.from_topology(topo(1, 2, 8))
    top = selective(fab, pure_dp(topo(1, 2, 8)), 1e9, SelectiveSpec(top_fraction=0.1, last_n_share=0.1))
    last = selective(fab, pure_dp(topo(1, 2, 8)), 1e9, SelectiveSpec(top_fraction=0.0, last_n_share=0.25))
    assert [s.held_until for s in top.streams] == [0.0, 1.0] and [s.held_until for s in last.streams] == [0.0, 0.25]
    assert rel(top.comm_s(), sum(s.bandwidth_s + s.latency_s for s in top.streams)) < 1e-12


def test_an_asynchronous_reconciliation_must_land_within_one_step():
    """Its correction is applied after the next optimizer step: a launch longer than the step's idle
    queue time stalls the step by the difference, once per launch (not its average over H)."""
    t = topo(2, 1, 8, leaf=(0.05, 7.0), spine=(0.05, 10.0, 1.0))
    wl = Workload(2e8, "fp32", compute_s=1.0)
    base = dict(top_fraction=0.05, last_n_share=0.0, algorithms=("selective",), overlap=True,
                moments_interval=4, promote_fraction=0.0, reconcile_interval=16, reconcile_dtype="fp32",
                moments_dtype="fp32")

    def row(**kw):
        return simulate(t, wl, SimOptions(**base, **kw)).row("selective")

    r, blocking = row(stream_fragments=1), row(stream_fragments=1, async_reconcile=False)
    streams_exposed = blocking.exposed_s - blocking.background_s
    idle = wl.compute_s + streams_exposed - r.busy_s  # the queue's free time in one step
    per = r.background_s * 16  # the mean launch: every 16 steps
    # launches: 3 of 4 carry the fp32 values (4 bytes per element), every 4th the fp32 moments too (4 + 2 x 4)
    stall = (0.75 * max(0.0, per * 4 / 6 - idle) + 0.25 * max(0.0, per * 12 / 6 - idle)) / 16
    assert r.background_s < idle < per * 12 / 6  # the average would hide; the moments launch does not fit
    assert r.exposed_s == pytest.approx(streams_exposed + stall, rel=1e-12) and stall > 0
    # 16 fragments: the same bytes in 16 launches of a sixteenth, each fits one step: no stall
    assert row(stream_fragments=16).exposed_s == pytest.approx(streams_exposed, rel=1e-9)
    c = selective(Fabric.from_topology(t), pure_dp(t), 2e8, SelectiveSpec(
        top_fraction=0.05, reconcile_bytes=4, moments_bytes=2.0, moments_interval=4, reconcile_interval=16))
    assert c.launch_rate == 1 / 16 and c.launch_scales == ((0.75, pytest.approx(4 / 6)), (0.25, pytest.approx(2.0)))


# -- layouts and workloads ----------------------------------------------------------------------------


def test_dp_groups_megatron_order():
    g = dp_groups(16, 2, 2)
    assert g.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_tp8_makes_dp_groups_rails_and_hierarchy_moot():
    t = topo(2, 4, 8)
    res = simulate(t, Workload(8e9, "bf16", tp=8, compute_s=10.0), SimOptions(overlap=False))
    ring, h2 = res.row("ring"), res.row("hier2")
    assert ring.tier_bytes_per_gpu["island"] == 0.0  # DP peers are on different hosts
    assert rel(ring.comm_s, h2.comm_s) < 1e-9
    n = 8
    expect = 2 * (n - 1) / n * (8e9 / 8 * 2) / (24 * GB) + 2 * (n - 1) * 10e-6
    assert rel(ring.comm_s, expect) < 1e-9
    assert any("hier3" in x for x in res.notes) or res.row("hier3")


def test_compute_from_flops():
    wl = Workload(175e9, mfu=0.35, peak_tflops=312.0, tokens_per_step=1536 * 2048)
    assert rel(wl.compute_seconds(960), 6 * 175e9 * 1536 * 2048 / (960 * 0.35 * 312e12)) < 1e-12
    with pytest.raises(SimError, match="--compute-s"):
        Workload(1e9).validate(8)
    with pytest.raises(SimError, match=r"tp x pp = 3 x 1 = 3 does not divide the 8 GPUs"):
        Workload(1e9, tp=3, compute_s=1.0).validate(8)


def test_megatron_args_and_deepspeed_config(tmp_path):
    cfg = tmp_path / "ta.json"
    cfg.write_text(json.dumps({"mode": "selective", "sync": {"top_fraction": 0.3, "last_n_layers": 2}}))
    args = tmp_path / "gpt.args"
    args.write_text(f"""# GPT-3 175B
--num-layers 96 --hidden-size 12288 \\
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --bf16
--global-batch-size 1536 --seq-length 2048 --topo-align --topo-align-config {cfg} --topo-align-reconcile-interval 8
""")
    flags = read_megatron_args(str(args))
    assert flags["num-layers"] == "96" and flags["bf16"] is True and flags["topo-align"] is True
    from topo_integrations.sim.workload import workload_from_deepspeed_config, workload_from_megatron_args

    wl = workload_from_megatron_args(str(args), Workload(1.0))
    assert wl.tp == 8 and wl.pp == 8 and wl.num_layers == 96 and wl.grad_dtype == "bf16"
    assert wl.params == megatron_param_count(96, 12288) and 174e9 < wl.params < 176e9
    assert wl.tokens_per_step == 1536 * 2048
    assert wl.topo_align.sync.top_fraction == 0.3 and wl.topo_align.local.reconcile_interval == 8
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True},
                              "topo_align": {"local": {"reconcile_interval": 16, "async_reconcile": False}}}))
    wl2 = workload_from_deepspeed_config(str(ds), Workload(1.0, grad_dtype="fp32"))
    assert wl2.grad_dtype == "bf16" and isinstance(wl2.topo_align, TopoAlignConfig)
    assert wl2.topo_align.local.reconcile_interval == 16
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"topo_align": {"sync": {"top_fractoin": 0.1}}}))
    with pytest.raises(SimError, match="top_fractoin"):
        workload_from_deepspeed_config(str(bad), Workload(1.0))


def test_reconcile_sync_vs_async_in_step_time():
    t = topo(2, 2, 8)
    base = dict(top_fraction=0.1, last_n_share=0.0, algorithms=("selective",), reconcile_interval=2, overlap=True)
    wl = Workload(2e9, "bf16", compute_s=5.0)
    sync = simulate(t, wl, SimOptions(**base, async_reconcile=False)).row("selective")
    asy = simulate(t, wl, SimOptions(**base, async_reconcile=True)).row("selective")
    assert sync.background_s > 0
    assert rel(sync.step_s - asy.step_s, sync.background_s) < 1e-9  # hidden behind 5 s of compute


# -- the 960-GPU SuperPOD against the design's first estimate (docs/costmodel.md 2.3) ----------------------


def superpod(over: float = 1.0) -> Topology:
    return topology_from_dict({
        "name": "superpod", "gpus_per_node": 8,
        "tiers": {"island": {"bandwidth_gbps": 230, "latency_us": 6}, "leaf": {"bandwidth_gbps": 24, "latency_us": 14},
                  "spine": {"bandwidth_gbps": 24, "latency_us": 14, "oversubscription": over}},
        "leaves": [{"name": f"su{i}", "hosts": f"dgx{i}[01-20]"} for i in range(6)],
    })


def test_superpod_960_agrees_with_first_estimate():
    res = simulate(superpod(), Workload(175e9, "bf16", compute_s=30.0), SimOptions(overlap=False))
    # the first estimate: ring 3.655 s, 2-level 3.619 / 6.282 s, 3-level 3.616 s
    assert rel(res.row("ring").comm_s, 3.655) < 0.01
    assert rel(res.row("hier2").comm_s, 3.619) < 0.001
    assert rel(res.row("hier2-b2b").comm_s, 6.282) < 0.001
    assert rel(res.row("hier3").comm_s, 3.616) < 0.001
    assert res.row("ring").bottleneck == "leaf"
    tp = simulate(superpod(), Workload(175e9, "bf16", tp=8, pp=8, compute_s=30.0), SimOptions(overlap=False))
    assert rel(tp.row("ring").comm_s, 0.426) < 0.01  # "0.426 s/step"


# -- CLI and speed ------------------------------------------------------------------------------------


def _write_topo(tmp_path, over=2.0):
    from topo_integrations.topology import topology_to_dict

    p = tmp_path / "sp.json"
    p.write_text(json.dumps(topology_to_dict(superpod(over))))
    return str(p)


def test_cli_json_plot_and_errors(tmp_path, capsys):
    topo_file = _write_topo(tmp_path)
    png = tmp_path / "p.png"
    rc = sim_main(["--topology", topo_file, "--params", "175e9", "--tp", "8", "--pp", "8", "--compute-s", "30",
                   "--rank-order", "scattered", "--json", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert data["workload"]["dp"] == 15 and data["options"]["rank_order"] == "scattered"
    assert {r["key"] for r in data["rows"]} >= {"ring", "hier2", "selective"}
    assert not {r["key"] for r in data["rows"]} & {"localsgd", "diloco", "powersgd"}  # peers: on request
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for argv, msg in (
        (["--params", "175e9", "--tp", "7", "--compute-s", "1"], "tp x pp = 7 x 1 = 7 does not divide the 960 GPUs"),
        (["--compute-s", "1"], "model size unknown: give --params"),
        (
            ["--params", "1e9", "--compute-s", "1", "--algorithms", "ring,fast"],
            "algorithm 'fast'; expected a comma list",
        ),
        (["--params", "1e9"], "compute per step is unknown"),
        (
            ["--params", "1e9", "--compute-s", "1", "--top-fraction", "1.5"],
            "top_fraction = 1.5; expected a number in [0, 1]",
        ),
        (["--params", "1e9", "--compute-s", "1", "--algorithms", "powersgd"],
         "PowerSGD needs the layer count to shape the gradient's matrices: give --num-layers"),
        (["--params", "1e9", "--compute-s", "1", "--algorithms", "diloco", "--diloco-period", "0"],
         "diloco_period = 0; expected an integer >= 1"),
        (["--params", "1e9", "--compute-s", "1", "--num-layers", "8", "--algorithms", "powersgd",
          "--powersgd-rank", "0"], "powersgd_rank = 0; expected an integer >= 1"),
    ):
        assert sim_main(["--topology", topo_file, *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err
    assert sim_main(["--topology", str(tmp_path / "missing.json"), "--params", "1e9", "--compute-s", "1"]) == 2
    assert "cannot read topology file" in capsys.readouterr().err
    # the peers' knobs reach the model
    assert sim_main(["--topology", topo_file, "--params", "175e9", "--num-layers", "96", "--compute-s", "30",
                     "--algorithms", "diloco,powersgd", "--diloco-period", "64", "--powersgd-rank", "1",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["options"]["diloco_period"], data["options"]["powersgd_rank"]) == (64, 1)
    assert {r["key"] for r in data["rows"]} == {"ring", "hier2", "diloco", "powersgd"}


def test_moments_dtype_halves_the_moments_bytes(tmp_path, capsys):
    """--moments-dtype bf16: Adam's two moments cost 2 x 2 / moments_interval bytes per LOCAL element
    and reconciliation instead of 2 x 4 / moments_interval (fp32)."""
    topo_file = _write_topo(tmp_path)
    leaf = {}
    for dt in ("fp32", "bf16"):
        # a LOCAL class to average (at this topology's group count `auto` would make every tensor SYNC)
        assert sim_main(["--topology", topo_file, "--params", "1e9", "--compute-s", "1", "--moments-dtype", dt,
                         "--top-fraction", "0.15", "--algorithms", "selective", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["options"]["moments_dtype"] == dt
        leaf[dt] = next(r for r in data["rows"] if r["key"] == "selective")["tier_bytes_per_gpu"]["leaf"]
    assert leaf["bf16"] < leaf["fp32"]
    with pytest.raises(SystemExit) as e:  # argparse: usage and one error line
        sim_main(["--topology", topo_file, "--params", "1e9", "--compute-s", "1", "--moments-dtype", "int8"])
    assert e.value.code == 2 and "argument --moments-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    # `auto` or a number (issue 31), said in one line
    with pytest.raises(SystemExit) as e:
        sim_main(["--topology", topo_file, "--params", "1e9", "--compute-s", "1", "--top-fraction", "most"])
    assert e.value.code == 2 and "argument --top-fraction: 'most' is neither a number nor auto" in \
        capsys.readouterr().err


def test_compute_defaults_from_the_gpu_kind(tmp_path, capsys):
    """Without --compute-s: peak from the topology's GPU kind (or --gpu), MFU 0.4, 1536 x 2048 tokens;
    every default used is named in the output (docs/costmodel.md, "Compute per step")."""
    from topo_integrations.sim.compute import DEFAULT_MFU, DEFAULT_TOKENS_PER_STEP, gpu_peak_tflops

    assert gpu_peak_tflops("a100-sxm4-80gb") == ("A100", 312.0)
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == ("H100", 989.0)
    with pytest.raises(SimError, match="GPU kind 'MI300X' is unknown; expected one of V100, A100"):
        gpu_peak_tflops("MI300X")
    plain = _write_topo(tmp_path)  # no "gpu" key
    doc = json.loads(open(plain).read())
    doc["gpu"] = "A100"
    named = tmp_path / "named.json"
    named.write_text(json.dumps(doc))
    assert sim_main(["--topology", str(named), "--params", "175e9", "--tp", "8", "--pp", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = 6 * 175e9 * DEFAULT_TOKENS_PER_STEP / (960 * DEFAULT_MFU * 312e12)
    assert rel(data["compute_s"], want) < 1e-12 and DEFAULT_TOKENS_PER_STEP == 1536 * 2048
    assert data["workload"]["peak_tflops"] == 312.0 and len(data["workload"]["assumed"]) == 3
    assert any("compute per step assumed: peak 312 TFLOP/s per GPU (A100" in n for n in data["notes"])
    # --gpu overrides the file; an explicit flag is not an assumption
    assert sim_main(["--topology", str(named), "--params", "175e9", "--gpu", "H100", "--mfu", "0.5", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workload"]
    assert w["peak_tflops"] == 989.0 and w["mfu"] == 0.5 and not any("MFU" in a for a in w["assumed"])
    # no GPU kind anywhere: the error says what to give
    assert sim_main(["--topology", plain, "--params", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "the topology names no GPU kind" in err and "--gpu KIND" in err and err.count("\n") == 1
    # tokens per step from a DeepSpeed config's train_batch_size x --seq-length
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 512, "bf16": {"enabled": True}}))
    assert sim_main(["--topology", str(named), "--params", "1e9", "--deepspeed-config", str(ds),
                     "--seq-length", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["tokens_per_step"] == 512 * 1024


def test_readme_simulate_example_answers():
    """The README's example, as written (the docs test runs it too, through the installed command)."""
    from pathlib import Path

    from topo_integrations.cli import main as cli_main

    topo_file = Path(__file__).resolve().parents[1] / "configs" / "topologies" / "dgx-a100-superpod-960.json"
    assert cli_main(["simulate", "--topology", str(topo_file),
                     "--params", "175e9", "--tp", "8", "--pp", "8", "--json"]) == 0


def test_python_m_entry_point(tmp_path):
    topo_file = _write_topo(tmp_path)
    p = subprocess.run([sys.executable, "-m", "topo_integrations.sim", "--topology", topo_file, "--params", "1e9",
                        "--compute-s", "1", "--algorithms", "ring,tree"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Flat ring" in p.stdout and "Tree" in p.stdout


@pytest.mark.timeout(120)
def test_16384_gpus_175b_under_5s():
    t = topology_from_dict({
        "name": "big", "gpus_per_node": 8,
        "tiers": {"spine": {"bandwidth_gbps": 24, "latency_us": 10, "oversubscription": 2.0}},
        "leaves": [{"name": f"su{i}", "hosts": f"n{i}-[001-032]"} for i in range(64)],
    })
    assert t.world_size == 16384
    t0 = time.process_time()  # CPU time: other jobs on a shared machine do not count against it
    res = simulate(t, Workload(175e9, "bf16", mfu=0.4, peak_tflops=312, tokens_per_step=4 * 2**20, num_layers=96),
                   SimOptions(rank_order="scattered", algorithms=tuple(ALGORITHMS)))
    took = time.process_time() - t0
    assert took < 5.0, took
    assert len(res.rows) == len(ALGORITHMS) and all(math.isfinite(r.step_s) for r in res.rows)


# -- calibration script --------------------------------------------------------------------------------


def _calibrate_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "calibrate_costmodel.py"
    spec = importlib.util.spec_from_file_location("calibrate_costmodel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calibration_script_compare_and_collect(tmp_path, capsys):
    import pathlib

    cal = _calibrate_module()
    topo_file = str(pathlib.Path(__file__).parent / "fixtures" / "sim" / "virtual-2x2.json")
    ring_s, ring_tx = cal.predict(topo_file, 4e6, "ring")
    # 2 hosts x 2 ranks at 0.025 GB/s per rank: each node's 0.05 GB/s uplink sends 2(n-1)/n * 4 MB
    assert rel(ring_s, 2 * 3 / 4 * 4e6 / 0.05e9 + 2 * 3 * 500e-6) < 1e-9 and rel(ring_tx, 6e6) < 1e-9
    hier_s, _ = cal.predict(topo_file, 4e6, "hier2-b2b")
    lines = tmp_path / "run.jsonl"
    lines.write_text("\n".join(
        "[rank %d] " % r + json.dumps({"rank": r, "numel": 1_000_000, "iters": 2, "phases": {
            "flat": {"seconds": 2 * ring_s * (1.1 if r else 1.0), "node_tx_bytes": 2 * 6_100_000},
            "hierarchical": {"seconds": 2 * hier_s * 0.9, "node_tx_bytes": 2 * 4_050_000}}})
        for r in range(4)) + "\n")
    out = tmp_path / "measured.json"
    assert (
        cal.main(["collect", "--name", "v2x2", "--topology", topo_file, "--lines", str(lines), "--out", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    assert data["presets"][0]["bytes"] == 4_000_000
    assert rel(data["presets"][0]["measured"]["flat"], ring_s * 1.1) < 1e-9  # slowest rank, per iteration
    capsys.readouterr()
    assert cal.main(["compare", str(out)]) == 0
    table = capsys.readouterr().out
    assert "-9.1%" in table and "+11.1%" in table and "NO" not in table  # (pred - meas) / meas
    assert cal.main(["compare", str(out), "--tolerance", "0.05"]) == 1
    data["presets"][0]["measured"]["ring"] = "fast"
    out.write_text(json.dumps(data))
    assert cal.main(["compare", str(out)]) == 2
    assert "presets[0].measured.ring = 'fast'" in capsys.readouterr().err


def test_calibration_collect_append_keeps_repeats_and_tiers(tmp_path, capsys):
    import pathlib

    cal = _calibrate_module()
    topo_file = str(pathlib.Path(__file__).parent / "fixtures" / "sim" / "virtual-2x2.json")
    out = tmp_path / "measured.json"
    tiers = '{"leaf": {"latency_us": 15}}'
    for i, (secs, numel) in enumerate(((0.5, 1_000_000), (0.7, 1_000_000), (0.9, 2_000_000))):
        lines = tmp_path / f"run{i}.jsonl"
        lines.write_text(json.dumps({"rank": 0, "numel": numel, "iters": 1, "phases": {
            "flat": {"seconds": secs, "node_tx_bytes": 6_000_000 + i}}}) + "\n")
        argv = ["collect", "--name", "v2x2", "--topology", topo_file, "--lines", str(lines), "--out", str(out),
                "--append"] + (["--tiers", tiers] if i == 0 else [])
        assert cal.main(argv) == (0 if i < 2 else 2)
    preset = json.loads(out.read_text())["presets"][0]
    # two runs of the same size are kept as repeats; the third (another size) is refused
    assert preset["measured"]["flat"] == [0.5, 0.7] and preset["node_tx_bytes"]["flat"] == 6_000_001
    assert preset["tiers"] == {"leaf": {"latency_us": 15}}
    assert "bytes = 8000000, but preset 'v2x2'" in capsys.readouterr().err
    assert cal.predict(topo_file, 4e6, "ring", tiers=preset["tiers"])[0] < cal.predict(topo_file, 4e6, "ring")[0]


# -- where each algorithm wins (issues 31, 38; scripts/costmodel_regions.py, docs/costmodel.md section 5) --


def _regions_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "costmodel_regions.py"
    if "costmodel_regions" in sys.modules:
        return sys.modules["costmodel_regions"]
    spec = importlib.util.spec_from_file_location("costmodel_regions", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_costmodel_regions_small_sweep(tmp_path, capsys):
    from topo_integrations.config import resolve_sync
    from topo_integrations.sim.model import DTYPE_BYTES

    reg = _regions_module()
    out = tmp_path / "regions.md"
    assert reg.main(["--islands", "2,8,128", "--gbits", "1,400", "--markdown", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    # the header states what is priced and what is not
    assert "simulated" in printed and "**not** model quality" in printed and "docs/convergence.md" in printed
    assert "Generated by `.venv/bin/python scripts/costmodel_regions.py --islands 2,8,128 --gbits 1,400`" in printed
    assert "| 128 (1024) | **D256** 69.3 s (D64 2.88x) | H = S = D256 25.9 s (D64 1.02x) |" in printed
    assert "| 128 (1024) | **local 64 capped** 0.62x | **hier.** 1.00x |" in printed  # method: auto's choice
    assert "`auto` for hierarchical and selective (25 MiB up to 6 islands, then 4 MiB per island" in printed
    assert "from 2 islands on every tensor SYNC on the int8 wire (`auto`)" in printed
    assert "**D16**, **D64**, **D256** DiLoCo" in printed and "**P1**, **P4** PowerSGD" in printed

    o = reg.options()
    cells = {(c.islands, c.gbit): c for c in reg.sweep((2, 8, 128), (1, 400), o)}
    # slowest link, most islands: DiLoCo's fp32 sync every 256 steps wins alone; selective's int8 rail
    # (512 MiB `auto` buckets) still beats post-local SGD's blocking average; hierarchical is last
    slow = cells[(128, 1)]
    assert slow.winners == ["diloco-h256"] and max(slow.step_s, key=slow.step_s.get) == "hier2-b2b"
    assert slow.step_s["selective"] < slow.step_s["localsgd"]
    # fast link, few islands: hierarchical hides behind backward (but its last bucket), every column ties
    fast = cells[(8, 400)]
    assert fast.winners == list(reg.KEYS)
    assert rel(fast.step_s["hier2-b2b"], fast.compute_s) < 1e-5  # the last bucket only
    # 8 islands at 1 Gbit/s: PowerSGD's few bytes hide (hierarchical exposes its bytes, the rest their syncs)
    assert cells[(8, 1)].winners == ["powersgd-r1", "powersgd-r4"]
    # 128 islands: PowerSGD's three chained flat rings per 25 MiB bucket (2 x 1023 ring steps each) are
    # latency-bound at every link speed
    assert cells[(128, 400)].step_s["powersgd-r1"] > 30 * cells[(128, 400)].compute_s
    # `method: auto`: hierarchical where it hides, a LOCAL class (H 64) on the slowest cell;
    # its hierarchical priced on the cell's fabric is column H
    assert fast.auto.method == "hierarchical" and rel(fast.auto_step_s, fast.step_s["hier2-b2b"]) < 1e-9
    assert fast.auto_agrees
    assert (slow.auto.method, slow.auto.reconcile_interval) == ("local", 64)
    assert slow.auto_agrees and slow.auto_step_s < min(slow.step_s.values())  # the lean class: under every column
    c8 = cells[(8, 1)]
    assert c8.auto.method == "int8" and rel(c8.auto_step_s, c8.step_s["selective"]) < 1e-9  # int8 is column S
    # 128 islands, 400 Gbit/s: fixed 25 MiB buckets of hierarchical and of `auto` selective (every
    # tensor SYNC) are latency-bound (254 ring steps each) and DiLoCo wins (post-local SGD beats both
    # too); the `auto` bucket (512 MiB at 128 groups) hides both behind backward
    fixed = reg.sweep((128,), (400,), reg.options(bucket_mb=25), auto=False)[0]
    assert fixed.winners == ["diloco-h256"] and fixed.auto is None
    assert min(fixed.step_s[k] for k in ("hier2-b2b", "selective")) > 1.5 * fixed.compute_s
    assert fixed.step_s["localsgd"] < min(fixed.step_s[k] for k in ("hier2-b2b", "selective"))
    assert cells[(128, 400)].winners == ["hier2-b2b", "selective", "diloco-h256"]
    assert rel(cells[(128, 400)].step_s["selective"], cells[(128, 400)].compute_s) < 0.01
    E = 175e9  # gradient elements per GPU (pure DP)
    for (n, _), c in cells.items():
        assert min(c.step_s.values()) >= c.compute_s * (1 - 1e-12)
        b, f, w = c.slow_bytes, c.sync_fraction, 8 * n
        assert all(b[k] < b["hier2-b2b"] for k in reg.KEYS[1:])
        # `auto`: every tensor on int8 wherever there are 2 islands or more
        dtype, frac = resolve_sync(o.sync_dtype, o.top_fraction, n)
        assert (dtype, frac == 1.0, f == 1.0) == ("int8", True, True)
        # selective / hierarchical (fp32 wire): SYNC share on its wire + the LOCAL reconciliation every H steps
        sel = (f * DTYPE_BYTES[dtype] + (1 - f) * (DTYPE_BYTES[o.reconcile_dtype] + 2 * DTYPE_BYTES[
            o.moments_dtype] / o.moments_interval) / o.reconcile_interval) / DTYPE_BYTES[o.inter_dtype]
        assert rel(b["selective"] / b["hier2-b2b"], sel) < 1e-9
        # post-local SGD: fp32 parameters every 4 steps over a ring of all ranks, vs the rail ring of islands:
        # a quarter of hierarchical's bytes, times (w-1)/w over (n-1)/n
        assert rel(b["localsgd"] / b["hier2-b2b"], 0.25 * ((w - 1) / w) / ((n - 1) / n)) < 1e-9
        # DiLoCo: the fp32 pseudo-gradient of the whole model over each rail every H steps, so its bytes fall with H
        for H in (16, 64, 256):
            assert rel(b[f"diloco-h{H}"], 2 * (n - 1) / n * E * 4 / H) < 1e-9
        assert b["diloco-h16"] > b["diloco-h64"] > b["diloco-h256"]
        # PowerSGD: fewer bytes at rank 1 than at 4, both far below hierarchical's
        assert b["powersgd-r1"] < b["powersgd-r4"] < b["hier2-b2b"] / 1000
    # bytes do not depend on the link speed
    assert all(rel(cells[(n, 1)].slow_bytes[k], cells[(n, 400)].slow_bytes[k]) < 1e-9
               for n in (2, 8, 128) for k in reg.KEYS)
    # bad input: exit 2 with one line
    assert reg.main(["--islands", "2", "--gbits", "1", "--localsgd-period", "0"]) == 2
    assert "localsgd_period = 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reg.main(["--islands", "1"])


def test_costmodel_regions_doc_is_what_the_script_prints():
    """docs/costmodel.md section 5 holds the default sweep's tables as the script prints them today."""
    reg = _regions_module()
    swept = reg.sweep()  # once: main([]) prints render(sweep(), options()) (test_costmodel_regions_small_sweep)
    assert reg.doc_block() == reg.render(swept, reg.options()), (
        "docs/costmodel.md section 5 is stale: run .venv/bin/python scripts/costmodel_regions.py --write-doc")
    # the lead paragraph's boundaries: where hierarchical (exact) ties the winner, where it does not
    cells = {(c.islands, c.gbit): c for c in swept}
    enough = {n: min(g for g in reg.GBITS if "hier2-b2b" in cells[(n, g)].winners) for n in reg.ISLANDS}
    assert enough == {2: 1, 4: 10, 8: 10, 16: 10, 32: 25, 64: 100, 128: 200}
    assert all(("hier2-b2b" in cells[(n, g)].winners) == (g >= enough[n]) for n in enough for g in reg.GBITS)
    # who wins alone: selective's int8 wire in four cells, DiLoCo at H = 256 on the slowest links of many
    # islands; post-local SGD, DiLoCo at H = 16 and 64 and PowerSGD never alone (PowerSGD's two ranks tie)
    alone = {k: {nk for nk, c in cells.items() if c.winners == [k]} for k in reg.KEYS}
    assert alone["selective"] == {(32, 10), (64, 25), (128, 25), (128, 100)}
    assert alone["diloco-h256"] == {(32, 1), (64, 1), (64, 10), (128, 1), (128, 10)}
    assert not any(alone[k] for k in reg.KEYS if k not in ("selective", "diloco-h256"))
    # PowerSGD: hides its bytes at 4-16 islands on 1 Gbit/s (winning there); latency-bound from 32 islands
    p_wins = {nk for nk, c in cells.items() if "powersgd-r1" in c.winners and "hier2-b2b" not in c.winners}
    assert p_wins == {(4, 1), (8, 1), (16, 1)}
    assert all(c.step_s["powersgd-r1"] > 2 * c.compute_s for (n, _), c in cells.items() if n >= 32)
    # `method: auto`: hierarchical exactly where hierarchical ties the fastest; within 1% of the fastest
    # in 36 of 42 cells (its lean LOCAL class below every column on 1 Gbit/s at 128 islands);
    # elsewhere the fastest is a peer it does not run, and it keeps the int8 wire: the LOCAL class's
    # steps to flat quality (sim/quality.py), and its launches' stalls (a reconciliation lands within
    # one step), outweigh its shorter step there
    assert all((c.auto.method == "hierarchical") == ("hier2-b2b" in c.winners) for c in cells.values())
    off = {nk: c for nk, c in cells.items() if not c.auto_agrees}
    assert set(off) == {(8, 1), (16, 1), (32, 1), (64, 1), (64, 10), (128, 10)}
    assert all(c.winners[0] in ("powersgd-r1", "diloco-h256") for c in off.values())
    assert all(c.auto.method == "int8" and c.auto.time_s("int8") < c.auto.time_s("local") for c in off.values())
    lean = {nk: c for nk, c in cells.items() if c.auto.method == "local"}
    assert set(lean) == {(128, 1)} and all(c.auto_step_s < min(c.step_s.values()) for c in lean.values())
