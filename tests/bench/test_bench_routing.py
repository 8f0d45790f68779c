"""bench.serving's routing comparison: the system variants' flags, the KV bytes shipped per request
from the scraped counters, and the routing tuner's pick."""
from __future__ import annotations

from bench.serving.compare import kv_shipped
from bench.serving.servers import Knobs, known, routing_flags, server_spec
from bench.serving.tune import RoutingSetting, best_routing, routing_grid


def test_routing_variants_of_pdserve_1p1d_add_their_router_flags():
    """-affinity is the old routing, @T the cost routing at threshold T; anything else is unknown."""
    assert routing_flags("pdserve-1p1d-affinity") == ("--routing", "affinity")
    assert routing_flags("pdserve-1p1d@64") == ("--routing", "cost", "--local-prefill-tokens", "64")
    assert [known(n) for n in ("pdserve-1p1d", "pdserve-1p1d@x", "vllm-cpu@4", "pdserve-1p1d@0")] == \
        [True, False, False, True]
    spec = server_spec("pdserve-1p1d@64", "/m", 8001, Knobs())
    assert spec.name == "pdserve-1p1d@64" and spec.argv[-4:] == routing_flags("pdserve-1p1d@64")


def test_kv_bytes_per_request_sum_every_prefill_node_and_split_prefills_by_place():
    deltas = {'pdserve_kv_bytes_sent_total{node="p0",role="prefill"}': 3000.0,
              'pdserve_kv_bytes_sent_total{node="p1",role="prefill"}': 1000.0,
              'pdserve_kv_bytes_received_total{node="d0",role="decode"}': 4000.0,
              'pdserve_router_prefills_total{where="local"}': 3.0,
              'pdserve_router_prefills_total{where="remote"}': 1.0}
    assert kv_shipped({"counter_deltas": deltas}, 4) == {"kv_bytes_per_request": 1000.0, "local_prefills": 3.0,
                                                        "remote_prefills": 1.0}
    assert kv_shipped({"available": False}, 0)["kv_bytes_per_request"] == 0.0


def test_the_tuner_picks_the_highest_goodput_among_settings_meeting_the_slos():
    """Settings under 90% SLO attainment are out whatever their goodput; ties go to the lower TTFT."""
    grid = routing_grid([0, 256], [1.0], [512, 2048])
    assert grid[1] == RoutingSetting(0, 1.0, 2048) and len(grid) == 4

    def config(setting, goodput, attainment, ttft):
        return setting._asdict() | {"metrics": {"goodput": goodput, "slo_attainment": attainment,
                                                "ttft": {"p50": ttft}}}
    configs = [config(grid[0], 0.9, 0.5, 10), config(grid[1], 0.4, 0.95, 300), config(grid[2], 0.4, 1.0, 200),
               config(grid[3], 0.3, 1.0, 100)]
    assert best_routing(configs) == grid[2]._asdict()
    assert best_routing(configs[:1]) is None
