"""Figures are generated, never copied (issue 39, item 4): the results README.md and docs/ quote are
the blocks scripts/docs_results.py draws from their data (the bench sections `topo-align bench
--markdown` wrote on docs/benchmarks.md, the convergence results of docs/data/); they fail here when
someone re-runs a bench or a grid and not the script, or edits a block by hand."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from _scripts import script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _results():
    return script('docs_results')


def test_every_quoted_result_is_its_generated_block():
    dr = _results()
    gb = sys.modules["generated_block"]
    stale = []
    for page, name, source, text in dr.blocks():
        begin, end = dr.markers(name, source)
        if gb.current(page, begin, end) != dr.render(name, source, text):
            stale.append(f"{page.relative_to(ROOT)}: {name}")
    assert not stale, f"stale or missing generated blocks {stale}: run {dr.COMMAND}"


def test_the_trimmed_bench_data_is_the_section_it_came_from():
    """docs/data/bench-*.json (what `topo-align simulate --bench` prices) and the bench section of the
    same run print the same median step and cross-node bytes for every system."""
    assert _results().bench_data_mismatches() == []


def test_readme_quotes_the_current_long_horizon_runs():
    """The defect this replaced: README's table held archived runs (2x2-long selective 2.75 MB, 101.1 s)
    while the page showed the current one. Every long-horizon section of docs/benchmarks.md is in
    README's table, with its selective row's bytes and time to flat quality."""
    dr = _results()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("<!-- bench-results:begin"):readme.index("<!-- bench-results:end -->")]
    longs = [s for s in dr.sections(dr.BENCH).values() if s.budget]
    assert {s.preset for s in longs} >= {"2x2-long", "4x2-long", "8x1-long"}
    for s in longs:
        row = s.budget["topo-align selective (GroupedReducer)"]
        line = next(ln for ln in block.splitlines() if "selective (GroupedReducer)" in ln
                    and f"| {row['time to flat quality'].split(' (runs')[0]} |" in ln)
        assert f"| {row['slow-tier bytes/step']} |" in line, (s.name, line)
    assert all(s.started >= "2026-12-06" for s in longs), "an archived run on the page of current results"


def test_a_stale_block_is_caught(tmp_path, monkeypatch):
    dr = _results()
    for name in ("README.md", "docs"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    monkeypatch.setattr(dr, "README", tmp_path / "README.md")
    for attr in ("BENCH", "ARCHIVE", "CONV", "COST"):
        monkeypatch.setattr(dr, attr, tmp_path / "docs" / getattr(dr, attr).name)
    monkeypatch.setattr(dr, "DATA", tmp_path / "docs" / "data")
    assert dr.main(["--check"]) == 0
    conv = tmp_path / "docs" / "convergence.md"
    conv.write_text(conv.read_text(encoding="utf-8").replace("| -0.25 % |", "| -0.52 % |", 1), encoding="utf-8")
    bench = tmp_path / "docs" / "benchmarks.md"
    text = bench.read_text(encoding="utf-8")  # a re-run of 2x2-long that moved selective's bytes
    for was, now in (("| 1.73 MB | 1.70 MB |", "| 2.75 MB | 1.70 MB |"), ("| 1.73 MB | 981 ", "| 2.75 MB | 981 ")):
        text = text.replace(was, now)
    bench.write_text(text, encoding="utf-8")
    assert dr.main(["--check"]) == 1  # convergence.md's headline by hand; the bench section no longer its data
    assert dr.main(["--write"]) == 0
    assert "| -0.25 % |" in conv.read_text(encoding="utf-8")
    assert "| 2.75 MB |" in (tmp_path / "README.md").read_text(encoding="utf-8")  # the section's figure travels
    assert dr.main(["--check"]) == 1  # and docs/data/bench-2x2-long-auto.json now disagrees with the section
