"""TopoAlignConfig: defaults equal the README's config reference; every rejection names field, value and
what is accepted."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from topo_integrations.config import ConfigError, TopoAlignConfig

pytestmark = pytest.mark.timeout(60)

DESIGN_BLOCK = {
    "enabled": True,
    "mode": "selective",
    "topology": {"source": "auto", "file": None, "group_by": "island", "min_tier_ratio": 1.3},
    "sync": {"last_n_layers": 5, "always_sync": ["output_layer", "lm_head"], "top_fraction": 0.15, "dtype": "bf16"},
    "local": {"dtype": "fp16", "reconcile_interval": 4, "async_reconcile": True},
    "importance": {"method": "fisher", "ema_decay": 0.99, "refresh_interval": 200},
    "communication": {"inter_dtype": "fp32", "error_feedback": True, "bucket_size_mb": 25, "overlap": True},
    "fallback": {"timeout_s": 600, "on_flat_topology": "flat"},
    "adaptive": {"enabled": False, "check_interval": 100},
    "monitor": {"log_interval": 10},
}


# The `local` defaults issue 15 changed from the design's example block, and the `sync` and bucket ones
# issue 31 made `auto` (CHANGELOG, docs/convergence.md, docs/costmodel.md).
CHANGED_DEFAULTS = {"local.dtype": ("fp16", "bf16"), "local.reconcile_interval": (4, 2),
                    "sync.top_fraction": (0.15, "auto"), "sync.dtype": ("bf16", "auto"),
                    "communication.bucket_size_mb": (25, "auto")}


def test_design_block_is_accepted_and_equals_defaults_but_the_changed_ones():
    cfg = TopoAlignConfig.from_block(DESIGN_BLOCK)
    assert (cfg.local.dtype, cfg.local.reconcile_interval) == ("fp16", 4)
    changed = {k: new for k, (_, new) in CHANGED_DEFAULTS.items()}
    assert cfg.with_overrides(changed) == TopoAlignConfig()
    d = TopoAlignConfig()
    assert (d.local.reconcile_dtype, d.local.moments_interval, d.local.promote_drift_fraction) == ("int8", 4, 0.15)
    assert d.local.moments_dtype == "bf16"
    assert (d.sync.top_fraction, d.sync.dtype, d.sync.last_n_layers) == ("auto", "auto", 5)


def test_auto_sync_follows_the_group_count():
    """Issue 31: `auto` is int8 / 1 from 2 groups on (every tensor SYNC: the 2-, 4- and 8-island
    evidence), bf16 / 0.15 only for an engine without a second tier (then flat, nothing acts);
    explicit values pass through; resolved values are not counted as the user's keys; the log line
    names what `auto` became."""
    from topo_integrations.config import MANY_GROUPS, resolve_sync
    from topo_integrations.reducer.classes.auto_sync import resolved_config

    assert MANY_GROUPS == 2
    assert [resolve_sync("auto", "auto", n) for n in (1, 2, 3, 4, 8, 128)] == \
        [("bf16", 0.15)] + [("int8", 1.0)] * 5
    assert resolve_sync("fp32", "auto", 8) == ("fp32", 1.0) and resolve_sync("auto", 0.3, 2) == ("int8", 0.3)
    cfg = TopoAlignConfig.from_block({"mode": "selective", "local": {"reconcile_interval": 4}})
    # issue 38: a LOCAL-class key set by the user keeps a LOCAL class under `auto`, at every group count
    kept, note = resolved_config(cfg, 8)
    assert (kept.sync.dtype, kept.sync.top_fraction, kept.local.reconcile_interval) == ("bf16", 0.15, 4)
    assert kept.explicit_keys() == {"mode", "local.reconcile_interval"}
    assert note.startswith(
        "topo_align: sync.dtype auto -> bf16, sync.top_fraction auto -> 0.15 at 8 groups: local.reconcile_interval "
        "set, so a LOCAL class is kept for it to act on (without LOCAL-class keys, from 2 groups on every tensor "
        "is SYNC on the int8 wire); ")
    card = resolved_config(TopoAlignConfig.from_block({"mode": "selective", "sync": {"last_n_layers": 2}}), 2)[0]
    assert (card.sync.dtype, card.sync.top_fraction, card.sync.last_n_layers) == ("bf16", 0.15, 2)
    many = cfg.with_overrides({"sync.top_fraction": 1.0, "importance.method": "magnitude", "sync.last_n_layers": 2})
    with pytest.raises(ConfigError) as err:
        resolved_config(many, 2)
    assert str(err.value) == (
        "topo_align: importance.method, local.reconcile_interval, sync.last_n_layers set, but every tensor is SYNC "
        "(sync.top_fraction = 1.0), so nothing is LOCAL for them to act on; set sync.top_fraction below 1 (or "
        "leave it auto: auto keeps a LOCAL class when LOCAL-class keys are set) or remove them")
    assert resolved_config(many, 1)[0].sync.top_fraction == 1.0  # one group: flat, nothing selective acts
    assert resolved_config(many.with_overrides({"mode": "hierarchical"}), 4)[1] is None
    out, note = resolved_config(TopoAlignConfig.from_block({"mode": "selective"}), 8)
    assert (out.sync.dtype, out.sync.top_fraction, out.local.reconcile_interval) == ("int8", 1.0, 2)
    assert out.explicit_keys() == {"mode"}
    assert note == ('topo_align: sync.dtype auto -> int8, sync.top_fraction auto -> 1.0 at 8 groups (from 2 on, '
                    'every tensor is SYNC on the int8 wire: docs/convergence.md, "Many islands"); '
                    'communication.bucket_size_mb auto -> 32 MiB at 8 groups (4 MiB per group: '
                    'fewer ring latencies per byte on a long rail, docs/costmodel.md section 5)')
    kept, _ = resolved_config(cfg.with_overrides({"sync.top_fraction": 0.15}), 8)
    assert (kept.sync.dtype, kept.sync.top_fraction, kept.local.reconcile_interval) == ("bf16", 0.15, 4)
    assert kept.explicit_keys() == {"mode", "local.reconcile_interval", "sync.top_fraction"}
    assert resolved_config(TopoAlignConfig.from_block({"mode": "selective"}), 4)[1].endswith('"Many islands")')
    one, note = resolved_config(TopoAlignConfig.from_block({"mode": "selective", "sync": {"dtype": "fp32"}}), 2)
    assert (one.sync.dtype, one.sync.top_fraction) == ("fp32", 1.0) and note.startswith(
        "topo_align: sync.top_fraction auto -> 1.0 at 2 groups")
    same, note = resolved_config(cfg.with_overrides({"sync.dtype": "bf16", "sync.top_fraction": 0.2}), 8)
    assert note.startswith("topo_align: communication.bucket_size_mb auto")
    assert (same.sync.dtype, same.sync.top_fraction) == ("bf16", 0.2)
    assert resolved_config(TopoAlignConfig.from_block({"mode": "hierarchical"}), 6)[1] is None


def test_auto_bucket_grows_with_the_rail():
    """Issue 31: `auto` buckets are DDP's 25 MiB up to 6 groups, then 4 MiB per group (a ring over
    the groups pays 2(groups - 1) latencies per bucket), in every mode; a number passes through and
    stays the user's key; the log line says what `auto` became only where it differs from 25 MiB."""
    from topo_integrations.config import resolve_bucket_mb
    from topo_integrations.reducer.classes.auto_sync import resolved_config

    assert [resolve_bucket_mb("auto", n) for n in (1, 2, 6, 7, 8, 120, 128, 100_000)] == \
        [25.0, 25.0, 25.0, 28.0, 32.0, 480.0, 512.0, 65536.0]
    assert resolve_bucket_mb(5, 128) == 5.0
    hier = TopoAlignConfig.from_block({"mode": "hierarchical"})
    out, note = resolved_config(hier, 128)
    assert out.communication.bucket_size_mb == 512.0 and out.explicit_keys() == {"mode"}
    assert note == ("topo_align: communication.bucket_size_mb auto -> 512 MiB at 128 groups (4 MiB per group: "
                    "fewer ring latencies per byte on a long rail, docs/costmodel.md section 5)")
    assert resolved_config(hier, 2)[0].communication.bucket_size_mb == 25.0
    mine, note = resolved_config(hier.with_overrides({"communication.bucket_size_mb": 64}), 128)
    assert note is None and mine.communication.bucket_size_mb == 64.0
    assert "communication.bucket_size_mb" in mine.explicit_keys()


@pytest.mark.parametrize(
    "block,message",
    [
        ({"mode": "fast"}, "topo_align.mode: got 'fast'; Input should be 'flat', 'hierarchical' or 'selective'"),
        (
            {"sync": {"top_fraction": 1.5}},
            "topo_align.sync.top_fraction: got 1.5; Input should be a number in [0, 1] or 'auto'",
        ),
        (
            {"local": {"reconcile_interval": 0}},
            "topo_align.local.reconcile_interval: got 0; Input should be greater than or equal to 1",
        ),
        ({"sync": {"dtype": "fp8"}},
         "topo_align.sync.dtype: got 'fp8'; Input should be 'auto', 'fp32', 'bf16', 'fp16' or 'int8'"),
        ({"sync": {"top_fraction": "0.5"}},
         "topo_align.sync.top_fraction: got '0.5'; Input should be a number in [0, 1] or 'auto'"),
        (
            {"local": {"reconcile_interval": "5"}},
            "topo_align.local.reconcile_interval: got '5'; Input should be a valid integer",
        ),
        ({"communication": {"bucket_size_mb": 0}},
         "topo_align.communication.bucket_size_mb: got 0; Input should be a number in (0, 65536] or 'auto'"),
        ({"communication": {"bucket_size_mb": "big"}},
         "topo_align.communication.bucket_size_mb: got 'big'; Input should be a number in (0, 65536] or 'auto'"),
        ({"bogus": 1}, "topo_align.bogus: unknown key (value 1); see `topo-align schema` for the accepted keys"),
        ([], 'topo_align: expected a JSON object (the "topo_align" block), got list'),
    ],
)
def test_exact_messages(block, message):
    with pytest.raises(ConfigError) as err:
        TopoAlignConfig.from_block(block)
    assert str(err.value) == message


def test_cross_field_file_required():
    with pytest.raises(ConfigError, match=r"topology.file is required when topology.source is 'slurm'"):
        TopoAlignConfig.from_block({"topology": {"source": "slurm"}})
    ok = TopoAlignConfig.from_block({"topology": {"source": "slurm", "file": "topology.conf,dgx[001-004]"}})
    assert ok.topology.file == "topology.conf,dgx[001-004]"


def test_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError) and issubclass(ValidationError, ValueError)
    with pytest.raises(ValueError):
        TopoAlignConfig.model_validate({"mode": 3})


def test_from_file_block_and_whole_deepspeed_config(tmp_path):
    p = tmp_path / "block.json"
    p.write_text(json.dumps({"mode": "hierarchical"}))
    assert TopoAlignConfig.from_file(p).mode == "hierarchical"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "topo_align": {"local": {"reconcile_interval": 8}}}))
    assert TopoAlignConfig.from_file(ds).local.reconcile_interval == 8
    from topo_integrations.deepspeed.block import from_deepspeed_config  # the DeepSpeed reader (no deepspeed import)

    assert from_deepspeed_config({"train_batch_size": 8}) is None
    assert from_deepspeed_config(str(ds)).local.reconcile_interval == 8
    ds.write_text(json.dumps({"topo_align": {"local": {"dtype": "fp8"}}}))
    with pytest.raises(ConfigError) as err:
        TopoAlignConfig.from_file(ds)
    assert str(err.value) == f"{ds}: topo_align.local.dtype: got 'fp8'; Input should be 'fp32', 'bf16' or 'fp16'"


@pytest.mark.parametrize("content,needle", [
    (b"{", "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"{" + b'"a":{' * 70 + b"}" * 71, "JSON nested too deeply (more than 64 levels)"),
])
def test_from_file_bad_files(tmp_path, content, needle):
    p = tmp_path / "c.json"
    p.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        TopoAlignConfig.from_file(p)
    assert needle in str(err.value) and str(err.value).startswith(str(p))


def test_missing_file():
    with pytest.raises(ConfigError, match=r"cannot read topo-align config \(No such file or directory\)"):
        TopoAlignConfig.from_file("/nonexistent/x.json")


def test_with_overrides():
    cfg = TopoAlignConfig().with_overrides({"local.reconcile_interval": 8, "mode": "flat"})
    assert (cfg.local.reconcile_interval, cfg.mode) == (8, "flat")
    with pytest.raises(ConfigError, match=r"unknown field 'local.interval'"):
        TopoAlignConfig().with_overrides({"local.interval": 8})


def test_inter_dtype_set_in_selective_is_refused_and_its_default_is_not():
    from topo_integrations.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        TopoAlignConfig.from_block({"mode": "selective", "communication": {"inter_dtype": "fp16"}})
    assert str(exc.value) == (
        "topo_align: communication.inter_dtype = 'fp16' has no effect in mode 'selective' (the SYNC hop across "
        "groups uses sync.dtype, LOCAL gradients stay inside the group); set sync.dtype instead, or use mode "
        "'hierarchical'")
    assert TopoAlignConfig.from_block({"communication": {"inter_dtype": "fp32"}}).mode == "selective"
    assert TopoAlignConfig.from_block({"mode": "hierarchical", "communication": {"inter_dtype": "fp16"}})
