"""What a transport reports to its node: each transfer ends in exactly one of these events."""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Union


class FailReason(Enum):
    LEASE_EXPIRED = "lease_expired"     # no progress or heartbeat for the transfer within its lease
    PEER_ABORTED = "peer_aborted"       # the other side sent Abort
    LOCAL_ABORT = "local_abort"         # this node called abort()
    PEER_DEAD = "peer_dead"             # no message from the peer within peer_timeout
    PEER_RESTARTED = "peer_restarted"   # the peer came back with a new epoch
    CHANNEL_BROKEN = "channel_broken"   # the payload channel lost sync (torch.distributed)
    CLOSED = "closed"                   # the transport was closed with the transfer open


class TransferCommitted(NamedTuple):
    """Receive side: every expected block and the Commit arrived; the node adopts the blocks."""
    xfer_id: str
    first_token: int
    num_tokens: int
    dst_block_ids: tuple[int, ...]      # the reservation's whole block table, cached prefix included
    nbytes: int                         # payload bytes written into the pool
    wait_seconds: float                 # register() -> first frame (prefill queue + compute)
    transfer_seconds: float             # first frame -> committed


class TransferFailed(NamedTuple):
    """Either side: the transfer is over and failed (final); the node frees its blocks once."""
    xfer_id: str
    reason: FailReason
    detail: str = ""


TransferEvent = Union[TransferCommitted, TransferFailed]
