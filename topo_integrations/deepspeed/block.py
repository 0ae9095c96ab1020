"""The "topo_align" block of a DeepSpeed config, without importing DeepSpeed.

DeepSpeed accepts its config as a dict or a JSON path; the block is one top-level key of it. This
module reads it for the adapter (``api.initialize``) and for tools that only need the settings,
such as the simulator (``sim/workload.py``), so it imports neither DeepSpeed nor torch.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import TopoAlignConfig, load_json_file

__all__ = ["from_deepspeed_config", "BLOCK_KEY"]

BLOCK_KEY = "topo_align"


def from_deepspeed_config(ds_config: Any) -> TopoAlignConfig | None:
    """The validated block of a DeepSpeed config (dict or JSON path), or None when it has none.

    A bad block raises :class:`~topo_integrations.config.ConfigError` naming the field and value."""
    if isinstance(ds_config, (str, os.PathLike)):
        ds_config = load_json_file(ds_config, what="DeepSpeed config")
    if not isinstance(ds_config, dict) or BLOCK_KEY not in ds_config:
        return None
    return TopoAlignConfig.from_block(ds_config[BLOCK_KEY])
