"""Rank 0's side of tensor parallelism: `TPModelRunner` has ModelRunner's interface, so LLMEngine
(one scheduler, one BlockManager, in rank 0's process) drives tp ranks without knowing it.

Each step:
  1. copy_blocks / swap_blocks / enable_swap / write_blocks: rank 0 acts on its shard at once and
     logs the call (block_log.py); the log rides along with the next message and each worker
     replays it before its forward
  2. execute: build the ForwardBatch, broadcast it and the logged block ops to the workers
  3. every rank runs its shard of the model over its shard of the pool; the row-parallel
     all-reduces keep the hidden states identical (replicated) on every rank
  4. rank 0 alone computes logits and returns them to the engine, which samples
  a collective that fails or waits past --tensor-parallel-timeout-s (a worker that stopped
  answering) leaves the ranks out of step: that call and every later one raise RunnerBroken,
  and the engine's process ends (a node says goodbye; the router moves its requests)

Blocks between nodes travel with all heads (what a tp = 1 pool holds), whatever either side's tp:

    gather_blocks  prefill node: every rank's heads of some blocks, assembled on rank 0
                   rank 0 [h0 h1] + rank 1 [h2 h3]  ->  [h0 h1 h2 h3]   (a GATHER message)
    write_blocks   decode node: rank 0 keeps its heads now, each worker gets its own with the
                   next message (a SCATTER op); a received block is read only by a later step
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
import weakref
from typing import Iterator

import torch

from engine.block_manager import BlockCopy
from engine.config import EngineConfig, ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_pool import allocate_kv_cache
from engine.runner_base import BlockExport, RunnerBase, RunnerBroken, WriteBlocks
from engine.model_runner import ModelRunner
from engine.parallel.block_log import BlockLog
from engine.parallel.group import TPGroup, host_store
from engine.parallel.sharding import check_shardable, shard_model
from engine.parallel.step_message import (BlockOp, batch_to, send_gather, send_scattered, send_shutdown,
                                          send_step)
from engine.parallel.worker import WorkerSpec, load_rank, to_argv
from engine.scheduler import ScheduledSeq
from engine.swap import BlockMove
from engine.weights import load_model

STARTUP_TIMEOUT_S = 600.0    # workers loading their model
SHUTDOWN_TIMEOUT_S = 10.0
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_runner(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> RunnerBase:
    """A ModelRunner for tensor_parallel_size 1, else a TPModelRunner over that many ranks."""
    bs = config.cache.block_size
    if config.tensor_parallel_size == 1:
        device = config.torch_device
        kv_cache = allocate_kv_cache(model_config, num_blocks, bs, device)
        return ModelRunner(load_model(model_config, device), kv_cache, bs)
    return TPModelRunner(config, model_config, num_blocks)


def close_runner(runner: RunnerBase) -> None:
    """Stop a runner's worker processes, if it has any (idempotent)."""
    runner.close()


class TPModelRunner(RunnerBase):
    """Runs the model over `tp` ranks: this process is rank 0, ranks 1..tp-1 are worker processes.
    A failed worker or collective raises RunnerBroken from execute and gather_blocks, then and
    at every later call: the engine cannot step after."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int):
        tp = config.tensor_parallel_size
        check_shardable(model_config, tp)
        device = _rank0_device(config.torch_device, tp)
        self.block_size = bs = config.cache.block_size
        self._store, port = host_store(STARTUP_TIMEOUT_S)
        timeout = config.tensor_parallel_timeout_s
        spec = WorkerSpec(os.path.abspath(model_config.path), _dtype_name(model_config.dtype), config.max_model_len,
                          num_blocks, bs, device.type, tp, port, STARTUP_TIMEOUT_S, timeout,
                          max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
        self._workers = [_spawn(dataclasses.replace(spec, rank=r)) for r in range(1, tp)]
        self._finalizer = weakref.finalize(self, _kill, self._workers)
        try:
            model, self.kv_cache = load_rank(model_config, num_blocks, bs, tp, device)
            _wait_ready(self._store, self._workers)
            self.group = TPGroup(self._store, 0, tp, device, timeout)
        except BaseException:
            self._finalizer()
            raise
        self.model = shard_model(model, 0, tp, self.group.all_reduce)
        # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads // tp, head_dim], rank 0's heads
        self._local = ModelRunner(self.model, self.kv_cache, bs)
        self._log = BlockLog()         # block ops done here, not yet on the workers
        self._closed = False
        self._broken: str | None = None     # why the ranks are out of step; None while they are not

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world

    @property
    def _full_block_shape(self) -> tuple[int, ...]:
        """One block with every rank's heads: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        layers, two, bs, heads, dim = self.kv_cache.shape[1:]
        return (layers, two, bs, heads * self.group.world, dim)

    @property
    def swap_cache(self) -> torch.Tensor | None:
        return self._local.swap_cache          # rank 0's heads of the host swap pool

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy here now; the workers copy at the start of the next message, before any forward."""
        self._local.copy_blocks(copies)
        self._log.add(BlockOp.COPY, [(c.src, c.dst) for c in copies])

    def enable_swap(self, num_blocks: int) -> None:
        self._local.enable_swap(num_blocks)
        self._log.add(BlockOp.ENABLE_SWAP, [(num_blocks, 0)])

    def swap_blocks(self, out: list[BlockMove], into: list[BlockMove]) -> None:
        """Swap out, then in, here now; the workers likewise at the start of the next message."""
        self._local.swap_blocks(out, into)
        self._log.add(BlockOp.SWAP_OUT, [(m.src, m.dst) for m in out])
        self._log.add(BlockOp.SWAP_IN, [(m.src, m.dst) for m in into])

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Pool blocks `block_ids` take `blocks` [n, num_layers, 2, block_size, num_kv_heads, head_dim],
        all heads (a block from another node): rank 0's heads now, the workers' at the start of
        the next message, before any forward. ValueError unless shape and dtype fit the pool."""
        expected = (len(block_ids),) + self._full_block_shape
        if tuple(blocks.shape) != expected or blocks.dtype != self.kv_cache.dtype:
            raise ValueError(f"write_blocks takes {expected} {self.kv_cache.dtype}, "
                             f"got {tuple(blocks.shape)} {blocks.dtype}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache[ids] = blocks[..., :self.kv_cache.shape[4], :].to(self.kv_cache.device)
        self._log.add_written(block_ids, blocks)

    def export_blocks(self, block_ids: list[int]) -> BlockExport:
        """A host copy gathered from every rank, held by the caller until sent."""
        return BlockExport(self.gather_blocks(block_ids), list(range(len(block_ids))), aliases_pool=False)

    def block_writer(self) -> WriteBlocks | None:
        return self.write_blocks        # each rank takes its heads of every received block

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of pool blocks with every rank's heads:
        [n, num_layers, 2, block_size, num_kv_heads, head_dim] (a collective with the workers)."""
        self._check_workers()
        ids = torch.tensor(block_ids, dtype=torch.long)
        ops, written = self._log.take()
        with self._collectives():
            send_gather(self.group, ids, ops)
            send_scattered(self.group, written)
            shards = self.group.gather(self.kv_cache[ids.to(self.kv_cache.device)].cpu())
        return torch.cat(shards, dim=4)      # rank r holds heads [r*H/tp, (r+1)*H/tp)

    def build_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        return self._local.build_batch(scheduled)

    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits (the model's dtype) for the scheduled sequences that sample, then for the
        prompt-logprob positions: [R + P, vocab], as ModelRunner.execute."""
        self._check_workers()
        batch = self.build_batch(scheduled)
        ops, written = self._log.take()
        with self._collectives():
            send_step(self.group, batch_to(batch, torch.device("cpu")), ops)
            send_scattered(self.group, written)
            hidden = self.model(batch, self.kv_cache)
        return self.model.compute_logits(hidden)

    def close(self) -> None:
        """Tell the workers to exit and wait for them (killed after a timeout); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None and all(p.poll() is None for p in self._workers):   # else: kill
            try:
                send_shutdown(self.group)
                for p in self._workers:
                    p.wait(SHUTDOWN_TIMEOUT_S)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self._finalizer()                                     # kills whoever is left
        self.group.close()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def worker_exit_codes(self) -> list[int | None]:
        """Ranks 1..tp-1: None while running."""
        return [p.poll() for p in self._workers]

    def _check_workers(self) -> None:
        if self._closed:
            raise RuntimeError("this tensor-parallel runner is closed")
        if self._broken is not None:
            raise RunnerBroken(self._broken)
        for rank, p in enumerate(self._workers, start=1):
            if p.poll() is not None:
                self._broken = f"tensor-parallel worker rank {rank} exited with code {p.returncode}"
                raise RunnerBroken(self._broken)

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """Collectives with the workers: any error inside (a timeout among them) leaves the ranks
        out of step, so it breaks the runner (RunnerBroken now and at every later call)."""
        try:
            yield
        except Exception as err:    # noqa: BLE001 -- gloo / NCCL raise RuntimeError subclasses of many kinds
            self._broken = (f"a tensor-parallel step failed, the ranks are out of step "
                            f"(--tensor-parallel-timeout-s {self.group.op_timeout_s:g}): {err}")[:500]
            raise RunnerBroken(self._broken) from err


def _rank0_device(device: torch.device, tp: int) -> torch.device:
    if device.type != "cuda":
        return torch.device("cpu")
    if torch.cuda.device_count() < tp:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} CUDA devices, "
                         f"found {torch.cuda.device_count()}")
    return torch.device("cuda", 0)


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(to_argv(spec), stdin=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path))


def _wait_ready(store, workers: list[subprocess.Popen]) -> None:
    """Until every worker has loaded; a worker that exits first (or a timeout) raises RuntimeError."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for rank, p in enumerate(workers, start=1):
        while not store.check([f"ready/{rank}"]):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code "
                                   f"{p.returncode} while loading")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker rank {rank} not ready after {STARTUP_TIMEOUT_S} s")
            time.sleep(0.02)


def _kill(workers: list[subprocess.Popen]) -> None:
    """Kill the workers still running and close their stdin pipes (a finalizer: holds no runner)."""
    for p in workers:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdin is not None:
            p.stdin.close()


def _dtype_name(dtype: torch.dtype) -> str:
    """The engine's resolved dtype as a config string: every rank loads exactly that."""
    return str(dtype).replace("torch.", "")
