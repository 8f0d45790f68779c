"""`pdserve ray up` on a three-host Ray cluster on one machine (tests/ray/ray_harness.py): the
router in the driver, each node a Ray actor running a real node process on the host Ray chose.
One cluster and one deployment serve the tests below, in order; each test leaves 0 requests
running and every KV block free."""
from __future__ import annotations

import os
import signal
import threading

import pytest

ray = pytest.importorskip("ray")

from engine.builtin import BUILTIN_MODEL_PATH  # noqa: E402
from tests.ray.ray_harness import HOSTS, Deployment, start_cluster  # noqa: E402

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo", "To be, or not to be"]
MAX_TOKENS = 24
LONG = 120          # tokens of a request that is still streaming when its node dies


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster()
    try:
        ray.init(address=cluster.address, namespace="pdserve", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def expected():
    """The colocated engine's greedy text for each prompt (and the long request's)."""
    from engine import LLM, SamplingParams

    llm = LLM(BUILTIN_MODEL_PATH, dtype="float32")
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (MAX_TOKENS, LONG)]
        texts = {p: llm.generate([p], params[0])[0].outputs[0].text for p in PROMPTS}
        texts["long"] = llm.generate([PROMPTS[0]], params[1])[0].outputs[0].text
        llm.engine.check_integrity()
    finally:
        llm.close()
    return texts


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray_up") / "pdserve.log"
    deployment = Deployment(cluster.address, BUILTIN_MODEL_PATH, log, prefill=1, decode=2,
                            flags=["--admission-timeout-s", "90", "--heartbeat-timeout-s", "10"])
    try:
        deployment.until(lambda: deployment.serving(3), 180, "1 prefill + 2 decode nodes")
        yield deployment
    finally:
        status = deployment.stop()
        print(deployment.log_tail(400))
    assert status == 0


@pytest.fixture
def settled(deployment):
    """After the test: no request runs on any node and every KV block is free (none leaked)."""
    yield
    deployment.until(lambda: all(n["num_running"] == 0 and n["num_free_blocks"] == n["num_blocks"]
                                 for n in deployment.nodes().values()), 30, "every block free")


def _host(node_id: str) -> str:
    return ray.get(ray.get_actor(f"t:{node_id}").info.remote(), timeout=30).host


def _host_once_back(node_id: str) -> str | None:
    """The node's host, or None while Ray is still bringing its actor back (its old address
    refuses, or the call times out)."""
    try:
        return _host(node_id)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError):
        return None


def test_1p2d_on_three_hosts_answers_like_the_colocated_engine(deployment, expected, settled):
    """1 prefill + 2 decode nodes placed by their resources (prefill on the head, decode on the
    decode hosts), each advertising its own host; concurrent HTTP greedy completions equal the
    colocated engine's text."""
    nodes = deployment.nodes()
    assert sorted(nodes) == ["decode-0", "decode-1", "prefill-0"]
    assert _host("prefill-0") == HOSTS["head"]
    for node_id in ("decode-0", "decode-1"):
        host = _host(node_id)
        assert host in (HOSTS["decode-a"], HOSTS["decode-b"])
        assert nodes[node_id]["address"].startswith(f"tcp://{host}:")
    outs: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: outs.__setitem__(p, deployment.complete(p, MAX_TOKENS)))
               for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert outs == {p: expected[p] for p in PROMPTS}


def test_a_killed_node_process_is_restarted_by_ray_and_its_request_completes(deployment, expected, settled):
    """kill -9 of the decode node process serving a streamed request: its actor ends with it, Ray
    restarts the actor (a new node process that rejoins with a new epoch), the router moves the
    request, and the client still gets the colocated engine's text."""
    before = deployment.nodes()
    killed: list[tuple[str, int]] = []

    def kill_its_decode_node(text: str) -> None:
        if killed or not text:
            return
        node_id = next(i for i, n in deployment.nodes().items() if n["role"] == "decode" and n["booked_requests"])
        pid = ray.get(ray.get_actor(f"t:{node_id}").info.remote(), timeout=30).pid
        os.kill(pid, signal.SIGKILL)
        killed.append((node_id, pid))

    assert deployment.complete(PROMPTS[0], LONG, kill_its_decode_node) == expected["long"]
    node_id, pid = killed[0]
    deployment.until(lambda: deployment.nodes().get(node_id, {}).get("epoch") not in (None, before[node_id]["epoch"]),
                     120, f"{node_id} back with a new epoch")
    assert ray.get(ray.get_actor(f"t:{node_id}").info.remote(), timeout=30).pid != pid
    metrics = deployment.admin.get("/metrics").text
    assert f'pdserve_router_node_restarts_total{{node="{node_id}"}} 1.0' in metrics


def test_pools_scale_1p1d_to_2p3d_and_back_under_a_stream_without_a_failed_request(deployment, expected, settled):
    """Under a steady stream of requests: decode 2 -> 1, then 1P+1D -> 2P+3D (with `pdserve ray
    scale`), then back to 1P+1D. New nodes are new actors placed by their resources; the surplus
    drains and its actors end. Every request answers the colocated engine's text."""
    stop, answers, failures = threading.Event(), [], []

    def stream(i: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                answers.append(deployment.complete(prompt, MAX_TOKENS) == expected[prompt])
            except Exception as err:                        # noqa: BLE001 -- counted, asserted below
                failures.append(repr(err))
            i += 1
    streams = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in streams:
        t.start()
    try:
        deployment.scale("decode", 1)
        _until_pools(deployment, prefill=1, decode=1)
        _scale_with_the_cli(deployment, prefill=2, decode=3)
        _until_pools(deployment, prefill=2, decode=3)
        hosts = {i: _host(i) for i, n in deployment.nodes().items()}
        assert {h for i, h in hosts.items() if i.startswith("prefill")} == {HOSTS["head"]}
        assert {h for i, h in hosts.items() if i.startswith("decode")} == {HOSTS["decode-a"], HOSTS["decode-b"]}
        served = len(answers)
        deployment.until(lambda: len(answers) >= served + 4, 120, "requests served by 2P+3D")
        deployment.scale("prefill", 1)
        deployment.scale("decode", 1)
        _until_pools(deployment, prefill=1, decode=1)
    finally:
        stop.set()
        for t in streams:
            t.join(180)
    assert failures == [] and len(answers) >= 8 and all(answers)
    gone = set(hosts) - set(deployment.nodes())
    assert len(gone) == 3
    deployment.until(lambda: not any(_actor_alive(i) for i in gone), 30, "the drained nodes' actors to end")


def test_a_dead_host_s_node_is_rescheduled_on_a_live_host_and_its_request_moves(cluster, deployment, expected,
                                                                                 settled):
    """The host of the one decode node dies (its raylet killed) while a request streams: the node
    goes with it, Ray reschedules its actor on the other decode host, where a new node process
    rejoins, and the request moves there and answers the colocated engine's text."""
    node_id = next(i for i, n in deployment.nodes().items() if n["role"] == "decode")
    host = _host(node_id)
    removed: list[str] = []

    def kill_its_host(text: str) -> None:
        if not removed and text:
            ray_node = next(n for n in cluster.worker_nodes if n.node_ip_address == host)
            cluster.remove_node(ray_node, allow_graceful=False)
            removed.append(host)

    assert deployment.complete(PROMPTS[0], LONG, kill_its_host) == expected["long"]
    assert removed == [host]
    other = ({HOSTS["decode-a"], HOSTS["decode-b"]} - {host}).pop()
    deployment.until(lambda: deployment.serving(2) and _host_once_back(node_id) == other, 120,
                     f"{node_id} rescheduled on {other}")


def _until_pools(deployment: Deployment, prefill: int, decode: int) -> None:
    want = {"prefill": (prefill, prefill, 0, 0), "decode": (decode, decode, 0, 0)}
    deployment.until(lambda: {r: (p["target"], p["active"], p["draining"], p["starting"])
                              for r, p in deployment.pools().items()} == want, 180, f"pools {want}")


def _scale_with_the_cli(deployment: Deployment, prefill: int, decode: int) -> None:
    import subprocess
    import sys

    from tests.ray.ray_harness import ADMIN_KEY, REPO
    argv = [sys.executable, "-m", "router.launcher", "ray", "scale", "--prefill", str(prefill),
            "--decode", str(decode), "--url", deployment.url]
    done = subprocess.run(argv, cwd=REPO, env=dict(os.environ, PDSERVE_ADMIN_KEY=ADMIN_KEY),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _actor_alive(node_id: str) -> bool:
    try:
        ray.get_actor(f"t:{node_id}")
        return True
    except ValueError:
        return False
