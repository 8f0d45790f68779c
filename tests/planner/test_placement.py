"""Where the real router sent each measured request (bench/simulate/placement.py), and the
simulator replaying it (SimRequest.replay_decode) or scoring its own choice against it."""
from __future__ import annotations

import json

from bench.simulate.placement import attach, read, request_id
from bench.simulate.validate import placement_agreement, ranked_before
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import profile, request, tokens


def test_a_wire_rid_names_its_request_id():
    """The router's wire rids are `<id>-<prompt>`, `#<choice>` when n > 1, `~<attempt>` on a retry."""
    assert request_id("cmpl-ab12-0") == "cmpl-ab12"
    assert request_id("cmpl-ab12-0#1") == "cmpl-ab12"
    assert request_id("cmpl-ab12-3~2") == "cmpl-ab12"


def test_read_takes_the_node_that_took_each_requests_first_attempt_and_attach_joins_by_response_id(tmp_path):
    """Only DecodeRequests count; a retry's later one (~1) does not replace the first attempt's; a
    node that answered Busy is not where the request went: the attempt's next ask is; a request
    the router never sent to a decode node gets ""."""
    lines = [{"t": 1.0, "p": "router", "e": "send", "node": "decode-1", "m": "DecodeRequest", "rid": "cmpl-a-0"},
             {"t": 1.1, "p": "router", "e": "send", "node": "prefill-0", "m": "PrefillRequest", "rid": "cmpl-a-0"},
             {"t": 1.2, "p": "router", "e": "send", "node": "decode-0", "m": "DecodeRequest", "rid": "cmpl-b-0"},
             {"t": 2.0, "p": "router", "e": "send", "node": "decode-1", "m": "DecodeRequest", "rid": "cmpl-b-0~1"},
             {"t": 2.1, "p": "router", "e": "send", "node": "decode-0", "m": "DecodeRequest", "rid": "cmpl-d-0"},
             {"t": 2.2, "p": "router", "e": "send", "node": "decode-1", "m": "DecodeRequest", "rid": "cmpl-d-0"}]
    (tmp_path / "123.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    where = read(str(tmp_path))
    assert where == {"cmpl-a": "decode-1", "cmpl-b": "decode-0", "cmpl-d": "decode-1"}
    records = [{"id": "cmpl-b"}, {"id": "cmpl-a"}, {"id": "cmpl-c"}, {}]
    assert attach(records, where) == 2
    assert [r["decode_node"] for r in records] == ["decode-0", "decode-1", "", ""]


def test_a_replayed_placement_decides_the_decode_node_and_is_recorded():
    """Four unique prompts at once: by the policy they spread over the two nodes; replayed, every one
    goes to decode-1, as the measured router put them, and each request records where it ran."""
    reqs = [request(i, tokens(40, 1_000 * (i + 1)), 8) for i in range(4)]
    simulate(profile(), reqs, Topology.disaggregated(1, 2))
    assert {r.decode_node for r in reqs} == {"decode-0", "decode-1"}
    for r in reqs:
        r.replay_decode = "decode-1"
    simulate(profile(), reqs, Topology.disaggregated(1, 2))
    assert [r.decode_node for r in reqs] == ["decode-1"] * 4
    assert placement_agreement(reqs, ["decode-1", "decode-0", "", "decode-1"]) == (2, 3)
    assert placement_agreement(reqs, ["decode-0", "decode-0", "", "decode-1"]) == (1, 3)   # by name, not renamed
    assert placement_agreement(reqs, ["", "", "", ""]) is None


def test_placement_agrees_node_by_node_name_with_many_nodes():
    """Eleven decode nodes, each request simulated on the node the router chose: 11 of 11 agree;
    two swapped, 9; every name shifted by one, none. By name: a renaming would make any one-to-one
    mismatch agree (and 11 nodes have 11! namings to try)."""
    reqs = [request(i, tokens(40), 4) for i in range(11)]
    for i, r in enumerate(reqs):
        r.decode_node = f"decode-{i}"
    placed = [f"decode-{i}" for i in range(11)]
    assert placement_agreement(reqs, placed) == (11, 11)
    placed[3], placed[4] = "decode-4", "decode-3"
    assert placement_agreement(reqs, placed) == (9, 11)
    shifted = [f"decode-{(i + 1) % 11}" for i in range(11)]
    assert placement_agreement(reqs, shifted) == (0, 11)


def test_the_requests_ranked_before_a_point_count_the_launchers_the_warm_ups_and_earlier_points():
    """pdserve up's first request, the run's recorded warm-up (2 in files that predate the record),
    then every earlier point's requests: the router's coin drew for each."""
    out = {"points": [{"requests": [{}] * 24}, {"requests": [{}] * 24}]}
    assert [ranked_before(out, i) for i in (0, 1)] == [3, 27]
    assert [ranked_before(out | {"warmup_requests": 10}, i) for i in (0, 1)] == [11, 35]
