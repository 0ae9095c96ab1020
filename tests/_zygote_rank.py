"""A rank for tests/test_emulate.py's zygote test: prints what it sees, then does what argv[1] says
(``ok``, ``fail``: rank 3 exits 3, ``hang``)."""

import json
import os
import socket
import sys
import time

rank = int(os.environ["RANK"])
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet: the kernel picks the route in this namespace
print(json.dumps({"rank": rank, "host": socket.gethostname(), "addr": probe.getsockname()[0], "argv": sys.argv[1:],
                  "preloaded": "colorsys" in sys.modules, "own_session": os.getsid(0) == os.getpid()}))
if sys.argv[1] == "fail" and rank == 3:
    sys.exit(3)
if sys.argv[1] == "hang":
    time.sleep(120)
