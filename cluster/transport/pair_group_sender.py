"""The sending side of the pair-group KV transport: PairGroupSender (a KVSender)
and _SendPair, the sending side of one pair, one per receiver it sends to, with
the thread that connects that pair and then moves its transfers one by one in
`send` order. The protocol is described in cluster/transport/pair_group_common.py.

Contract: send() never blocks on the network (a pair connects in its own thread,
on the first send to its receiver); a transfer is DONE only once the receiver has
acknowledged its bytes, and FAILED with the receiver's verdict if it refused them;
poll() fails a transfer on time even when its pair thread is stuck in a call that
cannot be interrupted; a transfer that fails while on the wire aborts its pair's
group, and the next send to that receiver makes a new pair, as does a pair the
receiver dropped on its side (seen at the next heartbeat); one that is
forgotten while on the wire finishes its send (the sender owns its buffer, a
private packed copy), so the transfers queued behind it are not failed with it.
All state is guarded by the sender's one lock, which its pair threads share.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from cluster.transport.kv_transport import (
    KVSender,
    KVTransportError,
    PeerAddress,
    TransferState,
)
from cluster.transport.pair_group_common import (
    CLOSED_KEY,
    JOIN_HINT,
    TAG_MASK,
    Settings,
    Transfer,
    abort_group,
    ack_key,
    admitted_verdict,
    as_bytes,
    challenge_key,
    connect_store,
    default_name,
    describe,
    epoch_key,
    group_prefix,
    hdr_key,
    is_challenge,
    join_key,
    join_threads,
    local_address_towards,
    make_group,
    pair_key,
    pair_prefix,
    pick_backend,
    proof_key,
    prove,
    seal,
    time_left,
    unseal,
    verdict_key,
    wait_work,
)

log = logging.getLogger(__name__)


class _SendPair:
    """The sending side of one pair and its thread: connect, then move the queued
    transfers one by one. All fields are guarded by the owner's lock."""

    def __init__(self, cfg: Settings, peer: PeerAddress, lock: threading.Lock):
        self.cfg, self.peer, self.lock = cfg, peer, lock
        self.queue: deque[Transfer] = deque()
        self.current: Transfer | None = None
        self.wake = threading.Condition(lock)
        self.connect_deadline = time.monotonic() + cfg.timeout_s
        self.connected = False
        self.broken: str | None = None
        self.closed_by_peer = False  # the receiver dropped the pair on its side (it reads nothing more)
        self.last_word = time.monotonic()   # when this side last wrote a header (a transfer's or a heartbeat)
        self.store: dist.TCPStore | None = None
        self.msgs: dist.PrefixStore | None = None
        self.group: dist.Backend | None = None
        self.key = b""               # seals this pair's headers and acks (set when the pair is admitted)
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
        abort_group(group, self.cfg.backend, peer_rank=1)

    def _run(self) -> None:
        try:
            self._connect()
        except KVTransportError as exc:   # the receiver answered: it refused the pair (and says why)
            self.drop(f"failed: no pair with {self.peer.name} at {self.peer.host}:{self.peer.port}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure to connect fails the queued transfers
            self.drop(f"failed: could not connect to {self.peer.name} at {self.peer.host}:{self.peer.port} "
                      f"within {self.cfg.timeout_s} s: {describe(exc)}")
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
                    self._heartbeat()
                # after a heartbeat's interval of silence, a pair the receiver dropped fails the transfer
                # now (the next send makes a new pair), not at the transfer's deadline
                elif not (time.monotonic() - self.last_word > self.cfg.timeout_s / 4 and self._peer_closed_the_pair()):
                    self._move(t, data)
            except Exception as exc:  # noqa: BLE001 - reported in the transfers' errors
                if t is None:
                    self.drop(f"lost: {describe(exc)}")
                elif t.deadline is not None and time.monotonic() >= t.deadline:
                    self.drop(f"timed out after {self.cfg.timeout_s} s", self.queued_reason())
                else:
                    self.drop(f"failed: {describe(exc)} (is {self.peer.name} alive?)", self.queued_reason())
        self._teardown()

    def queued_reason(self) -> str:
        return f"failed: not sent, the pair {self.cfg.name} -> {self.peer.name} broke on an earlier transfer"

    def _connect(self) -> None:
        store = connect_store(self.peer, self.connect_deadline, lambda: self.broken is not None)
        epoch = store.add(epoch_key(self.cfg.name), 1)
        payload = f"{epoch} {self.cfg.name}"
        slot = store.add(JOIN_HINT, 0)
        while store.compare_set(join_key(slot), "", payload) != payload.encode():
            slot += 1
        store.add(JOIN_HINT, 1)
        challenge = store.get(challenge_key(slot)).decode("utf-8", "replace")   # posted before the slot opens
        if not is_challenge(challenge):    # not the receiver's: proofs are made for its challenges only
            raise KVTransportError(f"{self.peer.name}'s store holds no valid challenge for join slot {slot}")
        store.set(proof_key(slot), prove(self.cfg.secret, challenge, epoch, self.cfg.name, self.peer.name))
        verdict = store.get(verdict_key(slot)).decode("utf-8", "replace")
        store.delete_key(verdict_key(slot))
        admitted = admitted_verdict(self.cfg.secret, challenge, epoch, self.cfg.name, self.peer.name)
        if not hmac.compare_digest(verdict.encode(), admitted.encode()):
            # a refusal says why; an "admitted" without the receiver's MAC was not written by it
            why = verdict[:200] if verdict.startswith("refused") else "refused: its verdict is not the receiver's"
            raise KVTransportError(f"{self.peer.name} {why}")
        self.key = pair_key(self.cfg.secret, challenge, epoch, self.cfg.name, self.peer.name)
        msgs = dist.PrefixStore(pair_prefix(self.cfg.name, epoch), store)
        # the group's timeout bounds every op of the pair's life (gloo keeps the one it was made with; NCCL's
        # watchdog takes 10x it), not only its rendezvous: the full timeout, as the receiver's, not what the
        # connect left (a late connect made a pair whose ops all failed, or NCCL's watchdog end its process)
        group = make_group(dist.PrefixStore(group_prefix(self.key), msgs), 0, self.cfg.backend, self.cfg.device,
                           self.cfg.timeout_s, local_address_towards(self.peer))
        store.set_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
        with self.lock:
            self.store, self.msgs, self.group, self.connected = store, msgs, group, True
            for t in self.queue:
                t.deadline = None  # from now on each one's clock starts at its header
            broken = self.broken
        if broken is not None:   # dropped (timed out, closed) while connecting
            abort_group(group, self.cfg.backend, peer_rank=1)

    def _heartbeat(self) -> None:
        """Keeps an idle pair alive (the receiver drops pairs that go silent), unless the receiver
        has dropped it already (this process was paused past the timeout, say): then this side
        breaks too, and the next send makes a new pair instead of failing on this one."""
        if not self._peer_closed_the_pair():
            self._header("B")

    def _peer_closed_the_pair(self) -> bool:
        """Whether the receiver dropped this pair on its side (its sealed "closed" key): then this
        side is dropped too, failing what it holds (one store round trip)."""
        if not self.msgs.check([CLOSED_KEY]):
            return False
        notice = unseal(self.key, "closed", 0, self.msgs.get(CLOSED_KEY).decode("utf-8", "replace"))
        if notice is None:
            return False
        self.closed_by_peer = True
        self.drop(f"failed: {self.peer.name} closed the pair on its side ({notice}); the next send makes a "
                  "new one")
        return True

    def _header(self, text: str) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.msgs.set(hdr_key(seq), seal(self.key, "hdr", seq, text))
        self.last_word = time.monotonic()
        return seq

    def _move(self, t: Transfer, data: torch.Tensor) -> None:
        # data: [nbytes] uint8
        seq = self._header(f"T {t.nbytes} {t.tid}")
        if t.nbytes:
            wait_work(self.group.send([data], 1, seq & TAG_MASK), self.cfg.backend, t.deadline)
        self.msgs.set_timeout(time_left(t.deadline))
        sealed = self.msgs.get(ack_key(seq)).decode("utf-8", errors="replace")   # blocks until the receiver answers
        self.msgs.set_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
        verdict = unseal(self.key, "ack", seq, sealed)
        if verdict is None:
            raise KVTransportError(f"the acknowledgement of {t.label} does not carry the pair's seal "
                                   f"(written into {self.peer.name}'s store by someone else?)")
        with self.lock:
            self.current = None
            if verdict:
                t.finish(TransferState.FAILED, verdict)   # the receiver's message names both sides
            else:
                t.finish(TransferState.DONE)

    def _teardown(self) -> None:
        if self.msgs is not None and not self.closed_by_peer:
            try:
                self._header("S")   # lets the receiver drop its side now rather than after timeout_s
            except Exception:  # the receiver is gone already
                log.debug("could not tell %s that the pair closed", self.peer.name, exc_info=True)
        with self.lock:
            self.group = self.msgs = self.store = None


class PairGroupSender(KVSender):
    """One per sending process: a lazily connected pair per receiver.

    `name` (default: unique per process) identifies this sender to receivers;
    buffers must be on `device`'s type; `backend` "auto" picks gloo (cpu) or NCCL (cuda);
    `secret` must be the receivers' (a receiver refuses the pair otherwise)."""

    def __init__(self, name: str | None = None, device: str | torch.device = "cpu", backend: str = "auto",
                 timeout_s: float = 30.0, secret: str = ""):
        device = torch.device(device)
        self.name = name or default_name("kvsend")
        self._cfg = Settings(self.name, device, pick_backend(backend, device), float(timeout_s), secret)
        self._lock = threading.Lock()
        self._pairs: dict[PeerAddress, _SendPair] = {}
        self._transfers: dict[str, tuple[Transfer, _SendPair]] = {}
        self._closed = False

    def send(self, transfer_id: str, peer: PeerAddress, buffer: torch.Tensor) -> None:
        data = as_bytes(buffer, self._cfg.device)
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
            t = Transfer(transfer_id, self.name, peer.name, data, data.numel())
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
        """Drops the record. A transfer on the wire still finishes its send (it owns
        its buffer), so that the transfers queued behind it on the pair go on:
        aborting the group would fail every one of them."""
        with self._lock:
            t, _ = self._transfers.pop(transfer_id)
            t.finish(TransferState.FAILED, f"{t.label} was forgotten")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.drop(f"failed: KV sender {self.name} closed")
        join_threads([p.thread for p in pairs])
