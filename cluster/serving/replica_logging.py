"""pdserve's loggers in a Serve replica: the replica's own handlers and level.

In a replica Serve configures only its `ray.serve` logger (its handlers write
the replica's log file under logs/serve/ and, at its level and above, stderr,
which Ray streams to the console of `pdserve serve`) and leaves the root logger
alone: a pdserve module's `logging.getLogger(__name__)` dropped INFO lines and
printed warnings bare (no time, level or replica) through Python's last-resort
handler. Every pdserve deployment calls `use_serve_handlers` first, so pdserve's
lines come out as Serve's own do.

The level is the deployment's Serve logging level (`ray.serve`'s, followed when
Serve changes it in place), or PDSERVE_LOG_LEVEL where it is set in the
replicas' environment (a cluster that `pdserve serve` starts inherits the
variable from it). Following Serve's, pdserve's loggers let INFO lines through
to the handler whatever Serve's level (pdserve logs nothing per request or per
step at INFO), which drops what is under Serve's level: a level Serve lowers to
INFO shows from the next line, one it lowers to DEBUG from the next line at INFO
or above (debug calls stay cheap until then).
"""

from __future__ import annotations

import logging
import os

PACKAGES = ("router", "engine", "cluster", "prefill_workers", "decode_workers")
LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"
SERVE_LOGGER = "ray.serve"


class _ToServe(logging.Handler):
    """Hands each record to the `ray.serve` logger's handlers as they are when it comes
    (Serve rebuilds them when a deployment's logging config changes in place), and
    follows that logger's level where PDSERVE_LOG_LEVEL does not set pdserve's."""

    def __init__(self, fixed_level: int | None):
        super().__init__()
        self.fixed_level = fixed_level

    def emit(self, record: logging.LogRecord) -> None:
        serve_logger = logging.getLogger(SERVE_LOGGER)
        if self.fixed_level is None:
            level = serve_logger.level or logging.INFO
            if _followed(level) != logging.getLogger(PACKAGES[0]).level:   # changed in place
                _set_level(_followed(level))
            if record.levelno < level:
                return
        serve_logger.handle(record)


def use_serve_handlers() -> None:
    """Sends pdserve's package loggers' lines through the `ray.serve` logger's handlers,
    at its level (or PDSERVE_LOG_LEVEL's; an unknown name is reported and ignored)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    wanted = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    fixed = logging.getLevelName(wanted) if wanted else None
    unknown = bool(wanted) and not isinstance(fixed, int)
    if unknown:
        fixed = None
    handler = _ToServe(fixed)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
    _set_level(fixed if fixed is not None else _followed(serve_logger.level or logging.INFO))
    if unknown:
        logging.getLogger(__name__).warning("%s=%r is no logging level (DEBUG, INFO, WARNING, ERROR); "
                                            "logging at Serve's", LOG_LEVEL_ENV, wanted)


def _followed(serve_level: int) -> int:
    """pdserve's loggers' level while following Serve's: at most INFO (module doc)."""
    return min(serve_level, logging.INFO)


def _set_level(level: int) -> None:
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
