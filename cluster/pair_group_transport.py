"""KV transport over one 2-rank torch.distributed process group per (sender,
receiver) pair: gloo for CPU buffers, NCCL for CUDA buffers, one code path.

Life cycle of a pair (S: a PairGroupSender, R: a PairGroupReceiver):

    R  hosts a TCPStore at R.address; its acceptor thread waits on join slot n
    S  first send() to R ─▶ S's pair thread: connect to R's store,
           epoch = add("kvpair/S/epoch", 1), claim the next free join slot,
           rank 0 of a group on PrefixStore("kvpair/S/<epoch>/pg")
    R  acceptor sees the slot ─▶ R's pair thread: rank 1 of the same group
    S, R  one thread per pair side moves that pair's transfers in `send` order

One transfer, message seq k of the pair (keys under "kvpair/S/<epoch>/"):

    S: set hdr/k = "T <nbytes> <transfer id>" ─▶ send bytes (tag k) ─▶ wait for ack/k
    R: wait for hdr/k ─▶ recv straight into expect()'s buffer ─▶ set ack/k = "" (ok)
       unknown id or wrong size: recv into scratch ─▶ FAILED ─▶ set ack/k = the error
       then delete hdr/k and ack/k-1 (S read it before it wrote hdr/k)
    other headers: "B" heartbeat of an idle sender, "S" stop (the pair is closing)

Headers and acks go through the store, not the group: a pending gloo receive can
be neither polled (`is_completed` stays False until `wait`) nor interrupted, so an
idle pair waiting on the group could never be closed. The data ops of a pair are
posted in the same order on both sides, which is what NCCL needs (it ignores tags).
The receiver's verdict is authoritative and reaches the sender through the ack:
data nobody expects fails the transfer on both sides.

Epochs: a pair that breaks (timeout, peer gone, forget or close while on the
wire) is dropped for good; the sender's next send to that peer builds a new pair
with the next epoch, so nothing of a broken pair is ever reused. A receiver drops
its side when the same sender joins again, when the sender says stop, or when it
hears nothing (not even the idle heartbeat, "B", every timeout_s / 4) for timeout_s.

Timeouts (timeout_s): connecting a pair; each transfer from the moment its header
is posted to its ack; on the receiver, an expected transfer that sees no activity
from its sender. Deadlines are also checked in `poll`, so a FAILED arrives on time
even when a thread is stuck in a call that cannot be interrupted (it then exits
when that call returns). Every path that fails a transfer on the wire first aborts
its group, so the caller's buffer is never touched again.

Caveats: close() does not wait for a thread blocked on a hung peer (it ends within
timeout_s by itself). CUDA buffers: NCCL orders a send after the work queued on the
default stream of its device; make buffers written on other streams ready first.
Each pair holds its own gloo context or NCCL communicator.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cluster.kv_transport import (
    KVReceiver,
    KVSender,
    KVTransportError,
    PeerAddress,
    TransferState,
)

log = logging.getLogger(__name__)

ABORT_TAG = 2**31 - 1          # a tag no data op uses: see _abort_group
TAG_MASK = 2**30 - 1
JOIN_HINT = "kvpair/joins"     # count of claimed join slots (a hint: slots are claimed with compare_set)
FOREVER = datetime.timedelta(days=3650)
MAX_ORPHANS = 256              # failures kept for transfers that arrived without an expect()
JOIN_GRACE_S = 1.0             # how long close() waits for its threads before leaving them


def default_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl") or (backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"backend {backend!r} does not fit device {device}: use 'auto', gloo for cpu, nccl for cuda")
    return backend


def _as_bytes(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The bytes of `buffer` (any dtype, contiguous) as a [nbytes] uint8 view of the same memory."""
    if not isinstance(buffer, torch.Tensor):
        raise KVTransportError(f"KV buffers must be torch tensors, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise KVTransportError(f"KV buffers must be contiguous (shape {tuple(buffer.shape)}, strides "
                               f"{buffer.stride()}): pack them with .contiguous() first")
    if buffer.device.type != device.type or (device.index is not None and buffer.device != device):
        raise KVTransportError(f"KV buffer on {buffer.device}, but this transport was made for {device}")
    return buffer.reshape(-1).view(torch.uint8)


def _left(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _describe(exc: BaseException) -> str:
    """First line of an error, without torch's "[file.cpp:123] " prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text)[:300]


def _connect(peer: PeerAddress, deadline: float, stopped: Callable[[], bool]) -> dist.TCPStore:
    """A client of `peer`'s store. Waits for the port with short tries in Python first:
    TCPStore's own retry loop cannot be left early (close) and overshoots its timeout."""
    while True:
        try:
            with socket.create_connection((peer.host, peer.port), timeout=min(1.0, _left(deadline).total_seconds())):
                break
        except OSError as exc:
            if stopped() or time.monotonic() + 0.05 >= deadline:
                raise ConnectionError(f"nothing answers at {peer.host}:{peer.port} ({exc})") from exc
            time.sleep(0.05)
    return dist.TCPStore(peer.host, peer.port, None, False, timeout=_left(deadline), wait_for_workers=False)


def _make_group(store: dist.Store, rank: int, backend: str, device: torch.device,
                timeout_s: float) -> dist.Backend:
    """Rank `rank` of a 2-rank group on `store`; blocks until both ranks joined (gloo)."""
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        # Our own deadline aborts a late op first: NCCL's watchdog, on timeout, may end the process.
        opts._timeout = datetime.timedelta(seconds=10 * timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)   # NCCL connects on the first op
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))


def _wait_work(work: dist.Work, backend: str, deadline: float) -> None:
    """Waits for one p2p op until `deadline` (monotonic); raises on error or timeout."""
    if backend == "gloo":
        work.wait(_left(deadline))   # a timeout also closes the group's connections
        return
    while not work.is_completed():   # NCCL: wait() would only order streams
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL op did not complete")
        time.sleep(0.0005)
    work.wait()


def _abort_group(group: dist.Backend | None, backend: str, peer_rank: int) -> None:
    """Fails every op pending on `group` at once; afterwards it never touches a buffer."""
    if group is None:
        return
    try:
        if backend == "nccl":
            group.abort()
        else:
            # gloo has no abort, but an op that times out closes all connections of
            # its context, which fails the other pending ops immediately.
            group.recv([torch.empty(1, dtype=torch.uint8)], peer_rank, ABORT_TAG).wait(
                datetime.timedelta(milliseconds=1))
    except Exception:  # expected: the timeout above, or a group already broken
        log.debug("aborted a pair group", exc_info=True)


@dataclass(slots=True, eq=False)
class _Transfer:
    """One transfer's record on one side. `data` ([nbytes] uint8, the caller's
    memory) is dropped once final so that we never keep the caller's buffer alive."""
    tid: str
    src: str                       # sender name
    dst: str                       # receiver name
    data: torch.Tensor | None
    nbytes: int
    created: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    error: str | None = None
    deadline: float | None = None  # while its pair connects, and from its header to its ack

    @property
    def label(self) -> str:
        return f"KV transfer {self.tid} from {self.src} to {self.dst}"

    def finish(self, state: TransferState, error: str | None = None) -> bool:
        if self.state.is_final:
            return False
        self.state, self.error, self.data = state, error, None
        return True


@dataclass(slots=True, frozen=True)
class _Settings:
    name: str
    device: torch.device
    backend: str
    timeout_s: float


class _SendPair:
    """The sending side of one pair and its thread: connect, then move the queued
    transfers one by one. All fields are guarded by the owner's lock."""

    def __init__(self, cfg: _Settings, peer: PeerAddress, lock: threading.Lock):
        self.cfg, self.peer, self.lock = cfg, peer, lock
        self.queue: deque[_Transfer] = deque()
        self.current: _Transfer | None = None
        self.wake = threading.Condition(lock)
        self.connect_deadline = time.monotonic() + cfg.timeout_s
        self.connected = False
        self.broken: str | None = None
        self.store: dist.TCPStore | None = None
        self.msgs: dist.PrefixStore | None = None
        self.group: dist.Backend | None = None
        self.seq = 0
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer.name}", daemon=True)

    def drop(self, reason: str, others: str | None = None) -> None:
        """Breaks the pair: the transfer on the wire fails with `reason`, queued ones
        with `others`. Idempotent, any thread; the next send makes a new pair."""
        with self.lock:
            if self.broken is not None:
                return
            self.broken = reason
            if self.current is not None:
                self.current.finish(TransferState.FAILED, f"{self.current.label} {reason}")
            for t in self.queue:
                t.finish(TransferState.FAILED, f"{t.label} {others or reason}")
            self.queue.clear()
            self.wake.notify_all()
            group = self.group
        _abort_group(group, self.cfg.backend, peer_rank=1)

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as exc:  # noqa: BLE001 - any failure to connect fails the queued transfers
            self.drop(f"failed: could not connect to {self.peer.name} at {self.peer.host}:{self.peer.port} "
                      f"within {self.cfg.timeout_s} s: {_describe(exc)}")
        while self.broken is None:
            with self.lock:
                if not self.queue and self.broken is None:
                    self.wake.wait(self.cfg.timeout_s / 4)
                if self.broken is not None:
                    break
                t = self.queue.popleft() if self.queue else None
                if t is not None and t.state.is_final:   # forgotten while queued
                    continue
                if t is not None:
                    t.state, t.deadline = TransferState.TRANSFERRING, time.monotonic() + self.cfg.timeout_s
                    self.current, data = t, t.data
            try:
                if t is None:
                    self._header("B")      # heartbeat: the receiver drops pairs that go silent
                else:
                    self._move(t, data)
            except Exception as exc:  # noqa: BLE001 - reported in the transfers' errors
                if t is None:
                    self.drop(f"lost: {_describe(exc)}")
                elif t.deadline is not None and time.monotonic() >= t.deadline:
                    self.drop(f"timed out after {self.cfg.timeout_s} s", self.queued_reason())
                else:
                    self.drop(f"failed: {_describe(exc)} (is {self.peer.name} alive?)", self.queued_reason())
        self._teardown()

    def queued_reason(self) -> str:
        return f"failed: not sent, the pair {self.cfg.name} -> {self.peer.name} broke on an earlier transfer"

    def _connect(self) -> None:
        store = _connect(self.peer, self.connect_deadline, lambda: self.broken is not None)
        epoch = store.add(f"kvpair/{self.cfg.name}/epoch", 1)
        payload = f"{epoch} {self.cfg.name}"
        slot = store.add(JOIN_HINT, 0)
        while store.compare_set(f"kvpair/join/{slot}", "", payload) != payload.encode():
            slot += 1
        store.add(JOIN_HINT, 1)
        msgs = dist.PrefixStore(f"kvpair/{self.cfg.name}/{epoch}", store)
        group = _make_group(dist.PrefixStore("pg", msgs), 0, self.cfg.backend, self.cfg.device,
                            _left(self.connect_deadline).total_seconds())
        store.set_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
        with self.lock:
            self.store, self.msgs, self.group, self.connected = store, msgs, group, True
            for t in self.queue:
                t.deadline = None  # from now on each one's clock starts at its header
            broken = self.broken
        if broken is not None:   # dropped (timed out, closed) while connecting
            _abort_group(group, self.cfg.backend, peer_rank=1)

    def _header(self, text: str) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.msgs.set(f"hdr/{seq}", text)
        return seq

    def _move(self, t: _Transfer, data: torch.Tensor) -> None:
        # data: [nbytes] uint8
        seq = self._header(f"T {t.nbytes} {t.tid}")
        if t.nbytes:
            _wait_work(self.group.send([data], 1, seq & TAG_MASK), self.cfg.backend, t.deadline)
        self.msgs.set_timeout(_left(t.deadline))
        verdict = self.msgs.get(f"ack/{seq}").decode()   # blocks until the receiver answers; it deletes the key
        self.msgs.set_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
        with self.lock:
            self.current = None
            if verdict:
                t.finish(TransferState.FAILED, verdict)   # the receiver's message names both sides
            else:
                t.finish(TransferState.DONE)

    def _teardown(self) -> None:
        if self.msgs is not None:
            try:
                self._header("S")   # lets the receiver drop its side now rather than after timeout_s
            except Exception:  # the receiver is gone already
                log.debug("could not tell %s that the pair closed", self.peer.name, exc_info=True)
        with self.lock:
            self.group = self.msgs = self.store = None


class PairGroupSender(KVSender):
    """One per sending process: a lazily connected pair per receiver.

    `name` (default: unique per process) identifies this sender to receivers;
    buffers must be on `device`'s type; `backend` "auto" picks gloo (cpu) or NCCL (cuda)."""

    def __init__(self, name: str | None = None, device: str | torch.device = "cpu", backend: str = "auto",
                 timeout_s: float = 30.0):
        device = torch.device(device)
        self.name = name or default_name("kvsend")
        self._cfg = _Settings(self.name, device, pick_backend(backend, device), float(timeout_s))
        self._lock = threading.Lock()
        self._pairs: dict[PeerAddress, _SendPair] = {}
        self._transfers: dict[str, tuple[_Transfer, _SendPair]] = {}
        self._closed = False

    def send(self, transfer_id: str, peer: PeerAddress, buffer: torch.Tensor) -> None:
        data = _as_bytes(buffer, self._cfg.device)
        with self._lock:
            if self._closed:
                raise KVTransportError(f"KV sender {self.name} is closed")
            if transfer_id in self._transfers:
                raise KVTransportError(f"KV transfer {transfer_id} was already sent by {self.name}; "
                                       "forget() it before reusing the id")
            pair = self._pairs.get(peer)
            new = pair is None or pair.broken is not None
            if new:   # forget broken pairs (to any peer) here: they hold nothing but a record
                for address in [a for a, p in self._pairs.items() if p.broken is not None]:
                    del self._pairs[address]
                pair = self._pairs[peer] = _SendPair(self._cfg, peer, self._lock)
            t = _Transfer(transfer_id, self.name, peer.name, data, data.numel())
            if not pair.connected:
                t.deadline = pair.connect_deadline
            pair.queue.append(t)
            pair.wake.notify()
            self._transfers[transfer_id] = (t, pair)
        if new:
            pair.thread.start()

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            t, pair = self._transfers[transfer_id]
            late = not t.state.is_final and t.deadline is not None and time.monotonic() > t.deadline
        if late:   # the pair thread is stuck in a call it cannot leave early: fail on time anyway
            if pair.connected:
                pair.drop(f"timed out after {self._cfg.timeout_s} s", pair.queued_reason())
            else:
                pair.drop(f"failed: could not connect to {pair.peer.name} at {pair.peer.host}:"
                          f"{pair.peer.port} within {self._cfg.timeout_s} s")
        return t.state

    def error(self, transfer_id: str) -> str | None:
        with self._lock:
            return self._transfers[transfer_id][0].error

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            t, pair = self._transfers.pop(transfer_id)
            on_wire = pair.current is t and not t.state.is_final
            t.finish(TransferState.FAILED, f"{t.label} was forgotten")
        if on_wire:   # the group may still read the buffer: stop it
            pair.drop("was forgotten while on the wire", pair.queued_reason())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.drop(f"failed: KV sender {self.name} closed")
        _join([p.thread for p in pairs])


class _RecvPair:
    """The receiving side of one pair (one sender, one epoch) and its thread."""

    def __init__(self, owner: PairGroupReceiver, sender: str, epoch: int):
        self.owner, self.sender, self.epoch = owner, sender, epoch
        self.current: _Transfer | None = None
        self.broken: str | None = None
        self.group: dist.Backend | None = None
        self.seq = 0
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{sender}", daemon=True)

    def drop(self, reason: str, wake: bool = True) -> None:
        """Breaks the pair; the transfer on the wire fails with `reason`. Any thread;
        `wake` interrupts the pair thread's wait for the next header."""
        owner = self.owner
        with owner._lock:
            if self.broken is not None:
                return
            self.broken = reason
            if self.current is not None:
                self.current.finish(TransferState.FAILED, f"{self.current.label} {reason}")
            seq, group, store = self.seq, self.group, owner._store
            if owner._pairs.get(self.sender) is self:
                del owner._pairs[self.sender]
        _abort_group(group, owner._cfg.backend, peer_rank=0)
        if wake and store is not None:
            try:
                store.set(f"kvpair/{self.sender}/{self.epoch}/hdr/{seq}", "S")
            except Exception:  # the store is shutting down: the wait fails by itself
                log.debug("could not wake the pair thread for %s", self.sender, exc_info=True)

    def _run(self) -> None:
        cfg, lock = self.owner._cfg, self.owner._lock
        try:
            store = _connect(self.owner.address, time.monotonic() + cfg.timeout_s, lambda: self.broken is not None)
            msgs = dist.PrefixStore(f"kvpair/{self.sender}/{self.epoch}", store)
            group = _make_group(dist.PrefixStore("pg", msgs), 1, cfg.backend, cfg.device, cfg.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the sender died or never joined: nothing to fail yet
            self.drop(f"failed: pair with {self.sender} not set up: {_describe(exc)}", wake=False)
            return
        with lock:
            self.group = group
            self.owner._activity[self.sender] = time.monotonic()
            dropped = self.broken is not None
        if dropped:   # while connecting: the loop below will not run
            _abort_group(group, cfg.backend, peer_rank=0)
        msgs.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))   # idle pairs hear a heartbeat sooner
        while self.broken is None:
            try:
                text = msgs.get(f"hdr/{self.seq}").decode()   # blocks until the sender writes it
            except Exception as exc:  # noqa: BLE001 - silence or a lost store both end the pair
                self.drop(f"failed: no word from {self.sender} for {cfg.timeout_s} s ({_describe(exc)})", wake=False)
                break
            with lock:
                if self.broken is not None or text == "S":
                    break
                seq, self.seq = self.seq, self.seq + 1
            try:
                if text != "B":
                    msgs.set(f"ack/{seq}", self._move(seq, text, group))
                # off the critical path: the sender read ack/seq-1 before it wrote hdr/seq
                msgs.delete_key(f"hdr/{seq}")
                msgs.delete_key(f"ack/{seq - 1}")
            except Exception as exc:  # noqa: BLE001 - reported in the transfer's error
                with lock:
                    t = self.current
                late = t is not None and t.deadline is not None and time.monotonic() >= t.deadline
                self.drop(f"timed out after {cfg.timeout_s} s" if late
                          else f"failed: {_describe(exc)} (is {self.sender} alive?)", wake=False)
        self.drop(f"failed: {self.sender} closed the pair", wake=False)   # no-op unless it said stop
        with lock:
            self.group = None

    def _move(self, seq: int, header: str, group: dist.Backend) -> str:
        """Receives one transfer; returns the verdict for the sender ("" = ok)."""
        _, nbytes, tid = header.split(" ", 2)
        nbytes = int(nbytes)
        t, target, verdict = self.owner._claim(self, tid, nbytes)
        if target is None:   # nobody wants these bytes, but they must leave the wire
            target = torch.empty(nbytes, dtype=torch.uint8, device=self.owner._cfg.device)
        if nbytes:
            deadline = t.deadline if t is not None else time.monotonic() + self.owner._cfg.timeout_s
            _wait_work(group.recv([target], 0, seq & TAG_MASK), self.owner._cfg.backend, deadline)
        with self.owner._lock:
            self.current = None
            self.owner._activity[self.sender] = time.monotonic()
            if t is not None and not t.finish(TransferState.DONE):
                verdict = t.error or "failed"
        return verdict


class PairGroupReceiver(KVReceiver):
    """One per receiving process: hosts the rendezvous store at `address`
    (port 0: a free one) and accepts pairs from any sender.

    Data that arrives without an expect() is discarded and kept as a FAILED
    transfer (poll and error answer for it; a later expect() of it fails) until
    forget(), or until MAX_ORPHANS newer ones push it out."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, name: str | None = None,
                 device: str | torch.device = "cpu", backend: str = "auto", timeout_s: float = 30.0):
        device = torch.device(device)
        name = name or default_name("kvrecv")
        self._cfg = _Settings(name, device, pick_backend(backend, device), float(timeout_s))
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.address = PeerAddress(name, host, self._store.port)
        self._lock = threading.Lock()
        self._expected: dict[tuple[str, str], _Transfer] = {}       # (sender, transfer id) ->
        self._orphans: OrderedDict[tuple[str, str], str] = OrderedDict()  # arrived unexpected -> error
        self._activity: dict[str, float] = {}                        # sender -> last data or join
        self._pairs: dict[str, _RecvPair] = {}
        self._closed = False
        self._slot = 0
        self._acceptor = threading.Thread(target=self._accept, name=f"kv-accept-{name}", daemon=True)
        self._acceptor.start()

    def expect(self, transfer_id: str, sender_name: str, buffer: torch.Tensor) -> None:
        data = _as_bytes(buffer, self._cfg.device)
        key = (sender_name, transfer_id)
        with self._lock:
            if self._closed:
                raise KVTransportError(f"KV receiver {self.address.name} is closed")
            if key in self._expected:
                raise KVTransportError(f"KV transfer {transfer_id} from {sender_name} is already expected; "
                                       "forget() it before reusing the id")
            t = self._expected[key] = _Transfer(transfer_id, sender_name, self.address.name, data, data.numel())
            if key in self._orphans:   # its data came first, and was discarded
                t.finish(TransferState.FAILED, self._orphans.pop(key))

    def poll(self, transfer_id: str, sender_name: str) -> TransferState:
        key, now, stuck = (sender_name, transfer_id), time.monotonic(), None
        with self._lock:
            if key in self._orphans:
                return TransferState.FAILED
            t = self._expected[key]
            quiet_since = max(t.created, self._activity.get(sender_name, 0.0))
            if t.state is TransferState.PENDING and now - quiet_since > self._cfg.timeout_s:
                t.finish(TransferState.FAILED, f"{t.label} timed out after {self._cfg.timeout_s} s: no data "
                         f"from {sender_name} (is it alive, and did it send this id?)")
            elif t.state is TransferState.TRANSFERRING and now > t.deadline:
                stuck = self._pairs.get(sender_name)
                if stuck is None or stuck.current is not t:
                    t.finish(TransferState.FAILED, f"{t.label} timed out after {self._cfg.timeout_s} s")
                    stuck = None
        if stuck is not None:   # its thread waits in a call it cannot leave early: fail on time anyway
            stuck.drop(f"timed out after {self._cfg.timeout_s} s")
        return t.state

    def error(self, transfer_id: str, sender_name: str) -> str | None:
        key = (sender_name, transfer_id)
        with self._lock:
            return self._orphans[key] if key in self._orphans else self._expected[key].error

    def forget(self, transfer_id: str, sender_name: str) -> None:
        key = (sender_name, transfer_id)
        with self._lock:
            if self._orphans.pop(key, None) is not None:
                return
            t = self._expected.pop(key)
            pair = self._pairs.get(sender_name)
            on_wire = pair is not None and pair.current is t and not t.state.is_final
            t.finish(TransferState.FAILED, f"{t.label} was forgotten")
        if on_wire:   # the group may still write into the buffer: stop it
            pair.drop("was forgotten while on the wire")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self._expected.values():
                t.finish(TransferState.FAILED, f"{t.label} failed: KV receiver {self.address.name} closed")
            pairs = list(self._pairs.values())
            slot = self._slot
        for pair in pairs:
            pair.drop(f"failed: KV receiver {self.address.name} closed")
        try:
            self._store.compare_set(f"kvpair/join/{slot}", "", "S")   # wakes the acceptor
        except Exception:  # then the acceptor's wait fails when the store goes
            log.debug("could not wake the acceptor of %s", self.address.name, exc_info=True)
        _join([self._acceptor, *(p.thread for p in pairs)])
        self._store = None   # shuts the rendezvous server down; waits still pending on it fail

    # ---- called by the threads ----
    def _accept(self) -> None:
        """Waits on join slots 0, 1, ... and starts the receiving side of each pair."""
        try:
            store = _connect(self.address, time.monotonic() + self._cfg.timeout_s, lambda: self._closed)
        except Exception:  # noqa: BLE001 - closed before the thread ran
            return
        while True:
            key = f"kvpair/join/{self._slot}"
            try:
                store.wait([key], FOREVER)
                text = store.get(key).decode()
            except Exception:  # noqa: BLE001 - the store shut down: the receiver is closed
                return
            epoch, sender = text.split(" ", 1) if " " in text else ("", text)
            with self._lock:
                if self._closed:
                    return
                self._slot += 1
                old = self._pairs.get(sender)
                pair = self._pairs[sender] = _RecvPair(self, sender, int(epoch))
            if old is not None:   # a sender only joins again after dropping its side
                old.drop(f"failed: {sender} started a new pair")
            pair.thread.start()

    def _claim(self, pair: _RecvPair, tid: str, nbytes: int) -> tuple[_Transfer | None, torch.Tensor | None, str]:
        """Matches a header to an expect(): (record, buffer to receive into, verdict)."""
        key = (pair.sender, tid)
        with self._lock:
            self._activity[pair.sender] = time.monotonic()
            t = self._expected.get(key)
            if t is None:
                error = (f"KV transfer {tid} from {pair.sender} to {self.address.name} was not expected "
                         f"(no expect() for this id from this sender, or it was forgotten); "
                         f"its {nbytes} bytes were discarded")
                self._orphans[key] = error
                while len(self._orphans) > MAX_ORPHANS:
                    self._orphans.popitem(last=False)
                return None, None, error
            if t.state.is_final:
                return None, None, t.error or f"{t.label} was already final"
            if t.nbytes != nbytes:
                t.finish(TransferState.FAILED, f"{t.label}: {pair.sender} sent {nbytes} bytes but the buffer "
                         f"given to expect() holds {t.nbytes}; the data was discarded")
                return None, None, t.error
            t.state, t.deadline, pair.current = (TransferState.TRANSFERRING,
                                                 time.monotonic() + self._cfg.timeout_s, t)
            return t, t.data, ""


def _join(threads: list[threading.Thread]) -> None:
    """Joins threads for at most JOIN_GRACE_S in all; one blocked in a call that
    cannot be interrupted is left to finish by itself (they are daemons)."""
    deadline = time.monotonic() + JOIN_GRACE_S
    for thread in threads:
        if thread.ident is not None and thread is not threading.current_thread():
            thread.join(max(deadline - time.monotonic(), 0.0))
