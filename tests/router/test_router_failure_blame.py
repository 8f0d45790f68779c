"""Which node the next attempt avoids: a prefill node's report that its transfer to the decode node
failed (or that it could not pair with it) blames that decode node, not the prefill node."""
from __future__ import annotations

import pytest

from pdwire.control import AbortRequest, DecodeRequest, FirstToken, PrefillRequest, RequestFailed
from pdwire.messages import Reserved
from tests.disagg_harness import Cluster, first_of, run, view


@pytest.mark.parametrize("reason, first", [
    ("transfer failed: its Commit was not sent: tcp://d:7000 not draining: send blocked 2.0s", True),
    ("transfer failed: peer_dead silent for 3.0s", False),
    ("cannot reach decode node: handshake timed out", False),
], ids=["commit_cut", "transfer_lost", "unpaired"])
def test_a_prefill_nodes_failed_transfer_avoids_its_decode_node_not_itself(reason, first):
    """P reports that its transfer to D failed (after its first token or before it): the next
    attempt avoids D, the node at fault, and runs on the other decode node through the same P."""
    async def test():
        async with Cluster() as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=4)
            d, _ = await first_of(ds, DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), 0))
            assert (await p.expect(PrefillRequest)).rid == "r1"
            if first:
                p.send(FirstToken("r1", 11, "a", None, ""))
                assert view(await out.next()) == ([([11], "a", None)], False)
            p.send(RequestFailed("r1", reason, True))
            assert (await d.expect(AbortRequest)).rid == "r1"
            d2, req = await first_of(ds, DecodeRequest)
            assert d2 is not d and req.rid == "r1~1"
            assert c.backend._requests["r1"].choices[0].avoid == {d.node_id}
            d2.send(Reserved("r1~1", "x2", (5, 6), 0))
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert (await p.expect(PrefillRequest)).rid == "r1~1"
            out.task.cancel()
    run(test)
