"""The public contract (config keys, CLI subcommands and flags, topology source KINDs) against a
checked-in snapshot, so that a change to it is deliberate.

After an intended change, regenerate the snapshot and commit it with the change:

    .venv/bin/python tests/test_contract.py --update
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("contract_snapshot.json")

pytestmark = pytest.mark.timeout(60)


def config_keys() -> list[str]:
    """Dotted paths of every field of the "topo_align" block, from its JSON Schema."""
    from topo_integrations.config import TopoAlignConfig

    schema = TopoAlignConfig.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        return node

    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, sub in resolve(node).get("properties", {}).items():
            path = f"{prefix}{key}"
            out.append(path)
            target = resolve(sub)
            if "properties" in target:
                walk(target, path + ".")

    walk(schema, "")
    return sorted(out)


def cli_contract() -> dict:
    from topo_integrations.cli import CORE_COMMANDS, OPTIONAL_COMMANDS, build_parser
    from topo_integrations.topology.sources import KINDS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = {}
    for name, p in sub.choices.items():
        if name not in CORE_COMMANDS:
            continue
        flags, positionals = [], []
        for act in p._actions:
            if isinstance(act, argparse._HelpAction):
                continue
            if act.option_strings:
                flags.extend(act.option_strings)
            else:
                positionals.append(act.metavar or act.dest)
        commands[name] = {"flags": sorted(flags), "positionals": positionals}
    return {
        "commands": commands,
        "optional_commands": sorted(OPTIONAL_COMMANDS),
        "source_kinds": list(KINDS),
    }


def current() -> dict:
    from topo_integrations.config import SOURCE_KINDS

    return {"config_keys": config_keys(), "config_source_kinds": list(SOURCE_KINDS), "cli": cli_contract()}


def test_contract_matches_snapshot():
    expected = json.loads(SNAPSHOT.read_text())
    got = current()
    assert got["config_keys"] == expected["config_keys"], "config keys changed: update docs and the snapshot"
    assert got["config_source_kinds"] == expected["config_source_kinds"]
    assert got["cli"] == expected["cli"], "CLI contract changed: update docs/cli.md and the snapshot"


def test_snapshot_covers_design_block():
    keys = set(current()["config_keys"])
    for k in ("mode", "topology.source", "topology.group_by", "topology.min_tier_ratio", "sync.top_fraction",
              "local.reconcile_interval", "local.async_reconcile", "communication.inter_dtype", "fallback.timeout_s",
              "adaptive.check_interval", "monitor.log_interval"):
        assert k in keys
    assert set(current()["cli"]["commands"]) == {"show", "plan", "hostfile", "schema", "doctor", "capture"}


if __name__ == "__main__":
    if "--update" in sys.argv:
        SNAPSHOT.write_text(json.dumps(current(), indent=2, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
    else:
        print(json.dumps(current(), indent=2, sort_keys=True))
