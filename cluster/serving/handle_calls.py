"""Ray Serve handle calls: cancelling one, and the error one raised.

`DeploymentResponse.cancel()` (and the generator's) fetches the call's replica
assignment first, and an assignment that failed (its target replica is gone:
ReplicaGoneError) is raised again from `cancel()` itself. Cancelling from an
`except` block would then replace the error being handled by that one, and
whatever the handler meant to map it to never happens.
"""

from __future__ import annotations

from ray import exceptions as ray_exceptions


def cancel_call(response) -> None:
    """Cancels the call if it is still under way; a call that already failed is
    over, and its error is the caller's to handle, not cancel()'s to raise."""
    try:
        response.cancel()
    except Exception:  # noqa: BLE001 - the failed assignment's own error, already seen by whoever awaited it
        pass


def replica_error(exc: BaseException) -> BaseException:
    """The replica's own exception, for one Ray raises wrapped in a RayTaskError."""
    return exc.cause if isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None else exc
