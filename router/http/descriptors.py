"""File descriptors for HTTP connections: every connection the router holds is one, and a process
may hold at most RLIMIT_NOFILE (`ulimit -n`). Out of them, accept() fails with EMFILE: uvloop's
libuv then accepts and closes every waiting connection unanswered, and whatever else the process
opens meanwhile (a node's socket, a file) fails as well.

So clients never take the last descriptors: the connections the router holds (at most
max_connections served + max_refusals being refused, router/http/connection_slots.py), the
descriptors open at startup and --reserved-fds for everything else (a router holds about one per
node it controls, besides its own files) must fit in the soft limit. The
router raises its soft limit toward the hard one as far as that needs (as Go's runtime raises it,
and nginx's worker_rlimit_nofile); when even the hard limit is short it serves fewer connections
than --max-connections and says so.
"""
from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)


def fitted_max_connections(max_connections: int, max_refusals: int, reserved: int) -> int:
    """max_connections, or fewer when the descriptors the process may open cannot hold them beside
    `reserved` others (a warning then); raises the soft RLIMIT_NOFILE as far as needed and allowed
    (a refusal, e.g. a sandbox's, leaves the soft limit as it was)."""
    in_use = len(os.listdir("/dev/fd"))
    needed = in_use + reserved + max_refusals + max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (ValueError, OSError) as e:
        log.warning("could not raise the file descriptor limit from %d to %d: %s", soft, raised, e)
        raised = soft
    fitted = max(1, raised - (needed - max_connections))
    if fitted < max_connections:
        log.warning("--max-connections %d does not fit in the %d file descriptors this process may open "
                    "(ulimit -Hn) beside the %d open, %d kept for nodes and files (--reserved-fds) and %d for "
                    "refusals (--max-refusals): serving at most %d connections. Raise the limit (ulimit -n, systemd's "
                    "LimitNOFILE) or lower --max-connections.", max_connections, raised, in_use, reserved,
                    max_refusals, fitted)
    return fitted
