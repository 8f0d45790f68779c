"""An OpenAI-like completions server with no model behind it, on a real loopback socket: the load
generator measured alone (client_alone.py), and its tests.

    python -m bench.serving.stub_server --port P [--ttft-s 0.05] [--itl-s 0.025]

POST /v1/completions streams `max_tokens` SSE chunks (`data: {"choices": [{"text": " w"}]}`), the
first ttft_s after the request, then one every itl_s, a usage chunk and `data: [DONE]`; any other
path is a 404. HTTP/1.1 keep-alive, chunked transfer encoding.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class StubServer:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    on_token: Callable[[], None] | None = None      # called before each token is written
    in_flight: int = 0                              # completions being streamed now
    handlers: list[asyncio.Task] = field(default_factory=list)   # one per connection accepted

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One keep-alive connection, until the client closes it."""
        self.handlers.append(asyncio.current_task())
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length")), 0)
                body = await reader.readexactly(length)
                if head[0].startswith("POST /v1/completions"):
                    await self._stream(writer, json.loads(body)["max_tokens"])
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, tokens: int) -> None:
        self.in_flight += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await asyncio.sleep(self.ttft_s)
        for i in range(tokens):
            if self.on_token:
                self.on_token()
            _chunk(writer, {"id": "stub", "choices": [{"text": " w"}]})
            await writer.drain()
            await asyncio.sleep(self.itl_s if i < tokens - 1 else 0)
        _chunk(writer, {"id": "stub", "choices": [], "usage": {"completion_tokens": tokens}})
        _chunk(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.in_flight -= 1


def _chunk(writer: asyncio.StreamWriter, event: dict | str) -> None:
    data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
    writer.write(b"%x\r\n" % len(data) + data + b"\r\n")


async def _main(port: int, stub: StubServer) -> None:
    server = await asyncio.start_server(stub.serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-s", type=float, default=0.05)
    p.add_argument("--itl-s", type=float, default=0.025)
    a = p.parse_args()
    asyncio.run(_main(a.port, StubServer(a.ttft_s, a.itl_s)))
