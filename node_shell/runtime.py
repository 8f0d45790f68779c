"""The loop that serves a node: poll the router and the transport, step the engine, forward.

The loop never blocks on the network while the engine has work: control messages and transport
frames are polled with a zero timeout between steps. With no step to run it sleeps in the kernel,
in one wait over the router link's socket and the KV transport's (NodeService.poll), woken by the
first control message or frame to arrive, or after IDLE_POLL_S (heartbeats, leases, grammar
compiles, KV events); after BUSY_POLL_S while work is due that no socket announces
(NodeService.needs_poll: blocks pinned until their bytes have left).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from node_shell.config import NodeConfig
    from node_shell.service import NodeService

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.005        # the longest an idle loop sleeps (woken sooner by any socket's input)
BUSY_POLL_S = 0.001        # ... while service.needs_poll(): a short bounded poll, not a spin
EXIT_BLOCKS_BROKEN = 70     # the node closed cleanly but its block accounting did not hold (EX_SOFTWARE)


def main(role: str, make_service: Callable[[NodeConfig], NodeService], argv: list[str] | None = None) -> None:
    """`python -m {role}_node` (or `pdserve {role}`): the node from its flags, served until told
    to stop."""
    from engine.heap import freeze_heap
    from kvtransport.secret import SecretError
    from node_shell.config import NodeConfig

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    config = NodeConfig.from_argv(f"pdserve {role}", argv)
    try:
        service = make_service(config)
    except SecretError as err:
        sys.exit(f"{role} node {config.node_id}: {err}")
    if config.freeze_gc:
        freeze_heap(f"{role} node {config.node_id}")
    intact = run(service)
    # Closed on purpose (goodbye said, transport, link and tp workers closed): exit now. The
    # interpreter's own teardown would spend 2-3 s collecting the engine's ~400k objects (one per
    # KV block among them) for nothing, and a drained node or a stopped deployment waits on it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if intact else EXIT_BLOCKS_BROKEN)


def run(service: NodeService) -> bool:
    """Serve until the router says leave or the process gets SIGTERM/SIGINT; then say goodbye
    (with the reason) and close. Returns whether block conservation held at the end."""
    stopping = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: stopping.append(signal.Signals(signum).name))
    reason = ""
    try:
        while not stopping and not service.should_stop():
            working = service.engine.has_unfinished_requests()
            service.poll(0.0 if working else BUSY_POLL_S if service.needs_poll() else IDLE_POLL_S)
            if service.engine.has_unfinished_requests():
                outputs, failed = service.engine.safe_step()      # a broken engine raises: the node ends
                for rid, why in failed.items():
                    service.fail(rid, why)
                service.on_outputs(outputs)
            service.kv_events.flush()
        reason = stopping[0] if stopping else "told to leave"
    except BaseException as err:
        reason = f"failed: {type(err).__name__}: {err}"[:200]
        raise
    finally:
        intact = service.close(reason)
    return intact
