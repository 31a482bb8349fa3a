"""Deploying a pdserve application on a local Ray cluster that a benchmark or test started."""

from __future__ import annotations

import time
import urllib.request
from typing import Any


def deploy(name: str, settings: dict[str, Any], port: int, timeout_s: float = 300.0) -> str:
    """Deploys a DeploymentConfig built from `settings` as Serve application
    `name` under /name and waits until /health answers; returns its base URL."""
    from ray import serve

    from cluster.app_builder import build_application
    from cluster.config import DeploymentConfig
    from cluster.serving.placement import placed_config

    config = placed_config(DeploymentConfig.model_validate(settings))
    serve.run(build_application(config), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}/{name}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return base
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base} did not become healthy in {timeout_s:.0f} s") from None
            time.sleep(0.5)
