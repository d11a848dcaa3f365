"""Plain-TCP probes for the NAT check's sanity step (no potluck): run inside a namespace.

  probe.py listen HOST PORT SECONDS   print "listening", then for each connection in SECONDS
                                      answer with the address it came from
  probe.py connect HOST PORT TIMEOUT  print one JSON line: {"ok", "seen_as" (how the listener saw
                                      us: our NAT's public address), "error"}
"""

from __future__ import annotations

import json
import socket
import sys
import time


def listen(host: str, port: int, seconds: float) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, peer = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.sendall(f"{peer[0]}:{peer[1]}\n".encode())


def connect(host: str, port: int, timeout: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            seen_as = conn.makefile().readline().strip()
        print(json.dumps({"ok": True, "seen_as": seen_as}), flush=True)
    except OSError as e:
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    command, host, port, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    {"listen": listen, "connect": connect}[command](host, port, seconds)
