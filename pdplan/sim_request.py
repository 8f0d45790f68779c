"""A simulated request and the timeline the simulator records for it (the client's view)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    arrival: float                  # seconds from the start
    prompt_len: int
    output_len: int                 # exact (EOS ignored), as the benchmark asks
    block_hashes: tuple[int, ...]   # chained hashes of the prompt's full blocks (prefix caching)
    kind: str = "chat"
    replay_decode: str = ""         # the decode node to send it to (a measured run's placement); "": the policy's
    # -- filled in by the simulation --------------------------------------------------------
    token_times: list[float] = field(default_factory=list)   # when each output token reached the client
    failed: bool = False
    decode_node: str = ""           # where it was decoded (disaggregated)

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1), as `vllm bench serve` computes it."""
        if len(self.token_times) <= 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def chain_hashes(prompt_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """hash(previous block's hash, this block's tokens) for every full block of the prompt."""
    hashes, prev = [], 0
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        prev = hash((prev, prompt_ids[start:start + block_size]))
        hashes.append(prev)
    return tuple(hashes)
