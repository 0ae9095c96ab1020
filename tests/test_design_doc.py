"""docs/design.md's layers picture and docs/testing.md's suite-times table are generated from the
code and the data files (scripts/design_layers.py, scripts/suite_times.py): they fail here when
someone edits the code or the data and not the page, or the page by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _script(name: str):
    if str(ROOT / "scripts") not in sys.path:  # the scripts import their shared helper by name
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_layers_picture_is_drawn_from_the_imports():
    layers = _script("design_layers")
    assert layers.current() == layers.block(), "docs/design.md is stale: python scripts/design_layers.py --write"


def test_the_layers_picture_shows_every_reducer_room_and_no_cycle():
    layers = _script("design_layers")
    graph = layers.part_graph()
    rooms = {p.name for p in (ROOT / "topo_integrations" / "reducer").iterdir() if (p / "__init__.py").is_file()}
    assert {f"reducer/{r}" for r in rooms} <= set(graph)
    # the transitive reduction keeps a path for every edge (no edge is lost, only shortened)
    reduced = layers.reduced(graph)
    for a, bs in graph.items():
        assert bs <= layers.reach(reduced, a), a
        assert a not in layers.reach(graph, a), f"{a} reaches itself: an import circle between parts"


def test_a_stale_picture_is_caught(tmp_path, monkeypatch):
    layers = _script("design_layers")
    doc = tmp_path / "design.md"
    doc.write_text(f"x\n{layers.BEGIN}\nhand-drawn\n{layers.END}\n", encoding="utf-8")
    monkeypatch.setattr(layers, "DOC", doc)
    assert layers.main(["--check"]) == 1
    assert layers.main(["--write"]) == 0
    assert layers.main(["--check"]) == 0
    assert "graph BT" in doc.read_text(encoding="utf-8")


def test_the_suite_times_table_comes_from_the_data_files():
    times = _script("suite_times")
    assert times.current() == times.block(), "docs/testing.md is stale: python scripts/suite_times.py --write"
    for path in (times.BEFORE, times.AFTER, times.FAST):
        if not path.is_file():  # not recorded yet: the page says so (test above)
            continue
        rec = json.loads(path.read_text(encoding="utf-8"))
        assert rec["tests"] == sum(f["tests"] for f in rec["files"].values())


def test_a_junit_record_sums_per_file(tmp_path):
    times = _script("suite_times")
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite time="12.5">'
                   '<testcase classname="tests.test_a" name="x" time="1.25">'
                   '<properties><property name="cpu_s" value="2.5"/></properties></testcase>'
                   '<testcase classname="tests.test_a.TestK" name="y" time="2.0"><skipped/></testcase>'
                   '<testcase classname="tests.test_b" name="z" time="3.0"><failure/></testcase>'
                   '</testsuite></testsuites>', encoding="utf-8")
    rec = times.record(xml, "label")
    assert rec["wall_s"] == 12.5 and rec["tests"] == 3
    assert rec["files"]["tests/test_a.py"] == {"tests": 2, "seconds": 3.2, "cpu_s": 2.5, "skipped": 1, "failed": 0}
    assert rec["files"]["tests/test_b.py"]["failed"] == 1
    assert rec["cpu_s"] == 2.5


def test_every_test_reports_its_cpu_seconds(request):
    """tests/conftest.py adds the CPU seconds of each test (self and waited-for children) to its
    report, so the JUnit XML that scripts/suite_times.py reads carries them."""
    import conftest

    assert conftest.CPU_PROPERTY == "cpu_s" and conftest._cpu_s() > 0
