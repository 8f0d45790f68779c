"""The load generator against a real local socket server that streams SSE tokens: no garbage
collection runs while a request is in flight (a collection stops the event loop, so it delays sends
and bunches the open streams' tokens)."""
import asyncio
import gc
import json

from bench.serving.client import Endpoint
from bench.serving.loadgen import LoadSpec, run_load
from bench.serving.workloads import BenchRequest

CYCLES_PER_TOKEN = 400      # garbage in reference cycles: with the collector on, generation 0 fills


async def _serve(reader, writer, state) -> None:
    """One keep-alive connection: /v1/completions streams max_tokens chunks, anything else is a 404."""
    state["handlers"].append(asyncio.current_task())
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length")), 0)
            body = await reader.readexactly(length)
            if not head[0].startswith("POST /v1/completions"):
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            await _stream(writer, json.loads(body)["max_tokens"], state)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _stream(writer, tokens: int, state: dict) -> None:
    state["in_flight"] += 1
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(tokens):
        for _ in range(CYCLES_PER_TOKEN):
            cycle = []
            cycle.append(cycle)
        state["collector_on"] |= gc.isenabled()
        _chunk(writer, "data: " + json.dumps({"choices": [{"text": " w"}]}) + "\n\n")
        await writer.drain()
        await asyncio.sleep(0)
    _chunk(writer, "data: [DONE]\n\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    state["in_flight"] -= 1


def _chunk(writer, text: str) -> None:
    data = text.encode()
    writer.write(b"%x\r\n" % len(data) + data + b"\r\n")


def _run(requests: list[BenchRequest], state: dict) -> list:
    collections = []
    note = lambda phase, info: collections.append(state["in_flight"]) if phase == "start" else None  # noqa: E731

    async def go():
        server = await asyncio.start_server(lambda r, w: _serve(r, w, state), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await run_load(Endpoint(f"http://127.0.0.1:{port}", "m"), requests, ["w"] * 8,
                                    LoadSpec(500.0, deadline_s=60.0))
            await asyncio.gather(*state["handlers"])    # the client has closed every connection
        return result
    gc.callbacks.append(note)
    try:
        result = asyncio.run(go())
    finally:
        gc.callbacks.remove(note)
    return result, collections


def test_no_collection_while_requests_are_in_flight():
    """Every request streams all its tokens, and the collector neither runs nor is on while any is open."""
    requests = [BenchRequest([3] * (4 + i), 30, "chat") for i in range(6)]
    state = {"in_flight": 0, "collector_on": False, "handlers": []}
    enabled = gc.isenabled()
    result, collections = _run(requests, state)
    assert [r.output_tokens for r in result.records] == [30] * 6 and all(r.success for r in result.records)
    assert not state["collector_on"]
    assert [n for n in collections if n > 0] == []
    assert gc.isenabled() == enabled            # back as it was after the run
