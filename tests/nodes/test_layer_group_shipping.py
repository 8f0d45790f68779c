"""A prefill node shipping the blocks of a prompt's last chunk by layer group during its forward
(--kv-layer-groups), over real ZMQ: the decode node decodes token for token what transformers
decodes, every block arrives once, and nothing leaks or stays pinned (serving's checks)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from kvtransport.base import TransportError
from node_shell.shipper import BlockShipper
from tests.model_factory import hf_greedy
from tests.node_harness import serving, tokens as _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("groups, min_blocks, expected", [
    (2, 1, [([4, 5], 0, 1), ([4, 5], 1, 1), ([0], 0, 1), ([0], 1, 1)]),
    (8, 1, [([4, 5], 0, 1), ([4, 5], 1, 1), ([0], 0, 1), ([0], 1, 1)]),     # more groups than layers: one a layer
    (2, 2, [([4, 5], 0, 1), ([4, 5], 1, 1)]),           # the 5-token prompt's one block: whole after the forward
    (2, 3, []),                                         # the last chunk completes 2 blocks: whole
    (1, 1, []),                                         # whole blocks only
])
def test_last_chunk_by_layer_group_matches_transformers(model_dir, monkeypatch, groups, min_blocks, expected):
    """Chunks of 16 tokens, blocks of 8, 2 layers in 2 groups: a 45-token prompt's first 4 blocks
    go whole after their chunks, its last 2 as layer 0 then layer 1 slices during the last
    forward; a 5-token prompt's one block by layer. A last chunk completing fewer than
    --kv-layer-group-min-blocks blocks ships them whole after its forward. Output equals
    transformers', every block arrives once."""
    _, hf = model_dir
    prompts = [[(i * 37) % 500 + 3 for i in range(45)], [1, 17, 99, 4, 250]]
    with serving(model_dir[0], block_size=8, num_blocks=48, max_num_batched_tokens=16, kv_layer_groups=groups,
                 kv_layer_group_min_blocks=min_blocks) as h:
        sender, sliced = h.prefill.sender, []
        real = sender.send_layers
        monkeypatch.setattr(sender, "send_layers", lambda *a: sliced.append((a[1], a[5], a[6])) or real(*a))
        for i, p in enumerate(prompts):
            h.submit(f"r{i}", p, GREEDY)
            (r,) = h.wait([f"r{i}"])
            assert r.failed is None and _tokens(r) == hf_greedy(hf, p, 12)
        assert sliced == expected
        assert h.decode.receiver.metrics.blocks_written == 6 + 1
        assert h.decode.receiver.metrics.drops == {}


def test_a_failed_layer_send_fails_only_its_request(model_dir, monkeypatch):
    """A send inside the forward fails for one transfer (its decode node stopped draining): that
    request fails (retryable), the prompt computed beside it in the same steps is shipped and
    decoded exactly, and the node serves the next request. Before, the error left the forward and
    the engine failed every request of the step."""
    _, hf = model_dir
    prompts = {"r1": [(i * 37) % 500 + 3 for i in range(40)], "r0": [1, 17, 99, 4, 250]}
    with serving(model_dir[0], block_size=8, num_blocks=48, max_num_batched_tokens=64, kv_layer_groups=2,
                 kv_layer_group_min_blocks=1) as h:
        sender, begun = h.prefill.sender, {}
        real_begin, real_layers = sender.begin, sender.send_layers
        monkeypatch.setattr(sender, "begin", lambda x, ep: begun.setdefault(len(begun), x) and real_begin(x, ep))

        def flaky(xfer_id, *rest):
            if xfer_id == begun.get(1) and rest[4] == 1:         # r0's transfer, its second layer group
                raise TransportError("the decode node stopped draining")
            return real_layers(xfer_id, *rest)
        monkeypatch.setattr(sender, "send_layers", flaky)
        h.submit("r1", prompts["r1"], GREEDY)
        h.submit("r0", prompts["r0"], GREEDY)
        r1, r0 = h.wait(["r1", "r0"])
        assert r0.failed is not None and r0.failed.retryable and "stopped draining" in r0.failed.reason
        assert r1.failed is None and _tokens(r1) == hf_greedy(hf, prompts["r1"], 12)
        h.submit("r2", [3, 4, 5], GREEDY)
        (r2,) = h.wait(["r2"])
        assert r2.failed is None and _tokens(r2) == hf_greedy(hf, [3, 4, 5], 12)


@pytest.mark.parametrize("value", [0, 1 << 21])
def test_layer_group_min_blocks_has_limits(value):
    """--kv-layer-group-min-blocks outside [1, MAX_LAYER_GROUP_MIN_BLOCKS] is refused by NodeConfig,
    and a BlockShipper refuses min_blocks 0 itself (it would slice a shipment with no block left)."""
    from node_shell.config import NodeConfig
    with pytest.raises(ValueError, match="kv_layer_group_min_blocks"):
        NodeConfig(router="tcp://127.0.0.1:1", node_id="p", kv_layer_group_min_blocks=value)
    if value < 1:
        with pytest.raises(ValueError, match="min_blocks must be >= 1"):
            BlockShipper(layer_groups=8, min_blocks=value)
