"""`python -m topo_integrations.bench ...` = `topo-align bench ...`."""

import sys

from .cli import main

sys.exit(main())
