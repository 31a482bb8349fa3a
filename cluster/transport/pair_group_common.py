"""What both sides of the pair-group KV transport share: its settings, the
protocol's constants and store key names, the per-transfer record, and the
helpers for stores, groups and threads. The sender (cluster/transport/pair_group_sender.py)
and the receiver (cluster/transport/pair_group_receiver.py) both follow the protocol
below and build every store key from the functions here, so that the two sides
agree. Nothing in this module starts a thread or holds state of its own.

The transport: one 2-rank torch.distributed process group per (sender, receiver)
pair: gloo for CPU buffers, NCCL for CUDA buffers, one code path.

Life cycle of a pair (S: a PairGroupSender, R: a PairGroupReceiver):

    R  hosts a TCPStore at R.address; its acceptor thread waits on join slot n
    R  acceptor posts a fresh random challenge for slot n, then waits on join slot n
    S  first send() to R ─▶ S's pair thread: connect to R's store,
           epoch = add("kvpair/S/epoch", 1), claim the next free join slot,
           post proof = HMAC-SHA256(secret, "kv-join-proof", challenge, epoch, S, R), wait for R's verdict
    R  acceptor sees the slot ─▶ R's pair thread: checks the proof, answers the verdict: admitted, with
           HMAC(secret, "kv-join-admitted", ...), which S checks; a wrong proof ends there (the sender's
           connect fails with "refused")
    S, R  rank 0 (S) and rank 1 (R) of a group on PrefixStore("kvpair/S/<epoch>/pg")
    S, R  one thread per pair side moves that pair's transfers in `send` order
    S, R  key = HMAC(secret, "kv-pair-key", challenge, epoch, S, R): every header and ack below
           is sealed with it (`seal`), and one that is not breaks the pair

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

Epochs: a pair that breaks (timeout, peer gone, close, a receiver's forget while
on the wire) is dropped for good; the sender's next send to that peer builds a new pair
with the next epoch, so nothing of a broken pair is ever reused. A receiver drops
its side when the same sender joins again, when the sender says stop, or when it
hears nothing (not even the idle heartbeat, "B", every timeout_s / 4) for timeout_s;
dropping it on its own, it sets "closed" (sealed) under the pair's prefix, which
the sender reads before its next heartbeat and drops its side too.

Timeouts (timeout_s): connecting a pair; each transfer from the moment its header
is posted to its ack; on the receiver, an expected transfer that sees no activity
from its sender. Deadlines are also checked in `poll`, so a FAILED arrives on time
even when a thread is stuck in a call that cannot be interrupted (it then exits
when that call returns). Every path that fails a transfer on the wire first aborts
its group, so the caller's buffer is never touched again; the one exception is a
sender's forget, whose send finishes reading the buffer the sender was given
(KVSender.send: the transport owns it).

Security: R's store listens on R's own address only (not on every interface),
and only a sender that holds the deployment's secret gets a pair: it proves it
with an HMAC over a challenge R made for that join, so a copied proof is worth
nothing. The store itself has no authentication: anyone who reaches it can
write keys. Headers and acks carry a MAC under a key only the pair's two sides
can derive, bound to the message's kind and sequence number, so a header or
ack written by anyone else (which could steer a sender's bytes into another
transfer's blocks, or free a sender's KV before it arrived) breaks the pair
instead of being obeyed; the secret keeps strangers from writing into, or
reading from, the KV caches through a pair's handshake. The process group's
own rendezvous keys, which gloo and NCCL read as they find them, are under a
name derived from the pair's key (`group_prefix`), but the store lists its keys
to any client: a stranger who reaches it can find them and race the two sides
to them while the pair is set up, and one that wins sits in the group (reads
the KV on gloo, or writes the receiver's on NCCL). The bytes on the wire are
neither encrypted nor authenticated. What else stays open to anyone who
reaches the store: deleting or overwriting keys, which fails transfers (they
time out and are retried). Hence: keep the workers' network private.

Caveats: close() does not wait for a thread blocked on a hung peer (it ends within
timeout_s by itself). CUDA buffers: NCCL orders a send after the work queued on the
default stream of its device; make buffers written on other streams ready first.
Each pair holds its own gloo context or NCCL communicator.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cluster.transport.kv_transport import KVTransportError, PeerAddress, TransferState
from engine.tcp_store import listening_store
from engine.tp_group import bound_gloo_group

log = logging.getLogger(__name__)

ABORT_TAG = 2**31 - 1          # a tag no data op uses: see abort_group
TAG_MASK = 2**30 - 1
JOIN_HINT = "kvpair/joins"     # count of claimed join slots (a hint: slots are claimed with compare_set)
JOIN_GRACE_S = 1.0             # how long close() waits for its threads before leaving them
CHALLENGE_BYTES = 16           # random bytes in a receiver's join challenge


def join_key(slot: int) -> str:
    """Join slot `slot` of a receiver's store: "<epoch> <sender>" once a sender claimed it."""
    return f"kvpair/join/{slot}"


def challenge_key(slot: int) -> str:
    """The receiver's random challenge for join slot `slot`, posted before anyone can claim it."""
    return f"kvpair/challenge/{slot}"


def proof_key(slot: int) -> str:
    """The joining sender's answer to the challenge of `slot`: see `prove`."""
    return f"kvpair/proof/{slot}"


def verdict_key(slot: int) -> str:
    """The receiver's verdict on the proof of `slot`: `admitted_verdict`, else why not."""
    return f"kvpair/verdict/{slot}"


def _mac(secret: str, purpose: str, *fields: object) -> bytes:
    """HMAC-SHA256 under `secret` of `purpose` and `fields`, each prefixed with its
    length: a MAC made for one purpose (or one split of the fields) is never the
    MAC of another, so a proof a sender writes for any challenge, however chosen,
    reveals no pair key and answers no other question."""
    message = b"".join(len(part).to_bytes(4, "big") + part
                       for part in (str(f).encode("utf-8", "surrogatepass") for f in (purpose, *fields)))
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def is_challenge(text: str) -> bool:
    """Whether `text` has the form of a receiver's challenge (CHALLENGE_BYTES random bytes, in hex)."""
    return len(text) == 2 * CHALLENGE_BYTES and all(c in "0123456789abcdef" for c in text)


def prove(secret: str, challenge: str, epoch: int, sender: str, receiver: str) -> str:
    """The proof that a sender joining as (`sender`, `epoch`) holds `secret`."""
    return _mac(secret, "kv-join-proof", challenge, epoch, sender, receiver).hex()


def proof_holds(proof: str, secret: str, challenge: str, epoch: int, sender: str, receiver: str) -> bool:
    return hmac.compare_digest(proof.encode(), prove(secret, challenge, epoch, sender, receiver).encode())


def admitted_verdict(secret: str, challenge: str, epoch: int, sender: str, receiver: str) -> str:
    """The receiver's verdict that admits a join: a MAC only a holder of the secret can
    write, so a sender never takes a verdict someone else put in the store for one."""
    return "admitted " + _mac(secret, "kv-join-admitted", challenge, epoch, sender, receiver).hex()


def pair_key(secret: str, challenge: str, epoch: int, sender: str, receiver: str) -> bytes:
    """The key that seals one pair's headers and acks: only the two sides know it
    (it needs the secret and the challenge of the pair's join)."""
    return _mac(secret, "kv-pair-key", challenge, epoch, sender, receiver)


def seal(key: bytes, kind: str, seq: int, text: str) -> str:
    """`text` as message `seq` of `kind` ("hdr", "ack" or "closed") of the pair keyed `key`,
    with a MAC that binds it to that place: "<text>|<mac>"."""
    mac = hmac.new(key, f"{kind}/{seq}/{text}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"{text}|{mac}"


def unseal(key: bytes, kind: str, seq: int, sealed: str) -> str | None:
    """The text `seal` sealed for this place, or None when the MAC does not hold
    (written by someone without the pair's key, or moved from another message)."""
    text, _, _ = sealed.rpartition("|")
    # as bytes: compare_digest refuses a str with non-ASCII characters (TypeError), and a store
    # anyone can reach may hold any bytes there
    expected = seal(key, kind, seq, text).encode("utf-8", "surrogatepass")
    return text if hmac.compare_digest(expected, sealed.encode("utf-8", "surrogatepass")) else None


def epoch_key(sender: str) -> str:
    """The counter of `sender`'s pairs with one receiver: each new pair takes the next epoch."""
    return f"kvpair/{sender}/epoch"


def group_prefix(key: bytes) -> str:
    """Under a pair's prefix: the keys of its process group's rendezvous, named from the
    pair's key so that only its two sides know where they are."""
    return "pg/" + hmac.new(key, b"group", hashlib.sha256).hexdigest()[:32]


def pair_prefix(sender: str, epoch: int) -> str:
    """The prefix of every key of one pair (the sender's name, its epoch)."""
    return f"kvpair/{sender}/{epoch}"


def hdr_key(seq: int) -> str:
    """The header of message `seq` of a pair (under its prefix): written by the sender."""
    return f"hdr/{seq}"


def ack_key(seq: int) -> str:
    """The receiver's verdict on message `seq` ("" = ok; under the pair's prefix)."""
    return f"ack/{seq}"


# under a pair's prefix: written by a receiver that dropped the pair on its side (no word from the
# sender in time, a transfer that failed there), read by the sender before each heartbeat
CLOSED_KEY = "closed"


def default_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl") or (backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"backend {backend!r} does not fit device {device}: use 'auto', gloo for cpu, nccl for cuda")
    return backend


def as_bytes(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The bytes of `buffer` (any dtype, contiguous) as a [nbytes] uint8 view of the same memory."""
    if not isinstance(buffer, torch.Tensor):
        raise KVTransportError(f"KV buffers must be torch tensors, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise KVTransportError(f"KV buffers must be contiguous (shape {tuple(buffer.shape)}, strides "
                               f"{buffer.stride()}): pack them with .contiguous() first")
    if buffer.device.type != device.type or (device.index is not None and buffer.device != device):
        raise KVTransportError(f"KV buffer on {buffer.device}, but this transport was made for {device}")
    return buffer.reshape(-1).view(torch.uint8)


def time_left(deadline: float) -> datetime.timedelta:
    """Time until `deadline`, rounded up to whole milliseconds plus one: gloo and
    the store truncate to milliseconds, and a wait that ends even slightly before
    the deadline would read as a failure instead of a timeout."""
    return datetime.timedelta(milliseconds=max(math.ceil((deadline - time.monotonic()) * 1000), 0) + 1)


def describe(exc: BaseException) -> str:
    """First line of an error, without torch's "[file.cpp:123] " prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text)[:300]


def connect_store(peer: PeerAddress, deadline: float, stopped: Callable[[], bool]) -> dist.TCPStore:
    """A client of `peer`'s store. Waits for the port with short tries in Python first:
    TCPStore's own retry loop cannot be left early (close) and overshoots its timeout."""
    while True:
        try:
            timeout = min(1.0, time_left(deadline).total_seconds())
            with socket.create_connection((peer.host, peer.port), timeout=timeout):
                break
        except OSError as exc:
            if stopped() or time.monotonic() + 0.05 >= deadline:
                raise ConnectionError(f"nothing answers at {peer.host}:{peer.port} ({exc})") from exc
            time.sleep(0.05)
    return dist.TCPStore(peer.host, peer.port, None, False, timeout=time_left(deadline), wait_for_workers=False)


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store server listening on `host` only (port 0: a free one)."""
    try:
        return listening_store(host, port, None, datetime.timedelta(seconds=timeout_s))
    except OSError as exc:
        raise KVTransportError(f"KV receiver cannot listen on {host}:{port}: {exc}") from exc


def make_group(store: dist.Store, rank: int, backend: str, device: torch.device,
               timeout_s: float, bind_host: str) -> dist.Backend:
    """Rank `rank` of a 2-rank group on `store`; blocks until both ranks joined (gloo).
    `bind_host`: the address gloo's sockets listen on, this node's address towards
    the peer (engine/tp_group.py's bound_gloo_group)."""
    if backend == "nccl":
        torch.cuda.set_device(device)
        # torch's default (3) ends the process on any error its watchdog sees on a pending op: a peer
        # that dies mid-transfer (across nodes NCCL reports it soon) would take this worker down with
        # it. 2 aborts the pair's communicator and keeps the process; the transfer fails, as it should.
        # Read by each group's constructor; a setting of the user's own is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        opts = dist.ProcessGroupNCCL.Options()
        # Our own deadline aborts a late op first: NCCL's watchdog, on timeout, may end the process.
        opts._timeout = datetime.timedelta(seconds=10 * timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)   # NCCL connects on the first op
    return bound_gloo_group(store, rank, 2, datetime.timedelta(seconds=timeout_s), bind_host)


def local_address_towards(peer: PeerAddress) -> str:
    """This node's address on the route to `peer` (127.0.0.1 for a peer on this
    machine's loopback): where this side of a pair listens."""
    family = socket.AF_INET6 if ":" in peer.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer.host, peer.port or 9))   # a datagram socket sends nothing on connect
        return probe.getsockname()[0]


def wait_work(work: dist.Work, backend: str, deadline: float) -> None:
    """Waits for one p2p op until `deadline` (monotonic); raises on error or timeout."""
    if backend == "gloo":
        work.wait(time_left(deadline))   # a timeout also closes the group's connections
        return
    while not work.is_completed():   # NCCL: wait() would only order streams
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL op did not complete")
        time.sleep(0.0005)
    work.wait()


def abort_group(group: dist.Backend | None, backend: str, peer_rank: int) -> None:
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
class Transfer:
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
class Settings:
    name: str
    device: torch.device
    backend: str
    timeout_s: float
    secret: str = field(default="", repr=False)   # the deployment's KV-transfer secret: both sides hold the same


def join_threads(threads: list[threading.Thread]) -> None:
    """Joins threads for at most JOIN_GRACE_S in all; one blocked in a call that
    cannot be interrupted is left to finish by itself (they are daemons)."""
    deadline = time.monotonic() + JOIN_GRACE_S
    for thread in threads:
        if thread.ident is not None and thread is not threading.current_thread():
            thread.join(max(deadline - time.monotonic(), 0.0))
