"""How a block's bytes leave the send side: the payload channel strategies.

  InlineChannel  the payload is the BlockFrame's second frame, or one of a BlockBatch's frames,
                 zero-copy out of the pool
  DistChannel    (kvtransport.torch_dist) the header goes over the link, then the block as a
                 tensor send on the pair's process group

The receive side's counterpart is the PayloadSink (kvtransport.receiver_core).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvtransport.base import TransportError
from kvtransport.link import Completion
from kvtransport.payload import block_bytes, pool_bytes
from pdwire.handshake import PeerIdentity
from pdwire.messages import Message


class PayloadChannel(ABC):
    """Moves block payloads to paired receivers. Not thread-safe."""
    batches: bool = False      # inline payloads: blocks may travel several to a message (BlockBatch)
    joins: bool = False        # the receiver sends one message after its HelloAck (P2PJoin) for paired()

    def inline_many(self, kv_cache: torch.Tensor, src_block_ids: list[int], first_layer: int = 0,
                    num_layers: int | None = None) -> list[memoryview]:
        """inline() of each block, for a BlockBatch (batching channels only); with num_layers, the
        payload frames of layers [first_layer, first_layer + num_layers) of each, for a LayerBatch."""
        raise NotImplementedError(f"{type(self).__name__} does not batch")

    def paired(self, endpoint: str, remote: PeerIdentity, join: Message | None, timeout: float) -> None:
        """endpoint accepted our Hello; set up its channel from join (the receiver's next message,
        for a channel that `joins`; else None), blocking at most about timeout s.

        Raises TransportError (or the backend's RuntimeError) if the channel cannot be set up; the
        pairing then fails."""

    @abstractmethod
    def inline(self, kv_cache: torch.Tensor, src_block_id: int) -> memoryview | None:
        """The payload frame of block src_block_id, aliasing the pool; None if it goes out of band."""

    @abstractmethod
    def send(self, endpoint: str, kv_cache: torch.Tensor, src_block_id: int) -> Completion:
        """Ship block src_block_id out of band, after its header went over the link."""

    def broken(self) -> list[tuple[str, str]]:
        """(endpoint, error) of each pair whose channel failed since the last call."""
        return []

    def unpaired(self, endpoint: str) -> None:
        """endpoint's link is gone: release its channel."""


class InlineChannel(PayloadChannel):
    """The payload travels as the BlockFrame's second frame (zmq, fake)."""
    batches = True

    def __init__(self) -> None:
        self._pool: tuple[torch.Tensor, memoryview | None] | None = None   # (kv_cache, pool_bytes of it)

    def inline(self, kv_cache: torch.Tensor, src_block_id: int) -> memoryview:
        return block_bytes(kv_cache, src_block_id)

    def inline_many(self, kv_cache: torch.Tensor, src_block_ids: list[int], first_layer: int = 0,
                    num_layers: int | None = None) -> list[memoryview]:
        pool = self._pool_bytes(kv_cache)       # slices of one view: no tensor per block
        if pool is None:        # a device or strided pool (whole blocks: only CPU pools ship layers)
            if num_layers is not None:
                raise TransportError("layer slices ship from a contiguous CPU pool only")
            return [block_bytes(kv_cache, b) for b in src_block_ids]
        n = len(pool) // kv_cache.shape[0]
        layer = n // kv_cache.shape[1]
        start = layer * first_layer
        stop = n if num_layers is None else start + layer * num_layers
        return [pool[b * n + start:b * n + stop] for b in src_block_ids]

    def _pool_bytes(self, kv_cache: torch.Tensor) -> memoryview | None:
        """pool_bytes(kv_cache), made once per pool (a node ships from one)."""
        if self._pool is None or self._pool[0] is not kv_cache:
            self._pool = (kv_cache, pool_bytes(kv_cache))
        return self._pool[1]

    def send(self, endpoint: str, kv_cache: torch.Tensor, src_block_id: int) -> Completion:
        raise NotImplementedError("an inline channel sends no payload out of band")
