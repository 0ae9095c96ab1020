"""`python -m topo_integrations.emulate ...` = `topo-align emulate ...`."""

import sys

from .cli import main

sys.exit(main())
