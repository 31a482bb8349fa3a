"""The HTTP port check of `pdserve serve`: a port something listens on is
reported by number before anything deploys; one blocked only by a stopped
server's connections in TIME_WAIT is waited for. Also the cluster it joins or
starts (a dead RAY_ADDRESS, a dead cluster left by `ray start`), and serving
until the application is lost."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

import cluster.cli.serve_command as serve_command
import cluster.serving.port_check as port_check
from cluster.cli.main import build_parser
from cluster.serving.port_check import can_bind, has_listener, wait_for_port


@pytest.fixture()
def listener():
    """A socket listening on a free loopback port for the test's duration."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s, s.getsockname()[1]
    s.close()


def closed_server_port(reuse_address: bool) -> int:
    """A port whose server (listening with or without SO_REUSEADDR) closed a
    connection first and then stopped listening: the server's side of that
    connection stays in TIME_WAIT, and nothing listens."""
    server = socket.socket()
    if reuse_address:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()                      # the server closes first ...
    assert client.recv(1) == b""      # ... the client sees its FIN ...
    client.close()                    # ... and closes: the server's side goes to TIME_WAIT
    server.close()
    time.sleep(0.05)
    return port


def test_a_listening_port_is_seen_and_cannot_be_bound(listener):
    sock, port = listener
    assert has_listener("127.0.0.1", port) and has_listener("0.0.0.0", port)
    assert not can_bind("127.0.0.1", port) and not can_bind("127.0.0.1", port, reuse_address=True)
    sock.close()
    assert not has_listener("127.0.0.1", port)
    assert can_bind("127.0.0.1", port)


def test_a_listener_on_another_address_of_this_machine_is_seen_for_a_wildcard_host():
    # a server on one address (here 127.0.0.2, the node's own address in a cluster) blocks binding
    # 0.0.0.0 as surely; probed through 127.0.0.1 it went unseen, and pdserve waited 65 s for
    # TIME_WAIT before saying "nothing listens on it"
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not can_bind("0.0.0.0", port)
        assert has_listener("0.0.0.0", port)
        problem = wait_for_port("0.0.0.0", port, listener_grace_s=0.2, time_wait_s=30.0, poll_s=0.05)
        assert f"0.0.0.0:{port} is in use by another process" in problem


def test_time_wait_blocks_a_plain_bind_only_after_a_server_without_reuse_address():
    port = closed_server_port(reuse_address=False)
    assert not has_listener("127.0.0.1", port)
    assert not can_bind("127.0.0.1", port)          # how Serve's direct ingress binds
    port = closed_server_port(reuse_address=True)
    assert not can_bind("127.0.0.1", port)
    assert can_bind("127.0.0.1", port, reuse_address=True)


def test_waits_for_a_listener_that_goes_away(listener):
    sock, port = listener
    threading.Timer(0.5, sock.close).start()
    started = time.monotonic()
    assert wait_for_port("127.0.0.1", port, listener_grace_s=10.0, poll_s=0.05) is None
    assert 0.4 < time.monotonic() - started < 5.0


def test_a_listener_that_stays_is_reported_with_the_port(listener):
    _, port = listener
    problem = wait_for_port("127.0.0.1", port, listener_grace_s=0.3, poll_s=0.05)
    assert f"127.0.0.1:{port} is in use by another process" in problem and "--port" in problem


def test_time_wait_is_waited_for_with_a_notice():
    port = closed_server_port(reuse_address=False)
    notices = []
    problem = wait_for_port("127.0.0.1", port, time_wait_s=0.3, poll_s=0.05, notify=notices.append)
    assert len(notices) == 1 and "TIME_WAIT" in notices[0]      # said once, not every poll
    assert "nothing listens on it" in problem                  # past the (shortened) wait
    assert wait_for_port("127.0.0.1", closed_server_port(reuse_address=True), reuse_address=True,
                         time_wait_s=0.3, notify=notices.append) is None
    assert len(notices) == 1                                   # bound at once: no wait, no notice


def test_serve_on_a_held_port_exits_with_the_port_in_the_message(listener, monkeypatch, capsys):
    """On a cluster of its own, `pdserve serve` checks the port before deploying
    (here without Ray: the cluster start and stop are stubbed)."""
    _, port = listener
    import ray
    shutdowns = []
    monkeypatch.setattr(serve_command, "_connect", lambda *a, **k: True)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(port_check, "LISTENER_GRACE_S", 0.3)
    args = build_parser().parse_args(["serve", "--port", str(port)])
    assert serve_command._cmd_serve(args) == 2
    assert f"127.0.0.1:{port} is in use" in capsys.readouterr().err
    assert shutdowns == [True]          # the cluster it started is stopped


def test_ctrl_c_while_serve_waits_for_the_port_stops_its_cluster(monkeypatch):
    # a KeyboardInterrupt traceback and exit 1 before, the StopSignal not yet installed
    import ray
    shutdowns = []

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(serve_command, "_connect", lambda *a, **k: True)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(port_check, "wait_for_port", interrupted)
    args = build_parser().parse_args(["serve", "--port", "8765"])
    assert serve_command._cmd_serve(args) == 130
    assert shutdowns == [True]


@pytest.mark.parametrize(("host", "expected"), [
    ("no-such-host.invalid", "does not resolve"),
    ("192.0.2.1", "is not an address of this machine"),     # TEST-NET-1: never a local address
])
def test_a_host_that_can_never_be_bound_is_reported_at_once(host, expected):
    """Only an address in use is waited for: a host that does not resolve or is
    not this machine's is an error before any wait (here the waits would be 30 s)."""
    started = time.monotonic()
    problem = wait_for_port(host, 8000, listener_grace_s=30, time_wait_s=30, notify=lambda m: None)
    assert problem is not None and expected in problem
    assert time.monotonic() - started < 5


def _closed_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_dead_ray_address_in_the_environment_is_a_clear_error_at_once(monkeypatch):
    import time
    import ray
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(ray, "init", lambda **k: pytest.fail("ray.init retries a dead address for minutes"))
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"RAY_ADDRESS=127\.0\.0\.1:\d+: nothing answers.*unset RAY_ADDRESS"):
        serve_command._connect(None, 2, {}, False)
    assert time.monotonic() - started < 5


def test_a_dead_cluster_left_by_ray_start_is_replaced_by_a_new_local_one(monkeypatch, capsys):
    import ray
    import ray._private.services as services
    from cluster.serving import local_cluster
    dead = f"127.0.0.1:{_closed_port()}"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: dead)
    monkeypatch.setattr(ray, "init", lambda **k: pytest.fail("ray.init retries a dead address for minutes"))
    started = []
    monkeypatch.setattr(local_cluster, "start_local_cluster", lambda *a, **k: started.append(a))
    assert serve_command._connect(None, 2, {}, False) is True
    assert started == [(2, {})]
    assert f"({dead}) does not answer; starting a new one" in capsys.readouterr().out


def test_a_port_that_answers_but_is_no_ray_cluster_is_a_connection_error(monkeypatch):
    import ray

    def not_gcs(**kwargs):
        raise RuntimeError("Failed to connect to GCS")
    monkeypatch.setattr(ray, "init", not_gcs)
    with pytest.raises(ConnectionError, match="RuntimeError: Failed to connect to GCS"):
        serve_command._init_ray("127.0.0.1:8265")


def _ticking_clock(monkeypatch):
    """A clock that moves a second at every look, and sleeps that return at once."""
    monkeypatch.setattr(serve_command.time, "sleep", lambda s: None)
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]
    return clock


class _Statuses:
    """serve.status() answering each call with the next application status (None: no application)."""

    def __init__(self, statuses):
        self.statuses = list(statuses)

    def __call__(self):
        from types import SimpleNamespace

        from ray.serve.schema import ApplicationStatus
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        status = ApplicationStatus(status) if status is not None else None     # as Serve gives it: an enum
        apps = {} if status is None else {"pdserve": SimpleNamespace(status=status, message="replica died")}
        return SimpleNamespace(applications=apps)


@pytest.mark.parametrize("statuses, says", [
    (["RUNNING", None, "RUNNING", None, None], r"application is gone \(deleted"),   # twice in a row
    (["RUNNING", "UNHEALTHY"], r"has been UNHEALTHY for 3\d s: replica died"),
])
def test_serving_ends_with_a_reason_when_the_application_is_lost(monkeypatch, statuses, says):
    from ray import serve
    from cluster.cli.stop_signal import StopSignal
    clock = _ticking_clock(monkeypatch)
    statuses_seen = _Statuses(statuses)
    monkeypatch.setattr(serve, "status", statuses_seen)
    reason = serve_command._watch_application("pdserve", StopSignal(), poll_s=2.0, unhealthy_limit_s=30.0,
                                              clock=clock)
    assert re.search(says, reason), reason
    assert len(statuses_seen.statuses) == 1     # every status was read: one missing status alone is not gone


def test_serve_not_answering_a_few_polls_is_not_a_loss_but_many_are(monkeypatch):
    from ray import serve
    from cluster.cli.stop_signal import StopSignal
    answers = [RuntimeError("controller restarting")] * 3 + ["RUNNING"] + [RuntimeError("GCS lost")] * 4

    def status():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return _Statuses([answer])()
    monkeypatch.setattr(serve, "status", status)
    clock = _ticking_clock(monkeypatch)
    reason = serve_command._watch_application("pdserve", StopSignal(), poll_s=2.0, clock=clock)
    assert reason.startswith("Serve has not answered for 4 polls (RuntimeError: GCS lost)") and answers == []


def test_serving_a_healthy_application_runs_until_stopped(monkeypatch):
    from ray import serve
    from cluster.cli.stop_signal import StopSignal
    stop, polls = StopSignal(), []

    def status():
        polls.append(1)
        if len(polls) == 5:
            stop.requested = True           # a Ctrl-C after the fifth look
        return _Statuses(["UNHEALTHY" if len(polls) == 2 else "RUNNING"])()
    monkeypatch.setattr(serve, "status", status)
    clock = _ticking_clock(monkeypatch)
    told = []
    assert serve_command._watch_application("pdserve", stop, poll_s=2.0, unhealthy_limit_s=30.0, clock=clock,
                                            notify=told.append) is None
    assert len(polls) == 5
    # an operator hears a replica failing and the application coming back, once each
    assert told == ["the 'pdserve' application is UNHEALTHY: replica died", "the 'pdserve' application is RUNNING"]


def test_a_local_cluster_that_answers_but_cannot_be_joined_is_reported_not_replaced(monkeypatch):
    # a Ray version mismatch, say: starting a second local cluster beside it would hide the problem
    import ray
    import ray._private.services as services
    from cluster.serving import local_cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)

    def mismatch(**kwargs):
        raise RuntimeError("Version mismatch: the cluster runs Ray 2.59")
    monkeypatch.setattr(ray, "init", mismatch)
    monkeypatch.setattr(local_cluster, "start_local_cluster", lambda *a, **k: pytest.fail("a second cluster"))
    with pytest.raises(ConnectionError, match="Version mismatch"):
        serve_command._connect(None, 2, {}, False)


def test_a_sigterm_before_serve_takes_its_own_signals_exits_143(monkeypatch):
    # ray.init's handler runs sys.exit(15) until pdserve installs its own: 143, as once deployed
    import signal

    from cluster.cli import main as cli_main

    def terminated(*args, **kwargs):
        raise SystemExit(signal.SIGTERM)
    monkeypatch.setattr(serve_command, "_connect", terminated)
    assert cli_main.main(["serve", "--port", "8765"]) == 143
    monkeypatch.setattr(serve_command, "_connect", lambda *a, **k: (_ for _ in ()).throw(SystemExit(3)))
    with pytest.raises(SystemExit) as exit_:   # any other exit is left alone
        cli_main.main(["serve", "--port", "8765"])
    assert exit_.value.code == 3


def test_a_second_signal_during_the_clean_up_quits_at_once(monkeypatch):
    import signal

    from cluster.cli import stop_signal
    exits = []
    monkeypatch.setattr(stop_signal.os, "_exit", exits.append)
    stop = stop_signal.StopSignal()
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)        # while serving or deploying: still only a stop request
    assert exits == [] and stop.requested
    stop.force_on_next()                     # the clean-up begins
    stop._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]


def test_a_signal_long_after_the_first_quits_even_where_the_command_never_looked_again(monkeypatch):
    # stuck in a call to a hung controller, the command never reaches its clean-up
    import signal

    from cluster.cli import stop_signal
    exits, now = [], [100.0]
    monkeypatch.setattr(stop_signal.os, "_exit", exits.append)
    stop = stop_signal.StopSignal(clock=lambda: now[0])
    stop._handle(signal.SIGINT, None)
    now[0] += stop_signal.FORCE_AFTER_S - 0.5
    stop._handle(signal.SIGINT, None)        # a double press: still a clean stop
    assert exits == []
    now[0] += 0.5
    stop._handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_the_ready_line_brackets_an_ipv6_host():
    assert serve_command.base_url("::", 8000) == "http://[::]:8000"
    assert serve_command.base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"


def test_a_chosen_port_is_outside_the_range_binds_to_port_0_take(monkeypatch):
    # a port chosen for another process to bind (the HTTP server of a `pdserve serve` the tests start) was
    # taken by one of the ports the Ray cluster starting meanwhile bound to port 0
    from engine import tp_group
    ports = {tp_group.free_port() for _ in range(20)}
    start = tp_group._ephemeral_range_start()
    assert all(20000 <= port < start for port in ports) and len(ports) > 1
    assert all(can_bind("127.0.0.1", port) for port in ports)
    monkeypatch.setattr(tp_group, "_ephemeral_range_start", lambda: 20000)     # no room below the range
    assert 0 < tp_group.free_port() < 65536
