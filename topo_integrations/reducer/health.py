"""Health checks: link probes between groups, IB port state, GPU link matrix; a start-of-run check.

* :func:`probe_groups` (inside a running job) times small all-reduces on every group kind of a
  :class:`ReducerGroups` -- my intra group (fast tier) and my rail (slow tier) -- and gathers every
  rank's numbers, so rank 0 can name the slow group, not only say that one is slow.
* :func:`check_probe` compares them with the plan: a group whose bus bandwidth is below its tier's
  planned GB/s divided by ``tolerance``, or ``tolerance`` times below the median of its tier
  (a congested leaf), gets a ``warn`` finding that names the group and its ranks.
* :func:`start_of_run_check` = IB ports (sysfs, as `topo-align doctor`) + ``nvidia-smi topo -m`` when
  ``nvidia-smi`` is on PATH + the probes; warnings go to the ``topo_align`` logger on DP position 0.
  Adapters call it after the reducer's groups exist (opt-in).
* ``python -m topo_integrations.reducer.health --json OUT`` is the probe job that
  ``topo-align doctor --probe`` runs under torchrun or on the emulated cluster (:func:`run_probe_job`).

Bus bandwidth: an all-reduce of S bytes over p ranks moves ``2(p-1)/p * S`` per rank on a ring, so
``busbw = 2(p-1)/p * S / t`` is comparable with a tier's per-GPU link bandwidth (as nccl-tests).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..doctor import Finding, check_ib
from .collectives import run as _run
from .groups import ReducerGroups

__all__ = ["ProbeResult", "probe_groups", "check_probe", "check_gpu_links", "start_of_run_check",
           "run_probe_job", "main", "tier_gbps"]

log = logging.getLogger("topo_align")

# kind -> which ReducerGroups attribute, which tier of the plan it runs on
_KINDS = (("intra", "intra_ranks"), ("inter", "inter_ranks"))


@dataclass
class ProbeResult:
    """Per DP position: the group members and the measured latency / bus bandwidth of each kind."""

    nbytes: int
    rows: list[dict]
    """One per DP position: ``{"rank", "intra": {"ranks", "latency_us", "busbw_gbps"}, "inter": ...}``."""

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "rows": self.rows}

    def groups(self, kind: str) -> list[dict]:
        """Distinct groups of ``kind`` with the slowest member's numbers (a group is as fast as its slowest)."""
        by: dict[tuple, dict] = {}
        for row in self.rows:
            g = row.get(kind)
            if not g or len(g["ranks"]) < 2:
                continue
            key = tuple(g["ranks"])
            cur = by.get(key)
            if cur is None or g["busbw_gbps"] < cur["busbw_gbps"]:
                by[key] = {"ranks": list(key), "latency_us": g["latency_us"], "busbw_gbps": g["busbw_gbps"]}
            else:
                cur["latency_us"] = max(cur["latency_us"], g["latency_us"])
        return list(by.values())


def _time_all_reduce(t: torch.Tensor, group, groups: ReducerGroups, what: str, iters: int) -> float:
    """Median seconds of ``iters`` all-reduces of ``t`` (after one warm-up), error-wrapped."""
    _run(f"all_reduce({what} warm-up)", "control", group, groups, 0, None, lambda: dist.all_reduce(t, group=group))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _run(f"all_reduce({what})", "control", group, groups, 0, None, lambda: dist.all_reduce(t, group=group))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_groups(groups: ReducerGroups, *, nbytes: int = 1 << 20, iters: int = 3, device=None) -> ProbeResult:
    """Latency and bus bandwidth of my intra group and my rail, gathered from every DP rank.

    Phases (every rank runs all, same order, so the groups' collectives match):
      1. intra group: all-reduce of 1 float (latency), then of ``nbytes`` (bandwidth), median of ``iters``;
      2. the same on my rail (the `inter` group), when the plan has one;
      3. all-gather over the DP group of every rank's 4 numbers.
    Cost: about ``2 * (iters + 1) * nbytes`` per rank on each tier.
    """
    device = device or torch.device("cpu")
    numel = max(1, nbytes // 4)
    mine = []
    for kind, _ in _KINDS:
        group = getattr(groups, kind)
        size = len(getattr(groups, f"{kind}_ranks"))
        if group is None or size < 2:
            mine += [0.0, 0.0]
            continue
        lat = _time_all_reduce(torch.zeros(1, device=device), group, groups, f"{kind} latency probe", iters)
        sec = _time_all_reduce(torch.zeros(numel, device=device), group, groups, f"{kind} bandwidth probe", iters)
        busbw = 2 * (size - 1) / size * numel * 4 / sec / 1e9 if sec > 0 else 0.0
        mine += [lat * 1e6, busbw]
    vec = torch.tensor(mine, dtype=torch.float64, device=device)
    allv = [torch.empty_like(vec) for _ in range(groups.dp_size)]
    _run("all_gather(probe results)", "dp", groups.dp_group, groups, vec.numel() * 8, None,
         lambda: dist.all_gather(allv, vec, group=groups.dp_group))
    # all_gather orders by group rank = ascending global rank; the gathered members lists are global
    # ranks, recomputed here from the plan so every rank builds the same rows.
    by_rank = dict(zip(sorted(groups.dp_ranks), [v.cpu().tolist() for v in allv]))
    plan = groups.plan
    rows = []
    intra_of = {p: sorted(groups.dp_ranks[q] for q in g) for g in plan.intra_groups for p in g}
    for pos, rank in enumerate(groups.dp_ranks):
        v = by_rank[rank]
        intra = intra_of.get(pos, sorted(groups.dp_ranks)) if plan.hierarchical else sorted(groups.dp_ranks)
        row = {"rank": rank, "intra": {"ranks": intra, "latency_us": v[0], "busbw_gbps": v[1]}}
        if plan.hierarchical:
            i = intra.index(rank)
            rail = sorted(sorted(groups.dp_ranks[q] for q in g)[i] for g in plan.intra_groups)
            row["inter"] = {"ranks": rail, "latency_us": v[2], "busbw_gbps": v[3]}
        rows.append(row)
    return ProbeResult(nbytes=numel * 4, rows=rows)


def tier_gbps(result: ProbeResult) -> tuple[float | None, float | None]:
    """(intra, inter) bus bandwidth of the slowest group of each tier (None when the tier has no group
    of two or more): a hierarchical step waits for its slowest group, so that is what estimates use."""
    out = []
    for kind, _ in _KINDS:
        bws = [g["busbw_gbps"] for g in result.groups(kind) if g["busbw_gbps"] > 0]
        out.append(min(bws) if bws else None)
    return out[0], out[1]


def check_probe(result: ProbeResult, plan, *, tolerance: float = 2.0) -> list[Finding]:
    """Findings: a group below its tier's planned bandwidth / ``tolerance``, or ``tolerance`` times
    slower than the median group of its kind (e.g. one congested leaf); ``ok`` otherwise."""
    out: list[Finding] = []
    planned = {"intra": plan.intra_bandwidth_gbps, "inter": plan.inter_bandwidth_gbps}
    tiers = {"intra": plan.intra_tier, "inter": plan.inter_tier}
    for kind in ("intra", "inter"):
        gs = result.groups(kind)
        if not gs:
            continue
        med = statistics.median(g["busbw_gbps"] for g in gs)
        for g in gs:
            bw = g["busbw_gbps"]
            label = f"{kind} group (global ranks {', '.join(map(str, g['ranks']))})"
            numbers = f"{bw:.4g} GB/s bus bandwidth, {g['latency_us']:.0f} us latency"
            if plan.hierarchical and bw * tolerance < planned[kind]:
                out.append(Finding("warn", label,
                                   f"{numbers}: below its tier '{tiers[kind]}' ({planned[kind]:g} GB/s planned, "
                                   f"{planned[kind] / max(bw, 1e-12):.1f}x slower)",
                                   "check cables, port rates (topo-align doctor) and congestion on this link"))
            elif len(gs) > 1 and bw * tolerance < med:
                out.append(Finding("warn", label,
                                   f"{numbers}: {med / max(bw, 1e-12):.1f}x slower than the median {kind} group "
                                   f"({med:.4g} GB/s)",
                                   "a congested or degraded link; adaptive.enabled can regroup around it"))
            else:
                out.append(Finding("ok", label, numbers))
    return out


def check_gpu_links(nvidia_smi: str | None = None, *, timeout: float = 20.0) -> list[Finding]:
    """``nvidia-smi topo -m`` (when on PATH): the NVLink islands it implies; info when absent."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return [Finding("info", "gpu links", "nvidia-smi is not on PATH; GPU link matrix not read")]
    try:
        proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [Finding("warn", "gpu links", f"`nvidia-smi topo -m` failed: {exc}", "check the driver")]
    if proc.returncode != 0:
        return [Finding("warn", "gpu links", f"`nvidia-smi topo -m` exited {proc.returncode}: "
                        f"{proc.stderr.strip()[:200]}", "check the driver")]
    from ..topology.nvidia_smi import parse_nvidia_smi

    try:
        lay = parse_nvidia_smi(proc.stdout)
    except ValueError as exc:
        return [Finding("warn", "gpu links", f"cannot parse `nvidia-smi topo -m`: {exc}")]
    return [Finding("info", "gpu links", f"nvidia-smi: {lay!r}"[:400])]


def start_of_run_check(groups: ReducerGroups, *, sysfs_root: str | None = None, probe: bool = True,
                       nbytes: int = 1 << 20, tolerance: float = 2.0, device=None,
                       nvidia_smi: bool = True) -> list[Finding]:
    """IB ports + GPU link matrix (local) + group probes (collective over the DP group).

    Every rank must call it (the probes are collectives). Warnings are logged on DP position 0.
    """
    from ..topology.sysfs_ib import DEFAULT_SYSFS_ROOT, read_ib_ports

    root = sysfs_root or DEFAULT_SYSFS_ROOT
    try:
        findings = check_ib(read_ib_ports(root), root)
    except ValueError as exc:
        findings = [Finding("warn", "infiniband", str(exc))]
    if nvidia_smi:
        findings += check_gpu_links()
    if probe:
        findings += check_probe(probe_groups(groups, nbytes=nbytes, device=device), groups.plan, tolerance=tolerance)
    if groups.position == 0:
        for f in findings:
            if f.level in ("warn", "error"):
                log.warning("topo_align: health: %s: %s %s", f.what, f.detail, f"({f.fix})" if f.fix else "")
    return findings


# ---------------------------------------------------------------------- the probe job

def main(argv: list[str] | None = None) -> int:
    """Probe job: every rank joins (env:// rendezvous), plans (config ``--config`` or hostnames),
    probes; DP position 0 writes ``{"findings", "probe", "plan_reason"}`` to ``--json``."""
    import argparse
    import datetime

    from ..config import TopoAlignConfig
    from .groups import build_groups, discover_plan

    ap = argparse.ArgumentParser(prog="python -m topo_integrations.reducer.health")
    ap.add_argument("--json", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    cfg = TopoAlignConfig.from_file(a.config) if a.config else TopoAlignConfig()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.timeout_s))
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    groups = build_groups(discover_plan(cfg), timeout_s=a.timeout_s)
    res = probe_groups(groups, nbytes=a.nbytes, device=device)
    findings = check_probe(res, groups.plan)
    if dist.get_rank() == 0:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"findings": [f.to_json() for f in findings], "probe": res.to_json(),
                       "plan_reason": groups.plan.reason}, fh)
    dist.destroy_process_group()
    return 0


def run_probe_job(*, nproc: int = 2, emulate_topology: str | None = None, timeout: float = 180.0,
                  config: str | None = None, cluster=None) -> dict:
    """Run the probe job under torchrun on this host (``nproc`` ranks), on the emulated cluster of
    ``emulate_topology`` (a JSON topology; needs root), or on a running ``cluster`` (an
    :class:`EmulatedCluster`, e.g. with a link slowed by the caller). Returns the JSON of DP position 0.
    Raises ValueError (one line) when the job fails."""
    with tempfile.TemporaryDirectory(prefix="topo-align-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = ["-m", "topo_integrations.reducer.health", "--json", out]
        if config:
            cmd += ["--config", config]
        if emulate_topology or cluster is not None:
            import io

            buf = io.StringIO()
            if cluster is not None:
                res = cluster.launch([sys.executable, *cmd], timeout=timeout, out=buf, port=29400)
            else:
                from ..emulate import EmulatedCluster
                from ..topology.file_source import load_topology_file

                with EmulatedCluster(load_topology_file(emulate_topology)) as cl:
                    res = cl.launch([sys.executable, *cmd], timeout=timeout, out=buf)
            code, tail = res.exit_code, buf.getvalue()
        else:
            if not 1 <= nproc <= 1024:
                raise ValueError(f"--probe-nproc {nproc}; expected an integer in [1, 1024]")
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", str(nproc), *cmd], capture_output=True, text=True,
                                  timeout=timeout)
            code, tail = proc.returncode, proc.stdout + proc.stderr
        if code != 0 or not os.path.exists(out):
            last = [ln for ln in tail.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            raise ValueError(f"probe job failed (exit {code}): {last[0][:300]}")
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


if __name__ == "__main__":
    sys.exit(main())
