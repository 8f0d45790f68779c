"""From the prefill node's last forward to the decode node's first decode step, for a long prompt.

    .venv/bin/python bench/prefill_gap.py [--tokens 4096,8192] [--repeats 3] [--chunk 2048] [--layer-groups 8]

Prefill side (this process): the prefill node's own pieces, an LLMEngine whose StepObserver is
the node's BlockShipper over a ZmqSender, and the node's Commit after the first token. Decode
side (a spawned process): an LLMEngine that reserves the prompt's blocks, a ZmqReceiver writing
into its pool, and on TransferCommitted the engine's adopt() and its first decode step().
Both sides stamp time.perf_counter() (CLOCK_MONOTONIC, one clock for every process here).

  last forward   the step whose forward computed the prompt's last chunk returned (its last
                 layer ran); the shipper then ships what that chunk completed
  gap            last forward -> the decode node's first decode step starts (transfer tail,
                 the prefill node's sampling and Commit, the receiver's poll, adopt)
  first step     the decode node's first step, for scale
  layer ms       one decoder layer's forward over the last chunk (hooks stamp each layer's end)
  gap if G groups   the gap projected from this run's stamps had the last chunk's blocks shipped in
                 G layer groups, each as soon as its last layer returned (layer_group_gap_ms);
                 G = 1 recomputes today's gap from its parts, as a check of the projection
  breakdown      from last forward: commit sent (the prefill node shipped the last chunk's
                 blocks, sampled, sent the Commit), last block (the decode node's receiver wrote
                 the prompt's last block), commit seen (TransferCommitted), adopt (commit seen ->
                 first step starts: adopt() and the step's scheduling up to its start)
  overlap        share of the prompt's blocks already in the decode node's pool at last forward

Modes, alternating within each repetition (repetition 0 warms up on a short prompt):
  per_chunk      each chunk's full blocks ship as soon as they are final (--kv-layer-groups 1)
  by_layer       the same, but the last chunk's blocks ship in --layer-groups layer groups during its
                 forward (the prefill node's --kv-layer-groups)
  at_end         every block ships after the last forward (no overlap), for comparison

Model: the peers' 58.5M random Llama (bench/random_model.py) with 16384 positions, float32, on
whatever cores the machine has (shared here: say so beside any figure). Writes
bench/results/prefill_gap_<time>.json.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")    # as engine/__init__.py, but before anything loads torch

from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from kvtransport.events import TransferCommitted  # noqa: E402
from kvtransport.receiver_state import Reservation  # noqa: E402
from kvtransport.zmq_receiver import ZmqReceiver  # noqa: E402
from kvtransport.zmq_sender import ZmqSender  # noqa: E402
from pdwire.handshake import KVLayout, PeerIdentity, new_epoch  # noqa: E402
from pdwire.sampling_params import SamplingParams  # noqa: E402
from node_shell.shipper import BlockShipper, Shipment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = b"prefill-gap-bench-secret-0123456"
WARMUP_TOKENS = 512      # repetition 0 of each mode: a short prompt warms the engines up
PEER_TIMEOUT = 300.0     # also the lease: one prefill step of 2048 tokens may take 30 s on a loaded machine
MODES = ("per_chunk", "by_layer", "at_end")
LAYER_GROUPS = (1, 2, 4, 8)   # per-layer-group shipping, projected from this run's stamps (1: as today)


def engine_config(path: str, chunk: int) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", cache=CacheConfig(kv_cache_gib=0.6),
                        scheduler=SchedulerConfig(max_num_batched_tokens=chunk))


def identity(engine: LLMEngine, node_id: str) -> PeerIdentity:
    return PeerIdentity(node_id, new_epoch(), "zmq", KVLayout.for_pool(engine.runner.kv_cache, "gap-bench"))


def decode_process(conn, path: str, chunk: int) -> None:
    """Reserves each prompt it is sent, receives its blocks, adopts them and runs one step; reports
    (blocks-written timeline, commit seen, first step start, first step end)."""
    engine = LLMEngine(engine_config(path, chunk))
    recv = ZmqReceiver(engine.runner.kv_cache, identity(engine, "gap-d"), SECRET, peer_timeout=PEER_TIMEOUT)
    conn.send(recv.endpoint)
    while True:
        while not conn.poll(0):                 # pairing and heartbeats go on between prompts
            recv.poll(0.005)
        if (cmd := conn.recv()) is None:
            break
        rid, prompt = cmd
        table, cached, _ = engine.reserve(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0), 2)
        recv.register(Reservation(rid, tuple(table), cached, lease_s=PEER_TIMEOUT, num_tokens=len(prompt)))
        conn.send((tuple(table), cached))
        timeline, base, event = [], recv.metrics.blocks_written, None
        written = base
        while event is None:
            events = recv.poll(0.0005)
            if recv.metrics.blocks_written != written:
                written = recv.metrics.blocks_written
                timeline.append((time.perf_counter(), written - base))
            event = events[0] if events else None
        if not isinstance(event, TransferCommitted):
            conn.send(("failed", f"{event}; drops {dict(recv.metrics.drops)}, {written - base} blocks written"))
            continue
        seen = time.perf_counter()
        engine.adopt(rid, event.first_token)
        start = time.perf_counter()
        engine.step()
        conn.send((timeline, seen, start, time.perf_counter()))
        engine.abort_request(rid)
        engine.check_integrity()
    recv.close()


class AtEndShipper(BlockShipper):
    """Ships a prompt's blocks only once its last chunk is computed (no overlap with prefill)."""

    def on_computed(self, group, seq) -> None:
        s = self.shipments.get(group.request_id)
        if s is not None and seq.num_computed_tokens >= s.prompt_len:
            super().on_computed(group, seq)


class Stamp:
    """A StepObserver that notes when the forward of a prompt's last chunk returned, and when each
    of its decoder layers did (forward hooks: layer i's K/V of the chunk is final then), then ships."""

    def __init__(self, shipper: BlockShipper) -> None:
        self.shipper, self.last_forward = shipper, 0.0
        self._ends: list[float] = []                    # the latest forward's, per layer
        self.layer_ends: list[float] = []               # the last chunk's

    def watch(self, model) -> None:
        """Stamp the end of each of model's decoder layers (tp = 1: the model runs in this process)."""
        self._ends = [0.0] * len(model.layers)
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(lambda module, args, out, i=i: self._ends.__setitem__(i, time.perf_counter()))

    def before_forward(self, scheduled) -> None:
        self.shipper.before_forward(scheduled)

    def on_computed(self, group, seq) -> None:
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            self.last_forward = time.perf_counter()
            self.layer_ends = list(self._ends)
        self.shipper.on_computed(group, seq)


def layer_group_gap_ms(layer_ends_ms: list[float], transfer_ms: float, commit_ms: float, adopt_ms: float,
                       groups: int) -> float:
    """The gap had each of `groups` layer groups' slices of the last chunk's blocks shipped as
    soon as the group's last layer returned (layer_ends_ms: from last forward, negative before
    it), the last group's at last forward as today (conservative: it could leave before the final
    norm and logits): slices queue on the one connection, each taking transfer_ms / groups (a
    transfer's time is proportional to its bytes: at_end against per_chunk), and the Commit
    follows the first token as today. groups=1 is today's shipping: max(last block, commit) + adopt."""
    n, done = len(layer_ends_ms), float("-inf")
    for g in range(groups):
        ready = 0.0 if g == groups - 1 else layer_ends_ms[(g + 1) * n // groups - 1]
        done = max(done, ready) + transfer_ms / groups
    return max(done, commit_ms) + adopt_ms


def prefill_once(engine: LLMEngine, stamp: Stamp, sender: ZmqSender, endpoint: str, conn, rid: str,
                 prompt: list[int], keepalive) -> dict:
    """One prompt through the prefill side; returns the decode side's timings against ours.
    keepalive() polls every sender between steps, as the prefill node's loop does (heartbeats)."""
    conn.send((rid, prompt))
    table, cached = conn.recv()
    assert cached == 0, "the decode node caches part of the prompt: nothing to measure"
    sender.begin(rid, endpoint)
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    stamp.shipper.track(Shipment(rid, rid, table, len(prompt), cached))
    start = commit_sent = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                sender.commit(rid, out.outputs[0].token_ids[0], len(prompt))
                commit_sent = time.perf_counter()
                stamp.shipper.close(rid)
        keepalive()
    while not conn.poll(0.01):
        keepalive()
    reply = conn.recv()
    if reply[0] == "failed":
        raise RuntimeError(f"transfer failed: {reply[1]}; sender {sender.metrics}")
    timeline, seen, step_start, step_end = reply
    while not sender.is_sent(rid):
        sender.poll(0.001)
    stamp.shipper.release_sent()
    last = stamp.last_forward
    early = max((n for t, n in timeline if t <= last), default=0)
    ends = [(t - last) * 1e3 for t in stamp.layer_ends]
    got = {"prefill_s": last - start, "commit_sent_ms": (commit_sent - last) * 1e3,
           "last_block_ms": (timeline[-1][0] - last) * 1e3, "commit_seen_ms": (seen - last) * 1e3,
           "adopt_ms": (step_start - seen) * 1e3, "gap_ms": (step_start - last) * 1e3,
           "first_step_ms": (step_end - step_start) * 1e3, "overlap": early / len(table),
           "blocks": len(table), "layer_ms": (ends[-1] - ends[0]) / (len(ends) - 1)}
    for groups in LAYER_GROUPS:
        got[f"gap_if_{groups}_groups_ms"] = layer_group_gap_ms(ends, got["last_block_ms"], got["commit_sent_ms"],
                                                               got["adopt_ms"], groups)
    return got


def run(path: str, tokens: int, repeats: int, chunk: int, layer_groups: int) -> dict[str, list[dict]]:
    conn, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=decode_process, args=(child, path, chunk))
    proc.start()
    endpoint = conn.recv()
    sides = {}
    shippers = {"per_chunk": BlockShipper(), "by_layer": BlockShipper(layer_groups), "at_end": AtEndShipper()}
    for mode, shipper in shippers.items():
        stamp = Stamp(shipper)
        engine = LLMEngine(engine_config(path, chunk), observer=stamp)
        stamp.watch(engine.runner.model)
        sides[mode] = (engine, stamp, ZmqSender(identity(engine, f"gap-p-{mode.replace('_', '-')}"), SECRET,
                                                peer_timeout=PEER_TIMEOUT))
    for engine, stamp, sender in sides.values():
        sender.connect(endpoint)
        stamp.shipper.bind(engine, sender)
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    rng = random.Random(tokens)
    keepalive = lambda: [s[2].poll(0.0) for s in sides.values()]     # noqa: E731
    try:
        for rep in range(repeats + 1):
            for mode in MODES:
                n = tokens if rep else WARMUP_TOKENS
                prompt = [rng.randrange(100, 31000) for _ in range(n)]      # no prefix cache hits
                engine, stamp, sender = sides[mode]
                result = prefill_once(engine, stamp, sender, endpoint, conn, f"{mode}-{tokens}-{rep}", prompt,
                                      keepalive)
                if rep:
                    got[mode].append(result)
                print(f"  {tokens} tokens {mode:9s} rep {rep}: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in result.items()), flush=True)
    finally:
        conn.send(None)
        proc.join(timeout=30)
        for engine, _, sender in sides.values():
            sender.close()
            engine.check_integrity()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--layer-groups", type=int, default=8, help="by_layer mode's --kv-layer-groups")
    args = ap.parse_args()
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m-16k"), max_position_embeddings=16384)
    rows = []
    load = os.getloadavg()
    for tokens in map(int, args.tokens.split(",")):
        got = run(path, tokens, args.repeats, args.chunk, args.layer_groups)
        for mode, results in got.items():
            row = {"tokens": tokens, "mode": mode, "chunk": args.chunk,
                   **{k: statistics.median(r[k] for r in results) for k in results[0]},
                   "gap_ms_range": [min(r["gap_ms"] for r in results), max(r["gap_ms"] for r in results)]}
            rows.append(row)
            print(f"{tokens} tokens, {mode:9s}: gap {row['gap_ms']:.1f} ms ({row['gap_ms_range'][0]:.1f}-"
                  f"{row['gap_ms_range'][1]:.1f}), commit sent {row['commit_sent_ms']:.1f}, last block "
                  f"{row['last_block_ms']:.1f}, commit seen {row['commit_seen_ms']:.1f}, adopt {row['adopt_ms']:.2f} ms, "
                  f"first step {row['first_step_ms']:.1f} ms, overlap {row['overlap']:.0%}, prefill "
                  f"{row['prefill_s']:.2f} s, layer {row['layer_ms']:.0f} ms; gap if 1/2/4/8 layer groups "
                  + "/".join(f"{row[f'gap_if_{g}_groups_ms']:.1f}" for g in LAYER_GROUPS) + " ms")
    print("wrote", write_result("prefill_gap", {"rows": rows, "repeats": args.repeats,
                                                "load_avg_before": load, "load_avg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
