"""What one authenticated peer gets queued on a KV receiver that nobody polls, measured: a raw
DEALER with the cluster's PLAIN credentials sends messages of a given shape until a send stays
blocked for SEND_BLOCKED_S (the receiver's queue is full), and counts them.

Besides the receiver's queue, what it counts holds what is in flight: its own queue (SNDHWM 1),
the message its I/O thread is writing, the one the receiver's I/O thread has read and cannot
queue, and both kernel socket buffers, which small_kernel_buffers() keeps to their minimum (made
before the receiver binds): in_flight() bytes at most.

It sends messages of the size the receiver expects (a block, a batch), a frame a block as a sender
does; frames up to the receiver's MAXMSGSIZE (a header's 64 KiB, where blocks are smaller) would
park more, as many of them as it queues.
"""
from pathlib import Path

import zmq

from kvtransport.testing import TEST_SECRET
from kvtransport.zmtp_auth import plain_client

SEND_BLOCKED_S = 3.0        # bounds the probe; a send blocked this long means a full queue, on a starved machine too
KERNEL_BUFFER = 4096        # SO_SNDBUF / SO_RCVBUF asked for (the kernel doubles it)
IN_FLIGHT = 4               # messages: the probe's queue, both I/O threads' (one each), one to spare
KERNEL_SLACK = 32 << 10     # both kernel buffers and libzmq's batch buffers


def small_kernel_buffers(monkeypatch) -> None:
    """Every ZeroMQ context made from now on in this test asks the kernel for the smallest socket
    buffers for its sockets (a bound socket's connections take them from its options at bind)."""
    class Small(zmq.Context):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.setsockopt(zmq.SNDBUF, KERNEL_BUFFER)
            self.setsockopt(zmq.RCVBUF, KERNEL_BUFFER)
    monkeypatch.setattr(zmq, "Context", Small)


def queued_messages(recv, frame_sizes: list[int], most: int) -> int:
    """Messages of len(frame_sizes) frames (frame k: frame_sizes[k] bytes) that one peer gets
    queued on recv (a ZmqReceiver, not polled meanwhile) before a send blocks; `most` at most."""
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_BLOCKED_S * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    plain_client(sock, TEST_SECRET)
    sock.connect(recv.endpoint)
    frames, sent = [bytes(n) for n in frame_sizes], 0
    try:
        while sent < most:
            sock.send_multipart(frames)
            sent += 1
    except zmq.Again:
        pass
    finally:
        sock.close()
        ctx.term()
    return sent


def queued_bytes(recv, message_bytes: int, frame_bytes: int, most_bytes: int) -> int:
    """The bytes one peer gets queued on recv in messages of message_bytes, sent as frames of
    frame_bytes at most (the receiver's MAXMSGSIZE bounds each frame); most_bytes at most."""
    whole, part = divmod(message_bytes, frame_bytes)
    frames = [frame_bytes] * whole + ([part] if part else [])
    return message_bytes * queued_messages(recv, frames, most_bytes // message_bytes + 1)


def in_flight(message_bytes: int) -> int:
    """The most bytes in flight besides the receiver's queue (messages of message_bytes)."""
    return IN_FLIGHT * message_bytes + KERNEL_SLACK


def kernel_bytes(endpoint: str) -> int:
    """Bytes the kernel holds on the TCP connections to endpoint (tcp://127.0.0.1:PORT), both ends:
    written and not yet read or acknowledged (/proc/net/tcp's tx_queue and rx_queue)."""
    port, total = int(endpoint.rsplit(":", 1)[1]), 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        ports = {int(address.split(":")[1], 16) for address in fields[1:3]}
        if port in ports and fields[3] == "01":        # ESTABLISHED
            total += sum(int(queue, 16) for queue in fields[4].split(":"))
    return total
