"""Nodes do not branch on the transport: each asks the factory once, by the configured name."""
import functools
from types import SimpleNamespace

import pytest

import decode_node.service as decode_service
from kvtransport.secret import ENV_VAR
from kvtransport.sender import Sender
from kvtransport.testing import TEST_SECRET
from node_shell.shipper import SEND_TIMEOUT_S
import prefill_node.service as prefill_service


def _stub(transport):
    runner = SimpleNamespace(kv_cache=SimpleNamespace(device="cpu"), block_writer=lambda: None)
    config = SimpleNamespace(kv_transport=transport, p2p_host="10.0.0.9", kv_bind="tcp://127.0.0.1:0", lease_s=30.0,
                             kv_batch_bytes=8 << 20, kv_recv_queue_bytes=16 << 20,
                             kv_split_payloads=False, kv_payload_wait_s=2.5, kv_poll_s=0.007)
    return SimpleNamespace(engine=SimpleNamespace(runner=runner), config=config,
                           shipper=SimpleNamespace(bind=lambda engine, sender: None))


@pytest.mark.parametrize("transport", ["zmq", "torch_dist"])
def test_node_services_make_their_transport_by_name(monkeypatch, transport):
    """open_transport passes config.kv_transport and its whole option set to the factory (a decode
    node's sender, for KV moves, is made at the first move, the same way); each sender's sends,
    made on the node's loop, give up after SEND_TIMEOUT_S, not the transport's 10 s default; a poll
    of any of them takes messages for --kv-poll-ms at most."""
    calls = []
    monkeypatch.setattr(prefill_service, "make_sender", lambda *a, **kw: calls.append((a, kw)) or "S")
    monkeypatch.setattr(decode_service, "make_sender", lambda *a, **kw: calls.append((a, kw)) or "S")
    monkeypatch.setattr(decode_service, "make_receiver", lambda *a, **kw: calls.append((a, kw)) or "R")
    p, d = _stub(transport), _stub(transport)
    identity = SimpleNamespace(layout=SimpleNamespace(block_nbytes=1 << 20))
    prefill_service.PrefillService.open_transport(p, identity, b"secret")
    decode_service.DecodeService.open_transport(d, identity, b"secret")
    assert (p.sender, d.receiver, d.mover.sender) == ("S", "R", None)
    assert d.mover.slice_blocks == 8        # a KV move sends one message (8 MiB) at a time
    assert d.mover._make_sender() == "S"
    sender = ((transport, identity, b"secret"), {"device": "cpu", "p2p_host": "10.0.0.9", "max_batch_bytes": 8 << 20,
                                                 "send_timeout": SEND_TIMEOUT_S,    # bounded: both send on the loop
                                                 "max_poll_s": 0.007})
    mover = (sender[0], {**sender[1], "split_payloads": False})                    # one message a send
    assert calls == [sender, ((transport, d.engine.runner.kv_cache, identity, b"secret"),
                              {"bind": "tcp://127.0.0.1:0", "p2p_host": "10.0.0.9", "write_blocks": None,
                               "payload_wait_s": 2.5, "max_batch_bytes": 8 << 20, "max_queue_bytes": 16 << 20,
                               "split_payloads": False, "max_poll_s": 0.007}), mover]


def test_a_kv_move_slices_to_the_smaller_of_both_nodes_batches(monkeypatch):
    """A decode node's --kv-batch-mib sizes its mover's slices (8 blocks of 1 MiB here), but the
    sender packs to min(own, the receiving node's announced batch): after pairing, the mover asks
    the sender how many blocks it packs per message to that peer and slices to the smaller."""
    monkeypatch.setattr(decode_service, "make_receiver", lambda *a, **kw: "R")
    d = _stub("zmq")
    identity = SimpleNamespace(layout=SimpleNamespace(block_nbytes=1 << 20))
    decode_service.DecodeService.open_transport(d, identity, b"secret")
    announced = {"tcp://small:1": 3 << 20, "tcp://large:1": 64 << 20}
    sender = SimpleNamespace(_max_batch_bytes=8 << 20,
                             _core=SimpleNamespace(identity=identity, batch_bytes=announced.__getitem__))
    sender.blocks_per_message = functools.partial(Sender.blocks_per_message, sender)   # the real rule
    assert d.mover.peer_slice(sender, "tcp://small:1") == 3
    assert d.mover.peer_slice(sender, "tcp://large:1") == 8


def test_kv_poll_ms_bounds_a_poll_of_the_decode_nodes_receiver(monkeypatch, model_dir):
    """--kv-poll-ms is how long one poll of a decode node's KV receiver takes messages for at
    most; 0 and more than MAX_KV_POLL_MS are refused."""
    from decode_node.service import DecodeService
    from node_shell.config import MAX_KV_POLL_MS, NodeConfig

    monkeypatch.setenv(ENV_VAR, TEST_SECRET.hex())
    config = dict(router="tcp://127.0.0.1:9", node_id="decode-0", model=model_dir[0], num_blocks=16)
    node = NodeConfig.from_argv("pdserve decode", ["--router", config["router"], "--node-id", "decode-0",
                                                   "--model", model_dir[0], "--num-blocks", "16", "--kv-poll-ms", "7"])
    service = DecodeService(node)
    try:
        assert service.receiver._link._max_poll_s == 0.007
    finally:
        service.close()
    for bad in (0, MAX_KV_POLL_MS + 1):
        with pytest.raises(ValueError, match="kv_poll_ms"):
            NodeConfig(**config, kv_poll_ms=bad)
