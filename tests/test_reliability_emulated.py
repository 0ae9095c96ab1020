"""Reliability acceptance on the emulated cluster (issue 9; docs/reliability.md).

* a node uplink made 10x slower mid-run (``set_link``), then restored: the run completes, every rank
  runs every step at the same adaptive level, and every level change is one the policy makes, logged
  with its numbers. *Which* changes happen depends on how much the machine's load blurs the measured
  link speed, so they are not asserted here: tests/test_reliability.py feeds the same controller
  injected measurements and asserts the exact decisions;
* a node's cable cut mid-run (``link_down``), the fault soak's slice (scripts/soak_jobs.py; the
  whole soak: scripts/fault_soak.py): under ``torchrun --max-restarts`` every rank is out within
  ``timeout_s + 30 s`` with the CollectiveError naming operation, group and ranks; after ``link_up``
  torchrun's restart resumes from the last checkpoint and the job ends with parameters bitwise equal
  to its reference (the job without the fault, stopped and resumed at the same checkpoint).

This file is also the training worker the tests and the soak launch on every rank
(``python tests/test_reliability_emulated.py --out DIR ...``): a small deterministic MLP trained
with the GroupedReducer, per-rank checkpoints (topo_integrations.train.checkpoint), a line per step
on rank 0, pauses at given steps so the test can change the network between two steps,
``--stop-after`` as the entry points have it.
Skips with the reason when namespaces cannot be made. Budget: ~90 s on the 2-core machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_COLLECTIVE = 3


# ---------------------------------------------------------------------------- the worker

def worker(argv: list[str] | None = None) -> int:
    import datetime
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from topo_integrations import GroupedReducer, TopoAlignConfig
    from topo_integrations.reducer import CollectiveError
    from topo_integrations.train import checkpoint as ckpt
    from topo_integrations.train.common import attempt_store, parse_set

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mode", default="hierarchical")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--check-interval", type=int, default=2)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--pause-at", default="")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--fail-once-at", type=int, default=0,
                    help="rank 1 stalls past the timeout at this step, once (marker file in --out)")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="exit after this step without saving it, as if killed (the entry points' flag)")
    ap.add_argument("--topology", default=None, help="a JSON topology file (topology.source file)")
    ap.add_argument("--group-by", default="island", choices=("island", "leaf"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a field of the block by dotted name (VALUE is JSON), as the entry points take it")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmo = datetime.timedelta(seconds=60)
    # Under torchrun each attempt rendezvouses under its own key prefix (topo_integrations.train.common.
    # attempt_store: a restart must not read the peer addresses of the attempt before).
    store = attempt_store(tmo)
    if store is not None:
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=tmo)
    else:
        dist.init_process_group("gloo", timeout=tmo)
    rank = dist.get_rank()
    block = {"mode": a.mode, "fallback": {"timeout_s": a.timeout_s}, "communication": {"bucket_size_mb": 64.0},
             "adaptive": {"enabled": a.adaptive, "check_interval": a.check_interval, "window": a.window,
                          "slowdown_factor": a.slowdown}}
    if a.topology:
        block["topology"] = {"source": "file", "file": a.topology, "group_by": a.group_by}
    cfg = TopoAlignConfig.model_validate(block).with_overrides(parse_set(a.set))
    torch.manual_seed(0)
    w = a.width
    model = nn.Sequential(nn.Linear(w, 2 * w), nn.Tanh(), nn.Linear(2 * w, w))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reducer = GroupedReducer(model, cfg)
    start = 0
    ck = str(out / "checkpoints")
    if a.resume and ckpt.latest_step(ck) is not None:
        start = ckpt.latest_step(ck)
        st = ckpt.load(ck, start)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        reducer.load_state_dict(st["reducer"])
        if rank == 0:
            print(f"resumed from step {start}", file=sys.stderr, flush=True)
    elif a.resume and rank == 0:
        print("--resume: no checkpoint; starting at step 0", file=sys.stderr, flush=True)
    pauses = {int(s) for s in a.pause_at.split(",") if s}
    progress = open(out / f"progress_r{rank}.jsonl", "a", encoding="utf-8")
    step = start
    try:
        for step in range(start + 1, a.steps + 1):
            t0 = time.perf_counter()
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, w, generator=g)
            loss = ((model(x) - torch.sin(x)) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if a.fail_once_at == step and rank == 1 and not (out / "failed_once").exists():
                (out / "failed_once").write_text("1")
                time.sleep(a.timeout_s * 3)  # the others time out in the next collective
            reducer.finish_grad_sync()
            opt.step()
            reducer.after_optimizer_step(opt)
            level = reducer.adaptive.level if reducer.adaptive else "off"
            progress.write(json.dumps({"step": step, "s": time.perf_counter() - t0, "level": level}) + "\n")
            progress.flush()
            if rank == 0:  # the run's log: what tests and scripts/fault_soak.py follow
                print(f"step {step} done in {time.perf_counter() - t0:.3f} s", file=sys.stderr, flush=True)
            if a.stop_after and step >= a.stop_after:
                break
            if a.save_every and step % a.save_every == 0:
                reducer.reconcile(opt)
                ckpt.save(ck, step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                     "reducer": reducer.state_dict()})
            if step in pauses:  # the test changes the network between two steps
                (out / f"pause_{step}_r{rank}").write_text("1")
                while not (out / f"resume_{step}").exists():
                    time.sleep(0.05)
    except CollectiveError as exc:
        # Exit non-zero at once (no teardown that could wait on a dead peer): torchrun / the
        # launcher sees the failure and restarts the job from the last checkpoint.
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_COLLECTIVE)
    if not (a.stop_after and step >= a.stop_after):  # stopped: as if killed, no final parameters
        reducer.reconcile(opt)
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "final.pt")
            if reducer.adaptive is not None:
                (out / "events.json").write_text(json.dumps({"events": reducer.adaptive.events,
                                                              "checks": reducer.adaptive.checks}))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the process-group teardown costs ~10 s on the loaded test machine; nothing is left to do


if __name__ == "__main__":
    sys.exit(worker())


# ---------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

WORKER = str(Path(__file__).resolve())
TOPO_2X2 = ROOT / "configs" / "topologies" / "virtual-2x2.json"


def _unavailable() -> str | None:
    from topo_integrations.emulate.netns import probe_unavailable_reason

    return probe_unavailable_reason()


_REASON = _unavailable()
pytestmark = [pytest.mark.emulated, pytest.mark.multirank,
              pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster unavailable: {_REASON}")]


def _cluster(uplink_mbit: float | None = None):
    from topo_integrations.emulate import EmulatedCluster
    from topo_integrations.topology.file_source import load_topology_file

    return EmulatedCluster(load_topology_file(TOPO_2X2), uplink_mbit=uplink_mbit)


def _port() -> int:
    return random.randint(30000, 45000)


class _Runner:
    """Run the worker on every rank of ``cl`` in a thread; the caller drives pauses."""

    def __init__(self, cl, args: list[str], timeout: float):
        self.buf = io.StringIO()
        self.result = None
        self.t_end = None

        def go():
            self.result = cl.launch([sys.executable, WORKER, *args], timeout=timeout, port=_port(), out=self.buf)
            self.t_end = time.monotonic()

        self.th = threading.Thread(target=go, daemon=True)
        self.th.start()

    def wait_pause(self, out: Path, step: int, ranks: int = 4, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all((out / f"pause_{step}_r{r}").exists() for r in range(ranks)):
            if not self.th.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"never paused at step {step}:\n{self.buf.getvalue()[-3000:]}")
            time.sleep(0.05)

    def join(self, timeout: float = 300.0):
        self.th.join(timeout)
        assert not self.th.is_alive(), "launch did not return"
        return self.result


def _our_namespaces_gone(cl) -> None:
    from topo_integrations.emulate.netns import list_namespaces

    assert not [n for n in list_namespaces() if n.startswith(cl.layout.prefix)]


# Which levels the controller reaches, and when, depends on how much the machine's load blurs the
# measured link speed; test_reliability.py drives the same controller with injected measurements and
# asserts the exact decisions. Here only what load cannot change is asserted.
LEGAL_MOVES = {("normal", "fp16"), ("fp16", "flat"), ("flat", "fp16"), ("fp16", "normal"), ("flat", "normal")}


@pytest.mark.timeout(900)  # generous: a loaded machine slows every step
def test_slow_link_run_completes_ranks_agree_and_logs(tmp_path):
    out = tmp_path / "slow"
    # Uplinks at 50 Mbit/s (not the preset's 200): on a shared 2-core machine a step's compute and
    # scheduling noise is ~0.5 s, so the link must dominate the step for a slowdown to be measurable.
    args = ["--out", str(out), "--steps", "36", "--adaptive", "--check-interval", "2", "--window", "2",
            "--slowdown", "2", "--pause-at", "6,20", "--timeout-s", "120"]
    with _cluster(uplink_mbit=50) as cl:
        run = _Runner(cl, args, timeout=780)
        run.wait_pause(out, 6, timeout=300)
        cl.set_link("node1", rate_mbit=5)  # 10x slower
        (out / "resume_6").write_text("1")
        run.wait_pause(out, 20, timeout=400)
        cl.set_link("node1", rate_mbit=50)  # recovered
        (out / "resume_20").write_text("1")
        res = run.join(timeout=800)
    _our_namespaces_gone(cl)
    log = run.buf.getvalue()
    # 1. a 10x slower link mid-run is no failure: every rank finishes every step
    assert res.exit_code == 0, log[-4000:]
    progress = [[json.loads(ln) for ln in (out / f"progress_r{r}.jsonl").read_text().splitlines()] for r in range(4)]
    assert all([p["step"] for p in prog] == list(range(1, 37)) for prog in progress)
    # 2. every rank ran every step at the same level (the decision is agreed, whatever was measured)
    levels = [[p["level"] for p in prog] for prog in progress]
    assert all(lv == levels[0] for lv in levels), levels
    # 3. the controller checked at every check_interval, and every move is one the policy makes,
    #    logged on rank 0 with its numbers (a step's progress line holds the level after its check)
    data = json.loads((out / "events.json").read_text())
    assert [c["step"] for c in data["checks"]] == list(range(2, 37, 2))
    ev = data["events"]
    for e in ev:
        assert (e["from"], e["to"]) in LEGAL_MOVES, ev
        assert e["step"] % 2 == 0 and levels[0][e["step"] - 2] == e["from"], (e, levels[0])
        assert levels[0][e["step"] - 1] == e["to"], (e, levels[0])
        assert f"adaptive: step {e['step']}: {e['from']} -> {e['to']}: {e['reason']}" in log
        if e["from"] == "normal":
            assert re.fullmatch(r"inter tier degraded over 2 checks: inter tier [0-9.e+-]+ GB/s vs reference "
                                r"[0-9.e+-]+ GB/s \([0-9.]+x slower\), [0-9.]+ ms per step", e["reason"]), e
    # what happened, for the record (docs/reliability.md shows one run): pytest -s prints it
    print("events:", [(e["step"], e["from"], e["to"]) for e in ev])
    for lo, hi in ((1, 6), (7, 20), (21, 36)):
        ts = sorted(p["s"] for p in progress[0][lo - 1:hi])
        print(f"steps {lo}-{hi}: median {ts[len(ts) // 2] * 1e3:.0f} ms, levels {sorted(set(levels[0][lo - 1:hi]))}")


def _soak_jobs():
    """scripts/soak_jobs.py: the fault soak's jobs (scripts/fault_soak.py runs the whole soak)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak_jobs", ROOT / "scripts" / "soak_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_jobs"] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


# Time limits here only bound a failure; they are generous, so a heavily loaded machine (one run
# here at load average 97 took over 150 s for 12 steps) slows the test without failing it.
@pytest.mark.timeout(1800)
def test_cut_link_fails_fast_and_restart_resumes_bitwise(tmp_path, monkeypatch):
    """The fault soak's slice (docs/reliability.md, "Fault soak"): a GroupedReducer job under torchrun
    --max-restarts on the emulated virtual-2leaf cluster; node3's cable is cut after step 4. (The whole
    soak, scripts/fault_soak.py, adds killed ranks, partitioned islands, slowed links and DeepSpeed.)"""
    from topo_integrations.emulate import EmulatedCluster
    from topo_integrations.topology.file_source import load_topology_file

    soak = _soak_jobs()
    for key, value in soak.job_env().items():
        monkeypatch.setenv(key, value)
    for key in soak.DROP_ENV:
        monkeypatch.delenv(key, raising=False)
    job = soak.Job("grouped", "hierarchical", [soak.Fault("link-cut", 4, "node3")], steps=7)
    with EmulatedCluster(load_topology_file(str(soak.TOPOLOGY))) as cl:
        rec = soak.run_job(cl, job, tmp_path, timeout_s=10, deadline=time.monotonic() + 1200)
        ref = soak.run_reference(cl, job, rec["restarts_from"], tmp_path, timeout_s=10,
                                 deadline=time.monotonic() + 500)
    _our_namespaces_gone(cl)
    log = (tmp_path / f"{job.name}.log").read_text()
    # the job ends (exit 0): torchrun restarted it after each fault, each time from the last checkpoint
    assert rec["exit_code"] == 0, (rec, log[-4000:])
    (cut,) = rec["faults"]
    assert cut["resumed_from"] == 3 and rec["restarts_from"] == [3], rec
    # the hidden fault (the cable): every rank out within timeout_s + 30 s, with the CollectiveError naming
    # operation, group, ranks and the timeout, not the launcher's time limit. gloo's own timeout ("failed after
    # X s, timeout 10s") or the schedule's watch ("did not complete within fallback.timeout_s = 10s") names it
    # first: a race. A collective gave up at its 10 s timeout, as the rank measured it (load may add the time the
    # rank waited for a CPU); peers may fail sooner, reset by it.
    assert cut["all_out_s"] is not None and cut["all_out_s"] <= 10 + 30, cut
    after = [float(a or b) for a, b in re.findall(
        r"CollectiveError: topo_align: (?:all_reduce|reduce_scatter|all_gather)\S* on the "
        r"(?:inter|intra|data-parallel) group \(global ranks [0-9, ]+\) (?:failed after ([0-9.]+)s, "
        r"timeout 10s|did not complete within fallback\.timeout_s = 10s \(([0-9.]+)s since it was issued)", log)]
    assert any(9.5 <= x < 10 + 60 for x in after), (after, log[-3000:])
    # bitwise resume: the final parameters equal those of the job without faults, stopped after step 4
    # and resumed from the checkpoint of step 3, as the faulted job was
    assert ref["ok"] and ref["stops_after"] == [4], ref
    assert soak.bitwise_equal(soak.final_params(job, tmp_path / job.name), soak.final_params(job, ref["out"]))


@pytest.mark.timeout(900)
def test_probe_job_warns_about_the_slow_link(tmp_path):
    from topo_integrations.diagnostics import run_probe_job

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"topology": {"source": "file", "file": str(TOPO_2X2)}}))
    with _cluster() as cl:
        cl.set_link("node1", rate_mbit=20)  # both rails cross node1's uplink
        res = run_probe_job(cluster=cl, config=str(cfg), timeout=600)
    _our_namespaces_gone(cl)
    f = {x["what"]: x for x in res["findings"]}
    for rail in ("inter group (global ranks 0, 2)", "inter group (global ranks 1, 3)"):
        assert f[rail]["level"] == "warn", res["findings"]
        assert "below its tier 'leaf' (0.0125 GB/s planned" in f[rail]["detail"]
    assert "intra group (global ranks 0, 1)" in f  # loopback; its level depends on the CPU load
