"""Measures a Profile on this machine: a real engine (the one a node runs, with the node's flags),
timed step by step, and a real ZeroMQ socket pair shipping blocks of the engine's block size.

Experiments (each step's scheduled (new tokens, context) pairs are read off the scheduler's own
plan, so chunking and prefix hits are whatever the engine really did):
  1. prefill: one prompt of length L alone, at each chunk size (max_num_batched_tokens)
  2. prefill with a cached prefix: the same prompt again after a different last part; and a
     warm question: a cached document, then a short fresh question after it, alone (RAG's step:
     a few new tokens reading thousands of cached ones)
  3. decode: B sequences of context C, a few steps after their prompts are in
  4. mixed: a decode batch with a long prompt arriving (what a colocated engine runs), at chat
     and RAG shapes (a 3,072-token prompt beside 4-32 sequences of 256-2,048 context)
  5. transfer: blocks of the engine's block size over ZeroMQ TCP loopback, copied into a
     preallocated buffer on the receiving thread (as a decode node must)
"""
from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from engine.machine import machine_info
from pdplan.profile import Overheads, Profile, StepCost, StepSample, Transfer
from pdplan.speed_probe import probe_model
from pdplan.speed_sections import at_one_speed


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """What to measure; the defaults take about a minute for a 60M model on one CPU core."""
    prompt_lens: tuple[int, ...] = (16, 128, 512, 1024, 2048, 3072)
    chunk_sizes: tuple[int, ...] = (512, 2048)
    cached_prefixes: tuple[int, ...] = (1024, 2048)        # of a 3072-token prompt
    warm_documents: tuple[int, ...] = (1024, 2048, 3072)   # cached, then a question of each warm_tails
    warm_tails: tuple[int, ...] = (16, 32, 64)             # ... (the router prefills <= 64 on a decode node)
    warm_repeats: int = 3                                  # each (document, question), in a shuffled order
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (64, 512, 2048, 4096)     # up to 4k: long RAG contexts decode there
    max_batch_tokens: int = 16384                          # skips B x C over it (time, pool size)
    decode_steps: int = 4
    repeats: int = 2                                       # each decode point, in a shuffled order
    mixed: tuple[tuple[int, int, int], ...] = (            # decoding seqs, their context, the prompt that joins
        (16, 256, 1536), (32, 256, 3072), (8, 1024, 3072), (4, 2048, 3072))   # ... chats, and RAG's long prompts
    transfer_blocks: int = 64


class StepRecorder:
    """Wraps an engine's scheduler.schedule to keep each step's (new tokens, context) pairs."""

    def __init__(self, engine) -> None:
        self.last: list[tuple[int, int]] = []
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            self.last = [(s.num_new_tokens, s.seq.num_computed_tokens) for s in out.scheduled]
            return out
        engine.scheduler.schedule = recording


def timed_steps(engine, recorder: StepRecorder, kind: str, limit: int = 10_000) -> list[StepSample]:
    """Steps the engine until it has no work (or `limit` steps), timing each step."""
    samples = []
    while engine.has_unfinished_requests() and len(samples) < limit:
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if recorder.last:
            samples.append(StepSample(recorder.last, dt, kind))
    return samples


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, n)]


class Profiler:
    def __init__(self, engine_args, grid: ProfileGrid = ProfileGrid(), log=print, one_speed: bool = True):
        self.args, self.grid, self.log, self.one_speed = engine_args, grid, log, one_speed
        self.rng = np.random.default_rng(0)
        self._next = 0

    def _engine(self, chunk: int | None = None, prefix_caching: bool = True):
        """A fresh engine; the one before it is freed first (its callers hold it no longer), so a
        profile of a GPU node can size the KV pool as the node does: two pools would not fit."""
        import torch

        from engine.llm_engine import LLMEngine
        gc.collect()            # (an engine's scheduler and its StepRecorder hold each other)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        args = replace(self.args, enable_prefix_caching=prefix_caching,       # the grid's chunks as asked:
                       max_num_batched_tokens=chunk or self.args.max_num_batched_tokens,   # the nodes' cap is
                       long_prefill_token_threshold=0)                     # recorded (the simulator's), not applied
        engine = LLMEngine(args.engine_config())
        return engine, StepRecorder(engine)

    def _add(self, engine, prompt: list[int], max_tokens: int) -> None:
        from pdwire.sampling_params import SamplingParams
        self._next += 1
        engine.add_request(f"p{self._next}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))

    def prefill(self) -> list[StepSample]:
        samples = []
        for chunk in self.grid.chunk_sizes:
            engine, rec = self._engine(chunk, prefix_caching=False)
            vocab = engine.model_config.vocab_size
            self._add(engine, _ids(self.rng, 16, vocab), 1)        # warm-up, not kept
            timed_steps(engine, rec, "warmup")
            for n in self.grid.prompt_lens:
                self._add(engine, _ids(self.rng, min(n, engine.max_model_len - 1), vocab), 1)
                samples += timed_steps(engine, rec, "prefill")
            self.log(f"profile: prefill at chunk {chunk}: {len(samples)} steps")
            del engine, rec         # before the next chunk size's engine is made
        return samples

    def prefill_cached(self) -> list[StepSample]:
        engine, rec = self._engine()
        vocab = engine.model_config.vocab_size
        full = min(max(self.grid.cached_prefixes) + max(self.grid.prompt_lens) // 3, engine.max_model_len - 1)
        samples = []
        for k in self.grid.cached_prefixes:
            prefix = _ids(self.rng, k, vocab)
            self._add(engine, prefix + _ids(self.rng, full - k, vocab), 1)
            timed_steps(engine, rec, "warmup")
            self._add(engine, prefix + _ids(self.rng, full - k, vocab), 1)
            samples += timed_steps(engine, rec, "prefill_cached")
        self.log(f"profile: prefill with cached prefixes: {len(samples)} steps")
        return samples + self.prefill_warm(engine, rec)

    def prefill_warm(self, engine, rec: StepRecorder) -> list[StepSample]:
        vocab = engine.model_config.vocab_size
        docs = {d: _ids(self.rng, min(d, engine.max_model_len - 1 - max(self.grid.warm_tails)), vocab)
                for d in self.grid.warm_documents}
        for doc in docs.values():
            self._add(engine, doc, 1)
            timed_steps(engine, rec, "warmup")
        points = [(d, t) for d in docs for t in self.grid.warm_tails] * self.grid.warm_repeats
        self.rng.shuffle(points)
        samples = []
        for d, t in points:
            self._add(engine, docs[d] + _ids(self.rng, t, vocab), 1)
            samples += timed_steps(engine, rec, "prefill_warm")
        self.log(f"profile: warm questions on cached documents: {len(samples)} steps")
        return samples

    def decode(self) -> list[StepSample]:
        engine, rec = self._engine(prefix_caching=False)
        vocab = engine.model_config.vocab_size
        samples = []
        for ctx, b in self._decode_points():
            prefill_steps = -(-b * ctx // self.args.max_num_batched_tokens) + b   # then all decode together
            if not self._fits(engine, ctx, b, prefill_steps + self.grid.decode_steps):
                continue
            for _ in range(b):
                self._add(engine, _ids(self.rng, ctx, vocab), prefill_steps + self.grid.decode_steps)
            steps = timed_steps(engine, rec, "decode")
            samples += [s for s in steps if all(n == 1 for n, _ in s.shapes) and len(s.shapes) == b]
            self.log(f"profile: decode batch {b} context {ctx}")
        self.log(f"profile: decode: {len(samples)} steps")
        return samples

    def _fits(self, engine, ctx: int, b: int, max_tokens: int, prompt: int = 0, what: str = "") -> bool:
        """Whether b sequences of ctx + max_tokens (and a prompt of that many tokens beside them)
        fit the model's length and the KV pool (else the point is skipped, and said so)."""
        bs = engine.block_manager.block_size
        need = b * -(-(ctx + max_tokens) // bs) + (-(-(prompt + 1) // bs) if prompt else 0)
        if ctx + max_tokens > engine.max_model_len or need > engine.block_manager.num_blocks:
            self.log(f"profile: {what or f'decode batch {b} context {ctx}'} skipped: over the model's "
                     f"{engine.max_model_len} tokens or the pool's {engine.block_manager.num_blocks} blocks")
            return False
        return True

    def _decode_points(self) -> list[tuple[int, int]]:
        """Every (context, batch) of the grid, `repeats` times, in a shuffled order: on a machine
        whose speed drifts, the drift then does not line up with the context or the batch."""
        points = [(c, b) for c in self.grid.contexts for b in self.grid.batch_sizes
                  if b * c <= self.grid.max_batch_tokens and b <= self.args.max_num_seqs] * self.grid.repeats
        self.rng.shuffle(points)
        return points

    def mixed(self) -> list[StepSample]:
        """Each (batch, context, prompt) of the grid: `batch` sequences decoding at `context`, then a
        prompt joins; the steps that prefill a chunk of it beside the decode batch are kept."""
        engine, rec = self._engine()
        vocab = engine.model_config.vocab_size
        chunk = self.args.max_num_batched_tokens
        samples = []
        for batch, context, prompt in self.grid.mixed:
            prompt = min(prompt, engine.max_model_len - 1)
            decode_steps = -(-batch * context // chunk) + batch + -(-prompt // chunk) + 4
            if not self._fits(engine, context, batch, decode_steps, prompt, f"mixed {batch} x {context} + {prompt}"):
                continue
            for _ in range(batch):
                self._add(engine, _ids(self.rng, context, vocab), decode_steps)
            engine.step()
            while engine.has_unfinished_requests() and any(n > 1 for n, _ in rec.last):
                engine.step()                        # until every sequence of the batch decodes
            self._add(engine, _ids(self.rng, prompt, vocab), 1)
            samples += [s for s in timed_steps(engine, rec, "mixed")
                        if any(n > 1 for n, _ in s.shapes) and any(n == 1 for n, _ in s.shapes)]
            self.log(f"profile: mixed: {batch} decoding at {context} beside a {prompt}-token prompt")
        self.log(f"profile: mixed: {len(samples)} steps")
        return samples

    def speed(self) -> dict | None:
        """The machine's speed now on the model's linears (pdplan/speed_probe.py), in this process
        (its caller pins it as a node: one core, one thread); None off the CPU. Always the probe's
        one reference workload (ProbeShape()), as measure.py's: a record compares only with its kind."""
        config = self.args.engine_config()
        if config.torch_device.type != "cpu":
            return None
        return probe_model(config.model_path, config.dtype).to_dict()

    def run(self) -> Profile:
        """Every experiment, the machine's speed probed before and after each; on the CPU the
        steps are priced at one speed (pdplan/speed_sections.py) unless one_speed is off."""
        probes, sections = [self.speed()], []
        for experiment in (self.prefill, self.prefill_cached, self.decode, self.mixed):
            sections.append(experiment())
            if probes[0] is not None:
                probes.append(self.speed())
        samples = [s for steps in sections for s in steps]
        speed = {"before": probes[0], "after": probes[-1], "probes": probes} if probes[0] is not None else None
        if speed and self.one_speed:
            samples, speed["sections"] = at_one_speed(sections, probes)
            self.log("profile: steps priced at one speed, k by experiment: "
                     + ", ".join(f"{'+'.join(r['kinds'])} {r['k']:.2f}" for r in speed["sections"]))
        engine, _ = self._engine()
        from engine.kv_pool import block_bytes, num_blocks_for
        cfg = engine.model_config
        bs = self.args.block_size
        per_block = measure_transfer(block_bytes(cfg, bs), self.grid.transfer_blocks)
        self.log(f"profile: transfer: {per_block * 1e6:.0f} us per {block_bytes(cfg, bs) >> 10} KiB block")
        model = {"name": os.path.basename(os.path.normpath(cfg.path)), "layers": cfg.num_layers,
                 "hidden": cfg.hidden_size, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                 "dtype": str(cfg.dtype).removeprefix("torch."),
                 "kv_bytes_per_token": block_bytes(cfg, bs) // bs}
        machine = machine_description(engine) | ({"speed": speed} if speed else {})
        return Profile(machine, model, bs, num_blocks_for(cfg, engine.config.cache),
                       self.args.max_num_seqs, self.args.max_num_batched_tokens, StepCost.fit(samples),
                       Transfer(per_block, 2 * ZMQ_ROUND_TRIP_S, block_bytes(cfg, bs)),
                       Overheads(), "measured", False, samples, self.args.long_prefill_token_threshold)


ZMQ_ROUND_TRIP_S = 75e-6    # PEERS.md: a ZMQ round trip's p50 on this machine kind (73 us)


def measure_transfer(block_bytes: int, blocks: int) -> float:
    """Median seconds per block: PUSH -> PULL over TCP loopback, one copy into a preallocated pool."""
    import zmq
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    pool = np.empty((4, block_bytes), dtype=np.uint8)
    payload = np.ones(block_bytes, dtype=np.uint8)
    times: list[float] = []

    def receive():
        for i in range(blocks):
            if not pull.poll(10_000):
                return
            frame = pull.recv(copy=False)
            pool[i % 4] = np.frombuffer(frame.buffer, dtype=np.uint8)
            times.append(time.perf_counter())
    thread = threading.Thread(target=receive)
    thread.start()
    start = time.perf_counter()
    for _ in range(blocks):
        push.send(payload, copy=False)
    thread.join(30)
    push.close(0)
    pull.close(0)
    ctx.term()
    gaps = np.diff([start, *times])
    return float(statistics.median(gaps)) if len(gaps) else float("nan")


def machine_description(engine) -> dict:
    """The machine (engine/machine.py) and the device the profiled engine ran on."""
    return {**machine_info(), "device": str(engine.config.torch_device)}
