"""The disaggregated router with real prefill and decode node processes on CPU (`pdserve up` itself:
test_router_pdserve_up.py)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pdwire.messages import Reserved
from pdwire.sampling_params import SamplingParams
from router.config import RouterConfig
from router.cluster.disaggregated import DisaggregatedBackend
from router.node_processes import ClusterConfig, NodeSpawner, stop_nodes
from tests.deltas import Accumulator
from tests.model_factory import hf_greedy
from kvtransport.secret import write_secret
from kvtransport.testing import TEST_SECRET

# heartbeats every 0.1 s (default 0.5): what the tests wait for in them (transfer counters, every
# block free) reaches the router sooner
NODE_FLAGS = ["--dtype", "float32", "--num-blocks", "96", "--max-num-seqs", "8", "--block-size", "16",
              "--heartbeat-s", "0.1"]
PROMPTS = [[1, 17, 33, 2, 250, 9, 9, 100, 41, 7, 7, 7, 300, 12, 13, 14, 15, 16, 200], [1, 5, 6], [3] * 40]


async def _registered(backend: DisaggregatedBackend, nodes, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(backend.server.info(n.node_id) is None for n in nodes):
        assert all(n.process.poll() is None for n in nodes), "a node process exited"
        assert time.monotonic() < deadline, "nodes did not register"
        await asyncio.sleep(0.1)


async def _collect(backend: DisaggregatedBackend, rid: str, prompt, params: SamplingParams, on_output=None):
    """The request's whole output, summed from its deltas; on_output sees the whole so far."""
    final, whole = None, Accumulator()
    async for delta in backend.generate(rid, prompt, params):
        final = whole.add(delta)
        if on_output is not None:
            on_output(final)
    return final


def _with_cluster(model_path: str, config: RouterConfig, cluster: ClusterConfig, test,
                  flags: list[str] = ()) -> None:
    async def main():
        backend = DisaggregatedBackend.from_model(model_path, TEST_SECRET, config)
        nodes = []
        try:
            spawner = NodeSpawner(await backend.start(), cluster, ["--model", model_path, *NODE_FLAGS, *flags],
                                  TEST_SECRET)
            nodes = spawner.spawn_pools(cluster)
            await _registered(backend, nodes)
            await asyncio.wait_for(test(backend, nodes), 120)
        finally:
            backend.close()
            stop_nodes(nodes)
    asyncio.run(main())


@pytest.mark.parametrize("transport", ["zmq", "torch_dist"])
def test_greedy_output_over_real_nodes_equals_transformers(model_dir, transport):
    """Concurrent greedy requests through a real prefill and decode node equal transformers'
    greedy, with block payloads over ZeroMQ or over torch.distributed (gloo)."""
    path, hf_model = model_dir

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = await asyncio.gather(*(_collect(backend, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))
        for prompt, out in zip(PROMPTS, outs):
            assert out.finished and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
        n2 = await _collect(backend, "n2", PROMPTS[0], SamplingParams(n=2, seed=3, max_tokens=5, ignore_eos=True))
        assert [len(c.token_ids) for c in n2.outputs] == [5, 5]
        assert [n.inflight_requests for n in backend.server.registry.nodes()] == [0, 0]
        await _transfer_counters_agree(backend)
        assert _prefills(backend) == {"remote": 5}
    _with_cluster(path, RouterConfig(local_prefill_tokens=0), ClusterConfig(1, 1), test, ["--kv-transport", transport])


async def _transfer_counters_agree(backend: DisaggregatedBackend, timeout: float = 10.0) -> None:
    """The nodes' heartbeats carry their KV transfer counters: what P sent, D received, and both
    count the same committed transfers (one per prompt and choice: 3 + 2 here); nothing failed or
    was dropped."""
    from pdwire.control import KV_COUNTERS
    deadline = time.monotonic() + timeout
    while True:
        kv = {m.role: dict(zip(KV_COUNTERS, m.kv)) for m in backend.metrics()}
        p, d = kv.get("prefill", {}), kv.get("decode", {})
        if p.get("kv_transfers_done") == 5 and d.get("kv_transfers_done") == 5:
            break
        assert time.monotonic() < deadline, f"counters never settled: {kv}"
        await asyncio.sleep(0.1)
    assert p["kv_bytes_sent"] == d["kv_bytes_received"] > 0
    assert p["kv_blocks_sent"] == d["kv_blocks_received"] > 0
    assert p["kv_transfers_failed"] == d["kv_transfers_failed"] == d["kv_frames_dropped"] == 0


def test_prefill_node_of_tp2_serves_a_decode_node_of_tp1(model_dir):
    """`--prefill-tp 2 --decode-tp 1`: the prefill node process runs one tp worker, the decode
    node none; blocks gathered from P's two ranks decode on D to transformers' greedy output."""
    path, hf_model = model_dir

    async def test(backend, nodes):
        assert [len(_children(n.process.pid)) for n in nodes] == [1, 0]       # prefill-0, decode-0
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = await asyncio.gather(*(_collect(backend, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    _with_cluster(path, RouterConfig(local_prefill_tokens=0), ClusterConfig(1, 1, prefill_tp=2, decode_tp=1), test)


def test_decode_node_frozen_mid_stream_is_migrated_with_identical_greedy_output(model_dir):
    """A decode node that stops (SIGSTOP, no heartbeats) mid-request: the router migrates the
    request to the other decode node and the client still gets transformers' exact greedy output.

    The node is stopped as its reservation reaches the router (before P ships the prompt's blocks)
    and never continued: the client has P's first token and the node none of the rest, whatever the
    machine's load (free, a node decodes the 160 tokens before a descheduled router sees one)."""
    path, hf_model = model_dir
    prompt, max_tokens = PROMPTS[0], 160

    async def test(backend, nodes):
        await _prefill_node_paired_with_both_decode_nodes(backend)
        held, losses = _hold_decode_node_at_reservation(backend, nodes, "m"), []
        lost = backend.on_node_lost
        backend.on_node_lost = lambda node_id, loss: (losses.append(node_id), lost(node_id, loss))

        def first_token_before_the_loss(output) -> None:
            if output.outputs[0].token_ids and not held[1:]:   # P's first token; D holds the rest
                assert backend.placement("m")[0][1] == held[0] and not output.finished and not losses
                held.append("first token")

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = await _collect(backend, "m", prompt, params, first_token_before_the_loss)
        next(n.process for n in nodes if n.node_id == held[0]).kill()     # stopped for good
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, max_tokens)
        assert losses == held[:1]
        moved = [(s.labels, s.value) for m in backend.collectors()[1].collect() for s in m.samples
                 if s.name.endswith("_total")]
        assert moved == [({"cause": "heartbeat", "how": "reprefill"}, 1.0)]
        assert _prefills(backend) == {"remote": 4}  # two warm-ups, then both attempts through P
    # 5 s without heartbeats: P's first token (asserted) comes first on a loaded machine too
    _with_cluster(path, RouterConfig(heartbeat_timeout_s=5.0, local_prefill_tokens=0), ClusterConfig(1, 2), test)


def _prefills(backend: DisaggregatedBackend) -> dict[str, float]:
    """pdserve_router_prefills_total by where the prompts were computed."""
    return {s.labels["where"]: s.value for c in backend.collectors() for m in c.collect() for s in m.samples
            if s.name == "pdserve_router_prefills_total"}


def test_decode_node_stopped_mid_stream_says_goodbye_and_its_request_moves_at_once(model_dir):
    """SIGTERM to the decode node serving a request: the node's goodbye reaches the router, which
    moves the request at once (the issue's bar is 1 s; the heartbeat timeout here is 60 s and never
    comes into it), and the client still gets transformers' exact greedy output.

    The node is held (SIGSTOP) from its reservation to the SIGTERM, so it still has the request
    then, whatever the machine's load: free, it decodes the 120 tokens in ~0.1 s, and a router that
    saw the first token late (descheduled) stopped an idle node, whose goodbye raced the end of a
    request that never moved."""
    path, hf_model = model_dir
    prompt, max_tokens = PROMPTS[0], 120

    async def test(backend, nodes):
        await _prefill_node_paired_with_both_decode_nodes(backend)
        processes = {n.node_id: n.process for n in nodes}
        held, stopped, losses = _hold_decode_node_at_reservation(backend, nodes, "g"), [], []
        lost = backend.on_node_lost
        backend.on_node_lost = lambda node_id, loss: (losses.append((node_id, str(loss), time.monotonic())),
                                                      lost(node_id, loss))

        def stop_decode_node(output) -> None:
            if not stopped and output.outputs[0].token_ids:     # P's first token; D holds the rest
                decode_id = backend.placement("g")[0][1]
                assert decode_id == held[0] and not output.finished
                processes[decode_id].send_signal(signal.SIGTERM)    # pending until it runs again
                processes[decode_id].send_signal(signal.SIGCONT)
                stopped.append((decode_id, time.monotonic()))

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = await _collect(backend, "g", prompt, params, stop_decode_node)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, max_tokens)
        assert losses[0][:2] == (stopped[0][0], "said goodbye (SIGTERM)")
        moved = [(s.labels, s.value) for m in backend.collectors()[1].collect() for s in m.samples
                 if s.name.endswith("_total")]
        assert moved == [({"cause": "goodbye", "how": "reprefill"}, 1.0)]
        print(f"goodbye reached the router {losses[0][2] - stopped[0][1]:.3f} s after SIGTERM")
        assert losses[0][2] - stopped[0][1] < 2.0          # the bar is 1 s; twice that on a loaded machine
    _with_cluster(path, RouterConfig(heartbeat_timeout_s=60.0, local_prefill_tokens=0), ClusterConfig(1, 2), test)


def _hold_decode_node_at_reservation(backend: DisaggregatedBackend, nodes, rid: str) -> list[str]:
    """Stops (SIGSTOP) the decode node whose Reserved for rid reaches the router: before P is asked
    for the prompt's blocks, so it has decoded nothing. Returns the list its node id is put in."""
    processes, held, heard = {n.node_id: n.process for n in nodes}, [], backend.on_request_message

    def hold(node_id: str, msg) -> bool:
        if isinstance(msg, Reserved) and msg.rid == rid and not held:
            processes[node_id].send_signal(signal.SIGSTOP)
            held.append(node_id)
        return heard(node_id, msg)
    backend.on_request_message = hold
    return held


async def _prefill_node_paired_with_both_decode_nodes(backend: DisaggregatedBackend, timeout: float = 10.0) -> None:
    """Two requests at once, one on each decode node (a burst spreads): the prefill node has paired
    with both (a pairing needs the decode node to answer, so one held later must be paired before)."""
    from pdwire.control import KV_COUNTERS
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    await asyncio.gather(*(_collect(backend, f"w{i}", p, params) for i, p in enumerate(PROMPTS[1:])))
    deadline = time.monotonic() + timeout
    while sorted(m.node_id for m in backend.metrics()
                 if m.role == "decode" and dict(zip(KV_COUNTERS, m.kv)).get("kv_transfers_done")) != \
            ["decode-0", "decode-1"]:
        assert time.monotonic() < deadline, "the warm-up requests did not reach both decode nodes"
        await asyncio.sleep(0.1)


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "pdserve exited early"
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("pdserve did not become healthy")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_nodes_started_by_hand_on_other_hosts_join_a_router_alone(model_dir, tmp_path):
    """`pdserve prefill` and `pdserve decode` started by hand, as on other hosts (127.0.0.2 for the
    router, 127.0.0.3 for the decode node's KV receiver), join the router with the cluster secret
    from a 0600 file; the decode node advertises the address it bound, and greedy output over
    the pair equals transformers'."""
    path, hf_model = model_dir
    secret_file = tmp_path / "secret"
    write_secret(str(secret_file), TEST_SECRET)

    async def main():
        backend = DisaggregatedBackend.from_model(path, TEST_SECRET, RouterConfig(control_endpoint="tcp://127.0.0.2:0"))
        endpoint, procs = await backend.start(), []
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_SECRET"}
        common = ["--router", endpoint, "--model", path, *NODE_FLAGS, "--cluster-secret-file", str(secret_file)]
        try:
            for role, extra in (("prefill", []), ("decode", ["--kv-bind", "tcp://127.0.0.3:0"])):
                procs.append(subprocess.Popen([sys.executable, "-m", "router.launcher", role, "--node-id", f"{role}-0",
                                               *common, *extra], env=env, start_new_session=True))
            deadline = time.monotonic() + 120
            while backend.server.info("prefill-0") is None or backend.server.info("decode-0") is None:
                assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert backend.server.info("decode-0").hello.kv_endpoint.startswith("tcp://127.0.0.3:")
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            out = await _collect(backend, "h", PROMPTS[1], params)
            assert out.outputs[0].token_ids == hf_greedy(hf_model, PROMPTS[1], 12)
        finally:
            backend.close()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                assert proc.wait(30) == 0
    asyncio.run(main())


def test_a_decode_node_bound_to_a_wildcard_address_must_advertise_one():
    """A decode node bound to 0.0.0.0 without --kv-advertise-host refuses its config (it would
    announce an address other hosts resolve to themselves); with one it announces that host; a
    torch_dist node's process-group address must be a concrete one too."""
    from node_shell.config import NodeConfig
    with pytest.raises(ValueError, match="kv-advertise-host"):
        NodeConfig(router="tcp://127.0.0.1:1", node_id="d", kv_bind="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="kv-advertise-host"):
        NodeConfig(router="tcp://127.0.0.1:1", node_id="d", kv_bind="tcp://0.0.0.0:0", kv_advertise_host="::")
    config = NodeConfig(router="tcp://127.0.0.1:1", node_id="d", kv_bind="tcp://0.0.0.0:0", kv_advertise_host="127.0.0.3")
    assert config.kv_advertised("tcp://0.0.0.0:5601") == "tcp://127.0.0.3:5601"
    with pytest.raises(ValueError, match="p2p-host"):        # torch_dist's rendezvous is announced as bound
        NodeConfig(router="tcp://127.0.0.1:1", node_id="d", kv_transport="torch_dist", p2p_host="0.0.0.0")
