"""The KV-transfer secret of a deployment that names no environment variable
for it: made once per Ray cluster and kept in the cluster's internal key-value
store. Building the same application again (`serve deploy` of an unchanged
file, a restart of `pdserve serve --address`) then gives the workers the same
arguments, so Serve updates them in place instead of restarting every replica,
and workers of an old and a new version can still pair during a rollout.
Without a Ray connection (building an application in a test) the secret is
random."""

from __future__ import annotations

import secrets

_NAMESPACE = "pdserve"
_KEY = b"kv_transfer_secret"


def cluster_secret() -> str:
    """The cluster's secret (made on first use; the first writer wins a race)."""
    import ray
    from ray.experimental import internal_kv
    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return secrets.token_hex(32)
    internal_kv._internal_kv_put(_KEY, secrets.token_hex(32), overwrite=False, namespace=_NAMESPACE)
    return internal_kv._internal_kv_get(_KEY, namespace=_NAMESPACE).decode()
