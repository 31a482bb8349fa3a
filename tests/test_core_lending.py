"""Idle cores lent between CPU engines (engine/core_lending.py): who may borrow
what, when it is given back, slots of dead processes, and an AsyncEngine that
borrows while it steps and lends while it sleeps."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core_lending import CoreLedger, NoLending, join_ledger


@pytest.fixture
def ledger_path(tmp_path):
    return str(tmp_path / "cores")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_borrower_takes_the_cores_of_idle_lenders_and_gives_them_back(ledger_path):
    decode = CoreLedger(ledger_path, 2, borrows=True, machine_cores=8)
    prefill_a = CoreLedger(ledger_path, 1, borrows=False, machine_cores=8)
    prefill_b = CoreLedger(ledger_path, 3, borrows=False, machine_cores=8)

    assert decode.at_work() == 6          # both lenders are idle: 2 + 1 + 3
    assert torch.get_num_threads() == 6
    assert decode.borrowed == 4
    prefill_b.at_work()                   # a lender goes back to work: its 3 cores return at the next step
    assert decode.at_work() == 3
    assert torch.get_num_threads() == 3
    assert prefill_a.at_work() == 1       # a prefill engine never borrows, even with cores idle
    assert decode.at_work() == 2
    prefill_a.idle()
    prefill_b.idle()
    assert decode.at_work() == 6
    decode.idle()
    assert decode.borrowed == 0
    assert decode.steps_with_borrowed == 3


def test_a_core_is_lent_to_one_borrower_at_a_time(ledger_path):
    lender = CoreLedger(ledger_path, 2, borrows=False, machine_cores=8)
    first = CoreLedger(ledger_path, 1, borrows=True, machine_cores=8)
    second = CoreLedger(ledger_path, 1, borrows=True, machine_cores=8)
    assert first.at_work() == 4           # the lender's 2 and idle `second`'s own 1
    assert second.at_work() == 1          # every idle core is taken by `first`
    assert first.at_work() == 3           # `second` took its own core back
    first.idle()                          # an idle borrower holds nothing: `second` may take them now
    assert second.at_work() == 4          # the lender's 2, and idle `first`'s own 1
    lender.close()


def test_borrowing_never_goes_past_the_machine(ledger_path):
    CoreLedger(ledger_path, 4, borrows=False, machine_cores=3)
    decode = CoreLedger(ledger_path, 1, borrows=True, machine_cores=3)
    assert decode.at_work() == 3


def test_ranks_placed_on_more_cores_than_the_machine_has_borrow_only_what_is_left(ledger_path):
    # 1 prefill + 2 decode engines own a core each on a 2-core machine
    prefill = CoreLedger(ledger_path, 1, borrows=False, machine_cores=2)
    first = CoreLedger(ledger_path, 1, borrows=True, machine_cores=2)
    second = CoreLedger(ledger_path, 1, borrows=True, machine_cores=2)
    assert first.at_work() == 2           # both others idle: the machine's second core
    assert second.at_work() == 1          # `first` runs 2 threads: nothing left (prefill's core is no spare)
    assert first.at_work() == 1           # `second` at work on its own core: `first` gives back the spare
    second.idle()
    prefill.at_work()
    assert first.at_work() == 1           # the prefill engine at work: 2 threads on 2 cores already
    prefill.close()


def test_the_slot_of_a_dead_engine_is_reclaimed_and_the_last_member_removes_the_file(ledger_path):
    code = ("import sys; sys.path.insert(0, %r); from engine.core_lending import CoreLedger; "
            "CoreLedger(%r, 1, borrows=False)" % (os.getcwd(), ledger_path))
    subprocess.run([sys.executable, "-c", code], check=True)   # joins, then dies without leaving
    decode = CoreLedger(ledger_path, 1, borrows=True, machine_cores=4)
    assert decode._slot == 0              # the dead process's slot, reused
    assert decode.at_work() == 1          # and nothing is lent by it
    decode.close()
    assert not os.path.exists(ledger_path)


def test_a_file_that_is_not_a_ledger_leaves_the_engine_as_it_was(ledger_path, caplog):
    with open(ledger_path, "wb") as f:
        f.write(b"x" * 784)
    with caplog.at_level(logging.WARNING):
        cores = join_ledger(ledger_path, 1, borrows=True)
    assert isinstance(cores, NoLending)
    assert "is not a pdserve core ledger" in caplog.text
    assert isinstance(join_ledger(None, 1, borrows=True), NoLending)


class _ThreadsAtEachStep:
    """A sink that notes the engine thread's torch threads at every step."""

    def __init__(self):
        self.threads: list[int] = []
        self.finished = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()

    def put(self, outputs):
        self.threads.append(torch.get_num_threads())
        if any(o.finished for o in outputs):
            self._loop.call_soon_threadsafe(self.finished.set_result, None)

    def fail(self, exc):
        self._loop.call_soon_threadsafe(self.finished.set_exception, exc)


@pytest.mark.parametrize("decode", [True, False], ids=["decode-borrows", "prefill-only-lends"])
def test_an_engine_borrows_an_idle_engines_core_while_it_steps(model_dirs, ledger_path, decode):
    idle_lender = CoreLedger(ledger_path, 1, borrows=False, machine_cores=2)
    config = EngineConfig(model=str(model_dirs["tiny"]), dtype="float32", device="cpu", max_model_len=128,
                          cpu_threads=1, cpu_core_ledger=ledger_path)

    async def run() -> tuple[list[int], float, list, float | None, float | None]:
        engine = AsyncEngine(lambda: LLMEngine(config), decode=decode, name="lending-test", cost_warmup_steps=0)
        await engine.ready()
        calibrated = engine.costs.prefill_s_per_token      # timed at start-up, on the engine's own core
        sink = _ThreadsAtEachStep()
        engine.attach("r", sink)
        params = SamplingParams(max_tokens=1 if not decode else 6, temperature=0.0, ignore_eos=True)
        engine.submit(lambda e: e.add_request("r", [1, 5, 9, 13], params))
        await asyncio.wait_for(sink.finished, 60)
        deadline = time.monotonic() + 10  # the loop goes idle, its last step measured
        while (engine.costs.num_steps < len(sink.threads) or engine.load_stats()["cpu_cores_borrowed"]) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        borrowed_after = engine.load_stats()["cpu_cores_borrowed"]
        samples, prefill_cost = engine.take_step_samples(), engine.costs.prefill_s_per_token
        engine.shutdown()
        return sink.threads, borrowed_after, samples, prefill_cost, calibrated

    threads, borrowed_after, samples, prefill_cost, calibrated = asyncio.run(run())
    assert threads and set(threads) == ({2} if decode else {1}), threads
    assert borrowed_after == 0.0
    # each step says what it ran with; steps on borrowed cores stay out of the cost estimates
    assert [(s.threads, s.borrowed_threads) for _, s in samples] == [(2, 1) if decode else (1, 0)] * len(threads)
    assert calibrated is not None and prefill_cost is not None
    # a step on its own cores replaces the calibration; one on borrowed cores does not
    assert (prefill_cost == calibrated) if decode else (prefill_cost != calibrated)
    assert idle_lender.at_work() == 1
    idle_lender.close()
    assert not os.path.exists(ledger_path)   # the engine left the ledger when it stopped


def _join_in_a_process_that_dies(ledger_path: str, own: int, borrows: bool, at_work: bool) -> None:
    """A member that joins (and maybe starts a step) and is killed without leaving."""
    code = ("import os, sys; sys.path.insert(0, %r); from engine.core_lending import CoreLedger; "
            "c = CoreLedger(%r, %d, borrows=%r, machine_cores=8); %s os._exit(0)"
            % (os.getcwd(), ledger_path, own, borrows, "c.at_work();" if at_work else ""))
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_engine_killed_mid_step_stops_taking_cores_without_anyone_joining(ledger_path, monkeypatch):
    """A borrower that died at work (its slot says busy, with borrowed cores) is
    left out once its death is seen, not only when the next engine joins."""
    import engine.core_lending as core_lending
    lender = CoreLedger(ledger_path, 2, borrows=False, machine_cores=8)
    borrower = CoreLedger(ledger_path, 1, borrows=True, machine_cores=8)
    _join_in_a_process_that_dies(ledger_path, 1, borrows=True, at_work=True)   # took the lender's 2 and ours
    monkeypatch.setattr(core_lending, "LIVENESS_CHECK_S", 3600.0)
    borrower._checked_at = float("-inf")       # the next step checks who is alive
    assert borrower.at_work() == 3             # its own and the lender's 2 (the dead member had taken all 3)
    lender.close()
    borrower.close()


def test_a_slot_whose_pid_lives_on_in_another_process_is_still_dead(ledger_path):
    """Liveness is the slot's lock, which the kernel drops with its process, not
    the pid (reused by any process)."""
    import mmap
    import struct
    borrower = CoreLedger(ledger_path, 1, borrows=True, machine_cores=8)
    with open(ledger_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as ledger:
        # slot 1: a live pid (not a member: it holds no lock), at work with 3 borrowed cores
        struct.pack_into("<iHHBBxx", ledger, 16 + 12, os.getppid(), 1, 3, 1, 1)
    lender = CoreLedger(ledger_path, 2, borrows=False, machine_cores=8)
    assert lender._slot == 1                   # the joiner reclaimed it
    borrower._checked_at = float("-inf")
    assert borrower.at_work() == 3             # its own 1 and the lender's 2
    lender.close()
    borrower.close()
    assert not os.path.exists(ledger_path)


def test_an_idle_engine_runs_on_its_own_cores(ledger_path):
    """Work an idle engine does between steps (KV written into its cache) must not
    use cores it has lent out meanwhile."""
    lender = CoreLedger(ledger_path, 1, borrows=False, machine_cores=4)
    decode = CoreLedger(ledger_path, 1, borrows=True, machine_cores=4)
    assert decode.at_work() == 2
    decode.idle()
    assert torch.get_num_threads() == 1
    lender.close()
    decode.close()


def test_a_ledger_whose_creator_died_before_its_header_is_set_up_again(ledger_path):
    with open(ledger_path, "wb") as f:
        f.write(bytes(16 + 64 * 12))           # sized, header never written
    decode = CoreLedger(ledger_path, 1, borrows=True, machine_cores=4)
    assert decode.at_work() == 1
    decode.close()


def test_a_ledger_path_that_is_a_symlink_is_not_followed(ledger_path, tmp_path, caplog):
    target = tmp_path / "elsewhere"
    os.symlink(target, ledger_path)
    with caplog.at_level(logging.WARNING):
        assert isinstance(join_ledger(ledger_path, 1, borrows=True), NoLending)
    assert not target.exists()


def test_the_automatic_ledger_is_per_user_and_set_of_usable_cores(monkeypatch):
    from engine.core_lending import default_ledger_path
    here = default_ledger_path()
    assert f"pdserve-cpu-cores-{os.getuid()}-" in here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 6})
    assert default_ledger_path() != here


def test_a_ledger_that_cannot_be_set_up_leaves_it_unlocked(ledger_path, monkeypatch, caplog):
    """/dev/shm full while the header is written: this engine runs without lending,
    and the file is not left locked for the next engine (it would wait for ever)."""
    import engine.core_lending as core_lending

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(core_lending.os, "pwrite", full)
    with caplog.at_level(logging.WARNING):
        assert isinstance(join_ledger(ledger_path, 1, borrows=True), NoLending)
    monkeypatch.undo()
    code = ("import sys; sys.path.insert(0, %r); from engine.core_lending import CoreLedger; "
            "CoreLedger(%r, 1, borrows=False).close(); print('joined')" % (os.getcwd(), ledger_path))
    joined = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert joined.stdout.strip() == "joined", joined.stderr


def test_a_ledger_that_fails_mid_run_leaves_the_engine_on_its_own_cores(ledger_path, monkeypatch, caplog):
    import engine.core_lending as core_lending
    CoreLedger(ledger_path, 1, borrows=False, machine_cores=4)
    decode = CoreLedger(ledger_path, 1, borrows=True, machine_cores=4)
    assert decode.at_work() == 2

    def broken(*args):
        raise OSError(5, "Input/output error")

    decode.idle()
    monkeypatch.setattr(core_lending.fcntl, "flock", broken)
    with caplog.at_level(logging.WARNING):
        assert decode.at_work() == 1            # no exception into the engine loop
    monkeypatch.undo()
    assert decode.at_work() == 1 and "runs on its own cores from now on" in caplog.text


def test_usable_cores_ignore_a_mask_openmp_binding_narrowed(monkeypatch):
    """With OpenMP binding on, the calling thread's mask is one core: not the process's."""
    from engine import cpu_count
    monkeypatch.setattr(cpu_count.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(cpu_count, "_cgroup_cpuset", lambda: frozenset({0, 1, 2, 3}))
    monkeypatch.setattr(cpu_count, "cgroup_cpu_quota", lambda: None)
    for name in cpu_count._BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_count.usable_cpus() == 1              # a real mask (taskset) counts
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    assert cpu_count.usable_cpus() == 4
    # an off switch binds nothing: the mask counts (a 64-core host's count had run 64 threads on 2)
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert cpu_count.usable_cpus() == 1
    monkeypatch.delenv("OMP_PROC_BIND")
    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine,none")
    assert cpu_count.usable_cpus() == 1
    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine,compact,1,0")
    assert cpu_count.usable_cpus() == 4
    monkeypatch.setenv("OMP_PROC_BIND", "false")             # off: places set beside it bind nothing
    monkeypatch.setenv("OMP_PLACES", "cores")
    assert cpu_count.usable_cpus() == 1


def test_leaving_a_ledger_removed_from_under_it_closes_its_descriptor_once(ledger_path, monkeypatch):
    # the file removed by someone else (a /dev/shm cleaner) just before the last member's unlink: the
    # clean-up closed the member's descriptor a second time, by then another file's of the same number
    engine = CoreLedger(ledger_path, 1, borrows=True, machine_cores=2)
    member = engine._fd
    reopened = []
    real_unlink = os.unlink

    def unlink_after_a_cleaner(path):
        real_unlink(path)
        reopened.append(os.open(os.devnull, os.O_RDONLY))     # takes the lowest free number: the member's
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "unlink", unlink_after_a_cleaner)
    engine.close()
    assert reopened == [member]                           # the number the member's descriptor had
    os.fstat(reopened[0])                                 # still open (else OSError): not closed by the clean-up
    os.close(reopened[0])


def test_usable_cores_are_at_most_the_cgroups_cpu_quota(monkeypatch, tmp_path):
    """A container limited by quota (docker --cpus 2, a Kubernetes CPU limit) keeps every host core
    in its mask: 8 threads on a 2-CPU quota are throttled, OpenMP barriers and all."""
    from engine import cpu_count
    monkeypatch.setattr(cpu_count.os, "sched_getaffinity", lambda pid: set(range(8)))
    for name in cpu_count._BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "cgroup"
    own = root / "kubepods" / "pod1" / "ctr"
    own.mkdir(parents=True)
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    monkeypatch.setattr(cpu_count, "_CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_count, "_PROC_CGROUP", proc)
    assert cpu_count.cgroup_cpu_quota() is None and cpu_count.usable_cpus() == 8      # no quota set
    (own / "cpu.max").write_text("max 100000\n")
    (root / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")    # 2.5 CPUs on the pod
    assert cpu_count.cgroup_cpu_quota() == 2.5 and cpu_count.usable_cpus() == 2
    (own / "cpu.max").write_text("150000 100000\n")                           # its own is less: 1.5
    assert cpu_count.usable_cpus() == 1
    (own / "cpu.max").write_text("20000 100000\n")                            # a fifth of a CPU: still 1
    assert cpu_count.usable_cpus() == 1
    for f in (own / "cpu.max", root / "kubepods" / "pod1" / "cpu.max"):
        f.unlink()
    (root / "cpu").mkdir()                                                     # cgroup v1
    (root / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_count.usable_cpus() == 4
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")                    # v1's "no limit"
    assert cpu_count.usable_cpus() == 8


def test_the_cgroup_cpuset_read_is_the_processs_own_cgroups(monkeypatch, tmp_path):
    from engine import cpu_count
    root = tmp_path / "cgroup"
    own = root / "system.slice" / "pdserve.service"
    own.mkdir(parents=True)
    (root / "cpuset.cpus.effective").write_text("0-63\n")           # the host's: not this process's
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/system.slice/pdserve.service\n")
    monkeypatch.setattr(cpu_count, "_CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_count, "_PROC_CGROUP", proc)
    assert cpu_count._cgroup_cpuset() == frozenset(range(64))       # none of its own: the nearest that says
    (own / "cpuset.cpus.effective").write_text("2-3,6\n")
    assert cpu_count._cgroup_cpuset() == frozenset({2, 3, 6})
