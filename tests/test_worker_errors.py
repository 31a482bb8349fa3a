"""What the router makes of a worker's errors (router/serve_pools.py): the
worker's own errors come back as raised; a worker that cannot serve any more,
dead or with its engine stopped, is unavailable, so the request moves on."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from engine.errors import EngineStoppedError, InvalidRequestError
from router.backend import BackendUnavailableError
from router.serve_pools import unwrapped_errors


def _raised_in_replica(exc: Exception) -> RayTaskError:
    return RayTaskError("DecodeServer.generate", "Traceback (most recent call last): ...", exc)


def test_a_workers_own_error_comes_back_as_raised():
    with pytest.raises(InvalidRequestError, match="max_tokens must be") as info:
        with unwrapped_errors("decode"):
            raise _raised_in_replica(InvalidRequestError("max_tokens must be >= 1", "max_tokens"))
    assert info.value.param == "max_tokens"


def test_a_worker_whose_engine_stopped_is_unavailable():
    with pytest.raises(BackendUnavailableError, match="the decode worker is unavailable: the engine is not running"):
        with unwrapped_errors("decode"):
            raise _raised_in_replica(EngineStoppedError("the engine is not running: a step failed"))
