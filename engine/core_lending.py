"""Idle cores lent between CPU engines on one machine.

A deployment's CPU ranks split a node's cores (cluster/serving/placement.py):
1 prefill + 1 decode replica on 2 cores run one torch thread each. Under a
light or uneven load one of them is often idle, and the other then runs at half
the speed the machine allows. A CoreLedger lets an engine at work use the
cores of engines that are idle:

- every engine in the ledger has a slot in one small shared-memory file: its
  pid, the cores it owns (its bundle's CPUs), the cores it borrows, and whether
  it is at work;
- before each step a borrowing engine takes the owned cores of idle engines
  that no other engine at work already borrows, as long as the threads of the
  engines at work stay within the machine's cores, and runs that many more
  torch threads;
- an engine that goes back to work takes its cores back at once (it never
  waits): the borrower gives them back at its next step, so the machine is
  oversubscribed for at most one of the borrower's steps. That is why only
  engines whose steps are short borrow (decode and colocated; a prefill-only
  engine lends but does not borrow).

Only cores that an engine in the ledger owns are ever lent: other processes'
cores, and TP gangs (which do not join), are never touched. Each member holds
an open-file-description lock on its slot's bytes, which the kernel drops when
the process dies however it dies: a slot whose lock nobody holds is dead, is
left out of what is lent and taken (checked every LIVENESS_CHECK_S), and is
reclaimed by the next engine that joins. A pid reused by another process
changes nothing. Joins, leaves and every change of what an engine takes happen
under the file's lock, so two borrowers never take the same idle cores.

One ledger per user and set of usable cores (`auto`): deployments confined to
different cpusets do not lend each other cores they cannot run on.

    slot layout (12 bytes, little-endian): pid i32 | own u16 | borrowed u16 | busy u8 | borrows u8 | pad
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Iterable

from engine.cpu_count import usable_cpu_set, usable_cpus

log = logging.getLogger(__name__)

_MAGIC = b"pdserve-cores-v2"                  # 16-byte header
_SLOT = struct.Struct("<iHHBBxx")
_NUM_SLOTS = 64
_SIZE = len(_MAGIC) + _NUM_SLOTS * _SLOT.size
_FLOCK = struct.Struct("hhqqi4x")               # struct flock (Linux): type, whence, start, len, pid
LIVENESS_CHECK_S = 1.0
AUTO = "auto"


def default_ledger_path() -> str:
    """This user's ledger for the cores this process may run on, in shared memory
    where there is one (computed where the engine runs)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    cpus = ",".join(map(str, sorted(usable_cpu_set())))
    return os.path.join(root, f"pdserve-cpu-cores-{os.getuid()}-{zlib.crc32(cpus.encode()):08x}")


class CoreLedger:
    """This engine's slot in the machine's ledger. Not thread-safe: one engine
    thread calls at_work() and idle()."""

    def __init__(self, path: str, own: int, *, borrows: bool, machine_cores: int | None = None):
        """Joins the ledger at `path` (created if need be) owning `own` cores;
        it never runs more threads than `machine_cores` (default: the cores
        this process may run on)."""
        self.path = path
        self.own = own
        self.borrows = borrows
        self.borrowed = 0
        self.steps_with_borrowed = 0     # steps this engine ran with borrowed cores
        self._busy = False
        cores = machine_cores if machine_cores is not None else usable_cpus()
        self._max_extra = max(0, cores - own)
        self._fd, self._map, self._slot = _join(path, own, borrows)
        self._dead: set[tuple[int, int]] = set()     # (slot, pid) whose process died, as of the last check
        self._checked_at = time.monotonic()

    def at_work(self) -> int:
        """Marks this engine at work; sets and returns the torch threads its next
        step runs with: its own cores plus those it may borrow now. A ledger that
        fails (the file gone bad) leaves the engine on its own cores for good."""
        if self._map is None:
            return _run_with_threads(self.own)
        try:
            extra = self._lendable() if self.borrows else 0
            if extra != self.borrowed or not self._busy:
                with _flocked(self._fd):       # read again and write as one: no other borrower in between
                    extra = self._lendable() if self.borrows else 0
                    self.borrowed, self._busy = extra, True
                    self._write()
        except OSError as exc:
            self._give_up(exc)
            return _run_with_threads(self.own)
        self.steps_with_borrowed += extra > 0
        return _run_with_threads(self.own + extra)

    def idle(self) -> None:
        """Marks this engine idle: its cores may be lent, it borrows none, and
        whatever it runs meanwhile runs on its own cores."""
        if self._map is not None and (self._busy or self.borrowed):
            try:
                with _flocked(self._fd):
                    self.borrowed, self._busy = 0, False
                    self._write()
            except OSError as exc:
                self._give_up(exc)
        _run_with_threads(self.own)

    def _give_up(self, exc: OSError) -> None:
        log.warning("the core ledger %s failed (%s); this engine runs on its own cores from now on", self.path, exc)
        self.borrowed, self._busy = 0, False
        self.close()

    def close(self) -> None:
        """Leaves the ledger (the slot is freed) and goes back to its own threads."""
        if self._map is None:
            return
        ledger, self._map = self._map, None
        own_fd, self._fd = self._fd, -1     # closed once: a second close could hit a number reused since
        try:
            with _locked(self.path) as fd:
                _SLOT.pack_into(ledger, self._offset, 0, 0, 0, 0, 0)
                ledger.close()
                own_fd, closing = -1, own_fd
                os.close(closing)           # drops the slot's lock
                if not _any_member(fd):
                    os.unlink(self.path)
        except (OSError, ValueError):       # the file went bad: the slot's lock goes with the descriptor
            if not ledger.closed:
                ledger.close()
            if own_fd >= 0:
                try:
                    os.close(own_fd)
                except OSError:
                    pass
        _run_with_threads(self.own)

    def _lendable(self) -> int:
        now = time.monotonic()
        if now - self._checked_at >= LIVENESS_CHECK_S:
            self._checked_at = now
            self._dead = {(index, pid) for index, (pid, *_rest) in enumerate(self._slots())
                          if pid and index != self._slot and not _slot_held(self._fd, index)}
        # (a slot taken again since the check has another pid: counted)
        others = [(own, borrowed, bool(busy))
                  for index, (pid, own, borrowed, busy, _) in enumerate(self._slots())
                  if pid != 0 and index != self._slot and (index, pid) not in self._dead]
        return lendable_cores(self.own + self._max_extra, self.own, others)

    def _slots(self):
        return _SLOT.iter_unpack(self._map[len(_MAGIC):])

    @property
    def _offset(self) -> int:
        return len(_MAGIC) + self._slot * _SLOT.size

    def _write(self) -> None:
        _SLOT.pack_into(self._map, self._offset, os.getpid(), self.own, self.borrowed, int(self._busy),
                        int(self.borrows))


def lendable_cores(machine_cores: int, own: int, others: Iterable[tuple[int, int, bool]]) -> int:
    """The cores an engine owning `own` may borrow beside `others` (own, borrowed,
    at work): idle engines' owned cores that no engine at work borrows, and no
    more than the machine has left beside the threads of the engines at work (a
    placement may give ranks more cores than the machine has: 1 prefill + 2
    decode on 2 cores own 3). The simulator applies the same rule."""
    idle_owned = taken = threads_at_work = 0
    for other_own, borrowed, at_work in others:
        if at_work:
            taken += borrowed
            threads_at_work += other_own + borrowed
        else:
            idle_owned += other_own
    return max(0, min(machine_cores - own - threads_at_work, idle_owned - taken))


class NoLending:
    """An engine outside any ledger: its threads never change."""

    borrowed = 0
    steps_with_borrowed = 0

    def at_work(self) -> int:
        import torch
        return torch.get_num_threads()

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def join_ledger(path: str | None, own: int, *, borrows: bool) -> CoreLedger | NoLending:
    """This engine's slot in the ledger at `path` (AUTO: default_ledger_path());
    NoLending where there is no path, or the ledger cannot be used (logged: the
    engine runs as before)."""
    if path is None:
        return NoLending()
    try:
        return CoreLedger(default_ledger_path() if path == AUTO else path, own, borrows=borrows)
    except Exception as exc:  # noqa: BLE001 - lending is an optimisation: never the engine's end
        log.warning("idle cores are not lent to or from this engine: %s", exc)
        return NoLending()


class _locked:
    """The ledger file, created if needed, open and exclusively locked."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> int:
        while True:
            fd = _open(self.path, os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_nlink > 0:       # not unlinked by the last member meanwhile
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self.fd = fd
        try:
            size = os.fstat(fd).st_size
            if size == 0 or (size == _SIZE and os.pread(fd, len(_MAGIC), 0) == bytes(len(_MAGIC))):
                # new, or its creator died before writing the header (it is written under this lock)
                os.ftruncate(fd, _SIZE)
                os.pwrite(fd, _MAGIC, 0)
            elif size != _SIZE or os.pread(fd, len(_MAGIC), 0) != _MAGIC:
                raise ValueError(f"{self.path} is not a pdserve core ledger of this version")
        except BaseException:        # /dev/shm full, say: never leave the file locked
            self.__exit__()
            raise
        return fd

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)   # explicitly: an mmap of the file shares its lock
        os.close(self.fd)


class _flocked:
    """The ledger's file lock, on an open descriptor, for a `with` block."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def _open(path: str, flags: int = 0) -> int:
    """The ledger file, opened read-write: never through a symlink, and only this user's."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | flags, 0o600)
    if os.fstat(fd).st_uid != os.getuid():
        os.close(fd)
        raise ValueError(f"{path} belongs to another user")
    return fd


def _join(path: str, own: int, borrows: bool) -> tuple[int, mmap.mmap, int]:
    """(this member's descriptor, holding its slot's lock; the mapped ledger; the slot)."""
    with _locked(path) as locked_fd:
        member_fd = _open(path)
        ledger = None
        try:
            ledger = mmap.mmap(locked_fd, _SIZE)
            free = None
            for index, (pid, *_rest) in enumerate(_SLOT.iter_unpack(ledger[len(_MAGIC):])):
                held = _slot_held(member_fd, index)
                if pid and not held:                  # its process died
                    _SLOT.pack_into(ledger, len(_MAGIC) + index * _SLOT.size, 0, 0, 0, 0, 0)
                    pid = 0
                if pid == 0 and not held and free is None:   # (held with no pid: a fork still has it)
                    free = index
            if free is None:
                raise RuntimeError(f"{path} has no free slot ({_NUM_SLOTS} engines)")
            _lock_slot(member_fd, free)
            _SLOT.pack_into(ledger, len(_MAGIC) + free * _SLOT.size, os.getpid(), own, 0, 0, int(borrows))
            return member_fd, ledger, free
        except BaseException:
            if ledger is not None:
                ledger.close()
            os.close(member_fd)
            raise


def _slot_range(index: int) -> tuple[int, int]:
    return len(_MAGIC) + index * _SLOT.size, _SLOT.size


def _lock_slot(fd: int, index: int) -> None:
    """Takes the slot's open-file-description lock (dropped when `fd` closes, or the process dies)."""
    start, length = _slot_range(index)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))


def _slot_held(fd: int, index: int) -> bool:
    """Whether a live member (another open file description than `fd`'s) holds the slot."""
    start, length = _slot_range(index)
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


def _run_with_threads(threads: int) -> int:
    import torch
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def _any_member(fd: int) -> bool:
    """Whether any slot is held by a live member (`fd` holds none)."""
    data = os.pread(fd, _SIZE, 0)
    return any(pid and _slot_held(fd, index)
               for index, (pid, *_rest) in enumerate(_SLOT.iter_unpack(data[len(_MAGIC):])))
