"""KV transport: real gloo pairs between spawned processes, and the fake backend.

Each child process ("agent") holds one PairGroupReceiver or PairGroupSender and
runs commands sent over a pipe. Every wait is bounded; every agent is stopped
(and killed if need be) when its test or module ends.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import socket
import time
import zlib
from collections.abc import Callable

import pytest
import torch

from cluster.transport.fake_transport import FakeTransportHub
from cluster.transport.kv_transport import KVTransportError, PeerAddress, TransferState
from cluster.transport.pair_group_receiver import PairGroupReceiver
from cluster.transport.pair_group_sender import PairGroupSender

SPAWN = multiprocessing.get_context("spawn")
SHORT_S = 2.0    # transport timeout in the tests that expect a timeout (success paths get 20 s or more)
# how much later than its timeout a FAILED may arrive: a hang guard (a loaded 2-core machine stalls for
# seconds), not a timing assertion; what timed out is read in the error
SLACK_S = 20.0
MiB = 1 << 20


def payload(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic random contents: [nbytes // itemsize] of `dtype`."""
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype)


def digest(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def wait_final(poll: Callable[..., TransferState], *args: str, limit_s: float = 20.0,
               waiting: tuple[TransferState, ...] = (TransferState.PENDING, TransferState.TRANSFERRING)
               ) -> TransferState:
    """Calls poll(*args) while it answers one of `waiting`, for at most `limit_s`;
    returns the last state."""
    deadline = time.monotonic() + limit_s
    while True:
        state = poll(*args)
        if state not in waiting or time.monotonic() > deadline:
            return state
        time.sleep(0.002)


# ---- the child side -------------------------------------------------------------------------
def _hang_after_header(pair, t, data) -> None:
    pair._header(f"T {t.nbytes} {t.tid}")
    time.sleep(3600)


def _die_after_header(pair, t, data) -> None:
    pair._header(f"T {t.nbytes} {t.tid}")
    os._exit(3)


def _agent_main(conn, role: str, timeout_s: float, sabotage: str | None, secret: str) -> None:
    """Child: one transport; answers (command, *args) with (ok, value) until "exit"."""
    import cluster.transport.pair_group_receiver as pgr
    import cluster.transport.pair_group_sender as pgs
    if sabotage:   # posts the header of a transfer, then never its data
        pgs._SendPair._move = {"hang": _hang_after_header, "die": _die_after_header}[sabotage]
    transport = pgr.PairGroupReceiver(timeout_s=timeout_s, secret=secret) if role == "receiver" \
        else pgs.PairGroupSender(timeout_s=timeout_s, secret=secret)
    buffers: dict[str, torch.Tensor] = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                transport.close()
                conn.send((True, None))
                return
            if cmd == "identity":                  # what peers need: an address, or a sender name
                value = transport.address if role == "receiver" else transport.name
            elif cmd == "expect":                  # tid, sender, nbytes, dtype
                tid, sender, nbytes, dtype = args
                buffers[tid] = torch.full((nbytes // torch.empty(0, dtype=dtype).element_size(),), 7, dtype=dtype)
                value = transport.expect(tid, sender, buffers[tid])
            elif cmd == "send":                    # tid, peer, nbytes, dtype, seed
                tid, peer, nbytes, dtype, seed = args
                value = transport.send(tid, peer, payload(nbytes, dtype, seed))
            elif cmd == "pairs":                   # each peer's pair: why it broke, or None while it is up
                value = {getattr(peer, "name", peer): pair.broken for peer, pair in transport._pairs.items()}
            elif cmd == "verifying":               # receiver: joins whose proof it still awaits
                value = pgr._MAX_VERIFYING - transport._verifying._value
            elif cmd == "result":                  # tid, sender (receiver only), limit_s
                tid, sender, limit_s = args
                key = (tid, sender) if role == "receiver" else (tid,)
                state = wait_final(transport.poll, *key, limit_s=limit_s)
                error = transport.error(*key)
                value = (state, error, digest(buffers[tid]) if tid in buffers else None)
            else:
                raise ValueError(cmd)
            conn.send((True, value))
        except Exception as exc:  # noqa: BLE001 - re-raised in the test process
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class Agent:
    """A child process holding one transport."""

    def __init__(self, role: str, timeout_s: float = 20.0, sabotage: str | None = None, secret: str = ""):
        """Starts the process and returns at once (the first call waits for it)."""
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_agent_main, args=(child, role, timeout_s, sabotage, secret), daemon=True)
        self.proc.start()
        child.close()
        self._identity: PeerAddress | str | None = None

    def call(self, *cmd, limit_s: float = 60.0):
        self.conn.send(cmd)
        if not self.conn.poll(limit_s):
            raise TimeoutError(f"agent did not answer {cmd[0]} within {limit_s} s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def identity(self) -> PeerAddress | str:
        """The receiver's PeerAddress, or the sender's name (asked once)."""
        if self._identity is None:
            self._identity = self.call("identity")
        return self._identity

    def result(self, tid: str, sender: str | None = None, limit_s: float = 20.0):
        return self.call("result", tid, sender, limit_s, limit_s=limit_s + 10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", limit_s=5)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def spawn_agent():
    made: list[Agent] = []

    def make(role: str, **kwargs) -> Agent:
        made.append(Agent(role, **kwargs))
        return made[-1]

    yield make
    for agent in made:
        agent.stop()


@pytest.fixture(scope="module")
def remote_receiver():
    """One receiving process shared by the tests of this module (ids never repeat)."""
    agent = Agent("receiver")
    yield agent
    agent.stop()


@pytest.fixture
def sender():
    s = PairGroupSender(timeout_s=20.0)
    yield s
    s.close()


def roundtrip(sender: PairGroupSender, agent: Agent, address: PeerAddress, tid: str, nbytes: int,
              dtype: torch.dtype = torch.float32) -> None:
    """expect on the agent, send from here, both sides DONE with equal bytes."""
    agent.call("expect", tid, sender.name, nbytes, dtype)
    data = payload(nbytes, dtype, seed=zlib.crc32(tid.encode()))
    sender.send(tid, address, data)
    assert wait_final(sender.poll, tid) is TransferState.DONE, sender.error(tid)
    state, error, received = agent.result(tid, sender.name)
    assert (state, error, received) == (TransferState.DONE, None, digest(data))


# ---- real pairs -----------------------------------------------------------------------------
def test_a_pair_that_connects_late_still_gets_the_whole_timeout_for_its_ops(remote_receiver, monkeypatch):
    # the group's timeout bounds every op of the pair's life: made from what the connect left, a pair
    # that took 29 of 30 s to connect failed every send after 1 s (NCCL's watchdog: after 10 ms x 10)
    import cluster.transport.pair_group_sender as sender_module
    connect, make_group, made = sender_module.connect_store, sender_module.make_group, []

    def slow_connect(*args, **kwargs):
        time.sleep(1.0)
        return connect(*args, **kwargs)

    def recording_make_group(store, rank, backend, device, timeout_s, bind_host):
        made.append(timeout_s)
        return make_group(store, rank, backend, device, timeout_s, bind_host)
    monkeypatch.setattr(sender_module, "connect_store", slow_connect)
    monkeypatch.setattr(sender_module, "make_group", recording_make_group)
    late = PairGroupSender(timeout_s=20.0)
    try:
        roundtrip(late, remote_receiver, remote_receiver.identity(), "late/1", 1000)
    finally:
        late.close()
    assert made == [20.0]


def test_bytes_arrive_equal_for_every_dtype_and_size_in_any_order(sender, remote_receiver):
    # (nbytes, dtype): odd byte counts (26, 14), empty, and a few MiB
    specs = {"f32": (4000, torch.float32), "f16-odd": (26, torch.float16), "bf16-odd": (14, torch.bfloat16),
             "empty": (0, torch.float32), "bf16-big": (4 * MiB + 6, torch.bfloat16), "i64": (800, torch.int64)}
    for tid, (nbytes, dtype) in specs.items():
        remote_receiver.call("expect", f"a/{tid}", sender.name, nbytes, dtype)
    sent = {}
    for tid in ["bf16-big", "empty", "i64", "f16-odd", "f32", "bf16-odd"]:   # not the order expected
        nbytes, dtype = specs[tid]
        sent[tid] = payload(nbytes, dtype, seed=len(sent))
        sender.send(f"a/{tid}", remote_receiver.identity(), sent[tid])
    for tid, data in sent.items():
        assert wait_final(sender.poll, f"a/{tid}") is TransferState.DONE, sender.error(f"a/{tid}")
        assert remote_receiver.result(f"a/{tid}", sender.name) == (TransferState.DONE, None, digest(data))
    for i in range(3):   # the same pair keeps working
        roundtrip(sender, remote_receiver, remote_receiver.identity(), f"a/again-{i}", 1000 + i * 4)


def test_one_sender_feeds_two_receivers_at_once(sender, remote_receiver, spawn_agent):
    other = spawn_agent("receiver")
    targets = [(remote_receiver, remote_receiver.identity()), (other, other.identity())]
    data = [payload(8 * MiB, torch.float16, seed=i) for i in range(2)]
    for i, (agent, _) in enumerate(targets):
        agent.call("expect", f"b/to-{i}", sender.name, 8 * MiB, torch.float16)
    for i, (_, address) in enumerate(targets):   # both queued before either is polled
        sender.send(f"b/to-{i}", address, data[i])
    for i, (agent, _) in enumerate(targets):
        assert wait_final(sender.poll, f"b/to-{i}") is TransferState.DONE, sender.error(f"b/to-{i}")
        assert agent.result(f"b/to-{i}", sender.name) == (TransferState.DONE, None, digest(data[i]))


def test_receivers_come_and_go_while_transfers_to_a_third_continue(remote_receiver, spawn_agent):
    sender = PairGroupSender(timeout_s=20.0)      # (the transfers that must fail fail at their peer's death)
    hasty = PairGroupSender(timeout_s=SHORT_S)    # connects to the dead peer: gives up at its connect timeout
    try:
        doomed = spawn_agent("receiver")
        doomed_address = doomed.identity()
        roundtrip(sender, doomed, doomed_address, "c/warm", 4096)
        roundtrip(sender, remote_receiver, remote_receiver.identity(), "c/steady-0", 64 * 1024)
        newcomer = spawn_agent("receiver")         # starting while transfers go on
        doomed.call("expect", "c/lost", sender.name, 16 * MiB, torch.float32)
        os.kill(doomed.proc.pid, signal.SIGSTOP)   # stops answering before the data: nothing can finish
        sender.send("c/lost", doomed_address, payload(16 * MiB, torch.float32, seed=1))
        doomed.proc.kill()                         # ... and then dies
        for i in range(1, 6):
            roundtrip(sender, remote_receiver, remote_receiver.identity(), f"c/steady-{i}", 64 * 1024)
        assert wait_final(sender.poll, "c/lost", limit_s=SLACK_S) is TransferState.FAILED
        assert doomed_address.name in sender.error("c/lost")
        assert "timed out" not in sender.error("c/lost")      # failed at the peer's death, not at a timeout
        roundtrip(sender, newcomer, newcomer.identity(), "c/hello", 1 * MiB)
        roundtrip(sender, remote_receiver, remote_receiver.identity(), "c/steady-last", 64 * 1024)
        hasty.send("c/to-the-dead", doomed_address, torch.ones(4))    # a new pair to a dead peer: fails fast
        assert wait_final(hasty.poll, "c/to-the-dead", limit_s=SHORT_S + SLACK_S) is TransferState.FAILED
        assert "could not connect" in hasty.error("c/to-the-dead")
    finally:
        sender.close()
        hasty.close()


def test_pair_is_rebuilt_after_a_timeout_and_kept_after_a_forget_on_the_wire(spawn_agent):
    sender = PairGroupSender(timeout_s=SHORT_S)
    try:
        sleepy = spawn_agent("receiver")
        address = sleepy.identity()
        roundtrip(sender, sleepy, address, "d/warm", 4096)
        for tid in ("d/stalled", "d/queued"):
            sleepy.call("expect", tid, sender.name, 4 * MiB, torch.float32)
        os.kill(sleepy.proc.pid, signal.SIGSTOP)
        for tid in ("d/stalled", "d/queued"):
            sender.send(tid, address, payload(4 * MiB, torch.float32, seed=2))
        limit = SHORT_S + SLACK_S
        assert wait_final(sender.poll, "d/stalled", limit_s=limit) is TransferState.FAILED
        assert f"from {sender.name} to {address.name} timed out after 2.0 s" in sender.error("d/stalled")
        assert wait_final(sender.poll, "d/queued", limit_s=limit) is TransferState.FAILED
        assert "broke on an earlier transfer" in sender.error("d/queued")
        os.kill(sleepy.proc.pid, signal.SIGCONT)
        state, error, _ = sleepy.result("d/stalled", sender.name)   # the receiver saw its side break
        assert state is TransferState.FAILED, error
        roundtrip(sender, sleepy, address, "d/after-timeout", 1 * MiB)   # a new pair (next epoch)

        # forgotten on the wire (the decode side moved on): its send finishes, the one queued behind
        # it on the same pair is not failed with it
        sleepy.call("expect", "d/forgotten", sender.name, 4 * MiB, torch.float32)
        sleepy.call("expect", "d/behind", sender.name, 1 * MiB, torch.float32)
        os.kill(sleepy.proc.pid, signal.SIGSTOP)
        sender.send("d/forgotten", address, payload(4 * MiB, torch.float32, seed=3))
        behind = payload(1 * MiB, torch.float32, seed=4)
        sender.send("d/behind", address, behind)
        assert wait_final(sender.poll, "d/forgotten", waiting=(TransferState.PENDING,)) \
            is TransferState.TRANSFERRING
        pair = sender._pairs[address]
        # (a forget that waited for the stalled send would see the pair time out: "d/behind" would fail with
        # it and the pair be replaced, below)
        sender.forget("d/forgotten")
        with pytest.raises(KeyError):
            sender.poll("d/forgotten")
        os.kill(sleepy.proc.pid, signal.SIGCONT)
        assert wait_final(sender.poll, "d/behind") is TransferState.DONE, sender.error("d/behind")
        assert sleepy.result("d/behind", sender.name) == (TransferState.DONE, None, digest(behind))
        assert sender._pairs[address] is pair
        roundtrip(sender, sleepy, address, "d/after-forget", 1 * MiB)
    finally:
        sender.close()


def test_a_receive_forgotten_on_the_wire_leaves_the_pair_up(spawn_agent):
    """The decode side gives up on a transfer whose bytes are flowing (its client
    left): the bytes still arrive, unread, the sender hears it was forgotten,
    and the next transfer goes over the same pair."""
    receiver = PairGroupReceiver(timeout_s=20.0)
    try:
        agent = spawn_agent("sender")
        name = agent.identity()
        receiver.expect("f/warm", name, torch.empty(1024))
        agent.call("send", "f/warm", receiver.address, 4096, torch.float32, 1)
        assert wait_final(receiver.poll, "f/warm", name) is TransferState.DONE, receiver.error("f/warm", name)
        pair = receiver._pairs[name]
        receiver.expect("f/big", name, torch.empty(32 * MiB))            # 128 MiB: ~0.1 s on the wire
        agent.call("send", "f/big", receiver.address, 128 * MiB, torch.float32, 2)
        assert wait_final(receiver.poll, "f/big", name, waiting=(TransferState.PENDING,)) \
            is TransferState.TRANSFERRING
        receiver.forget("f/big", name)
        state, error, _ = agent.result("f/big")
        assert state is TransferState.FAILED and "was forgotten" in error
        after = torch.empty(1024)
        receiver.expect("f/after", name, after)
        agent.call("send", "f/after", receiver.address, 4096, torch.float32, 3)
        assert wait_final(receiver.poll, "f/after", name) is TransferState.DONE, receiver.error("f/after", name)
        assert receiver._pairs[name] is pair and pair.broken is None
        assert digest(after) == digest(payload(4096, torch.float32, 3))
    finally:
        receiver.close()


def test_a_pair_the_receiver_dropped_is_rebuilt_by_the_sender_before_its_next_send(spawn_agent):
    """An idle sender paused past the timeout (GC, swap, a stopped VM): the receiver drops the pair.
    Resumed, the sender finds that out at its next heartbeat and sends the next transfer over a
    new pair (before, the transfer went into the dropped pair and failed)."""
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        agent = spawn_agent("sender", timeout_s=SHORT_S)
        name = agent.identity()
        receiver.expect("p/warm", name, torch.empty(1024))
        agent.call("send", "p/warm", receiver.address, 4096, torch.float32, 1)
        assert wait_final(receiver.poll, "p/warm", name) is TransferState.DONE, receiver.error("p/warm", name)
        first = receiver._pairs[name]
        os.kill(agent.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + SHORT_S + SLACK_S
        while first.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.broken is not None and "no word from" in first.broken
        os.kill(agent.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + SLACK_S
        # the sender's next heartbeat reads the receiver's "closed" and drops its side too
        while agent.call("pairs").get(receiver.address.name) is None:
            assert time.monotonic() < deadline, "the sender never noticed the dropped pair"
            time.sleep(0.05)
        after = torch.empty(1024)
        receiver.expect("p/after", name, after)
        agent.call("send", "p/after", receiver.address, 4096, torch.float32, 2)
        assert wait_final(receiver.poll, "p/after", name) is TransferState.DONE, receiver.error("p/after", name)
        state, error, _ = agent.result("p/after")
        assert state is TransferState.DONE, error
        assert receiver._pairs[name] is not first
        assert digest(after) == digest(payload(4096, torch.float32, 2))
    finally:
        receiver.close()


def test_a_transfer_after_silence_finds_a_pair_the_receiver_dropped_before_sending(monkeypatch):
    """A sender silent past the timeout (no heartbeat: paused) whose next transfer comes before
    any heartbeat: it reads the receiver's "closed" first and fails at once, saying so, rather
    than going into the dropped pair (over NCCL, a wait until its deadline); the send after it
    makes a new pair."""
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    sender = PairGroupSender(timeout_s=SHORT_S)
    try:
        warm = torch.empty(1024)
        receiver.expect("q/warm", sender.name, warm)
        sender.send("q/warm", receiver.address, payload(4096, torch.float32, 1))
        assert wait_final(sender.poll, "q/warm") is TransferState.DONE, sender.error("q/warm")
        monkeypatch.setattr(sender._pairs[receiver.address], "_heartbeat", lambda: None)   # goes silent
        first = receiver._pairs[sender.name]
        deadline = time.monotonic() + SHORT_S + SLACK_S
        while first.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.broken is not None
        time.sleep(0.5)                     # the receiver's "closed" is written as its pair thread ends
        sender.send("q/late", receiver.address, payload(4096, torch.float32, 2))
        assert wait_final(sender.poll, "q/late", limit_s=SHORT_S + SLACK_S) is TransferState.FAILED
        assert "closed the pair on its side" in sender.error("q/late")
        after = torch.empty(1024)
        receiver.expect("q/after", sender.name, after)
        sender.send("q/after", receiver.address, payload(4096, torch.float32, 3))
        assert wait_final(sender.poll, "q/after") is TransferState.DONE, sender.error("q/after")
        assert digest(after) == digest(payload(4096, torch.float32, 3))
    finally:
        sender.close()
        receiver.close()


def test_unknown_id_or_wrong_size_fails_on_both_sides(sender, remote_receiver):
    sender.send("e/nobody", remote_receiver.identity(), torch.ones(10))
    assert wait_final(sender.poll, "e/nobody") is TransferState.FAILED
    state, error, _ = remote_receiver.result("e/nobody", sender.name)
    assert state is TransferState.FAILED and "e/nobody" in error and "was not expected" in error
    assert sender.error("e/nobody") == error       # the receiver's verdict reaches the sender

    remote_receiver.call("expect", "e/size", sender.name, 40, torch.float32)
    sender.send("e/size", remote_receiver.identity(), torch.ones(12))
    assert wait_final(sender.poll, "e/size") is TransferState.FAILED
    state, error, _ = remote_receiver.result("e/size", sender.name)
    assert state is TransferState.FAILED and "sent 48 bytes" in error and "holds 40" in error
    roundtrip(sender, remote_receiver, remote_receiver.identity(), "e/fine", 4000)   # the pair survived


def test_sender_gives_up_when_no_receiver_listens():
    with socket.socket() as sock:   # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sender = PairGroupSender(timeout_s=SHORT_S)
    try:
        sender.send("f/void", PeerAddress("ghost", "127.0.0.1", port), torch.ones(4))
        assert sender.poll("f/void") is TransferState.PENDING
        assert wait_final(sender.poll, "f/void", limit_s=SHORT_S + SLACK_S) is TransferState.FAILED
        error = sender.error("f/void")
        assert "could not connect to ghost" in error and f"within {SHORT_S} s" in error
    finally:
        sender.close()


def test_receiver_gives_up_on_a_sender_that_never_comes():
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        receiver.expect("g/never", "ghost", torch.empty(8))
        assert receiver.poll("g/never", "ghost") is TransferState.PENDING
        assert wait_final(receiver.poll, "g/never", "ghost", limit_s=SHORT_S + SLACK_S) is TransferState.FAILED
        error = receiver.error("g/never", "ghost")
        assert "KV transfer g/never from ghost" in error and "timed out after 2.0 s" in error
    finally:
        receiver.close()


@pytest.mark.parametrize("sabotage", ["hang", "die"])
def test_receiver_fails_when_the_sender_stops_midway(spawn_agent, sabotage):
    """The sender posts a header, then hangs or dies instead of sending the data."""
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        agent = spawn_agent("sender", timeout_s=SHORT_S, sabotage=sabotage)
        name = agent.identity()
        receiver.expect("h/midway", name, torch.empty(1 * MiB, dtype=torch.uint8))
        agent.call("send", "h/midway", receiver.address, 1 * MiB, torch.uint8, 0)
        started = wait_final(receiver.poll, "h/midway", name, limit_s=30, waiting=(TransferState.PENDING,))
        assert started is TransferState.TRANSFERRING
        assert wait_final(receiver.poll, "h/midway", name, limit_s=SHORT_S + SLACK_S) is TransferState.FAILED
        error = receiver.error("h/midway", name)
        assert f"KV transfer h/midway from {name} to {receiver.address.name}" in error
        assert ("timed out after 2.0 s" in error) if sabotage == "hang" else (f"is {name} alive?" in error)
        # a sender gone (prefill replicas come and go, each rank under a new name) leaves no trace once its
        # pair is broken and its transfers are forgotten
        receiver.forget("h/midway", name)
        deadline = time.monotonic() + SLACK_S
        while name in receiver._pairs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert name not in receiver._pairs and name not in receiver._activity
    finally:
        receiver.close()


def test_close_fails_transfers_on_the_wire_without_hanging(spawn_agent):
    receiver = PairGroupReceiver(timeout_s=60.0)
    agent = spawn_agent("sender", timeout_s=60.0, sabotage="hang")
    name = agent.identity()
    receiver.expect("i/open", name, torch.empty(1024))
    receiver.expect("i/queued", name, torch.empty(1024))
    agent.call("send", "i/open", receiver.address, 4096, torch.float32, 0)
    started = wait_final(receiver.poll, "i/open", name, limit_s=30, waiting=(TransferState.PENDING,))
    assert started is TransferState.TRANSFERRING
    start = time.monotonic()
    receiver.close()
    assert time.monotonic() - start < 20      # a hang guard: it did not wait out the hung transfer's 60 s
    for tid in ("i/open", "i/queued"):
        assert receiver.poll(tid, name) is TransferState.FAILED
        assert "closed" in receiver.error(tid, name)
    with pytest.raises(KVTransportError):
        receiver.expect("i/late", name, torch.empty(4))


def test_only_a_sender_holding_the_secret_gets_a_pair(spawn_agent):
    """A wrong secret is refused with a clear error, moves no byte, and an
    impostor using a real sender's name does not break that sender's pair."""
    agent = spawn_agent("receiver", timeout_s=SHORT_S, secret="deployment-secret")
    address = agent.identity()
    # SHORT_S on every side: the honest sender's heartbeat (every timeout_s / 4) keeps its pair alive
    honest = PairGroupSender(timeout_s=SHORT_S, secret="deployment-secret")
    impostors = [PairGroupSender(timeout_s=SHORT_S, secret="guess"),
                 PairGroupSender(name=honest.name, timeout_s=SHORT_S)]
    try:
        roundtrip(honest, agent, address, "s/before", 4096)
        for i, impostor in enumerate(impostors):
            agent.call("expect", f"s/forged{i}", impostor.name, 4096, torch.uint8)
            impostor.send(f"s/forged{i}", address, payload(4096, torch.uint8, seed=i))
            assert wait_final(impostor.poll, f"s/forged{i}") is TransferState.FAILED
            assert "refused: the secret does not match" in impostor.error(f"s/forged{i}")
            assert "within" not in impostor.error(f"s/forged{i}")     # an answer, not a timeout
            state, error, received = agent.result(f"s/forged{i}", impostor.name, limit_s=SHORT_S + SLACK_S)
            assert state is TransferState.FAILED and "no data" in error
            assert received == digest(torch.full((4096,), 7, dtype=torch.uint8))   # untouched
        roundtrip(honest, agent, address, "s/after", 4096)   # the honest pair survived the impostors
    finally:
        for s in [honest, *impostors]:
            s.close()


def test_malformed_joins_and_a_flood_of_unproven_ones_leave_the_receiver_accepting(spawn_agent):
    """Anyone who reaches the store can write a join: garbage, or many joins that
    never prove the secret. Each is refused or times out; honest senders still pair."""
    import datetime

    import torch.distributed as dist

    from cluster.transport.pair_group_common import JOIN_HINT, join_key, verdict_key
    from cluster.transport.pair_group_receiver import _MAX_VERIFYING
    agent = spawn_agent("receiver", timeout_s=SHORT_S, secret="deployment-secret")
    address = agent.identity()
    stranger = dist.TCPStore(address.host, address.port, None, False, timeout=datetime.timedelta(seconds=10),
                             wait_for_workers=False)
    bad = [b"\xff\xfe", "\u00b2 someone".encode(), b"no-epoch", b"12"]
    slots = range(len(bad) + _MAX_VERIFYING + 4)
    for slot in slots:     # the malformed ones, then more unproven joins than are verified at once
        text = bad[slot] if slot < len(bad) else f"1 stranger-{slot}".encode()
        assert stranger.compare_set(join_key(slot), "", text) == text
        stranger.add(JOIN_HINT, 1)
    for slot in range(len(bad)):
        assert stranger.get(verdict_key(slot)).decode() == "refused: a malformed join"
    busy = [stranger.get(verdict_key(slot)).decode() for slot in slots[-4:]]
    assert busy == ["refused: too many joins being verified; try again"] * 4
    deadline = time.monotonic() + SHORT_S + SLACK_S
    # every unproven join timed out and freed its place (with some still pending, the honest pair's own
    # connect to the receiver's store was seen to time out)
    while agent.call("verifying"):
        assert time.monotonic() < deadline, "unproven joins still hold their places"
        time.sleep(0.05)
    honest = PairGroupSender(timeout_s=20.0, secret="deployment-secret")
    try:
        roundtrip(honest, agent, address, "m/after", 4096)
    finally:
        honest.close()


def test_a_late_join_of_an_older_epoch_does_not_displace_the_senders_newer_pair(spawn_agent):
    """A sender whose join of epoch 1 timed out joins again as epoch 2 and is admitted;
    then epoch 1's proof arrives: it is refused, and the newer pair stays."""
    import datetime

    import torch.distributed as dist

    from cluster.transport.pair_group_common import (
        JOIN_HINT,
        admitted_verdict,
        challenge_key,
        join_key,
        proof_key,
        prove,
        verdict_key,
    )
    agent = spawn_agent("receiver", timeout_s=SHORT_S, secret="deployment-secret")
    address = agent.identity()
    store = dist.TCPStore(address.host, address.port, None, False, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)

    def join(slot: int, epoch: int, answer: bool = True) -> str:
        text = f"{epoch} slow-sender"
        assert store.compare_set(join_key(slot), "", text).decode() == text
        store.add(JOIN_HINT, 1)
        challenge = store.get(challenge_key(slot)).decode()
        if answer:
            store.set(proof_key(slot), prove("deployment-secret", challenge, epoch, "slow-sender", address.name))
        return challenge

    join(0, 1, answer=False)                 # epoch 1 claims its slot; its proof is late
    second = join(1, 2)
    assert store.get(verdict_key(1)).decode() == \
        admitted_verdict("deployment-secret", second, 2, "slow-sender", address.name)   # epoch 2 admitted
    challenge = store.get(challenge_key(0)).decode()
    store.set(proof_key(0), prove("deployment-secret", challenge, 1, "slow-sender", address.name))
    assert store.get(verdict_key(0)).decode() == "refused: slow-sender has a newer pair (epoch 2)"


def test_no_mac_a_sender_writes_is_another_purposes_mac():
    """Proofs, verdicts and pair keys are MACs of one secret: with the purposes and
    fields told apart, a proof a sender writes for a challenge someone chose (a
    store anyone can write) is never the key of a pair nor a verdict."""
    from cluster.transport.pair_group_common import admitted_verdict, pair_key, prove
    secret, challenge = "deployment-secret", "0123456789abcdef0123456789abcdef"
    key = pair_key(secret, challenge, 3, "s", "r")
    assert prove(secret, "pair|" + challenge, 3, "s", "r") != key.hex()    # (was equal: the key leaked)
    assert prove(secret, challenge, 3, "s", "r") not in (key.hex(), admitted_verdict(secret, challenge, 3, "s", "r"))
    assert prove(secret, challenge, 3, "s|x", "r") != prove(secret, challenge, 3, "s", "x|r")   # fields apart


@pytest.mark.parametrize("challenge, verdict, says", [
    ("pair|0123456789abcdef0123456789abcdef", None, "holds no valid challenge"),
    ("0123456789abcdef0123456789abcdef", "", "refused: its verdict is not the receiver's"),
    ("0123456789abcdef0123456789abcdef", "admitted 00", "refused: its verdict is not the receiver's"),
])
def test_a_sender_takes_no_challenge_or_verdict_but_the_receivers(challenge, verdict, says):
    """A store that is not a real receiver's (or one a stranger wrote into): the sender
    proves nothing for a challenge a receiver would not make, and pairs on no verdict
    but one made with the secret, so no one without it can have a pair with it."""
    import datetime
    import threading

    from cluster.transport.kv_transport import PeerAddress
    from cluster.transport.pair_group_common import challenge_key, proof_key, verdict_key
    from engine.tcp_store import listening_store
    store = listening_store("127.0.0.1", 0, None, datetime.timedelta(seconds=10))
    address = PeerAddress("not-a-receiver", "127.0.0.1", store.port)
    proofs = []

    def forge() -> None:
        store.set(challenge_key(0), challenge)
        if verdict is not None:
            proofs.append(store.get(proof_key(0)).decode())
            store.set(verdict_key(0), verdict)
    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    sender = PairGroupSender(timeout_s=SHORT_S, secret="deployment-secret")
    try:
        sender.send("f/1", address, payload(64, torch.uint8, seed=1))
        assert wait_final(sender.poll, "f/1") is TransferState.FAILED
        assert says in sender.error("f/1")
        assert len(proofs) == (verdict is not None)
        assert store.check([proof_key(0)]) == (verdict is not None)   # a proof only for a well-formed challenge
    finally:
        sender.close()
        forger.join(timeout=5)


def test_a_receiver_whose_store_keeps_failing_says_so(monkeypatch):
    """Its acceptor gives up after _MAX_STORE_FAILURES failures in a row: the receiver
    then reports why, which fails its decode replica's health check (before: it stayed
    healthy and every hand-off to it timed out)."""
    from cluster.transport import pair_group_receiver

    def broken(slot: int) -> str:
        raise RuntimeError("store down")
    monkeypatch.setattr(pair_group_receiver, "challenge_key", broken)
    monkeypatch.setattr(pair_group_receiver, "_MAX_STORE_FAILURES", 2)
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        deadline = time.monotonic() + 5
        while receiver.problem() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stopped accepting pairs: its store failed 2 times in a row (store down" in receiver.problem()
    finally:
        receiver.close()
    assert FakeTransportHub().receiver("d").problem() is None      # the interface's default


def test_a_store_hiccup_keeps_the_challenge_a_sender_may_have_answered(monkeypatch):
    # a new challenge for the same slot after one failed wait refused the sender that had read and
    # answered the first: "the secret does not match", pointing at a configuration that is right
    from cluster.transport import pair_group_receiver
    connect, posted, hiccups = pair_group_receiver.connect_store, [], []

    class HiccupOnce:
        def __init__(self, store):
            self._store = store

        def set(self, key, value):
            posted.append((key, value))
            return self._store.set(key, value)

        def wait(self, keys, timeout):
            if not hiccups:
                hiccups.append(keys)
                raise RuntimeError("store hiccup")
            return self._store.wait(keys, timeout)

        def __getattr__(self, name):
            return getattr(self._store, name)

    monkeypatch.setattr(pair_group_receiver, "connect_store", lambda *a, **k: HiccupOnce(connect(*a, **k)))
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        deadline = time.monotonic() + 5
        while len(posted) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        receiver.close()
    challenges = [value for key, value in posted if key == pair_group_receiver.challenge_key(0)]
    assert hiccups and len(challenges) >= 2 and len(set(challenges)) == 1


def test_a_header_read_as_its_pair_is_dropped_leaves_the_transfer_for_the_next_pair():
    # claimed on a pair dropped since its thread looked, a transfer was left TRANSFERRING (the drop had
    # failed the pair's transfer on the wire before this one was on it) until its whole timeout ran out
    from types import SimpleNamespace
    receiver = PairGroupReceiver(timeout_s=SHORT_S)
    try:
        buffer = torch.zeros(16, dtype=torch.uint8)
        receiver.expect("t", "s", buffer)
        dropped = SimpleNamespace(sender="s", broken="failed: timed out", current=None)
        transfer, target, verdict = receiver._claim(dropped, "t", 16)
        assert (transfer, target) == (None, None) and "the pair failed: timed out" in verdict
        assert receiver.poll("t", "s") is TransferState.PENDING and dropped.current is None
    finally:
        receiver.close()


def test_a_pairs_process_group_meets_under_a_name_only_its_two_sides_can_derive():
    from cluster.transport.pair_group_common import group_prefix, pair_key
    key = pair_key("deployment-secret", "challenge", 3, "prefill-0", "decode-0")
    prefix = group_prefix(key)
    assert prefix.startswith("pg/") and len(prefix) == 35
    others = {group_prefix(pair_key(secret, "challenge", epoch, "prefill-0", "decode-0"))
              for secret, epoch in (("another-secret", 3), ("deployment-secret", 4))}
    assert prefix not in others and len(others) == 2     # another secret or pair: another name


def test_a_seal_holds_only_for_its_pair_kind_and_place():
    from cluster.transport.pair_group_common import pair_key, seal, unseal
    key = pair_key("secret", "challenge", 3, "S", "R")
    sealed = seal(key, "hdr", 7, "T 4096 cmpl-1|x#1")
    assert unseal(key, "hdr", 7, sealed) == "T 4096 cmpl-1|x#1"
    assert unseal(key, "hdr", 8, sealed) is None                      # another message's place
    assert unseal(key, "ack", 7, sealed) is None                      # an ack is not a header
    assert unseal(pair_key("secret", "challenge", 4, "S", "R"), "hdr", 7, sealed) is None   # another pair
    assert unseal(pair_key("guess", "challenge", 3, "S", "R"), "hdr", 7, sealed) is None
    assert unseal(key, "hdr", 7, sealed.replace("4096", "4097")) is None
    assert unseal(key, "hdr", 7, "T 4096 cmpl-1") is None and unseal(key, "ack", 0, "") is None


def test_a_header_written_by_a_stranger_breaks_the_pair_and_moves_no_byte():
    """Anyone who reaches the receiver's store can write the next header of an
    admitted pair: obeyed, it would steer the sender's next bytes into whichever
    transfer it names. It does not carry the pair's seal, so the receiver drops
    the pair at once instead."""
    import datetime

    import torch.distributed as dist

    from cluster.transport.pair_group_common import hdr_key, pair_prefix
    receiver = PairGroupReceiver(host="127.0.0.1", timeout_s=30, secret="deployment-secret")
    sender = PairGroupSender(timeout_s=30, secret="deployment-secret")
    address = receiver.address
    try:
        victim = torch.full((4096,), 7, dtype=torch.uint8)
        receiver.expect("x/victim", sender.name, victim)
        first = torch.zeros(64, dtype=torch.uint8)
        receiver.expect("x/first", sender.name, first)
        sender.send("x/first", address, torch.ones(64, dtype=torch.uint8))
        assert wait_final(sender.poll, "x/first") is TransferState.DONE, sender.error("x/first")
        pair = receiver._pairs[sender.name]
        stranger = dist.TCPStore(address.host, address.port, None, False, timeout=datetime.timedelta(seconds=10),
                                 wait_for_workers=False)
        stranger.set(f"{pair_prefix(sender.name, pair.epoch)}/{hdr_key(pair.seq)}", "T 4096 x/victim")
        deadline = time.monotonic() + 5
        while pair.broken is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pair.broken is not None and "seal" in pair.broken
        assert receiver.poll("x/victim", sender.name) is TransferState.PENDING
        assert torch.equal(victim, torch.full((4096,), 7, dtype=torch.uint8))     # untouched
    finally:
        sender.close()
        receiver.close()


def test_the_receiver_listens_on_its_own_address_only():
    receiver = PairGroupReceiver(host="127.0.0.1")
    try:
        socket.create_connection(("127.0.0.1", receiver.address.port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):   # another local address: a wildcard bind would accept
            socket.create_connection(("127.0.0.2", receiver.address.port), timeout=5).close()
    finally:
        receiver.close()


def test_buffers_are_checked_and_ids_are_unique():
    sender = PairGroupSender(timeout_s=SHORT_S)
    try:
        somewhere = PeerAddress("nowhere", "127.0.0.1", 1)
        with pytest.raises(KVTransportError, match="contiguous"):
            sender.send("j/strided", somewhere, torch.ones(4, 4).t())
        sender.send("j/once", somewhere, torch.ones(4))
        with pytest.raises(KVTransportError, match="already sent"):
            sender.send("j/once", somewhere, torch.ones(4))
        with pytest.raises(KeyError):
            sender.poll("j/never-sent")
        sender.forget("j/once")
    finally:
        sender.close()
    with pytest.raises(KVTransportError, match="closed"):
        sender.send("j/after-close", somewhere, torch.ones(4))


# ---- the fake backend -------------------------------------------------------------------------
def fake_pair(hub: FakeTransportHub, tid: str = "t", n: int = 6):
    tx, rx = hub.sender("p"), hub.receiver("d")
    src, dst = torch.arange(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    rx.expect(tid, "p", dst)
    tx.send(tid, rx.address, src)
    return tx, rx, src, dst


def test_fake_copies_bytes_when_both_sides_posted():
    tx, rx, src, dst = fake_pair(FakeTransportHub())
    assert tx.poll("t") is TransferState.DONE and rx.poll("t", "p") is TransferState.DONE
    assert torch.equal(src, dst)


@pytest.mark.parametrize("when", ["connect", "transfer"])
def test_fake_injected_failure_reaches_both_sides(when):
    hub = FakeTransportHub()
    hub.fail_next(1, when=when, message="boom", transfer_id="t")
    tx, rx, _, dst = fake_pair(hub)
    assert tx.poll("t") is TransferState.FAILED and rx.poll("t", "p") is TransferState.FAILED
    assert "boom" in tx.error("t") and "boom" in rx.error("t", "p")
    assert not dst.any()
    rx.expect("t2", "p", torch.zeros(2))   # the fault was used up: the next one goes through
    tx.send("t2", rx.address, torch.ones(2))
    assert tx.poll("t2") is TransferState.DONE


def test_fake_delay_and_kill():
    now = [0.0]
    hub = FakeTransportHub(delay_s=1.0, clock=lambda: now[0])
    tx, rx, src, dst = fake_pair(hub)
    assert tx.poll("t") is TransferState.TRANSFERRING
    now[0] = 1.0
    assert rx.poll("t", "p") is TransferState.DONE and torch.equal(src, dst)
    rx.expect("t2", "p", torch.zeros(2))
    tx.send("t2", rx.address, torch.ones(2))
    assert tx.poll("t2") is TransferState.TRANSFERRING
    hub.kill("d")
    assert tx.poll("t2") is TransferState.FAILED and "d died" in tx.error("t2")
    assert rx.poll("t2", "p") is TransferState.FAILED
    tx.send("t3", rx.address, torch.ones(2))
    assert tx.poll("t3") is TransferState.FAILED and "not reachable" in tx.error("t3")
    with pytest.raises(KVTransportError):
        rx.expect("t4", "p", torch.zeros(2))


def test_fake_unexpected_data_fails():
    hub = FakeTransportHub()
    tx, rx = hub.sender("p"), hub.receiver("d")
    tx.send("x", rx.address, torch.ones(2))
    assert tx.poll("x") is TransferState.FAILED and "was not expected" in tx.error("x")
    assert rx.poll("x", "p") is TransferState.FAILED and rx.error("x", "p") == tx.error("x")
    rx.expect("x", "p", torch.zeros(2))
    assert rx.poll("x", "p") is TransferState.FAILED


def test_a_receive_that_fails_to_post_a_piece_forgets_the_pieces_posted_before():
    """Two prefill ranks each hold a KV head for a one-rank decode gang: two
    pieces. The second fails to post; the first is forgotten, not left behind."""
    from types import SimpleNamespace

    from cluster.transport import kv_handoff

    class Receiver:
        def __init__(self):
            self.expected, self.forgotten = [], []

        def expect(self, transfer_id, sender_name, buffer):
            if self.expected:
                raise KVTransportError("out of staging memory")
            self.expected.append(transfer_id)

        def forget(self, transfer_id, sender_name):
            self.forgotten.append(transfer_id)

    receiver = Receiver()
    spec = SimpleNamespace(num_layers=1, block_size=4, head_dim=8, dtype=torch.float32)
    worker = SimpleNamespace(attachments={kv_handoff.RECEIVER: receiver, kv_handoff.RECEIVES: {}},
                             kv_cache=SimpleNamespace(spec=spec, tensor=torch.empty(0)),
                             tp=SimpleNamespace(rank=0, size=1))
    with pytest.raises(KVTransportError, match="out of staging memory"):
        kv_handoff.start_receive(worker, "t1", num_blocks=2, sender_names=["p0", "p1"], num_kv_heads=2)
    assert receiver.expected == receiver.forgotten == ["t1/0"]
    assert worker.attachments[kv_handoff.RECEIVES] == {}


def test_a_sealed_message_with_foreign_bytes_is_refused_not_a_crash():
    # a store anyone can reach may hold any bytes where a header goes: compare_digest on a str
    # with non-ASCII characters raised TypeError in the receiving thread, which died without cleanup
    from cluster.transport.pair_group_common import seal, unseal
    key = b"k" * 32
    assert unseal(key, "hdr", 3, seal(key, "hdr", 3, "t-1 4096")) == "t-1 4096"
    assert unseal(key, "hdr", 3, b"\xff\xfe|abc".decode("utf-8", "replace")) is None
    assert unseal(key, "hdr", 3, "t-1 4096|" + "é" * 32) is None
    assert unseal(key, "hdr", 4, seal(key, "hdr", 3, "t-1 4096")) is None       # moved from another message


def test_each_side_of_a_pair_listens_on_its_address_towards_the_peer(monkeypatch):
    # gloo's own default is wherever the hostname resolves, which need not be where the store listens
    import threading

    import cluster.transport.pair_group_common as common
    assert common.local_address_towards(PeerAddress("r", "127.0.0.1", 29500)) == "127.0.0.1"
    made, real = [], common.dist.ProcessGroupGloo.create_device
    monkeypatch.setattr(common.dist.ProcessGroupGloo, "create_device",
                        staticmethod(lambda hostname: made.append(hostname) or real(hostname=hostname)))
    store, groups = torch.distributed.HashStore(), {}

    def join(rank: int) -> None:
        groups[rank] = common.make_group(store, rank, "gloo", torch.device("cpu"), 10.0, "127.0.0.1")
    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert made == ["127.0.0.1", "127.0.0.1"] and set(groups) == {0, 1}


def test_an_nccl_pair_group_keeps_its_process_when_the_peer_fails(monkeypatch):
    # torch's default error handling (3) ends the process on an error in a pending NCCL op: a
    # prefill worker dying mid-transfer would take its decode worker down too
    import cluster.transport.pair_group_common as common

    seen = []

    class FakeNCCL:
        Options = type("Options", (), {})

        def __init__(self, store, rank, size, opts):
            seen.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), rank, size))

    # set, then deleted: either way monkeypatch restores the variable as it was before (unset: removed),
    # not make_group's setdefault
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "x")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setattr(common.dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(common.torch.cuda, "set_device", lambda device: None)
    common.make_group(object(), 1, "nccl", torch.device("cuda:0"), 30.0, "127.0.0.1")
    assert seen == [("2", 1, 2)]
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")      # the user's own setting stays
    common.make_group(object(), 0, "nccl", torch.device("cuda:0"), 30.0, "127.0.0.1")
    assert seen[-1] == ("1", 0, 2)


def test_a_receiver_whose_acceptor_cannot_reach_its_store_says_so(monkeypatch):
    # its acceptor thread returned without a word: the receiver reported no problem (the worker "healthy")
    # while every hand-off to it waited out its timeout
    from cluster.transport import pair_group_receiver

    def unreachable(peer, deadline, stopped):
        raise ConnectionError(f"nothing answers at {peer.host}:{peer.port}")
    monkeypatch.setattr(pair_group_receiver, "connect_store", unreachable)
    receiver = PairGroupReceiver(timeout_s=SLACK_S)
    try:
        deadline = time.monotonic() + SLACK_S
        while receiver.problem() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "cannot accept pairs: its store did not answer (nothing answers at" in \
            (receiver.problem() or ""), receiver.problem()
    finally:
        receiver.close()
