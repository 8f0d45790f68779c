"""Raw bytes of one pool block, read zero-copy on CPU and written straight into the pool.

kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, so
kv_cache[b] is one region of block_nbytes bytes. Bytes go through a uint8 view because numpy
has no bfloat16. On CUDA the bytes are staged through host memory (the zmq path is host-to-host;
the torch.distributed backend moves device tensors directly).

A block travels with every kv head (handshake.KVLayout). A pool holding all of them takes the
bytes straight in (InlineSink); one holding a tensor-parallel rank's share takes the block as a
tensor and spreads its heads over the ranks (BlockWriterSink + TPModelRunner.write_blocks).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from kvtransport.receiver_core import PayloadSink
from kvtransport.stream_copy import copy_into, prepare
from pdwire.handshake import KVLayout, dtype_name
from pdwire.messages import BlockFrame

TORCH_DTYPES: dict[str, torch.dtype] = {      # pdwire.handshake.KV_DTYPES' names as torch dtypes
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
WriteBlocks = Callable[[list[int], torch.Tensor], None]   # (pool block ids, blocks [n, L, 2, bs, H, D])


def block_view(kv_cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """The bytes of one block as a flat uint8 tensor aliasing the pool: [block_nbytes]."""
    return kv_cache[block_id].view(torch.uint8).view(-1)


def block_bytes(kv_cache: torch.Tensor, block_id: int) -> memoryview:
    """A memoryview of block_id's bytes: zero-copy for a CPU pool, a host copy for CUDA.

    The view aliases the pool: the caller must not overwrite the block until the transport
    says the bytes have left the process (KVSender.is_sent).
    """
    view = block_view(kv_cache, block_id)
    if view.device.type != "cpu":
        view = view.cpu()
    return memoryview(view.numpy())


def pool_bytes(kv_cache: torch.Tensor) -> memoryview | None:
    """The whole pool as one writable byte view (block b at b * block_nbytes), None unless the
    pool is a contiguous CPU tensor."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    return memoryview(kv_cache.view(torch.uint8).view(-1).numpy())


def write_block(kv_cache: torch.Tensor, block_id: int, payload: bytes | memoryview) -> None:
    """Copy payload (exactly block_nbytes bytes, checked by the caller) into block block_id."""
    src = np.frombuffer(payload, dtype=np.uint8)
    dst = block_view(kv_cache, block_id)
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), src)
    else:
        dst.copy_(torch.from_numpy(src.copy()))


def check_whole_blocks(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """ValueError unless a pool block is exactly a wire block (every head, same dtype), as
    writing payload bytes straight into the pool needs."""
    pool = (tuple(kv_cache.shape[1:]), dtype_name(kv_cache.dtype))
    if pool != (layout.block_shape, layout.kv_dtype):
        raise ValueError(f"pool blocks {pool} are not wire blocks {(layout.block_shape, layout.kv_dtype)}: "
                         "a pool holding some of the kv heads (tensor parallelism) needs a BlockWriterSink")


def block_tensor(payload: memoryview, layout: KVLayout) -> torch.Tensor:
    """One block's payload (exactly layout.block_nbytes bytes, checked by the caller) as a tensor
    [num_layers, 2, block_size, num_kv_heads, head_dim]; it aliases a writable payload."""
    raw = payload if not payload.readonly else bytearray(payload)
    return torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPES[layout.kv_dtype]).view(layout.block_shape)


class InlineSink(PayloadSink):
    """The payload is the BlockFrame's second frame (zmq, fake): copy it into the pool."""
    inline = True

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        check_whole_blocks(kv_cache, layout)
        self._kv_cache, self._nbytes = kv_cache, layout.block_nbytes
        self._layer_nbytes = layout.block_nbytes // layout.num_layers
        self._pool = pool_bytes(kv_cache)     # one copy a block (kvtransport/stream_copy.py), no tensor per block
        self.takes_layers = self.has_slots = self._pool is not None
        if self._pool is not None:
            prepare()                           # the landing copy built as the node starts, not on its first block
        # every whole block's view, made once (~200 bytes a block): slots() picks a batch's in one C call
        self._blocks = [] if self._pool is None else \
            [self._pool[b * self._nbytes:(b + 1) * self._nbytes] for b in range(kv_cache.shape[0])]

    def write(self, peer: str, frame: BlockFrame, payload: memoryview | None, dst: int) -> None:
        self.write_many([dst], [payload])

    def write_many(self, dsts: list[int], payloads: list[memoryview], first_layer: int = 0) -> None:
        if self._pool is None:                  # a device or strided pool: whole blocks only
            for dst, block in zip(dsts, payloads):
                write_block(self._kv_cache, dst, block)
            return
        for slot, piece in zip(self.slots(dsts, first_layer, len(payloads[0]) if payloads else 0), payloads):
            copy_into(slot, piece)

    def slots(self, dsts: Sequence[int], first_layer: int, nbytes: int) -> list[memoryview] | None:
        if self._pool is None:
            return None
        if first_layer == 0 and nbytes == self._nbytes and dsts and min(dsts) >= 0 and max(dsts) < len(self._blocks):
            return list(map(self._blocks.__getitem__, dsts))
        # (a block past the pool, which the ledger never lets through, gets an empty view here:
        # the copy refuses it as a wrong size instead of an IndexError ending the receive loop)
        start = first_layer * self._layer_nbytes
        return [self._pool[d * self._nbytes + start:d * self._nbytes + start + nbytes] for d in dsts]


class BlockWriterSink(PayloadSink):
    """The payload is the BlockFrame's second frame, handed on as a block tensor (every head) to
    `write_blocks([dst], block[None])`, which must copy it before returning: for a pool the bytes
    cannot go straight into, e.g. a tensor-parallel one (TPModelRunner.write_blocks)."""
    inline = True

    def __init__(self, write_blocks: WriteBlocks, layout: KVLayout) -> None:
        self._write_blocks, self._layout = write_blocks, layout

    def write(self, peer: str, frame: BlockFrame, payload: memoryview | None, dst: int) -> None:
        self.write_many([dst], [payload])

    def write_many(self, dsts: list[int], payloads: list[memoryview], first_layer: int = 0) -> None:
        for dst, block in zip(dsts, payloads):      # whole blocks (first_layer 0): takes_layers is False
            self._write_blocks([dst], block_tensor(block, self._layout)[None])
