"""The node network trusts no local process: a hostile one with ZMQ sockets cannot register, take
over a node id, read prompts or commands, or make the router send what a node cannot read; a node
whose session is lost registers again with a new epoch, and no send of a node ever blocks."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq

from node_shell.router_link import RouterLink
from pdwire.sampling_params import SamplingParams
from pdwire import control
from pdwire.control import DecodeRequest, NodeCommand, NodeGoodbye, NodeHello, NodeStatus, TokenDelta
from kvtransport.secret import ENV_VAR, SecretError, load_secret, write_secret
from kvtransport.session import AuthKind, auth_frame, parse_auth_frame
from kvtransport.testing import TEST_SECRET
from kvtransport.zmtp_auth import ThreadGuard, plain_client
from router.cluster.control_server import _YIELD_EVERY
from router.cluster.registry import NodeRole
from tests.control_peer import NodeEnd, RouterEnd
from tests.disagg_harness import HANG_S, Cluster, admit, counter, run, serve_two_tokens, until, view


def _hostile(c: Cluster) -> zmq.asyncio.Socket:
    sock = c.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(c.backend.control_endpoint)
    return sock


async def _received(sock, wait: float = 0.3) -> list[list[bytes]]:
    """Every message sock gets within `wait` seconds."""
    got, deadline = [], asyncio.get_running_loop().time() + wait
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        if await sock.poll(int(left * 1000)):
            got.append(await sock.recv_multipart())
    return got


def test_a_process_without_the_secret_cannot_register_or_read_prompts():
    """Hellos, statuses and answers without the secret (plain, or sealed with another secret) are
    dropped unread: no node registers, no prompt reaches the intruder, the real pair serves the
    request untouched, and the intruder hears nothing but a random challenge or a RESET."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            plain, wrong = _hostile(c), _hostile(c)
            hello = NodeHello("prefill-9", "e9", "prefill", "", 64, 4, 256)
            plain.send(control.encode(hello))
            plain.send_multipart([control.encode(hello), b"t" * 40])
            spy = NodeEnd(secret=b"w" * 32)
            wrong.send_multipart(spy.hello())
            spy.receive((await _received(wrong))[0])                    # a challenge: any key gets one
            wrong.send_multipart(spy.seal(hello))
            wrong.send_multipart(spy.seal(NodeStatus("prefill-9", "e9", 0, 0, 0.0, 0.0, 0, 64)))
            out = c.generate(max_tokens=1)
            await admit(d, p)
            p.send(control.FirstToken("r1", 11, "a", None, "length"))
            assert view(await out.next()) == ([([11], "a", "length")], True)
            assert sorted(n.node_id for n in c.backend.server.registry.nodes()) == ["decode-0", "prefill-0"]
            assert await _received(plain) == [[auth_frame(AuthKind.RESET)]]
            assert await _received(wrong) == []                       # after its challenge: nothing
            dropped = c.backend.server.dropped
            assert {r: counter(dropped, {"reason": r}) for r in ("malformed", "not_authenticated", "bad_mac")} == \
                {"malformed": 1, "not_authenticated": 1, "bad_mac": 2}
            for sock in (plain, wrong):
                sock.close(0)
    run(test)


def test_a_forged_hello_cannot_take_over_a_live_node():
    """A hello naming decode-0 with a new epoch, sent without the secret, leaves decode-0 registered
    on its own connection and serving (the finding: one 60-byte hello removed it for good)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            thief = _hostile(c)
            for frames in ([control.encode(NodeHello("decode-0", "stolen", "decode", "tcp://127.0.0.1:1", 64, 4, 256))],
                           NodeEnd(secret=b"x" * 32).hello()):
                thief.send_multipart(frames)
            await asyncio.sleep(0.2)
            assert c.backend.server.info("decode-0").hello.epoch == d.epoch
            await serve_two_tokens(c, p, d)
            thief.close(0)
    run(test)


def test_a_flood_of_hellos_and_garbage_without_the_secret_neither_stalls_the_router_nor_is_answered():
    """20,000 hellos on one connection and 20,000 sealed-looking frames on another, without the
    secret, get one challenge and one RESET, never hold the router's event loop for more than a
    turn of its receive loop (_YIELD_EVERY messages), and the real nodes stay registered (the
    finding: 50,000 hellos froze the loop for 7 s, nodes were lost). Counted, not timed: a task
    that yields every loop turn sees at most two receive-loop turns' worth of drops between two
    of its own turns (thousands, were the loop held until the queue ran dry)."""
    def flood(socks) -> None:              # in a thread: the scripted nodes keep beating
        for k in range(20_000):
            socks[0].send(auth_frame(AuthKind.HELLO, k.to_bytes(16, "little")))
            socks[1].send_multipart([b"x" * 10, b"t" * 40])

    def answers(sock) -> list[list[bytes]]:
        """What sock was sent: the first message waited for (bounding a hang), then any within 0.3 s."""
        got, wait_ms = [], int(HANG_S * 1000)
        while sock.poll(wait_ms):
            got.append(sock.recv_multipart())
            wait_ms = 300
        return got

    async def test():
        async with Cluster() as c:
            await c.pair()
            server = c.backend.server
            # the first hello's handshake stays pending however long a starved machine takes over the
            # flood (past its 10 s TTL a hello is rightly challenged again)
            server._auth._clock = lambda: 0.0
            drops = lambda: counter(server.dropped, {"reason": "not_authenticated"})    # noqa: E731
            turns: list[float] = []

            async def tick():
                while True:
                    turns.append(drops())
                    await asyncio.sleep(0)
            ticker = asyncio.create_task(tick())
            ctx = zmq.Context()
            plain_client(ctx, TEST_SECRET)     # past ZMTP PLAIN: the flood aims at the session layer
            socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(c.backend.control_endpoint)
            await asyncio.to_thread(flood, socks)
            await until(lambda: drops() == 20_000, 2 * HANG_S)
            ticker.cancel()
            hellos, garbage = [await asyncio.to_thread(answers, sock) for sock in socks]
            ctx.destroy(0)
            assert [parse_auth_frame(m)[0] for m in hellos] == [AuthKind.CHALLENGE]
            assert garbage == [[auth_frame(AuthKind.RESET)]]
            most = max(b - a for a, b in zip(turns, turns[1:]))
            assert most <= 2 * _YIELD_EVERY, f"{most} drops between two turns of the loop"
            assert sorted(n.node_id for n in server.registry.nodes()) == ["decode-0", "prefill-0"]
    run(test)


def test_a_request_too_big_for_the_control_plane_is_refused_before_it_is_sent():
    """A request whose PrefillRequest would be over the nodes' control-message limit is a
    ValueError (an HTTP 400) up front, and no node is sent anything (the finding: such a message
    wedged a decode node for good)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            stops = tuple(f"{i:05d}" + "x" * 1019 for i in range(17_000))    # ~17 MiB of stop strings
            with pytest.raises(ValueError, match="node network"):
                await c.backend.generate("big", [5, 6, 7], SamplingParams(max_tokens=4, stop=stops)).__anext__()
            await d.assert_silent()
            await p.assert_silent()
    run(test)


def test_a_node_whose_session_is_lost_registers_again_with_a_new_epoch():
    """When the router no longer knows a node's session (it restarted, say), the node's next
    heartbeat is answered RESET, and the node handshakes again and registers with a new epoch;
    its work is dropped (on_reset) for the router to run elsewhere."""
    async def test():
        async with Cluster() as c:
            resets, stop = [], threading.Event()
            link = RouterLink(c.backend.control_endpoint, TEST_SECRET, _hello, _status, heartbeat_s=0.05,
                              on_reset=lambda: resets.append(True))
            loop = threading.Thread(target=lambda: [link.poll(0.01) for _ in iter(stop.is_set, True)])
            loop.start()
            try:
                await until(lambda: c.backend.server.info("decode-7") is not None)
                first = link.epoch
                peer = c.backend.server.info("decode-7").peer
                c.backend.server._auth.forget(peer)                        # as a restarted router would
                await until(lambda: (i := c.backend.server.info("decode-7")) is not None and i.hello.epoch != first)
                assert resets == [True] and link.resets == 1 and link.epoch != first
                assert c.backend.server.count(NodeRole.DECODE) == 1
            finally:
                stop.set()
                loop.join(5)
                link.close()
    run(test)


def test_a_control_message_sealed_on_one_connection_is_refused_on_another_with_its_routing_id():
    """A node's connection A registers and seals a goodbye it never sends; after A closes,
    connection B with A's routing id and the right PLAIN password sends that goodbye: dropped
    (not_authenticated), answered RESET, the node stays registered. B then opens a session of its
    own, and its hello registers the node on B (a reconnect is served)."""
    async def test():
        async with Cluster() as c:
            server, rid = c.backend.server, b"decode-7/" + os.urandom(8).hex().encode()
            a, end = await _session(c, rid)
            a.send_multipart(end.seal(_hello("e1")))
            await until(lambda: server.info("decode-7") is not None)
            first, goodbye = server.info("decode-7").peer, end.seal(NodeGoodbye("decode-7", "e1", "bye"))
            await _close(server, a, rid)
            b = await _take_over(c, rid)
            b.send_multipart(goodbye)
            assert [parse_auth_frame(f) for f in await _received(b)] == [(AuthKind.RESET, b"")]
            assert counter(server.dropped, {"reason": "not_authenticated"}) == 1
            assert server.info("decode-7").peer == first and counter(server.membership.goodbyes) == 0
            await _close(server, b, rid)
            b, end = await _session(c, rid)
            b.send_multipart(end.seal(_hello("e1")))
            assert end.receive(await asyncio.wait_for(b.recv_multipart(), 5)) == NodeCommand("ok")
            assert server.info("decode-7").peer not in (None, first) and server.count(NodeRole.DECODE) == 1
    run(test)


def _node_socket(c: Cluster, rid: bytes) -> zmq.asyncio.Socket:
    sock = c.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.connect(c.backend.control_endpoint)
    return sock


async def _take_over(c: Cluster, rid: bytes) -> zmq.asyncio.Socket:
    """A new connection with routing id rid, once the router's ROUTER routes rid to it: a send to
    rid succeeds under ROUTER_MANDATORY (set for the wait), and the connection reads that empty
    probe. libzmq ignores a new connection whose routing id is still registered, even to a pipe
    that is closing (EHOSTUNREACH already), so a connection ignored for 1 s is replaced."""
    server = c.backend.server
    server._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        for _ in range(10):
            sock = _node_socket(c, rid)
            for _ in range(200):
                try:
                    await server._sock.send_multipart([rid, b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    await asyncio.sleep(0.005)
                    continue
                assert await asyncio.wait_for(sock.recv_multipart(), 5) == [b""]
                return sock
            sock.close()
        raise AssertionError("no new connection took the routing id")
    finally:
        server._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)


async def _session(c: Cluster, rid: bytes) -> tuple[zmq.asyncio.Socket, NodeEnd]:
    """A new connection with routing id rid and an open session on it."""
    sock, end = await _take_over(c, rid), NodeEnd()
    sock.send_multipart(end.hello())
    end.receive(await asyncio.wait_for(sock.recv_multipart(), 5))
    assert end.session is not None
    return sock, end


async def _close(server, sock: zmq.asyncio.Socket, rid: bytes) -> None:
    """Close sock and wait until the router's ROUTER let its routing id go (a send to it fails
    under ROUTER_MANDATORY, set for the wait). Until then libzmq ignores a new connection with it."""
    sock.close()
    server._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        for _ in range(1000):
            try:
                await server._sock.send_multipart([rid, b""], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    return
            await asyncio.sleep(0.005)
        raise AssertionError("the router kept the closed connection's routing id")
    finally:
        server._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)


def _hello(epoch: str) -> NodeHello:
    return NodeHello("decode-7", epoch, "decode", "tcp://127.0.0.1:9", 64, 4, 256)


def _status(epoch: str) -> NodeStatus:
    return NodeStatus("decode-7", epoch, 0, 0, 0.0, 0.0, 0, 64)


def test_a_node_never_blocks_on_a_router_that_stopped_reading():
    """Sends to a router that completed the handshake and then stopped reading return at once;
    when the queue is full the link starts a new session instead of blocking (the finding: the
    node hung in send forever, deaf to SIGTERM)."""
    ctx = zmq.Context()
    guard = ThreadGuard(ctx, TEST_SECRET)
    guard.start()
    router = ctx.socket(zmq.ROUTER)
    guard.protect(router, recv_hwm=1)
    router.setsockopt(zmq.RCVBUF, 4096)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    end = RouterEnd()
    link = RouterLink(f"tcp://127.0.0.1:{port}", TEST_SECRET, _hello, _status, heartbeat_s=60, send_hwm=4)
    try:
        for frames in end.receive(router.recv_multipart())[0]:              # the hello: challenge it
            router.send_multipart(frames)
        deadline = time.monotonic() + 5
        while not link.connected and time.monotonic() < deadline:
            link.poll(0.01)
        assert link.connected
        big = TokenDelta("r", 0, (1,), 0, "x" * 500_000, None, "")
        start = time.monotonic()
        for _ in range(200):                                                # nobody reads the router
            link.send(big)
        assert time.monotonic() - start < 5.0 and link.resets == 1 and not link.connected
    finally:
        link.close()
        router.close(0)
        guard.stop()
        ctx.term()


def test_a_node_refuses_to_start_without_the_secret(tmp_path):
    """`python -m decode_node` with no secret exits at once with a message that says how to give
    one, before it loads a model; a secret file others can read is refused too."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    argv = [sys.executable, "-m", "decode_node", "--router", "tcp://127.0.0.1:9", "--node-id", "d"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and ENV_VAR in done.stderr and "Traceback" not in done.stderr
    loose = tmp_path / "secret"
    loose.write_text("a" * 64)
    loose.chmod(0o644)
    with pytest.raises(SecretError, match="readable by others"):
        load_secret(str(loose))
    private = tmp_path / "private"
    write_secret(str(private), TEST_SECRET)
    assert load_secret(str(private)) == TEST_SECRET and (private.stat().st_mode & 0o777) == 0o600


def test_transfer_ids_are_unguessable_and_bound_to_the_prompt_length(harness_free_decode):
    """A decode node's reservations carry random 128-bit transfer ids, name the one prefill node
    the router chose, and accept only a Commit of the prompt's exact length."""
    res = harness_free_decode
    assert len(res.xfer_id) == 32 and int(res.xfer_id, 16) >= 0
    assert res.sender_node_id == "prefill-0" and res.num_tokens == 3


@pytest.fixture
def harness_free_decode(monkeypatch, model_dir, tmp_path):
    """The Reservation a real DecodeService registers for a 3-token prompt (no router needed)."""
    from decode_node.service import DecodeService
    from node_shell.config import NodeConfig

    monkeypatch.setenv(ENV_VAR, TEST_SECRET.hex())
    service = DecodeService(NodeConfig(router="tcp://127.0.0.1:9", node_id="decode-0", model=model_dir[0],
                                       num_blocks=16, router_timeout_s=60))
    seen = []
    monkeypatch.setattr(service.receiver, "register", seen.append)
    try:
        service._reserve(DecodeRequest("r", (5, 6, 7), SamplingParams(max_tokens=2), "prefill-0"))
        yield seen[0]
    finally:
        service.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_secret_file_owned_by_another_user_is_refused(tmp_path):
    """A 0600 secret file that another user owns is refused: its owner can read (or set) the secret
    (the finding: a root operator's --cluster-secret-file that a local user had created was used)."""
    planted = tmp_path / "secret"
    write_secret(str(planted), TEST_SECRET)
    os.chown(planted, 65534, -1)
    with pytest.raises(SecretError, match="owned by uid 65534"):
        load_secret(str(planted))


def test_a_decode_node_bounds_what_one_prefill_connection_may_queue(monkeypatch, model_dir):
    """What one authenticated connection gets queued on a decode node that does not poll, measured
    (tests/kvtransport/queue_probe): --kv-recv-queue-mib of the messages a peer may send, single
    blocks where payloads come split (the default), else batches of the 2 MiB a receiver that does
    not split announces (--no-kv-split-payloads: 8 / 2 = 4 of them, not the one of 8 / 16, and the
    HelloAck leaves the split off); 0 is refused."""
    from decode_node.service import DecodeService
    from node_shell.config import NodeConfig
    from tests.kvtransport.queue_probe import in_flight, queued_bytes, small_kernel_buffers

    small_kernel_buffers(monkeypatch)
    monkeypatch.setenv(ENV_VAR, TEST_SECRET.hex())
    config = dict(router="tcp://127.0.0.1:9", node_id="decode-0", model=model_dir[0], num_blocks=16)
    argv = ["--router", config["router"], "--node-id", "decode-0", "--model", model_dir[0], "--num-blocks", "16",
            "--kv-batch-mib", "16", "--kv-recv-queue-mib", "8"]
    for flag, split in [([], True), (["--no-kv-split-payloads"], False)]:
        node = NodeConfig.from_argv("pdserve decode", argv + flag)
        assert node.kv_split_payloads is split
        service = DecodeService(node)
        try:
            block = service.receiver._core.identity.layout.block_nbytes
            assert service.receiver._core._split is split
            message = block if split else 2 << 20
            got = queued_bytes(service.receiver, message, min(message, block),
                                (8 << 20) + 2 * in_flight(message))
            assert 8 << 20 <= got <= (8 << 20) + in_flight(message), (split, got / message)
        finally:
            service.close()
    with pytest.raises(ValueError, match="kv_recv_queue_mib"):
        NodeConfig(**config, kv_recv_queue_mib=0)

