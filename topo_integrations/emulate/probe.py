"""A tiny TCP probe for emulated links: bulk-transfer time and round-trip latency (stdlib only).

    python -m topo_integrations.emulate.probe serve --bind 10.213.0.2 --port 5201
    python -m topo_integrations.emulate.probe send --to 10.213.0.2 --port 5201 --bytes 2000000 --pings 20

Protocol, per connection (phases):
  1. the client sends ``P`` and 1 byte ``pings`` times; the server echoes each byte (TCP_NODELAY):
     the median round trip is ``rtt_ms``;
  2. the client sends ``S`` + 8-byte length + that many bytes; the server answers ``K`` once it has
     read them all: ``seconds`` runs from the first payload byte sent to the ``K`` received, so it
     includes draining the link's queue and one one-way latency.
``send`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time

_CHUNK = 1 << 16


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(_CHUNK, n - len(buf)))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


def _serve_one(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            op = conn.recv(1)
            if not op:
                return
            if op == b"P":
                conn.sendall(_recv_exact(conn, 1))
            elif op == b"S":
                (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                left = n
                while left:
                    got = conn.recv_into(memoryview(bytearray(min(_CHUNK, left))))
                    if not got:
                        return
                    left -= got
                conn.sendall(b"K")
            else:
                return


def serve(bind: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((bind, port))
        srv.listen(16)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def connect(to: str, port: int, timeout: float) -> socket.socket:
    """Connect, retrying while the server is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((to, port), timeout=max(0.1, deadline - time.monotonic()))
        except (ConnectionRefusedError, socket.timeout, OSError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def send(to: str, port: int, nbytes: int, pings: int, timeout: float = 30.0) -> dict:
    with connect(to, port, timeout) as sock:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"Px")
            _recv_exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        payload = bytes(_CHUNK)
        sock.sendall(b"S" + struct.pack("!Q", nbytes))
        t0 = time.perf_counter()
        left = nbytes
        while left:
            k = min(_CHUNK, left)
            sock.sendall(payload[:k])
            left -= k
        if _recv_exact(sock, 1) != b"K":
            raise ConnectionError("bad acknowledgement")
        secs = time.perf_counter() - t0
    return {
        "bytes": nbytes,
        "seconds": secs,
        "mbit_per_s": nbytes * 8 / secs / 1e6,
        "mbyte_per_s": nbytes / secs / 1e6,
        "rtt_ms": statistics.median(rtts) * 1000 if rtts else None,
        "rtt_ms_min": min(rtts) * 1000 if rtts else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topo_integrations.emulate.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, default=5201)
    c = sub.add_parser("send")
    c.add_argument("--to", required=True)
    c.add_argument("--port", type=int, default=5201)
    c.add_argument("--bytes", type=int, default=2_000_000)
    c.add_argument("--pings", type=int, default=20)
    c.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.bind, a.port)
        return 0
    print(json.dumps(send(a.to, a.port, a.bytes, a.pings, a.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
