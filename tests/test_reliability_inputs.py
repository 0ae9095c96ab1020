"""Bad input (issue 9): a corpus of malformed and hostile config and topology files.

Every file of ``tests/bad_inputs/`` (made by ``make_corpus.py``; at least 50) must give its documented
error (``tests/bad_inputs/MANIFEST.json``: the error class and the message, ``{path}`` standing for
the file) both
* through the API: only ``ConfigError`` / ``TopologyError`` (ValueError subclasses), never another
  exception type; and
* through the CLI (``topo-align doctor --config F`` / ``topo-align plan KIND:F``): exit 2, exactly
  one line on stderr, no traceback.
Hypothesis then mutates the corpus (byte flips, truncation, splices, JSON value swaps) and checks
the same contract on every mutant. ``python tests/test_reliability_inputs.py --regen`` rewrites
the manifest from the current messages (review the diff).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "bad_inputs"
MANIFEST = CORPUS / "MANIFEST.json"
NODELIST = "node[0-1]"


def files() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if "--" in p.name)


def kind_of(p: Path) -> str:
    return p.name.split("--", 1)[0]


def api_load(p: Path):
    """Load ``p`` the way its kind is loaded at run time; returns the object (must not happen here)."""
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.topology.sources import load_source

    k = kind_of(p)
    if k == "config":
        return TopoAlignConfig.from_file(p)
    if k == "topo":
        return load_source("file", str(p))
    if k == "nccl":
        return load_source("nccl-xml", str(p))
    if k == "slurm":
        return load_source("slurm", f"{p},{NODELIST}")
    if k == "hostfile":
        return load_source("hostfile", str(p))
    if k == "smi":
        return load_source("nvidia-smi", str(p))
    raise AssertionError(f"unknown corpus kind {k!r} ({p.name})")


def cli_argv(p: Path) -> list[str]:
    k = kind_of(p)
    if k == "config":
        return ["doctor", "--config", str(p), "--sysfs-root", str(CORPUS)]
    spec = {"topo": "file", "nccl": "nccl-xml", "slurm": "slurm", "hostfile": "hostfile", "smi": "nvidia-smi"}[k]
    return ["plan", f"{spec}:{p}" + (f",{NODELIST}" if k == "slurm" else "")]


def api_error(p: Path) -> tuple[str, str]:
    """(exception class name, message with the path replaced by {path})."""
    try:
        api_load(p)
    except ValueError as exc:
        return type(exc).__name__, str(exc).replace(str(p), "{path}")
    return "no error", ""


def cli_run(argv: list[str]) -> tuple[int, str, str]:
    from topo_integrations import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


if __name__ == "__main__" and "--regen" in sys.argv:
    man = {}
    for p in files():
        cls, msg = api_error(p)
        man[p.name] = {"error": cls, "message": msg}
    MANIFEST.write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
    print(f"{len(man)} entries written to {MANIFEST}")
    sys.exit(0)

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ALLOWED = {"ConfigError", "TopologyError", "PlanError"}


def _manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def test_corpus_has_at_least_50_documented_inputs():
    man = _manifest()
    names = [p.name for p in files()]
    assert len(names) >= 50
    assert sorted(man) == names, "MANIFEST.json and the corpus differ; run make_corpus.py and --regen"
    kinds = {kind_of(p) for p in files()}
    assert {"config", "topo", "nccl", "slurm", "hostfile", "smi"} <= kinds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [p.name for p in files()])
def test_bad_input_api_and_cli(name):
    p = CORPUS / name
    want = _manifest()[name]
    cls, msg = api_error(p)
    assert cls in ALLOWED, f"{name}: {cls}: {msg}"
    assert (cls, msg) == (want["error"], want["message"])
    assert "\n" not in msg and len(msg) < 2000
    code, out, err = cli_run(cli_argv(p))
    assert code == 2, (code, out[-500:], err)
    assert err.count("\n") == 1 and err.startswith("topo-align: error: "), err
    assert "Traceback" not in err and out == ""
    # the CLI prints the same message (on one line)
    assert " ".join(want["message"].replace("{path}", str(p)).split()) in err


def _mutants():
    seeds = [p.read_bytes() for p in files() if p.stat().st_size < 5000] + [
        (ROOT / "configs" / "topologies" / "virtual-2x2.json").read_bytes(), b'{"mode": "selective"}']
    seed = st.sampled_from(seeds)

    def flip(data: bytes, i: int, b: int) -> bytes:
        if not data:
            return bytes([b])
        i %= len(data)
        return data[:i] + bytes([b]) + data[i + 1:]

    return st.one_of(
        st.builds(flip, seed, st.integers(0, 10 ** 6), st.integers(0, 255)),
        st.builds(lambda d, n: d[: n % (len(d) + 1)], seed, st.integers(0, 10 ** 6)),
        st.builds(lambda a, b, n: a[: n % (len(a) + 1)] + b[n % (len(b) + 1):], seed, seed, st.integers(0, 10 ** 6)),
        st.builds(lambda d, s: d.replace(b'"', s, 1), seed, st.sampled_from([b"", b"'", b'"\\u0000', b"[", b"{"])),
        st.binary(max_size=300),
    )


@pytest.mark.timeout(240)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=_mutants(), kind=st.sampled_from(["config", "topo", "nccl", "slurm", "hostfile", "smi"]))
def test_fuzzed_inputs_give_one_clear_error(tmp_path_factory, data, kind):
    p = tmp_path_factory.mktemp("fuzz") / f"{kind}--mutant.dat"
    p.write_bytes(data)
    try:
        api_load(p)
        ok = True
    except ValueError as exc:
        ok = False
        assert type(exc).__name__ in ALLOWED, f"{type(exc).__name__}: {exc}"
        assert str(exc) and "\n" not in str(exc)
    code, out, err = cli_run(cli_argv(p))
    if ok:
        assert code in (0, 1), (code, err)
    else:
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
