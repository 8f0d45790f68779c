"""ZMTP PLAIN on the router's control server: a local process without the cluster secret is
refused at ZeroMQ's handshake, so none of its (huge) messages is buffered by the router, while the
registered nodes keep being served; refusals are counted with the dropped control frames."""
from __future__ import annotations

import asyncio
import contextlib

from tests.disagg_harness import Cluster, counter, run, serve_two_tokens, until
from tests.zmtp_flood import MIB, flood, rss

ROUNDS = 4            # messages of 64 frames of 1 MiB (the control plane's MAXMSGSIZE is 16 MiB)
BOUND = 24 * MIB      # what the router may grow by while a flood is refused


def test_a_flood_without_the_password_never_reaches_the_router():
    """256 MiB from a wrong PLAIN password and 128 MiB from a peer with no mechanism grow the
    router by less than BOUND and are counted as zmtp_refused only; the registered pair serves a
    request meanwhile and stays registered."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            dropped = c.backend.server.dropped
            before = rss()
            endpoint = c.backend.control_endpoint
            # the floods start and end off the event loop: it runs the router and the scripted
            # nodes' heartbeats, which a blocking wait for a flood's "sent" (seconds on a loaded
            # machine) stalled past the 5 s heartbeat timeout
            floods = contextlib.ExitStack()
            await asyncio.to_thread(floods.enter_context, flood(endpoint, "0" * 64, ROUNDS))
            try:
                await asyncio.to_thread(floods.enter_context, flood(endpoint, None, ROUNDS // 2))
                await until(lambda: counter(dropped, {"reason": "zmtp_refused"}) >= ROUNDS, 15)
                await asyncio.sleep(0.5)
                grown = rss() - before
                await serve_two_tokens(c, p, d)
            finally:
                await asyncio.to_thread(floods.close)
            assert grown < BOUND, f"the router grew {grown / MIB:.0f} MiB"
            reasons = {s.labels["reason"] for m in dropped.collect() for s in m.samples
                       if s.name.endswith("_total") and s.value}
            assert reasons == {"zmtp_refused"}
            assert sorted(n.node_id for n in c.backend.server.registry.nodes()) == ["decode-0", "prefill-0"]
    run(test)
