"""One streamed request against an OpenAI-compatible `/v1/completions`, timed as `vllm bench
serve` times it (see metrics.py).

Exact output lengths: pdserve and vLLM take `ignore_eos: true` with `max_tokens`; `transformers
serve` refuses unknown fields (HTTP 422) but takes a `generation_config` JSON string, where
`min_new_tokens == max_new_tokens` has the same effect.
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass

import httpx

from bench.serving.metrics import RequestRecord


class LengthControl(enum.Enum):
    IGNORE_EOS = "ignore_eos"                  # pdserve, vLLM
    GENERATION_CONFIG = "generation_config"    # transformers serve


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str                   # e.g. http://127.0.0.1:8000
    model: str                      # the name the server answers to
    length_control: LengthControl = LengthControl.IGNORE_EOS
    temperature: float = 0.0        # 0: greedy; else every request samples at it (no top-k / top-p)

    def payload(self, prompt: str, output_len: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": self.temperature,
                "stream": True}
        if self.length_control is LengthControl.IGNORE_EOS:
            body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
        else:
            sampled = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
            body["generation_config"] = json.dumps({"max_new_tokens": output_len, "min_new_tokens": output_len,
                                                    **(sampled if self.temperature else {"do_sample": False})})
        return body


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str, record: RequestRecord) -> None:
    """Stream one completion, filling `record` in place (its send_time is set by the caller)."""
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{endpoint.base_url}/v1/completions",
                                 json=endpoint.payload(prompt, record.expected_output_len)) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"])[:200]
                    return
                now = time.perf_counter()
                record.response_id = record.response_id or str(event.get("id") or "")
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    chunks, last = chunks + 1, now
                if event.get("usage"):
                    record.output_tokens = int(event["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        record.error = f"{type(err).__name__}: {err}"[:200]
        return
    record.latency = last - start
    record.output_tokens = record.output_tokens or chunks
    record.success = chunks > 0
    if not record.success:
        record.error = "no tokens streamed"
