"""Megatron adapter pieces that need no ranks: flags, classes, launcher usage, CPU-compat guard."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from topo_integrations.config import TopoAlignConfig
from topo_integrations.megatron.flags import FLAG_FIELDS, add_topo_align_args, config_from_args

ALL_FLAGS = [
    "--topo-align",
    "--topo-align-config", "CFG",
    "--topo-align-mode", "hierarchical",
    "--topo-align-topology", "topo.json",
    "--topo-align-sync-last-n-layers", "3",
    "--topo-align-top-fraction", "0.25",
    "--topo-align-reconcile-interval", "8",
    "--no-topo-align-async-reconcile",
    "--topo-align-inter-dtype", "bf16",
    "--topo-align-local-dtype", "fp32",
    "--topo-align-importance", "magnitude",
]


def _parser():
    # Megatron-LM builds its parser with allow_abbrev=False; so do we.
    return add_topo_align_args(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "block.json"
    path.write_text(json.dumps({"mode": "selective", "sync": {"top_fraction": 0.5, "last_n_layers": 7},
                                "local": {"reconcile_interval": 2, "async_reconcile": True}}))
    return str(path)


@pytest.mark.timeout(30)
def test_every_flag_maps_to_its_field(cfg_file):
    argv = [cfg_file if a == "CFG" else a for a in ALL_FLAGS]
    cfg = _parser().parse_args(argv).topo_align_resolved
    assert isinstance(cfg, TopoAlignConfig) and cfg.enabled
    assert cfg.mode == "hierarchical"
    assert (cfg.topology.source, cfg.topology.file) == ("file", "topo.json")
    assert cfg.sync.last_n_layers == 3 and cfg.sync.top_fraction == 0.25
    assert cfg.local.reconcile_interval == 8 and cfg.local.async_reconcile is False
    assert cfg.communication.inter_dtype == "bf16" and cfg.local.dtype == "fp32"
    assert cfg.importance.method == "magnitude"
    # every flag of docs/megatron.md exists
    dests = {a.dest for a in _parser()._actions}
    assert {"topo_align", "topo_align_config", "topo_align_topology", *FLAG_FIELDS} <= dests


@pytest.mark.timeout(30)
def test_method_flag_maps_to_method():
    # ALL_FLAGS runs mode `hierarchical`, which `auto` (settings of `selective`) does not go with
    cfg = _parser().parse_args(["--topo-align", "--topo-align-method", "auto"]).topo_align_resolved
    assert cfg.method == "auto" and cfg.mode == "selective"


@pytest.mark.timeout(30)
def test_flags_override_the_file_and_the_file_overrides_defaults(cfg_file):
    cfg = _parser().parse_args(["--topo-align", "--topo-align-config", cfg_file,
                                "--topo-align-top-fraction", "0.1"]).topo_align_resolved
    assert cfg.mode == "selective"                   # from the file
    assert cfg.sync.last_n_layers == 7               # from the file
    assert cfg.sync.top_fraction == 0.1              # flag beats file
    assert cfg.local.reconcile_interval == 2
    assert cfg.importance.method == "fisher"         # schema default


@pytest.mark.timeout(30)
def test_without_topo_align_the_run_is_stock():
    args = _parser().parse_args([])
    assert args.topo_align is False and args.topo_align_resolved is None
    assert config_from_args(args) is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", [
    (["--topo-align", "--topo-align-mode", "ring"],
     "argument --topo-align-mode: got 'ring'; expected one of flat, hierarchical, selective"),
    (["--topo-align", "--topo-align-top-fraction", "1.5"],
     "argument --topo-align-top-fraction: got '1.5'; expected a number in [0, 1]"),
    (["--topo-align", "--topo-align-top-fraction", "nan"],
     "argument --topo-align-top-fraction: got 'nan'; expected a number in [0, 1]"),
    (["--topo-align", "--topo-align-reconcile-interval", "0"],
     "argument --topo-align-reconcile-interval: got 0; expected an integer in [1, 1000000]"),
    (["--topo-align", "--topo-align-sync-last-n-layers", "two"],
     "argument --topo-align-sync-last-n-layers: got 'two'; expected an integer in [0, 100000]"),
    (["--topo-align", "--topo-align-inter-dtype", "fp8"],
     "argument --topo-align-inter-dtype: got 'fp8'; expected one of fp32, bf16, fp16"),
    (["--topo-align", "--topo-align-local-dtype", "int8"],
     "argument --topo-align-local-dtype: got 'int8'; expected one of fp32, bf16, fp16"),
    (["--topo-align", "--topo-align-importance", "random"],
     "argument --topo-align-importance: got 'random'; expected one of fisher, hutchinson, magnitude"),
    (["--topo-align", "--topo-align-method", "sometimes"],
     "argument --topo-align-method: got 'sometimes'; expected one of fixed, auto"),
    (["--topo-align", "--topo-align-method", "auto", "--topo-align-top-fraction", "0.2"],
     "topo_align: method = 'auto' chooses sync.dtype, sync.top_fraction and local.reconcile_interval itself"),
    (["--topo-align-mode", "selective"],
     "--topo-align-mode given without --topo-align; add --topo-align to turn the plugin on"),
    (["--topo-align", "--topo-align-config", "/nonexistent/block.json"],
     "--topo-align-config: /nonexistent/block.json: cannot read topo-align config"),
])
def test_bad_values_are_rejected_with_one_clear_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt.py: error: ")
    assert message in last
    assert "Traceback" not in err


@pytest.mark.timeout(30)
def test_invalid_file_content_names_field_and_value(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mode": "selective", "local": {"reconcile_interval": "4"}}))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--topo-align", "--topo-align-config", str(bad)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "local.reconcile_interval" in last and "'4'" in last


@pytest.mark.timeout(30)
def test_parse_known_args_resolves_too():
    args, rest = _parser().parse_known_args(["--topo-align", "--unknown-megatron-flag"])
    assert rest == ["--unknown-megatron-flag"]
    assert args.topo_align_resolved.mode == "selective"


@pytest.mark.timeout(30)
def test_adding_flags_twice_is_harmless():
    p = _parser()
    assert add_topo_align_args(p) is p
    assert p.parse_args(["--topo-align"]).topo_align_resolved is not None


@pytest.mark.timeout(30)
def test_engine_classes_with_megatron_global_layers_and_forced_names():
    # What TopoAlignDDP hands the engine: global layer indices, num_layers of the whole model, and
    # forced SYNC names (tied embedding, expert buckets Megatron reduces itself).
    from topo_integrations.reducer.classes.classes import classify

    named = [("embedding.word_embeddings.weight", 1000), ("decoder.layers.0.mlp.weight", 400),
             ("decoder.layers.0.attn.weight", 300), ("decoder.layers.1.mlp.weight", 400),
             ("decoder.final_layernorm.weight", 10), ("output_layer.weight", 1000)]
    names, numels = [n for n, _ in named], [k for _, k in named]
    # a pipeline stage holding only layer 0 of 2 must still count layer 1 as the last one
    layers = {n: (int(n.split(".")[2]) if n.startswith("decoder.layers.") else None) for n in names}
    kw = dict(last_n_layers=1, always_sync=["output_layer"], layers=layers, num_layers=2)
    got = classify(names, numels, top_fraction=0.0, scores=None, **kw)
    assert [n for n in names if got[n] == "SYNC"] == ["decoder.layers.1.mlp.weight", "output_layer.weight"]
    forced = classify(names, numels, top_fraction=0.0, scores=None, exact_names={"embedding.word_embeddings.weight"},
                      **kw)
    assert forced["embedding.word_embeddings.weight"] == "SYNC"
    # importance adds the top tensors within 10% of 3110 elements = 311: attn (300) fits, mlp (400) does not
    scores = [0.0, 9.0, 5.0, 0.0, 0.0, 0.0]
    ranked = classify(names, numels, top_fraction=0.1, scores=scores, **kw)
    assert ranked["decoder.layers.0.attn.weight"] == "SYNC" and ranked["decoder.layers.0.mlp.weight"] == "LOCAL"
    assert set(classify(names, numels, top_fraction=1.0, scores=None, **kw).values()) == {"SYNC"}


REFUSED = [
    ({"communication": {"bucket_size_mb": 10.0}}, dict(),
     "topo_align: communication.bucket_size_mb = 10.0 is not supported by the Megatron adapter (TopoAlignDDP): "
     "Megatron builds the gradient buckets itself; set the bucket size with --ddp-bucket-size "
     "(DistributedDataParallelConfig.bucket_size, in elements) and remove the key"),
    ({"communication": {"overlap": False}}, dict(overlap_grad_reduce=True),
     "topo_align: communication.overlap = False is not supported by the Megatron adapter (TopoAlignDDP): "
     "Megatron decides whether buckets are reduced during backward; use --overlap-grad-reduce "
     "(DistributedDataParallelConfig.overlap_grad_reduce) and remove the key"),
    ({"mode": "selective", "local": {"dtype": "fp16"}}, dict(use_distributed_optimizer=True),
     "topo_align: local.dtype = 'fp16' (--topo-align-local-dtype) is not supported by the Megatron adapter "
     "(TopoAlignDDP): with the distributed optimizer LOCAL gradients travel in the island reduce-scatter of the "
     "whole bucket, in the gradient buffer's dtype; remove the key (or choose the buffer dtype with "
     "--accumulate-allreduce-grads-in-fp32), or use plain DDP (no --use-distributed-optimizer) where local.dtype "
     "applies"),
    ({"mode": "selective", "importance": {"method": "hutchinson"}}, dict(pipeline_parallel_size=2),
     "topo_align: importance.method = 'hutchinson' (--topo-align-importance) is not supported by the Megatron "
     "adapter (TopoAlignDDP): with pipeline parallelism no stage computes the whole loss, so there is no loss "
     "closure to differentiate twice; use 'fisher' or 'magnitude'"),
]

ACCEPTED = [
    ({}, dict(use_distributed_optimizer=True, pipeline_parallel_size=4)),  # defaults never trip a refusal
    (TopoAlignConfig().model_dump(mode="json"), dict(use_distributed_optimizer=True)),  # nor spelled-out defaults
    ({"communication": {"overlap": True}}, dict(overlap_grad_reduce=True)),  # agrees with Megatron's setting
    ({"communication": {"bucket_size_mb": "auto"}}, dict()),  # asks for nothing: Megatron's buckets stay
    ({"method": "auto"}, dict(use_distributed_optimizer=True)),  # issue 38: each engine chooses its method
    ({"mode": "selective", "local": {"dtype": "fp16"}}, dict()),  # plain DDP applies local.dtype
    ({"mode": "hierarchical", "local": {"dtype": "fp16"}}, dict(use_distributed_optimizer=True)),  # unused there
    # the default spelled out is no conflict: with DistOpt the buffer dtype applies (logged at start)
    ({"mode": "selective", "local": {"dtype": "bf16"}}, dict(use_distributed_optimizer=True)),
    ({"mode": "selective", "importance": {"method": "hutchinson"}}, dict()),
    ({"adaptive": {"enabled": True}, "local": {"promote_drift_fraction": 0.1, "async_reconcile": True},
      "topology": {"middle_level": True}, "monitor": {"log_interval": 5},
      "fallback": {"timeout_s": 60.0, "on_flat_topology": "error"}}, dict(use_distributed_optimizer=True)),
]


def _side(**kw):
    from topo_integrations.megatron.refusals import MegatronSide

    return MegatronSide(**{"use_distributed_optimizer": False, "overlap_grad_reduce": True, **kw})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("block, side, message", REFUSED)
def test_refuse_table_names_key_value_adapter_and_replacement(block, side, message):
    from topo_integrations.megatron.refusals import TopoAlignDDPError, check_config

    with pytest.raises(TopoAlignDDPError) as exc:
        check_config(TopoAlignConfig.model_validate(block), _side(**side))
    assert str(exc.value) == message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("block, side", ACCEPTED)
def test_refuse_table_accepts_what_the_adapter_honours(block, side):
    from topo_integrations.megatron.refusals import check_config

    check_config(TopoAlignConfig.model_validate(block), _side(**side))


@pytest.mark.timeout(30)
def test_megatron_settings_the_plugin_cannot_combine():
    from topo_integrations.megatron.refusals import TopoAlignDDPError, check_megatron_settings

    with pytest.raises(TopoAlignDDPError) as exc:
        check_megatron_settings(TopoAlignConfig(), _side(calculate_per_token_loss=True))
    assert str(exc.value) == (
        "topo_align: mode = 'selective' is not supported by the Megatron adapter (TopoAlignDDP) with "
        "calculate_per_token_loss: Megatron all-reduces the token count over the whole data-parallel group, LOCAL "
        "gradients would need group counts; turn --calculate-per-token-loss off or use mode 'hierarchical'")
    check_megatron_settings(TopoAlignConfig.model_validate({"mode": "hierarchical"}),
                            _side(calculate_per_token_loss=True))
    with pytest.raises(TopoAlignDDPError, match="reduce_scatter_with_fp32_accumulation"):
        check_megatron_settings(TopoAlignConfig(), _side(reduce_scatter_with_fp32_accumulation=True))


@pytest.mark.timeout(30)
def test_every_key_is_documented_for_megatron():
    # docs/megatron.md has one row per key of the block: what the adapter does with it or why it refuses.
    import os

    from topo_integrations.megatron.refusals import REFUSALS

    def leaves(model, prefix=""):
        for name, f in type(model).model_fields.items():
            v = getattr(model, name)
            if hasattr(v, "model_fields"):
                yield from leaves(v, f"{prefix}{name}.")
            else:
                yield prefix + name

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "megatron.md"), encoding="utf-8") as fh:
        doc = fh.read()
    keys = list(leaves(TopoAlignConfig()))
    missing = [k for k in keys if f"| `{k}` |" not in doc]
    assert not missing, missing
    assert {r.key for r in REFUSALS} <= set(keys)


@pytest.mark.slow  # starts a Python process
@pytest.mark.timeout(60)
def test_launcher_usage_errors_are_one_line():
    no_args = subprocess.run([sys.executable, "-m", "topo_integrations.megatron"], capture_output=True, text=True)
    assert no_args.returncode == 2 and no_args.stderr.strip().startswith("usage: python -m topo_integrations.megatron")
    missing = subprocess.run([sys.executable, "-m", "topo_integrations.megatron", "/nonexistent/pretrain_gpt.py"],
                             capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("topo-align: /nonexistent/pretrain_gpt.py: no such file "
                                      "(expected a Megatron-LM entry script such as pretrain_gpt.py)")


@pytest.mark.slow  # starts a Python process
@pytest.mark.timeout(120)
def test_cpu_compat_never_activates_when_cuda_is_available():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "from topo_integrations.megatron import cpu_compat\n"
        "assert cpu_compat.apply() is False and not cpu_compat.is_active()\n"
        "assert torch.cuda.current_device is orig\n"
        "from torch.overrides import _get_current_function_mode_stack as s\n"
        "assert not s()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["hierarchical-distopt.args", "selective.args", "selective-auto.args"])
def test_shipped_megatron_configs_parse(name):
    import os
    import shlex

    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "configs", "megatron", name)) as fh:
        argv = shlex.split(fh.read())
    argv = [os.path.join(root, a) if a.endswith(".json") else a for a in argv]
    p = _parser()
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--num-distributed-optimizer-instances", type=int)
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--clip-grad", type=float)
    cfg = p.parse_args(argv).topo_align_resolved
    assert "--num-distributed-optimizer-instances" not in argv  # derived from the topology (megatron/layout.py)
    assert cfg.mode == name.split(".")[0].split("-")[0]
    assert cfg.method == ("auto" if "auto" in name else "fixed")


@pytest.mark.timeout(30)
def test_inter_dtype_in_selective_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--topo-align", "--topo-align-inter-dtype", "bf16"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --topo-align flags: topo_align: communication.inter_dtype = 'bf16' has no effect "
        "in mode 'selective' (the SYNC hop across groups uses sync.dtype, LOCAL gradients stay inside the group); "
        "set sync.dtype instead, or use mode 'hierarchical' (set by --topo-align-inter-dtype)")
    cfg = _parser().parse_args(["--topo-align", "--topo-align-mode", "hierarchical", "--topo-align-inter-dtype",
                                "bf16"]).topo_align_resolved
    assert cfg.communication.inter_dtype == "bf16"
