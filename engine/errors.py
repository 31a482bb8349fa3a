"""Errors a caller can cause, each naming what to change, and the engine's own stop."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches any other request.
    `param` names the offending field (the HTTP layer reports it as OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineStoppedError(RuntimeError):
    """The engine thread is gone (shut down, or a step failed): the worker cannot
    serve, and the router treats it as unavailable. `replica_id`: the serving
    replica it happened on, where a worker knows it (a retry avoids it)."""

    def __init__(self, message: str, replica_id: str = ""):
        super().__init__(message)
        self.replica_id = replica_id

    def __reduce__(self):   # keeps replica_id across Ray's pickling
        return EngineStoppedError, (str(self), self.replica_id)


class RequestIdInUse(InvalidRequestError):
    """A request id the engine or worker already runs. On a decode replica a KV
    hand-off retried after a call that may have executed there (Ray's "actor
    unavailable") can meet its own earlier attempt: the router then tries
    elsewhere. `replica_id`: the replica that refused it, where a worker knows it."""

    def __init__(self, message: str, replica_id: str = ""):
        super().__init__(message, "request_id")
        self.replica_id = replica_id

    def __reduce__(self):   # keeps replica_id across Ray's pickling
        return RequestIdInUse, (str(self), self.replica_id)


class RequestAbortedError(RuntimeError):
    """The request was aborted on this worker (by `abort`) before it produced what
    its caller waits for. Not a CancelledError: a caller must not take it for its
    own client leaving."""
