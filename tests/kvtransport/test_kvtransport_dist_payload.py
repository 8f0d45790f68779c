"""torch.distributed backend, a payload that never comes: the decode node's loop waits for it at
most payload_wait_s (not the peer timeout), fails that transfer, breaks that pair, and serves the
other prefill nodes.

Both prefill nodes and the decode node run in this process (gloo pairs threads as well as
processes); the decode node's loop is the test's thread."""
import pytest

from kvtransport import torch_dist
from kvtransport.events import FailReason, TransferCommitted, TransferFailed
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.torch_dist import DistReceiver, DistSender
from tests.kvtransport.test_kvtransport_dist_join import GEOM, HANG_S, _until

pytestmark = pytest.mark.timeout(600)

WAIT_S = 4.0        # the payload wait under test: above the sender join's leftover (~3 s: gloo bounded
                    # a send by it before), and above a starved machine's stall of the good pair
PEER_TIMEOUT_S = 10 * HANG_S   # far above the test's hang bound: a receiver that ignored WAIT_S hangs the test


def _header_only(endpoint, kv_cache, src_block_id):
    """A sender's payload send that sends nothing, done at once: its header goes, the payload never."""
    done = torch_dist._Completion()
    done.done = True
    return done


def _pair(send: DistSender, recv: DistReceiver) -> None:
    _until(lambda: send.try_connect(recv.endpoint, HANG_S) is not None, lambda: recv.poll(0.01), "a pairing")


def test_a_payload_that_never_comes_fails_its_transfer_and_the_loop_serves_the_others():
    """The mute prefill node's block header comes, its payload never: after payload_wait_s its
    transfer fails (CHANNEL_BROKEN, counted), its pair is dropped and the block it aimed at keeps
    its bytes; the other node's transfer, sent meanwhile, commits bit-exactly."""
    dst = make_pool(seed=None, **GEOM)
    before = dst.clone()
    recv = DistReceiver(dst, make_identity(dst, "d0", "torch_dist"), TEST_SECRET, peer_timeout=PEER_TIMEOUT_S,
                        payload_wait_s=WAIT_S)
    srcs = {name: make_pool(seed=seed, **GEOM) for name, seed in (("mute", 1), ("good", 2))}
    mute = DistSender(make_identity(srcs["mute"], "p-mute", "torch_dist"), TEST_SECRET, peer_timeout=HANG_S)
    good = DistSender(make_identity(srcs["good"], "p-good", "torch_dist"), TEST_SECRET, peer_timeout=HANG_S)
    recv.register(Reservation("xm", (1, 2)))
    recv.register(Reservation("xg", (4, 5)))
    events = []
    try:
        _pair(mute, recv)
        _pair(good, recv)
        mute._channel.send = _header_only
        mute.begin("xm", recv.endpoint)
        mute.send_block("xm", 0, 1, srcs["mute"], 1)
        good.begin("xg", recv.endpoint)
        for i, dst_id in enumerate((4, 5)):
            good.send_block("xg", i, dst_id, srcs["good"], i + 1)
        good.commit("xg", 7, 2 * GEOM["block_size"])
        _until(lambda: len(events) == 2, lambda: events.extend(recv.poll(0.01)) or good.poll(0.0),
               "both transfers' ends")
        by_xfer = {e.xfer_id: e for e in events}
        assert isinstance(by_xfer["xg"], TransferCommitted)
        assert isinstance(by_xfer["xm"], TransferFailed) and by_xfer["xm"].reason is FailReason.CHANNEL_BROKEN
        assert recv.payloads_missed == 1
        assert same_bytes(dst[1], before[1])
        for i, b in enumerate((4, 5)):
            assert same_bytes(dst[b], srcs["good"][i + 1]), b
    finally:
        for end in (mute, good, recv):
            end.close()


@pytest.mark.parametrize("wait_s", [0.0, -1.0, float("nan"), float("inf")])
def test_the_payload_wait_must_be_positive_and_finite(wait_s):
    """A payload wait of 0 s, below, NaN or infinite is refused before anything is bound."""
    dst = make_pool(seed=None, **GEOM)
    with pytest.raises(ValueError, match="payload_wait_s"):
        DistReceiver(dst, make_identity(dst, "d0", "torch_dist"), TEST_SECRET, payload_wait_s=wait_s)

