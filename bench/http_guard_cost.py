"""The HTTP connection guard's CPU cost (router/http/server.py), per request and per streamed token.

One process serves the real app over a backend that streams `--tokens` tokens per request at
once (no model, so the router's own work is all there is), over uvicorn's plain h11 protocol or
pdserve's GuardedProtocol, alternately; a client process sends `--requests` streamed completions
one after another on one keep-alive connection. The figure is the server process's CPU time
(time.process_time, which another process's load on the machine barely moves, unlike wall time)
per request and per token, median over `--pairs` alternating pairs.

    python bench/http_guard_cost.py [--pairs 5] [--requests 200] [--tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIENT = r"""
import http.client, json, sys
port, requests, tokens = map(int, sys.argv[1:4])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": True})
for _ in range(requests):
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    assert reply.status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-200:]
"""


def _backend(tokens: int):
    from pdwire.outputs import CompletionOutput, RequestOutput
    from router.backend import Backend

    class Tokenizer:
        def encode(self, text, add_special_tokens=True, split_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

        def __len__(self):
            return 0x110000

    class Stream(Backend):
        """`tokens` outputs per request, each a delta of one more character, at once."""
        model_name, tokenizer, max_model_len = "m", Tokenizer(), 1 << 16

        async def generate(self, request_id, prompt, params):
            for k in range(tokens):
                token = 97 + k % 26
                yield RequestOutput(request_id, prompt, [CompletionOutput(0, chr(token), [token], None,
                                                                          "length" if k == tokens - 1 else None)],
                                   k == tokens - 1)
                await asyncio.sleep(0)

        async def abort(self, request_id):
            pass

        def metrics(self):
            return []
    return Stream()


async def _serve_once(guarded: bool, requests: int, tokens: int) -> float:
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from router.config import RouterConfig
    from router.http.app import create_app
    from router.http.server import Server, bind_http

    config = RouterConfig(port=0)
    app = create_app(_backend(tokens), config)
    sock = bind_http(config)
    if guarded:
        server = Server(app, config, log_level="warning")
    else:
        server = uvicorn.Server(uvicorn.Config(app, http=H11Protocol, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(sock.getsockname()[1]),
                                                  str(requests), str(tokens))
    start = time.process_time()
    assert await client.wait() == 0
    used = time.process_time() - start
    server.should_exit = True
    await serving
    sock.close()
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results/http_guard_cost.json")
    args = parser.parse_args()
    import uvloop

    runs: dict[str, list[float]] = {"h11": [], "guarded": []}
    for _ in range(args.pairs):
        for name in ("h11", "guarded"):
            runs[name].append(uvloop.run(_serve_once(name == "guarded", args.requests, args.tokens)))
    print(f"server CPU per request ({args.requests} requests x {args.tokens} streamed tokens, median of "
          f"{args.pairs} alternating pairs; load average {os.getloadavg()[0]:.1f})")
    result = {"requests": args.requests, "tokens": args.tokens, "pairs": args.pairs, "load_average": os.getloadavg()[0]}
    for name, times in runs.items():
        per_request = statistics.median(times) / args.requests
        result[name] = {"cpu_s": times, "cpu_per_request_us": 1e6 * per_request,
                        "cpu_per_token_us": 1e6 * per_request / args.tokens}
        print(f"  {name:8s} {1e6 * per_request:8.0f} us/request  {1e6 * per_request / args.tokens:6.1f} us/token  "
              f"(runs: {', '.join(f'{t:.2f}' for t in times)} s)")
    ratio = result["guarded"]["cpu_per_request_us"] / result["h11"]["cpu_per_request_us"]
    result["guarded_over_h11"] = ratio
    print(f"  guarded / h11: {ratio:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
