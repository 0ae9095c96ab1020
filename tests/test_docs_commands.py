"""Every command of a ```bash block in README.md and docs/*.md runs as written (issue 14).

Each command runs with bash in a scratch copy of the repository (docs/ copied, everything else
linked), with the checkout's code first on PYTHONPATH and the suite's interpreter first on PATH, and
must exit 0 (or the status a ``# exits N`` comment on it names). Kept fast:

* the pretraining launch scripts run with ``TOPO_ALIGN_DRY_RUN=1`` and ``TOPO_ALIGN_SKIP_SETUP=1``
  (docs/pretraining.md): every flag is checked by the entry point, the launch command is printed,
  no rank starts and nothing is installed. The first documented command of each script runs so;
  the other commands of that script differ only in training flags, which are checked in this process
  with the entry point's ``--check-args``, as the launcher does (one interpreter start instead of two
  per command);
* ``pytest`` commands get ``--collect-only`` (the named test files and options exist and import;
  running them is the suite's own job), and the ones that differ only in their test files are
  collected together, in one interpreter: every file of every command in it, so each command's files
  and options are checked as before, while the pytest start-up and the shared imports (torch,
  DeepSpeed, megatron-core) are paid once instead of once per command;
* SMALL_ARGS below shrinks the few others;
* the commands of two pages run at the same time (``LANES``, in the ``lanes`` fixture), each page's
  in its order.

A comment ``# not run by the docs test: REASON`` skips the rest of its block (as a line of its own)
or its command (at the end of the command); ``# needs root`` runs the commands only where network
namespaces can be made (else they skip, with the reason). Both show in the page itself, and
``test_the_skip_list_stays_small`` keeps the skips few.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = "not run by the docs test"
ROOT_MARK = "needs root"
EXIT_RE = re.compile(r"#.*\bexits (\d+)\b")
MAX_SKIPS = 12

# (pattern, replacement) applied to a command before it runs: the same command, small.
SMALL_ARGS = [
    (re.compile(r"--repeats 5\b"), "--repeats 1"),  # scripts/emulate_measure.py: one repeat per preset
    # scripts/ds_sync_overlap.py: one step of a small model per case (4 ranks start either way)
    (re.compile(r"ds_sync_overlap\.py --steps 12\b"), "ds_sync_overlap.py --steps 1 --width 32 --depth 2 --batch 4"),
]
# Files the docs name as "yours" (your block, your cluster's topology.conf): stand-ins from the repo.
STAND_INS = {
    "my_block.json": '{"mode": "hierarchical", "local": {"reconcile_interval": 8}}\n',
    "topology.conf": ROOT / "tests" / "fixtures" / "topology" / "topology.conf",
    "topo.txt": ROOT / "tests" / "fixtures" / "topology" / "nvidia-smi-topo-dgx-a100.txt",
}
# The environment of a documented command: no cluster settings leak in from the machine.
DROP_ENV = re.compile(r"^(NCCL_|UCX_|TORCH_NCCL_|SLURM_|OMPI_|PMI_|MASTER_|RANK$|WORLD_SIZE$|LOCAL_RANK$)")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    skip: str | None = None
    root: bool = False
    flags_of: str | None = None
    """Set (``deepspeed`` / ``megatron``) when only the training flags are checked, in process."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _bash_blocks(path: Path):
    """``(first line number, lines)`` of every ```bash block, de-indented (blocks inside lists)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```bash\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m.group(1)), i + 2, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i].lstrip())
            i += 1
        yield start, body
        i += 1


def _commands(path: Path) -> list[Command]:
    page = str(path.relative_to(ROOT))
    out: list[Command] = []
    for start, body in _bash_blocks(path):
        skip, root, cur, first = None, False, [], 0
        for n, ln in enumerate(body):
            s = ln.strip()
            if not cur:
                if not s:
                    continue
                if s.startswith("#"):
                    if SKIP_MARK in s:
                        skip = s.split(SKIP_MARK, 1)[1].lstrip(": ") or "(no reason given)"
                        out.append(Command(page, start + n, "\n".join(body[n:]), skip=skip))
                        break
                    root = root or ROOT_MARK in s
                    continue
                first = start + n
            cur.append(ln)
            if ln.rstrip().endswith("\\"):
                continue
            text = "\n".join(cur)
            cur = []
            own = text.split(SKIP_MARK, 1)[1].lstrip(": ") if SKIP_MARK in text else None
            out.append(Command(page, first, text, skip=own, root=root or ROOT_MARK in text))
        if skip is None and cur:
            out.append(Command(page, first, "\n".join(cur), root=root))
    return out


PRETRAIN = re.compile(r"^(?:time\s+)?bash scripts/pretrain_gpt_(deepspeed|megatron)\.sh\b(.*)$", re.S)
# The launcher's own flags (scripts/_pretrain_launch.sh) and how many values each takes.
LAUNCH_FLAGS = {"--skip-setup": 0, "--dry-run": 0, "--nproc-per-node": 1, "--gpus-per-node": 1, "--nnodes": 1,
                "--node-rank": 1, "--master-addr": 1, "--master-port": 1, "--hostfile": 1, "--virtual-nodes": 1}


def training_flags(cmd: str) -> tuple[str, list[str]] | None:
    """``(deepspeed|megatron, the flags the entry point gets)`` of a pretraining launch command."""
    import shlex

    m = PRETRAIN.match(cmd)
    if not m:
        return None
    words, out = shlex.split(m.group(2)), []
    while words:
        w = words.pop(0)
        if w in LAUNCH_FLAGS:
            del words[:LAUNCH_FLAGS[w]]
        else:
            out.append(w)
    return m.group(1), out


def _all_commands() -> list[Command]:
    seen, launched, out = set(), set(), []
    for page in PAGES:
        for c in _commands(page):
            flags = None if c.skip else training_flags(runnable(c))
            if flags is not None and flags[0] in launched:
                key = (flags[0], tuple(flags[1]))
                c = Command(c.page, c.line, c.text, flags_of=flags[0])
            else:
                key = c.text if c.skip else " ".join(runnable(c).split())
                if flags is not None:
                    launched.add(flags[0])
                    seen.add((flags[0], tuple(flags[1])))
            if key not in seen:  # a command documented twice runs once
                seen.add(key)
                out.append(c)
    return out



def _strip_comment(text: str) -> str:
    """The command without its trailing ``# comment`` (quotes respected), continuation lines joined."""
    text = text.replace("\\\n", " ")
    quote, prev = None, " "
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            return text[:i].rstrip()
        prev = ch
    return text.rstrip()


def runnable(c: Command) -> str:
    """What actually runs for ``c``: comment removed, pytest collects only, SMALL_ARGS applied."""
    cmd = _strip_comment(c.text)
    if re.search(r"(^|[\s/])pytest\s", cmd + " "):
        cmd += " --collect-only -q -p no:cacheprovider"
    for pattern, repl in SMALL_ARGS:
        cmd = pattern.sub(repl, cmd)
    return cmd


COMMANDS = _all_commands()

TEST_FILE = re.compile(r"^tests/[\w/]+\.py(::\S+)?$")


def pytest_batch(run: str) -> tuple[tuple[str, ...], list[str]] | None:
    """``(the command's words without its test files, its test files)`` for a plain pytest command
    (no shell syntax beyond words), else None: commands with the same first part collect together."""
    if not re.search(r"(^|[\s/])pytest\s", run + " ") or re.search(r"[;&|<>'\"$`()\\]", run):
        return None
    # OMP_NUM_THREADS=1 is in every documented command's environment already (_env): not a difference
    words = [w for w in run.split() if w != "OMP_NUM_THREADS=1"]
    files = [w for w in words if TEST_FILE.match(w)]
    return (tuple(w for w in words if not TEST_FILE.match(w)), files) if files else None


def _batches() -> dict[tuple[str, ...], list[str]]:
    out: dict[tuple[str, ...], list[str]] = {}
    for c in COMMANDS:
        b = None if c.skip or c.flags_of or EXIT_RE.search(c.text) else pytest_batch(runnable(c))
        if b is not None:
            files = out.setdefault(b[0], [])
            files += [f for f in b[1] if f not in files]
    return out


BATCHES = _batches()


def batched_command(key: tuple[str, ...]) -> str:
    """The one pytest command that collects every file of the batch ``key``: the pytest words (and
    environment assignments) before the files, all the files, then the options."""
    words = list(key)
    at = next(i for i, w in enumerate(words) if re.search(r"(^|/)pytest$", w)) + 1
    return " ".join(words[:at] + BATCHES[key] + words[at:])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the repository to run in: docs/ copied (commands may write there), the rest linked;
    stand-ins for the user's own files."""
    d = tmp_path_factory.mktemp("docs-commands")
    for entry in ROOT.iterdir():
        if entry.name in (".git", "docs", "runs", ".pytest_cache", ".hypothesis") or entry.name.endswith(".egg-info"):
            continue
        (d / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", d / "docs")
    if not (d / ".venv" / "bin" / "python").exists():  # suite run by another interpreter: stand in for .venv
        if (d / ".venv").is_symlink():
            (d / ".venv").unlink()
        bin_ = d / ".venv" / "bin"
        bin_.mkdir(parents=True)
        (bin_ / "python").symlink_to(sys.executable)
        (bin_ / "pytest").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pytest "$@"\n')
        (bin_ / "pytest").chmod(0o755)
    for name, src in STAND_INS.items():
        if isinstance(src, Path):
            shutil.copyfile(src, d / name)
        else:
            (d / name).write_text(src)
    return d


def _env(scratch: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not DROP_ENV.match(k)}
    bindir = str(Path(sys.executable).parent)
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
        TOPO_ALIGN_DRY_RUN="1", TOPO_ALIGN_SKIP_SETUP="1", COLUMNS="120",
    )
    return env


def _root_reason() -> str | None:
    from topo_integrations.emulate.netns import probe_unavailable_reason

    return probe_unavailable_reason()


def _params():
    for c in COMMANDS:
        marks = [pytest.mark.emulated] if c.root else []
        yield pytest.param(c, id=c.id, marks=marks)


_BATCH_RUNS: dict[tuple[str, ...], tuple[str, subprocess.CompletedProcess]] = {}


def _run(run: str, scratch: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", run], cwd=scratch, env=_env(scratch), capture_output=True, text=True,
                          timeout=timeout)


LANES = 2
"""Pages whose commands run at the same time. Most commands are one interpreter start and a little
work on one core; two pages at once keep both cores of the machine busy. A page's own commands keep
their order (a command may read what an earlier one on its page wrote)."""


def _own_subprocess(c: Command) -> str | None:
    """What ``c`` runs in a subprocess of its own (its runnable text), or None: skipped, checked in
    this process (training flags) or collected with its pytest batch."""
    if c.skip or c.flags_of or (c.root and _root_reason()):
        return None
    run = runnable(c)
    want = int(m.group(1)) if (m := EXIT_RE.search(c.text)) else 0
    batch = pytest_batch(run)
    if batch is not None and batch[0] in BATCHES and want == 0:
        return None
    return run


@pytest.fixture(scope="module")
def lanes(request, scratch):
    """Started once: every selected command that runs in a subprocess of its own, page by page in
    ``LANES`` lanes; each test then waits for its own command's result."""
    from concurrent.futures import Future, ThreadPoolExecutor

    selected = {item.callspec.params["cmd"].id for item in request.session.items
                if getattr(item, "originalname", None) == "test_documented_command_runs"}
    pages: dict[str, list] = {}
    futures: dict[str, Future] = {}
    for c in COMMANDS:
        run = _own_subprocess(c) if c.id in selected else None
        if run is not None:
            futures[c.id] = Future()
            pages.setdefault(c.page, []).append((run, futures[c.id]))

    def page(cmds):
        for run, fut in cmds:
            try:
                fut.set_result(_run(run, scratch, timeout=280))
            except BaseException as exc:  # noqa: BLE001 - the command's test raises it
                fut.set_exception(exc)

    pool = ThreadPoolExecutor(LANES, thread_name_prefix="docs-lane")
    for cmds in pages.values():
        pool.submit(page, cmds)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first command of a pytest batch collects the whole batch
@pytest.mark.parametrize("cmd", _params())
def test_documented_command_runs(cmd: Command, scratch: Path, lanes):
    if cmd.skip:
        pytest.skip(f"{cmd.id}: {cmd.skip}")
    if cmd.root:
        reason = _root_reason()
        if reason:
            pytest.skip(f"{cmd.id}: needs root (network namespaces): {reason}")
    want = int(m.group(1)) if (m := EXIT_RE.search(cmd.text)) else 0
    run = runnable(cmd)
    if cmd.flags_of:
        _check_training_flags(cmd, run, scratch, want)
        return
    batch = pytest_batch(run)
    if batch is not None and batch[0] in BATCHES and want == 0:
        if batch[0] not in _BATCH_RUNS:
            merged = batched_command(batch[0])
            _BATCH_RUNS[batch[0]] = (merged, _run(merged, scratch, timeout=280))
        run, proc = _BATCH_RUNS[batch[0]]
        assert all(f.split("::")[0] in proc.stdout for f in batch[1]) or proc.returncode != 0, (
            f"{cmd.id}: the batched collection lists none of the tests of some of {batch[1]}\n$ {run}\n"
            f"--- stdout (tail)\n{proc.stdout[-2000:]}")
    else:
        proc = lanes[cmd.id].result() if cmd.id in lanes else _run(run, scratch, timeout=280)
    assert proc.returncode == want, (
        f"{cmd.id}: the documented command exited {proc.returncode} (expected {want})\n$ {run}\n"
        f"--- stdout (tail)\n{proc.stdout[-2000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}")


def _check_training_flags(cmd: Command, run: str, scratch: Path, want: int) -> None:
    """What the launcher runs before starting ranks: ``python -m MODULE --check-args FLAGS`` (with
    ``--virtual-nodes 2``, as on a CPU machine), here in this process, in the scratch directory."""
    import contextlib
    import importlib
    import io

    which, flags = training_flags(run)
    mod = importlib.import_module(f"topo_integrations.train.pretrain_{which}")
    err = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(scratch)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = mod.main(["--check-args", "--virtual-nodes", "2", *flags])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(cwd)
    assert rc == want, f"{cmd.id}: the documented flags are refused (exit {rc}): {flags}\n{err.getvalue()[-2000:]}"


def test_docs_have_runnable_commands_and_the_parser_sees_them():
    pages = {c.page for c in COMMANDS}
    assert "README.md" in pages and "docs/cli.md" in pages
    readme = [c for c in COMMANDS if c.page == "README.md"]
    assert any("topo-align simulate --topology configs/topologies/dgx-a100-superpod-960.json" in c.text
               for c in readme)
    # continuation lines are one command; a trailing comment is not part of what runs
    c = Command("x", 1, "topo-align plan \\\n    file:a.json   # plan it; 'quoted # not a comment'")
    assert runnable(c) == "topo-align plan      file:a.json"
    assert runnable(Command("x", 1, "echo '#1' # c")) == "echo '#1'"
    assert runnable(Command("x", 1, ".venv/bin/pytest tests/test_sim.py -q   # 25 tests")).endswith(
        "tests/test_sim.py -q --collect-only -q -p no:cacheprovider")
    assert training_flags("time bash scripts/pretrain_gpt_megatron.sh --skip-setup --nproc-per-node 2 --resume") \
        == ("megatron", ["--resume"])
    # pytest commands that differ only in their files collect in one run of all of them
    a = pytest_batch("OMP_NUM_THREADS=1 .venv/bin/pytest tests/a.py tests/b.py --collect-only -q")
    assert a == ((".venv/bin/pytest", "--collect-only", "-q"), ["tests/a.py", "tests/b.py"])
    assert pytest_batch(".venv/bin/pytest tests/c.py --collect-only -q")[0] == a[0]
    assert pytest_batch("X=1 .venv/bin/pytest tests/c.py -q")[0] != a[0]
    assert pytest_batch("cd x && pytest tests/a.py") is None and pytest_batch("topo-align plan") is None
    assert {f for files in BATCHES.values() for f in files} == {
        w for c in COMMANDS if not c.skip and (b := pytest_batch(runnable(c))) for w in b[1]}
    launched = [c for c in COMMANDS if training_flags(runnable(c)) and not c.flags_of and not c.skip]
    assert sorted(training_flags(runnable(c))[0] for c in launched) == ["deepspeed", "megatron"]


def test_the_skip_list_stays_small():
    skipped = [f"{c.id}: {c.skip}" for c in COMMANDS if c.skip]
    assert all(not s.endswith("(no reason given)") for s in skipped), skipped
    assert len(skipped) <= MAX_SKIPS, "more documented commands are skipped than allowed:\n" + "\n".join(skipped)
