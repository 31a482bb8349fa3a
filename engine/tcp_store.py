"""A torch.distributed TCPStore server that listens on one address only.

`dist.TCPStore(host, port, ..., is_master=True)` listens on every interface
whatever `host` says: anyone who reaches the machine can then read and write
the store that a process group rendezvous on. Here the server gets a socket
bound to `host` (it owns, and closes, the socket from then on).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def listening_store(host: str, port: int, world_size: int | None,
                    timeout: datetime.timedelta) -> dist.TCPStore:
    """The store server on host:port (port 0: one the kernel picks as it binds,
    so no other process can take it first; the store's `port` says which).
    Raises OSError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
