"""Store servers (a TP engine's rank-0 store, a KV receiver's) listen on the
address they are given only, not on every interface as TCPStore does alone."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch.distributed as dist

from engine.tcp_store import listening_store
from engine.tp_group import host_store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")

TIMEOUT = datetime.timedelta(seconds=10)
LOOPBACK_V4 = "0100007F"      # 127.0.0.1 as /proc/net/tcp spells it


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port`, as /proc/net/tcp{,6} spell them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:      # 0A: LISTEN
                    found.add(address)
    return found


def test_a_plain_master_store_listens_on_every_interface():
    # what the helper is for: torch's own server ignores the host it is given
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    assert listening_addresses(store.port) and LOOPBACK_V4 not in listening_addresses(store.port)


def test_the_store_listens_on_its_address_only_and_serves_clients_there():
    store = listening_store("127.0.0.1", 0, None, TIMEOUT)
    assert listening_addresses(store.port) == {LOOPBACK_V4}
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=TIMEOUT)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_tp_engines_rank_zero_store_is_on_loopback():
    store = host_store(2)
    assert listening_addresses(store.port) == {LOOPBACK_V4}


def test_an_address_that_cannot_be_bound_raises():
    with pytest.raises(OSError):
        listening_store("203.0.113.254", 0, None, TIMEOUT)    # TEST-NET-3: no interface has it
