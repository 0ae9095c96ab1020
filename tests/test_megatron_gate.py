"""The Megatron adapter's version gate on megatron-core (topo_integrations/megatron/compat.py).

The adapter subclasses megatron-core's private ``_ParamAndGradBucketGroup`` and reads private
attributes of the DDP, its buffers, buckets and optimizers; every one of them is checked at start and
a missing or changed one is refused with one message naming it, the installed megatron-core and the
supported range. The range is written once (``CORE_RANGE``): setup.py's extra is built from it and
constraints.txt pins the version the suite runs.
"""

from __future__ import annotations

import re
import runpy
import types
from pathlib import Path

import pytest

from topo_integrations.config import TopoAlignConfig
from topo_integrations.megatron import compat

ROOT = Path(__file__).resolve().parents[1]
RANGE = "Megatron-LM tag core_v0.16.1 (megatron-core >=0.16.1,<0.17.0, tested: 0.16.1)"
INSTALLED = f"installed megatron-core 0.16.1; supported: {RANGE}"

pytestmark = pytest.mark.timeout(120)


def test_the_gate_passes_on_the_installed_megatron_core():
    assert compat.SUPPORTED == RANGE
    assert compat.check_core() == "0.16.1"
    compat.check_seams(compat.CPU_CORE_SEAMS)


def test_a_renamed_private_class_is_refused_naming_the_version_and_the_range(monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer as pgb

    monkeypatch.delattr(pgb, "_ParamAndGradBucketGroup")
    with pytest.raises(compat.MegatronLMVersionError) as exc:
        compat.check_core()
    assert str(exc.value) == (
        "topo-align: this megatron-core has no megatron.core.distributed.param_and_grad_buffer."
        "_ParamAndGradBucketGroup (needed for TopoBucketGroup, the class Megatron's bucket groups are swapped "
        f"to); {INSTALLED}")


def test_a_changed_signature_is_refused_naming_both(monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer as pgb

    def start_grad_sync(self, force_all_reduce=False, stream=None):  # as a newer core could have it
        raise AssertionError("never called")

    monkeypatch.setattr(pgb._ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)
    with pytest.raises(compat.MegatronLMVersionError) as exc:
        compat.check_core()
    assert str(exc.value) == (
        "topo-align: megatron-core's megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup."
        "start_grad_sync(self, force_all_reduce=False, stream=None) does not match the signature topo-align was "
        "written for (self, force_all_reduce), needed for replacing the bucket group's gradient reduction; "
        f"refusing to patch it; {INSTALLED}")


@pytest.mark.parametrize("version", ["0.17.0", "0.16.0", "0.18.0rc0"])
def test_a_megatron_core_outside_the_range_is_refused(monkeypatch, version):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", version)
    with pytest.raises(compat.MegatronLMVersionError) as exc:
        compat.check_core()
    assert str(exc.value) == (
        f"topo-align: megatron-core {version} is not supported; the Megatron adapter drives megatron-core "
        ">=0.16.1,<0.17.0 (tested: 0.16.1). Install megatron-core==0.16.1, or run without --topo-align "
        "(or with \"enabled\": false) for stock Megatron")


def test_a_missing_attribute_of_a_built_object_is_refused():
    group = types.SimpleNamespace(buckets=[], ddp_config=None, params=set())
    with pytest.raises(compat.MegatronLMVersionError) as exc:
        compat.check_built(group, compat.CORE_BUILT["bucket_group"])
    assert str(exc.value) == (
        "topo-align: this megatron-core's _ParamAndGradBucketGroup has no attribute 'is_first_batch' (needed for "
        f"the replaced start_grad_sync / finish_grad_sync); {INSTALLED}")


def test_an_optimizer_missing_an_attribute_is_refused():
    from topo_integrations.megatron.optimizer import check_optimizer

    config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    fp16 = type("Float16OptimizerWithFloat16Params", (), {})()
    fp16.optimizer, fp16.config, fp16.float16_groups, fp16.fp32_from_float16_groups = None, config, [], []
    with pytest.raises(compat.MegatronLMVersionError) as exc:
        check_optimizer(fp16)
    assert str(exc.value) == (
        "topo-align: this megatron-core's Float16OptimizerWithFloat16Params has no attribute 'fp32_from_fp32_groups' "
        f"(needed for finding the fp32 main parameters (reconciliation)); {INSTALLED}")
    fp16.fp32_from_fp32_groups = []
    check_optimizer(fp16)


def test_topo_align_ddp_refuses_before_megatron_builds_anything(monkeypatch):
    """The gate runs first: Megatron's constructor (which would fail on these placeholder
    arguments) is never reached; with the plugin off, nothing is checked."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from topo_integrations.megatron.ddp import TopoAlignDDP

    monkeypatch.delattr(pgb, "_ParamAndGradBucketGroup")
    cfg = TopoAlignConfig.model_validate({"mode": "hierarchical"})
    with pytest.raises(compat.MegatronLMVersionError, match=r"^topo-align: this megatron-core has no .*"
                       r"_ParamAndGradBucketGroup .*supported: Megatron-LM tag core_v0\.16\.1"):
        TopoAlignDDP(None, DistributedDataParallelConfig(), None, topo_align=cfg)
    off = TopoAlignConfig.model_validate({"mode": "hierarchical", "enabled": False})
    with pytest.raises(AssertionError, match="data parallel group is not initialized"):
        # Megatron's own constructor (no parallel state in this process) fails first: no gate
        TopoAlignDDP(None, DistributedDataParallelConfig(), None, topo_align=off)


def _built_gate(rank, world):
    """On one gloo rank: TopoAlignDDP (plain and distributed optimizer) runs the whole gate on what
    Megatron built, then falls back (one rank is one tier); the optimizers pass `check_optimizer`."""
    from topo_integrations.megatron import cpu_compat

    cpu_compat.apply()
    from topo_integrations.megatron.optimizer import check_optimizer
    from topo_integrations.megatron.testing import TinyGPT, build_gpt, init_parallel, make_optimizer, wrap_ddp

    init_parallel(1)
    out = []
    for dist_opt in (False, True):
        model, cfg = build_gpt(TinyGPT(num_layers=1, hidden_size=16, num_attention_heads=2))
        ddp = wrap_ddp(model, cfg, topo=TopoAlignConfig.model_validate({"mode": "hierarchical"}),
                       use_distributed_optimizer=dist_opt)
        check_optimizer(make_optimizer(ddp))
        out.append(ddp.topo_reason)
    return out


@pytest.mark.multirank  # a world of one rank
@pytest.mark.timeout(300)
def test_the_gate_passes_on_built_megatron_objects():
    from topo_integrations.testing import run_world

    reasons = run_world(1, _built_gate, timeout=280, env={"OMP_NUM_THREADS": "1"})[0]
    assert all(r.startswith("falling back to Megatron's reduction") for r in reasons), reasons


def test_setup_py_admits_exactly_the_gate_s_range_and_ci_pins_the_tested_version(monkeypatch):
    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"))
    assert captured["extras_require"]["megatron"][0] == "megatron-core>=0.16.1,<0.17.0"
    pins = re.findall(r"^megatron-core==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pins == [compat.CORE_TESTED]
