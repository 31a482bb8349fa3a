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

import errno
import socket
import time
from collections.abc import Callable

LISTENER_GRACE_S = 10.0      # a stopped server's processes are gone within a few seconds
TIME_WAIT_S = 65.0           # Linux holds a closed TCP connection in TIME_WAIT for 60 s


def bind_error(host: str, port: int, *, reuse_address: bool = False) -> OSError | None:
    """None when a listening socket could bind `host`:`port` now, set up as the
    server will set it up (`reuse_address`: SO_REUSEADDR, which connections in
    TIME_WAIT do not block); else why not."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            if reuse_address:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:      # socket.gaierror too: a host name that does not resolve
        return exc
    return None


def can_bind(host: str, port: int, *, reuse_address: bool = False) -> bool:
    return bind_error(host, port, reuse_address=reuse_address) is None


WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}   # -> the loopback that reaches them


def has_listener(host: str, port: int) -> bool:
    """True when something accepts TCP connections on `host`:`port`. For a wildcard
    host, anything listening on the port at any address of this machine (it
    blocks the wildcard's bind as surely; a connection through loopback would
    miss a server on the node's own address, and waiting for TIME_WAIT to end
    would not help)."""
    if host in WILDCARD_HOSTS and (ports := _listening_ports()) is not None:
        return port in ports
    try:
        with socket.create_connection((WILDCARD_HOSTS.get(host, host), port), timeout=1.0):
            return True
    except OSError:
        return False


def _listening_ports() -> set[int] | None:
    """The local ports of TCP sockets in LISTEN state (Linux's /proc/net), or None
    where this system does not say."""
    ports: set[int] = set()
    known = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)                       # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) > 3 and fields[3] == "0A":     # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
            known = True
        except (OSError, ValueError):
            continue
    return ports if known else None


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
    while (error := bind_error(host, port, reuse_address=reuse_address)) is not None:
        if (problem := _lasting_problem(host, port, error)) is not None:
            return problem
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


def _lasting_problem(host: str, port: int, error: OSError) -> str | None:
    """What to change when the bind failed for a reason that waiting does not
    clear (anything but the address being in use)."""
    if isinstance(error, socket.gaierror):
        return (f"the HTTP host {host!r} does not resolve ({error.strerror}): give an address of this "
                f"machine (--host, or http.host in the deployment file; 127.0.0.1 or 0.0.0.0)")
    if error.errno == errno.EADDRINUSE:
        return None
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine: give one of its addresses (--host, or http.host "
                f"in the deployment file; 127.0.0.1 or 0.0.0.0)")
    if error.errno == errno.EACCES:
        return (f"{host}:{port} may not be bound by this user (ports below 1024 need privileges): serve on "
                f"another port (--port, or http.port in the deployment file)")
    return (f"{host}:{port} cannot be bound ({error.strerror or error}): change --host / --port (http.host / "
            f"http.port in the deployment file)")


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
