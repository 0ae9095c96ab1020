"""`method: auto` (issue 38; docs/costmodel.md, section 6): the chooser's decisions at three link
speeds for one workload, its log line word for word, the config's refusals, `topo-align simulate`'s
choice, and on 4 gloo ranks (2 nodes x 2, the suite's shared world, tests/_world4.py) every rank
taking DP position 0's choice at the same step boundary, the switch to a LOCAL class and back
losing nothing (SYNC parameters bitwise equal on every rank at every step, every parameter equal
after leaving the LOCAL class), a re-choice, and a resume that keeps the method.
"""

from __future__ import annotations

import json
import logging
import os

import _world4
import pytest
import torch

from topo_integrations.config import ConfigError, TopoAlignConfig
from topo_integrations.sim import SimError, SimOptions
from topo_integrations.sim.choose import H_CAP, MethodInputs, choose_for_groups, stream_fragments

pytestmark = pytest.mark.timeout(60)

GBIT = 1e9 / 8 / 1e9  # GB/s per Gbit/s


def _inputs(gbit: float, **kw) -> MethodInputs:
    """The fixed workload: 4 islands of 8 GPUs (NVLink 230 GB/s), a 7B model's bf16 gradient, 10 s of
    compute per step, the last-N share 10 %, no drift-promotion budget."""
    base = dict(n_groups=4, group_size=8, slow_gbps=gbit * GBIT, slow_latency_us=7.0, slow_origin="leaf, file",
                grad_elements=7e9, grad_dtype="bf16", compute_s=10.0, compute_from="given",
                options=SimOptions(last_n_share=0.1, promote_fraction=0.0))
    base.update(kw)
    return MethodInputs(**base)


def test_fast_link_takes_hierarchical_middle_int8_slow_a_local_class():
    fast, middle, slow = (choose_for_groups(_inputs(g)) for g in (100.0, 2.0, 0.2))
    assert fast.method == "hierarchical" and fast.config == {"mode": "selective", "sync.dtype": "fp32",
                                                             "sync.top_fraction": 1.0}
    assert fast.step_s["hierarchical"] <= 10.0 * 1.02
    assert middle.method == "int8" and middle.config["sync.dtype"] == "int8"
    assert middle.step_s["hierarchical"] > 10.0 * 1.02 and middle.step_s["int8"] < middle.step_s["hierarchical"]
    assert slow.method == "local" and slow.config == {
        "mode": "selective", "sync.dtype": "int8", "sync.top_fraction": 0.05, "sync.last_n_layers": 1,
        "local.promote_drift_fraction": 0.0, "local.reconcile_interval": slow.reconcile_interval,
        "local.stream_fragments": stream_fragments(slow.reconcile_interval)}
    assert 1 <= slow.reconcile_interval <= H_CAP
    assert slow.time_s("local") < slow.time_s("int8")
    for c in (fast, middle, slow):
        assert set(c.step_s) == set(c.steps_factor) == {"hierarchical", "int8", "local"}
        assert c.steps_factor["hierarchical"] == 1.0 and c.steps_factor["local"] >= c.steps_factor["int8"] >= 1.0
        assert c.runner_up != c.method and c.time_s(c.runner_up) == min(c.time_s(k) for k in c.step_s
                                                                          if k != c.method)


def test_the_log_line_names_the_choice_the_figures_and_the_runner_up():
    c = choose_for_groups(_inputs(2.0))
    s, f = c.step_s, c.steps_factor
    assert c.line() == (
        f"topo_align: method auto: int8 (sync.dtype int8, sync.top_fraction 1): predicted step {s['int8']:.4g} s "
        f"against 10 s of compute, {f['int8']:.3g} x flat's steps to flat quality; runner-up {c.runner_up} "
        f"({s[c.runner_up]:.4g} s x {f[c.runner_up]:.3g}); predicted step x steps: "
        f"hierarchical {s['hierarchical']:.4g} s x 1; int8 {s['int8']:.4g} s x {f['int8']:.3g}; "
        f"local {s['local']:.4g} s x {f['local']:.3g} (H {c.reconcile_interval}); figures: 4 groups of 8 ranks; "
        "slow tier 0.25 GB/s per GPU (leaf, file), 7 us; gradient 14 GB per GPU (7e+09 x bf16); compute 10 s per "
        "step (given)")
    assert json.loads(json.dumps(c.to_json()))["line"] == c.line()


def test_the_quality_a_local_class_costs_grows_with_the_islands():
    """The bench's 2 x 2 figures at 100 Mbit/s (round 3's measured slow tier, 0.84M fp32 gradient
    elements, 0.102 s of compute, the lean class's fixed share 8 %): at 2 islands the LOCAL class's
    shorter step pays its 1.4 x steps to flat quality; at 4 islands, on the same links, its 1.9 x does not."""
    opt = SimOptions(last_n_share=0.4, promote_fraction=0.15)
    lean = SimOptions(last_n_layers=1, last_n_share=0.08, promote_fraction=0.0)

    def at(groups: int):
        return choose_for_groups(MethodInputs(groups, 2, 0.006174, 220.3, "leaf, measured", 8.37e5, "fp32", 0.1018,
                                              "timed", options=opt, local_options=lean, codec_s=0.0031))
    two, four = at(2), at(4)
    assert two.method == "local" and two.reconcile_interval == 16 and two.runner_up == "int8"
    assert two.step_s["local"] < two.step_s["int8"] and two.time_s("local") < two.time_s("int8") / 1.01
    assert four.method == "int8" and four.runner_up == "local"
    assert four.step_s["local"] < four.step_s["int8"] < four.time_s("local")
    assert four.steps_factor["local"] > two.steps_factor["local"] > 1.0 == two.steps_factor["int8"]


def test_the_int8_wires_own_work_is_priced():
    """The int8 wire's quantisation, timed by the engine (on a CPU rank it runs on the cores the compute
    runs on), is added to that candidate's step: where the link hides the int8 wire's bytes but not
    its codec, the exact method is as fast and wins (rule 1's tie)."""
    plain, priced = choose_for_groups(_inputs(5.0)), choose_for_groups(_inputs(5.0, codec_s=2.5))
    assert plain.method == "int8" and plain.step_s["hierarchical"] > plain.step_s["int8"] * 1.01
    assert priced.step_s["int8"] == pytest.approx(plain.step_s["int8"] + 2.5)
    assert priced.step_s["hierarchical"] == plain.step_s["hierarchical"]
    assert priced.step_s["local"] == plain.step_s["local"] and priced.steps_factor == plain.steps_factor
    assert priced.method == "hierarchical"
    assert priced.line().endswith("compute 10 s per step (given); int8 codec 2.5 s per step (timed)")
    assert not plain.line().endswith("(timed)")  # nothing timed: no codec figure
    with pytest.raises(SimError, match=r"^method auto: codec_s = -1\.0; expected a number >= 0$"):
        choose_for_groups(_inputs(5.0, codec_s=-1.0))


def test_the_codec_is_timed_on_the_device_without_the_random_stream():
    from topo_integrations.reducer.adaptive.method import int8_codec_seconds

    state = torch.random.get_rng_state()
    t = int8_codec_seconds(100_000, torch.device("cpu"))
    assert 0 < t < 5 and torch.equal(torch.random.get_rng_state(), state)


def test_local_class_keys_mean_a_local_class_and_h_is_capped():
    c = choose_for_groups(_inputs(100.0, local_only=True))
    assert c.method == "local" and set(c.step_s) == {"local"} and c.runner_up is None
    capped = choose_for_groups(_inputs(0.01))  # 10 Mbit/s per GPU: no H up to the cap hides the reconciliation
    assert capped.method == "local" and capped.h_capped
    assert capped.reconcile_interval == H_CAP and f"(H capped at {H_CAP})" in capped.line()


def test_the_local_candidate_streams_from_h_64_and_keeps_a_users_fragments():
    from types import SimpleNamespace

    from topo_integrations.reducer.adaptive.method import MethodAuto, applied_keys
    from topo_integrations.sim.choose import STREAM_FROM_H, method_config

    assert STREAM_FROM_H == H_CAP == 64
    assert [method_config("local", h)["local.stream_fragments"] for h in (1, 16, 32, 64)] == [1, 1, 1, 4]
    assert choose_for_groups(_inputs(0.01)).config["local.stream_fragments"] == 4
    assert "local.stream_fragments" not in method_config("int8")
    # a value the user set is not overridden when the choice is applied
    engine = SimpleNamespace(cfg=SimpleNamespace(explicit_keys=lambda: ["local.stream_fragments", "mode"]))
    user = MethodAuto(engine).local_only
    assert user == ["local.stream_fragments"]
    assert applied_keys("local", 64, user) == {"sync.dtype": "int8", "sync.top_fraction": 0.05,
                                               "sync.last_n_layers": 1, "local.promote_drift_fraction": 0.0,
                                               "local.reconcile_interval": 64}
    assert applied_keys("local", 64, [])["local.stream_fragments"] == 4


@pytest.mark.parametrize("block, words", [
    ({"method": "auto", "mode": "hierarchical"},
     "topo_align: method = 'auto' chooses among settings of mode 'selective' (its exact candidate is every tensor "
     "SYNC on an fp32 wire, which equals 'hierarchical'); mode = 'hierarchical' is set too: remove it, or set "
     "method 'fixed' to keep it"),
    ({"method": "auto", "sync": {"dtype": "bf16"}, "local": {"reconcile_interval": 8}},
     "topo_align: method = 'auto' chooses sync.dtype, sync.top_fraction and local.reconcile_interval itself "
     "(docs/costmodel.md, section 6); sync.dtype = 'bf16', local.reconcile_interval = 8 set too: remove them, or "
     "set method 'fixed' to keep them"),
    ({"method": "sometimes"}, "topo_align.method: got 'sometimes'; Input should be 'fixed' or 'auto'"),
])
def test_config_refuses_what_auto_would_override(block, words):
    with pytest.raises(ConfigError) as exc:
        TopoAlignConfig.from_block(block)
    assert str(exc.value) == words


def test_config_accepts_auto_with_its_own_values_and_every_adapter_takes_it():
    cfg = TopoAlignConfig.from_block({"method": "auto", "sync": {"dtype": "auto"}, "local": {"dtype": "fp16"}})
    assert cfg.method == "auto" and cfg.local.dtype == "fp16"
    from topo_integrations.deepspeed.support import UnsupportedConfigError, check_supported
    from topo_integrations.fsdp.refusals import check_config as fsdp_check
    from topo_integrations.megatron.refusals import MegatronSide, check_config
    from topo_integrations.torch.reducer import check_config as torch_check

    auto = TopoAlignConfig.from_block({"method": "auto"})
    for stage in (0, 1, 2):
        check_supported({"zero_optimization": {"stage": stage}, "train_batch_size": 8}, auto)
    for dist_opt in (False, True):
        check_config(auto, MegatronSide(use_distributed_optimizer=dist_opt, overlap_grad_reduce=True))
    fsdp_check(auto)
    for who in ("GroupedReducer", "TopoAlignHookState"):
        torch_check(cfg, None, who)
    # ZeRO-3 partitions parameters over the whole DP group: no candidate of `auto` but the exact one
    with pytest.raises(UnsupportedConfigError) as exc:
        check_supported({"zero_optimization": {"stage": 3}, "train_batch_size": 8}, auto)
    assert str(exc.value) == (
        "topo_align.mode = 'selective' with zero_optimization.stage = 3: selective at ZeRO-3 (parameters are "
        "partitioned over the whole data-parallel group, so island replicas cannot drift and be reconciled) is "
        "not supported; use mode 'hierarchical' with ZeRO-3, or ZeRO stage 1 or 2 for 'selective' (method 'auto' "
        "chooses among settings of mode 'selective': remove it at ZeRO-3)")


class _DeviceClock:
    """Stands in for CUDA timing events (no GPU here): an event records the fake device clock; this
    isolates MethodAuto's CUDA arithmetic (tests/test_reducer_cuda.py runs the real one on a GPU)."""

    def __init__(self):
        self.t = 0.0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = clock.t

            def elapsed_time(self, end):  # milliseconds, as CUDA's
                assert self.at is not None and end.at is not None
                return (end.at - self.at) * 1e3

            def synchronize(self):
                clock.synced += 1

        self.Event, self.synced = Event, 0


@pytest.mark.timeout(30)
def test_on_cuda_the_compute_is_timed_on_the_device_less_the_streams_waits(monkeypatch):
    """On CUDA the host does not block on a bucket (the stream waits), so the host clock would time
    the enqueueing: each timed step is the time between events on the training stream, less that
    stream's waits for the communication stream (event pairs the dispatcher records) and the host's
    blocking waits; one host wait, when the steps are timed; none after."""
    from types import SimpleNamespace

    from topo_integrations.reducer.adaptive.method import TIMED_STEPS, MethodAuto
    from topo_integrations.reducer.schedule.dispatch import Dispatcher

    dev = _DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", dev.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    d = SimpleNamespace(cuda=True, device=None, device_waits=None, waited_s=0.0)
    engine = SimpleNamespace(dispatcher=d, step=0, cfg=SimpleNamespace(explicit_keys=lambda: []))
    m = MethodAuto(engine)
    chosen = []
    monkeypatch.setattr(m, "_choose",
                        lambda compute_from, scale, why="": chosen.append((compute_from, list(m.samples))))
    for step in range(1, 8):
        engine.step = step
        dev.t += 0.1 * step  # compute (step-dependent, so a misassigned interval shows)
        start = Dispatcher._stream_mark(d)  # the training stream waits 0.05 s for a bucket
        dev.t += 0.05
        Dispatcher._stream_waited(d, start)
        d.waited_s += 0.01  # and the host blocks on a control value
        dev.t += 0.01
        m.after_step()
        if chosen:
            m.method = "int8"  # what _choose would set
    assert chosen == [(f"timed over steps 2-{TIMED_STEPS + 1}, on the device",
                       pytest.approx([0.1 * s for s in range(2, TIMED_STEPS + 2)]))]
    assert dev.synced == 1 and d.device_waits is None  # one host wait; nothing recorded after
    assert Dispatcher._stream_mark(d) is None


def test_simulate_prints_the_choice(capsys):
    from topo_integrations.sim.cli import main

    topo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "topologies",
                        "dgx-a100-superpod-960.json")
    assert main(["--topology", topo, "--params", "175e9", "--tp", "8", "--pp", "8", "--num-layers", "96",
                 "--algorithms", "hier2-b2b,selective", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mc = out["method_choice"]
    assert mc["method"] in ("hierarchical", "int8", "local") and mc["runner_up"] in mc["step_s"]
    assert mc["line"].startswith(f"topo_align: method auto: {mc['method']} (")
    assert "figures: 15 groups of 1 rank; slow tier 24 GB/s per GPU (leaf, file), 7 us" in mc["line"]
    assert main(["--topology", topo, "--params", "175e9", "--tp", "8", "--pp", "8", "--num-layers", "96",
                 "--algorithms", "hier2-b2b"]) == 0
    assert f"method auto: {mc['method']} (" in capsys.readouterr().out


# -- on 4 gloo ranks ------------------------------------------------------------------------------


def _rank_main(rank: int, world: int) -> dict:
    import torch.nn as nn
    from _forced_choice import forced_method_choices

    from topo_integrations import GroupedReducer
    from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("topo_align: method auto"):
                lines.append(record.getMessage())

    lg = logging.getLogger("topo_align")
    lg.addHandler(Keep())
    lg.setLevel(logging.INFO)

    def Net():  # 9 layers (the outer Sequential's children): the last 5 SYNC, the rest a LOCAL class
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)), nn.Linear(16, 4))

    def run(red, model, opt, steps: int, first: int, record: list) -> None:
        for step in range(first, first + steps):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).pow(2).mean().backward()
            red.finish_grad_sync()
            opt.step()
            opt.zero_grad()
            red.after_optimizer_step(opt)
            e = red.engine
            record.append({"method": e.method.method, "H": e.reconciler.interval, "dtype": str(e.sync_dtype),
                           "sync_params": {n: p.detach().clone() for n, p in red._params.items() if e.is_sync(n)},
                           "synced": e.reconciler.all_synced})

    out: dict = {}
    # 1. The real chooser (DP position 0 decides on its timed steps); every rank takes its choice.
    torch.manual_seed(0)
    model = Net()
    red = GroupedReducer(model, TopoAlignConfig.from_block({"method": "auto"}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec: list = []
    run(red, model, opt, 7, 0, rec)
    out["real"] = [(r["method"], r["dtype"]) for r in rec]
    out["real_events"] = [(e["step"], e["method"], e["reconcile_interval"]) for e in red.engine.method.events]
    out["real_line"] = red.engine.method.events[0]["line"]
    out["stats_line"] = red.engine.stats()["method_line"]
    red.close()

    # 2. A LOCAL class (H 2) from DP position 0's (forced) choice, then back to the exact method by a
    #    re-choice: the other ranks never run the chooser, they take the broadcast.
    with forced_method_choices(("local", 2), ("hierarchical", None)):
        _forced(out, run, Net, rank)
        out["lines"] = list(lines)
        # 4. The same switch through FSDP2 (shards: the classes rank on magnitudes agreed over the DP
        #    group) and through DDP's comm hook.
        out["fsdp2"] = _adapter_switch(rank, "fsdp2")
        out["ddp_hook"] = _adapter_switch(rank, "ddp_hook")
    return out


def _forced(out: dict, run, Net, rank: int) -> None:
    from _forced_choice import rechoose

    from topo_integrations import GroupedReducer

    torch.manual_seed(0)
    model = Net()
    red = GroupedReducer(model, TopoAlignConfig.from_block({"method": "auto", "adaptive": {"enabled": True,
                                                                                           "check_interval": 100}}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec: list = []
    run(red, model, opt, 8, 0, rec)
    out["classes_local"] = sorted(red.engine.classes.items())
    out["sync_fraction"] = red.engine.sync_fraction()
    d = red.engine.policy.drift
    out["promotion"] = (d.promote_fraction, list(d.promoted), red.engine.cfg.local.promote_drift_fraction)
    sd = red.engine.state_dict()
    opt_sd = opt.state_dict()
    rechoose(red.engine)
    out["after_rechoose"] = (red.engine.method.method, str(red.engine.sync_dtype), red.engine.sync_fraction(),
                             red.engine.reconciler.all_synced)
    out["after_rechoose_params"] = {n: p.detach().clone() for n, p in red._params.items()}
    run(red, model, opt, 2, 8, rec)
    out["forced"] = [(r["method"], r["H"], r["dtype"], r["synced"]) for r in rec]
    out["forced_sync_params"] = [r["sync_params"] for r in rec]
    out["forced_events"] = [(e["step"], e["method"], e["reconcile_interval"], e["changed"])
                            for e in red.engine.method.events]
    out["adaptive_events"] = [ev["to"] for ev in red.engine.adaptive.events]
    red.close()

    # 3. A resume from the LOCAL-class state keeps the method without timing again.
    torch.manual_seed(0)
    model = Net()
    red = GroupedReducer(model, TopoAlignConfig.from_block({"method": "auto", "adaptive": {"enabled": True,
                                                                                           "check_interval": 100}}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(opt_sd)
    red.engine.load_state_dict(sd)
    out["resumed"] = (red.engine.method.method, red.engine.reconciler.interval, str(red.engine.sync_dtype),
                      sorted(red.engine.classes.items()) == out["classes_local"])
    red.close()


def _adapter_switch(rank: int, adapter: str) -> list:
    """10 steps through ``adapter`` with the forced choices (LOCAL class with H 2 at step 5, the exact
    method again from step 8): per step the method, H, the SYNC wire, the number of LOCAL tensors,
    whether SYNC parameters (FSDP2: shards, against the rail partner) are bitwise equal on every rank
    and whether every parameter is; before step 8 (right after the re-choice) whether every parameter
    is equal."""
    import test_fsdp as F
    import torch.distributed as dist
    from _forced_choice import RECHOICE_STEP, STEPS, auto_block, rechoose

    cfg = TopoAlignConfig.from_block(auto_block(topology={"source": "hostnames"}))
    if adapter == "fsdp2":
        from topo_integrations.fsdp import apply, island_groups, island_mesh

        groups = island_groups(F.cfg_of("hierarchical"))
        model = F.build(island_mesh(groups)["shard"])
        ta = apply(model, groups, cfg)
        names = [n for n, _ in model.named_parameters()]

        def values():  # per parameter, this rank's shard's fingerprint; peers: my rail partner's shard
            return F._fingerprints(model)

        def loss(s):
            return F.loss_of(model, s, rank)
        peers = [(rank + 2) % 4]
    else:
        import test_ddp_hook as T
        from torch.nn.parallel import DistributedDataParallel as DDP

        from topo_integrations.torch import TopoAlignHookState, topo_align_hook

        model = DDP(T.make(), bucket_cap_mb=T.BUCKET_CAP_MB)
        ta = TopoAlignHookState(model, cfg)
        model.register_comm_hook(ta, topo_align_hook)
        names = [n for n, _ in model.module.named_parameters()]

        def values():
            return F._fingerprints(model.module)

        def loss(s):
            return T.loss_of(model, s, rank)
        peers = range(4)

    def equal() -> list[bool]:
        v = values()
        every = [torch.empty_like(v) for _ in range(4)]
        dist.all_gather(every, v)
        return [all(torch.equal(v[i], every[p][i]) for p in peers) for i in range(len(names))]

    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    rec: list = []
    for s in range(STEPS):
        if s == RECHOICE_STEP:
            rechoose(ta.engine)
            rec.append(("after re-choice", all(equal())))
        opt.zero_grad(set_to_none=True)
        loss(s).backward()
        opt.step()
        ta.after_optimizer_step(opt)
        e, same = ta.engine, equal()
        rec.append((e.method.method, e.reconciler.interval, str(e.sync_dtype),
                    sum(not e.is_sync(n) for n in names),
                    all(ok for n, ok in zip(names, same) if e.is_sync(n)), all(same)))
    ta.close()
    return rec


@pytest.fixture(scope="module")
def world(request):
    return _world4.results(request, "test_method_auto")  # _rank_main, in the suite's shared 4-rank world


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_every_rank_takes_position_0s_choice_at_the_same_step(world):
    real = world[0]["real"]
    assert all(r["real"] == real for r in world)
    assert [m for m, _ in real[:4]] == [None] * 4 and real[4][0] in ("hierarchical", "int8", "local")
    assert all(r["real_events"] == world[0]["real_events"] for r in world) and world[0]["real_events"][0][0] == 5
    line = world[0]["real_line"]
    assert line.startswith(f"topo_align: method auto: {real[4][0]} (") and "compute" in line
    assert "figures: 2 groups of 2 ranks; slow tier " in line
    assert "(timed over steps 2-5); int8 codec " in line and line.endswith(" s per step (timed)")
    assert all(r["real_line"] is None for r in world[1:])  # only position 0 chose, and logged
    assert world[0]["stats_line"] == line and all(r["stats_line"] is None for r in world[1:])
    assert world[0]["lines"][0] == line and not any(r["lines"] for r in world[1:])


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_the_switch_to_a_local_class_and_back_loses_nothing(world):
    forced = world[0]["forced"]
    assert all(r["forced"] == forced for r in world)
    assert [f[:3] for f in forced[:5]] == [(None, 2, "torch.int8")] * 4 + [("local", 2, "torch.int8")]
    assert forced[8][:3] == ("hierarchical", 2, "torch.float32")
    assert all(r["classes_local"] == world[0]["classes_local"] for r in world)
    assert 0 < world[0]["sync_fraction"] < 1
    # the candidate's local.promote_drift_fraction 0 is the drift monitor's budget (no promotion)
    assert all(r["promotion"] == (0.0, [], 0.0) for r in world)
    # SYNC parameters bitwise equal on every rank at every step (invariant 1)
    for step, ref in enumerate(world[0]["forced_sync_params"]):
        for r in world[1:]:
            got = r["forced_sync_params"][step]
            assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref), step
    # leaving the LOCAL class reconciled first: every parameter equal everywhere, every tensor SYNC
    assert world[0]["after_rechoose"] == ("hierarchical", "torch.float32", 1.0, True)
    ref = world[0]["after_rechoose_params"]
    for r in world[1:]:
        assert all(torch.equal(r["after_rechoose_params"][n], ref[n]) for n in ref)
    assert world[0]["forced_events"] == [(5, "local", 2, True), (8, "hierarchical", None, True)]
    assert world[0]["adaptive_events"] == ["local", "hierarchical"]  # the controller renewed at each switch
    rechosen = [x for x in world[0]["lines"] if "re-chosen at step 8" in x]
    assert len(rechosen) == 1 and rechosen[0].endswith(
        "(re-chosen at step 8: the adaptive monitor measured the slow tier at 1 GB/s against its reference "
        "4 GB/s, x0.25)")


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("adapter", ["fsdp2", "ddp_hook"])
def test_fsdp2_and_the_ddp_hook_switch_and_lose_nothing(world, adapter):
    rec = world[0][adapter]
    assert all(r[adapter] == rec for r in world)  # every rank took the same method at the same step
    assert [x[:3] for x in rec[:4]] == [(None, 2, "torch.int8")] * 4
    assert [x[:3] for x in rec[4:8]] == [("local", 2, "torch.int8")] * 4
    assert rec[8] == ("after re-choice", True)  # leaving the LOCAL class reconciled first
    assert [x[:3] for x in rec[9:]] == [("hierarchical", 2, "torch.float32")] * 2
    steps = [x for x in rec if x[0] != "after re-choice"]
    assert all(x[4] for x in steps)  # invariant 1: SYNC parameters equal on every rank, every step
    assert all(x[3] > 0 for x in steps[4:8]) and all(x[3] == 0 for x in steps[:4] + steps[8:])
    assert not all(x[5] for x in steps[4:8])  # positive control: the LOCAL class did drift apart


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_a_resume_keeps_the_method(world):
    for r in world:
        assert r["resumed"] == ("local", 2, "torch.int8", True)
