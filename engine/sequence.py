"""A sequence (one completion's tokens and KV blocks) and a sequence group (one request: n
sequences that share the prompt's blocks)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdwire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.beam_search import BeamState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # no KV blocks; (re)prefills when admitted
    RUNNING = "running"        # holds blocks; prefilling in chunks or decoding
    SWAPPED = "swapped"        # its blocks sit in the swap pool; swapped back in before running
    FINISHED = "finished"      # blocks freed


class FinishReason(str, enum.Enum):
    STOP = "stop"              # EOS, a stop token id or a stop string
    LENGTH = "length"          # max_tokens or the model's context
    ABORT = "abort"            # client abort, peer death, bad input after admission


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    token_ids: list[int]                          # prompt followed by generated tokens
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    index: int = 0                                # position among the group's n completions
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0                  # tokens whose K/V are in this sequence's blocks
    block_table: list[int] = field(default_factory=list)   # logical block i -> physical block id
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full computed blocks
    num_registered_blocks: int = 0                # leading blocks already offered to the prefix cache
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)   # per generated token
    text: str = ""                                # detokenized output, stop strings cut
    seed: int | None = None                       # seeded sampling (engine/sampler.py)
    # A group readmitted after recompute shares its prompt's full blocks again: the first
    # sequence computes them in place (its first `writes_shared` blocks are not copied on
    # write), the others wait for it (`waits_for`) before their own tokens run.
    writes_shared: int = 0
    waits_for: "Sequence | None" = None
    reuses_cache: bool = True                     # False: every prompt token is computed (its logits
                                                  # give the prompt logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token, when asked
    num_prior_outputs: int = 0                    # the prompt's last tokens an earlier attempt
                                                  # generated (a moved request): they count as
                                                  # generated for penalties and seeded draws

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """Every generated token, the earlier attempts' included."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_outputs:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A sibling with the same tokens and (shared, by the block manager) blocks."""
        child = Sequence(list(self.token_ids), self.num_prompt_tokens, index=index, status=self.status,
                         num_computed_tokens=self.num_computed_tokens, logprobs=list(self.logprobs),
                         text=self.text, block_hashes=list(self.block_hashes),
                         num_registered_blocks=self.num_registered_blocks, seed=self.seed,
                         num_prior_outputs=self.num_prior_outputs)
        return child


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request. Its sequences start as one; after the prompt is prefilled it forks to n."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival: float                                # monotonic seconds, for FCFS order
    forked: bool = False                          # n > 1 groups fork once after the prefill
    beam: "BeamState | None" = None               # beam search state (engine/beam_search.py)
    grammar: Any = None                           # structured output: its compiled grammar (engine/grammar.py)
    num_cached_tokens: int | None = None          # prefix-cache hit tokens at its first admission
    queue_time: float | None = None               # seconds from arrival to its first admission

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].token_ids[: self.seqs[0].num_prompt_tokens]

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)
