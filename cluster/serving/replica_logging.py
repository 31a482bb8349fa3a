"""pdserve's loggers in a Serve replica: the replica's own handlers and level.

In a replica Serve configures only its `ray.serve` logger (its handlers write
the replica's log file under logs/serve/ and, at its level and above, stderr,
which Ray streams to the console of `pdserve serve`) and leaves the root logger
alone: a pdserve module's `logging.getLogger(__name__)` dropped INFO lines and
printed warnings bare (no time, level or replica) through Python's last-resort
handler. Every pdserve deployment calls `use_serve_handlers` first, so pdserve's
lines come out as Serve's own do.

The level is the deployment's Serve logging level (`ray.serve`'s), or
PDSERVE_LOG_LEVEL where it is set in the replicas' environment (a cluster that
`pdserve serve` starts inherits the variable from it).
"""

from __future__ import annotations

import logging
import os

PACKAGES = ("router", "engine", "cluster", "prefill_workers", "decode_workers")
LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"
SERVE_LOGGER = "ray.serve"


def use_serve_handlers() -> None:
    """Gives pdserve's package loggers the `ray.serve` logger's handlers and level
    (or PDSERVE_LOG_LEVEL's; an unknown name is reported and ignored)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    level = serve_logger.level or logging.INFO
    wanted = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    unknown = bool(wanted) and not isinstance(logging.getLevelName(wanted), int)
    if wanted and not unknown:
        level = logging.getLevelName(wanted)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers = list(serve_logger.handlers)
        logger.setLevel(level)
        logger.propagate = False
    if unknown:
        logging.getLogger(__name__).warning("%s=%r is no logging level (DEBUG, INFO, WARNING, ERROR); "
                                            "logging at %s", LOG_LEVEL_ENV, wanted, logging.getLevelName(level))
