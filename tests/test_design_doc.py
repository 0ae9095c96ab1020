"""docs/design.md's layers picture, docs/testing.md's suite-times table and docs/reliability.md's
fault-soak figures are generated from the code and the data files (scripts/design_layers.py,
scripts/suite_times.py, scripts/fault_soak.py): they fail here when someone edits the code or the
data and not the page, or the page by hand."""

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


def test_the_fault_soak_block_comes_from_its_json():
    soak = _script("fault_soak")
    assert soak.current() == soak.block(), "docs/reliability.md is stale: python scripts/fault_soak.py --write"
    if soak.DATA.is_file():  # not recorded yet: the block says so (above)
        rec = json.loads(soak.DATA.read_text(encoding="utf-8"))
        assert rec["emulated"] is True and rec["format"] == "topo-align/fault-soak/v1"
        # the figures are those of the faults the JSON records
        assert rec["summary"] == soak.summarize(rec["jobs"], rec["timeout_s"])


def _fault(kind, **kw):
    base = {"kind": kind, "target": "node1", "step": 4, "injected": True, "steps_lost": 0}
    if kind != "link-slow":
        base.update(detect_s=10.2, error="topo_align: all_reduce ... timeout 10s", all_out_s=10.5, within_bound=True,
                    resumed_from=3, steps_lost=1)
    else:
        base.update(restarted=False, slowdown=5.0)
    return {**base, **kw}


def test_the_fault_soak_figures_and_table(tmp_path, monkeypatch):
    soak = _script("fault_soak")
    jobs = [{"name": "grouped-hierarchical", "framework": "grouped", "mode": "hierarchical", "exit_code": 0,
             "bitwise_equal": True, "restarts_from": [3, 6], "seconds": 100.0, "reference": {"seconds": 50.0},
             "faults": [_fault("link-cut"), _fault("rank-kill", detect_s=0.3, all_out_s=0.6, steps_lost=2),
                        _fault("link-slow")]},
            {"name": "deepspeed-selective", "framework": "deepspeed", "mode": "selective", "exit_code": 0,
             "bitwise_equal": False, "restarts_from": [3], "seconds": 200.0, "reference": {"seconds": 90.0},
             "faults": [_fault("island-partition", detect_s=12.0), _fault("link-cut", injected=False)]}]
    s = soak.summarize(jobs, 10.0)
    # survived: a named error, out within the bound, a resume, and the job bitwise equal to its reference
    want = {"planned": 5, "injected": 4, "survived": 3, "detect_s_max": 12.0, "detect_s_median": 10.2,
            "all_out_s_max": 10.5, "steps_lost": 4, "steps_lost_max": 2, "slowdown_median": 5.0}
    assert {k: s["all"][k] for k in want} == want
    assert s["by_kind"]["island-partition"]["survived"] == 0 and s["jobs_bitwise_equal"] == 1
    data = tmp_path / "fault-soak.json"
    data.write_text(json.dumps({"machine": "m", "date": "d", "commit": "c", "command": "scripts/fault_soak.py",
                                "seed": 1, "budget_s": 60, "elapsed_s": 50.0, "timeout_s": 10.0,
                                "topology": "virtual-2leaf", "summary": s, "jobs": jobs}), encoding="utf-8")
    doc = tmp_path / "reliability.md"
    doc.write_text(f"x\n{soak.BEGIN}\nhand-typed\n{soak.END}\n", encoding="utf-8")
    monkeypatch.setattr(soak, "DATA", data)
    monkeypatch.setattr(soak, "DOC", doc)
    assert soak.main(["--check"]) == 1
    assert soak.main(["--write"]) == 0 and soak.main(["--check"]) == 0
    text = doc.read_text(encoding="utf-8")
    assert "| link cut | 1 of 2 planned | 1 | 10.2 (10.2) | 10.5 | 1 (1) |" in text
    assert "| island partitioned | 1 | 0 | 12 (12) | 10.5 | 1 (1) |" in text
    assert "| link slowed 10x | 1 | 1 | none needed: steps 5x slower (median), no restart | - | 0 (0) |" in text
    assert "| **all** | 4 of 5 planned | 3 |" in text and "**emulated**" in text
