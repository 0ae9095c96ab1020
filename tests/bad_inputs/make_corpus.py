"""Regenerate the bad-input corpus (``python tests/bad_inputs/make_corpus.py``).

Each file is ``<kind>--<name>.<ext>``; kind says how it is loaded (tests/test_reliability_inputs.py):
``config`` (TopoAlignConfig.from_file / ``topo-align doctor --config``), ``topo`` (JSON topology file /
``topo-align plan file:``), ``nccl`` (``nccl-xml:``), ``slurm`` (``slurm:FILE,NODELIST``), ``hostfile``,
``smi`` (``nvidia-smi:``). MANIFEST.json holds the documented error of each (written by the test's
``--regen`` helper, reviewed by hand).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def w(name: str, data) -> None:
    p = HERE / name
    if isinstance(data, (dict, list)) or data is None:
        data = json.dumps(data)
    p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))


def topo(**over):
    base = {"format": "topo-align/topology/v1", "gpus_per_node": 2, "leaves": [{"name": "leaf0", "hosts": "node[0-1]"}]}
    base.update(over)
    return base


def main() -> None:
    rnd = random.Random(9)
    junk = bytes(rnd.randrange(256) for _ in range(512))
    # -- config blocks
    w("config--mode-int.json", {"mode": 3})
    w("config--mode-unknown.json", {"mode": "fast"})
    w("config--mode-trailing-space.json", {"mode": "flat "})
    w("config--string-number.json", {"local": {"reconcile_interval": "5"}})
    w("config--bool-for-int.json", {"local": {"reconcile_interval": True}})
    w("config--float-for-int.json", {"local": {"reconcile_interval": 4.0}})
    w("config--negative-timeout.json", {"fallback": {"timeout_s": -1}})
    w("config--huge-timeout.json", {"fallback": {"timeout_s": 1e300}})
    w("config--huge-integer.json", '{"local": {"reconcile_interval": ' + "9" * 5000 + "}}")
    w("config--nan.json", '{"topology": {"min_tier_ratio": NaN}}')
    w("config--infinity.json", '{"fallback": {"timeout_s": Infinity}}')
    w("config--unknown-key.json", {"modee": "flat"})
    w("config--unknown-nested-key.json", {"sync": {"lastn": 3}})
    w("config--unknown-section.json", {"mode": "flat", "retry": {"count": 3}})
    w("config--deep-nesting-100.json", "{\"a\":" * 100 + "1" + "}" * 100)
    w("config--deep-nesting-20000.json", "[" * 20000 + "]" * 20000)
    w("config--top-list.json", [])
    w("config--top-string.json", '"selective"')
    w("config--null.json", None)
    w("config--empty.json", "")
    w("config--truncated.json", '{"mode": "fla')
    w("config--binary-junk.json", junk)
    w("config--utf16.json", '{"mode": "flat"}'.encode("utf-16"))
    w("config--utf8-bom.json", b"\xef\xbb\xbf" + b'{"mode": "flat"}')
    w("config--dtype-fp8.json", {"communication": {"inter_dtype": "fp8"}})
    w("config--always-sync-string.json", {"sync": {"always_sync": "lm_head"}})
    w("config--always-sync-5000.json", {"sync": {"always_sync": [f"p{i}" for i in range(5000)]}})
    w("config--bucket-zero.json", {"communication": {"bucket_size_mb": 0}})
    w("config--file-source-without-file.json", {"topology": {"source": "file"}})
    w("config--ema-decay-one.json", {"importance": {"ema_decay": 1.0}})
    w("config--deepspeed-block-int.json", {"train_batch_size": 8, "topo_align": 5})
    w("config--xml-instead.json", "<topo_align><mode>flat</mode></topo_align>")
    w("config--nul-in-string.json", '{"mode": "fl\\u0000at"}')
    w("config--adaptive-interval-zero.json", {"adaptive": {"enabled": True, "check_interval": 0}})
    w("config--adaptive-factor-one.json", {"adaptive": {"slowdown_factor": 1.0}})
    w("config--adaptive-window-huge.json", {"adaptive": {"window": 10 ** 9}})
    w("config--source-unknown.json", {"topology": {"source": "ibnetdiscover", "file": "x"}})
    # -- JSON topology files
    w("topo--duplicate-hosts.json", topo(leaves=[{"name": "a", "hosts": "node[0-1]"}, {"name": "b", "hosts": "node1"}]))
    w("topo--duplicate-host-in-list.json", topo(leaves=[{"name": "a", "hosts": "node[0-1],node1"}]))
    w("topo--leaves-empty.json", topo(leaves=[]))
    w("topo--leaves-missing.json", {"format": "topo-align/topology/v1", "gpus_per_node": 2})
    w("topo--unknown-key.json", topo(rails=4))
    w("topo--wrong-format.json", topo(format="topo-align/topology/v9"))
    w("topo--gpus-zero.json", topo(gpus_per_node=0))
    w("topo--gpus-huge.json", topo(gpus_per_node=10 ** 9))
    w("topo--gpus-float.json", topo(gpus_per_node=2.5))
    w("topo--too-many-ranks.json", topo(leaves=[{"name": "a", "hosts": "node[0-99999999]"}]))
    w("topo--negative-bandwidth.json", topo(tiers={"leaf": {"bandwidth_gbps": -5}}))
    w("topo--string-bandwidth.json", topo(tiers={"leaf": {"bandwidth_gbps": "fast"}}))
    w("topo--unknown-tier.json", topo(tiers={"rack": {"bandwidth_gbps": 5}}))
    w("topo--tiers-list.json", topo(tiers=[1, 2]))
    w("topo--island-unknown-host.json", topo(islands=[{"name": "i0", "hosts": "ghost"}]))
    w("topo--bad-hostlist-range.json", topo(leaves=[{"name": "a", "hosts": "node[3-1]"}]))
    w("topo--unclosed-hostlist.json", topo(leaves=[{"name": "a", "hosts": "node[0-3"}]))
    w("topo--duplicate-leaf-name.json", topo(leaves=[{"name": "a", "hosts": "n1"}, {"name": "a", "hosts": "n2"}]))
    w("topo--empty-host.json", topo(leaves=[{"name": "a", "hosts": ""}]))
    w("topo--island-size-zero.json", topo(island_size=0))
    w("topo--deep-nesting.json", "[" * 5000 + "]" * 5000)
    w("topo--binary-junk.json", junk[::-1])
    w("topo--truncated.json", json.dumps(topo())[:40])
    # -- NCCL topology XML
    laughs = (
        '<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
        + "".join(f' <!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">\n' for i in range(1, 10))
        + ']>\n<system version="1"><cpu>&lol9;</cpu></system>\n'
    )
    w("nccl--billion-laughs.xml", laughs)
    w("nccl--external-entity.xml", '<?xml version="1.0"?>\n<!DOCTYPE system [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>\n'
      '<system version="1">&xxe;</system>\n')
    w("nccl--doctype-lowercase.xml", '<!doctype system>\n<system version="1"/>\n')
    w("nccl--truncated.xml", '<system version="1"><cpu numaid="0"><pci busid="0000:07:00.0"')
    w("nccl--binary-junk.xml", junk)
    w("nccl--not-xml.xml", "GPU0 GPU1\nGPU0 X NV12\n")
    w("nccl--huge-dev.xml", '<system version="1"><cpu numaid="0"><pci busid="0000:07:00.0"><gpu dev="99999999999" '
      'sm="80" rank="0" gdr="1"/></pci></cpu></system>\n')
    w("nccl--deep-nesting.xml", "<a>" * 5000 + "</a>" * 5000)
    # -- Slurm topology.conf (loaded with NODELIST node[0-1])
    w("slurm--garbage-line.conf", "SwitchName=s1 Nodes=node[0-1]\nthis is not a slurm line\n")
    w("slurm--cycle.conf", "SwitchName=a Switches=b\nSwitchName=b Switches=a\n")
    w("slurm--binary-junk.conf", junk)
    w("slurm--huge-range.conf", "SwitchName=s1 Nodes=node[0-999999999]\n")
    w("slurm--missing-ranks.conf", "SwitchName=s1 Nodes=other[0-1]\n")
    # -- hostfiles
    w("hostfile--slots-word.txt", "node0 slots=abc\n")
    w("hostfile--slots-zero.txt", "node0 slots=0\n")
    w("hostfile--slots-huge.txt", "node0 slots=99999999999\n")
    w("hostfile--duplicate-hosts.txt", "node0 slots=2\nnode0 slots=2\n")
    w("hostfile--binary-junk.txt", junk)
    w("hostfile--empty.txt", "\n# nothing\n")
    # -- nvidia-smi topo -m
    w("smi--no-header.txt", "hello\nworld\n")
    w("smi--garbage-cells.txt", "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tWAT\t0-63\nGPU1\tWAT\t X \t0-63\n")
    w("smi--binary-junk.txt", junk)


if __name__ == "__main__":
    main()
