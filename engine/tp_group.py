"""Building a tensor-parallel group, and the local rank processes of the
offline engine.

The group is a torch.distributed backend (gloo for CPU tensors, NCCL for CUDA
tensors) created directly on a prefixed TCP store, without
`init_process_group`: nothing global is touched. Beside it, every gang has a
gloo group for rank 0's commands and other pickled objects (`control`):
followers wait for the next command there, blocked on a socket, for as long
as rank 0 is idle. Waiting in an NCCL broadcast instead would keep a kernel
spinning on every follower's GPU between requests, and pass each command
through device memory and a host sync.

`RankProcesses` starts ranks 1..N-1 as local processes that run
`model_worker.follow` (rank 0 stays in the caller's process, where the
scheduler and sampler live) and stops them: on `stop()`, on garbage
collection of the engine, at interpreter exit, and by themselves when their
parent process dies.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from engine.model.parallel import TensorParallel
from engine.tcp_store import listening_store

log = logging.getLogger(__name__)
T = TypeVar("T")

# Followers wait for rank 0's next command in the control group for as long as it is idle,
# so its timeout outlasts any idle period; a dead peer is detected by its closed socket, and
# rank 0 also checks that the rank processes are alive before each step.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
# Tensor collectives run only within a command, all ranks at once; a rank stuck in one is
# found sooner by rank 0's stuck-step check (engine/async_engine.py).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)
# every rank of a gang in the store (each spawned, torch and the engine imported): generous for a
# loaded node starting many gangs at once, yet a bound on a start whose follower died before joining
JOIN_TIMEOUT = datetime.timedelta(seconds=600)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend name for `backend` ('auto', 'gloo' or 'nccl', checked by EngineConfig)."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("tp_backend nccl needs device=cuda; CPU tensors use gloo")
    return backend


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's store, on a loopback port the kernel picks as it binds (the ranks
    are local processes); its `port` goes to the ranks. Any local user can reach a
    loopback port: the gang's keys go under a prefix only its processes know
    (create_group's `prefix`), so nobody else can find them to race the ranks."""
    return listening_store("127.0.0.1", 0, size, CONNECT_TIMEOUT)


def create_group(rank: int, size: int, host: str, port: int, backend: str, device: torch.device,
                 prefix: str = "tp", store: dist.Store | None = None) -> TensorParallel:
    """Joins (rank 0: hosts, unless `store` is its hosted store) the store at
    host:port and builds the tensor group and the control group."""
    if store is None:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=CONNECT_TIMEOUT)
    store = dist.PrefixStore(f"{prefix}/", store)
    # every rank here within JOIN_TIMEOUT, before the groups (whose own timeouts are days long) wait
    # for them: a rank that died before joining fails this, and no thread waits on for days
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(size)], JOIN_TIMEOUT)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
        comm_device = str(device)
    else:
        group = bound_gloo_group(store, rank, size, COLLECTIVE_TIMEOUT, host)
        comm_device = "cpu"
    control = bound_gloo_group(dist.PrefixStore("control/", store), rank, size, CONTROL_TIMEOUT, host)
    return TensorParallel(rank=rank, size=size, group=group, comm_device=comm_device, store=store,
                          control=control)


def bound_gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                     host: str) -> dist.ProcessGroupGloo:
    """A gloo group whose sockets listen on `host` (for a gang: the loopback, where its
    store is), not where the machine's hostname resolves, which can be an interface
    the store does not listen on: a gang's control group carries pickled messages,
    a KV pair's group the cache."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


# Ports handed to another process to bind come from below the kernel's ephemeral range (where
# a bind to port 0 takes its ports: a Ray cluster starting meanwhile takes dozens, and took one
# that had been chosen for the HTTP server) and above Ray's worker ports (10002-19999).
_CHOSEN_PORTS_FROM = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, outside the range the kernel hands to binds
    of port 0 where there is room below it (else one of that range)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    below = _ephemeral_range_start()
    rng = random.Random()
    for _ in range(64 if below > _CHOSEN_PORTS_FROM else 0):
        port = rng.randrange(_CHOSEN_PORTS_FROM, below)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it is not said)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def exit_when_parent_dies(parent_pid: int, poll_s: float = 1.0) -> None:
    """A follower must not outlive the process that started it (its TP peer)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_s)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


@dataclass(slots=True)
class _GroupState:
    tp: TensorParallel | None = None   # set once every rank has joined
    healthy: bool = True               # False after an error mid-collective: STOP could hang


class RankProcesses:
    """Ranks 1..size-1 of one engine as local processes.

    `stop()` (also run when this object is garbage collected, and at interpreter
    exit) tells healthy ranks to stop, then terminates whatever is left."""

    def __init__(self, size: int, port: int, follower_args: tuple):
        from engine.model_worker import follower_main
        ctx = multiprocessing.get_context("spawn")
        # one pipe per rank for the error that ended it, read by `dead` (rank 0's own error, when it
        # saw the group break, says only that a peer went away)
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        self._failure_readers = [reader for reader, _ in pipes]
        self._failures: dict[int, str] = {}     # index in procs -> the error it reported
        self._failures_lock = threading.Lock()  # `dead` runs on any thread
        self.procs = [ctx.Process(target=follower_main,
                                  args=(rank, size, port, os.getpid(), writer, *follower_args),
                                  name=f"pdserve-tp-rank{rank}", daemon=True)
                      for rank, (_, writer) in zip(range(1, size), pipes)]
        self._state = _GroupState()
        # before the first start: a start that fails (or a Ctrl-C) midway stops the ranks started so far
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self._state, self._failure_readers,
                                           self._failures_lock)
        try:
            for p, (_, writer) in zip(self.procs, pipes):
                p.start()
                writer.close()      # the rank's copy is the one that writes
        except BaseException:
            for _, writer in pipes:
                writer.close()
            self._state.healthy = False
            self._finalizer()
            raise

    def attach(self, tp: TensorParallel) -> None:
        """The group every rank joined; `stop` sends it the STOP command."""
        self._state.tp = tp

    def mark_broken(self) -> None:
        """The ranks may be stuck in a collective: `stop` terminates them outright."""
        self._state.healthy = False

    def kill(self) -> None:
        """Terminates the ranks without a word to them, from any thread (rank 0's may be stuck
        in a collective with them, where a STOP broadcast from here would interleave)."""
        self.mark_broken()
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> str | None:
        """Which rank processes exited, or None while all live."""
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
        if not dead:
            return None
        reported = [f"rank {i + 1}: {failure}" for i in dead if (failure := self._failure(i))]
        return (f"tensor-parallel rank process(es) {[self.procs[i].name for i in dead]} exited "
                f"(exit codes {[self.procs[i].exitcode for i in dead]})"
                + (f" after {'; '.join(reported)}" if reported else "") + "; see their log above")

    def _failure(self, index: int) -> str | None:
        """The error rank `index + 1` reported before it exited, if it did."""
        with self._failures_lock:
            if index not in self._failures:
                reader = self._failure_readers[index]
                try:
                    self._failures[index] = reader.recv() if reader.poll() else ""
                except (EOFError, OSError):     # exited without a word (killed)
                    self._failures[index] = ""
            return self._failures[index] or None

    def check_alive(self) -> None:
        if problem := self.dead():
            raise RuntimeError(problem)

    def watched(self, start: Callable[[], T], poll_s: float = 0.1) -> T:
        """Runs rank 0's part of the engine's start (joining the group, which blocks
        until every rank has; loading and setting up the model, whose collectives
        wait for every rank) while watching the rank processes, so one that dies
        while starting (a bad checkpoint, out of memory) fails the start at once:
        a dead peer breaks a gloo collective, but an NCCL one waits for it for
        ever (the thread left in it is a daemon, and the process is failing)."""
        result: list = []

        def run() -> None:
            try:
                result.append(start())
            except BaseException as exc:  # re-raised in the caller's thread
                result.append(exc)

        thread = threading.Thread(target=run, name="tp-rank0-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(poll_s)
            if thread.is_alive():
                self.check_alive()
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def stop(self) -> None:
        self._finalizer()


def _shutdown(procs: list, state: _GroupState, failure_readers: list, readers_lock: threading.Lock) -> None:
    from engine.model_worker import STOP
    if state.tp is not None and state.healthy and all(p.is_alive() for p in procs):
        try:
            state.tp.broadcast_object((STOP, None))
        except Exception:  # a rank went away meanwhile: terminate the rest below
            log.warning("could not tell the tensor-parallel ranks to stop; terminating them")
    # ranks told to stop get a moment to exit; broken ones sit in a collective and never would
    _stop_processes(procs, grace_s=10.0 if state.healthy else 0.0)
    with readers_lock:      # (`dead` may be reading one on another thread)
        for reader in failure_readers:
            reader.close()


def _stop_processes(procs: list, grace_s: float = 10.0) -> None:
    procs = [p for p in procs if p.pid is not None]     # (a start that failed midway left the rest unstarted)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
