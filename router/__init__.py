"""pdserve's router, in two halves side by side, with what joins them:

    http/           the OpenAI-compatible front end: app.py (routes, keys), protocol.py (request
                    models -> SamplingParams), limits.py, prompts.py / chat_template.py,
                    completions.py / chat.py / streaming.py / logprobs.py, lifecycle.py (one HTTP
                    request's backend requests), errors.py, metrics.py, info_routes.py,
                    tokenize.py, operator.py (the /admin routes), workers.py, server.py (uvicorn
                    behind a connection guard, bounded shutdown)
    cluster/        the nodes: disaggregated.py (the DisaggregatedBackend), disagg_request.py,
                    admission.py, policy.py, registry.py, membership.py, control_server.py (the
                    control plane), node_operator.py (drain / remove), node_collector.py
    backend.py      Backend: the interface between the halves (it yields deltas), and NoNodeAvailable (a 503)
    stop_hold.py    StopHold: one choice's unsent output; holds back text a stop string may still claim
    request_deltas.py  RequestDeltas: a request's next delta (its choices' and the prompt's scores, once)
    colocated.py    ColocatedBackend: one engine on its own thread (prefill + decode on one node)
    config.py       RouterConfig, the frozen, validated settings (flags generated from it)
    cli.py          `python -m router`: the colocated server
    launcher.py     `pdserve up | router | prefill | decode | colocated | secret | nodes | drain | remove`
    node_fleet.py   NodeFleet: who starts and supervises the nodes (pdserve up: LocalFleet; ray_deploy: RayFleet)
    node_processes.py  the node processes `pdserve up` starts: spawn, wait for, supervise, stop
    operator_cli.py `pdserve nodes | drain | remove`: the operator API from a shell

Import from the modules; this package file imports nothing, so a process can use one half
without loading the other.
"""
