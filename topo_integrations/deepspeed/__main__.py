"""``python -m topo_integrations.deepspeed SCRIPT [ARGS...]``: run an unchanged DeepSpeed training
script with the plugin installed (its plain ``deepspeed.initialize`` honours the "topo_align" block).

Works under launchers: ``torchrun ... -m topo_integrations.deepspeed train.py --deepspeed_config c.json``
or ``deepspeed --module topo_integrations.deepspeed train.py ...``.
"""

from __future__ import annotations

import runpy
import sys


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    script = sys.argv[1]
    from . import install

    install()
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
