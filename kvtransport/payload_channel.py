"""How a block's bytes leave the send side: the payload channel strategies.

  InlineChannel  the payload is the BlockFrame's second frame, zero-copy out of the pool
  DistChannel    (kvtransport.torch_dist) the header goes over the link, then the block as a
                 tensor send on the pair's process group

The receive side's counterpart is the PayloadSink (kvtransport.receiver_core).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from kvtransport.link import Completion
from kvtransport.payload import block_bytes
from pdwire.handshake import PeerIdentity
from pdwire.messages import Message

ReadMessage = Callable[[float], Message | None]   # the next message from the peer within timeout s


class PayloadChannel(ABC):
    """Moves block payloads to paired receivers. Not thread-safe."""

    def paired(self, endpoint: str, remote: PeerIdentity, read: ReadMessage, timeout: float) -> None:
        """endpoint accepted our Hello; set up its channel (read() gets its next message).

        Raises TransportError if the channel cannot be set up; the pairing then fails."""

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

    def inline(self, kv_cache: torch.Tensor, src_block_id: int) -> memoryview:
        return block_bytes(kv_cache, src_block_id)

    def send(self, endpoint: str, kv_cache: torch.Tensor, src_block_id: int) -> Completion:
        raise NotImplementedError("an inline channel sends no payload out of band")
