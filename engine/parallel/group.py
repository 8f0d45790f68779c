"""The tensor-parallel process group: rank 0 (the engine process) hosts a TCPStore on loopback,
the workers join it, and every rank builds two groups on it:

    control  gloo, CPU tensors: rank 0 broadcasts each step's message (no CUDA-side timeout
             while workers sit idle waiting for the next step) and scatters / gathers the head
             slices of KV blocks that travel between nodes
    compute  the all-reduces inside the model: NCCL for CUDA ranks, else the control group

The groups are built directly (no torch.distributed default group), so several engines can live
in one process.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"
JOIN_TIMEOUT = datetime.timedelta(minutes=5)     # building the groups (every rank has loaded its model)
IDLE_TIMEOUT = datetime.timedelta(days=3650)     # a worker waiting for the next step


def host_store(timeout: float) -> tuple[dist.TCPStore, int]:
    """Rank 0's store on a free loopback port (bound before the store takes it: no race)."""
    sock = socket.create_server((STORE_HOST, 0))
    port = sock.getsockname()[1]
    store = dist.TCPStore(STORE_HOST, port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), timeout=datetime.timedelta(seconds=timeout))
    return store, port


def join_store(port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


class TPGroup:
    """One rank's view of the tp ranks. Every rank must call the same collectives in the same order.
    A collective inside a step (a broadcast of it, an all-reduce, a scatter or gather) waits at
    most op_timeout_s for the other ranks (--tensor-parallel-timeout-s), then raises: a rank
    that stopped answering; the ranks are out of step from then on."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, op_timeout_s: float):
        self.rank, self.world, self.op_timeout_s = rank, world, op_timeout_s
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=STORE_HOST)]
        opts._timeout = JOIN_TIMEOUT
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("pdserve-tp/control", store), rank, world, opts)
        self.control._set_default_timeout(self._op_timeout)
        self.compute = self.control
        if device.type == "cuda":
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("pdserve-tp/compute", store), rank, world)
            self.compute._set_default_timeout(self._op_timeout)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` in place over every rank."""
        self.compute.allreduce([t]).wait()

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's CPU tensor `t` into every rank's `t`; `idle`: the worker may wait indefinitely."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = IDLE_TIMEOUT if idle else self._op_timeout
        self.control.broadcast([t], opts).wait()

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's CPU tensor `t` (one shape and dtype on every rank), in rank order, on rank 0;
        None elsewhere. Moved as bytes, so any dtype goes (gloo lacks some, e.g. float8)."""
        raw = t.contiguous().view(torch.uint8)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(raw) for _ in range(self.world)] if self.rank == 0 else None
        self.control.gather([parts] if parts else [], [raw], opts).wait()
        return None if parts is None else [p.view(t.dtype) for p in parts]

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> None:
        """Rank 0's CPU tensor parts[r] into rank r's contiguous `out`; `parts` on rank 0 only.
        Moved as bytes, like gather."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        raw = [[p.contiguous().view(torch.uint8) for p in parts]] if self.rank == 0 else []
        self.control.scatter([out.view(torch.uint8)], raw, opts).wait()

    def close(self) -> None:
        for pg in [self.control] + ([self.compute] if self.compute is not self.control else []):
            try:
                pg.shutdown()
            except Exception:   # noqa: BLE001 - backends differ in what shutdown supports
                pass
