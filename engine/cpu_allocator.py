"""glibc allocator settings for CPU inference.

Every engine step allocates large temporaries (gathered KV, activations) and
frees them. By default glibc serves allocations over 128 KiB-32 MiB with mmap
and returns them to the kernel on free, so the next step page-faults the same
memory back in; on a 2-core machine that made decode attention ~3x slower than
the copy itself. Raising the mmap and trim thresholds keeps freed memory in the
heap for reuse. It is process-wide and only changes where memory comes from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    """Serve allocations up to `threshold_bytes` from the heap and keep freed
    memory for reuse. Returns False (and changes nothing) where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the default allocator settings")
    return ok
