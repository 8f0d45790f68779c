"""A router process for tests of the HTTP edge: the real app and Server (router/http/server.py) over a
scripted backend, so a test can hold raw sockets against it, signal it, and read its RSS.

    python -m tests.http_server --port P [RouterConfig flags] [--steps N] [--interval-s S]
                                [--hf-tokenizer]

The backend streams `steps` outputs per request, one `interval_s` apart, each adding TOKEN_TEXT
to every choice (a delta, as a Backend yields); prompt logprobs when asked, in the first.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time

from pdwire.outputs import CompletionOutput, RequestOutput
from router.cli import add_dataclass_args, build_dataclass
from router.config import RouterConfig
from tests.fake_backend import CharTokenizer, FakeBackend

TOKEN_TEXT = "abcdefgh"


class StreamingBackend(FakeBackend):
    def __init__(self, steps: int, interval_s: float, tokenizer):
        super().__init__(max_model_len=4096)
        self._steps, self._interval_s, self._tokenizer = steps, interval_s, tokenizer

    @property
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, request_id, prompt, params):
        steps = min(self._steps, params.max_tokens or self._steps)
        for step in range(1, steps + 1):
            reason = "length" if step == steps else None
            outs = [CompletionOutput(i, TOKEN_TEXT, [7], None if params.logprobs is None else [{7: -0.5}], reason)
                    for i in range(params.n)]
            scores = None if params.prompt_logprobs is None or step > 1 else \
                [None] + [{t: -0.5, **{k: -1.0 for k in range(params.prompt_logprobs)}} for t in prompt[1:]]
            yield RequestOutput(request_id, prompt, outs, reason is not None, scores)
            await asyncio.sleep(self._interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from router.http.app import create_app
    from router.http.server import Server

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, RouterConfig)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=0.01)
    parser.add_argument("--hf-tokenizer", action="store_true")
    args = vars(parser.parse_args())
    tokenizer = CharTokenizer()
    if args["hf_tokenizer"]:
        from transformers import AutoTokenizer

        from engine.builtin import BUILTIN_MODEL_PATH
        tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_PATH)
    logging.basicConfig(level=logging.WARNING)
    backend = StreamingBackend(args["steps"], args["interval_s"], tokenizer)
    Server(create_app(backend, build_dataclass(RouterConfig, args)), build_dataclass(RouterConfig, args),
           loop="uvloop", log_level="warning").run()
    print(f"http_server: exited at {time.monotonic():.3f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
