"""Rank-side sync-debug cases of scripts/gpu_check.py: training steps of each adapter under
``torch.cuda.set_sync_debug_mode``, where a host synchronisation (``.item()``, a blocking copy, a
stream synchronize) is an error or a warning.

* GroupedReducer and the DDP comm hook: the whole step (forward, backward, the reduction, the
  optimizer step, ``after_optimizer_step``) runs in mode ``"error"``: the first synchronisation
  raises, and the case fails naming the line that made it (:func:`owner`).
* DeepSpeed and Megatron synchronise in their own step (loss scaling checks, timers, norms), so
  ``"error"`` would stop there before topo-align's code is reached; their steps run in mode
  ``"warn"`` and every synchronisation is attributed, from the Python stack at the call, to the
  innermost frame outside torch: topo-align's code (a failure), the framework's, torch's, or the
  check's own loop. Gradient clipping is off: the clip seams hand the framework a host float, as the
  frameworks' own clipping does.

Warm-up steps run first (communicator set-up, DDP's bucket rebuild). ``monitor.check_collectives``
is off here: its per-step fingerprint exchange is a host round trip by design. The batches live on
the GPU before the steps (a copy from pageable host memory is a synchronisation).
"""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path

from gpu_single import shipped_config

WARMUP, STEPS = 3, 5
SYNC_TEXT = "called a synchronizing CUDA operation"
ROOT = Path(__file__).resolve().parents[1]
HARNESS = ("topo_integrations/megatron/testing.py", "topo_integrations/deepspeed/harness.py", "scripts/", "tests/")


def _rules() -> tuple[list[tuple[str, str]], list[str]]:
    """(path prefix, owner) in order, first match wins; and the prefixes looked through (torch's code)."""
    import importlib.util

    import torch

    rules = [(str(ROOT / h), "harness") for h in HARNESS] + [(str(ROOT / "topo_integrations"), "topo-align")]
    for fw in ("deepspeed", "megatron"):
        spec = importlib.util.find_spec(fw)
        if spec is not None and spec.submodule_search_locations:
            rules += [(loc, fw) for loc in spec.submodule_search_locations]
    return rules, [os.path.dirname(torch.__file__)]


def owner(frames: list[tuple[str, int, str]], rules: list[tuple[str, str]], skip: list[str]) -> tuple[str, str]:
    """Who made a synchronising call, from the Python stack at it (``frames``: file, line, function;
    outermost first): the innermost frame not under a ``skip`` prefix, owned by the first rule whose
    prefix it starts with. A call the check's own code makes through torch's Python code counts as
    torch's (``torch``); a frame no rule owns counts as the check's (``harness``)."""
    looked_through = None
    for file, line, func in reversed(frames):
        where = f"{_short(file)}:{line} {func}"
        if any(file.startswith(p) for p in skip):
            looked_through = looked_through or where
            continue
        who = next((w for p, w in rules if file.startswith(p)), "harness")
        if who == "harness" and looked_through is not None:
            return "torch", looked_through
        return who, where
    return "torch", looked_through or "(no Python frame)"


def _short(file: str) -> str:
    for marker in ("/site-packages/", str(ROOT) + "/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


class SyncProbe:
    """``torch.cuda.set_sync_debug_mode(mode)`` for a block; in ``"warn"`` mode every synchronising
    call is attributed (:func:`owner`) into :attr:`syncs`."""

    def __init__(self, mode: str):
        self.mode = mode
        self.syncs: list[tuple[str, str]] = []
        self._rules = _rules()
        self._caught = warnings.catch_warnings()

    def __enter__(self) -> "SyncProbe":
        import torch

        torch.cuda.synchronize()
        self._caught.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_TEXT in str(message):  # the stack at the call, less this hook and the warnings module's frames
            frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack()[:-1]
                      if f.filename != warnings.__file__]
            self.syncs.append(owner(frames, *self._rules))

    def attribute(self, exc: BaseException) -> tuple[str, str]:
        """The owner of the synchronisation that raised ``exc`` (a collective's error wraps it: the
        innermost cause that names it is the one raised at the call)."""
        while exc.__cause__ is not None and SYNC_TEXT in str(exc.__cause__):
            exc = exc.__cause__
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        return owner(frames, *self._rules)

    def __exit__(self, *exc) -> bool:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(*exc)
        return False


def _verdict(mode: str, syncs: list[tuple[str, str]], raised: tuple[str, str] | None, extra: str = ""):
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for who, where in syncs:
        counts[who] = counts.get(who, 0) + 1
        first.setdefault(who, where)
    ours = counts.get("topo-align", 0)
    data = {"mode": mode, "warmup": WARMUP, "steps": STEPS, "syncs": counts, "first": first}
    if raised is not None:
        data["raised"] = {"owner": raised[0], "at": raised[1]}
        return "FAIL", f"mode 'error': the step synchronised in {raised[0]}'s code at {raised[1]}{extra}", data
    others = ", ".join(f"{w} {n} (first {first[w]})" for w, n in counts.items() if w != "topo-align") or "none"
    head = f"{STEPS} steps after {WARMUP} in mode {mode!r}: "
    if ours:
        where = first["topo-align"]
        return "FAIL", head + f"topo-align synchronised {ours}x, first at {where}; others: {others}{extra}", data
    return "PASS", head + f"no synchronisation in topo-align's code; others: {others}{extra}", data


def _torch(adapter: str, rank: int, dev):
    import test_ddp_hook as hook_t
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from topo_integrations.torch import GroupedReducer, TopoAlignHookState, topo_align_hook

    import test_reducer_modes as modes_t

    if adapter == "grouped-reducer":
        model = modes_t.make(1).to(dev)
        red = GroupedReducer(model, shipped_config())
        finish, after, verify, close = red.finish_grad_sync, red.after_optimizer_step, red.verify_consistency, red.close
    else:
        model = DDP(hook_t.make().to(dev), device_ids=[dev.index], bucket_cap_mb=hook_t.BUCKET_CAP_MB)
        state = TopoAlignHookState(model, shipped_config())
        model.register_comm_hook(state, topo_align_hook)
        finish, after, verify, close = (lambda: None), state.after_optimizer_step, state.verify_consistency, state.close
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    batches = [tuple(t.to(dev) for t in modes_t.batch(s, rank)) for s in range(WARMUP + STEPS)]

    def step(s: int) -> None:
        x, y = batches[s]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1)).backward()
        finish()
        opt.step()
        after(opt)

    raised = None
    try:
        for s in range(WARMUP):
            step(s)
        with SyncProbe("error") as probe:
            try:
                for s in range(WARMUP, WARMUP + STEPS):
                    step(s)
            except RuntimeError as exc:
                if SYNC_TEXT not in str(exc):
                    raise
                raised = probe.attribute(exc)
        if raised is None:
            verify()  # the steps were right too: invariants 1 and 2 (SYNC identical on all ranks)
    finally:
        close()
    return _verdict("error", [], raised, "; replicas verified after the steps" if raised is None else "")


def _deepspeed(rank: int, dev):
    import deepspeed.utils.groups as dg

    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H

    block = {"enabled": True, "mode": "selective", "topology": {"source": "hostnames"}}
    model = H.Net()
    eng = tds.initialize(model=model, optimizer=H.make_optimizer("adamw", model.parameters()),
                         config=H.ds_config(1, topo=block))[0]
    try:
        H.train(eng, WARMUP)
        with SyncProbe("warn") as probe:
            H.train(eng, STEPS, start=WARMUP)
    finally:
        dg.mpu = None
    attached = "topo-align engine attached" if hasattr(eng, "topo_align") else "one tier: DeepSpeed reduces"
    return _verdict("warn", probe.syncs, None, f"; ZeRO-1, {attached}")


def _megatron(rank: int, dev):
    from topo_integrations.megatron import testing as mt

    spec = mt.TinyGPT()
    mt.init_parallel(1)
    ddp = mt.wrap_ddp(*mt.build_gpt(spec), topo=shipped_config())
    opt = mt.make_optimizer(ddp)
    try:
        for s in range(WARMUP):
            mt.run_iteration(ddp, spec, rank, s, opt)
        with SyncProbe("warn") as probe:
            for s in range(WARMUP, WARMUP + STEPS):
                mt.run_iteration(ddp, spec, rank, s, opt)
    finally:
        ddp.topo_close()
    return _verdict("warn", probe.syncs, None, f"; Megatron DDP, {ddp.topo_reason}")


def run(name: str, rank: int, dev):
    adapter = name.removeprefix("sync-debug-")
    if adapter in ("grouped-reducer", "ddp-hook"):
        return _torch(adapter, rank, dev)
    return {"deepspeed": _deepspeed, "megatron": _megatron}[adapter](rank, dev)
