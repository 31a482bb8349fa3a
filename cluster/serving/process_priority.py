"""Serving processes run at normal scheduling priority.

Ray starts worker processes, Serve replicas included, at niceness 15
(RAY_worker_niceness) so that its own daemons win the CPU. A serving replica is
the work itself: at niceness 15 anything else on the node at niceness 0 (a load
generator, another server, a shell) gets ~28× its share of a contended core,
and an engine whose OpenMP threads lose their core stalls at every barrier.
`normal_priority()` puts every thread of this process back at niceness 0;
threads started afterwards (the engine thread, OpenMP workers, TP rank
processes) inherit it. `LOCAL_CLUSTER_ENV` does the same for every worker of a
local cluster pdserve starts itself (Serve's HTTP proxy included).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOCAL_CLUSTER_ENV = {"RAY_worker_niceness": "0"}


def normal_priority() -> bool:
    """Sets niceness 0 on every thread of this process; False (and a log line)
    where the process may not lower its niceness (no CAP_SYS_NICE)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:
            continue   # a thread that ended meanwhile; the others still need it
        except PermissionError:
            log.info("running at niceness %d: this process may not lower it", os.getpriority(os.PRIO_PROCESS, 0))
            return False
    return True
