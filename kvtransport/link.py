"""How messages travel between a Sender and a Receiver: the link strategies (ZMQ or in-process).

A link moves sealed multipart messages and knows nothing of sessions, transfers or payload
channels; kvtransport.sender and kvtransport.receiver run the flow over it.

  SendLink     one connection per receiver endpoint: open -> handshake sends / recv ->
               paired (read by receive() from then on) -> close
  ReceiveLink  one listening endpoint; every message goes to the handler bound by the Receiver
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

from kvtransport.metrics import DropReason
from kvtransport.session import Buffer

if TYPE_CHECKING:
    import zmq

Handler = Callable[[str, list[Buffer]], None]     # (endpoint or peer, frames of one message)


class Dropped(NamedTuple):
    """A message a send link read and dropped before any handler saw it (e.g. more frames than any
    reply has), for its caller to count: unlike an empty message, or none."""
    reason: DropReason
    detail: str


DropHandler = Callable[[str, Dropped], None]     # (endpoint, what the link dropped)


class Landing(Protocol):
    """Where a message's payload frames go, chosen from its header and seal (kvtransport.receiver_core)."""
    slots: list[memoryview]          # frame k into slots[k]: writable, of the size it must have
    sizes: list[int]                 # split: the sizes of the payload messages received so far
    seconds: float                   # split: the time their copies took


class Lander(Protocol):
    """A receive side that takes payload frames straight into their destination (ReceiverCore):
    a link that can receive frame by frame asks landing(peer, header, seal) (a message's first
    two frames) before the payloads; if it gets one, it receives payload frame k into slots[k]
    and calls landed() with every payload frame's size, else it hands the whole message to the
    Handler. Split (landing(..., split=True): [header, seal] was the whole message): before any
    message of a peer, the link asks owed(peer); while it gets a landing, it receives a bare
    message into its next slot (appending its size and time), and calls landed() once every slot
    has one, or at once when the message is not bare (it is then taken as any other message)."""

    def landing(self, peer: str, header: Buffer, seal: Buffer, split: bool = False) -> Landing | None: ...

    def owed(self, peer: str) -> Landing | None: ...

    def owing(self) -> bool:
        """Whether any peer owes a split batch payloads."""

    def landed(self, peer: str, landing: Landing, sizes: list[int], seconds: float) -> None: ...


class Completion(Protocol):
    """One payload in flight: `done` turns True once it has left the process (a zmq tracker)."""
    done: bool


class Sent:
    """A payload that left at once."""
    done = True


class SendLink(ABC):
    """The prefill side's connections, keyed by the receiver's endpoint. Not thread-safe."""

    @abstractmethod
    def open(self, endpoint: str) -> None:
        """A new connection to endpoint (none is open); TransportError if it is unreachable."""

    @abstractmethod
    def recv(self, endpoint: str, timeout: float) -> list[Buffer] | Dropped | None:
        """The next message from endpoint while pairing (Dropped: one the link dropped), or None
        after timeout seconds."""

    @abstractmethod
    def paired(self, endpoint: str) -> None:
        """endpoint's handshake succeeded: receive() reads it from now on."""

    @abstractmethod
    def send(self, endpoint: str, frames: list[Buffer]) -> None:
        """Send one message; blocks while the queue is full, then raises TransportError. Its
        payload frames may be read after it returns, until a later send_tracked completes."""

    def send_each(self, endpoint: str, frames: list[Buffer]) -> None:
        """send() each frame as a message of its own, in order (a split batch's payloads)."""
        for frame in frames:
            self.send(endpoint, [frame])

    @abstractmethod
    def send_tracked(self, endpoint: str, frames: list[Buffer]) -> Completion:
        """send() a message whose payload frames (frames[1:-1]) alias pool blocks, without copying
        them; the completion is done once they, and every message sent before on this
        connection, have left."""

    @abstractmethod
    def try_send(self, endpoint: str, frames: list[Buffer]) -> None:
        """Send one message if that does not block; else drop it (heartbeats)."""

    @abstractmethod
    def receive(self, timeout: float, handle: Handler, drop: DropHandler) -> None:
        """Hand every message waiting on paired connections to handle (those the link drops to
        drop); wait at most timeout."""

    def waitables(self) -> list[zmq.Socket]:
        """The open connections' sockets, readable when a reply waits: for a caller's loop to wait
        on beside its own (then receive() or recv() with no wait); none for a link without sockets."""
        return []

    @abstractmethod
    def endpoints(self) -> list[str]:
        """The endpoints with an open connection."""

    @abstractmethod
    def close(self, endpoint: str, linger: float = 0.0) -> None:
        """Close endpoint's connection (no-op if none), letting queued messages leave for linger s."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the link holds; every connection is closed already."""


class ReceiveLink(ABC):
    """The decode side's listening endpoint; peers are told apart by an opaque name."""

    endpoint: str                 # where senders connect
    lands: bool = False           # it receives payloads straight into a Lander's slots

    @abstractmethod
    def bind(self, handle: Handler, lander: Lander | None = None) -> None:
        """Every message received from now on goes to handle(peer, frames), or, on a link that
        receives frame by frame, its payloads straight into lander's slots."""

    @abstractmethod
    def receive(self, timeout: float) -> None:
        """Hand waiting messages to the handler; wait at most timeout for the first."""

    def waitables(self) -> list[zmq.Socket]:
        """The sockets that turn readable when a message waits: for a caller's loop to wait on
        beside its own (then receive(0)); none for a link without sockets."""
        return []

    def take_refused(self) -> list[str]:
        """The addresses of the connections refused at the transport's own handshake since the
        last call (to be counted); none for a link without one."""
        return []

    @abstractmethod
    def send(self, peer: str, frames: list[Buffer]) -> None:
        """Reply to peer; never blocks (a reply that cannot leave now is dropped)."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening."""
