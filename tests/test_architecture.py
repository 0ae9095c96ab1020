"""The layering of docs/design.md ("Layers"), checked over the import graph of topo_integrations/.

Every ``import`` and ``from ... import`` in every module counts, at module level or inside a function
(a lazy import is still a dependency). A part may import only the parts below it:

    config <- topology <- reducer <- torch | deepspeed | megatron <- train <- bench <- cli
                                      torch <- fsdp <- bench (FSDP2 peers)
                                      torch, fsdp, deepspeed <- hf (Accelerate, Trainer)
                       \\- sim, emulate (topology only; reducer asks sim for `method: auto`)
                       doctor, plot (topology)     diagnostics (reducer, doctor, emulate)

Also checked here: the adapters (torch, deepspeed, megatron, fsdp) issue no collective of their own and
import neither reducer.wire.collectives nor reducer.wire.wire (every collective is the engine's); the
module import graph has no cycle; inside reducer/ the sub-packages import one way (REDUCER_LAYERS) and
each says in its ``__init__`` docstring what it owns; frameworks (deepspeed, megatron) are imported
only by their adapters and the parts above them; no module
imports another module's private name; no library module installs a warning filter at import; no
module is longer than MAX_LINES; comments and docs point to files of this repository, never to
documents outside it.

Known exceptions are listed with ``TODO(#14)``: modules that other work is rewriting. A stale
exception fails the test too, so the lists only shrink.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "topo_integrations"

pytestmark = pytest.mark.timeout(60)

# What each part may import (besides itself). A part is a top-level module or sub-package of
# topo_integrations; "" is the package itself (topo_integrations/__init__.py, the public API, which
# re-exports config, topology and the reducer).
ALLOWED: dict[str, set[str]] = {
    "auto_values": set(),  # what each `auto` key becomes at a group count (plain functions)
    "config": {"auto_values"},
    "testing": set(),  # multi-rank test helper (run_world): stdlib and torch only
    "topology": {"config"},
    "doctor": {"config", "topology"},
    "plot": {"topology"},
    "sim": {"config", "topology"},
    "emulate": {"config", "topology"},
    "reducer": {"config", "topology", "sim"},  # `method: auto` predicts with the cost model (docs/costmodel.md 6)
    "": {"config", "topology", "reducer", "torch"},
    "diagnostics": {"config", "topology", "reducer", "doctor", "emulate"},
    "torch": {"config", "topology", "reducer"},  # GroupedReducer and the DDP comm hook
    "deepspeed": {"config", "topology", "reducer"},
    "megatron": {"config", "topology", "reducer"},
    "fsdp": {"config", "topology", "reducer", "torch"},  # FSDP2: the plain-PyTorch adapter's groups and view
    "hf": {"config", "torch", "fsdp", "deepspeed"},  # Accelerate/Trainer: picks the adapter of each path
    "train": {"", "config", "topology", "reducer", "torch", "deepspeed", "megatron", "testing"},
    "bench": {"", "config", "topology", "reducer", "torch", "fsdp", "deepspeed", "megatron", "train", "emulate",
              "testing"},
    "cli": {"", "config", "topology", "doctor", "plot", "diagnostics", "sim", "emulate", "bench"},
}

# TODO(#14): removed by the adapter rewrite. (importing module, part it imports) pairs that break
# the layering today; the reducer's owner moves what reducer/wire/health.py needs from doctor/emulate
# into diagnostics.py (already there).
KNOWN_LAYER_EXCEPTIONS: set[tuple[str, str]] = set()

# Third-party frameworks and the parts that may import them.
FRAMEWORKS = {"deepspeed": {"deepspeed", "train", "bench"}, "megatron": {"megatron", "train", "bench"}}

# TODO(#14): removed by the adapter rewrite. (importing module, private name) pairs.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()

MAX_LINES = 500
# TODO(#14): removed by the adapter rewrite (megatron/ddp.py is split by job; reducer.py likewise).
KNOWN_LONG_MODULES: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()

# Old module paths that reducer/__init__.py registers as the modules they became (issue 41): an import
# spelled the old way is the same dependency.
ALIASES = {f"{PKG}.reducer.groups": f"{PKG}.reducer.plan",
           f"{PKG}.reducer.collectives": f"{PKG}.reducer.wire.collectives"}


def _part(module: str) -> str:
    """``topo_integrations.reducer.wire.health`` -> ``reducer``; the package itself -> ``""``."""
    rest = module.split(".")[1:]
    return rest[0] if rest else ""


def _alias(module: str) -> str:
    """``module`` with an old path (ALIASES) replaced by the module it became."""
    for old, new in ALIASES.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module


def _imports(module: str, path: Path, modules: dict[str, Path] | None = None) -> list[tuple[str, int]]:
    """Modules of topo_integrations that ``module`` imports (resolved, with line numbers). ``from
    pkg import name`` counts as importing ``pkg.name`` when that is a module (of ``modules``, default
    MODULES), else ``pkg``."""
    modules = MODULES if modules is None else modules
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(_alias(a.name), node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG:
                continue
            target = _alias(target)
            for a in node.names:
                sub = _alias(f"{target}.{a.name}")
                out.append((sub if sub in modules else target, node.lineno))
    return out


# -- adapters issue no collective of their own ---------------------------------------------------

ADAPTERS = ("torch", "deepspeed", "megatron", "fsdp", "hf")
ENGINE_ONLY = {f"{PKG}.reducer.wire.collectives", f"{PKG}.reducer.wire.wire", f"{PKG}.reducer.wire.lossy_wire"}
"""Modules only the engine imports: an adapter hands buckets to the dispatcher (reducer/schedule/dispatch.py)."""
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "all_gather_coalesced", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
}
"""torch.distributed calls that communicate. Queries (get_rank, get_world_size, get_process_group_ranks)
and new_group for a framework's own mpu are seams, not collectives."""
# (module, call) pairs an adapter may issue itself, each with its reason; a stale entry fails the test.
KNOWN_ADAPTER_COLLECTIVES: dict[tuple[str, str], str] = {
    (f"{PKG}.deepspeed.engine", "barrier"):
        "checkpoint save: every rank's reducer state file is written before DeepSpeed's own save goes on "
        "(DeepSpeed's checkpoint protocol, not gradient traffic)",
    (f"{PKG}.deepspeed.selfcheck", "barrier"):
        "the launcher self-check (python -m topo_integrations.deepspeed --check): rank 0's report is "
        "printed before the ranks exit; runs once, outside training",
    (f"{PKG}.deepspeed.harness", "all_gather"): "test/bench harness: compares replicas from outside the adapter",
    (f"{PKG}.deepspeed.harness", "all_reduce"): "test/bench harness: averages the reported loss",
}


def _distributed_calls(path: Path) -> list[tuple[str, int]]:
    """torch.distributed collectives called in ``path``: ``X.op(...)`` with X bound to torch.distributed
    (``import torch.distributed as X``, ``from torch import distributed as X``), ``torch.distributed.op(...)``
    and ``op(...)`` after ``from torch.distributed import op``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif node.module == "torch.distributed":
                direct |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in direct:
            out.append((f.id, node.lineno))
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            v = f.value
            if (isinstance(v, ast.Name) and v.id in aliases) or (
                    isinstance(v, ast.Attribute) and v.attr == "distributed"
                    and isinstance(v.value, ast.Name) and v.value.id == "torch"):
                out.append((f.attr, node.lineno))
    return out


def test_adapters_issue_no_collective_of_their_own():
    """Every collective of an adapter goes through the engine (reducer/schedule/dispatch.py,
    reducer/wire/replicas.py),
    so it takes its place in the one schedule and ends in a named, bounded error."""
    bad, seen = [], set()
    for module, path in MODULES.items():
        if _part(module) not in ADAPTERS:
            continue
        rel = path.relative_to(ROOT)
        bad += [f"{rel}:{line}: imports {t} (engine only)" for t, line in _imports(module, path) if t in ENGINE_ONLY]
        for op, line in _distributed_calls(path):
            if (module, op) in KNOWN_ADAPTER_COLLECTIVES:
                seen.add((module, op))
            else:
                bad.append(f"{rel}:{line}: calls torch.distributed.{op} (hand it to the engine: engine.call, "
                           "reducer/wire/replicas.py)")
    assert not bad, "adapters issuing collectives themselves:\n" + "\n".join(bad)
    stale = set(KNOWN_ADAPTER_COLLECTIVES) - seen
    assert not stale, f"no longer called; delete them from KNOWN_ADAPTER_COLLECTIVES: {stale}"


def test_the_collective_check_sees_every_spelling(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as d\nfrom torch import distributed as e\n"
                   "from torch.distributed import barrier as b\n"
                   "d.all_reduce(t)\ne.broadcast(t, 0)\ntorch.distributed.all_gather(x, t)\nb()\n"
                   "d.get_rank()\nd.new_group([0])\n")
    assert sorted(_distributed_calls(src)) == [("all_gather", 7), ("all_reduce", 5), ("b", 8), ("broadcast", 6)]


def _framework_imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module.split(".")[0], node.lineno))
    return [(m, ln) for m, ln in out if m in FRAMEWORKS]


def test_the_contract_is_layered():
    """ALLOWED names only existing parts and has no cycle (so it is a layering, not a tangle)."""
    parts = {_part(m) for m in MODULES}
    assert set(ALLOWED) == parts, f"parts without a rule: {parts - set(ALLOWED)}; rules without a part: " \
                                  f"{set(ALLOWED) - parts}"
    state: dict[str, int] = {}

    def visit(p: str, trail: tuple[str, ...]) -> None:
        if state.get(p) == 2:
            return
        assert state.get(p) != 1, f"the allowed imports form a cycle: {' -> '.join(trail + (p,))}"
        state[p] = 1
        for q in ALLOWED[p]:
            visit(q, trail + (p,))
        state[p] = 2

    for p in ALLOWED:
        visit(p, ())


def test_imports_follow_the_layers():
    bad, seen = [], set()
    for module, path in MODULES.items():
        me = _part(module)
        for target, line in _imports(module, path):
            them = _part(target)
            if them == me or them in ALLOWED[me]:
                continue
            if (module, them) in KNOWN_LAYER_EXCEPTIONS:
                seen.add((module, them))
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {me or PKG} imports {target} ({them or PKG}); "
                       f"{me or PKG} may import only {sorted(ALLOWED[me]) or 'nothing of the package'}")
    assert not bad, "imports against the layering (docs/design.md, Layers):\n" + "\n".join(bad)
    stale = KNOWN_LAYER_EXCEPTIONS - seen
    assert not stale, f"known exceptions that no longer occur; delete them from KNOWN_LAYER_EXCEPTIONS: {stale}"


# -- no import cycle, and the rooms of reducer/ in one order ------------------------------------------


def _graph(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Module -> the modules of ``modules`` it imports (every import, as `_imports` counts them)."""
    return {m: sorted({t for t, _ in _imports(m, p, modules) if t != m and t in modules}) for m, p in modules.items()}


def _cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, todo = [root], [iter(graph[root])]
        state[root] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(graph.get(nxt, ())))
    return None


def test_no_import_cycle():
    """No module of the package imports itself through others (lazy and TYPE_CHECKING imports count):
    a shared piece goes to a module below both, or is handed in."""
    cyc = _cycle(_graph(MODULES))
    assert cyc is None, "import cycle: " + " -> ".join(cyc)


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    pkg = tmp_path / PKG / "x"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (pkg / "c.py").write_text("def f():\n    from topo_integrations.x.a import g\n")
    mods = {f"{PKG}.x.{n}": pkg / f"{n}.py" for n in "abc"}
    assert _cycle(_graph(mods)) == [f"{PKG}.x.{n}" for n in "abca"]
    (pkg / "c.py").write_text("import os\n")
    assert _cycle(_graph(mods)) is None


REDUCER = f"{PKG}.reducer"
REDUCER_LAYERS = ["kinds", "watch", "plan", "wire", "schedule", "classes", "reconcile", "adaptive", "engine"]
"""The rooms of reducer/ from bottom to top (docs/design.md): a module of one may import only the rooms
below it (and its own); reducer/__init__.py, the public face, may import every room."""


def _room(module: str) -> str | None:
    """``topo_integrations.reducer.wire.collectives`` -> ``wire``; the reducer package itself -> ""."""
    if module == REDUCER:
        return ""
    return module[len(REDUCER) + 1:].split(".")[0] if module.startswith(REDUCER + ".") else None


def _room_violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in modules.items():
        me = _room(module)
        if not me:  # outside reducer/, or reducer/__init__.py
            continue
        for target, line in _imports(module, path, modules):
            them = _room(target)
            if them is None or them == me:
                continue
            if them == "" or them not in REDUCER_LAYERS or REDUCER_LAYERS.index(them) > REDUCER_LAYERS.index(me):
                bad.append(f"{path}:{line}: reducer/{me} imports {target}; reducer/{me} may import only "
                           f"{REDUCER_LAYERS[:REDUCER_LAYERS.index(me)]}")
    return bad


def test_reducer_rooms_import_one_way():
    rooms = {_room(m) for m in MODULES if _room(m)}
    assert rooms == set(REDUCER_LAYERS), f"rooms without a layer: {rooms - set(REDUCER_LAYERS)}; layers " \
                                         f"without a room: {set(REDUCER_LAYERS) - rooms}"
    bad = _room_violations(MODULES)
    assert not bad, "imports against the order of reducer/ (REDUCER_LAYERS):\n" + "\n".join(bad)


def test_the_room_check_sees_an_upward_import(tmp_path):
    root = tmp_path / PKG / "reducer"
    for room in ("watch", "plan"):
        (root / room).mkdir(parents=True)
    (root / "watch" / "w.py").write_text("def f():\n    from ..plan import p\n")
    (root / "plan" / "p.py").write_text("from ..watch.w import f\nfrom ...reducer import Engine\n")
    mods = {f"{REDUCER}.watch.w": root / "watch" / "w.py", f"{REDUCER}.plan.p": root / "plan" / "p.py"}
    bad = _room_violations(mods)
    assert [b.split(": ", 1)[1].split(";")[0] for b in bad] == [
        f"reducer/watch imports {REDUCER}.plan.p", f"reducer/plan imports {REDUCER}"]


def _docstring_problems(root: Path) -> list[str]:
    """Sub-packages of ``root`` whose ``__init__.py`` has no docstring, or one of more than one paragraph."""
    bad = []
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        if not doc:
            bad.append(f"{init}: no docstring saying what {init.parent.name}/ owns")
        elif "\n\n" in doc.strip():
            bad.append(f"{init}: the docstring is more than one paragraph")
    return bad


def test_every_reducer_room_says_what_it_owns():
    bad = _docstring_problems(ROOT / PKG / "reducer")
    assert not bad, "\n".join(bad)


def test_the_docstring_check_sees_a_missing_one(tmp_path):
    for name, text in {"a": '"""Owns a."""\n', "b": "x = 1\n", "c": '"""Owns c.\n\nAnd more."""\n'}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    assert [b.split(": ", 1)[1] for b in _docstring_problems(tmp_path)] == [
        "no docstring saying what b/ owns", "the docstring is more than one paragraph"]


def test_emulate_and_bench_do_not_import_each_other_both_ways():
    """bench runs on the emulator (bench -> emulate); emulate knows nothing of bench."""
    for module, path in MODULES.items():
        if _part(module) == "emulate":
            assert not [t for t, _ in _imports(module, path) if _part(t) == "bench"], module


def test_frameworks_are_imported_only_by_their_adapters_and_above():
    bad = []
    for module, path in MODULES.items():
        for fw, line in _framework_imports(path):
            if _part(module) not in FRAMEWORKS[fw]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {fw}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_private_name_of_another():
    """``from topo_integrations.x import _name`` or ``x._name`` on an imported module of the package:
    a name other modules need is public (no leading underscore)."""
    bad, seen = [], set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_pkg = path.name == "__init__.py"
        here = module.split(".") if is_pkg else module.split(".")[:-1]
        aliases: dict[str, str] = {}  # local name -> module of the package
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                if target.split(".")[0] != PKG:
                    continue
                for a in node.names:
                    if f"{target}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__") and target != module:
                        found.append((f"{target}.{a.name}", node.lineno))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PKG and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                found.append((f"{aliases[node.value.id]}.{node.attr}", node.lineno))
        for name, line in found:
            if (module, name) in KNOWN_PRIVATE_IMPORTS:
                seen.add((module, name))
            else:
                bad.append(f"{path.relative_to(ROOT)}:{line}: uses {name}")
    assert not bad, "private names used from another module (make them public):\n" + "\n".join(sorted(set(bad)))
    stale = KNOWN_PRIVATE_IMPORTS - seen
    assert not stale, f"known exceptions that no longer occur; delete them from KNOWN_PRIVATE_IMPORTS: {stale}"


def _module_level_calls(tree: ast.Module):
    """Calls that run at import: module body and class bodies, not function bodies."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def test_no_warning_filters_at_import():
    """A library module leaves the process's warning filters alone when imported; entry points may
    install filters in their main()."""
    bad = []
    for module, path in MODULES.items():
        for call in _module_level_calls(ast.parse(path.read_text(encoding="utf-8"))):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr in ("filterwarnings", "simplefilter"):
                bad.append(f"{path.relative_to(ROOT)}:{call.lineno}: warnings.{f.attr} at import")
    assert not bad, "\n".join(bad)


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not set(long) - KNOWN_LONG_MODULES, f"modules over {MAX_LINES} lines (split them by job): " \
                                               f"{ {k: v for k, v in long.items() if k not in KNOWN_LONG_MODULES} }"
    stale = KNOWN_LONG_MODULES - set(long)
    assert not stale, f"no longer over {MAX_LINES} lines; delete them from KNOWN_LONG_MODULES: {stale}"


# -- references to documents outside the repository ------------------------------------------------

# DESIGN.md, research/ and notes/ lived beside the repository, not in it; docs/design.md and the
# other docs pages hold what the code needs from them.
OUTSIDE = re.compile(r"\bDESIGN\b(?!_)|\bresearch/|\bnotes/|shared/")
SCANNED = ("README.md", "CHANGELOG.md", "setup.py", "ruff.toml", "pytest.ini", "constraints.txt")
SCANNED_DIRS = ("topo_integrations", "docs", "scripts", "tests", "configs", "patches", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".json", ".args", ".txt", ".toml", ".ini", ".patch", ""}

# TODO(#14): removed by the adapter rewrite (comments in modules other work is rewriting).
KNOWN_OUTSIDE_REFERENCES: set[str] = set()


def _scanned_files():
    for name in SCANNED:
        if (ROOT / name).is_file():
            yield ROOT / name
    for d in SCANNED_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts \
                    and path.name != Path(__file__).name and "bad_inputs" not in path.parts:
                yield path


def test_references_stay_inside_the_repository():
    bad, seen = [], set()
    for path in _scanned_files():
        rel = str(path.relative_to(ROOT))
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits = [(i, ln.strip()) for i, ln in enumerate(text.splitlines(), 1) if OUTSIDE.search(ln)]
        if not hits:
            continue
        if rel in KNOWN_OUTSIDE_REFERENCES:
            seen.add(rel)
            continue
        bad += [f"{rel}:{i}: {ln[:110]}" for i, ln in hits]
    assert not bad, ("references to documents outside the repository (point to docs/... instead):\n"
                     + "\n".join(bad))
    stale = KNOWN_OUTSIDE_REFERENCES - seen
    assert not stale, f"no outside references left; delete them from KNOWN_OUTSIDE_REFERENCES: {stale}"


# Issue 41: modes are compared as members of the Mode enum (config.py, re-exported by reducer.kinds),
# never as spelled strings, outside the parsing of the config. (path, comparison as ast.unparse
# writes it) -> why it may stay; a stale entry fails too.
MODE_WORDS = {"flat", "hierarchical", "selective"}
MODE_PARSING = {"topo_integrations/config.py"}
KNOWN_MODE_WORDS: dict[tuple[str, str], str] = {
    **{("topo_integrations/sim/scenario.py", c): "the simulator's algorithm names (sim/algorithms.py "
       "ALGORITHMS), a vocabulary of its own that shares one word with the modes"
       for c in ("key == 'selective'", "'selective' in opt.algorithms")},
    ("topo_integrations/sim/benchcheck.py", "algo == 'selective'"): "a simulator algorithm name (as above)",
    ("topo_integrations/bench/report.py", "'selective' in e['key']"): "a substring of a bench system's key "
    "(bench/systems.py), not a mode",
}


def _mode_word_comparisons(path: Path) -> list[tuple[int, str]]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``) with a mode word as a string literal on one
    side (alone, or in a tuple, list or set literal)."""
    def words(node) -> set[str]:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and (words(a) | words(b)) & MODE_WORDS
                   for op, a, b in zip(node.ops, sides, sides[1:])):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_modes_are_compared_as_enum_members(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if cfg.mode == "flat" or m in ("selective", "x") or "hierarchical" != m:\n'
                     '    run(mode="flat", kind="selective" == k2 == "other")\n')
    assert sorted(c for _, c in _mode_word_comparisons(probe)) == sorted([
        "cfg.mode == 'flat'", "m in ('selective', 'x')", "'hierarchical' != m", "'selective' == k2 == 'other'",
    ]), "the scan misses a spelling of a mode comparison (or flags a keyword argument)"
    bad, seen = [], set()
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if rel in MODE_PARSING:
            continue
        for line, cmp in _mode_word_comparisons(path):
            if (rel, cmp) in KNOWN_MODE_WORDS:
                seen.add((rel, cmp))
            else:
                bad.append(f"{rel}:{line}: {cmp}")
    assert not bad, "compare with Mode members (topo_integrations.config.Mode), not strings:\n" + "\n".join(bad)
    stale = set(KNOWN_MODE_WORDS) - seen
    assert not stale, f"no longer occur; delete them from KNOWN_MODE_WORDS: {stale}"


# -- every imported name exists ----------------------------------------------------------------------


def _missing_names(paths: dict[str, Path]) -> list[str]:
    """``from <package module> import name`` (module level or lazy, in the package, tests/ and
    scripts/) where the module has no such attribute or submodule. A lazy import runs only on the
    path that needs it, so a name moved away (the reducer's split) fails only there, at run time."""
    import importlib

    bad = []
    for module, path in paths.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                target = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG or target.endswith("__main__"):  # importing a __main__ runs it
                continue
            mod = importlib.import_module(target)
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            for a in node.names:
                if a.name != "*" and not hasattr(mod, a.name) and f"{target}.{a.name}" not in MODULES:
                    bad.append(f"{rel}:{node.lineno}: {target} has no {a.name}")
    return bad


@pytest.mark.timeout(180)
def test_every_imported_name_exists(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(f"def f():\n    from {PKG}.reducer.plan.groups import no_such_name\n")
    assert _missing_names({"probe": probe}) == [f"probe.py:2: {PKG}.reducer.plan.groups has no no_such_name"]
    outside = {f"tests.{p.stem}": p for p in sorted((ROOT / "tests").glob("*.py"))}
    outside |= {f"scripts.{p.stem}": p for p in sorted((ROOT / "scripts").glob("*.py"))}
    bad = _missing_names(MODULES | outside)
    assert not bad, "imports of names that do not exist (moved or renamed):\n" + "\n".join(bad)
