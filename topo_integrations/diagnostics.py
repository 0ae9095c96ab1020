"""Diagnostics above the reducer: findings from link probes, the GPU link matrix, a start-of-run
check, and the probe job that ``topo-align doctor --probe`` runs (docs/reliability.md).

The reducer measures (:func:`topo_integrations.reducer.wire.health.probe_groups`: latency and bus
bandwidth of every intra group and rail, gathered on every rank); this module judges the numbers
and reports them as ``topo-align doctor`` findings, and runs the probe job under torchrun or on the
emulated cluster. It sits above the reducer in the layering (docs/design.md, "Layers"): it may
import the reducer, ``doctor`` and ``emulate``; the reducer imports none of them.

* :func:`check_probe` compares a probe with the plan: a group whose bus bandwidth is below its
  tier's planned GB/s divided by ``tolerance``, or ``tolerance`` times below the median of its tier
  (a congested leaf), gets a ``warn`` finding that names the group and its ranks.
* :func:`check_gpu_links`: ``nvidia-smi topo -m`` when ``nvidia-smi`` is on PATH.
* :func:`start_of_run_check` = IB ports (sysfs, as ``topo-align doctor``) + GPU links + the probes;
  warnings go to the ``topo_align`` logger on DP position 0. Every rank calls it once the reducer's
  groups exist (opt-in).
* ``python -m topo_integrations.diagnostics --json OUT`` is the probe job (:func:`main`);
  :func:`run_probe_job` starts it.
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

from .doctor import Finding, check_ib

__all__ = ["check_probe", "check_gpu_links", "start_of_run_check", "run_probe_job", "main", "PROBE_MODULE"]

log = logging.getLogger("topo_align")

PROBE_MODULE = "topo_integrations.diagnostics"
"""The module ``python -m`` runs as the probe job."""


def check_probe(result, plan, *, tolerance: float = 2.0) -> list[Finding]:
    """Findings for a :class:`~topo_integrations.reducer.wire.health.ProbeResult`: a group below its
    tier's planned bandwidth / ``tolerance``, or ``tolerance`` times slower than the median group of
    its kind (e.g. one congested leaf); ``ok`` otherwise."""
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
    from .topology.nvidia_smi import parse_nvidia_smi

    try:
        lay = parse_nvidia_smi(proc.stdout)
    except ValueError as exc:
        return [Finding("warn", "gpu links", f"cannot parse `nvidia-smi topo -m`: {exc}")]
    return [Finding("info", "gpu links", f"nvidia-smi: {lay!r}"[:400])]


def start_of_run_check(groups, *, sysfs_root: str | None = None, probe: bool = True,
                       nbytes: int = 1 << 20, tolerance: float = 2.0, device=None,
                       nvidia_smi: bool = True) -> list[Finding]:
    """IB ports + GPU link matrix (local) + group probes (collective over the DP group of
    ``groups``, a :class:`~topo_integrations.reducer.plan.groups.ReducerGroups`).

    Every rank must call it (the probes are collectives). Warnings are logged on DP position 0.
    """
    from .topology.sysfs_ib import DEFAULT_SYSFS_ROOT, read_ib_ports

    root = sysfs_root or DEFAULT_SYSFS_ROOT
    try:
        findings = check_ib(read_ib_ports(root), root)
    except ValueError as exc:
        findings = [Finding("warn", "infiniband", str(exc))]
    if nvidia_smi:
        findings += check_gpu_links()
    if probe:
        from .reducer.wire.health import probe_groups

        result = probe_groups(groups, nbytes=nbytes, device=device)
        findings += check_probe(result, groups.plan, tolerance=tolerance)
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

    import torch
    import torch.distributed as dist

    from .config import TopoAlignConfig
    from .reducer.plan.discover import discover_plan
    from .reducer.plan.groups import build_groups
    from .reducer.wire.health import probe_groups

    ap = argparse.ArgumentParser(prog=f"python -m {PROBE_MODULE}")
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
    :class:`~topo_integrations.emulate.EmulatedCluster`, e.g. with a link slowed by the caller).
    Returns the JSON of DP position 0. Raises ValueError (one line) when the job fails."""
    with tempfile.TemporaryDirectory(prefix="topo-align-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = ["-m", PROBE_MODULE, "--json", out]
        if config:
            cmd += ["--config", config]
        if emulate_topology or cluster is not None:
            import io

            buf = io.StringIO()
            if cluster is not None:
                res = cluster.launch([sys.executable, *cmd], timeout=timeout, out=buf, port=29400)
            else:
                from .emulate import EmulatedCluster
                from .topology.file_source import load_topology_file

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
