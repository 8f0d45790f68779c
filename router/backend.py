"""What the HTTP front end talks to: something that turns (prompt, SamplingParams) into outputs.

Two implementations fit behind it: ColocatedBackend (one engine in this process, prefill and decode
on one node) and the disaggregated backend (prefill and decode nodes over the wire).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

from pdwire.figures import PrefixCounters, TransferCounters
from pdwire.outputs import RequestOutput
from pdwire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from router.cluster.node_operator import NodeOperator


class NoNodeAvailable(RuntimeError):
    """The backend has no live node of a role a request needs: the HTTP side answers 503."""


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    """A snapshot of one node's scheduler and KV cache, for /metrics."""
    node_id: str
    role: str                   # "colocated" | "prefill" | "decode"
    num_running: int
    num_waiting: int
    kv_usage: float             # fraction of KV blocks in use, 0..1
    prefix_hit_rate: float      # fraction of prompt tokens served from the prefix cache, 0..1
    num_preemptions: int        # since the node started
    kv: TransferCounters | tuple[()] = ()   # disaggregated nodes: transfer totals (KV_COUNTERS order)
    prefix: PrefixCounters = PrefixCounters()   # prefix-cache query and hit tokens since the node started
    block_size: int = 0         # tokens per KV block (0: not known yet)
    num_blocks: int = 0         # KV blocks the node holds


class Backend(ABC):
    """Contract of a token-generating backend, as the HTTP app uses it from its event loop.

    generate(request_id, prompt, params) is an async generator of RequestOutput:
      - `prompt` is a token-id list (the router tokenizes) or a string;
      - it yields deltas, as vLLM's RequestOutputKind.DELTA: each output carries, per choice that
        advanced, only what is new since that choice's last delta (text, token_ids, logprobs), and
        its finish_reason in its last; the sum of a choice's deltas is its whole output, and
        nothing is ever taken back. Text that may still become part of a stop string is held
        until it cannot (router/stop_hold.py), so no stop string is ever sent, even in part;
        token ids and logprobs are not held (a delta may carry tokens and no text). The last
        output has finished=True;
      - prompt_logprobs, when asked for, come once: in the first output that carries a choice
        delta, or before it; later outputs carry None. Beam search yields its beams once, at
        the end (it revises them until then);
      - it raises ValueError at its first await, before yielding anything, when the request is
        rejected (empty or too long a prompt, a duplicate request id);
      - it raises RuntimeError if the backend fails while the request runs;
      - closing it early (break, aclose(), task cancellation on client disconnect) aborts the
        request: no caller has to remember to call abort().
    abort(request_id) ends a request from outside; unknown or finished ids are ignored; its
    generate() then stops without a finished output.
    metrics() never blocks and is safe to call from the event loop.
    Request ids are unique per backend; the app makes them.
    """

    @property
    @abstractmethod
    def model_name(self) -> str: ...

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer for the router's own use (tokenize, chat template, decode)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one sequence may hold."""

    @abstractmethod
    def generate(self, request_id: str, prompt: str | list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def metrics(self) -> list[NodeMetrics]:
        """One snapshot per node behind this backend."""

    def is_healthy(self) -> bool:
        return True

    @property
    def operator(self) -> NodeOperator | None:
        """What the operator API acts on (list, drain, remove nodes); None: no nodes to manage."""
        return None

    def collectors(self) -> Iterable[Any]:
        """Extra prometheus collectors (e.g. KV transfer metrics) for the app's registry."""
        return ()

    def close(self) -> None:
        """Stops the backend; idempotent."""
