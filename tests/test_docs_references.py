"""What docs/reliability.md names in backticks exists in the code (issue 40): every file (``path.py``,
``path.py::test_name``, ``dir/``) and every dotted name of the code (``module.function``,
``Class.method``, a config key ``section.field``), and its example of a failed collective is what
the code prints.

A dotted name is checked when its first part is a module of the package (``collectives.run``: any
module of that name; ``topo_integrations.x.y``: that path; ``torch.x``: PyTorch's too), a class defined in the package
(``GroupedReducer.state_dict``: an attribute of the class, or ``self.<name>`` set in its code) or a
section of the ``topo_align`` block (``fallback.timeout_s``); it passes when one of those readings
resolves. Other dotted text (``torch.cuda...``, ``Event.query()``) is not the package's and is left
alone. Files resolve from the repository root or from ``topo_integrations/``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "topo_integrations"
PAGES = ["docs/reliability.md"]

SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^([\w./-]+\.py)(?:::(\w+))?$|^([\w./-]+/)$")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
FILE_SUFFIXES = {"conf", "json", "md", "txt", "yaml", "yml", "toml", "ini", "cfg", "sh", "xml", "log", "pt"}
"""A dotted span ending in one of these is a file name (`topology.conf`), not a dotted name of the code."""


def spans(text: str) -> list[str]:
    """Inline code of ``text`` outside fenced blocks (their lines are examples, not references)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return SPAN.findall(prose.replace("\n", " "))


def _module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _index() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Last component -> the package's modules of that name; class name -> the modules defining it."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for name, path in _module_names().items():
        modules.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        for cls in re.findall(r"^class (\w+)\b", path.read_text(encoding="utf-8"), re.M):
            classes.setdefault(cls, []).append(name)
    return modules, classes


MODULES, CLASSES = _index()
SHARED_NAMES = ("torch",)
"""Third-party packages that share a name with a part of the package (imported when named)."""


def _attr(obj, name: str):
    """``obj.name``, or for a class an attribute its code sets on ``self`` (a stand-in object)."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if inspect.isclass(obj):
        src = "".join(inspect.getsource(k) for k in obj.__mro__ if k.__module__.startswith("topo_integrations"))
        if re.search(rf"self\.{name}\s*(:[^=\n]*)?=[^=]", src):
            return types.SimpleNamespace()
    raise AttributeError(name)


def _walk(obj, rest: list[str]) -> bool:
    try:
        for name in rest:
            obj = _attr(obj, name)
    except AttributeError:
        return False
    return True


def _config_key(parts: list[str]) -> bool | None:
    """True / False for a key of the ``topo_align`` block; None when ``parts[0]`` is no section."""
    from pydantic import BaseModel

    from topo_integrations.config import TopoAlignConfig

    model = TopoAlignConfig
    if parts[0] not in model.model_fields or len(parts) < 2:
        return None
    for name in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or name not in model.model_fields:
            return False
        model = model.model_fields[name].annotation
    return True


def resolves(dotted: str) -> bool | None:
    """Whether ``dotted`` names something of the package; None when it is not the package's to check."""
    parts = dotted.split(".")
    readings: list[bool] = []
    if parts[0] in SHARED_NAMES:  # `torch.cuda...` is PyTorch's, though the package has a torch/ too
        readings.append(_walk(importlib.import_module(parts[0]), parts[1:]))
    if parts[0] == "topo_integrations":
        for i in range(len(parts), 0, -1):
            try:
                mod = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            readings.append(_walk(mod, parts[i:]))
            break
    for name in MODULES.get(parts[0], []):
        readings.append(_walk(importlib.import_module(name), parts[1:]))
    for name in CLASSES.get(parts[0], []):
        readings.append(_walk(getattr(importlib.import_module(name), parts[0]), parts[1:]))
    key = _config_key(parts)
    if key is not None:
        readings.append(key)
    return any(readings) if readings else None


def path_resolves(path: str, test: str | None) -> bool:
    for base in (ROOT, PKG):
        p = base / path
        if p.exists():
            return test is None or re.search(rf"^def {test}\(", p.read_text(encoding="utf-8"), re.M) is not None
    return False


def problems(text: str) -> tuple[list[str], int]:
    """The references of ``text`` that resolve to nothing, and how many references were checked."""
    bad, checked = [], 0
    for span in spans(text):
        span = span.strip()
        if m := PATH.match(span):
            checked += 1
            if not path_resolves(m.group(1) or m.group(3), m.group(2)):
                bad.append(f"`{span}`: no such file" + (" or test" if m.group(2) else ""))
        elif (m := DOTTED.match(span)) and m.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES:
            ok = resolves(m.group(1))
            if ok is not None:
                checked += 1
                if not ok:
                    bad.append(f"`{span}`: {m.group(1)} is in no module, class or config section of the package")
    return bad, checked


@pytest.mark.parametrize("page", PAGES)
def test_every_code_reference_resolves(page):
    bad, checked = problems((ROOT / page).read_text(encoding="utf-8"))
    assert not bad, f"{page} names code that does not exist:\n" + "\n".join(bad)
    assert checked >= 100, f"only {checked} references were checked in {page}: is the parser seeing them?"


def test_the_check_sees_stale_references():
    """What the page said before issue 40 (a function and a module that no longer exist) fails."""
    bad, checked = problems("Every collective goes through `collectives._run`; DeepSpeed's in `deepspeed/wire.py` "
                            "(`_timed`), also `reducer.state_dict()` and `fallback.timeout`. Fine: "
                            "`collectives.run`, `reducer/wire/collectives.py`, `GroupedReducer.state_dict()`, "
                            "`AdaptiveController.events`, `fallback.timeout_s`, `torch.cuda.set_sync_debug_mode`, "
                            "`tests/test_reliability.py::test_no_such_test`.\n```text\n`collectives._nope`\n```")
    assert [b.split("`")[1] for b in bad] == ["collectives._run", "deepspeed/wire.py", "reducer.state_dict()",
                                              "fallback.timeout", "tests/test_reliability.py::test_no_such_test"]
    assert checked == 11


def test_the_example_of_a_failed_collective_is_what_the_code_prints():
    """The ```text example after "turns any failure into" is `collectives.run`'s message, numbers aside."""
    from topo_integrations.reducer.watch.errors import CollectiveError
    from topo_integrations.reducer.wire.collectives import run

    text = (ROOT / "docs/reliability.md").read_text(encoding="utf-8")
    block = re.search(r"turns any failure into\n\n```text\n(.*?)\n```", text, re.S)
    assert block, "the example of a failed collective is gone from docs/reliability.md section 1"
    shown = " ".join(block.group(1).split("\n"))
    groups = types.SimpleNamespace(dp_ranks=[0, 2], position=0, timeout_s=10.0,
                                   describe=lambda g: "inter group (global ranks 0, 2)")

    def fails():
        raise RuntimeError("... Timed out waiting 10000ms for recv operation to complete")

    with pytest.raises(CollectiveError) as err:
        run("all_reduce", "inter", object(), groups, 4, None, fails)
    printed = f"CollectiveError: {err.value}"

    def shape(s: str) -> str:
        return re.sub(r"\d+(\.\d+)?", "N", s)

    assert shape(shown) == shape(printed), f"docs: {shown}\ncode: {printed}"
