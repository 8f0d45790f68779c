"""pdserve's router: the OpenAI-compatible HTTP front end and where requests go.

    config.py       RouterConfig, the frozen, validated settings
    protocol.py     OpenAI request/response models; a request -> SamplingParams
    errors.py       OpenAI-style error bodies (400 for bad input, 401, 404 model_not_found, 503)
    prompts.py      tokenizing prompts and chat templates; context-length checks
    backend.py      Backend: the interface the app talks to (contract in its docstring)
    colocated.py    ColocatedBackend: one engine on its own thread (prefill + decode on one node)
    lifecycle.py    Generation: one HTTP request's backend requests, merged; abort on disconnect
    streaming.py    SSE framing and cumulative-output -> delta cursors
    completions.py  /v1/completions bodies and streams
    chat.py         /v1/chat/completions bodies and streams
    logprobs.py     engine logprobs in OpenAI's two shapes
    metrics.py      per-app Prometheus registry: request latencies and phases, lengths, outcomes
    node_collector.py  per-node series at scrape time: load, prefix-cache and KV counters, cache layout
    app.py          create_app(backend, config): routes, API key, wiring
    registry.py     NodeRegistry: prefill/decode nodes, heartbeats, drain, in-flight counts
    policy.py       PrefillPolicy (prefix affinity vs load), DecodePolicy (least loaded with room, booked at once)
    cli.py          `python -m router`: the colocated server, flags from the config dataclasses
    control_server.py  ControlServer: the nodes' ZMQ ROUTER socket, hello/heartbeat, expiry
    disaggregated.py   DisaggregatedBackend: reserve on D, prefill on P, stream, retry, migrate
    launcher.py     `pdserve up`: router + prefill/decode node processes; `pdserve colocated`

Import from the modules; this package file imports nothing, so node processes can use the
registry and policies without loading the HTTP stack.
"""
