"""The router answers HTTP itself: Ray Serve's direct ingress.

Behind Serve's HTTP proxy every streamed chunk crosses one more process
(router replica → proxy actor → client), and on a small node the proxy's CPU
comes out of the engine's. With direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS)
each ingress replica serves the same ASGI app on a port of its own, taken from
a range; pdserve makes that range the single port the user asked for, so the
router listens on it, and moves Serve's proxy (which Serve still starts on the
head node) to a free port nobody needs to know.

Serve reads these settings when its controller and replicas start, so they
apply to a cluster that `pdserve serve` starts itself; a deployment that joins
an existing cluster is served through the proxy on the configured port, as
before. One router per node: the application deploys exactly one.
"""

from __future__ import annotations

# Serve keeps a draining direct-ingress replica open this long so that an
# external load balancer can deregister it; a local cluster has none.
_DRAINING_PERIOD_S = "1"
# Serve holds a released replica port out of use this long (default 150 s, for its
# HAProxy mode). With one port that is how long HTTP stays down after the router
# replica is replaced. It must outlast TCP TIME_WAIT (60 s on Linux): the new
# router binds without SO_REUSEADDR, and a failed bind blocks the port for good.
PORT_QUARANTINE_S = "65"


def direct_ingress_env(port: int) -> dict[str, str]:
    """Environment for the Ray processes of a local cluster: the ingress
    replica (the router) listens on `port` itself."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),   # [min, max): exactly `port`
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": _DRAINING_PERIOD_S,
        "RAY_SERVE_PORT_QUARANTINE_S": PORT_QUARANTINE_S,
    }
