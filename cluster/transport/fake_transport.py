"""An in-process fake of the KV transport, with failure injection, for tests of
the servers above it (one process, no network, no threads).

    hub = FakeTransportHub()
    tx, rx = hub.sender("prefill-0"), hub.receiver("decode-0")
    rx.expect("t1", "prefill-0", dst)          # PENDING
    tx.send("t1", rx.address, src)             # PENDING
    tx.poll("t1")                              # DONE: dst holds src's bytes

Progress happens only inside `poll` (any poll, on any endpoint of the hub, moves
every transfer that can move), under the hub's lock, so tests are deterministic:

    send + matching expect ─▶ TRANSFERRING ─▶ (hub.delay_s later) bytes copied ─▶ DONE

Differences from the real transport, on purpose: a failure fails both sides at
once (the real one lets the receiver find out by its own timeout); nothing times
out by itself (use `fail_next` or `kill`); data nobody expects fails the send at
once; the receiver's poll reports it FAILED, as does any later `expect` of it.

Injection: `fail_next(n, when, message, name=..., transfer_id=...)` fails the next
n matching transfers when their pair connects ("connect": the first transfer of a
sender/receiver pair, or the first after that pair failed) or when they would
move ("transfer"); `kill(name)` is a process dying: its transfers and the
transfers of its peers with it turn FAILED and its endpoints refuse new transfers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.transport.kv_transport import (
    KVReceiver,
    KVSender,
    KVTransportError,
    PeerAddress,
    TransferState,
)


@dataclass(slots=True, eq=False)
class _Side:
    """One side's record of a transfer; `data` is [nbytes] uint8 of the caller's buffer."""
    data: torch.Tensor
    state: TransferState = TransferState.PENDING
    error: str | None = None
    started: float = 0.0   # when both sides had posted

    def finish(self, state: TransferState, error: str | None = None) -> None:
        if not self.state.is_final:
            self.state, self.error = state, error


@dataclass(slots=True)
class _Fault:
    count: int
    when: str
    message: str
    name: str | None
    transfer_id: str | None

    def matches(self, when: str, src: str, dst: str, tid: str) -> bool:
        return (self.count > 0 and self.when == when and self.name in (None, src, dst)
                and self.transfer_id in (None, tid))


def _bytes_of(buffer: torch.Tensor) -> torch.Tensor:
    if not buffer.is_contiguous():
        raise KVTransportError("KV buffers must be contiguous: pack them with .contiguous() first")
    return buffer.reshape(-1).view(torch.uint8)


class FakeTransportHub:
    """The shared registry: endpoints by name, transfers by (sender, receiver, id), faults."""

    def __init__(self, delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.delay_s = delay_s      # how long a transfer stays TRANSFERRING
        self._clock = clock
        self._lock = threading.RLock()
        self._sends: dict[tuple[str, str], tuple[str, _Side]] = {}        # (sender, id) -> (receiver, side)
        self._expects: dict[tuple[str, str, str], _Side] = {}              # (receiver, sender, id) -> side
        self._refused: dict[tuple[str, str, str], str] = {}                # arrived unexpected -> error
        self._receivers: set[str] = set()
        self._dead: set[str] = set()
        self._connected: set[tuple[str, str]] = set()
        self._faults: list[_Fault] = []

    def sender(self, name: str) -> FakeSender:
        """A new endpoint (a new process: a name killed or closed before lives again)."""
        with self._lock:
            self._dead.discard(name)
        return FakeSender(self, name)

    def receiver(self, name: str) -> FakeReceiver:
        with self._lock:
            self._dead.discard(name)
            self._receivers.add(name)
        return FakeReceiver(self, name)

    def fail_next(self, n: int = 1, when: str = "transfer", message: str = "injected failure",
                  name: str | None = None, transfer_id: str | None = None) -> None:
        """The next `n` transfers that match (`name`: either side's name) fail with `message`."""
        if when not in ("connect", "transfer"):
            raise ValueError(f"when must be 'connect' or 'transfer', got {when!r}")
        with self._lock:
            self._faults.append(_Fault(n, when, message, name, transfer_id))

    def kill(self, name: str) -> None:
        """`name`'s process dies: its transfers and its peers' transfers with it fail."""
        self._stop(name, f"{name} died")

    def step(self) -> None:
        """Moves every transfer that can move (poll calls this)."""
        with self._lock:
            now = self._clock()
            for (src, tid), (dst, send) in self._sends.items():
                if send.state.is_final:
                    continue
                expect = self._expects.get((dst, src, tid))
                if send.state is TransferState.PENDING:
                    self._start(src, dst, tid, send, expect, now)
                if send.state is not TransferState.TRANSFERRING:
                    continue
                if expect is None or expect.state is not TransferState.TRANSFERRING:
                    send.finish(TransferState.FAILED, f"KV transfer {tid} from {src} to {dst} failed: "
                                "the receiver gave up on it")
                elif now - send.started >= self.delay_s:
                    expect.data.copy_(send.data)
                    send.finish(TransferState.DONE)
                    expect.finish(TransferState.DONE)

    # ---- internals, under the lock ----
    def _start(self, src: str, dst: str, tid: str, send: _Side, expect: _Side | None, now: float) -> None:
        error = self._refusal(src, dst, tid, send, expect)
        if error is not None:
            self._fail(src, dst, send, expect, error)
        elif expect is None or expect.state.is_final:
            error = f"KV transfer {tid} from {src} to {dst} was not expected (no expect() for this id from this sender)"
            self._refused[(dst, src, tid)] = error
            send.finish(TransferState.FAILED, error)
        else:
            send.state = expect.state = TransferState.TRANSFERRING
            send.started = expect.started = now

    def _refusal(self, src: str, dst: str, tid: str, send: _Side, expect: _Side | None) -> str | None:
        """Why this transfer cannot start (None: it can, or nobody expects it)."""
        label = f"KV transfer {tid} from {src} to {dst}"
        if dst in self._dead or dst not in self._receivers:
            return f"{label} failed: {dst} is not reachable"
        if (src, dst) not in self._connected:
            fault = self._take("connect", src, dst, tid)
            if fault is not None:
                return f"{label} failed to connect: {fault}"
            self._connected.add((src, dst))
        if expect is None or expect.state.is_final:
            return None
        if expect.data.numel() != send.data.numel():
            return (f"{label}: {src} sent {send.data.numel()} bytes but the buffer given to expect() "
                    f"holds {expect.data.numel()}")
        fault = self._take("transfer", src, dst, tid)
        return None if fault is None else f"{label} failed: {fault}"

    def _fail(self, src: str, dst: str, send: _Side, expect: _Side | None, error: str) -> None:
        self._connected.discard((src, dst))   # like a broken pair: the next transfer connects again
        send.finish(TransferState.FAILED, error)
        if expect is not None:
            expect.finish(TransferState.FAILED, error)

    def _take(self, when: str, src: str, dst: str, tid: str) -> str | None:
        for fault in self._faults:
            if fault.matches(when, src, dst, tid):
                fault.count -= 1
                return fault.message
        return None

    def _stop(self, name: str, why: str) -> None:
        with self._lock:
            self._dead.add(name)
            for (src, tid), (dst, send) in self._sends.items():
                if name in (src, dst):
                    error = f"KV transfer {tid} from {src} to {dst} failed: {why}"
                    self._fail(src, dst, send, self._expects.get((dst, src, tid)), error)
            for (dst, src, tid), expect in self._expects.items():
                if name in (src, dst):
                    expect.finish(TransferState.FAILED, f"KV transfer {tid} from {src} to {dst} failed: {why}")

    def _check_alive(self, name: str) -> None:
        if name in self._dead:
            raise KVTransportError(f"KV endpoint {name} is closed or dead")


class FakeSender(KVSender):
    def __init__(self, hub: FakeTransportHub, name: str):
        self._hub, self.name = hub, name

    def send(self, transfer_id: str, peer: PeerAddress, buffer: torch.Tensor) -> None:
        hub = self._hub
        with hub._lock:
            hub._check_alive(self.name)
            if (self.name, transfer_id) in hub._sends:
                raise KVTransportError(f"KV transfer {transfer_id} was already sent by {self.name}")
            hub._sends[(self.name, transfer_id)] = (peer.name, _Side(_bytes_of(buffer)))

    def _side(self, transfer_id: str) -> _Side:
        return self._hub._sends[(self.name, transfer_id)][1]

    def poll(self, transfer_id: str) -> TransferState:
        self._hub.step()
        with self._hub._lock:
            return self._side(transfer_id).state

    def error(self, transfer_id: str) -> str | None:
        with self._hub._lock:
            return self._side(transfer_id).error

    def forget(self, transfer_id: str) -> None:
        with self._hub._lock:
            dst, side = self._hub._sends.pop((self.name, transfer_id))
            side.finish(TransferState.FAILED, "forgotten")
            expect = self._hub._expects.get((dst, self.name, transfer_id))
            if expect is not None and expect.state is TransferState.TRANSFERRING:
                expect.finish(TransferState.FAILED, f"KV transfer {transfer_id} from {self.name} to {dst} "
                              "failed: the sender gave up on it")

    def close(self) -> None:
        self._hub._stop(self.name, f"{self.name} closed")


class FakeReceiver(KVReceiver):
    def __init__(self, hub: FakeTransportHub, name: str):
        self._hub = hub
        self.address = PeerAddress(name, "fake", 0)

    def expect(self, transfer_id: str, sender_name: str, buffer: torch.Tensor) -> None:
        hub, key = self._hub, (self.address.name, sender_name, transfer_id)
        with hub._lock:
            hub._check_alive(self.address.name)
            if key in hub._expects:
                raise KVTransportError(f"KV transfer {transfer_id} from {sender_name} is already expected")
            side = hub._expects[key] = _Side(_bytes_of(buffer))
            if key in hub._refused:
                side.finish(TransferState.FAILED, hub._refused.pop(key))

    def poll(self, transfer_id: str, sender_name: str) -> TransferState:
        self._hub.step()
        key = (self.address.name, sender_name, transfer_id)
        with self._hub._lock:   # data that came unexpected reads as FAILED, as in the real transport
            return TransferState.FAILED if key in self._hub._refused else self._hub._expects[key].state

    def error(self, transfer_id: str, sender_name: str) -> str | None:
        key = (self.address.name, sender_name, transfer_id)
        with self._hub._lock:
            return self._hub._refused[key] if key in self._hub._refused else self._hub._expects[key].error

    def forget(self, transfer_id: str, sender_name: str) -> None:
        key = (self.address.name, sender_name, transfer_id)
        with self._hub._lock:
            if self._hub._refused.pop(key, None) is not None:
                return
            side = self._hub._expects.pop(key)
            side.finish(TransferState.FAILED, "forgotten")
            entry = self._hub._sends.get((sender_name, transfer_id))
            if entry is not None and entry[0] == self.address.name and entry[1].state is TransferState.TRANSFERRING:
                entry[1].finish(TransferState.FAILED, f"KV transfer {transfer_id} from {sender_name} to "
                                f"{self.address.name} failed: the receiver gave up on it")

    def close(self) -> None:
        self._hub._stop(self.address.name, f"{self.address.name} closed")
