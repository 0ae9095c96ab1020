"""topo-align against Megatron-LM's own training code (``megatron.training``, not in the wheel).

Needs a Megatron-LM checkout at tag core_v0.16.1: set ``TOPO_ALIGN_MEGATRON_LM=/path/to/Megatron-LM``
(e.g. ``git -C Megatron-LM archive core_v0.16.1 | tar -x -C /tmp/mlm``). Skipped otherwise.

Megatron-LM imports a few packages only for tokenizers/YAML (``six``, ``regex``, ``yaml``) and
triton kernels; where they are missing, import-only stand-ins are put in ``sys.modules`` in the
child process (nothing they provide is called on these paths).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MLM = os.environ.get("TOPO_ALIGN_MEGATRON_LM")
PATCH = os.path.join(
    os.path.dirname(__file__), "..", "patches", "megatron-lm", "0001-ddp-impl-and-extra-args-chain.patch"
)

pytestmark = pytest.mark.skipif(not MLM or not os.path.isdir(os.path.join(MLM or "", "megatron", "training")),
                                reason="set TOPO_ALIGN_MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1)")

BOOTSTRAP = textwrap.dedent("""
    import importlib, sys, types
    class _Stub(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith('__'):
                raise AttributeError(k)
            return lambda *a, **kw: None
    def _stub(name):
        m = _Stub(name); m.__path__ = []; sys.modules[name] = m
    for name in ('six', 'regex', 'yaml'):
        try:
            importlib.import_module(name)
        except ImportError:
            _stub(name)
    try:
        import triton  # noqa: F401
    except ImportError:
        _stub('megatron.core.transformer.custom_layers.batch_invariant_kernels')
""")


def _run(code: str, *, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", BOOTSTRAP + textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=280)


@pytest.mark.timeout(120)
def test_patch_applies_to_core_v0_16_1():
    out = subprocess.run(["git", "apply", "--check", "-v", os.path.abspath(PATCH)], cwd=MLM,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for f in ("megatron/training/arguments.py", "megatron/training/training.py", "pretrain_gpt.py"):
        assert f"Checking patch {f}..." in out.stderr + out.stdout


@pytest.mark.timeout(300)
def test_megatron_lm_parser_accepts_every_flag_and_rejects_bad_values():
    code = """
        import json, sys
        from topo_integrations.megatron import install
        install()
        from megatron.training import arguments
        sys.argv = ['pretrain_gpt.py', '--num-layers', '2', '--topo-align', '--topo-align-mode', 'selective',
                    '--topo-align-topology', 'topo.json', '--topo-align-sync-last-n-layers', '3',
                    '--topo-align-top-fraction', '0.2', '--topo-align-reconcile-interval', '8',
                    '--topo-align-async-reconcile', '--topo-align-inter-dtype', 'bf16',
                    '--topo-align-local-dtype', 'fp32', '--topo-align-importance', 'magnitude']
        on = arguments.parse_args()
        sys.argv = ['pretrain_gpt.py', '--num-layers', '2']
        off = arguments.parse_args()
        print(json.dumps({"on": on.topo_align_resolved.model_dump(), "off": off.topo_align_resolved,
                          "num_layers": on.num_layers}))
        sys.argv = ['pretrain_gpt.py', '--topo-align', '--topo-align-top-fraction', '2']
        arguments.parse_args()
    """
    out = _run(code)
    assert out.returncode == 2, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["off"] is None and res["num_layers"] == 2
    on = res["on"]
    assert on["mode"] == "selective" and on["topology"]["file"] == "topo.json"
    assert on["sync"]["last_n_layers"] == 3 and on["sync"]["top_fraction"] == 0.2
    assert {k: on["local"][k] for k in ("dtype", "reconcile_interval", "async_reconcile")} == \
        {"dtype": "fp32", "reconcile_interval": 8, "async_reconcile": True}
    assert on["communication"]["inter_dtype"] == "bf16" and on["importance"]["method"] == "magnitude"
    assert out.stderr.strip().splitlines()[-1] == \
        "pretrain_gpt.py: error: argument --topo-align-top-fraction: got '2'; expected a number in [0, 1]"


@pytest.mark.timeout(300)
def test_install_swaps_ddp_only_with_the_flag_and_uninstall_restores():
    code = """
        import json, sys
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.training import arguments, global_vars, training
        from topo_integrations.megatron import install, uninstall
        real_get_model = training.get_model
        seen = []
        def probe(*a, **k):  # stands in for get_model's body: records what `DP = DDP` would pick
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
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["seen"][0] == ["TopoAlignDDP", "TopoAlignDDPConfig", ["topo_align_resolved", "topo_align_groups"]]
    assert res["seen"][1][:2] == ["DistributedDataParallel", "DistributedDataParallelConfig"]
    assert res["restored"] and res["ddp_restored"] and res["cfg_restored"]


@pytest.mark.timeout(300)
def test_launcher_runs_an_entry_script_with_the_flags(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(textwrap.dedent("""
        import sys
        from megatron.training import arguments
        if __name__ == "__main__":
            args = arguments.parse_args()
            cfg = args.topo_align_resolved
            print("MODE", cfg.mode if cfg else None, "ARGV0", sys.argv[0])
    """))
    code = f"""
        import sys
        from topo_integrations.megatron.__main__ import main
        sys.exit(main([{str(script)!r}, '--num-layers', '2', '--topo-align', '--topo-align-mode', 'hierarchical']))
    """
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"MODE hierarchical ARGV0 {script}" in out.stdout
