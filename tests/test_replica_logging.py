"""pdserve's loggers in a Serve replica write through the replica's Serve handlers,
at Serve's level or PDSERVE_LOG_LEVEL's."""

from __future__ import annotations

import logging

import pytest

from cluster.serving.replica_logging import LOG_LEVEL_ENV, PACKAGES, SERVE_LOGGER, use_serve_handlers


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@pytest.fixture
def serve_logger(monkeypatch):
    """`ray.serve` as Serve configures it in a replica (a handler, INFO); every logger touched is
    put back afterwards."""
    names = (SERVE_LOGGER, *PACKAGES)
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    collect = Collect()
    serve = logging.getLogger(SERVE_LOGGER)
    serve.handlers, serve.propagate = [collect], False
    serve.setLevel(logging.INFO)
    yield collect
    for n, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)


def test_pdserve_lines_go_through_serves_handlers_at_its_level(serve_logger):
    use_serve_handlers()
    logging.getLogger("router.ingress").info("stats of the decode pool failed")     # dropped before
    logging.getLogger("engine.async_engine").debug("a step")
    logging.getLogger("decode_workers.decode_worker").warning("lease ended")
    logging.getLogger("unrelated.module").warning("not ours")                        # left to the root logger
    assert serve_logger.lines == ["INFO router.ingress: stats of the decode pool failed",
                                  "WARNING decode_workers.decode_worker: lease ended"]


def test_the_level_from_the_environment_and_a_bad_one_reported(serve_logger, monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    use_serve_handlers()
    logging.getLogger("engine.async_engine").debug("a step")
    assert serve_logger.lines == ["DEBUG engine.async_engine: a step"]
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    use_serve_handlers()
    logging.getLogger("engine.async_engine").debug("a step")
    assert len(serve_logger.lines) == 2 and "PDSERVE_LOG_LEVEL='LOUD' is no logging level" in serve_logger.lines[1]
    assert "logging at Serve's" in serve_logger.lines[1]


def test_serves_handlers_and_level_changed_in_place_are_followed(serve_logger):
    # a deployment's logging config updated without restarting the replica: Serve rebuilds its
    # handlers and sets its level; copies of the old handlers wrote to the old file, at the old level
    use_serve_handlers()
    rebuilt = Collect()
    serve = logging.getLogger(SERVE_LOGGER)
    serve.handlers = [rebuilt]
    serve.setLevel(logging.WARNING)
    logging.getLogger("router.ingress").info("below the new level")
    logging.getLogger("router.ingress").warning("after the update")
    assert serve_logger.lines == [] and rebuilt.lines == ["WARNING router.ingress: after the update"]


def test_a_level_serve_lowers_in_place_is_followed(serve_logger):
    # pdserve's loggers stood at WARNING after Serve's had: INFO lines never reached the handler that
    # would have seen Serve's level go back to INFO, until some warning came
    serve = logging.getLogger(SERVE_LOGGER)
    serve.setLevel(logging.WARNING)
    use_serve_handlers()
    logging.getLogger("router.ingress").info("under WARNING")
    serve.setLevel(logging.INFO)
    logging.getLogger("router.ingress").info("back at INFO")
    serve.setLevel(logging.DEBUG)
    logging.getLogger("engine.async_engine").debug("a step, before a line at INFO")
    logging.getLogger("router.ingress").info("now DEBUG")
    logging.getLogger("engine.async_engine").debug("a step")
    assert serve_logger.lines == ["INFO router.ingress: back at INFO", "INFO router.ingress: now DEBUG",
                                  "DEBUG engine.async_engine: a step"]
    # the autoscaler's lines are pdserve's too (PDSERVE_LOG_LEVEL sets them): they went to ray.serve directly
    from router import autoscale_loop
    assert autoscale_loop.log.name.startswith(PACKAGES)
