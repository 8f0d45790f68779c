"""The vLLM paper's memory-waste experiment (its Fig. 2) on pdserve's block manager: how much of
the KV memory a serving system holds actually stores tokens, with paged blocks
(engine/block_manager.py) against contiguous per-request reservations (Orca-style), on the
ShareGPT-like and Alpaca-like length distributions (bench/serving/workloads.py).

    python bench/memory_fragmentation.py                      # both workloads, printed + JSON
    python bench/memory_fragmentation.py --pool-tokens 65536 --max-len 2048 --num-requests 2000

Pure CPU simulation, no model: every request waits at t = 0 (a saturated server); each step the
FCFS scheduler admits waiting requests while memory allows (no cap on the batch: memory is the
only limit), then every running request appends
one token; a request leaves after its last token. The systems:

  contiguous-max     reserves max_len slots per request           (Orca (Max))
  contiguous-pow2    reserves the next power of two >= its length (Orca (Pow2))
  contiguous-oracle  reserves exactly prompt + output             (Orca (Oracle))
  paged              pdserve's BlockManager: a 16-token block at a time; when a block cannot be
                     had, the latest-admitted request is preempted (recomputed later)

Contiguous reservations live in one address space, first fit, so holes appear. Each step the
pool's slots are sorted into (as fractions of the pool, averaged over the steps while requests
wait, i.e. while memory is the limit):

  token_states       slots holding a token
  reservation        slots held for tokens the request will still produce
  internal_frag      slots held that the request will never fill
  external_frag      free slots in holes too small for the request at the head of the queue
  free               the rest
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.serving.workloads import ALPACA, SHAREGPT, LogNormal  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

KV_BYTES_PER_TOKEN = 2 * 8 * 512 * 4    # K and V, 8 layers, hidden 512, fp32: the 58.5M Llama


@dataclass(frozen=True, slots=True)
class Req:
    prompt_len: int
    output_len: int

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(slots=True)
class Breakdown:
    """Slot counts of one step, or their running sums over steps."""
    token_states: float = 0
    reservation: float = 0
    internal_frag: float = 0
    external_frag: float = 0
    free: float = 0
    running: float = 0

    def add(self, other: "Breakdown") -> None:
        for k in asdict(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass(slots=True)
class SimResult:
    system: str
    steps: int = 0
    saturated_steps: int = 0
    preemptions: int = 0
    sums: Breakdown = field(default_factory=Breakdown)

    def figures(self, pool_tokens: int) -> dict:
        n = max(self.saturated_steps, 1)
        held = self.sums.token_states + self.sums.reservation + self.sums.internal_frag
        return {"system": self.system, "steps": self.steps, "saturated_steps": self.saturated_steps,
                "preemptions": self.preemptions, "mean_running": self.sums.running / n,
                **{k: v / n / pool_tokens for k, v in asdict(self.sums).items() if k != "running"},
                "tokens_per_held_slot": self.sums.token_states / held if held else float("nan")}


def classify(cur: int, final: int, held: int) -> tuple[int, int, int]:
    """(token states, reservation, internal fragmentation) of one request holding `held` slots
    with `cur` tokens now and `final` at the end."""
    future = max(0, min(held, final) - cur)
    return cur, future, held - cur - future


class FirstFit:
    """A contiguous address space of `size` slots; allocations take the lowest hole that fits."""

    def __init__(self, size: int):
        self.holes: list[tuple[int, int]] = [(0, size)]     # (start, length), by start

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                self.holes[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, n))
        self.holes.insert(i, (start, n))
        merged: list[tuple[int, int]] = []
        for s, l in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + l)
            else:
                merged.append((s, l))
        self.holes = merged

    def unusable_for(self, n: int) -> int:
        return sum(length for _, length in self.holes if length < n)

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)


def reservation(policy: str, r: Req, max_len: int) -> int:
    if policy == "max":
        return max_len
    if policy == "pow2":
        return 1 << (r.final_len - 1).bit_length()
    return r.final_len


def simulate_contiguous(reqs: list[Req], pool_tokens: int, policy: str, max_len: int,
                        max_running: int = 1 << 30) -> SimResult:
    res = SimResult(f"contiguous-{policy}")
    space, waiting, running = FirstFit(pool_tokens), list(reqs), []   # running: [req, cur, start, held]
    while waiting or running:
        while waiting and len(running) < max_running:
            held = reservation(policy, waiting[0], max_len)
            start = space.alloc(held)
            if start is None:
                break
            r = waiting.pop(0)
            running.append([r, r.prompt_len, start, held])
        step = Breakdown(running=len(running))
        for r, cur, _, held in running:
            t, f, i = classify(cur, r.final_len, held)
            step.token_states, step.reservation, step.internal_frag = \
                step.token_states + t, step.reservation + f, step.internal_frag + i
        if waiting:
            step.external_frag = space.unusable_for(reservation(policy, waiting[0], max_len))
        step.free = space.free_slots - step.external_frag
        _account(res, step, bool(waiting))
        for entry in running:
            entry[1] += 1
        for r, cur, start, held in [e for e in running if e[1] >= e[0].final_len]:
            space.free(start, held)
        running = [e for e in running if e[1] < e[0].final_len]
    return res


def simulate_paged(reqs: list[Req], pool_tokens: int, block_size: int = 16, max_running: int = 1 << 30,
                   check_every: int = 0) -> SimResult:
    res = SimResult("paged")
    bm = BlockManager(pool_tokens // block_size, block_size, enable_prefix_caching=False)
    waiting = [(r, Sequence(list(range(r.prompt_len)), r.prompt_len)) for r in reqs]
    running: list[tuple[Req, Sequence]] = []
    while waiting or running:
        while waiting and len(running) < max_running and bm.can_allocate(waiting[0][1]):
            r, seq = waiting.pop(0)
            bm.allocate(seq)
            running.append((r, seq))
        step = Breakdown(running=len(running))
        for r, seq in running:
            t, f, i = classify(len(seq), r.final_len, len(seq.block_table) * block_size)
            step.token_states, step.reservation, step.internal_frag = \
                step.token_states + t, step.reservation + f, step.internal_frag + i
        step.free = bm.num_free_blocks * block_size
        _account(res, step, bool(waiting))
        running = _grow(bm, running, waiting, res)
        if check_every and res.steps % check_every == 0:
            bm.check_integrity([s for _, s in running])
    bm.check_integrity([])
    return res


def _grow(bm: BlockManager, running, waiting, res: SimResult):
    """Every running request gets its next token; finished ones free their blocks; without a
    free block the latest-admitted request is preempted (freed, back to the queue's head)."""
    kept = []
    for r, seq in running:
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(0)
        if len(seq) >= r.final_len:
            bm.free(seq)
            continue
        kept.append((r, seq))
    i = 0
    while i < len(kept):
        while not bm.can_append(kept[i][1]):
            victim_r, victim = kept.pop()           # the latest admitted; possibly kept[i] itself
            bm.free(victim)
            waiting.insert(0, (victim_r, victim))
            res.preemptions += 1
            if len(kept) == i:
                return kept
        bm.append_slots(kept[i][1])
        i += 1
    return kept


def _account(res: SimResult, step: Breakdown, saturated: bool) -> None:
    res.steps += 1
    if saturated:
        res.saturated_steps += 1
        res.sums.add(step)


def sample_requests(lengths: tuple[LogNormal, LogNormal], n: int, max_len: int, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    outs = lengths[1].sample(rng, n, 1, max_len // 2)
    prompts = np.minimum(lengths[0].sample(rng, n, 1, max_len // 2), max_len - outs)
    return [Req(int(p), int(o)) for p, o in zip(prompts, outs)]


def run(workload: str, n: int, pool_tokens: int, max_len: int, seed: int) -> dict:
    reqs = sample_requests({"sharegpt": SHAREGPT, "alpaca": ALPACA}[workload], n, max_len, seed)
    sims = [simulate_contiguous(reqs, pool_tokens, p, max_len) for p in ("max", "pow2", "oracle")]
    sims.append(simulate_paged(reqs, pool_tokens, check_every=97))
    return {"workload": workload, "num_requests": n, "prompt_mean": float(np.mean([r.prompt_len for r in reqs])),
            "output_mean": float(np.mean([r.output_len for r in reqs])),
            "systems": [s.figures(pool_tokens) for s in sims]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--pool-tokens", type=int, default=65536, help="2 GiB of fp32 KV for the 58.5M Llama")
    ap.add_argument("--max-len", type=int, default=2048, help="Orca (Max) reservation; OPT's 2048 as in the paper")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = {"bench": "memory_fragmentation", "args": vars(args), "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
           "workloads": [run(w, args.num_requests, args.pool_tokens, args.max_len, args.seed)
                         for w in ("sharegpt", "alpaca")]}
    for w in out["workloads"]:
        print(f"\n{w['workload']}: {w['num_requests']} requests, prompt mean {w['prompt_mean']:.0f}, output mean "
              f"{w['output_mean']:.0f}; pool {args.pool_tokens} token slots; shares of the pool while requests wait")
        print(f"  {'system':18s} {'tokens':>7s} {'reserv.':>8s} {'int.frag':>8s} {'ext.frag':>8s} {'free':>6s} "
              f"{'tokens/held':>11s} {'batch':>6s} {'steps':>6s} {'preempt':>7s}")
        for s in w["systems"]:
            print(f"  {s['system']:18s} {s['token_states']:7.1%} {s['reservation']:8.1%} {s['internal_frag']:8.1%} "
                  f"{s['external_frag']:8.1%} {s['free']:6.1%} {s['tokens_per_held_slot']:11.1%} "
                  f"{s['mean_running']:6.1f} {s['steps']:6d} {s['preemptions']:7d}")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_fragmentation.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
