"""Prefill and decode nodes of different tensor_parallel_size pair: blocks travel with every kv
head, gathered from P's ranks and spread over D's, and D decodes token for token what
transformers decodes; nothing leaks, no worker outlives its node."""
from __future__ import annotations

import os
import signal
import threading

import pytest

import engine.parallel.runner as parallel_runner
from engine import SamplingParams
from engine.runner_base import RunnerBroken
from pdwire.control import NodeCommand, NodeGoodbye
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


def test_a_decode_worker_that_stops_answering_ends_its_node_with_a_goodbye(model_dir, monkeypatch):
    """decode-0 (tp = 2) whose worker stops answering (SIGSTOP): the step that holds a request
    breaks after --tensor-parallel-timeout-s and the node ends at once, its goodbye saying why
    (the router moves its requests, as for any node that leaves), not failing the request
    itself; every block is accounted for, its worker is killed, and the prefill node serves on."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    path, _ = model_dir
    h = NodeHarness(path, 1, 2, block_size=8, num_blocks=48, tensor_parallel_timeout_s=2.0)
    goodbyes, on = [], h._on
    h._on = lambda node, msg: goodbyes.append((node, msg)) if isinstance(msg, NodeGoodbye) else on(node, msg)
    (pid,) = h.decode.engine.runner.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        h.submit("r0", PROMPTS[2], GREEDY, local=True)
        h.pump(lambda: goodbyes)
        ((node, bye),) = goodbyes
        assert node == "decode-0" and bye.reason.startswith("failed: RunnerBroken: ")
        assert "--tensor-parallel-timeout-s 2" in bye.reason
        h.threads[1].join(HANG_S)
        assert not h.threads[1].is_alive() and [type(e) for e in raised] == [RunnerBroken]
        assert h.decode.engine.runner.worker_exit_codes() == [-signal.SIGKILL]
        assert h.results["r0"].reserved is not None and h.results["r0"].failed is None
        h.decode.engine.check_integrity()
    finally:
        if h.decode.engine.runner.worker_exit_codes() == [None]:
            os.kill(pid, signal.SIGCONT)
        h.send("prefill-0", NodeCommand("leave"))
        h.threads[0].join(HANG_S)
        h.sock.close(linger=0)
        h.guard.stop()
        h.ctx.term()
    assert h.intact == {"prefill-0": True}
