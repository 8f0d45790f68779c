"""pdserve on a Ray cluster: `pdserve ray up` places the router's nodes as Ray actors, Ray
restarts and reschedules them, and the router keeps membership and moves requests.

    config.py      RayConfig: which cluster, what each node's rank holds, the deployment's name
    placement.py   NodePlacement: the Ray resources of one node (GPUs, else CPUs; prefill/decode)
    node_actor.py  NodeActor: the Ray actor that runs one `pdserve prefill|decode` process
    ray_node.py    RayNode: the driver's record of one node actor
    fleet.py       RayFleet: the router's NodeFleet on Ray (start, watch, restart, stop)
    cli.py         `pdserve ray up | scale | pools`

Needs the [ray] extra (`pip install -e .[ray]`); this face imports nothing, and `import router`
or `pdserve up` never imports ray.
"""
