"""Every relative link and image of README.md and docs/*.md resolves, and every ``#anchor`` names a
heading of its page (GitHub's slugs); docs/benchmarks.md stays a reader's page (issue 39, item 4).

A link leaving the repository (``../main/docs/img/...``, a worktree next to this one) counts as
broken: it resolves here and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _scripts import script

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH_MAX_LINES = 500
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
pytestmark = pytest.mark.timeout(60)


def _blocks():
    return script('generated_block')


def links(page: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every ``[..](target)`` and ``![..](target)`` outside code."""
    out = []
    for n, line in enumerate(_blocks().prose_lines(page.read_text(encoding="utf-8")), 1):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            out.append((n, m.group(1)))
    return out


def broken(page: Path, anchors_of, root: Path = ROOT) -> list[str]:
    bad = []
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{n}: ({target})"
        if not dest.is_relative_to(root):
            bad.append(f"{where} leaves the repository")
        elif not dest.exists():
            bad.append(f"{where} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            bad.append(f"{where} names no heading of {dest.name}")
    return bad


def _anchors(path: Path) -> set[str]:
    return {a for _, a in _blocks().anchors(path.read_text(encoding="utf-8"))}


def test_every_relative_link_and_anchor_resolves():
    bad = [b for page in PAGES for b in broken(page, _anchors)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_benchmarks_page_stays_short():
    n = len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines())
    assert n <= BENCH_MAX_LINES, (f"docs/benchmarks.md has {n} lines (at most {BENCH_MAX_LINES}): move dated runs "
                                  "to docs/benchmarks-archive.md")


def test_github_slugs():
    gb = _blocks()
    assert gb.slug("2x2: the deep GPT on 40 Mbit/s uplinks") == "2x2-the-deep-gpt-on-40-mbits-uplinks"
    assert gb.slug("The long-horizon preset (`2x2-long`)") == "the-long-horizon-preset-2x2-long"
    assert gb.slug("2x2-long, 2026-12-04 20:49 - 21:37: issue 25's defaults") == \
        "2x2-long-2026-12-04-2049---2137-issue-25s-defaults"
    text = "# A\n\n```bash\n# not a heading\n```\n\n## A\n### [Link](x.md) *b*\n"
    assert [a for _, a in gb.anchors(text)] == ["a", "a-1", "link-b"]


def test_a_broken_link_is_caught(tmp_path):
    repo = tmp_path / "repo"
    (repo / "img").mkdir(parents=True)
    (repo / "img" / "ok.png").write_bytes(b"")
    (tmp_path / "main" / "docs" / "img").mkdir(parents=True)
    (tmp_path / "main" / "docs" / "img" / "x.png").write_bytes(b"")  # exists, but outside the repository
    page = repo / "page.md"
    page.write_text("# Top\n\n[a](#top) ![b](img/ok.png) [c](#nowhere) ![d](../main/docs/img/x.png)\n"
                    "`[e](missing.md)` [f](https://example.com/x) [g](gone.md)\n", encoding="utf-8")
    bad = broken(page, _anchors, root=repo)
    assert len(bad) == 3, bad
    assert "(#nowhere) names no heading" in bad[0] and "leaves the repository" in bad[1], bad
    assert "(gone.md) does not exist" in bad[2], bad
