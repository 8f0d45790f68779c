"""A decode node's KV block keeping without a model: the real engine Scheduler and BlockManager,
reserving prompts as a decode node does (engine/llm_engine.py reserve), for tests that check the
router's view of a node's blocks against the node's own."""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler import ReservedPrompt, Scheduler
from engine.sequence import Sequence, SequenceGroup
from engine.swap import PreemptionMode, SwapPool
from pdwire.sampling_params import SamplingParams


class DecodeBlocks:
    def __init__(self, num_blocks: int, block_size: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(SchedulerConfig(), self.bm, SwapPool(1, block_size, PreemptionMode.RECOMPUTE))

    def cache(self, tokens: list[int]) -> None:
        """Computes `tokens` and frees them: their full blocks stay cached, used by no request."""
        seq = Sequence(list(tokens), len(tokens))
        self.bm.allocate(seq)
        seq.num_computed_tokens = len(tokens)
        self.bm.commit_computed(seq)
        self.bm.free(seq)

    def reserve(self, rid: str, prompt: list[int], growth_tokens: int = 0) -> ReservedPrompt | None:
        group = SequenceGroup(rid, [Sequence(list(prompt), len(prompt))], SamplingParams(max_tokens=1), 0.0)
        return self.scheduler.reserve(group, growth_tokens)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def check_integrity(self) -> None:
        self.bm.check_integrity([g.seqs[0] for g in self.scheduler.reserved.values()])
