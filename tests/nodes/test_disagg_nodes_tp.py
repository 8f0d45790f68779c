"""Prefill and decode nodes of different tensor_parallel_size pair: blocks travel with every kv
head, gathered from P's ranks and spread over D's, and D decodes token for token what
transformers decodes; nothing leaks, no worker outlives its node."""
from __future__ import annotations

import pytest

import engine.parallel.runner as parallel_runner
from engine import SamplingParams
from node_shell.identity import kv_identity
from tests.model_factory import hf_greedy
from tests.node_harness import HANG_S, NodeHarness

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# shorter than a block, exactly one block, several blocks and a partial one (block_size 8)
PROMPTS = [[1, 17, 99, 4, 250], list(range(10, 18)), [(i * 37) % 500 + 3 for i in range(29)]]


@pytest.mark.parametrize("prefill_tp, decode_tp, transport", [
    (2, 1, "zmq"), (1, 2, "zmq"), (2, 2, "zmq"), (1, 1, "torch_dist"), (2, 2, "torch_dist")])
def test_nodes_of_any_tp_decode_what_transformers_decodes(model_dir, prefill_tp, decode_tp, transport, monkeypatch):
    """P(tp = a) -> D(tp = b), over ZeroMQ frames or torch.distributed sends (gloo here, NCCL on
    GPUs): both announce the same full-head layout (2 kv heads), every prompt block is shipped
    once (chunked prefill, 7-token steps), greedy output equals transformers'."""
    monkeypatch.setattr(parallel_runner, "SHUTDOWN_TIMEOUT_S", HANG_S)   # a starved worker exits slowly, not killed
    path, hf = model_dir
    h = NodeHarness(path, prefill_tp, decode_tp, block_size=8, num_blocks=48, max_num_batched_tokens=7,
                    kv_transport=transport)
    try:
        layouts = [kv_identity(s.engine, s.config.node_id, "e0").layout for s in (h.prefill, h.decode)]
        assert layouts[0] == layouts[1] and layouts[0].num_kv_heads == 2
        assert type(h.prefill.sender).__name__ == {"zmq": "ZmqSender", "torch_dist": "DistSender"}[transport]
        for i, p in enumerate(PROMPTS):
            h.submit(f"r{i}", p, GREEDY)
        results = h.wait([f"r{i}" for i in range(len(PROMPTS))])
        for p, r in zip(PROMPTS, results):
            assert r.failed is None and r.finish == "length"
            assert [r.tokens[i] for i in sorted(r.tokens)] == hf_greedy(hf, p, 10)
        assert h.decode.receiver.metrics.blocks_written == sum(-(-len(p) // 8) for p in PROMPTS)
        h.idle()
    finally:
        h.close()
    for service, tp in ((h.prefill, prefill_tp), (h.decode, decode_tp)):
        service.engine.check_integrity()
        assert not service.engine.block_manager.num_pins, "a shipped block stayed pinned"
        assert getattr(service.engine.runner, "worker_exit_codes", lambda: [])() == [0] * (tp - 1)
