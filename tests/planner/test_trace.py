"""bench/simulate/trace.py reads a request's path off the processes' timestamps: a scripted run."""
from __future__ import annotations

import pytest

from bench.simulate.trace import inside_spans, requests, shared_core_table, step_ratios
from tests.planner.test_simulator import STEP, profile


def _ev(t: float, p: str, e: str, **fields) -> dict:
    return {"t": t, "p": p, "e": e, **fields}


def test_one_remote_request_is_split_into_the_hops_of_its_path():
    """Client at 0, router at 3 ms, DecodeRequest 4 ms, read by D at 6 ms (D's step ran 2-6 ms),
    Reserved back 7, PrefillRequest 7.5, P reads it 8, steps 9-40, FirstToken sent 41, at the
    router 42, yielded with text 43, at the client 50 ms."""
    rid = "cmpl-1"
    events = [
        _ev(0.060, "client", "c_req", t0=0.0, ttft=0.050, itl=[], out=4),
        _ev(0.003, "router", "gen_start", rid=rid),
        _ev(0.004, "router", "send", m="DecodeRequest", rid=rid, node="decode-0"),
        _ev(0.006, "decode-0", "step", t0=0.002, cpu=0.004, seqs=1, tokens=1, shapes=[[1, 50]], chunks=[], out=[]),
        _ev(0.006, "decode-0", "recv", m="DecodeRequest", rid=rid),
        _ev(0.007, "router", "recv", m="Reserved", rid=rid, node="decode-0"),
        _ev(0.0075, "router", "send", m="PrefillRequest", rid=rid, node="prefill-0"),
        _ev(0.008, "prefill-0", "recv", m="PrefillRequest", rid=rid),
        _ev(0.040, "prefill-0", "step", t0=0.009, cpu=0.031, seqs=1, tokens=78, shapes=[[78, 0]],
            chunks=[[rid, 78]], out=[rid]),
        _ev(0.041, "prefill-0", "send", m="FirstToken", rid=rid, txt=5),
        _ev(0.042, "router", "recv", m="FirstToken", rid=rid, txt=5, node="prefill-0"),
        _ev(0.043, "router", "yield", rid=rid, n=1, txt=5),
        _ev(0.052, "router", "recv", m="TokenDelta", rid=rid, i=1, n=1, txt=3, node="decode-0"),
    ]
    (row,) = requests(sorted(events, key=lambda e: e["t"]))
    expected = {"ttft": 50, "arrive": 3, "reserve": 3, "d_wait": 2, "prefill": 34.5, "p_recv": 0.5, "p_wait": 1,
                "p_steps": 31, "p_tokens": 78, "p_back": 1, "deliver": 7, "p_to_d": 10}
    assert {k: row[k] for k in expected} == pytest.approx(expected)
    assert row["first_by"] == "P" and not row["local"] and row["d_batch"] == 1


def test_a_step_beside_another_nodes_step_is_priced_and_its_overlap_measured():
    """P's 40 ms step overlaps D's 10 ms one by a quarter; each is measured against the profile's price."""
    p = profile()
    events = [_ev(0.040, "prefill-0", "step", t0=0.0, cpu=0.04, shapes=[[100, 0]]),
              _ev(0.035, "decode-0", "step", t0=0.025, cpu=0.01, shapes=[[1, 10]])]
    ratios = step_ratios(events, p)
    assert ratios["prefill-0"] == [(pytest.approx(0.25), pytest.approx(0.040 / STEP.of([(100, 0)])), pytest.approx(40))]
    assert ratios["decode-0"][0][0] == pytest.approx(1.0)


def _rag_trace(tmp_path, late: int = 4):
    """A traced RAG run of 15 requests: each reaches the router 3 ms + 2 us per prompt token after
    the client sent it (request `late` 30 ms more), and the decode node (idle) has it reserved
    1 ms + 0.5 us per prompt token after that; before them, the load generator's 2 warm-up requests."""
    import json
    from pdplan.workload import sim_requests
    folder = tmp_path / "trace_rag_1p1d_0.3_20261202-000000"
    folder.mkdir()
    reqs = sorted(sim_requests("rag", 15, 0.3, 0, 16, 4096, output_cap=256), key=lambda r: r.arrival)
    events = [_ev(-1.0 + 0.001 * i, "client", "c_req", t0=-1.0, ttft=0.1, itl=[], out=2) for i in range(2)]
    events += [_ev(-1.0 + 0.5, "router", "gen_start", rid=f"warm-{i}") for i in range(2)]   # 0.5 s: not the line
    for i, r in enumerate(reqs):
        arrive = r.arrival + 0.003 + 2e-6 * r.prompt_len + (0.030 if i == late else 0.0)
        reserved = arrive + 0.001 + 0.5e-6 * r.prompt_len
        events += [_ev(r.arrival + 0.5, "client", "c_req", t0=r.arrival, ttft=0.4, itl=[], out=2),
                   _ev(arrive, "router", "gen_start", rid=f"cmpl-{i}"),
                   _ev(arrive + 0.0002, "router", "send", m="DecodeRequest", rid=f"cmpl-{i}", node="decode-0"),
                   _ev(arrive + 0.0005, "decode-0", "recv", m="DecodeRequest", rid=f"cmpl-{i}"),
                   _ev(reserved, "decode-0", "send", m="Reserved", rid=f"cmpl-{i}")]
    (folder / "1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(folder)


def test_front_end_per_prompt_token_from_a_trace_folder(tmp_path):
    """The router took one request 30 ms late: it moves a third's median by one neighbour, not by
    30 ms; front_end gives about 3 ms and 2 us per token back, the warm-up (0.5 s late) left out."""
    from bench.simulate.trace import front_end
    fixed, per_token = front_end([_rag_trace(tmp_path)])
    assert fixed == pytest.approx(0.003, abs=2e-4) and per_token == pytest.approx(2e-6, rel=0.05)


def test_front_end_cpu_per_prompt_token_from_the_tokenizing_calls(tmp_path):
    """The HTTP worker's tokenizing calls (`work`, with their thread's CPU): 0.2 ms + 1.5 us a token,
    the longest 5 ms more (a busy process): the thirds' medians give the line back; an
    event that is not a prompt's work (no tokens) is left out."""
    import json
    from bench.simulate.trace import front_cpu
    folder = tmp_path / "trace_sharegpt_colocated_0.5_20261205-000000"
    folder.mkdir()
    lengths = [30, 60, 90, 120, 150, 400, 700, 1000, 1300, 1600, 2000, 2600, 3000, 3200, 3400]
    events = [_ev(1.0 + i, "router", "work", t0=0.5 + i, fn="completion_prompts", tokens=n,
                  cpu=0.0002 + 1.5e-6 * n + (0.005 if n == 3400 else 0.0)) for i, n in enumerate(lengths)]
    events += [_ev(0.1, "router", "work", t0=0.0, fn="render", cpu=0.5)]
    (folder / "1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fixed, per_token = front_cpu([str(folder)])
    assert fixed == pytest.approx(0.0002, abs=5e-5) and per_token == pytest.approx(1.5e-6, rel=0.02)
    assert front_cpu([_rag_trace(tmp_path)]) == (0.0, 0.0)     # made before the calls were traced: none


def test_admission_per_prompt_token_from_a_trace_folder(tmp_path):
    """From the router's backend to the decode node's Reserved: about 1 ms and 0.5 us per token."""
    from bench.simulate.trace import admission
    fixed, per_token = admission([_rag_trace(tmp_path)])
    assert fixed == pytest.approx(0.001, abs=1e-4) and per_token == pytest.approx(0.5e-6, rel=0.05)


def test_two_decode_nodes_on_one_core_wall_against_cpu_and_the_time_each_way():
    """decode-0 steps 0-10 ms alone (10 ms CPU), then 20-40 ms beside decode-1's 20-40 ms step
    (10 ms CPU each: the core shared, wall / CPU 2); 10 ms with neither, 10 alone, 20 both."""
    step = dict(seqs=1, tokens=1, shapes=[[1, 50]], chunks=[], out=[])
    events = [_ev(0.010, "decode-0", "step", t0=0.0, cpu=0.010, **step),
              _ev(0.040, "decode-0", "step", t0=0.020, cpu=0.010, **step),
              _ev(0.040, "decode-1", "step", t0=0.020, cpu=0.010, **step)]
    text = shared_core_table(events, profile())
    row0 = next(line for line in text.splitlines() if line.startswith("| decode-0"))
    assert "| 1.00 (1) | - | 2.00 (1) |" in row0
    assert inside_spans(events) == pytest.approx([0.010, 0.010, 0.020])
    assert shared_core_table(events[:2], profile()) == ""
