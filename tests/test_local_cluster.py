"""The local cluster's environment: normal priority, Serve's slower controller
loop unless the user set one, and the caller's extra variables on top."""

from cluster.serving.local_cluster import (
    CONTROL_LOOP_ENV,
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


def test_extra_variables_are_added_and_override():
    env = local_cluster_env({"RAY_worker_niceness": "5", "X_EXTRA": "1"})
    assert env["RAY_worker_niceness"] == "5" and env["X_EXTRA"] == "1"
