"""Simulated requests from the serving benchmark's workloads (bench/serving/workloads.py: the
same prompts, lengths and shared documents, so prefix hits are the real ones) and its arrival
process (bench/serving/arrivals.py: gamma gaps, exact rate). Needs a checkout (bench/ is not in
the wheel)."""
from __future__ import annotations

from pdplan.sim_request import SimRequest, chain_hashes


def sim_requests(workload: str, num_requests: int, rate: float, seed: int = 0, block_size: int = 16,
                 max_model_len: int = 4096, burstiness: float = 1.0, output_cap: int | None = None,
                 arrival_seed: int | None = None) -> list[SimRequest]:
    """The workload drawn with `seed`, arriving at `rate` (arrivals drawn with `arrival_seed`,
    default `seed`, as bench.serving.compare draws both from one seed per rate point)."""
    from bench.serving.arrivals import arrival_times
    from bench.serving.workloads import WorkloadSpec, generate

    requests = generate(WorkloadSpec(workload, num_requests, seed, max_model_len, output_cap=output_cap))
    times = arrival_times(len(requests), rate, burstiness, seed if arrival_seed is None else arrival_seed)
    memo: dict[tuple[int, ...], tuple[int, ...]] = {}
    return [SimRequest(i, float(t), r.prompt_len, r.output_len, _hashes(r.prompt_ids, block_size, memo), r.kind)
            for i, (r, t) in enumerate(zip(requests, times))]


def _hashes(ids: tuple[int, ...], block_size: int, memo: dict) -> tuple[int, ...]:
    """Chained block hashes; a prompt whose first 64 blocks were seen reuses their chain."""
    head = ids[:64 * block_size]
    if len(head) == 64 * block_size and head in memo:
        prefix = memo[head]
        rest, prev = [], prefix[-1]
        for start in range(len(head), len(ids) - block_size + 1, block_size):
            prev = hash((prev, ids[start:start + block_size]))
            rest.append(prev)
        return prefix + tuple(rest)
    hashes = chain_hashes(ids, block_size)
    if len(head) == 64 * block_size:
        memo[head] = hashes[:64]
    return hashes
