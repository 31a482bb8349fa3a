"""The local cluster's environment: normal priority, Serve's slower controller
loop and gRPC calls between deployments unless the user set them, and the
caller's extra variables on top."""

from cluster.serving.local_cluster import (
    CONTROL_LOOP_ENV,
    GRPC_CALLS_ENV,
    SERVE_CONTROL_LOOP_INTERVAL_S,
    local_cluster_env,
)


def test_defaults_lengthen_the_controller_loop_and_keep_normal_priority(monkeypatch):
    monkeypatch.delenv(CONTROL_LOOP_ENV, raising=False)
    env = local_cluster_env({})
    assert env[CONTROL_LOOP_ENV] == str(SERVE_CONTROL_LOOP_INTERVAL_S)
    assert float(env[CONTROL_LOOP_ENV]) > 0.1          # Serve's own default
    assert env["RAY_worker_niceness"] == "0"


def test_an_interval_the_user_set_wins(monkeypatch):
    monkeypatch.setenv(CONTROL_LOOP_ENV, "0.05")
    assert CONTROL_LOOP_ENV not in local_cluster_env({})   # os.environ already has it: left alone


def test_deployments_call_each_other_over_grpc_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv(GRPC_CALLS_ENV, raising=False)
    assert local_cluster_env({})[GRPC_CALLS_ENV] == "1"
    monkeypatch.setenv(GRPC_CALLS_ENV, "0")
    assert GRPC_CALLS_ENV not in local_cluster_env({})


def test_extra_variables_are_added_and_override():
    env = local_cluster_env({"RAY_worker_niceness": "5", "X_EXTRA": "1"})
    assert env["RAY_worker_niceness"] == "5" and env["X_EXTRA"] == "1"


def test_normal_priority_goes_on_past_a_thread_that_ended(monkeypatch):
    """A thread that ends between listing and its priority call is skipped, and
    every other thread is still set back to niceness 0."""
    import os

    from cluster.serving import process_priority
    niceness = {101: 15, 102: 15, 103: 15}       # 102 ends before it is looked at
    monkeypatch.setattr(os, "listdir", lambda path: ["101", "102", "103"])

    def getpriority(which, tid):
        if tid == 102:
            raise ProcessLookupError(tid)
        return niceness[tid]

    monkeypatch.setattr(os, "getpriority", getpriority)
    monkeypatch.setattr(os, "setpriority", lambda which, tid, value: niceness.__setitem__(tid, value))
    assert process_priority.normal_priority() is True
    assert niceness == {101: 0, 102: 15, 103: 0}


def test_direct_ingress_gets_its_port_back_soon_after_the_router_is_replaced():
    """The router's one port is held out of use after its replica dies: past TCP
    TIME_WAIT (a bind before that fails and Serve blocks the port for good), and
    well short of Serve's 150 s default, during which nothing answers HTTP."""
    from cluster.serving.direct_ingress import direct_ingress_env
    env = direct_ingress_env(8000)
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == \
        ("8000", "8001")
    assert 60 < float(env["RAY_SERVE_PORT_QUARANTINE_S"]) < 150
