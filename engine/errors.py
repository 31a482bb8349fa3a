"""Errors a caller can cause, each naming what to change, and the engine's own stop."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches any other request.
    `param` names the offending field (the HTTP layer reports it as OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineStoppedError(RuntimeError):
    """The engine thread is gone (shut down, or a step failed): the worker cannot
    serve, and the router treats it as unavailable."""
