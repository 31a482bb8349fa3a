"""Rank 0's commands and the ranks' pickled results travel on the gang's gloo
control group, never on the tensor group (NCCL on a GPU, where a follower
waiting for the next command would keep a kernel spinning on its device)."""

from __future__ import annotations

import dataclasses
import threading

import torch

from engine.tp_group import create_group, host_store


class _NoTensorGroup:
    """Stands in for the tensor group: any collective on it is a failure."""

    def __getattr__(self, name):
        raise AssertionError(f"a pickled object went through the tensor group ({name})")


def _gang(size: int):
    """`size` ranks of one gang in threads of this process, their tensor groups replaced."""
    store = host_store(size)
    groups: list = [None] * size

    def join(rank: int) -> None:
        groups[rank] = create_group(rank, size, "127.0.0.1", store.port, "gloo", torch.device("cpu"),
                                    store=store if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups), "the gang did not form"
    return [dataclasses.replace(g, group=_NoTensorGroup()) for g in groups], store


def _on_every_rank(groups, fn):
    results: list = [None] * len(groups)

    def run(rank: int) -> None:
        results[rank] = fn(groups[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_commands_and_results_cross_the_control_group():
    groups, _store = _gang(3)
    assert all(g.control is not None and g.control is not g.group for g in groups)
    command = ("step", {"ids": list(range(1000)), "table": torch.arange(12).view(3, 4)})
    received = _on_every_rank(groups, lambda tp: tp.broadcast_object(command if tp.is_first else None))
    for got in received:
        assert got[0] == "step" and got[1]["ids"] == list(range(1000))
        assert torch.equal(got[1]["table"], torch.arange(12).view(3, 4))
    # results of different sizes, gathered on rank 0 in rank order
    gathered = _on_every_rank(groups, lambda tp: tp.gather_objects_to_first(["x" * (10 ** tp.rank), tp.rank]))
    assert gathered[0] == [["x", 0], ["x" * 10, 1], ["x" * 100, 2]]
    assert gathered[1] is None and gathered[2] is None


def test_the_gangs_gloo_sockets_listen_where_its_store_is(monkeypatch):
    # not where the machine's hostname resolves (an interface others reach): the control group
    # carries pickled messages
    import torch.distributed as dist
    made, real = [], dist.ProcessGroupGloo.create_device
    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device",
                        staticmethod(lambda hostname: made.append(hostname) or real(hostname=hostname)))
    _gang(2)
    assert made == ["127.0.0.1"] * 4       # two ranks, each a tensor group and a control group


def test_a_rank_that_never_joins_fails_the_gang_within_the_join_timeout(monkeypatch):
    # rank 0's group rendezvous waited with the groups' own timeouts (days): a follower that died before
    # joining left the join thread, and the store it holds, behind for days after the start had failed
    import datetime
    import time

    import engine.tp_group as tp_group
    monkeypatch.setattr(tp_group, "JOIN_TIMEOUT", datetime.timedelta(seconds=0.5))
    store = host_store(2)
    outcome: list = []

    def rank_zero_alone() -> None:
        try:
            outcome.append(create_group(0, 2, "127.0.0.1", store.port, "gloo", torch.device("cpu"), store=store))
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=rank_zero_alone, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert isinstance(outcome[0], Exception) and "joined/1" in str(outcome[0])
