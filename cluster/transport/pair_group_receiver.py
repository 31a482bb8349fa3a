"""The receiving side of the pair-group KV transport: PairGroupReceiver (a
KVReceiver), which hosts the rendezvous store and accepts new pairs in its
acceptor thread, and _RecvPair, the receiving side of one pair (one sender, one
epoch), whose thread receives that sender's transfers in order. The protocol is
described in cluster/transport/pair_group_common.py.

Contract: expect() registers the buffer for (sender, transfer id) before the
data comes; the receiver's verdict on each transfer (received into the expected
buffer, or refused: not expected, wrong size, already final) is authoritative and
goes back to the sender in the ack. Data nobody expects is discarded and kept as
a FAILED record (at most MAX_ORPHANS of them). poll() fails a transfer on time
even when its pair thread is stuck in a call that cannot be interrupted; a
transfer that fails while on the wire aborts its pair's group, so its buffer is
not written again; one forgotten while on the wire finishes into its buffer,
unread (forget), and the pair goes on. All state is guarded by the receiver's one
lock, which its acceptor and pair threads share.
"""

from __future__ import annotations

import datetime
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from cluster.transport.kv_transport import (
    KVReceiver,
    KVTransportError,
    PeerAddress,
    TransferState,
)
from cluster.transport.pair_group_common import (
    CHALLENGE_BYTES,
    CLOSED_KEY,
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
    group_prefix,
    hdr_key,
    host_store,
    join_key,
    join_threads,
    make_group,
    pair_key,
    pair_prefix,
    pick_backend,
    proof_holds,
    proof_key,
    seal,
    unseal,
    verdict_key,
    wait_work,
)

log = logging.getLogger(__name__)

FOREVER = datetime.timedelta(days=3650)
MAX_ORPHANS = 256              # failures kept for transfers that arrived without an expect()
_MAX_VERIFYING = 32            # joins whose proof of the secret is awaited at once (a thread each)
_MAX_STORE_FAILURES = 50       # the acceptor gives up after this many store errors in a row (not closed)
# a join: "<epoch> <sender name>", the epoch in ASCII digits
_JOIN = re.compile(r"([0-9]{1,18}) (\S{1,256})")


class _RecvPair:
    """The receiving side of one pair (one sender, one epoch, joined at `slot`
    against `challenge`) and its thread; it counts as the sender's pair once
    the sender proved the secret."""

    def __init__(self, owner: PairGroupReceiver, sender: str, epoch: int, slot: int, challenge: str):
        self.owner, self.sender, self.epoch = owner, sender, epoch
        self.slot, self.challenge = slot, challenge
        self.current: Transfer | None = None
        self.broken: str | None = None
        self.group: dist.Backend | None = None
        self.key = b""          # seals this pair's headers and acks (set once the sender proved the secret)
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
            owner._forget_sender_if_done(self.sender)
        abort_group(group, owner._cfg.backend, peer_rank=0)
        if wake and store is not None:
            try:   # the thread sees `broken` once the get returns, whatever the header says
                store.set(f"{pair_prefix(self.sender, self.epoch)}/{hdr_key(seq)}", "S")
            except Exception:  # the store is shutting down: the wait fails by itself
                log.debug("could not wake the pair thread for %s", self.sender, exc_info=True)

    def _admit(self, store: dist.TCPStore) -> bool:
        """Checks the sender's proof of the secret and answers the verdict; an
        admitted pair replaces the sender's previous one, unless that one is of a
        later epoch (this join was slow, and its sender has moved on)."""
        owner = self.owner
        try:
            proof = store.get(proof_key(self.slot)).decode("utf-8", errors="replace")   # waits up to timeout_s
        finally:
            owner._verifying.release()
        if not proof_holds(proof, owner._cfg.secret, self.challenge, self.epoch, self.sender, owner.address.name):
            log.warning("KV receiver %s refused a pair from %r: wrong secret", owner.address.name, self.sender)
            owner._refuse(store, self.slot, "refused: the secret does not match (is the sender from this "
                                            "deployment?)", proof_read=True)
            return False
        self.key = pair_key(owner._cfg.secret, self.challenge, self.epoch, self.sender, owner.address.name)
        with owner._lock:
            if owner._closed:
                return False
            old = owner._pairs.get(self.sender)
            late = old is not None and old.epoch > self.epoch
            if not late:
                owner._pairs[self.sender] = self
        if late:   # the sender gave up on this one and already paired again: the newer pair stays
            owner._refuse(store, self.slot, f"refused: {self.sender} has a newer pair (epoch {old.epoch})",
                          proof_read=True)
            return False
        if old is not None:   # a sender only joins again after dropping its side
            old.drop(f"failed: {self.sender} started a new pair")
        store.set(verdict_key(self.slot), admitted_verdict(owner._cfg.secret, self.challenge, self.epoch,
                                                           self.sender, owner.address.name))
        for key in (challenge_key(self.slot), proof_key(self.slot)):
            store.delete_key(key)
        return True

    def _run(self) -> None:
        cfg, lock = self.owner._cfg, self.owner._lock
        try:
            try:
                store = connect_store(self.owner.address, time.monotonic() + cfg.timeout_s,
                                      lambda: self.broken is not None)
            except BaseException:
                self.owner._verifying.release()   # _admit releases it once the proof is in (or not)
                raise
            if not self._admit(store):
                return
            msgs = dist.PrefixStore(pair_prefix(self.sender, self.epoch), store)
            group = make_group(dist.PrefixStore(group_prefix(self.key), msgs), 1, cfg.backend, cfg.device,
                               cfg.timeout_s, self.owner.address.host)   # where the store listens
        except Exception as exc:  # noqa: BLE001 - the sender died or never joined: nothing to fail yet
            self.drop(f"failed: pair with {self.sender} not set up: {describe(exc)}", wake=False)
            return
        with lock:
            self.group = group
            self.owner._activity[self.sender] = time.monotonic()
            dropped = self.broken is not None
        if dropped:   # while connecting: the loop below will not run
            abort_group(group, cfg.backend, peer_rank=0)
        msgs.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))   # idle pairs hear a heartbeat sooner
        said_stop = False
        while self.broken is None:
            try:
                sealed = msgs.get(hdr_key(self.seq)).decode("utf-8", errors="replace")   # until the sender writes it
            except Exception as exc:  # noqa: BLE001 - silence or a lost store both end the pair
                self.drop(f"failed: no word from {self.sender} for {cfg.timeout_s} s ({describe(exc)})", wake=False)
                break
            if self.broken is not None:
                break
            text = unseal(self.key, "hdr", self.seq, sealed)
            if text is None:
                log.warning("KV receiver %s: a header for the pair with %s does not carry its seal; dropping the "
                            "pair", self.owner.address.name, self.sender)
                self.drop(f"failed: a header without the pair's seal (written into {self.owner.address.name}'s "
                          f"store by someone other than {self.sender}?)", wake=False)
                break
            with lock:
                if self.broken is not None or text == "S":
                    said_stop = text == "S"
                    break
                seq, self.seq = self.seq, self.seq + 1
            try:
                if text != "B":
                    msgs.set(ack_key(seq), seal(self.key, "ack", seq, self._move(seq, text, group)))
                # off the critical path: the sender read ack/seq-1 before it wrote hdr/seq
                msgs.delete_key(hdr_key(seq))
                msgs.delete_key(ack_key(seq - 1))
            except Exception as exc:  # noqa: BLE001 - reported in the transfer's error
                with lock:
                    t = self.current
                late = t is not None and t.deadline is not None and time.monotonic() >= t.deadline
                self.drop(f"timed out after {cfg.timeout_s} s" if late
                          else f"failed: {describe(exc)} (is {self.sender} alive?)", wake=False)
        self.drop(f"failed: {self.sender} closed the pair", wake=False)   # no-op unless it said stop
        if not said_stop:
            self._tell_sender_closed(msgs)
        with lock:
            self.group = None

    def _tell_sender_closed(self, msgs: dist.PrefixStore) -> None:
        """Tells the sender that this side dropped the pair, so that it makes a new one for its next
        transfer instead of sending into this one (and its heartbeats pile up unread here)."""
        try:
            msgs.set(CLOSED_KEY, seal(self.key, "closed", 0, self.broken or "closed"))
        except Exception:  # noqa: BLE001 - the store is gone: the sender finds out on its next call
            log.debug("could not tell %s that the pair closed", self.sender, exc_info=True)

    def _move(self, seq: int, header: str, group: dist.Backend) -> str:
        """Receives one transfer; returns the verdict for the sender ("" = ok)."""
        _, nbytes, tid = header.split(" ", 2)
        nbytes = int(nbytes)
        t, target, verdict = self.owner._claim(self, tid, nbytes)
        if target is None:   # nobody wants these bytes, but they must leave the wire
            target = torch.empty(nbytes, dtype=torch.uint8, device=self.owner._cfg.device)
        if nbytes:
            deadline = t.deadline if t is not None else time.monotonic() + self.owner._cfg.timeout_s
            wait_work(group.recv([target], 0, seq & TAG_MASK), self.owner._cfg.backend, deadline)
        with self.owner._lock:
            self.current = None
            self.owner._activity[self.sender] = time.monotonic()
            if t is not None and not t.finish(TransferState.DONE):
                verdict = t.error or "failed"
        return verdict


class PairGroupReceiver(KVReceiver):
    """One per receiving process: hosts the rendezvous store at `address`
    (listening on `host` only; port 0: a free one) and accepts pairs from any
    sender that holds `secret`.

    Data that arrives without an expect() is discarded and kept as a FAILED
    transfer (poll and error answer for it; a later expect() of it fails) until
    forget(), or until MAX_ORPHANS newer ones push it out."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, name: str | None = None,
                 device: str | torch.device = "cpu", backend: str = "auto", timeout_s: float = 30.0,
                 secret: str = ""):
        device = torch.device(device)
        name = name or default_name("kvrecv")
        self._cfg = Settings(name, device, pick_backend(backend, device), float(timeout_s), secret)
        self._store: dist.TCPStore | None = host_store(host, port, timeout_s)
        self.address = PeerAddress(name, host, self._store.port)
        self._lock = threading.Lock()
        self._expected: dict[tuple[str, str], Transfer] = {}        # (sender, transfer id) ->
        self._orphans: OrderedDict[tuple[str, str], str] = OrderedDict()  # arrived unexpected -> error
        self._activity: dict[str, float] = {}                        # sender -> last data or join
        self._pairs: dict[str, _RecvPair] = {}
        self._closed = False
        self._accept_failure: str | None = None     # why the acceptor gave up (problem())
        self._slot = 0
        self._verifying = threading.BoundedSemaphore(_MAX_VERIFYING)
        self._acceptor = threading.Thread(target=self._accept, name=f"kv-accept-{name}", daemon=True)
        self._acceptor.start()

    def expect(self, transfer_id: str, sender_name: str, buffer: torch.Tensor) -> None:
        data = as_bytes(buffer, self._cfg.device)
        key = (sender_name, transfer_id)
        with self._lock:
            if self._closed:
                raise KVTransportError(f"KV receiver {self.address.name} is closed")
            if key in self._expected:
                raise KVTransportError(f"KV transfer {transfer_id} from {sender_name} is already expected; "
                                       "forget() it before reusing the id")
            t = self._expected[key] = Transfer(transfer_id, sender_name, self.address.name, data, data.numel())
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
        """A transfer on the wire is left to finish into its buffer (which the
        pair thread keeps until then: the caller may drop it), its bytes unread,
        and the sender hears that it was forgotten: the pair, and the transfers
        queued behind it, go on. (Breaking the pair instead would fail every
        transfer queued on it: a client that leaves during its hand-off would
        cost other requests theirs.)"""
        key = (sender_name, transfer_id)
        with self._lock:
            if self._orphans.pop(key, None) is not None:
                return
            t = self._expected.pop(key)
            t.finish(TransferState.FAILED, f"{t.label} was forgotten")
            self._forget_sender_if_done(sender_name)

    def _forget_sender_if_done(self, sender_name: str) -> None:
        """Under the lock: a sender with no pair and no transfer expected from it leaves no
        trace (senders come and go with prefill replicas, each rank under a new name)."""
        if sender_name not in self._pairs and not any(sender == sender_name for sender, _ in self._expected):
            self._activity.pop(sender_name, None)

    def problem(self) -> str | None:
        return self._accept_failure

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
            self._store.compare_set(join_key(slot), "", "S")   # wakes the acceptor
        except Exception:  # then the acceptor's wait fails when the store goes
            log.debug("could not wake the acceptor of %s", self.address.name, exc_info=True)
        join_threads([self._acceptor, *(p.thread for p in pairs)])
        self._store = None   # shuts the rendezvous server down; waits still pending on it fail

    # ---- called by the threads ----
    def _accept(self) -> None:
        """Waits on join slots 0, 1, ... and starts the receiving side of each pair."""
        try:
            store = connect_store(self.address, time.monotonic() + self._cfg.timeout_s, lambda: self._closed)
        except Exception as exc:  # noqa: BLE001 - closed before the thread ran, or the store cannot be reached
            if not self._closed:   # else every hand-off to this receiver waited out its timeout, health "ok"
                self._accept_failure = (f"KV receiver {self.address.name} cannot accept pairs: its store did not "
                                        f"answer ({describe(exc)})")
                log.error("%s", self._accept_failure)
            return
        failures = 0
        challenged: tuple[int, str] | None = None     # (slot, its challenge), posted
        while True:
            slot = self._slot
            if challenged is None or challenged[0] != slot:
                # one challenge per slot: after a store hiccup the slot is waited on again with the challenge
                # a sender may have read and answered already (a new one would refuse its right proof)
                challenged = (slot, secrets.token_hex(CHALLENGE_BYTES))
            challenge = challenged[1]
            key = join_key(slot)
            try:
                store.set(challenge_key(slot), challenge)
                store.wait([key], FOREVER)
                text = store.get(key).decode("utf-8", errors="replace")
            except Exception as exc:  # noqa: BLE001 - the store shut down (closed), or a hiccup
                failures += 1
                if self._closed or failures >= _MAX_STORE_FAILURES:
                    if not self._closed:
                        self._accept_failure = (f"KV receiver {self.address.name} stopped accepting pairs: its "
                                                f"store failed {failures} times in a row ({describe(exc)})")
                        log.error("%s", self._accept_failure)
                    return
                time.sleep(0.1)
                continue
            failures = 0
            with self._lock:
                if self._closed:
                    return
                self._slot += 1
            join = _JOIN.fullmatch(text)
            if join is None:
                log.warning("KV receiver %s ignored a malformed join %r", self.address.name, text[:100])
                self._refuse(store, slot, "refused: a malformed join")
                continue
            if not self._verifying.acquire(blocking=False):
                log.warning("KV receiver %s refused a join from %r: %d joins are being verified already",
                            self.address.name, join[2][:100], _MAX_VERIFYING)
                self._refuse(store, slot, "refused: too many joins being verified; try again")
                continue
            try:
                _RecvPair(self, join[2], int(join[1]), slot, challenge).thread.start()
            except RuntimeError as exc:   # no thread to be had
                self._verifying.release()
                log.warning("KV receiver %s could not take a pair from %r: %s", self.address.name, join[2], exc)
                self._refuse(store, slot, "refused: the receiver could not start a thread")

    @staticmethod
    def _refuse(store: dist.TCPStore, slot: int, verdict: str, *, proof_read: bool = False) -> None:
        """Answers a join that is refused; once its proof was read (the sender has
        read the challenge), drops the slot's keys too."""
        try:
            store.set(verdict_key(slot), verdict)
            for key in (challenge_key(slot), proof_key(slot)) if proof_read else ():
                store.delete_key(key)
        except Exception:  # noqa: BLE001 - best effort: the sender times out by itself
            log.debug("could not answer join slot %d", slot, exc_info=True)

    def _claim(self, pair: _RecvPair, tid: str, nbytes: int) -> tuple[Transfer | None, torch.Tensor | None, str]:
        """Matches a header to an expect(): (record, buffer to receive into, verdict)."""
        key = (pair.sender, tid)
        with self._lock:
            if pair.broken is not None:   # dropped since its thread looked: the transfer waits for a new pair
                return None, None, f"KV transfer {tid} from {pair.sender}: the pair {pair.broken}"
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
