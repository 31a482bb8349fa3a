"""The KV-transfer secret of a deployment that names no environment variable
for it: made once per Ray cluster and kept in the cluster's internal key-value
store. Building the same application again (`serve deploy` of an unchanged
file, a restart of `pdserve serve --address`) then gives the workers the same
arguments, so Serve updates them in place instead of restarting every replica,
and workers of an old and a new version can still pair during a rollout.
Without a Ray connection (building an application in a test) the secret is
random.

The same store carries the secret of a deployment file that names its
variable (kv_transfer.secret_env) to an application built in the cluster
(`pdserve serve --autoscale`), where that variable need not be set: the
application's config, which Serve shows to anyone who asks, names the key."""

from __future__ import annotations

import secrets

_NAMESPACE = "pdserve"
_KEY = b"kv_transfer_secret"
_NAMED_PREFIX = "kv_transfer_secret_env/"


def cluster_secret() -> str:
    """The cluster's secret (made on first use; the first writer wins a race)."""
    import ray
    from ray.experimental import internal_kv
    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return secrets.token_hex(32)
    internal_kv._internal_kv_put(_KEY, secrets.token_hex(32), overwrite=False, namespace=_NAMESPACE)
    return internal_kv._internal_kv_get(_KEY, namespace=_NAMESPACE).decode()


def named_secret_key(variable: str) -> str:
    """The key store_named_secret keeps environment variable `variable`'s secret under."""
    return _NAMED_PREFIX + variable


def store_named_secret(variable: str, value: str) -> None:
    """Keeps `value`, the secret in environment variable `variable`, in the
    cluster's store under named_secret_key(variable), replacing what an earlier
    deploy stored there. Needs a Ray connection (RuntimeError without one)."""
    import ray
    from ray.experimental import internal_kv
    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        raise RuntimeError("storing the KV secret in the cluster needs a Ray connection")
    internal_kv._internal_kv_put(named_secret_key(variable).encode(), value, overwrite=True, namespace=_NAMESPACE)


def delete_named_secret(variable: str) -> None:
    """Removes what store_named_secret kept for `variable` (nothing without a Ray connection)."""
    import ray
    from ray.experimental import internal_kv
    if ray.is_initialized() and internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(named_secret_key(variable).encode(), namespace=_NAMESPACE)


def stored_secret(key: str) -> str | None:
    """The secret store_named_secret kept under `key`; None when the cluster holds
    none there, or without a Ray connection."""
    import ray
    from ray.experimental import internal_kv
    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return None
    value = internal_kv._internal_kv_get(key.encode(), namespace=_NAMESPACE)
    return value.decode() if value else None
