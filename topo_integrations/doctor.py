"""`topo-align doctor`: check NCCL/UCX/PyTorch settings, IB ports and whether the tiers differ enough.

Facts come from the NCCL 2.30 source (src/misc/param.cc, src/graph/tuning.cc, src/transport/) and the
NCCL and PyTorch environment-variable docs; docs/cli.md ("doctor") lists them. Every finding names the
variable, its value, what is wrong and the valid alternative. Pure: the environment, the sysfs root
and the topology are parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

from .topology.model import Topology
from .topology.planner import PlanError, plan_groups
from .topology.sysfs_ib import IBPort, read_ib_ports

__all__ = ["Finding", "check_env", "check_ib", "check_topology", "run_doctor", "NCCL_ALGOS", "NCCL_PROTOS"]

NCCL_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("LL", "LL128", "Simple")
_PATH_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "sendrecv", "alltoall")


@dataclass(frozen=True)
class Finding:
    level: str
    """``error`` (will fail or misbehave), ``warn`` (no effect / likely a mistake), ``ok``, ``info``."""
    what: str
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _token_list(value: str, valid: tuple[str, ...]) -> list[str]:
    """Tokens of an NCCL_ALGO/NCCL_PROTO value not in ``valid`` (case-insensitive; ``^`` excludes;
    since NCCL 2.24 also ``allreduce:ring,tree;allgather:...``)."""
    bad = []
    lower = {v.lower() for v in valid}
    for part in value.split(";"):
        part = part.strip()
        if ":" in part:
            coll, _, part = part.partition(":")
            if coll.strip().lower() not in _COLLECTIVES:
                bad.append(coll.strip() + ":")
        part = part.strip().lstrip("^")
        for tok in part.split(","):
            tok = tok.strip()
            if tok and tok.lower() not in lower:
                bad.append(tok)
            elif not tok and part:
                bad.append("(empty)")
    return bad


def _int(v: str) -> int | None:
    try:
        return int(v.strip(), 0)
    except ValueError:
        return None


def check_env(env: Mapping[str, str], *, ib_active: bool) -> list[Finding]:
    out: list[Finding] = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        bad = _token_list(algo, NCCL_ALGOS)
        if bad or not algo.strip():
            out.append(
                Finding(
                    "error",
                    "NCCL_ALGO",
                    f"NCCL_ALGO={algo!r}: {', '.join(repr(b) for b in bad) or 'empty'} is not an NCCL algorithm "
                    f"(accepted: {', '.join(NCCL_ALGOS)}); NCCL >= 2.24 fails at init, "
                    "older versions disable every algorithm",
                    "leave NCCL_ALGO unset (NCCL's tuner already uses the topology); for experiments e.g. "
                    "NCCL_ALGO='allreduce:ring,tree'",
                )
            )
        else:
            out.append(Finding("info", "NCCL_ALGO", f"NCCL_ALGO={algo!r} is valid but overrides NCCL's tuner",
                               "unset it unless you are benchmarking one algorithm"))
    proto = env.get("NCCL_PROTO")
    if proto is not None:
        bad = _token_list(proto, NCCL_PROTOS)
        if bad or not proto.strip():
            out.append(Finding("error", "NCCL_PROTO",
                               f"NCCL_PROTO={proto!r}: {', '.join(repr(b) for b in bad) or 'empty'} is not a protocol "
                               f"(accepted: {', '.join(NCCL_PROTOS)})", "leave NCCL_PROTO unset"))
    if "NCCL_TIMEOUT" in env:
        out.append(Finding(
            "warn", "NCCL_TIMEOUT",
            f"NCCL_TIMEOUT={env['NCCL_TIMEOUT']!r} does not exist: neither NCCL nor PyTorch reads it",
            "set the collective timeout with init_process_group(timeout=datetime.timedelta(seconds=600)) "
            "(topo_align.fallback.timeout_s for the plugin's own collectives); failure handling: "
            "TORCH_NCCL_ASYNC_ERROR_HANDLING; transport retries: NCCL_IB_TIMEOUT (exponent, 1-31)"))
    socket_knobs = [k for k in ("NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_NTHREADS") if k in env]
    ns, nt = _int(env.get("NCCL_NSOCKS_PERTHREAD", "1")), _int(env.get("NCCL_SOCKET_NTHREADS", "1"))
    for k in socket_knobs:
        if _int(env[k]) is None or _int(env[k]) < 1:
            out.append(Finding("error", k, f"{k}={env[k]!r}; expected a positive integer", f"unset {k}"))
    if nt is not None and nt > 16:
        out.append(Finding("error", "NCCL_SOCKET_NTHREADS", f"NCCL_SOCKET_NTHREADS={nt} > 16 (NCCL's maximum)",
                           "use at most 16, or unset it"))
    if ns is not None and nt is not None and ns > 0 and nt > 0 and ns * nt > 64:
        out.append(Finding("error", "NCCL_NSOCKS_PERTHREAD",
                           f"NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS = {ns * nt} > 64 (NCCL's MAX_SOCKETS)",
                           "keep the product at most 64, or unset both"))
    ib_used = ib_active and env.get("NCCL_IB_DISABLE", "0").strip() not in ("1",) and \
        env.get("NCCL_NET", "").strip().lower() not in ("socket",)
    if socket_knobs and ib_used:
        out.append(Finding(
            "warn", ",".join(socket_knobs),
            f"{', '.join(f'{k}={env[k]}' for k in socket_knobs)} tune NCCL's socket transport only; "
            "with active InfiniBand NCCL uses NET/IB and ignores them",
            "remove them; on IB leave the NCCL_IB_* settings at their defaults"))
    if "NCCL_IB_TIMEOUT" in env:
        v = _int(env["NCCL_IB_TIMEOUT"])
        if v is None or not 1 <= v <= 31:
            out.append(
                Finding(
                    "error",
                    "NCCL_IB_TIMEOUT",
                    f"NCCL_IB_TIMEOUT={env['NCCL_IB_TIMEOUT']!r}; it is an exponent (4.096 us x 2^N), accepted 1-31",
                    "leave it unset (default 20, about 4.3 s per retry, in NCCL >= 2.23)",
                )
            )
    for k in ("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL"):
        if k in env:
            v = env[k].strip()
            if v.upper() not in _PATH_LEVELS and _int(v) is None:
                out.append(Finding("error", k, f"{k}={v!r}; accepted: {', '.join(_PATH_LEVELS)} (or an integer level)",
                                   f"leave {k} unset"))
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in env:
        v = _int(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"])
        if v is None or not 0 <= v <= 3:
            out.append(
                Finding(
                    "error",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    f"TORCH_NCCL_ASYNC_ERROR_HANDLING={env['TORCH_NCCL_ASYNC_ERROR_HANDLING']!r}; accepted 0, 1, 2, 3",
                    "leave it unset (default 3)",
                )
            )
    ucx = sorted(k for k in env if k.startswith("UCX_"))
    if ucx:
        plugin = (
            env.get("NCCL_PLUGIN_P2P", "").strip().lower() == "ucx" or "ucx" in env.get("NCCL_NET_PLUGIN", "").lower()
        )
        if not plugin:
            out.append(Finding(
                "warn", ",".join(ucx),
                f"{', '.join(f'{k}={env[k]}' for k in ucx)} configure UCX (MPI/UCC), not NCCL; no effect on NCCL "
                "unless its UCX net plugin is used (NCCL_PLUGIN_P2P=ucx)",
                "for NCCL: nothing to set (GPUDirect RDMA is automatic with nvidia-peermem or DMA-BUF; tune with "
                "NCCL_NET_GDR_LEVEL); select HCAs with NCCL_IB_HCA only if auto-selection is wrong"))
    return out


def check_ib(ports: list[IBPort], root: str) -> list[Finding]:
    if not ports:
        return [Finding("info", "infiniband", f"no InfiniBand devices under {root}")]
    out = []
    for p in ports:
        label = f"{p.device} port {p.port}"
        desc = f"{p.state}/{p.phys_state}, {p.rate_gbit:g} Gb/s, {p.link_layer}"
        if p.healthy:
            out.append(Finding("ok", label, desc))
        else:
            hint = {"Polling": "no cable or peer", "Disabled": "port disabled"}.get(p.phys_state, "")
            if p.state == "INIT":
                hint = "no subnet manager has configured the port"
            out.append(Finding("warn", label, desc + (f" ({hint})" if hint else ""),
                               "check the cable and the subnet manager, or exclude it with NCCL_IB_HCA"))
    healthy_rates = {p.rate_gbit for p in ports if p.healthy and p.link_layer.lower() == "infiniband"}
    if len(healthy_rates) > 1:
        out.append(Finding("warn", "infiniband", f"active ports run at different rates {sorted(healthy_rates)} Gb/s",
                           "a slow port slows every ring through it; check cables and NCCL_IB_HCA"))
    return out


def check_topology(topo: Topology, *, min_tier_ratio: float = 1.3) -> list[Finding]:
    out = []
    for gb in ("island", "leaf"):
        if gb == "leaf" and len(topo.leaves) < 2:
            continue
        try:
            plan = plan_groups(topo, group_by=gb, min_tier_ratio=min_tier_ratio)
        except PlanError as exc:
            out.append(Finding("warn", f"tiers (group_by {gb})", str(exc), "use mode 'flat' or equal groups"))
            continue
        if plan.hierarchical:
            out.append(Finding("ok", f"tiers (group_by {gb})",
                               f"{plan.reason}: differ by >= {min_tier_ratio:g}x, the plugin can help"))
        else:
            out.append(Finding("info", f"tiers (group_by {gb})", f"{plan.reason}: the plugin falls back to flat",
                               "flat all-reduce is right here" if gb == "island" else ""))
    return out


def run_doctor(
    env: Mapping[str, str],
    *,
    sysfs_root: str,
    topo: Topology | None = None,
    min_tier_ratio: float = 1.3,
) -> tuple[list[Finding], list[IBPort]]:
    ports = read_ib_ports(sysfs_root)
    ib_active = any(p.healthy and p.link_layer.lower() == "infiniband" for p in ports)
    findings = check_env(env, ib_active=ib_active)
    findings += check_ib(ports, sysfs_root)
    if topo is not None:
        findings += check_topology(topo, min_tier_ratio=min_tier_ratio)
    return findings, ports
