"""DeepSpeed adapter: the "topo_align" config block drives topology-aware gradient reduction.

    import topo_integrations.deepspeed as tds
    engine, optimizer, _, _ = tds.initialize(model=model, optimizer=opt, config="ds_config.json")
    # or, for unchanged scripts:  tds.install(); deepspeed.initialize(...)

Modes: ``hierarchical`` at ZeRO 0-3, ``selective`` at ZeRO 0-2 (docs/deepspeed.md). Without the
block, with ``enabled: false`` or ``mode: flat`` the engine is stock DeepSpeed.
"""

from ..config import ConfigError
from .api import initialize, install, installed, read_block, uninstall
from .compat import DeepSpeedVersionError, check_deepspeed, skip_shm_comm_build
from .support import UnsupportedConfigError

__all__ = [
    "initialize", "install", "uninstall", "installed", "read_block",
    "ConfigError", "UnsupportedConfigError", "DeepSpeedVersionError",
    "check_deepspeed", "skip_shm_comm_build",
]
