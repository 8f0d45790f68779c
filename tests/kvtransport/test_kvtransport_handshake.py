"""Pairing: two nodes pair only with equal layouts; the refusal names the field. A layout is
that of a block on the wire, every kv head, whatever a node's tensor_parallel_size."""
import dataclasses

import pytest
import torch

from kvtransport.testing import TEST_SECRET
from pdwire.handshake import (HandshakeError, KVLayout, PeerIdentity, check_compatible,
                                   model_fingerprint, new_epoch)
from kvtransport.payload import InlineSink
from kvtransport.sender_core import SenderCore
from kvtransport.testing import make_pool

CONFIG = {"hidden_size": 512, "num_hidden_layers": 8, "rope_theta": 10000.0}
WEIGHTS = [("model.embed_tokens.weight", (32000, 512)), ("lm_head.weight", (32000, 512))]
LAYOUT = KVLayout(model_fingerprint(CONFIG, WEIGHTS), "float32", 16, 8, 8, 64)


def _peer(layout=LAYOUT, transport="zmq"):
    return PeerIdentity("node", new_epoch(), transport, layout)


def test_fingerprint_ignores_order_and_sees_every_change():
    """The model id ignores key/weight order and changes with any config value or weight shape."""
    base = model_fingerprint(CONFIG, WEIGHTS)
    assert len(base) == 32
    assert model_fingerprint(dict(reversed(list(CONFIG.items()))), WEIGHTS[::-1]) == base
    assert model_fingerprint({**CONFIG, "rope_theta": 500000.0}, WEIGHTS) != base
    assert model_fingerprint(CONFIG, [WEIGHTS[0], ("lm_head.weight", (32001, 512))]) != base
    assert model_fingerprint(CONFIG, [WEIGHTS[0], ("lm_head.bias", (32000, 512))]) != base


def test_equal_layouts_pair():
    """Identical layouts with different epochs pair."""
    check_compatible(_peer(), _peer())


@pytest.mark.parametrize("field, value", [
    ("model_id", "ffff"), ("kv_dtype", "bfloat16"), ("block_size", 32), ("num_layers", 4),
    ("num_kv_heads", 4), ("head_dim", 128), ("pool_layout", "layer-major"), ("protocol_version", 2),
])
def test_mismatch_names_the_field(field, value):
    """A layout mismatch refuses the pairing with an error naming exactly that field."""
    other = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(HandshakeError, match=field) as e:
        check_compatible(_peer(), _peer(other))
    assert e.value.field == field


def test_transport_mismatch_and_self_pairing_refused():
    """A zmq peer never pairs with a torch_dist one, nor a node with its own epoch."""
    with pytest.raises(HandshakeError) as e:
        check_compatible(_peer(), _peer(transport="torch_dist"))
    assert e.value.field == "transport"
    me = _peer()
    with pytest.raises(HandshakeError) as e:
        check_compatible(me, me)
    assert e.value.field == "epoch"


def test_epochs_are_fresh():
    """Each start draws a new epoch, so a restarted node is a new peer."""
    assert len({new_epoch() for _ in range(100)}) == 100


def test_layout_from_pool():
    """KVLayout.for_pool reads [N, L, 2, bs, H, D] and the dtype; block bytes follow."""
    pool = make_pool(num_blocks=3, num_layers=8, block_size=16, num_kv_heads=8, head_dim=64,
                     dtype=torch.bfloat16, seed=None)
    layout = KVLayout.for_pool(pool, LAYOUT.model_id)
    assert (layout.kv_dtype, layout.block_size, layout.num_layers) == ("bfloat16", 16, 8)
    assert layout.block_shape == tuple(pool.shape[1:])
    assert layout.block_nbytes == pool[0].numel() * 2 == 8 * 2 * 16 * 8 * 64 * 2
    with pytest.raises(ValueError):
        KVLayout.for_pool(pool.transpose(0, 1), LAYOUT.model_id)


def test_tp_rank_pool_announces_the_full_head_layout():
    """A pool holding one of tp = 2 ranks' heads announces a tp = 1 pool's layout, so the two
    pair, while a model of other head counts is still refused naming num_kv_heads; the shard's
    own blocks can neither be shipped nor take wire bytes straight in."""
    whole, shard = make_pool(num_kv_heads=4), make_pool(num_kv_heads=2)
    layout = KVLayout.for_pool(shard, LAYOUT.model_id, tensor_parallel_size=2)
    assert layout == KVLayout.for_pool(whole, LAYOUT.model_id) and layout.num_kv_heads == 4
    check_compatible(_peer(layout), _peer(KVLayout.for_pool(whole, LAYOUT.model_id)))
    with pytest.raises(HandshakeError, match="num_kv_heads differs") as e:
        check_compatible(_peer(layout), _peer(KVLayout.for_pool(shard, LAYOUT.model_id)))
    assert e.value.field == "num_kv_heads"
    with pytest.raises(ValueError, match="tensor parallelism"):
        InlineSink(shard, layout)
    with pytest.raises(ValueError, match="every kv head"):
        SenderCore(_peer(layout), TEST_SECRET).block_header("x0", 0, 0, shard)
    assert SenderCore(_peer(layout), TEST_SECRET).block_header("x0", 0, 0, whole).shape == layout.block_shape
