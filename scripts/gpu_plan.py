"""The GPU check's cases and its plan for a machine (scripts/gpu_check.py; docs/reliability.md, "GPU check").

Pure Python, no torch: the driver refuses a mistyped case before importing torch, and the tests check
the planning for any GPU count without a GPU. A case is one check at one world size on one backend:

* ``nccl``: one GPU per rank (NCCL refuses two ranks on one GPU), so a case of world N needs N GPUs;
* ``gloo``: ranks share the GPUs (rank r on GPU r % count); gloo reduces CUDA tensors by staging them
  through pinned host memory, so four ranks on one GPU run the multi-rank logic (2 islands x 2) with
  the reducer on CUDA (its completion by CUDA events, its communication stream);
* ``-``: one process, no communication (the wire's kernels).

The plan for a machine (:func:`plan`): with one GPU every adapter at world 1 on NCCL, the schedule's
streams and its abort path on NCCL, the adapters under ``torch.cuda.set_sync_debug_mode``, the 2 x 2
gloo cases on CUDA tensors and the int8 wire's bandwidth; two GPUs add the 2-rank NCCL cases; four add
every adapter case on 4 NCCL ranks. A case asked for by name that the machine cannot run is a failure
that says why; nothing is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Case", "Result", "CASES", "EXCLUDED", "plan", "worlds", "unknown", "unknown_message",
           "no_gpu_message", "table", "summary_line", "exit_code", "case_list", "START_S"]

START_S = 120.0
"""Added to a world's time limit for starting its ranks (imports, CUDA and communicator set-up)."""

# Exit statuses of scripts/gpu_check.py.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3


@dataclass(frozen=True)
class Case:
    name: str
    """What the rank-side runner of ``family`` runs."""
    family: str
    """The runner (scripts/gpu_world.py, RUNNERS); cases of one family, world and backend share a world."""
    world: int
    backend: str
    """``nccl``, ``gloo`` or ``-`` (no communication)."""
    timeout_s: float
    what: str

    @property
    def id(self) -> str:
        return self.name if self.backend == "-" else f"{self.name}@{self.backend}{self.world}"

    @property
    def gpus_needed(self) -> int:
        return self.world if self.backend == "nccl" else 1

    @property
    def key(self) -> tuple[str, int, str]:
        return self.family, self.world, self.backend


@dataclass
class Result:
    case: Case
    result: str
    """``PASS`` or ``FAIL``."""
    seconds: float
    detail: str
    data: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        c = self.case
        return {"case": c.id, "name": c.name, "world": c.world, "backend": c.backend, "result": self.result,
                "seconds": round(self.seconds, 2), "detail": self.detail, "data": self.data}


_TORCH = ("grouped-reducer-hierarchical", "grouped-reducer-selective", "grouped-reducer-default",
          "grouped-reducer-auto", "ddp-hook-hierarchical", "ddp-hook-selective")
_DEEPSPEED = tuple(f"deepspeed-zero{s}-hierarchical" for s in range(4)) + tuple(
    f"deepspeed-zero{s}-selective" for s in range(3))  # selective is refused at ZeRO-3 (docs/deepspeed.md)
_MEGATRON = ("megatron-ddp-hierarchical", "megatron-distopt-hierarchical", "megatron-ddp-selective",
             "megatron-distopt-selective")
_ADAPTERS = ("grouped-reducer", "ddp-hook", "deepspeed", "megatron")
_FAMILY_OF = {**{n: "torch" for n in _TORCH}, **{n: "deepspeed" for n in _DEEPSPEED},
              **{n: "megatron" for n in _MEGATRON}}
_TIMEOUT = {"torch": 120.0, "deepspeed": 150.0, "megatron": 180.0}

EXCLUDED = {
    ("megatron-ddp-hierarchical", "gloo"): "its reference, stock megatron-core DDP, coalesces every bucket "
    "collective (torch's _coalescing_manager -> allreduce_coalesced), which gloo runs on CPU tensors only",
    ("megatron-distopt-hierarchical", "gloo"): "as megatron-ddp-hierarchical, and the distributed optimizer "
    "gathers its parameters with coalesced all-gathers (gloo's has no CUDA path)",
    ("megatron-distopt-selective", "gloo"): "the distributed optimizer gathers its parameters with coalesced "
    "all-gathers (gloo's has no CUDA path)",
}
"""Adapter cases that gloo cannot run on CUDA tensors, with the reason (``--list`` prints them): the
suite runs them on gloo and CPU, a 4-GPU machine on NCCL."""


def _adapter_cases(backend: str) -> list[Case]:
    out = []
    for name in (*_TORCH, *_DEEPSPEED, *_MEGATRON):
        if (name, backend) in EXCLUDED:
            continue
        fam = _FAMILY_OF[name]
        mode = name.rsplit("-", 1)[1]
        what = ("equal to the framework's flat all-reduce within 1e-6" if mode == "hierarchical" else
                "shipped config: every tensor SYNC on the int8 wire" if mode == "default" else
                "method auto: compute of steps 2-5 timed on the device, one choice on every rank" if mode == "auto"
                else "SYNC identical on all ranks, LOCAL per island, all after reconciliation")
        out.append(Case(name, fam, 4, backend, _TIMEOUT[fam], f"2 islands x 2; {what}"))
    return out


def _cases() -> list[Case]:
    single = [Case(a, "single", 1, "nccl", 150.0 if a in ("deepspeed", "megatron") else 90.0,
                   "world 1: one tier, the adapter runs beside the plain framework; parameters bitwise equal")
              for a in _ADAPTERS]
    sync1 = [Case(f"sync-debug-{a}", "sync", 1, "nccl", 150.0, "steps under torch.cuda.set_sync_debug_mode: "
                  "no host synchronisation in topo-align's code") for a in _ADAPTERS]
    sync4 = [Case(c.name, c.family, 4, "nccl", c.timeout_s, c.what) for c in sync1]
    return [
        Case("wire-bandwidth", "wire", 1, "-", 120.0, "int8 pack/unpack and the fp32 owner sum vs a device copy and "
             "the nominal HBM bandwidth"),
        Case("streams", "single", 1, "nccl", 60.0, "the schedule's communication stream: ordered after the "
             "producer, waited for by the consumer, no host wait"),
        *single,
        *sync1,
        Case("abort", "abort", 1, "nccl", 60.0, "a collective stuck past fallback.timeout_s: named error, NCCL "
             "communicators aborted, later calls fail at once"),
        *_adapter_cases("gloo"),
        Case("engine", "engine", 2, "nccl", 120.0, "the engine on 2 NCCL ranks: equal to NCCL's all-reduce, "
             "device timings, the same collectives on both ranks"),
        Case("abort-peer", "engine", 2, "nccl", 90.0, "a peer that never calls: the named error within "
             "fallback.timeout_s"),
        *_adapter_cases("nccl"),
        *sync4,
    ]


CASES: list[Case] = _cases()
_BY_ID = {c.id: c for c in CASES}
CPU_FAMILIES = ("torch", "deepspeed", "megatron")
"""``--device cpu`` runs these families' gloo cases on CPU (the suite's check of the case code)."""


def unknown(wanted: list[str]) -> list[str]:
    """The names in ``wanted`` that are no case id."""
    return [w for w in wanted if w not in _BY_ID]


def unknown_message(bad: list[str]) -> str:
    return f"gpu_check: unknown case(s) {bad}; expected some of {[c.id for c in CASES]}"


def no_gpu_message(torch_version: str, cuda_version: str | None) -> str:
    """The refusal on a machine where torch sees no GPU (exit status 3)."""
    why = ("is a CPU build (torch.version.cuda is None)" if cuda_version is None else
           f"(CUDA {cuda_version}) sees no GPU (torch.cuda.is_available() is False)")
    return (f"gpu_check: no GPU: torch {torch_version} {why}; run it where a GPU is visible, with a CUDA build of "
            "torch (PYTHON=/path/to/python bash scripts/gpu_check.sh); nothing was run")


def why_not(case: Case, gpus: int, *, cpu: bool = False) -> str | None:
    """Why ``case`` cannot run on this machine (``gpus`` visible; ``cpu``: the ``--device cpu`` run), or None."""
    if cpu:
        if case.backend == "gloo" and case.family in CPU_FAMILIES:
            return None
        return "needs CUDA (--device cpu runs only the gloo adapter cases, on CPU)"
    if gpus < 1:
        return "needs a GPU"
    if case.gpus_needed > gpus:
        return f"needs {case.gpus_needed} GPUs (one per NCCL rank), found {gpus}"
    return None


def plan(gpus: int, wanted: list[str] | None = None, *, cpu: bool = False) -> list[tuple[Case, str | None]]:
    """``[(case, why it cannot run or None)]`` in the cases' order: every case this machine can run
    (``wanted`` empty), or exactly the ``wanted`` ones, each with why it cannot run where that is so."""
    if wanted:
        want = set(wanted)
        return [(c, why_not(c, gpus, cpu=cpu)) for c in CASES if c.id in want]
    return [(c, None) for c in CASES if why_not(c, gpus, cpu=cpu) is None]


def worlds(cases: list[Case]) -> list[list[Case]]:
    """Consecutive cases of one family, world size and backend run in one world, in order."""
    out: list[list[Case]] = []
    for c in cases:
        if out and out[-1][0].key == c.key:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def world_timeout_s(cases: list[Case]) -> float:
    """The whole world's limit: its cases' own limits and the start."""
    return sum(c.timeout_s for c in cases) + START_S


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(results: list[Result], *, detail_width: int = 100) -> str:
    """The summary: one row per case (case, world, backend, result, seconds, detail)."""
    rows = [("case", "world", "backend", "result", "seconds", "detail")]
    rows += [(r.case.id, str(r.case.world), r.case.backend, r.result, f"{r.seconds:.1f}",
              _clip(r.detail.replace("\n", " "), detail_width)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[i].ljust(widths[i]) if i in (0, 2, 3) else row[i].rjust(widths[i]) for i in range(5)]
        lines.append("  ".join(cells + [row[5]]).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(lines)


def summary_line(results: list[Result], seconds: float) -> str:
    passed = sum(r.result == "PASS" for r in results)
    return f"gpu_check: {passed} passed, {len(results) - passed} failed in {seconds:.0f} s"


def exit_code(results: list[Result]) -> int:
    """0 when every case passed; 1 when one failed or could not run (an empty plan is a failure too)."""
    return EXIT_OK if results and all(r.result == "PASS" for r in results) else EXIT_FAILED


def case_list() -> str:
    """Every case with its world, backend, GPUs, time limit and what it checks (``--list``)."""
    rows = [("case", "world", "backend", "GPUs", "limit s", "checks")]
    rows += [(c.id, str(c.world), c.backend, str(c.gpus_needed), f"{c.timeout_s:.0f}", c.what) for c in CASES]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join([r[i].ljust(widths[i]) for i in range(5)] + [r[5]]) for r in rows]
    lines.append("")
    lines += [f"not run on gloo with CUDA tensors: {name}: {why}" for (name, _), why in EXCLUDED.items()]
    return "\n".join(lines)
