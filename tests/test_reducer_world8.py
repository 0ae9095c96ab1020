"""The reducer on 8 gloo ranks (one world for the module): groups of 2 (4 nodes) and of 4 (2 nodes),
8 islands of one rank (a bf16 rail of 8: one rounding per sender and one of the sum; `selective`
planned there: local SGD per rank between reconciliations), an unequal layout refused, and a short
selective run checking invariant 1 on every step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from topo_integrations.reducer.plan.planning import HOSTNAME_ENV, gather_hostnames_topology
from topo_integrations.topology import PlanError, plan_groups

from test_reducer_collectives import assert_collectives, collective_checks
from test_reducer_modes import cfg_of, flat_params, make, same_on, train

pytestmark = pytest.mark.multirank

UNEQUAL = ["a"] * 4 + ["b"] * 2 + ["c"] * 2


def _rank_main(rank, world):
    from topo_integrations.reducer import discover_plan
    from topo_integrations.testing import released_groups

    res = {}
    cfg = cfg_of()
    for name, per_node in (("g2", 2), ("g4", 4)):
        with released_groups():  # idle gloo groups cost CPU: each layout's go away with it
            res[name] = _layout(rank, world, cfg, per_node)
    with released_groups():
        res["g1"] = _selective_islands_of_one(rank, world)
    with released_groups():
        res["leaf3"] = _three_level(rank, world)
    with released_groups():
        res["islands8"] = _eight_islands(rank, world)
    with released_groups():
        res["auto"] = _auto_sync(rank, world)
    os.environ[HOSTNAME_ENV] = UNEQUAL[rank]
    try:
        discover_plan(cfg)
        res["unequal"] = None
    except PlanError as exc:
        res["unequal"] = str(exc)
    return res


def _layout(rank, world, cfg, per_node):
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.torch import GroupedReducer

    os.environ[HOSTNAME_ENV] = f"node{rank // per_node}"
    g = build_groups(discover_plan(cfg), timeout_s=60)
    out = collective_checks(g, 3 + per_node, ef_steps=50 if per_node == 4 else 0)
    # selective, blocking reconciliation every 3 steps, invariant 1 checked on every step
    model = make(11)
    red = GroupedReducer(model, cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1,
                                       local__reconcile_interval=3, local__async_reconcile=False),
                         groups=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, red, opt, rank, 0, 9, verify=True)
    out["sel_all_same_after_reconcile"] = same_on(list(range(world)), flat_params(model))
    out["sel_inter_bytes"] = red.stats()["total"]["bytes"]["inter"]
    red.close()
    dist.barrier()
    return out


def _auto_sync(rank, world):
    """`sync.dtype` / `sync.top_fraction` `auto` (issue 31) as the engine takes them from its groups:
    int8 and every tensor SYNC at 8, 4 and 2 groups (no reconciliation bytes, invariant 1 on every
    step); the log line on DP position 0 only."""
    import logging

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.torch import GroupedReducer

    out = {}
    for name, per_node in (("8x1", 1), ("4x2", 2), ("2x4", 4)):
        os.environ[HOSTNAME_ENV] = f"node{rank // per_node}"
        # the schema defaults (no local.* key: with every tensor SYNC the engine refuses one set)
        cfg = TopoAlignConfig.model_validate({"mode": "selective", "topology": {"source": "hostnames"},
                                              "fallback": {"timeout_s": 60.0}})
        g = build_groups(discover_plan(cfg), timeout_s=60)
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda rec: seen.append(rec.getMessage())
        log = logging.getLogger("topo_align")
        log.addHandler(handler)
        old_level = log.level
        log.setLevel(logging.INFO)
        try:
            model = make(11)
            red = GroupedReducer(model, cfg, groups=g)
        finally:
            log.removeHandler(handler)
            log.setLevel(old_level)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, red, opt, rank, 0, 4, verify=True)
        e = red.engine
        st = red.stats()
        out[name] = {"groups": g.inter_size, "dtype": str(e.sync_dtype), "top": e.cfg.sync.top_fraction,
                     "user": (cfg.sync.dtype, cfg.sync.top_fraction), "local": st["local_elements"],
                     "reconcile_bytes": st["total"]["bytes"]["inter"].get("reconcile", 0),
                     "notes": [m for m in seen if "auto ->" in m],
                     "bucket": (e.cfg.communication.bucket_size_mb, red._bucket_numel * 4 / 2**20),
                     "same": same_on(list(range(world)), flat_params(model))}
        red.close()
        dist.barrier()
    return out


def _selective_islands_of_one(rank, world):
    """8 islands of one rank: `selective` plans two levels (groups of one, one rail of 8), LOCAL
    replicas differ between reconciliations and agree after one; `hierarchical` on the same
    hostnames plans flat."""
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.torch import GroupedReducer

    os.environ[HOSTNAME_ENV] = f"node{rank}"
    hier = discover_plan(cfg_of(mode="hierarchical"))
    cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1, local__reconcile_interval=3,
                 local__async_reconcile=False)
    plan = discover_plan(cfg)
    g = build_groups(plan, timeout_s=60)
    model = make(11)
    red = GroupedReducer(model, cfg, groups=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, red, opt, rank, 0, 8, verify=True)  # step 8 (index 7) is not a reconciliation step
    differ = not same_on(list(range(world)), flat_params(model))
    train(model, red, opt, rank, 8, 9, verify=True)
    out = {"hier_plan": (hier.hierarchical, hier.reason), "plan": (plan.hierarchical, plan.notes),
           "sizes": (g.intra_size, g.inter_size), "mode": red.stats()["mode"], "differ_between": differ,
           "same_after": same_on(list(range(world)), flat_params(model)),
           "bytes": red.stats()["total"]["bytes"]}
    red.close()
    dist.barrier()
    return out


LEAF8 = os.path.join(os.path.dirname(__file__), "..", "configs", "topologies", "virtual-2leaf-8.json")


def _three_level(rank, world):
    """topology.middle_level on 2 leaves x 2 islands x 2 ranks: every collective through island,
    leaf rail and spine rail; exactness, bytes per tier, and a selective run with invariant 1."""
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.reducer.engine.stats import Stats
    from topo_integrations.reducer.wire.collectives import hierarchical_all_reduce
    from topo_integrations.torch import GroupedReducer

    cfg = cfg_of(topology__source="file", topology__file=LEAF8, topology__middle_level=True)
    g = build_groups(discover_plan(cfg), timeout_s=60)
    out = collective_checks(g, 17, ef_steps=50)
    out.update(three_level=g.three_level, leaf_rail_size=g.leaf_rail_size, spine_rail_size=g.spine_rail_size)
    # bytes per tier of one fp32 hierarchical all-reduce of n elements (payload bytes per rank)
    st = Stats()
    n = 4000
    hierarchical_all_reduce(torch.ones(n), g, record=st.recorder("sync"))
    tot = st.as_dict()["total"]["bytes"]
    out["bytes"] = {t: tot[t]["sync"] for t in ("intra", "leaf", "inter")}
    model = make(13)
    red = GroupedReducer(model, cfg_of(topology__source="file", topology__file=LEAF8, topology__middle_level=True,
                                       sync__last_n_layers=1, sync__top_fraction=0.1, local__reconcile_interval=3,
                                       local__async_reconcile=True), groups=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, red, opt, rank, 0, 8, verify=True)
    red.reconcile(opt)
    out["sel_all_same_after_reconcile"] = same_on(list(range(world)), flat_params(model))
    out["sel_bytes"] = red.stats()["total"]["bytes"]
    red.close()
    dist.barrier()
    return out


ISLANDS8_N = 4096


def _eight_islands(rank, world):
    """8 islands of one rank: the bf16 SYNC hop is a rail of 8 (invariant 6 of docs/design.md section 4).
    Every rank draws every rank's gradient, so each can compute the exact mean and the bound."""
    import dataclasses

    from topo_integrations.reducer import build_groups
    from topo_integrations.reducer.plan.planning import gather_hostnames_topology
    from topo_integrations.reducer.wire.collectives import hierarchical_all_reduce, residual_numel

    # The planner falls back to `flat` for islands of one rank (nothing to reduce inside them);
    # forcing the two-level plan makes the rail all 8 ranks, the most islands 8 ranks can give.
    plan = plan_groups(gather_hostnames_topology([f"node{r}" for r in range(world)]))
    plan = dataclasses.replace(plan, hierarchical=True, intra_groups=tuple((r,) for r in range(world)),
                               inter_groups=(tuple(range(world)),))
    g = build_groups(plan, timeout_s=60)
    # Mean-zero values over three decades: the partial sums of a ring are larger than the result,
    # so rounding them costs more than rounding the result once.
    xs = [torch.randn(ISLANDS8_N, generator=torch.Generator().manual_seed(31_000 + r))
          * torch.logspace(-3, 0, ISLANDS8_N) for r in range(world)]
    res = torch.zeros(residual_numel(ISLANDS8_N, g, torch.bfloat16))
    y = hierarchical_all_reduce(xs[rank].clone(), g, inter_dtype=torch.bfloat16, residual=res)
    old = xs[rank].to(torch.bfloat16)  # the scheme before issue 31: one all-reduce in bf16
    dist.all_reduce(old, group=g.inter)
    return {"L": g.intra_size, "K": g.inter_size, "y": y, "old": old.float() / world,
            "same": same_on(list(range(world)), y)}


def single_rounding_bound(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mean of ``xs`` and, per element, the error of a bf16 hop that rounds each sender's
    value once (q_r = bf16(x_r)), sums in fp32 and rounds the sum once:
    |result - mean| <= (|sum_r (q_r - x_r)| + 2^-8 |sum_r q_r| + 2^-20 sum_r |q_r|) / n,
    where 2^-8 is bf16's unit roundoff and 2^-20 > (n - 1) 2^-24 (1 + 2^-8) covers the fp32 sum of
    n <= 16 values."""
    x = torch.stack([t.double() for t in xs])
    q = torch.stack([t.to(torch.bfloat16).double() for t in xs])
    n = len(xs)
    bound = ((q - x).sum(0).abs() + 2.0 ** -8 * q.sum(0).abs() + 2.0 ** -20 * q.abs().sum(0)) / n
    return x.mean(0), bound


@pytest.fixture(scope="module")
def world8():
    from topo_integrations.testing import run_world

    return run_world(8, _rank_main, timeout=280, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,L,K", [("g2", 2, 4), ("g4", 4, 2)])
def test_collectives_8_ranks(world8, layout, L, K):
    results = [res[layout] for res in world8]
    for c in results:
        assert (c["intra_size"], c["inter_size"]) == (L, K)
    assert_collectives(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["g2", "g4"])
def test_selective_8_ranks(world8, layout):
    for res in world8:
        assert res[layout]["sel_all_same_after_reconcile"]  # step 9 is a reconciliation step
        assert res[layout]["sel_inter_bytes"]["sync"] > 0 and res[layout]["sel_inter_bytes"]["reconcile"] > 0


@pytest.mark.timeout(300)
def test_selective_at_8_islands_of_one_rank(world8):
    """Islands of one rank: `hierarchical` falls back to flat, `selective` runs two levels (the planner's
    note says so): replicas drift between reconciliations and agree after one, SYNC and the
    reconciliation cross the rail, no LOCAL gradient crosses any link."""
    for res in world8:
        r = res["g1"]
        assert r["hier_plan"][0] is False and "every island holds one rank" in r["hier_plan"][1]
        assert r["plan"][0] is True and any("mode 'selective' keeps two levels" in n for n in r["plan"][1])
        assert r["sizes"] == (1, 8) and r["mode"] == "selective"
        assert r["differ_between"] and r["same_after"]
        assert r["bytes"]["inter"]["sync"] > 0 and r["bytes"]["inter"]["reconcile"] > 0
        assert not r["bytes"]["inter"].get("local") and not r["bytes"]["intra"].get("local")


@pytest.mark.timeout(300)
def test_auto_sync_from_the_group_count(world8):
    """Issue 31: with `auto`, 8, 4 and 2 groups run every tensor SYNC on the int8 wire (nothing LOCAL,
    nothing reconciled, replicas identical on every rank after each step); the user's config object
    is not changed; position 0 logs what `auto` became."""
    for rank, res in enumerate(world8):
        a = res["auto"]
        for name, groups in (("8x1", 8), ("4x2", 4), ("2x4", 2)):
            r = a[name]
            assert (r["groups"], r["dtype"], r["top"], r["local"], r["reconcile_bytes"]) == (
                groups, "torch.int8", 1.0, 0, 0), (rank, name, r)
            assert r["same"] and r["user"] == ("auto", "auto")
        # the `auto` bucket: DDP's 25 MiB up to 6 groups, 4 MiB per group beyond (the reducer's buckets)
        assert [a[n]["bucket"] for n in ("8x1", "4x2", "2x4")] == [(32.0, 32.0), (25.0, 25.0), (25.0, 25.0)]
        bucket_note = "communication.bucket_size_mb auto -> 32 MiB at 8 groups"
        assert any(bucket_note in m for m in a["8x1"]["notes"]) == (rank == 0)
        want = {"8x1": "sync.dtype auto -> int8, sync.top_fraction auto -> 1.0 at 8 groups",
                "4x2": "sync.dtype auto -> int8, sync.top_fraction auto -> 1.0 at 4 groups",
                "2x4": "sync.dtype auto -> int8, sync.top_fraction auto -> 1.0 at 2 groups"}
        for name, text in want.items():
            notes = a[name]["notes"]
            assert (len(notes) == 1 and text in notes[0]) if rank == 0 else not notes, (rank, name, notes)


@pytest.mark.timeout(300)
def test_unequal_8_refused(world8):
    want = None
    try:
        plan_groups(gather_hostnames_topology(UNEQUAL))
    except PlanError as exc:
        want = str(exc)
    assert want and "1 x 4, 2 x 2" in want
    assert all(res["unequal"] == want for res in world8)


@pytest.mark.timeout(300)
def test_three_level_reduction_exact_and_bytes_per_tier(world8):
    """middle_level: island RS -> leaf-rail RS -> spine AR -> leaf-rail AG -> island AG, equal to a
    flat all-reduce (<= 1e-6), and the spine carries 1/M of the two-level rail payload."""
    results = [res["leaf3"] for res in world8]
    for c in results:
        assert c["three_level"] and (c["intra_size"], c["leaf_rail_size"], c["spine_rail_size"]) == (2, 2, 2)
    assert_collectives(results)
    n, L, M = 4000, 2, 2
    for c in results:
        # payload bytes per rank: island RS + AG of n, leaf RS + AG of n/L, spine all-reduce of n/(L*M)
        assert c["bytes"] == {"intra": 2 * 4 * n, "leaf": 2 * 4 * n // L, "inter": 4 * n // (L * M)}
        assert c["sel_all_same_after_reconcile"]
        assert c["sel_bytes"]["leaf"]["sync"] > 0 and c["sel_bytes"]["inter"]["reconcile"] > 0


@pytest.mark.timeout(300)
def test_bf16_sync_at_8_islands_rounds_once(world8):
    """At 8 islands the bf16 SYNC hop is within the single-rounding bound of the exact mean, on every
    element, bitwise the same on every rank; the bf16 all-reduce it replaced is not (its partial sums
    round at every hop), so the check can fail."""
    world = len(world8)
    xs = [torch.randn(ISLANDS8_N, generator=torch.Generator().manual_seed(31_000 + r))
          * torch.logspace(-3, 0, ISLANDS8_N) for r in range(world)]
    exact, bound = single_rounding_bound(xs)
    for res in world8:
        r = res["islands8"]
        assert (r["L"], r["K"]) == (1, 8) and r["same"]
        assert torch.equal(r["y"], world8[0]["islands8"]["y"])
        over = (r["y"].double() - exact).abs() > bound
        assert not bool(over.any()), f"{int(over.sum())} elements beyond one rounding per sender and of the sum"
        old_over = int(((r["old"].double() - exact).abs() > bound).sum())
        assert old_over > 0, "the bf16 all-reduce met the bound too: the data does not test the sum's rounding"
