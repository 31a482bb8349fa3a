"""Is the HTTP port free for the server about to listen on it?

On a local cluster that `pdserve serve` starts, the router (direct ingress) or
Serve's proxy binds the configured port only when the application deploys.
If the bind fails then, Serve blocks the port and the deployment fails with
"No available ports", which names neither the port nor the cause. So the port
is checked first:
- something listening on it: the error says so, after a short grace period (a
  server stopped a moment ago may still be exiting);
- nothing listening, but the bind still fails: connections of a server that
  stopped less than a minute ago are in TIME_WAIT, and Serve's direct ingress
  binds without SO_REUSEADDR, which they block. They end within Linux's fixed
  60 s, so this waits for them, saying why.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

LISTENER_GRACE_S = 10.0      # a stopped server's processes are gone within a few seconds
TIME_WAIT_S = 65.0           # Linux holds a closed TCP connection in TIME_WAIT for 60 s


def can_bind(host: str, port: int, *, reuse_address: bool = False) -> bool:
    """True when a listening socket could bind `host`:`port` now, set up as the
    server will set it up (`reuse_address`: SO_REUSEADDR, which connections in
    TIME_WAIT do not block)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def has_listener(host: str, port: int) -> bool:
    """True when something accepts TCP connections on `host`:`port` (a wildcard
    host is reached through loopback)."""
    target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, *, reuse_address: bool = False, listener_grace_s: float | None = None,
                  time_wait_s: float | None = None, poll_s: float = 0.25,
                  notify: Callable[[str], None] = print) -> str | None:
    """Waits until `host`:`port` can be bound; None once it can, else why not
    (a message that says what to change). `notify` hears once why it waits.
    The waits default to LISTENER_GRACE_S and TIME_WAIT_S."""
    listener_grace_s = LISTENER_GRACE_S if listener_grace_s is None else listener_grace_s
    time_wait_s = TIME_WAIT_S if time_wait_s is None else time_wait_s
    started = time.monotonic()
    told = False
    while not can_bind(host, port, reuse_address=reuse_address):
        waited = time.monotonic() - started
        if has_listener(host, port):
            if waited >= listener_grace_s:
                return (f"{host}:{port} is in use by another process: stop what listens there "
                        f"(`ss -ltnp | grep :{port}` shows it) or serve on another port (--port, or "
                        f"http.port in the deployment file)")
        elif waited >= time_wait_s:
            return (f"{host}:{port} cannot be bound although nothing listens on it (after {waited:.0f} s): "
                    f"serve on another port (--port, or http.port in the deployment file)")
        elif not told:
            notify(f"waiting for {host}:{port}: connections of a server that stopped less than a minute "
                   f"ago are closing (TCP TIME_WAIT, at most 60 s)")
            told = True
        time.sleep(poll_s)
    return None


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
