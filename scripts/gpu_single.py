"""Rank-side cases of scripts/gpu_check.py that one GPU (or two) can run on NCCL.

* ``single`` (world 1): ``streams`` -- the schedule's communication stream, with device work made
  slow on purpose (``torch.cuda._sleep``): the stream starts after the producer's work, the caller's
  stream waits for it through the CUDA-aware future, and the host never waits; then every adapter at
  world 1 (``grouped-reducer``, ``ddp-hook``, ``deepspeed``, ``megatron``): one tier, so the adapter
  runs its flat path (GroupedReducer, the DDP hook: the engine and its event completion) or hands the
  reduction back to the framework (DeepSpeed, Megatron, as documented), and the parameters after a
  few steps are bitwise those of the plain framework run beside it.
* ``abort`` (world 1): a collective stuck behind device work past ``fallback.timeout_s``: the watch
  names it, aborts the NCCL communicators, and the next call fails at once.
* ``engine`` (world 2, two GPUs): tests/test_reducer_cuda.py's NCCL rank functions -- the engine equal
  to NCCL's own all-reduce with device timings, and a peer that never calls.
"""

from __future__ import annotations

import copy
import time

STEPS = 4


def _verdict(ok: bool, detail: str, data: dict | None = None) -> tuple[str, str, dict]:
    return ("PASS" if ok else "FAIL"), detail, data or {}


def sleep_cycles(dev, seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for at least ``seconds`` (at the peak clock)."""
    import torch

    khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) or 2_000_000
    return int(seconds * khz * 1000)


def _flat_engine(dev, timeout_s: float):
    """An engine of one tensor over this world's groups (world 1 or 2: mode flat), and its groups."""
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.reducer.engine import Engine, EngineTensors
    from topo_integrations.reducer.plan.discover import discover_plan
    from topo_integrations.reducer.plan.groups import build_groups

    cfg = TopoAlignConfig.model_validate({"mode": "flat", "topology": {"source": "hostnames"},
                                          "fallback": {"timeout_s": timeout_s}})
    groups = build_groups(discover_plan(cfg), timeout_s=timeout_s)
    return Engine(cfg, groups, EngineTensors(["a"], [1024], layers={"a": None}), device=dev), groups


# -- the schedule's stream (world 1) --------------------------------------------------------------------------

def _streams(rank: int, dev):
    import torch

    from topo_integrations.reducer.kinds import Traffic

    engine, _ = _flat_engine(dev, 60.0)
    sched = engine.dispatcher.sched
    cyc = sleep_cycles(dev, 0.5)
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(cyc)  # the producer (this stream) is busy ...
    x.fill_(1.0)  # ... and writes x after it

    def job():  # runs on the communication stream
        torch.cuda._sleep(cyc)
        x.mul_(2.0).add_(1.0)  # 3 if it ran after the producer's fill; 1 if it did not wait for it
        return x

    t0 = time.perf_counter()
    item = sched.item("gpu-check stream probe", Traffic.SYNC, job)
    sched.release([item])
    sched.wait(item, host=False)
    got = item.future.wait().clone()  # the caller's stream waits for the communication stream, the host not
    host_s = time.perf_counter() - t0
    busy = not torch.cuda.current_stream(dev).query()
    torch.cuda.synchronize(dev)
    value = float(got[0])
    device_ms = item.events[0].elapsed_time(item.events[1])
    engine.close()
    ok = bool((got == 3.0).all()) and busy and sched.kind == "event"
    return _verdict(ok, f"value {value:g} (3: the communication stream ran after the producer and the caller "
                        f"read after it); host returned in {host_s * 1000:.0f} ms with the device still busy "
                        f"({busy}); item {device_ms:.0f} ms on the communication stream; completion {sched.kind!r}",
                    {"host_ms": host_s * 1000, "device_ms": device_ms})


# -- every adapter at world 1 --------------------------------------------------------------------------------

def shipped_config():
    """The shipped `topo_align` block (every tensor SYNC on the int8 wire where there are two tiers)."""
    from topo_integrations.config import TopoAlignConfig

    return TopoAlignConfig.model_validate({"mode": "selective", "topology": {"source": "hostnames"}})


def _same(a, b) -> bool:
    import torch

    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _side_by_side(model, ref, rank: int, dev, *, finish, after) -> bool:
    """``STEPS`` Adam steps of ``model`` (with the adapter's ``finish()`` before and ``after(opt)`` after
    the optimizer step) and of ``ref`` (the plain framework) on the same batches: bitwise equal?"""
    import torch

    import test_reducer_modes as modes_t

    runs = [(model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True), True),
            (ref, torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True), False)]
    for s in range(STEPS):
        x, y = (t.to(dev) for t in modes_t.batch(s, rank))
        for m, opt, adapted in runs:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(x).reshape(-1, 16), y.reshape(-1)).backward()
            if adapted:
                finish()
            opt.step()
            if adapted:
                after(opt)
    return _same(model, ref)


def _grouped_reducer(rank: int, dev):
    from topo_integrations.torch import GroupedReducer

    import test_reducer_modes as modes_t

    model = modes_t.make(1).to(dev)
    ref = copy.deepcopy(model)  # before the reducer hooks the model
    red = GroupedReducer(model, shipped_config())
    same = _side_by_side(model, ref, rank, dev, finish=red.finish_grad_sync, after=red.after_optimizer_step)
    kind, reason = red.engine.dispatcher.sched.kind, red.fallback_reason
    red.close()
    return _verdict(same and kind == "event" and reason is not None,
                    f"{STEPS} Adam steps bitwise equal to the model without the reducer: {same}; completion "
                    f"{kind!r}; one tier: {reason}")


def _ddp_hook(rank: int, dev):
    import test_ddp_hook as hook_t
    from torch.nn.parallel import DistributedDataParallel as DDP

    from topo_integrations.torch import TopoAlignHookState, topo_align_hook

    base = hook_t.make().to(dev)
    twin = copy.deepcopy(base)  # before DDP hooks the parameters
    model, ref = (DDP(m, device_ids=[dev.index], bucket_cap_mb=hook_t.BUCKET_CAP_MB) for m in (base, twin))
    state = TopoAlignHookState(model, shipped_config())
    model.register_comm_hook(state, topo_align_hook)
    same = _side_by_side(model, ref, rank, dev, finish=lambda: None, after=state.after_optimizer_step)
    calls, kind = state.buckets_reduced, state.engine.dispatcher.sched.kind
    state.close()
    return _verdict(same and calls > 0 and kind == "event",
                    f"{STEPS} Adam steps bitwise equal to DDP without the hook: {same}; {calls} buckets through "
                    f"the hook; completion {kind!r}; one tier: {state.fallback_reason}")


def _deepspeed(rank: int, dev):
    import deepspeed.utils.groups as dg

    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H

    def engine(cfg):
        model = H.Net()
        return tds.initialize(model=model, optimizer=H.make_optimizer("adamw", model.parameters()), config=cfg)[0]

    out = []
    for stage in range(4):
        try:
            stock = engine(H.ds_config(stage))
            H.train(stock, STEPS)
            top = engine(H.ds_config(stage, topo=H.topo_block("hierarchical")))
            H.train(top, STEPS)
            out.append((stage, bool((H.flat_params(top) == H.flat_params(stock)).all()), hasattr(top, "topo_align")))
        finally:
            dg.mpu = None
    ok = all(same and not attached for _, same, attached in out)
    return _verdict(ok, "ZeRO " + ", ".join(f"{s}: equal {same}, handed back {not att}" for s, same, att in out)
                    + f" (one tier at world 1: DeepSpeed reduces; {STEPS} AdamW steps on CUDA, NCCL)")


def _megatron(rank: int, dev):
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron import testing as mt

    spec = mt.TinyGPT()
    mt.init_parallel(1)
    out = []
    for dist_opt in (False, True):
        pair = []
        for topo in (None, TopoAlignConfig.model_validate({"mode": "hierarchical"})):
            ddp = mt.wrap_ddp(*mt.build_gpt(spec), topo=topo, use_distributed_optimizer=dist_opt)
            opt = mt.make_optimizer(ddp)
            for s in range(STEPS):
                mt.run_iteration(ddp, spec, rank, s, opt)
            pair.append(ddp)
        out.append((dist_opt, _same(*pair), pair[1].topo_active, pair[1].topo_reason))
    ok = all(same and not active for _, same, active, _ in out)
    return _verdict(ok, "; ".join(f"{'distopt' if d else 'ddp'}: equal to stock {same}, active {a} ({why})"
                                  for d, same, a, why in out) + f" ({STEPS} iterations)")


# -- the abort path (world 1) ----------------------------------------------------------------------------------

def _abort(rank: int, dev):
    import torch
    import torch.distributed as dist

    from topo_integrations.reducer.kinds import Traffic
    from topo_integrations.reducer.watch.errors import CollectiveError
    from topo_integrations.reducer.wire.collectives import run

    timeout = 2.0
    engine, g = _flat_engine(dev, timeout)
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t, group=g.dp_group)  # the communicator exists before the clock starts
    torch.cuda.synchronize(dev)
    aborted: list[str] = []
    c10d = dist.distributed_c10d
    real = c10d._abort_process_group

    def spy(pg=None):
        aborted.append(str(pg))
        return real(pg)

    c10d._abort_process_group = spy  # the schedule looks it up when it aborts

    def stuck():  # the communication stream is busy past the timeout: the all-reduce after it cannot land
        torch.cuda._sleep(sleep_cycles(dev, 4 * timeout))
        run("all_reduce", "dp", g.dp_group, g, t.numel() * 4, None, lambda: dist.all_reduce(t, group=g.dp_group),
            like=t)

    sched = engine.dispatcher.sched
    t0 = time.perf_counter()
    item = sched.item("gpu-check stuck all_reduce", Traffic.SYNC, stuck)
    sched.release([item])
    err = later = None
    try:
        sched.wait(item, host=True)
    except CollectiveError as exc:
        err = exc
    after_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        engine.call(lambda: None, "gpu-check call after the abort")
    except CollectiveError as exc:
        later = exc
    later_s = time.perf_counter() - t1
    named = err is not None and f"did not complete within fallback.timeout_s = {timeout:g}s" in str(err)
    ok = named and after_s <= timeout + 1.5 and bool(aborted) and later is not None and later_s < 0.5
    first = str(err).splitlines()[0][:160] if err is not None else "no error"
    return _verdict(ok, f"named error after {after_s:.1f} s (timeout {timeout:g} s): {first}; {len(aborted)} "
                        f"communicator abort(s); the next call failed in {later_s * 1000:.0f} ms ({later is not None})",
                    {"after_s": after_s, "aborts": len(aborted), "later_ms": later_s * 1000})


# -- two NCCL ranks (tests/test_reducer_cuda.py) -----------------------------------------------------------------

def _engine2(name: str, rank: int, dev):
    import test_reducer_cuda as cuda_t
    import torch.distributed as dist

    world = dist.get_world_size()
    if name == "engine":
        r = cuda_t._nccl_main(rank, world)
        ok = all(r[m]["rel"] <= 1e-6 and r[m]["is_out"] and r[m]["seconds"] > 0 for m in r)
        return _verdict(ok, "; ".join(f"{m}: rel err vs NCCL all-reduce {v['rel']:.1e}, in place {v['is_out']}, "
                                      f"device seconds {v['seconds']:.2e}" for m, v in r.items()))
    r = cuda_t._nccl_fault_main(rank, world)
    if r.get("skipped"):
        return _verdict(True, "the silent peer (never called the step's reduction)")
    err = r["error"] or ""
    ok = r["enqueued_done"] and "did not complete within fallback.timeout_s = 5s" in err and r["after_s"] <= 6.5
    return _verdict(ok, f"future done at enqueue {r['enqueued_done']}; named error after {r.get('after_s', 0):.1f} s: "
                        f"{err.splitlines()[0][:160] if err else 'none'}")


_SINGLE = {"streams": _streams, "grouped-reducer": _grouped_reducer, "ddp-hook": _ddp_hook,
           "deepspeed": _deepspeed, "megatron": _megatron}

RUNNERS = {"single": lambda name, rank, dev: _SINGLE[name](rank, dev),
           "abort": lambda name, rank, dev: _abort(rank, dev),
           "engine": _engine2}
