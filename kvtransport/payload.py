"""Raw bytes of one pool block, read zero-copy on CPU and written straight into the pool.

kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, so
kv_cache[b] is one region of block_nbytes bytes. Bytes go through a uint8 view because numpy
has no bfloat16. On CUDA the bytes are staged through host memory (the zmq path is host-to-host;
the torch.distributed backend moves device tensors directly).
"""
from __future__ import annotations

import numpy as np
import torch

from kvtransport.messages import BlockFrame
from kvtransport.receiver_core import PayloadSink


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


def write_block(kv_cache: torch.Tensor, block_id: int, payload: bytes | memoryview) -> None:
    """Copy payload (exactly block_nbytes bytes, checked by the caller) into block block_id."""
    src = np.frombuffer(payload, dtype=np.uint8)
    dst = block_view(kv_cache, block_id)
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), src)
    else:
        dst.copy_(torch.from_numpy(src.copy()))


class InlineSink(PayloadSink):
    """The payload is the BlockFrame's second frame (zmq, fake): copy it into the pool."""
    inline = True

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._kv_cache = kv_cache

    def write(self, peer: str, frame: BlockFrame, payload: memoryview | None, dst: int) -> None:
        write_block(self._kv_cache, dst, payload)
