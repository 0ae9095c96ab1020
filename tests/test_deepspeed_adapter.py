"""DeepSpeed adapter, single process: config plumbing, refusals, version/signature checks, the source
patch, ready configs, the shm-op skip. (Multi-rank behaviour: test_deepspeed_multirank.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

import topo_integrations.deepspeed as tds  # noqa: E402
from topo_integrations.config import ConfigError, TopoAlignConfig  # noqa: E402
from topo_integrations.deepspeed import compat  # noqa: E402
from topo_integrations.deepspeed import harness as H  # noqa: E402
from topo_integrations.deepspeed.block import from_deepspeed_config  # noqa: E402
from topo_integrations.deepspeed.support import KEY_REFUSALS, UnsupportedConfigError, check_supported  # noqa: E402
from topo_integrations.reducer.classes.classes import SYNC, classify, layer_indices  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "deepspeed" / "deepspeed-0.19.8-topo-align.patch"


def _init(cfg):
    model = H.Net()
    return tds.initialize(model=model, optimizer=H.make_optimizer("sgd", model.parameters()), config=cfg)


# -- a bad block fails at initialize, naming the field -------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("block, field, value", [
    ({"mode": "fast"}, "topo_align.mode", "'fast'"),
    ({"mode": "selective", "sync": {"lastn": 3}}, "topo_align.sync.lastn", "unknown key"),
    ({"local": {"reconcile_interval": 0}}, "topo_align.local.reconcile_interval", "got 0"),
    ({"communication": {"inter_dtype": "int8"}}, "topo_align.communication.inter_dtype", "'int8'"),
    ({"enabled": "yes"}, "topo_align.enabled", "'yes'"),
])
def test_bad_block_fails_at_initialize_naming_the_field(block, field, value):
    with pytest.raises(ConfigError) as exc:
        _init(H.ds_config(0, topo=block))
    msg = str(exc.value)
    assert field in msg and value in msg, msg


@pytest.mark.timeout(30)
def test_bad_block_in_a_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(H.ds_config(2, topo={"mode": "hierarchical", "topology": {"source": "file"}})))
    with pytest.raises(ConfigError, match=r"topology\.file is required when topology\.source is 'file'"):
        _init(str(path))


@pytest.mark.timeout(30)
def test_block_must_be_an_object():
    with pytest.raises(ConfigError, match=r'topo_align: expected a JSON object .*got list'):
        _init(H.ds_config(0, topo=["hierarchical"]))


@pytest.mark.timeout(30)
def test_read_block():
    assert tds.read_block(H.ds_config(0)) is None
    cfg = tds.read_block(str(ROOT / "configs" / "deepspeed" / "zero2-selective.json"))
    # The shipped example spells the schema's `local` defaults out (LOCAL wire: DeepSpeed's bf16 here).
    assert cfg.mode == "selective" and cfg.local == type(cfg.local)()


# -- unsupported combinations are refused, saying what to use instead ----------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage, mode, extra, says", [
    (3, "selective", {}, r"selective at ZeRO-3 .* use mode 'hierarchical' with ZeRO-3, or ZeRO stage 1 or 2"),
    (3, "hierarchical", {"zero_optimization": {"zero_quantized_gradients": True}},
     r"zero_quantized_gradients .* set zero_quantized_gradients to false"),
    (3, "hierarchical", {"zero_optimization": {"reduce_scatter": False}}, r"reduce_scatter = false .*set it to true"),
    (0, "selective", {"bf16": {"enabled": True}}, r"selective at ZeRO-0 with fp16/bf16 .*use ZeRO stage 1 or 2"),
    (1, "selective", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     r"BF16_Optimizer.*use ZeRO stage 2"),
    (2, "selective", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     r"selective with offload_optimizer.*use mode 'hierarchical'"),
    (2, "hierarchical", {"sequence_parallel_size": 2}, r"sequence_parallel_size > 1"),
])
def test_unsupported_combination_is_refused(stage, mode, extra, says):
    cfg = H.ds_config(stage, topo=H.topo_block(mode), **extra)
    with pytest.raises(UnsupportedConfigError, match=says) as exc:
        _init(cfg)
    assert f"topo_align.mode = '{mode}' with zero_optimization.stage = {stage}" in str(exc.value)


@pytest.mark.timeout(30)
def test_refusals_without_engine():
    sel = TopoAlignConfig.from_block(H.topo_block("selective"))
    with pytest.raises(UnsupportedConfigError, match="an mpu"):
        check_supported(H.ds_config(1), sel, mpu=object())
    # hutchinson and adaptive work in the adapter now: nothing refused.
    check_supported(H.ds_config(2), TopoAlignConfig.from_block(H.topo_block(
        "selective", importance={"method": "hutchinson"}, adaptive={"enabled": True})))
    # flat never reaches a seam, so nothing is refused.
    check_supported(H.ds_config(3, zero_optimization={"zero_quantized_gradients": True}),
                    TopoAlignConfig.from_block({"mode": "flat"}))


# -- the refuse table: a key the adapter cannot honour is refused at initialize, naming it -------

REFUSED = [
    (2, "hierarchical", {"communication": {"bucket_size_mb": 50}}, {},
     "topo_align.communication.bucket_size_mb = 50.0 is not supported by the DeepSpeed adapter (mode 'hierarchical', "
     "ZeRO stage 2): DeepSpeed builds and owns the gradient buckets the adapter reduces; set "
     "zero_optimization.reduce_bucket_size (elements) in the DeepSpeed config instead"),
    (0, "selective", {"communication": {"overlap": False}}, {},
     "topo_align.communication.overlap = False is not supported by the DeepSpeed adapter (mode 'selective', "
     "ZeRO stage 0): DeepSpeed decides when its buckets are reduced during backward; set "
     "zero_optimization.overlap_comm in the DeepSpeed config instead"),
    (2, "selective", {"local": {"dtype": "fp16"}}, {"bf16": {"enabled": True}},
     "topo_align.local.dtype = 'fp16' is not supported by the DeepSpeed adapter (mode 'selective', ZeRO stage 2): "
     "at ZeRO-1/2 `selective` DeepSpeed reduces the LOCAL gradients inside the island itself, in its "
     "communication dtype (bf16); remove local.dtype (or set it to 'bf16'), or set DeepSpeed's "
     "communication_data_type to 'fp16'"),
    (1, "selective", {"local": {"dtype": "bf16"}}, {},
     "topo_align.local.dtype = 'bf16' is not supported by the DeepSpeed adapter (mode 'selective', ZeRO stage 1): "
     "at ZeRO-1/2 `selective` DeepSpeed reduces the LOCAL gradients inside the island itself, in its "
     "communication dtype (fp32); remove local.dtype (or set it to 'fp32'), or set DeepSpeed's "
     "communication_data_type to 'bf16'"),
    (3, "hierarchical", {"topology": {"source": "hostnames", "middle_level": True}}, {},
     "topo_align.topology.middle_level = True is not supported by the DeepSpeed adapter (mode 'hierarchical', "
     "ZeRO stage 3): the adapter's ZeRO-3 reduce-scatter has two levels (island, rail); remove "
     "topology.middle_level, or use ZeRO stage 0-2 for three levels"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage, mode, sections, extra, message", REFUSED,
                         ids=["bucket_size_mb", "overlap", "local.dtype-bf16", "local.dtype-fp32",
                              "middle_level-zero3"])
def test_refused_key_names_key_adapter_and_instead(stage, mode, sections, extra, message):
    # initialize refuses before DeepSpeed builds anything (no process group is needed to get here).
    with pytest.raises(UnsupportedConfigError) as exc:
        _init(H.ds_config(stage, topo=H.topo_block(mode, **sections), **extra))
    assert str(exc.value) == message


@pytest.mark.timeout(30)
def test_method_auto_is_refused_at_zero3_naming_why():
    # issue 38: `auto` chooses among settings of mode `selective`, which ZeRO-3 cannot run
    with pytest.raises(UnsupportedConfigError) as exc:
        _init(H.ds_config(3, topo={"enabled": True, "method": "auto", "topology": {"source": "hostnames"}}))
    assert str(exc.value).endswith(
        "use mode 'hierarchical' with ZeRO-3, or ZeRO stage 1 or 2 for 'selective' (method 'auto' chooses among "
        "settings of mode 'selective': remove it at ZeRO-3)")


@pytest.mark.timeout(30)
def test_refuse_table_only_refuses_what_the_user_set():
    assert {r.key for r in KEY_REFUSALS} == {"communication.bucket_size_mb", "communication.overlap", "local.dtype",
                                             "topology.middle_level"}
    # Defaults (bucket_size_mb auto, overlap true, local.dtype fp16) are never refused, nor an explicit
    # bucket `auto` (DeepSpeed owns the buckets; `auto` asks for nothing) ...
    block = {"enabled": True, "mode": "selective", "topology": {"source": "hostnames"}}
    check_supported(H.ds_config(2, bf16={"enabled": True}), TopoAlignConfig.from_block(block))
    check_supported(H.ds_config(2, bf16={"enabled": True}),
                    TopoAlignConfig.from_block(dict(block, communication={"bucket_size_mb": "auto"})))
    # ... a local.dtype equal to DeepSpeed's communication dtype is honoured, and
    check_supported(H.ds_config(2, bf16={"enabled": True}, topo=None),
                    TopoAlignConfig.from_block(dict(block, local={"dtype": "bf16"})))
    check_supported(H.ds_config(1, communication_data_type="fp16"),
                    TopoAlignConfig.from_block(dict(block, local={"dtype": "fp16"})))
    # ... and at ZeRO-0 the adapter reduces LOCAL gradients itself, in any local.dtype.
    check_supported(H.ds_config(0), TopoAlignConfig.from_block(dict(block, local={"dtype": "bf16"})))


# -- the runtime patcher refuses unknown versions and changed signatures -------------------------

@pytest.mark.timeout(30)
def test_seams_match_installed_deepspeed():
    assert compat.check_deepspeed() == deepspeed.__version__ == "0.19.8"


@pytest.mark.timeout(30)
def test_unknown_version_is_refused(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.21.0")
    with pytest.raises(compat.DeepSpeedVersionError,
                       match=r"DeepSpeed 0\.21\.0 is not supported; .*>=0\.17\.0,<0\.20\.0 \(tested: 0\.19\.8\)"):
        compat.check_deepspeed()


@pytest.mark.timeout(30)
def test_changed_signature_is_refused(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def allreduce_bucket(self, bucket, dtype, rank=None):  # a "future" signature
        raise AssertionError("never called")

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "allreduce_bucket", allreduce_bucket)
    with pytest.raises(compat.DeepSpeedVersionError) as exc:
        compat.check_deepspeed()
    msg = str(exc.value)
    assert "DeepSpeedZeroOptimizer.allreduce_bucket(self, bucket, dtype, rank=None)" in msg
    assert "(self, bucket, communication_data_type, rank, log, divide, process_group)" in msg
    assert "refusing to patch it" in msg


@pytest.mark.timeout(30)
def test_missing_seam_is_refused():
    seam = compat.Seam("deepspeed.runtime.engine", "DeepSpeedEngine.no_such_method", ("self",), "a test")
    with pytest.raises(compat.DeepSpeedVersionError, match=r"has no deepspeed\.runtime\.engine\.DeepSpeedEngine"
                                                           r"\.no_such_method \(needed for a test\)"):
        compat.check_deepspeed(seams=(seam,))


# -- install() routes plain deepspeed.initialize ------------------------------------------------

@pytest.mark.timeout(30)
def test_install_routes_plain_deepspeed_initialize():
    stock = deepspeed.initialize
    tds.install()
    try:
        assert deepspeed.initialize is not stock and tds.installed()
        tds.install()  # idempotent
        model = H.Net()
        with pytest.raises(ConfigError, match="topo_align.mode"):
            deepspeed.initialize(model=model, config=H.ds_config(0, topo={"mode": "ring"}))
    finally:
        tds.uninstall()
    assert deepspeed.initialize is stock and not tds.installed()


# -- the source patch ----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_source_patch_applies_and_reverts(tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("the `patch` tool is not installed")
    src = Path(deepspeed.__file__)
    (tmp_path / "deepspeed").mkdir()
    target = tmp_path / "deepspeed" / "__init__.py"
    shutil.copy(src, target)
    run = lambda *a: subprocess.run(["patch", *a, "-p1", "-d", str(tmp_path), "-i", str(PATCH)],  # noqa: E731
                                    capture_output=True, text=True)
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    text = target.read_text()
    assert "route_initialize" in text
    compile(text, str(target), "exec")
    r = run("-R")
    assert r.returncode == 0, r.stdout + r.stderr
    assert target.read_bytes() == src.read_bytes()


@pytest.mark.timeout(30)
def test_route_initialize_passes_stock_configs_through():
    from topo_integrations.deepspeed.api import route_initialize

    assert route_initialize({"config": H.ds_config(0), "model": None}) is None
    with pytest.raises(ConfigError, match="topo_align.mode"):
        route_initialize({"config": H.ds_config(0, topo={"mode": "x"}), "model": H.Net()})


# -- ready configs -------------------------------------------------------------------------------

CONFIGS = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))


@pytest.mark.timeout(30)
def test_every_stage_and_mode_has_a_config():
    names = {p.stem for p in CONFIGS}
    assert {"zero0-hierarchical", "zero1-hierarchical", "zero2-hierarchical", "zero3-hierarchical",
            "zero0-selective-fp32", "zero1-selective", "zero2-selective"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ready_config_is_valid(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = json.loads(path.read_text())
    cfg = from_deepspeed_config(ds)
    assert cfg is not None and cfg.enabled
    check_supported(ds, cfg)
    stage = ds["zero_optimization"]["stage"]
    assert path.stem.startswith(f"zero{stage}-{cfg.mode}")
    DeepSpeedConfig(ds)  # DeepSpeed itself accepts the file (the block is a top-level key it ignores)


# -- classes and the CPU op ----------------------------------------------------------------------

def _classify(named, sync_cfg, scores=None):
    """The engine's classification rules (reducer/classes/classes.py) as the adapter applies them."""
    names = [n for n, _ in named]
    out = classify(names, [k for _, k in named], last_n_layers=sync_cfg.last_n_layers,
                   always_sync=list(sync_cfg.always_sync), top_fraction=sync_cfg.top_fraction,
                   scores=[scores[n] for n in names] if scores else None,
                   layers=layer_indices(names, layer_pattern=sync_cfg.layer_pattern))
    return {n: c == SYNC for n, c in out.items()}


@pytest.mark.timeout(30)
def test_classes_structure_and_importance():
    named = [(n, p.numel()) for n, p in H.Net().named_parameters()]
    sync_cfg = TopoAlignConfig.from_block(H.topo_block("selective")).sync
    classify = _classify
    sync = classify(named, sync_cfg)
    assert {n for n, s in sync.items() if s} == {"layers.2.weight", "layers.2.bias", "head.weight", "head.bias"}
    total = sum(k for _, k in named)
    frac_cfg = sync_cfg.model_copy(update={"top_fraction": 0.3})
    scores = {n: (10.0 if n == "layers.0.weight" else 1.0) for n, _ in named}
    sync2 = classify(named, frac_cfg, scores)
    assert sync2["layers.0.weight"] and not sync2["layers.1.weight"]
    added = sum(k for n, k in named if sync2[n] and not sync[n])
    assert added <= 0.3 * total
    assert all(classify(named, sync_cfg.model_copy(update={"top_fraction": 1.0}), scores).values())


@pytest.mark.timeout(30)
def test_shm_comm_op_is_not_built():
    import importlib

    tds.skip_shm_comm_build()
    torch_backend = importlib.import_module("deepspeed.comm.torch")  # not `import deepspeed.comm.torch`: shadowed
    assert torch_backend.build_shm_op() is None


@pytest.mark.timeout(120)
def test_module_runner_installs_the_plugin_for_an_unchanged_script(tmp_path):
    """`python -m topo_integrations.deepspeed SCRIPT`: the script's plain deepspeed.initialize is routed."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, deepspeed, torch\n"
        "from topo_integrations.config import ConfigError\n"
        "model = torch.nn.Linear(2, 2)\n"
        "try:\n"
        "    deepspeed.initialize(model=model, config={'train_micro_batch_size_per_gpu': 1,\n"
        "                                              'topo_align': {'mode': 'ring'}})\n"
        "except ConfigError as exc:\n"
        "    print('ROUTED', exc, sys.argv[1:])\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "topo_integrations.deepspeed", str(script), "--x", "1"],
                          capture_output=True, text=True, env=env, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ROUTED topo_align.mode: got 'ring'" in proc.stdout and "['--x', '1']" in proc.stdout, proc.stdout
