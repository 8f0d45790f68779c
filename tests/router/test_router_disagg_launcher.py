"""`pdserve up`'s flags, node command lines and process cleanup, without starting a model."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdplan.autoscale_config import AutoscaleConfig
from router import launcher, node_processes
from router.config import RouterConfig
from router.launcher import parse_up
from router.node_processes import ClusterConfig, NodeProcess, NodeSpawner, stop_nodes
from tests.node_harness import process_alive


def test_flags_reach_router_cluster_and_nodes():
    """Router and cluster flags build their configs; node flags given (only those) go to the nodes."""
    args = parse_up(["up", "--port", "9000", "--prefill", "2", "--decode", "3", "--model", "/m",
                     "--dtype", "float32", "--max-num-seqs", "4", "--heartbeat-timeout-s", "1.5",
                     "--decode-tp", "2"])
    assert (args.router.port, args.router.heartbeat_timeout_s) == (9000, 1.5)
    assert args.cluster == ClusterConfig(prefill=2, decode=3, prefill_tp=1, decode_tp=2)
    assert args.model == "/m"
    assert args.node_flags == ["--dtype", "float32", "--max-num-seqs", "4"]
    assert parse_up(["up"]) == (RouterConfig(), ClusterConfig(), None, [], AutoscaleConfig())


def test_invalid_flags_are_usage_errors():
    """A negative node count, a tp below 1, a bad router value or a per-node flag (--kv-bind; the
    node's --tensor-parallel-size, which --prefill-tp / --decode-tp set per kind) is a usage error
    (no local node of a kind is allowed: nodes may join from other hosts)."""
    assert parse_up(["up", "--decode", "0"]).cluster.decode == 0
    for argv in (["up", "--decode", "-1"], ["up", "--prefill-tp", "0"], ["up", "--port", "-1"],
                 ["up", "--kv-bind", "tcp://x:1"], ["up", "--tensor-parallel-size", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_up(argv)
        assert exit_info.value.code == 2


def test_node_command_lines(monkeypatch):
    """Each node runs `python -m <role>_node --router EP --node-id <role>-<i>` plus the node flags,
    and `--tensor-parallel-size N` where its kind's tp is above 1; every rank gets an equal share
    of the cores (a tp node its ranks' shares, which its workers split); the cluster secret
    travels in the environment, never in argv."""
    started = []

    class FakePopen:
        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs))
            self.pid = 0

    monkeypatch.setattr(node_processes.subprocess, "Popen", FakePopen)
    cluster = ClusterConfig(prefill=2, decode=1, decode_tp=2)
    nodes = NodeSpawner("tcp://127.0.0.1:5555", cluster, ["--dtype", "float32"], b"\x01" * 32).spawn_pools(cluster)
    assert [(n.node_id, n.role) for n in nodes] == [("prefill-0", "prefill"), ("prefill-1", "prefill"),
                                                    ("decode-0", "decode")]
    for (argv, kwargs), node in zip(started, nodes):
        tp = ["--tensor-parallel-size", "2"] if node.role == "decode" else []
        assert argv[-9 - len(tp):] == [sys.executable, "-m", f"{node.role}_node", "--router", "tcp://127.0.0.1:5555",
                                       "--node-id", node.node_id, "--dtype", "float32", *tp]
        assert kwargs["start_new_session"] is True
        assert kwargs["env"]["PDSERVE_CLUSTER_SECRET"] == "01" * 32
        assert not any("01" * 32 in a for a in argv)
        assert kwargs["env"]["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        per_rank = max(1, (os.cpu_count() or 1) // 4)        # 2 prefill ranks + 2 decode ranks
        expected_threads = str(per_rank * (2 if node.role == "decode" else 1))
        assert kwargs["env"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", expected_threads)


def test_stop_nodes_kills_a_node_that_ignores_sigterm():
    """A node still running after the grace period is killed; stop_nodes returns with none left."""
    process = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); "
                                "print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
                               start_new_session=True)
    process.stdout.readline()
    start = time.monotonic()
    stop_nodes([NodeProcess("decode-0", "decode", process)], grace_s=0.3)
    assert process.poll() is not None and time.monotonic() - start < 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_node_dies_with_its_launcher_even_on_sigkill():
    """A node started through the parent-death shim gets SIGTERM when its launcher dies abruptly."""
    script = ("import os, subprocess, sys; from router.node_processes import with_parent_death_signal; "
              "p = subprocess.Popen(with_parent_death_signal([sys.executable, '-c', 'import time; time.sleep(60)'])); "
              "print(p.pid, flush=True); import time; time.sleep(1.0); os._exit(0)")
    middle = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    node_pid = int(middle.stdout.split()[0])
    deadline = time.monotonic() + 10
    while process_alive(node_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(node_pid)


def test_up_on_a_taken_port_fails_before_anything_loads(monkeypatch, capsys):
    """pdserve up on a taken port: status 1 and one line on stderr; no tokenizer, no node started."""
    import socket

    from router.cluster.disaggregated import DisaggregatedBackend

    def must_not_run(*args, **kwargs):
        raise AssertionError("ran before the port was checked")
    monkeypatch.setattr(DisaggregatedBackend, "from_model", must_not_run)
    monkeypatch.setattr(node_processes, "NodeSpawner", must_not_run)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = launcher.up("/nonexistent", RouterConfig(port=port), ClusterConfig(), [])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith(f"pdserve: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert err.count("\n") == 1


def test_start_up_greeting_logs_no_httpx_line(caplog, capsys):
    """The greeting prints the streamed text; httpx logs no "HTTP Request" line the router seems to send itself."""
    import asyncio
    import dataclasses
    import logging

    from router.http.app import create_app
    from router.http.server import Server, bind_http
    from tests.fake_backend import MODEL, REPLY, FakeBackend

    config = RouterConfig(port=0)
    sock = bind_http(config)
    config = dataclasses.replace(config, port=sock.getsockname()[1])

    async def greet():
        server = Server(create_app(FakeBackend(max_model_len=4096), config), config, log_level="warning")
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        await launcher._first_request(config, MODEL)
        server.should_exit = True
        await serving

    caplog.set_level(logging.INFO)
    asyncio.run(greet())
    assert capsys.readouterr().out == f"pdserve: a first request, ROMEO:\n{REPLY}\n\n"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("httpx")] == []
    assert logging.getLogger("httpx").level == logging.NOTSET
