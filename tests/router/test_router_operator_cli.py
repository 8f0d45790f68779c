"""`pdserve nodes / drain / remove` (router/operator_cli.py) against a live router: the real app
under uvicorn on a free loopback port, its DisaggregatedBackend serving scripted nodes."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading

import pytest
import trustme
import uvicorn

from router import operator_cli
from router.http.app import create_app
from router.cluster.registry import NodeState
from tests.disagg_harness import Cluster, run, until
from tests.http_server import free_port
from tests.router.test_router_operator import ADMIN, APP_CONFIG


async def live(c: Cluster) -> tuple[uvicorn.Server, asyncio.Task, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(c.backend, APP_CONFIG), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started)
    return server, task, f"http://127.0.0.1:{port}"


async def cli(*argv: str) -> int:
    """Runs the CLI on a thread (it blocks), as an operator's shell would beside the router."""
    return await asyncio.to_thread(operator_cli.main, list(argv))


def test_cli_lists_drains_and_removes_nodes(capsys, monkeypatch, tmp_path):
    """nodes prints one row per node; drain and remove act and say so; the key comes from the
    environment or a file; a wrong key, no key or an unknown node fail with the router's message."""
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN + "\n")
    key_file.chmod(0o600)

    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode"), await c.node("decode-1", "decode")
            server, task, url = await live(c)
            try:
                monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)
                assert await cli("nodes", "--url", url) == 0
                rows = [line.split() for line in capsys.readouterr().out.splitlines()]
                assert [r[:8] + r[9:] for r in rows] == [
                    ["NODE", "ROLE", "STATE", "RUN", "WAIT", "KV%", "FREE", "EPOCH", "ADDRESS"],
                    ["decode-0", "decode", "active", "1", "0", "0", "64", "e1", c.nodes["decode-0"].kv_endpoint],
                    ["decode-1", "decode", "active", "1", "0", "0", "64", "e1", c.nodes["decode-1"].kv_endpoint],
                    ["prefill-0", "prefill", "active", "1", "0", "0", "64", "e1", "-"]]
                assert await cli("drain", "decode-1", "--deadline-s", "30", "--url", url) == 0
                assert capsys.readouterr().out == "decode-1: draining; its requests move in 30 s if not done\n"
                assert c.backend.server.registry.get("decode-1").state is NodeState.DRAINING
                monkeypatch.delenv(operator_cli.ENV_VAR)
                assert await cli("remove", "decode-0", "--url", url, "--admin-key-file", str(key_file)) == 0
                assert capsys.readouterr().out == "decode-0: removed\n"
                assert c.backend.server.info("decode-0") is None
                assert await cli("remove", "decode-9", "--url", url, "--admin-key-file", str(key_file)) == 1
                assert capsys.readouterr().err == "pdserve remove: 404 no node 'decode-9' is registered\n"
                monkeypatch.setenv(operator_cli.ENV_VAR, "wrong")
                assert await cli("nodes", "--url", url) == 1
                assert capsys.readouterr().err == "pdserve nodes: 401 Incorrect API key provided.\n"
                monkeypatch.delenv(operator_cli.ENV_VAR)
                assert await cli("nodes", "--url", url) == 2
            finally:
                server.should_exit = True
                await task
    run(test)


class OneShotListener:
    """A loopback port that accepts connections on a thread, records what each sends first, and
    answers `reply` (or nothing: closes at once)."""

    def __init__(self, reply: bytes = b"", tls: ssl.SSLContext | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self._stop, self._tls = threading.Event(), tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[bytes] = []
        self._reply = reply
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True) if self._tls else conn
                except (ssl.SSLError, OSError):
                    continue            # the client refused our certificate
                self.received.append(conn.recv(1 << 16))
                conn.sendall(self._reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


NODES_REPLY = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{"data": []}'


def test_the_admin_key_goes_nowhere_without_a_router_url(capsys, monkeypatch):
    """With neither --url nor $PDSERVE_ROUTER_URL the CLI stops (status 2) before sending anything:
    the key went to whatever listened on 127.0.0.1:8000 by default."""
    import httpx
    sent = []
    monkeypatch.setattr(httpx, "request", lambda *a, **k: sent.append(a))
    monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)
    monkeypatch.delenv(operator_cli.URL_VAR, raising=False)
    assert operator_cli.main(["nodes"]) == 2
    assert sent == [] and "--url" in capsys.readouterr().err


def test_the_admin_key_goes_to_the_router_url_only_never_to_an_environment_proxy(monkeypatch):
    """$PDSERVE_ROUTER_URL names the router; $HTTP_PROXY and $ALL_PROXY are not followed (the key
    went to the proxy)."""
    router, proxy = OneShotListener(NODES_REPLY), OneShotListener()
    try:
        monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)
        monkeypatch.setenv(operator_cli.URL_VAR, router.url)
        for variable in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(variable, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert operator_cli.main(["nodes"]) == 0
    finally:
        router.close()
        proxy.close()
    assert proxy.received == []
    assert [r.split(b"\r\n")[0] for r in router.received] == [b"GET /admin/nodes HTTP/1.1"]
    assert f"Bearer {ADMIN}".encode() in router.received[0]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_an_admin_key_file_open_to_other_users_is_refused(capsys, monkeypatch, tmp_path, mode):
    """As ssh refuses a private key others may read: a key file with any group or other permission
    bit stops the CLI (status 2, the fix named) before anything is sent; mode 600 is used."""
    router = OneShotListener(NODES_REPLY)
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN + "\n")
    monkeypatch.delenv(operator_cli.ENV_VAR, raising=False)
    try:
        os.chmod(key_file, mode)
        assert operator_cli.main(["nodes", "--url", router.url, "--admin-key-file", str(key_file)]) == 2
        assert "chmod 600" in capsys.readouterr().err and router.received == []
        os.chmod(key_file, 0o600)
        assert operator_cli.main(["nodes", "--url", router.url, "--admin-key-file", str(key_file)]) == 0
    finally:
        router.close()
    assert len(router.received) == 1


def test_an_https_router_is_checked_against_the_cas_named_by_ssl_cert_file(monkeypatch, tmp_path):
    """The environment is otherwise ignored (no proxies, no .netrc), but $SSL_CERT_FILE still names
    the CAs an https:// router's certificate must chain to: a router behind a private CA is reached
    with it (it was refused: httpx reads the variable only with trust_env), and without it the
    certificate is refused before the key is sent."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    router = OneShotListener(NODES_REPLY, tls=server)
    try:
        monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)
        monkeypatch.setenv(operator_cli.URL_VAR, router.url)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        assert operator_cli.main(["nodes"]) == 1
        assert router.received == []
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        assert operator_cli.main(["nodes"]) == 0
    finally:
        router.close()
    assert len(router.received) == 1 and f"Bearer {ADMIN}".encode() in router.received[0]
