"""The load generator's client and scraper against a scripted in-process server (httpx.MockTransport)."""
import asyncio
import json

import httpx

from bench.serving.client import Endpoint, LengthControl, send
from bench.serving.metrics import RequestRecord
from bench.serving.prometheus import parse


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _run(handler, endpoint=Endpoint("http://test", "m"), expected=3):
    record = RequestRecord(4, expected)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await send(client, endpoint, "a b c d", record)
    asyncio.run(go())
    return record


def test_counts_text_chunks_and_takes_usage():
    """Chunks with text time TTFT/ITL; usage.completion_tokens wins over the chunk count."""
    body = _sse([{"choices": [{"text": " x"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": " y z"}]},
                 {"choices": [], "usage": {"completion_tokens": 3}}])
    r = _run(lambda req: httpx.Response(200, text=body))
    assert r.success and r.output_tokens == 3 and len(r.itl) == 1 and r.latency >= r.ttft > 0


def test_the_responses_id_is_recorded():
    """The first chunk's "id" (pdserve: the router's request id) is kept: placement.py joins on it."""
    body = _sse([{"id": "cmpl-7", "choices": [{"text": " x"}]}, {"id": "cmpl-7", "choices": [{"text": " y"}]}])
    assert _run(lambda req: httpx.Response(200, text=body)).response_id == "cmpl-7"


def test_http_error_is_a_failed_record():
    """A non-200 answer (e.g. 422 for unknown fields) fails the request with its status."""
    r = _run(lambda req: httpx.Response(422, text="Unexpected fields"))
    assert not r.success and r.error.startswith("HTTP 422")


def test_exact_length_fields_per_server():
    """pdserve/vLLM get ignore_eos; transformers serve gets min_new_tokens == max_new_tokens."""
    a = Endpoint("u", "m").payload("p", 7)
    assert a["ignore_eos"] is True and a["max_tokens"] == 7 and a["stream_options"]["include_usage"]
    b = Endpoint("u", "m", LengthControl.GENERATION_CONFIG).payload("p", 7)
    assert "ignore_eos" not in b and "stream_options" not in b
    assert json.loads(b["generation_config"]) == {"max_new_tokens": 7, "min_new_tokens": 7, "do_sample": False}


def test_prometheus_parse_keeps_labels_and_drops_buckets():
    """Sample lines become `name{labels}` -> value; buckets and _created lines are dropped."""
    text = ('# HELP x\npdserve_kv_cache_usage{node="d0",role="decode"} 0.25\n'
            'lat_bucket{le="0.1"} 3\nlat_sum 1.5\nlat_created 1.7e9\n')
    assert parse(text) == {'pdserve_kv_cache_usage{node="d0",role="decode"}': 0.25, "lat_sum": 1.5}
