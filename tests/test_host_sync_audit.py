"""Every host synchronisation and every object collective of the modules the training step runs
through is listed here, each with its reason (issue 40); a new one fails until it is justified.

What counts (an AST scan, :func:`scan`):

* object collectives: every call whose name contains ``_object`` (``all_gather_object``,
  ``broadcast_object_list``, ...): they pickle on the host and block the caller; on NCCL their bytes
  go to the calling thread's current CUDA device (reducer/watch/thread_device.py);
* host reads of device values: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``,
  and ``float(t)`` / ``int(t)`` / ``bool(t)`` of a value the scan can tell is a tensor (the result
  of a ``torch.*`` call or of a tensor method, a name assigned one in the same function, a parameter
  annotated ``torch.Tensor``); on CUDA each waits for the device's queued work;
* blocking waits: ``.synchronize()`` and ``.wait()`` without arguments (a ``Work``'s or a future's
  wait). ``engine.wait(fut)`` / ``Dispatcher.wait(fut)`` take the future as an argument: they are
  the schedule's bounded wait (a stream wait on CUDA), the sanctioned way, and are not listed.

Where: every module of the packages the step runs through -- ``reducer/`` (the engine and all it
calls), ``torch/``, ``deepspeed/``, ``megatron/`` (the adapters: their seams run inside the
framework's step) -- except EXCLUDED, modules that never run inside a training step (launchers,
self-checks, test and benchmark harnesses, the CPU stand-ins for Megatron's CUDA kernels), each
with its reason. Set-up code that shares a module with the step (discovery, the plan broadcast, the
start-of-run check, checkpoints) is listed too, its reason saying when it runs: a scan cannot tell
when a function runs, a reader can.

ALLOWED maps (module, enclosing function, what) to (count, reason): keyed by file and function,
not by line, so edits elsewhere do not touch it. A new occurrence (a key not listed, or more of
them than counted) fails naming file, line and function; a listed one that no longer occurs (or
fewer) fails as stale, so the list only says what is true.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "topo_integrations"
SCANNED = ("reducer", "torch", "deepspeed", "megatron")

pytestmark = pytest.mark.timeout(60)

EXCLUDED = {
    "deepspeed/__main__.py": "the launcher self-check entry point (python -m topo_integrations.deepspeed), outside "
                             "training",
    "deepspeed/selfcheck.py": "the launcher self-check: runs once, before or instead of training",
    "deepspeed/harness.py": "test and benchmark harness: compares replicas from outside the adapter",
    "deepspeed/hf_harness.py": "test harness: a synthetic Hugging Face dataset and trainer set-up",
    "megatron/__main__.py": "the launcher (python -m topo_integrations.megatron pretrain_gpt.py ARGS)",
    "megatron/testing.py": "test helpers for megatron-core runs on CPU",
    "megatron/cpu_compat.py": "CPU stand-ins for Megatron's CUDA-only pieces; never active when CUDA is available "
                              "(tests/test_megatron_unit.py)",
}

HOST_READS = {"item", "tolist", "cpu", "numpy"}
TENSOR_METHODS = {
    "sqrt", "sum", "pow", "norm", "abs", "mean", "max", "min", "amax", "amin", "prod", "double", "float", "half",
    "bfloat16", "to", "clone", "detach", "reshape", "view", "flatten", "contiguous", "any", "all", "isfinite",
    "mul", "div", "add", "sub", "square", "squeeze", "unsqueeze", "cuda", "new_tensor", "new_zeros", "new_ones",
    "agree", "global_grad_norm_sq",
}
"""Methods whose result the scan takes for a tensor (for ``float(t)`` and friends)."""

SETUP = "set-up, once per run before any step (not in the step)"
SETUP_OBJECT = (SETUP + "; the object's bytes go to this rank's device: the caller's thread, or a helper thread "
                "started on it (reducer/watch/thread_device.py)")
CHECKPOINT = "checkpoint save: state goes to the host by definition (the save itself waits for the device)"
HOST_COPY = ("reads a host copy made on the communication stream inside the agreement (Wire.agree_later), "
             "already landed: no device sync")
STREAM_WAIT = ("a CUDA-aware future's wait after the schedule's bounded wait: on CUDA the caller's stream waits "
               "for the data, the host does not; on the CPU the data has arrived")

ALLOWED: dict[tuple[str, str, str], tuple[int, str]] = {
    # -- object collectives: set-up only ---------------------------------------------------------
    ("reducer/plan/discover.py", "gather_facts", "all_gather_object()"): (1, SETUP_OBJECT),
    ("reducer/plan/discover.py", "_probe", "broadcast_object_list()"): (1, SETUP_OBJECT),
    ("reducer/plan/discover.py", "_probe", "all_gather_object()"): (2, SETUP_OBJECT),
    ("reducer/plan/discover.py", "discover_auto", "broadcast_object_list()"): (1, SETUP_OBJECT),
    ("reducer/plan/discover.py", "discover_plan", "broadcast_object_list()"): (2, SETUP_OBJECT),
    ("reducer/plan/discover.py", "discover_plan", "all_gather_object()"): (1, SETUP_OBJECT),
    ("reducer/plan/planning.py", "broadcast_plan", "broadcast_object_list()"): (
        1, SETUP_OBJECT + "; also at an adaptive regroup, a rare step chosen by every rank alike"),
    ("reducer/wire/replicas.py", "all_dp_layouts", "all_gather_object()"): (1, SETUP_OBJECT),
    ("reducer/schedule/dispatch.py", "Dispatcher.end_step", "all_gather_object()"): (
        1, "monitor.check_collectives only (a debugging check, off by default): the step's fingerprints are "
           "compared on the host; bounded, in a helper thread on the caller's device"),
    # -- set-up: timing probes and the start-of-run check ------------------------------------------
    ("reducer/plan/discover.py", "_timed", ".wait()"): (
        1, SETUP + ": topology.probe times an all-reduce to completion"),
    ("reducer/plan/discover.py", "_timed", ".synchronize()"): (
        1, SETUP + ": topology.probe times an all-reduce to completion"),
    ("reducer/wire/health.py", "start_check.verify", ".item()"): (
        2, SETUP + ": the start-of-run check reads each group's member count (the second read only for the error)"),
    ("reducer/wire/health.py", "_time_all_reduce.once", ".synchronize()"): (
        1, "link probes (topo-align doctor --probe, an adaptive regroup's measurement): a timing to completion "
           "needs the stream synchronised"),
    ("reducer/wire/health.py", "probe_groups", ".cpu()"): (
        1, "link probes (doctor, an adaptive regroup): the gathered timings are judged on the host"),
    ("reducer/wire/health.py", "probe_groups", ".tolist()"): (
        1, "link probes (doctor, an adaptive regroup): the gathered timings are judged on the host"),
    ("reducer/classes/policy.py", "ClassPolicy._initial", ".cpu()"): (
        1, SETUP + ": the first classes are decided on the host from the parameters' magnitudes"),
    ("reducer/classes/policy.py", "ClassPolicy._initial", ".tolist()"): (
        1, SETUP + ": the first classes are decided on the host from the parameters' magnitudes"),
    # -- checkpoints and on-request checks ---------------------------------------------------------
    ("reducer/classes/importance.py", "Importance.state_dict", ".cpu()"): (2, CHECKPOINT),
    ("reducer/reconcile/reconcile.py", "PendingAverage.state_dict", ".cpu()"): (1, CHECKPOINT),
    ("reducer/reconcile/reconciler.py", "Reconciler.state_dict.to_cpu", ".cpu()"): (1, CHECKPOINT),
    ("reducer/wire/wire.py", "Wire.residual_state", ".cpu()"): (1, CHECKPOINT),
    ("torch/consistency.py", "verify_replicas", ".cpu()"): (
        1, "verify_consistency(), on request (tests, monitoring): the fingerprints are compared on the host"),
    ("deepspeed/adapter.py", "DeepSpeedTopo.last_clip_norm", ".item()"): (
        1, "the clip norm is read on the host only when asked for (the monitor every log_interval steps, tests); "
           "the step keeps it on the device"),
    # -- in the step, needed there -------------------------------------------------------------------
    ("reducer/wire/wire.py", "Wire.agree_later.fn", '.to("cpu")'): (
        1, "the one host copy of agreed control values: on CUDA non-blocking, on the communication stream "
           "inside the agreement item (done when the item has landed: no drain of the training stream); "
           "blocking only for a Wire without a dispatcher (outside an engine)"),
    ("reducer/classes/drift.py", "DriftMonitor._read", ".tolist()"): (
        1, HOST_COPY + "; read when landed (polled every step) or when a promotion decision needs it"),
    ("reducer/schedule/dispatch.py", "Dispatcher._window_chunks", ".tolist()"): (
        1, HOST_COPY + "; k decides which reconciliation chunks are released now, identically on every rank "
                       "(asynchronous reconciliation steps only)"),
    ("reducer/engine/engine.py", "Engine.refresh_classes", ".tolist()"): (
        1, HOST_COPY + "; the classes are decided on the host (refresh steps only, after a blocking reconciliation)"),
    ("reducer/engine/engine.py", "Engine.agree_overflow", ".item()"): (
        1, HOST_COPY + "; the frameworks' has_overflow returns a host bool (DeepSpeed's own check reads it too)"),
    ("reducer/adaptive/adaptive.py", "AdaptiveController.after_step", ".tolist()"): (
        1, HOST_COPY + "; the adaptive level is decided on the host (every adaptive.check_interval steps)"),
    ("reducer/adaptive/adaptive.py", "AdaptiveController.after_step", ".item()"): (
        1, "the broadcast level selects the next steps' groups and dtypes on the host (every "
           "adaptive.check_interval steps, after the bounded wait for the broadcast)"),
    ("reducer/adaptive/adaptive.py", "AdaptiveController._maybe_regroup", ".item()"): (
        1, "the broadcast regroup choice decides on the host whether the groups are rebuilt (adaptive checks "
           "only, after the bounded wait for the broadcast)"),
    # method: auto (issue 38): once after the timed steps, and again only when the slow tier moved
    ("reducer/adaptive/method.py", "MethodAuto._choose", ".cpu()"): (
        1, "the broadcast method choice decides on the host which keys the engine reconfigures with (once "
           "after the timed steps, again only on a re-choice)"),
    ("reducer/adaptive/method.py", "MethodAuto._choose", ".tolist()"): (
        1, "the same broadcast choice, read as two host integers"),
    ("reducer/adaptive/method.py", "MethodAuto._after_step_cuda", ".synchronize()"): (
        1, "CUDA, once per run: the host waits for the last timed step's end event, so that the timed steps' "
           "device times can be read for the method choice that follows"),
    ("reducer/adaptive/method.py", "int8_codec_seconds", ".synchronize()"): (
        2, "CUDA, once per run, right after the timed steps: the int8 wire's codec is timed between two "
           "device waits for the method choice (a re-choice does not time it again)"),
    ("reducer/adaptive/method.py", "MethodAuto._apply", ".tolist()"): (
        1, "the importance ranking of a switch to a LOCAL class is made on the host, as at a class refresh: "
           "the magnitudes agreed over the DP group (copied to the host inside the agreement) as host floats "
           "for ClassPolicy.classify (at the switch only, after the blocking reconciliation)"),
    ("reducer/adaptive/adaptive.py", "AdaptiveController._probe.probe", ".synchronize()"): (
        1, "the adaptive probe times an all-reduce to completion (adaptive checks that want a probe only)"),
    ("reducer/schedule/dispatch.py", "Dispatcher.collect", ".wait()"): (
        1, STREAM_WAIT + " (a device value of an agreement, e.g. the clip norm: CUDA only)"),
    ("reducer/schedule/dispatch.py", "Dispatcher.wait", ".wait()"): (2, STREAM_WAIT + "; a future the schedule no "
                                                                       "longer holds is already complete"),
    ("deepspeed/zero.py", "SelectiveZeroMixin.scaled_global_norm", ".item()"): (
        1, "only for a DeepSpeed whose scaled_global_norm returns a host float (older releases): it gets a float "
           "back; with a tensor norm (the pinned release) the step stays on the device"),
    ("megatron/optimizer.py", "make_grad_stats_global.get_grad_norm", ".item()"): (
        1, "Megatron's get_grad_norm returns a host float (its own get_grad_norm_fp32 reads the norm on the host "
           "before we see it): the agreed norm goes back the same way"),
    ("megatron/optimizer.py", "MegatronReconcileSource.written", ".wait()"): (
        1, "Megatron's own overlapped parameter all-gather handle, finished before the forced re-gather "
           "(reconciliation steps only); on NCCL a Work's wait makes the stream wait, not the host"),
}


# ------------------------------------------------------------------------------------------ the scan

def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _tensorish(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` is, as far as the scan can tell, a tensor."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute):
            if f.attr in HOST_READS:
                return False
            if f.attr in TENSOR_METHODS:
                return True
            return _dotted(f).count(".") == 1 and _dotted(f).startswith("torch.")
        return False
    if isinstance(node, ast.Subscript):
        return _tensorish(node.value, names)
    if isinstance(node, ast.BinOp):
        return _tensorish(node.left, names) or _tensorish(node.right, names)
    if isinstance(node, ast.UnaryOp):
        return _tensorish(node.operand, names)
    if isinstance(node, ast.Compare):
        return _tensorish(node.left, names) or any(_tensorish(c, names) for c in node.comparators)
    return False


def _tensor_names(fn: ast.AST) -> set[str]:
    """Names a function binds to tensors: parameters annotated ``torch.Tensor``, names assigned a
    tensor-looking value (two passes, so ``b = a.sum()`` after ``a = torch.zeros(...)`` counts)."""
    names = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for a in fn.args.args + fn.args.kwonlyargs:
            if a.annotation is not None and _dotted(a.annotation) in ("torch.Tensor", "Tensor"):
                names.add(a.arg)
    for _ in range(2):
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _tensorish(node.value, names):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                    and isinstance(node.target, ast.Name) and _tensorish(node.value, names):
                names.add(node.target.id)
    return names


def _what(call: ast.Call, names: set[str]) -> str | None:
    """What a call is, in the audit's words, or None when it is none of them."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if "_object" in name:
        return f"{name}()"
    if isinstance(f, ast.Attribute):
        if (f.attr in HOST_READS and not call.args) or f.attr == "synchronize":  # sched.item(what, ...) is not
            return f".{f.attr}()"
        if f.attr == "wait" and not call.args and not call.keywords:
            return ".wait()"
        if f.attr == "to":
            dev = [a for a in call.args[:1]] + [k.value for k in call.keywords if k.arg == "device"]
            if any(isinstance(d, ast.Constant) and d.value == "cpu" for d in dev):
                return '.to("cpu")'
    if isinstance(f, ast.Name) and f.id in ("float", "int", "bool") and len(call.args) == 1 \
            and _tensorish(call.args[0], names):
        return f"{f.id}(tensor)"
    return None


def scan(source: str, module: str) -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, what, line) of every occurrence in ``source``. The function is
    the qualified name of the innermost ``def`` (``Class.method``, ``outer.inner``); ``<module>`` at
    module level; a lambda counts as its enclosing function."""
    out = []

    def visit(node: ast.AST, qual: list[str], names: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, qual + [child.name], names | _tensor_names(child))
            elif isinstance(child, ast.ClassDef):
                visit(child, qual + [child.name], set())
            else:
                if isinstance(child, ast.Call):
                    what = _what(child, names)
                    if what is not None:
                        out.append((module, ".".join(qual) or "<module>", what, child.lineno))
                visit(child, qual, names)

    visit(ast.parse(source), [], set())
    return out


def step_path_modules() -> dict[str, Path]:
    """Module path relative to topo_integrations/ -> file, for every scanned module."""
    out = {}
    for part in SCANNED:
        for path in sorted((PKG / part).rglob("*.py")):
            rel = path.relative_to(PKG).as_posix()
            if rel not in EXCLUDED:
                out[rel] = path
    return out


def problems(found: list[tuple[str, str, str, int]], allowed: dict) -> list[str]:
    """Occurrences beyond ALLOWED (new keys, or more than counted) and stale entries."""
    counts = Counter((m, f, w) for m, f, w, _ in found)
    bad = []
    for key, n in sorted(counts.items()):
        listed = allowed.get(key, (0, ""))[0]
        if n > listed:
            lines = ", ".join(str(ln) for m, f, w, ln in found if (m, f, w) == key)
            bad.append(f"topo_integrations/{key[0]}:{lines}: {key[2]} in {key[1]} ({n} found, {listed} listed): "
                       "remove it from the step, or list it in ALLOWED with the reason it must stay")
    for key, (n, _reason) in sorted(allowed.items()):
        if counts.get(key, 0) < n:
            bad.append(f"stale: {key} is listed {n} time(s) but occurs {counts.get(key, 0)}: update ALLOWED")
    return bad


# ------------------------------------------------------------------------------------------ the tests

def test_every_host_sync_and_object_collective_of_the_step_path_is_listed_with_a_reason():
    found = []
    for rel, path in step_path_modules().items():
        found += scan(path.read_text(encoding="utf-8"), rel)
    bad = problems(found, ALLOWED)
    assert not bad, "host synchronisations / object collectives (tests/test_host_sync_audit.py):\n" + "\n".join(bad)


def test_every_entry_has_a_reason_and_every_exclusion_exists():
    assert all(isinstance(r, str) and len(r) > 20 and n >= 1 for n, r in ALLOWED.values())
    for rel in EXCLUDED:
        assert (PKG / rel).is_file(), f"EXCLUDED names {rel}, which does not exist"
        assert rel.split("/")[0] in SCANNED


SAMPLE = '''
import torch
import torch.distributed as dist

class Opt:
    def step(self, grads, norm: torch.Tensor, n: int):
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
        total = sq.sqrt()
        scale = float(total)              # float(tensor): a name bound to a tensor
        ok = bool(norm > 0)               # a parameter annotated torch.Tensor
        k = int(n)                        # a plain int: not listed
        work = dist.all_reduce(sq, async_op=True)
        work.wait()                       # a blocking wait
        self.engine.wait(fut)             # the schedule's bounded wait: not listed
        torch.cuda.current_stream().synchronize()
        host = sq.to("cpu")
        def later():
            return sq.tolist()
        return scale, ok, k, host, later

def setup(group):
    out = [None]
    dist.all_gather_object(out, 1, group=group)
    x = torch.ones(1).item()
'''


def test_the_scan_sees_every_kind_and_names_the_function():
    got = sorted((f, w) for _, f, w, _ in scan(SAMPLE, "m.py"))
    assert got == sorted([
        ("Opt.step", "float(tensor)"), ("Opt.step", "bool(tensor)"), ("Opt.step", ".wait()"),
        ("Opt.step", ".synchronize()"), ("Opt.step", '.to("cpu")'), ("Opt.step.later", ".tolist()"),
        ("setup", "all_gather_object()"), ("setup", ".item()"),
    ])


def _of(rel: str) -> dict:
    return {k: v for k, v in ALLOWED.items() if k[0] == rel}


def test_a_new_item_in_a_step_path_function_fails_the_audit():
    """Add ``.item()`` to the dispatcher's ``reduce`` (the hot path of every bucket): the audit names it."""
    rel = "reducer/schedule/dispatch.py"
    tree = ast.parse((PKG / rel).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Dispatcher")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "reduce")
    fn.body.insert(1, ast.parse("bucket.flat.sum().item()").body[0])
    found = scan(ast.unparse(tree), rel)
    assert not problems(scan((PKG / rel).read_text(encoding="utf-8"), rel), _of(rel))  # as it is: clean
    bad = problems(found, _of(rel))
    assert len(bad) == 1 and "reducer/schedule/dispatch.py" in bad[0] and ".item() in Dispatcher.reduce" in bad[0]
    # and one more of a listed kind in a listed function fails too (counts, not just keys)
    key = next(iter(ALLOWED))
    extra = [(key[0], key[1], key[2], 1)] * (ALLOWED[key][0] + 1)
    assert any(f"in {key[1]} (" in b for b in problems(extra, {key: ALLOWED[key]}))


def test_a_listed_entry_that_no_longer_occurs_is_stale():
    assert problems([], {("m.py", "f", ".item()"): (1, "because")}) == [
        "stale: ('m.py', 'f', '.item()') is listed 1 time(s) but occurs 0: update ALLOWED"]


# ------------------------------------------------------------------ what the step no longer reads on the host

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("norm", [0.5, 1.0, 3.7, 1e-9, 0.0, float("nan"), float("inf")])
def test_clipping_on_the_device_is_bitwise_the_host_formula(norm):
    """reducer/engine/clip.py against the formula it replaced in the DDP hook and DeepSpeed's ZeRO-0
    clip: ``scale = max_norm / (float(norm) + 1e-6)``, applied when below 1."""
    from topo_integrations.reducer.engine.clip import clip_by_norm_

    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(257, generator=gen) * 3, torch.randn(33, generator=gen).bfloat16(),
            torch.randn(5, generator=gen).half(), torch.randn(9, generator=gen, dtype=torch.float64),
            torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-30])]
    new, old = [g.clone() for g in base], [g.clone() for g in base]
    n = torch.tensor([norm], dtype=torch.float64)
    clip_by_norm_(new, n, 1.0)
    scale = 1.0 / (float(n) + 1e-6)
    if scale < 1:
        torch._foreach_mul_(old, scale)
    for a, b in zip(new, old):
        assert torch.equal(_bits(a), _bits(b)), (norm, a.dtype)


def test_drift_is_read_when_its_sums_have_landed_not_at_the_reconciliation():
    from topo_integrations.reducer.classes.drift import DriftMonitor

    class Later:
        def __init__(self, t):
            self.t, self.ready, self.reads = t, False, 0

        def landed(self):
            return self.ready

        def value(self):
            self.reads += 1
            return self.t

    class Wire:
        def __init__(self):
            self.made = []

        def agree_later(self, t, op):
            self.made.append(Later(t))
            return self.made[-1]

    segs, before, after = [("a", 0, 2), ("b", 2, 1)], torch.tensor([1.5, 0.9, 2.0]), torch.tensor([1.0, 1.0, 2.0])
    polled, w = DriftMonitor(0.0, 10), Wire()
    polled.measure_segments(segs, before, after, w, 4)
    polled.poll()
    assert w.made[0].reads == 0  # the reconciliation and a poll before landing read nothing on the host
    w.made[0].ready = True
    polled.poll()
    assert w.made[0].reads == 1 and polled._pending == []
    asked, w2 = DriftMonitor(0.0, 10), Wire()
    asked.measure_segments(segs, before, after, w2, 4)
    assert asked.last == polled.last and asked.history == polled.history and asked.last_step == 4  # a read settles
    assert w2.made[0].reads == 1 and set(polled.last) == {"a", "b"} and polled.last["b"] == 0.0


def test_on_cuda_the_reconciliation_window_is_timed_by_events_not_the_host_clock(monkeypatch):
    from topo_integrations.reducer.schedule.dispatch import Dispatcher

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream=None):
            self.t = clock[0]

        def query(self):
            return self.t is not None

        def elapsed_time(self, end):
            return (end.t - self.t) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    d = Dispatcher.__new__(Dispatcher)
    d.cuda, d.device, d.sched, d.schedule = True, torch.device("cuda", 0), SimpleNamespace(trace=None), []
    d._step_sync, d._local_open, d._t_step_end, d._ev_step_end = [], False, None, None
    d._timed_windows, d._timed_chunks, d._window_s, d._chunk_s = [], [], None, None
    clock[0] = 10.0  # the device reaches the step's end
    d.end_step(1)
    clock[0] = 10.25  # ... and the next step's first SYNC bucket 0.25 s later
    d._window_ends(SimpleNamespace(submitted=d._t_step_end + 5.0))  # the host clock would say 5 s
    d._resolve_chunk_times()
    assert d._window_s == pytest.approx(0.25) and d._timed_windows == []
