"""A node with nothing to step sleeps in the kernel, on the router's socket and its KV transport's at
once (node_shell/runtime.py): a decode node whose reserved blocks are due uses little CPU while
they do not come, and adopts them as soon as they land; no wait of a request depends on the idle
timeout."""
from __future__ import annotations

import os
import time

from engine import SamplingParams
from node_shell import runtime
from pdwire.control import PrefillRequest
from tests.model_factory import hf_greedy
from tests.node_harness import serving, tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [(i * 37) % 500 + 3 for i in range(45)]      # 6 blocks of 8 tokens, the last partial
HOLD_S = 2.0            # how long the prefill request is held back: the decode node waits for its blocks
SPIN_SHARE = 0.1        # a loop that polled without sleeping would use (nearly) all the CPU it gets


def _cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) thread native_id of this process has used (Linux /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime, stime


def test_a_decode_node_waiting_for_its_blocks_sleeps_and_adopts_them_once_sent(model_dir, monkeypatch):
    """A request reserved on the decode node whose prefill is held back 2 s: the decode node's loop
    thread uses under a tenth of that in CPU time (it spun, a whole core, before), the transfer stays
    due, and once the prefill node is told to send, the blocks are adopted and decode what
    transformers decodes."""
    with serving(model_dir[0], block_size=8, num_blocks=48) as h:
        held, send = [], h.send
        monkeypatch.setattr(h, "send", lambda node, msg: held.append(msg) if isinstance(msg, PrefillRequest)
                            else send(node, msg))
        h.submit("r", PROMPT, GREEDY)
        h.pump(lambda: held)                            # reserved: its blocks are due, and none is sent
        decode_loop = h.threads[1].native_id            # NodeHarness serves (prefill, decode) on threads
        cpu, start = _cpu_s(decode_loop), time.monotonic()
        h.pump(lambda: time.monotonic() - start >= HOLD_S)
        used, waited = _cpu_s(decode_loop) - cpu, time.monotonic() - start
        assert h.decode.xfer_rid and not h.results["r"].tokens
        assert used < SPIN_SHARE * waited, f"the waiting decode node used {used:.2f} s of CPU in {waited:.2f} s"
        send("prefill-0", held[0])
        (r,) = h.wait(["r"])
        assert r.failed is None and tokens(r) == hf_greedy(model_dir[1], PROMPT, 12)


def test_every_wait_of_a_request_ends_on_its_socket_not_on_the_idle_timeout(model_dir, monkeypatch):
    """With the idle timeout and the heartbeats an hour away, a disaggregated request still completes,
    token for token: each node's wait ends on the message it waits for (the router's requests, the
    pairing's replies, the blocks and the Commit), never on a timeout."""
    monkeypatch.setattr(runtime, "IDLE_POLL_S", 3600.0)
    with serving(model_dir[0], block_size=8, num_blocks=48, heartbeat_s=3600.0) as h:
        h.submit("r", PROMPT, GREEDY)
        (r,) = h.wait(["r"])
        assert r.failed is None and tokens(r) == hf_greedy(model_dir[1], PROMPT, 12)
        assert h.decode.receiver.metrics.blocks_written == 6
