"""The factory: each transport's name gives its sender and receiver, built from one flow."""
import pytest

from kvtransport.factory import TRANSPORTS, make_receiver, make_sender
from kvtransport.fake import FakeNetwork
from kvtransport.payload import BlockWriterSink
from kvtransport.receiver import Receiver
from kvtransport.receiver_state import Reservation
from kvtransport.sender import Sender
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes

NODE_OPTIONS = {"device": "cpu", "p2p_host": "127.0.0.1"}     # what a prefill node passes to any
SENDERS = {"zmq": "ZmqSender", "torch_dist": "DistSender", "fake": "FakeSender"}
RECEIVERS = {"zmq": "ZmqReceiver", "torch_dist": "DistReceiver", "fake": "FakeReceiver"}


def _options(transport, net, **more):
    return {"network": net, **more} if transport == "fake" else more


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_gives_its_sender_and_receiver(transport):
    """make_sender / make_receiver give the transport's backend, both the one Sender / Receiver
    flow; a node's whole option set is accepted by every transport."""
    net, pool = FakeNetwork(), make_pool()
    send = make_sender(transport, make_identity(pool, "p0", transport), TEST_SECRET,
                       **_options(transport, net, **NODE_OPTIONS))
    recv = make_receiver(transport, pool, make_identity(pool, "d0", transport), TEST_SECRET,
                         **_options(transport, net, name="d0", p2p_host="127.0.0.1", write_blocks=None))
    try:
        assert type(send).__name__ == SENDERS[transport] and isinstance(send, Sender)
        assert type(recv).__name__ == RECEIVERS[transport] and isinstance(recv, Receiver)
    finally:
        send.close()
        assert recv.close() == []


def test_fake_pair_from_the_factory_ships_a_block():
    """A fake sender and receiver made by name pair and move one block bit for bit."""
    net, src, dst = FakeNetwork(), make_pool(seed=1), make_pool(seed=2)
    recv = make_receiver("fake", dst, make_identity(dst, "d0"), TEST_SECRET, network=net, name="d0")
    send = make_sender("fake", make_identity(src, "p0"), TEST_SECRET, network=net)
    send.connect(recv.endpoint)
    recv.register(Reservation("x1", (3,), 0, 15.0))
    send.begin("x1", recv.endpoint)
    send.send_block("x1", 0, 3, src, 5)
    send.commit("x1", first_token=7, num_tokens=4)
    assert [e.xfer_id for e in recv.poll()] == ["x1"] and same_bytes(dst[3], src[5])


def test_write_blocks_becomes_the_receivers_sink():
    """write_blocks (a pool holding some heads) reaches the zmq receiver as a BlockWriterSink."""
    pool = make_pool()
    recv = make_receiver("zmq", pool, make_identity(pool, "d0", "zmq"), TEST_SECRET,
                         write_blocks=lambda ids, blocks: None)
    try:
        assert type(recv._core._sink) is BlockWriterSink
    finally:
        recv.close()


def test_unknown_transport_or_option_is_refused():
    """An unknown transport is a ValueError; an option no transport takes is a TypeError."""
    pool = make_pool()
    with pytest.raises(ValueError, match="transport must be one of"):
        make_sender("carrier-pigeon", make_identity(pool, "p0"), TEST_SECRET)
    with pytest.raises(TypeError, match="hmw"):
        make_sender("zmq", make_identity(pool, "p0", "zmq"), TEST_SECRET, hmw=3)
