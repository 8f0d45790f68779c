"""A tensor-parallel worker (rank >= 1): `python -m engine.parallel '<WorkerSpec JSON>'`.

Lifecycle:
  1. join rank 0's TCPStore; load the whole model and allocate this rank's KV pool shard
  2. set `ready/<rank>` in the store (rank 0 waits for every worker, watching for early exits)
  3. build the tp groups, keep this rank's slice of the weights (`shard_model`)
  4. loop: receive a message, replay its block ops (copies, swaps, this rank's heads of blocks
     written from another node) through a ModelRunner of this rank's shard, then either run
     the batch (its all-reduces pair with the other ranks'; no logits, rank 0 alone samples)
     or send rank 0 this rank's heads of the blocks it gathers
  5. SHUTDOWN ends the loop; EOF on stdin (rank 0's process is gone) exits at once
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass

import torch

from engine.block_manager import BlockCopy
from engine.config import ModelConfig
from engine.kv_pool import allocate_kv_cache
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup, join_store
from engine.parallel.sharding import shard_model
from engine.parallel.step_message import BlockOp, Op, batch_to, receive, receive_scattered
from engine.step_memory import retain_step_memory
from engine.swap import BlockMove
from engine.weights import load_model


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs, passed as JSON on its command line."""
    model_path: str
    dtype: str                      # the engine's resolved dtype ("float32", "bfloat16", "float16")
    max_model_len: int | None
    num_blocks: int
    block_size: int
    device_type: str                # "cpu" | "cuda": rank r uses cuda:r
    world: int                      # tensor_parallel_size
    store_port: int                 # rank 0's TCPStore on 127.0.0.1
    timeout_s: float                # joining the store
    op_timeout_s: float             # one collective inside a step (--tensor-parallel-timeout-s)
    rank: int = 0
    max_num_batched_tokens: int = 2048  # a step's tokens: the activations the rank keeps mapped (engine/step_memory.py)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank) if self.device_type == "cuda" else torch.device("cpu")


def load_rank(cfg: ModelConfig, num_blocks: int, block_size: int, world: int,
              device: torch.device) -> tuple[CausalLM, torch.Tensor]:
    """The whole model (sharded later, once the group exists) and this rank's zeroed KV pool."""
    return load_model(cfg, device), allocate_kv_cache(cfg, num_blocks, block_size, device, world)


def serve(runner: ModelRunner, group: TPGroup) -> None:
    """Run rank 0's messages on this rank's shard until SHUTDOWN."""
    while (msg := receive(group)).op is not Op.SHUTDOWN:
        replay(runner, msg.block_ops, receive_scattered(group, msg, runner.kv_cache))
        if msg.op is Op.STEP:
            runner.model(batch_to(msg.batch, runner.device), runner.kv_cache)
        else:
            group.gather(runner.kv_cache[msg.block_ids.to(runner.device)].cpu())


def replay(runner: ModelRunner, block_ops: torch.Tensor, scattered: torch.Tensor | None = None) -> None:
    """Make rank 0's runner calls [3, N] (kind, a, b) on this runner, in order; SCATTER ops
    take their block from `scattered` [K, L, 2, block_size, H/tp, D], this rank's heads."""
    for kind, run in itertools.groupby(zip(*block_ops.tolist()), key=lambda op: BlockOp(op[0])):
        pairs = [(a, b) for _, a, b in run]
        if kind is BlockOp.SCATTER:
            dst, src = zip(*pairs)
            runner.kv_cache[torch.tensor(dst, device=runner.device)] = scattered[list(src)].to(runner.device)
        elif kind is BlockOp.COPY:
            runner.copy_blocks([BlockCopy(a, b) for a, b in pairs])
        elif kind is BlockOp.SWAP_OUT:
            runner.swap_blocks([BlockMove(a, b) for a, b in pairs], [])
        elif kind is BlockOp.SWAP_IN:
            runner.swap_blocks([], [BlockMove(a, b) for a, b in pairs])
        else:
            runner.enable_swap(pairs[-1][0])


def main(spec: WorkerSpec) -> None:
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    device = spec.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:   # the ranks share the host's cores; oversubscribed OpenMP threads spin against each other
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    store = join_store(spec.store_port, spec.timeout_s)
    cfg = ModelConfig.from_pretrained(spec.model_path, spec.dtype, spec.max_model_len)
    if device.type == "cpu":            # as rank 0's LLMEngine: every rank's steps wait for the slowest
        retain_step_memory(cfg, spec.max_num_batched_tokens)
    model, kv_cache = load_rank(cfg, spec.num_blocks, spec.block_size, spec.world, device)
    store.set(f"ready/{spec.rank}", "1")
    group = TPGroup(store, spec.rank, spec.world, device, spec.op_timeout_s)
    try:
        serve(ModelRunner(shard_model(model, spec.rank, spec.world, group.all_reduce), kv_cache,
                          spec.block_size), group)
    finally:
        group.close()


def _exit_when_parent_dies() -> None:
    """Rank 0 holds our stdin's write end; EOF means its process ended, however it ended."""
    while os.read(sys.stdin.fileno(), 4096):   # raw reads: no buffered-stdin lock at shutdown
        pass
    print("pdserve tp worker: rank 0 is gone, exiting", file=sys.stderr, flush=True)
    os._exit(1)


def to_argv(spec: WorkerSpec) -> list[str]:
    # -P: no cwd on sys.path, so the worker imports the engine rank 0 runs (PYTHONPATH, see runner)
    return [sys.executable, "-P", "-m", "engine.parallel", json.dumps(asdict(spec))]


def from_argv(argv: list[str]) -> WorkerSpec:
    return WorkerSpec(**json.loads(argv[1]))
