"""The jobs of the fault soak (scripts/fault_soak.py; docs/reliability.md, "Fault soak"): the plan,
one training job under ``torchrun --max-restarts`` on the emulated cluster with its faults injected
while it runs, and the job's fault-free reference.

A job trains with GroupedReducer (the worker of tests/test_reliability_emulated.py: an MLP, per-rank
checkpoints) or DeepSpeed (``topo_integrations.train.pretrain_deepspeed``: the tiny GPT, DeepSpeed's
checkpoints) on the emulated ``virtual-2leaf`` cluster: 4 nodes of one rank under 2 leaves, grouped by
leaf (``topology.group_by`` leaf), so each leaf is an island. Every job checkpoints every
``SAVE_EVERY`` steps and runs with ``--resume``, so each restart continues from the latest checkpoint.
A fault is injected right after the job has logged its step (``INJECT_DELAY_S`` later: every rank
has left that step's last collective), and a fatal one only after a step ``k`` with ``k % SAVE_EVERY
== 1``: neither ``k`` nor ``k + 1`` saves a checkpoint, so the fault meets the next step's gradient
collectives, not a checkpoint's barrier:

* ``link-cut``: a node's cable is cut (``EmulatedCluster.link_down``), put back once every rank is out;
* ``rank-kill``: a rank's process gets SIGKILL (``EmulatedCluster.kill_rank``);
* ``island-partition``: a leaf's link to the spine goes down (``EmulatedCluster.spine_down``): the
  island's ranks still reach each other, nothing else; put back once every rank is out;
* ``link-slow``: a node's uplink at a tenth of its rate (``EmulatedCluster.set_link``) for
  ``SLOW_STEPS`` steps, then back.

The reference of a job is the same job without faults, stopped and resumed at the checkpoints the
faulted job resumed from: for each restart of the job, from checkpoint ``c``, one run that stops
after step ``c + 1`` (``--stop-after``: ``c`` is then its latest checkpoint, as it was when the fault
struck), then a last run to the end; every run with ``--resume``.
"""

from __future__ import annotations

import io
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "configs" / "topologies" / "virtual-2leaf.json"
WORKER = ROOT / "tests" / "test_reliability_emulated.py"
DS_MODULE = "topo_integrations.train.pretrain_deepspeed"

CONFIGS = (("grouped", "hierarchical"), ("grouped", "selective"), ("deepspeed", "selective"),
           ("deepspeed", "hierarchical"))
DEAL = (0, 1, 2, 0, 1, 3)
"""The order faults are dealt to CONFIGS in: a DeepSpeed restart costs about four GroupedReducer ones
(DeepSpeed's start-up on the loaded 2-core machine), so the GroupedReducer jobs get two faults in three."""
KINDS = ("link-cut", "rank-kill", "link-slow", "island-partition")
FATAL = ("link-cut", "rank-kill", "island-partition")
SAVE_EVERY = 3
GROUPED_WIDTH = 512
"""The GroupedReducer job's MLP width: ~1M parameters, steps long enough for a fault to meet them."""
INJECT_DELAY_S = 0.1
SLOW_STEPS = 3
SLOW_FACTOR = 10
OUT_GRACE_S = 30.0
"""Every rank of the attempt must be out within ``timeout_s`` + this (docs/reliability.md)."""
PG_TIMEOUT_S = 120
"""The DeepSpeed entry point's process-group timeout: long enough for restarted ranks to wait for
slower peers in ``init_process_group``; the reducer's own collectives end at ``fallback.timeout_s``."""
SELECTIVE = ["--set", "sync.top_fraction=0.5"]  # a LOCAL class, reconciled, in both frameworks
DS_ARGS = ["--micro-batch-size", "2", "--seq-length", "32", "--eval-batches", "1", "--eval-interval", "100000",
           "--log-interval", "1", "--warmup-steps", "1", "--corpus-max-bytes", "1500000", "--lr", "1e-3",
           "--no-tensorboard"]

DROP_ENV = ("TOPO_ALIGN_CHECK_COLLECTIVES",)
"""Taken out of the jobs' environment: the suite's per-step collective check (tests/conftest.py)."""


def job_env() -> dict[str, str]:
    """What the jobs' environment gets (besides DROP_ENV taken out): unbuffered output (the soak
    follows the log as it comes), DeepSpeed on the CPU, one thread per rank, this checkout first."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


NAMED = re.compile(r"CollectiveError: (topo_align: .*)")
ERROR_AFTER = re.compile(r"failed after ([0-9.]+)s|\(([0-9.]+)s since it was issued")
RESUMED = re.compile(r"resumed from (?:the checkpoint of )?step (\d+)|no checkpoint[^\n]*starting at step 0")
STEP_LINE = {"grouped": re.compile(r"\bstep (\d+) done in "), "deepspeed": re.compile(r"\] (\d+)/\d+ loss ")}


@dataclass
class Fault:
    kind: str
    step: int
    """Injected once the job has logged this step."""
    target: str
    """``node<i>`` (link-cut, link-slow), ``rank<r>`` (rank-kill) or a leaf's name (island-partition)."""


@dataclass
class Job:
    framework: str
    mode: str
    faults: list[Fault]
    steps: int
    save_every: int = SAVE_EVERY

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.mode}"

    @property
    def fatal(self) -> int:
        return sum(f.kind in FATAL for f in self.faults)


def plan(n_faults: int, seed: int, topology) -> list[Job]:
    """``n_faults`` faults dealt to the four jobs (GroupedReducer and DeepSpeed, each in `hierarchical`
    and `selective`) in the order of DEAL; each job's faults go through the four kinds in turn (from a
    different kind in each job), in a seeded order, at seeded steps and on seeded targets."""
    rng = random.Random(seed)
    nodes, leaves = list(topology.hosts), list(topology.leaves)
    kinds: list[list[str]] = [[] for _ in CONFIGS]
    for i in range(n_faults):
        j = DEAL[i % len(DEAL)]
        kinds[j].append(KINDS[(len(kinds[j]) + j) % len(KINDS)])
    jobs = []
    for (framework, mode), ks in zip(CONFIGS, kinds):
        if not ks:
            continue
        rng.shuffle(ks)
        faults, step = [], SAVE_EVERY + 1  # the first fault after the first checkpoint
        for kind in ks:
            step += rng.randrange(2) * (SAVE_EVERY if kind in FATAL else 1)
            while kind in FATAL and step % SAVE_EVERY != 1:
                step += 1
            target = {"link-cut": lambda: rng.choice(nodes), "link-slow": lambda: rng.choice(nodes),
                      "rank-kill": lambda: f"rank{rng.randrange(topology.world_size)}",
                      "island-partition": lambda: rng.choice(leaves)}[kind]()
            faults.append(Fault(kind, step, target))
            step += SLOW_STEPS + 1 if kind == "link-slow" else SAVE_EVERY
        jobs.append(Job(framework, mode, faults, steps=step + 2))
    for job in jobs:  # one length per framework: the DeepSpeed jobs then share their dataset's cached indices
        job.steps = max(j.steps for j in jobs if j.framework == job.framework)
    return jobs


class Transcript(io.TextIOBase):
    """A job's output as the launcher forwards it: ``(monotonic time, line)``, also written to a log;
    the steps the job logs (``step_line``) as they arrive."""

    def __init__(self, path: Path, step_line: re.Pattern):
        self.lines: list[tuple[float, str]] = []
        self.steps: list[tuple[float, int]] = []
        self._step_line = step_line
        self._lock = threading.Condition()
        self._fh = open(path, "w", encoding="utf-8")
        self._t0 = time.monotonic()

    def write(self, text: str) -> int:
        now = time.monotonic()
        with self._lock:
            for ln in text.splitlines():
                self.lines.append((now, ln))
                if m := self._step_line.search(ln):
                    self.steps.append((now, int(m.group(1))))
                    self._lock.notify_all()
                self._fh.write(f"{now - self._t0:9.3f} {ln}\n")
            self._fh.flush()
        return len(text)

    def last_step(self, since: float) -> int:
        """The last step logged since ``since`` (-1: none)."""
        with self._lock:
            return next((s for t, s in reversed(self.steps) if t >= since), -1)

    def wait_step(self, step: int, since: float, until: float) -> bool:
        """Wait (woken by the line itself) until step ``step`` or a later one is logged since ``since``."""
        with self._lock:
            while next((s for t, s in reversed(self.steps) if t >= since), -1) < step:
                left = min(until - time.monotonic(), 0.5)
                if until - time.monotonic() <= 0:
                    return False
                self._lock.wait(left)
            return True

    def step_seconds(self, since: float) -> dict[int, float]:
        """Wall seconds of each step logged since ``since``, between its line and the one before."""
        with self._lock:
            at = {s: t for t, s in self.steps if t >= since}
        return {s: at[s] - at[s - 1] for s in at if s - 1 in at}

    def matches(self, pattern: re.Pattern, after: float = 0.0) -> list[tuple[float, re.Match]]:
        with self._lock:
            lines = list(self.lines)
        return [(t, m) for t, ln in lines if t >= after and (m := pattern.search(ln))]

    def first(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match] | None:
        found = self.matches(pattern, after)
        return found[0] if found else None

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def train_command(job: Job, out: Path, timeout_s: float) -> list[str]:
    """What torchrun (or, with the interpreter in front, each rank) runs for ``job`` in ``out``."""
    extra = SELECTIVE if job.mode == "selective" else []
    if job.framework == "grouped":
        return [str(WORKER), "--out", str(out), "--steps", str(job.steps), "--save-every", str(job.save_every),
                "--timeout-s", f"{timeout_s:g}", "--mode", job.mode, "--topology", str(TOPOLOGY),
                "--group-by", "leaf", "--width", str(GROUPED_WIDTH), "--resume", *extra]
    return ["-m", DS_MODULE, *DS_ARGS, "--runs-dir", str(out), "--run-name", "run",
            "--data-dir", str(out.parent / "data"), "--train-steps", str(job.steps),
            "--save-interval", str(job.save_every), "--topology", str(TOPOLOGY), "--set", "topology.group_by=leaf",
            "--topo-align-mode", job.mode, "--set", f"fallback.timeout_s={timeout_s:g}",
            "--timeout-s", str(PG_TIMEOUT_S), "--resume", *extra]


def final_params(job: Job, out: Path) -> dict | None:
    """The job's final parameters (rank 0's, after the last reconciliation), or None."""
    import torch

    if job.framework == "grouped":
        path = out / "final.pt"
        return torch.load(path) if path.is_file() else None
    path = out / "run" / "checkpoints" / f"step_{job.steps:07d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["module"] if path.is_file() else None


def bitwise_equal(a: dict | None, b: dict | None) -> bool:
    import torch

    return a is not None and b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _port() -> int:
    return random.randint(30000, 45000)


def _wait(cond: Callable[[], bool], until: float, poll: float = 0.05) -> bool:
    while not cond():
        if time.monotonic() > until:
            return False
        time.sleep(poll)
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _Run:
    """One job (or reference segment) launched on the cluster in a thread."""

    def __init__(self, cl, job: Job, command: list[str], *, mode: str, deadline: float, log: Path):
        self.tr = Transcript(log, STEP_LINE[job.framework])
        self.result = None
        timeout = max(1.0, deadline - time.monotonic())

        def go():
            self.result = cl.launch(command, mode=mode, timeout=timeout, port=_port(), out=self.tr)

        self.th = threading.Thread(target=go, daemon=True)
        self.th.start()

    @property
    def running(self) -> bool:
        return self.th.is_alive()

    def join(self, until: float):
        self.th.join(max(0.0, until - time.monotonic()) + 10.0)
        self.tr.close()
        return self.result


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _rank_pids(cl) -> dict[int, list[int]]:
    return {r: cl.rank_pids(r) for r in range(cl.topology.world_size)}


def _fatal(cl, run: _Run, fault: Fault, ranks: dict[int, list[int]], since: float, timeout_s: float,
           deadline: float) -> dict:
    pids = [p for ps in ranks.values() for p in ps]
    rec: dict = {"after_step": run.tr.last_step(since)}
    t0 = time.monotonic()
    if fault.kind == "link-cut":
        cl.link_down(fault.target)
    elif fault.kind == "rank-kill":
        for pid in ranks[int(fault.target[4:])]:  # EmulatedCluster.kill_rank, with the pids found already
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        cl.spine_down(fault.target)
    bound = t0 + timeout_s + OUT_GRACE_S
    _wait(lambda: run.tr.first(NAMED, t0) is not None or not any(map(_alive, pids)), min(bound, deadline))
    _wait(lambda: not any(map(_alive, pids)), min(bound + OUT_GRACE_S, deadline))
    t_out = time.monotonic()
    rec["all_out_s"] = round(t_out - t0, 2) if not any(map(_alive, pids)) else None
    last = run.tr.last_step(since)
    if fault.kind == "link-cut":
        cl.link_up(fault.target)
    elif fault.kind == "island-partition":
        cl.spine_up(fault.target)
    named = run.tr.first(NAMED, t0)
    if named is not None:
        t, m = named
        after = ERROR_AFTER.search(m.group(1))
        rec.update(detect_s=round(t - t0, 2), error=m.group(1)[:400],
                   error_after_s=float(after.group(1) or after.group(2)) if after else None,
                   names_timeout="timeout" in m.group(1))
    else:
        rec.update(detect_s=None, error=None, error_after_s=None, names_timeout=False)
    _wait(lambda: run.tr.first(RESUMED, t0) is not None or not run.running, deadline)
    resumed = run.tr.first(RESUMED, t0)
    rec["resumed_from"] = int(resumed[1].group(1) or 0) if resumed else None
    rec["resumed_at"] = resumed[0] if resumed else None
    rec["steps_lost"] = last - rec["resumed_from"] if resumed and last >= 0 else None
    rec["within_bound"] = rec["all_out_s"] is not None and rec["all_out_s"] <= timeout_s + OUT_GRACE_S
    return rec


def _slow(cl, run: _Run, fault: Fault, since: float, deadline: float) -> dict:
    planned = cl.link_shape(fault.target).rate_mbit
    t0 = time.monotonic()
    cl.set_link(fault.target, rate_mbit=planned / SLOW_FACTOR)
    try:
        run.tr.wait_step(fault.step + SLOW_STEPS, since, deadline)
    finally:
        cl.set_link(fault.target, rate_mbit=planned)
    secs = run.tr.step_seconds(since)
    k = fault.step
    before = _median([secs[s] for s in range(k - 2, k + 1) if s in secs])
    during = _median([secs[s] for s in range(k + 1, k + SLOW_STEPS + 1) if s in secs])
    return {"after_step": k, "rate_mbit": [planned, planned / SLOW_FACTOR], "step_s_before": before,
            "step_s_during": during, "slowdown": round(during / before, 2) if before and during else None,
            "restarted": run.tr.first(RESUMED, t0) is not None, "steps_lost": 0}


def heal(cl) -> None:
    """Every cable and spine link up, every uplink at its planned rate."""
    for node in cl.layout.nodes:
        cl.link_up(node.host)
        if cl.link_shape(node.host).rate_mbit != node.uplink.rate_mbit:
            cl.set_link(node.host, rate_mbit=node.uplink.rate_mbit)
    for sp in cl.layout.spines:
        cl.spine_up(sp.leaf)


def run_job(cl, job: Job, workdir: Path, *, timeout_s: float, deadline: float, say=print) -> dict:
    """Run ``job`` under ``torchrun --max-restarts`` with its faults; returns its record (faults,
    restarts, exit) without the reference."""
    out = workdir / job.name
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["--max-restarts", str(job.fatal + 3), "--monitor-interval", "0.5", *train_command(job, out, timeout_s)]
    t_start = time.monotonic()
    run = _Run(cl, job, cmd, mode="torchrun", deadline=deadline, log=workdir / f"{job.name}.log")
    since, faults = t_start, []
    try:
        for fault in job.faults:
            rec = {"kind": fault.kind, "target": fault.target, "step": fault.step, "injected": False}
            faults.append(rec)
            ranks = _rank_pids(cl)  # this attempt's processes, refreshed while waiting
            while not run.tr.wait_step(fault.step, since, min(deadline, time.monotonic() + 1.0)):
                if not run.running or time.monotonic() > deadline:
                    break
                ranks = _rank_pids(cl)
            if run.tr.last_step(since) < fault.step or not run.running:
                say(f"  {job.name}: not injected: {fault.kind} after step {fault.step} (job ended or budget)")
                continue
            time.sleep(INJECT_DELAY_S)
            rec["injected"] = True
            if fault.kind in FATAL:
                if not all(_alive(p) for ps in ranks.values() for p in ps):
                    ranks = _rank_pids(cl)
                rec.update(_fatal(cl, run, fault, ranks, since, timeout_s, deadline))
                since = rec.pop("resumed_at") or time.monotonic()
                say(f"  {job.name}: {fault.kind} {fault.target} after step {rec['after_step']}: "
                    f"named error after {rec['detect_s']} s, all ranks out after {rec['all_out_s']} s, "
                    f"resumed from step {rec['resumed_from']} ({rec['steps_lost']} steps lost): {rec['error']}")
            else:
                rec.update(_slow(cl, run, fault, since, deadline))
                say(f"  {job.name}: {fault.kind} {fault.target} {rec['rate_mbit'][0]:g} -> "
                    f"{rec['rate_mbit'][1]:g} Mbit/s after step {fault.step}: steps {fault.step + 1}-"
                    f"{fault.step + SLOW_STEPS} took {rec['step_s_during']} s each vs {rec['step_s_before']} s "
                    f"({rec['slowdown']}x), restarted: {rec['restarted']}")
    finally:
        heal(cl)
    res = run.join(deadline)
    restarts = [int(m.group(1) or 0) for _, m in run.tr.matches(RESUMED)][1:]  # the first: attempt 0's start
    return {"name": job.name, "framework": job.framework, "mode": job.mode, "steps": job.steps,
            "save_every": job.save_every, "faults": faults, "restarts_from": restarts,
            "exit_code": None if res is None else res.exit_code, "reason": None if res is None else res.reason,
            "seconds": round(time.monotonic() - t_start, 1)}


def run_reference(cl, job: Job, restarts: list[int], workdir: Path, *, timeout_s: float, deadline: float) -> dict:
    """The job without faults, stopped after step ``c + 1`` and resumed for each restart from ``c``."""
    out = workdir / f"{job.name}-reference"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    base = [sys.executable, *train_command(job, out, timeout_s)]
    for i, c in enumerate([*restarts, None]):
        stop = [] if c is None else ["--stop-after", str(c + 1)]
        run = _Run(cl, job, [*base, *stop], mode="per-rank", deadline=deadline,
                   log=workdir / f"{job.name}-reference-{i}.log")
        res = run.join(deadline)
        if res is None or res.exit_code != 0:
            return {"ok": False, "segments": i + 1, "seconds": round(time.monotonic() - t_start, 1),
                    "reason": None if res is None else res.reason}
    return {"ok": True, "segments": len(restarts) + 1, "stops_after": [c + 1 for c in restarts],
            "seconds": round(time.monotonic() - t_start, 1), "out": out}
