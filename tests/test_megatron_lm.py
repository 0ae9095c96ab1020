"""topo-align against Megatron-LM's own training code (``megatron.training``, not in the wheel), one
process per check: the parser (flags, ``--help``, bad values), install()/uninstall(), the launcher,
the version gate on the seams install() patches, and the source patch applying to core_v0.16.1.
The parser, install() and launcher checks run in forks of one interpreter that imported Megatron-LM
once (`_run_forked`); ``--help``, a bad value and the version gate run as a user types them.
The multi-rank runs of ``pretrain_gpt.py`` are in tests/test_megatron_lm_train.py.

The Megatron-LM tree: ``MEGATRON_LM=DIR``, else the vendored tarball unpacked into ``.cache/``
(tests/_megatron_lm_tree.py); skipped only when there is none. Modules Megatron-LM imports at import
time whose packages have no CPU build (triton) or are not needed here (regex) get the CPU layer's
import stand-ins (``cpu_compat.stub_absent_imports``), which raise if used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from _megatron_lm_tree import SKIP_REASON, megatron_lm_tree

MLM = megatron_lm_tree()
PATCH = os.path.join(
    os.path.dirname(__file__), "..", "patches", "megatron-lm", "0001-ddp-impl-and-extra-args-chain.patch"
)

# slow: every check starts processes that import Megatron-LM (not in the fast tier)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MLM is None, reason=SKIP_REASON)]

BOOTSTRAP = textwrap.dedent("""
    from topo_integrations.megatron import cpu_compat
    cpu_compat.stub_absent_imports()
""")


def _env(tree: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
                PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


# Runs the snippets of the tests below in one interpreter that imports Megatron-LM's training code
# once (seconds on 2 cores), each snippet in a fork of it: a process of its own, from the state a
# fresh one has after ``import megatron.training`` (what each snippet's first statements import).
FORKS = BOOTSTRAP + textwrap.dedent("""
    import os, sys, threading, traceback
    import megatron.training
    import topo_integrations.megatron
    assert threading.active_count() == 1, threading.enumerate()  # a fork copies this thread only
    out_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, stream in ((1, "out"), (2, "err")):
                os.dup2(os.open(os.path.join(out_dir, f"{name}.{stream}"), os.O_WRONLY | os.O_CREAT), fd)
            code = 0
            try:
                with open(os.path.join(out_dir, f"{name}.py"), encoding="utf-8") as fh:
                    exec(compile(fh.read(), name, "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        with open(os.path.join(out_dir, f"{name}.rc"), "w", encoding="utf-8") as fh:
            fh.write(str(os.waitstatus_to_exitcode(status)))
""")


def _run_forked(snippets: dict[str, str], out_dir) -> dict[str, subprocess.CompletedProcess]:
    """``{name: code}`` -> ``{name: CompletedProcess}`` of each snippet run in its own fork (FORKS)."""
    for name, code in snippets.items():
        (out_dir / f"{name}.py").write_text(textwrap.dedent(code), encoding="utf-8")
    driver = subprocess.run([sys.executable, "-c", FORKS, str(out_dir), *snippets], capture_output=True,
                            text=True, env=_env(MLM), timeout=280)
    assert driver.returncode == 0, driver.stderr[-3000:]
    return {name: subprocess.CompletedProcess(
        name, int((out_dir / f"{name}.rc").read_text()), (out_dir / f"{name}.out").read_text(),
        (out_dir / f"{name}.err").read_text()) for name in snippets}


def _launch(tree: str, *args: str):
    """``python -m topo_integrations.megatron TREE/pretrain_gpt.py ARGS`` (what a user types)."""
    return subprocess.run([sys.executable, "-m", "topo_integrations.megatron", os.path.join(tree, "pretrain_gpt.py"),
                           *args], capture_output=True, text=True, env=_env(tree), timeout=280)


PARSER = """
        import json, sys
        from topo_integrations.megatron import install
        install()
        from megatron.training import arguments
        sys.argv = ['pretrain_gpt.py', '--num-layers', '2', '--topo-align', '--topo-align-mode', 'selective',
                    '--topo-align-topology', 'topo.json', '--topo-align-sync-last-n-layers', '3',
                    '--topo-align-top-fraction', '0.2', '--topo-align-reconcile-interval', '8',
                    '--topo-align-async-reconcile', '--topo-align-inter-dtype', 'fp32',
                    '--topo-align-local-dtype', 'fp32', '--topo-align-importance', 'magnitude']
        on = arguments.parse_args()
        sys.argv = ['pretrain_gpt.py', '--num-layers', '2']
        off = arguments.parse_args()
        print(json.dumps({"on": on.topo_align_resolved.model_dump(), "off": off.topo_align_resolved,
                          "num_layers": on.num_layers}))
        sys.argv = ['pretrain_gpt.py', '--topo-align', '--topo-align-top-fraction', '2']
        arguments.parse_args()
"""

INSTALL = """
        import json, sys
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.training import arguments, global_vars, training
        from topo_integrations.megatron import install, uninstall
        real_get_model = training.get_model
        seen = []
        def probe(model_provider_func=None, model_type=None, wrap_with_ddp=True, **k):
            # stands in for get_model's body (same leading parameters: the version gate checks them)
            fields = __import__('dataclasses').fields(training.DistributedDataParallelConfig)
            seen.append((training.DDP.__name__, training.DistributedDataParallelConfig.__name__,
                         [f.name for f in fields][-2:]))
        training.get_model = probe     # install() wraps whatever get_model is
        install()
        for argv in (['x', '--topo-align'], ['x']):
            sys.argv = argv
            global_vars._GLOBAL_ARGS = arguments.parse_args()
            training.get_model()
        uninstall()
        print(json.dumps({"seen": seen, "restored": training.get_model is probe,
                          "ddp_restored": training.DDP is DistributedDataParallel,
                          "cfg_restored": training.DistributedDataParallelConfig is DistributedDataParallelConfig}))
"""

ENTRY = """
    import sys
    from megatron.training import arguments
    if __name__ == "__main__":
        args = arguments.parse_args()
        cfg = args.topo_align_resolved
        print("MODE", cfg.mode if cfg else None, "ARGV0", sys.argv[0])
"""

LAUNCHER = """
    import sys
    from topo_integrations.megatron.__main__ import main
    sys.exit(main([{script!r}, '--num-layers', '2', '--topo-align', '--topo-align-mode', 'hierarchical']))
"""


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    """The parser, install() and launcher snippets, each in a process of its own (`_run_forked`);
    the launcher's ``CompletedProcess.args`` is the entry script it ran."""
    out_dir = tmp_path_factory.mktemp("mlm-forks")
    script = out_dir / "entry.py"
    script.write_text(textwrap.dedent(ENTRY), encoding="utf-8")
    res = _run_forked({"parser": PARSER, "install": INSTALL, "launcher": LAUNCHER.format(script=str(script))},
                      out_dir)
    res["launcher"].args = script
    return res


@pytest.mark.timeout(120)
def test_patch_applies_to_core_v0_16_1():
    # The unpacked tree may sit inside this checkout (.cache/): stop git from finding the project's
    # repository above it, so the patch's paths are read relative to the tree.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(os.path.abspath(MLM)))
    out = subprocess.run(["git", "apply", "--check", "-v", os.path.abspath(PATCH)], cwd=MLM,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    for f in ("megatron/training/arguments.py", "megatron/training/training.py", "pretrain_gpt.py"):
        assert f"Checking patch {f}..." in out.stderr + out.stdout


@pytest.mark.timeout(300)
def test_megatron_lm_parser_accepts_every_flag_and_rejects_bad_values(forked):
    out = forked["parser"]
    assert out.returncode == 2, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["off"] is None and res["num_layers"] == 2
    on = res["on"]
    assert on["mode"] == "selective" and on["topology"]["file"] == "topo.json"
    assert on["sync"]["last_n_layers"] == 3 and on["sync"]["top_fraction"] == 0.2
    assert {k: on["local"][k] for k in ("dtype", "reconcile_interval", "async_reconcile")} == \
        {"dtype": "fp32", "reconcile_interval": 8, "async_reconcile": True}
    assert on["communication"]["inter_dtype"] == "fp32" and on["importance"]["method"] == "magnitude"
    assert out.stderr.strip().splitlines()[-1] == \
        "pretrain_gpt.py: error: argument --topo-align-top-fraction: got '2'; expected a number in [0, 1]"


@pytest.mark.timeout(300)
def test_install_swaps_ddp_only_with_the_flag_and_uninstall_restores(forked):
    out = forked["install"]
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["seen"][0] == ["TopoAlignDDP", "TopoAlignDDPConfig", ["topo_align_resolved", "topo_align_groups"]]
    assert res["seen"][1][:2] == ["DistributedDataParallel", "DistributedDataParallelConfig"]
    assert res["restored"] and res["ddp_restored"] and res["cfg_restored"]


@pytest.mark.timeout(300)
def test_launcher_runs_an_entry_script_with_the_flags(forked):
    out, script = forked["launcher"], forked["launcher"].args
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"MODE hierarchical ARGV0 {script}" in out.stdout


FLAG_HELP = {
    "--topo-align": "Reduce gradients with topo-align (TopoAlignDDP).",
    "--topo-align-config": 'JSON file holding the "topo_align" block',
    "--topo-align-mode": "Reduction mode: flat, hierarchical, selective.",
    "--topo-align-topology": "JSON topology file (sets topology.source to 'file').",
    "--topo-align-sync-last-n-layers": "selective: the last N transformer layers are reduced globally",
    "--topo-align-top-fraction": "selective: fraction of gradient elements",
    "--topo-align-reconcile-interval": "selective: average LOCAL parameters across groups every H",
    "--topo-align-async-reconcile": "selective: overlap reconciliation with the next steps",
    "--topo-align-inter-dtype": "hierarchical: wire dtype across groups (slow tier): fp32, bf16, fp16",
    "--topo-align-local-dtype": "selective: wire dtype of LOCAL gradients inside a group",
    "--topo-align-importance": "selective: importance score: fisher, hutchinson, magnitude.",
}


@pytest.mark.timeout(300)
def test_pretrain_gpt_help_lists_the_flags_and_a_bad_value_is_one_line():
    out = _launch(MLM, "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    text = " ".join(out.stdout.split())  # argparse wraps help text
    for flag, help_text in FLAG_HELP.items():
        assert f"{flag} " in text and help_text in text, flag
    bad = _launch(MLM, "--topo-align", "--topo-align-mode", "fastest")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == ("pretrain_gpt.py: error: argument --topo-align-mode: got "
                                                   "'fastest'; expected one of flat, hierarchical, selective")


@pytest.mark.timeout(300)
def test_a_megatron_lm_whose_seam_differs_is_refused_at_start(tmp_path):
    """The version gate: save_checkpoint with another first parameter (as a newer Megatron-LM could
    have) ends the start with one line naming the seam, both signatures and the supported version."""
    tree = shutil.copytree(MLM, tmp_path / "megatron-lm", symlinks=True)
    ckpt = tree / "megatron" / "training" / "checkpointing.py"
    src = ckpt.read_text()
    assert src.count("def save_checkpoint(iteration, model,") == 1
    ckpt.write_text(src.replace("def save_checkpoint(iteration, model,", "def save_checkpoint(step, model,"))
    out = _launch(str(tree), "--topo-align")
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("topo-align: Megatron-LM's megatron.training.training.save_checkpoint(step, model, ")
    assert line.endswith("does not match the signature topo-align was written for (iteration, model, optimizer, "
                         "...), needed for reconciling before a save and saving the plugin state; refusing to "
                         "patch it; installed megatron-core 0.16.1; supported: Megatron-LM tag core_v0.16.1 "
                         "(megatron-core >=0.16.1,<0.17.0, tested: 0.16.1)")
