"""Counters a node exports (e.g. to Prometheus): plain attributes, no registry, no globals."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from kvtransport.log_limiter import LogLimiter
from pdwire.figures import TransferCounters

log = logging.getLogger("kvtransport")


class DropReason(Enum):
    """Why a received frame was dropped (never written into the pool)."""
    MALFORMED = "malformed"             # not a valid message / wrong frame count
    BAD_MAC = "bad_mac"                 # the session's MAC is missing or wrong
    NOT_AUTHENTICATED = "not_authenticated"   # from a connection that never completed a handshake
    ZMTP_REFUSED = "zmtp_refused"       # a connection refused at ZeroMQ's handshake: none of its frames read
    REPLAY = "replay"                   # a sequence number already seen on the session
    OVERSIZE = "oversize"               # a frame above the size cap
    NOT_PAIRED = "not_paired"           # from a peer that has not completed the handshake
    UNEXPECTED = "unexpected"           # a message kind this side does not accept
    UNKNOWN_XFER = "unknown_xfer"       # xfer id never registered
    FINISHED_XFER = "finished_xfer"     # late frame for a committed or failed transfer
    WRONG_PEER = "wrong_peer"           # transfer claimed by another peer
    NOT_RESERVED = "not_reserved"       # index / block id outside the reservation's shipped part
    DUPLICATE = "duplicate"             # block already written
    BAD_NBYTES = "bad_nbytes"           # header nbytes or payload length != block bytes
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    BAD_COMMIT = "bad_commit"           # num_tokens does not fit the reserved blocks


@dataclass(slots=True)
class _Drops:
    """What one side dropped of the messages it received: counted exactly, by reason; logged at
    most once a LOG_INTERVAL_S per (peer, reason) (kvtransport.log_limiter)."""
    drops: Counter = field(default_factory=Counter)   # DropReason -> frames (receiver) or messages dropped
    drop_log: LogLimiter = field(default_factory=lambda: LogLimiter(log), repr=False, compare=False)

    def count_drop(self, reason: DropReason, peer: str, detail: str = "") -> None:
        """Count one dropped frame or message and log it (rate-limited per peer and reason)."""
        self.drops[reason] += 1
        self.drop_log.warning((peer, reason), "dropped frame from %s: %s %s (%d so far)", peer, reason.value,
                              detail, self.drops[reason])

    @property
    def frames_dropped(self) -> int:
        return sum(self.drops.values())


@dataclass(slots=True)
class ReceiverMetrics(_Drops):
    blocks_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0          # time spent copying payloads into the pool
    transfers_committed: int = 0
    transfers_failed: int = 0

    def counters(self) -> TransferCounters:
        """What a decode node's heartbeat reports."""
        return TransferCounters(blocks_received=self.blocks_written, bytes_received=self.bytes_written,
                                transfers_done=self.transfers_committed,
                                transfers_failed=self.transfers_failed, frames_dropped=self.frames_dropped)


@dataclass(slots=True)
class SenderMetrics(_Drops):
    """drops: the receivers' replies dropped (too many frames, a bad MAC, not a message)."""
    blocks_sent: int = 0
    bytes_sent: int = 0
    send_seconds: float = 0.0           # time spent handing payloads to the transport
    commits_sent: int = 0
    aborts_sent: int = 0
    transfers_failed: int = 0

    def counters(self) -> TransferCounters:
        """What a prefill node's heartbeat reports."""
        return TransferCounters(blocks_sent=self.blocks_sent, bytes_sent=self.bytes_sent,
                                transfers_done=self.commits_sent, transfers_failed=self.transfers_failed,
                                frames_dropped=self.frames_dropped)
