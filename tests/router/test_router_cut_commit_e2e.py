"""A prefill node whose Commit's send times out after its first token went out (its decode node's
KV queue full), end to end: the real router (DisaggregatedBackend) and real prefill and decode node
services, on threads of this process so that the prefill node's sender can be made to meet that
full queue (tests/nodes/test_prefill_stalled_decode.py does so against a scripted router)."""
from __future__ import annotations

import asyncio
import threading

from kvtransport.base import TransportError
from kvtransport.testing import TEST_SECRET
from node_shell.config import NodeConfig
from node_shell.runtime import run
from decode_node.service import DecodeService
from pdwire.control import RequestFailed
from pdwire.sampling_params import SamplingParams
from prefill_node.service import PrefillService
from router.cluster.disaggregated import DisaggregatedBackend
from router.config import RouterConfig
from tests.model_factory import hf_greedy
from tests.node_harness import HANG_S, secret_file, settled
from tests.router.test_router_disagg_e2e import PROMPTS, _collect

NODE = dict(dtype="float32", device="cpu", block_size=16, num_blocks=64, max_num_seqs=4)


def _cut_next_commit(sender) -> list[str]:
    """The sender's next Commit finds its receiver's queue full: its send times out, as into a
    full queue (TransportError, the receiver lost with it), and so does any later send on that
    connection (a new connection is another queue). Returns the transfers whose Commit was cut."""
    commit, link, cut = sender.commit, sender._link, []

    def cut_commit(xfer_id: str, first_token: int, num_tokens: int) -> None:
        if not cut:
            cut.append(xfer_id)
            full = link._socks[sender._core.endpoint_of(xfer_id)]
            send, send_tracked = link.send, link.send_tracked

            def check(to: str) -> None:
                if link._socks.get(to) is full:
                    raise TransportError(f"{to} not draining: send blocked 2.0s")
            link.send = lambda to, frames: check(to) or send(to, frames)
            link.send_tracked = lambda to, frames: check(to) or send_tracked(to, frames)
        commit(xfer_id, first_token, num_tokens)
    sender.commit = cut_commit
    return cut


async def _idle(nodes) -> None:
    """Both nodes idle and every shipped block unpinned."""
    while not all(settled(n) for n in nodes):
        await asyncio.sleep(0.05)


def test_a_cut_commit_moves_the_request_at_once_with_exact_greedy_output(model_dir):
    """The first request's Commit is cut after P sent its first token: P reports the request
    failed, and the router aborts it at D (which never reports it: it would have held the
    reservation until its lease, 10 minutes here) and runs it again from prompt + the first
    token; the client gets transformers' exact greedy output; both nodes end with every block
    accounted for and none pinned."""
    path, hf_model = model_dir
    prompt, max_tokens = PROMPTS[0], 12

    async def main() -> None:
        backend = DisaggregatedBackend.from_model(path, TEST_SECRET, RouterConfig(local_prefill_tokens=0))
        endpoint = await backend.start()
        common = dict(router=endpoint, model=path, cluster_secret_file=secret_file(), **NODE)
        prefill = await asyncio.to_thread(PrefillService, NodeConfig(node_id="prefill-0", **common))
        decode = await asyncio.to_thread(DecodeService, NodeConfig(node_id="decode-0", lease_s=600.0, **common))
        cut = _cut_next_commit(prefill.sender)
        heard, on_message = [], backend.on_request_message
        backend.on_request_message = lambda node_id, msg: (heard.append((node_id, msg)), on_message(node_id, msg))[1]
        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in (prefill, decode)]
        for t in threads:
            t.start()
        try:
            while not backend.is_healthy():
                await asyncio.sleep(0.05)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out = await asyncio.wait_for(_collect(backend, "r", prompt, params), HANG_S)
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, max_tokens)
            assert len(cut) == 1
            failed = [(n, m.rid) for n, m in heard if isinstance(m, RequestFailed)]
            assert failed == [("prefill-0", "r")]           # D was aborted: it never failed r itself
            moved = [(s.labels, s.value) for m in backend.collectors()[1].collect() for s in m.samples
                     if s.name.endswith("_total")]
            assert moved == [({"cause": "node_failure", "how": "reprefill"}, 1.0)]
            await asyncio.wait_for(_idle((prefill, decode)), HANG_S)
        finally:
            for n in (prefill, decode):
                n.link.leave = True
            for t in threads:
                await asyncio.to_thread(t.join, HANG_S)
            backend.close()
        for n in (prefill, decode):
            n.engine.check_integrity()
            assert not n.engine.block_manager.num_pins, "a shipped block stayed pinned"
    asyncio.run(main())
