"""`python -m topo_integrations.sim ...` = `topo-align simulate ...`."""

import sys

from .cli import main

sys.exit(main())
