"""The load generator against a real local socket server that streams SSE tokens
(bench/serving/stub_server.py): no garbage collection runs while a request is in flight (a
collection stops the event loop, so it delays sends and bunches the open streams' tokens)."""
import asyncio
import gc

from bench.serving.client import Endpoint
from bench.serving.loadgen import LoadSpec, run_load
from bench.serving.stub_server import StubServer
from bench.serving.workloads import BenchRequest

CYCLES_PER_TOKEN = 400      # garbage in reference cycles: with the collector on, generation 0 fills


def _run(requests: list[BenchRequest]):
    seen = {"collector_on": False, "collections_in_flight": 0}

    def make_cycles():
        for _ in range(CYCLES_PER_TOKEN):
            cycle = []
            cycle.append(cycle)
        seen["collector_on"] |= gc.isenabled()
    stub = StubServer(on_token=make_cycles)

    def note(phase, info):
        if phase == "start" and stub.in_flight:
            seen["collections_in_flight"] += 1

    async def go():
        server = await asyncio.start_server(stub.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await run_load(Endpoint(f"http://127.0.0.1:{port}", "m"), requests, ["w"] * 8,
                                    LoadSpec(500.0, deadline_s=60.0))
            await asyncio.gather(*stub.handlers)    # the client has closed every connection
        return result
    gc.callbacks.append(note)
    try:
        result = asyncio.run(go())
    finally:
        gc.callbacks.remove(note)
    return result, seen


def test_no_collection_while_requests_are_in_flight():
    """Every request streams all its tokens, and the collector neither runs nor is on while any is open."""
    requests = [BenchRequest([3] * (4 + i), 30, "chat") for i in range(6)]
    enabled = gc.isenabled()
    result, seen = _run(requests)
    assert [r.output_tokens for r in result.records] == [30] * 6 and all(r.success for r in result.records)
    assert seen == {"collector_on": False, "collections_in_flight": 0}
    assert gc.isenabled() == enabled            # back as it was after the run
