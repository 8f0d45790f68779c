"""FCFS continuous batching with chunked prefill under a per-step token budget.

Each step:
  1. running groups, decoding ones first: one token per decoding sequence, the next chunk for a
     prefilling one. A group that cannot get its blocks preempts the latest-arrived running
     group (all of its sequences: swapped out, or recomputed later) until it can, or preempts
     itself.
  2. swapped groups, oldest first, when their blocks fit again.
  3. waiting groups in arrival order, while the budget, `max_num_seqs` (counting a group's n
     before it forks) and free blocks allow: blocks are allocated for the whole prompt
     (prefix-cache hits reused; a recomputed group shares its identical full blocks again, its
     first sequence computing them) and the first chunk is scheduled. Without chunked prefill a
     prompt is scheduled whole or waits. With long_prefill_token_threshold a sequence computes at
     most that many tokens a step, so short prompts admitted beside a long one wait for a short
     chunk of it, not for a whole budget's (vLLM V1's cap of the same name).
A group that cannot fit even when nothing else holds blocks ends with "length", keeping what it
generated, rather than waiting forever.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.block_manager import BlockCopy, BlockManager
from engine.config import SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from engine.swap import BlockMove, SwapPool


class ReservedPrompt(NamedTuple):
    """Blocks held for a prompt another node computes (Scheduler.reserve)."""
    block_table: list[int]      # the prompt's whole block table
    cached_blocks: int          # leading blocks found cached: their K/V need not be sent
    taken_blocks: int           # blocks it took from the free count (num_free_blocks): new ones
                                #   and cached hits no one was using, not hits already in use


PROMPT_LOGPROBS_CHUNK = 256     # prompt tokens a step computes for a prompt-logprobs request: each
                                # keeps a vocabulary-wide row of logits (128k x 4 B = 0.5 MiB)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int        # tokens whose K/V this step computes

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions computed this step whose logits give the next prompt token's logprob (when
        the request asks for prompt logprobs): all but the prompt's last, which samples."""
        if self.group.params.prompt_logprobs is None:
            return range(0)
        start = self.seq.num_computed_tokens
        return range(start, min(start + self.num_new_tokens, self.seq.num_prompt_tokens - 1))


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)          # copy-on-write before the step
    swap_out: list[BlockMove] = field(default_factory=list)        # device -> swap pool, first
    swap_in: list[BlockMove] = field(default_factory=list)         # swap pool -> device, second
    preempted: list[SequenceGroup] = field(default_factory=list)
    finished: list[SequenceGroup] = field(default_factory=list)   # ended by the scheduler itself

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, swap: SwapPool | None = None):
        self.config = config
        self.bm = block_manager
        self.swap = swap
        self.swapped: deque[SequenceGroup] = deque()   # preempted by swap, oldest first
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.reserved: dict[str, SequenceGroup] = {}   # blocks held, K/V arriving from a peer
        self.num_preemptions = 0
        self.watermark = max(1, block_manager.num_blocks // 100)   # room kept for running growth

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def reserve(self, group: SequenceGroup, growth_tokens: int) -> ReservedPrompt | None:
        """Allocate blocks for a prompt whose K/V another node computes, keeping room for
        `growth_tokens` more. Returns its block table, its leading blocks found cached and the
        blocks it took from the free count, or None when the blocks are not there (the caller
        says busy)."""
        seq = group.seqs[0]
        if not self.bm.can_allocate(seq, reserve_tokens=growth_tokens + self.watermark * self.bm.block_size):
            return None
        free = self.bm.num_free_blocks
        self.bm.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self.reserved[group.request_id] = group
        return ReservedPrompt(list(seq.block_table), seq.num_computed_tokens // self.bm.block_size,
                              free - self.bm.num_free_blocks)

    def adopt(self, request_id: str) -> SequenceGroup:
        """The reserved prompt's K/V have all arrived: it is computed and joins the batch."""
        group = self.reserved.pop(request_id)
        seq = group.seqs[0]
        seq.num_computed_tokens = len(seq)
        self.bm.commit_computed(seq)
        group.forked = True
        self.running.append(group)
        return group

    def compute_reserved(self, request_id: str) -> None:
        """The reserved prompt is computed here after all: it joins the batch as a prefilling
        group from its cached blocks on (chunked beside the decodes, as an admitted prompt)."""
        self.running.append(self.reserved.pop(request_id))

    def abort(self, request_id: str) -> SequenceGroup | None:
        if request_id in self.reserved:
            group = self.reserved.pop(request_id)
            self.finish_group(group, FinishReason.ABORT)
            return group
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.finish_group(group, FinishReason.ABORT)
                    return group
        return None

    def finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        pool = self.swap.bm if seq.status is SequenceStatus.SWAPPED else self.bm
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        pool.free(seq)

    def finish_group(self, group: SequenceGroup, reason: FinishReason) -> None:
        for seq in group.unfinished():
            self.finish_seq(seq, reason)
        group.forked = True

    def remove_finished(self) -> None:
        self.running = [g for g in self.running if not g.is_finished]

    def swapped_seqs(self) -> list[Sequence]:
        return [s for g in self.swapped for s in g.unfinished()]

    def live_seqs(self) -> list[Sequence]:
        """Every sequence holding blocks: running and reserved (pins are the block manager's)."""
        groups = self.running + list(self.reserved.values())
        return [s for g in groups for s in g.unfinished()]

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for group in sorted(self.running, key=_is_prefilling):
            if group not in self.running or budget <= 0:
                continue
            if not self._reserve_running(group, out):
                continue
            budget = self._schedule_group(group, budget, out)
        budget = self._swap_in(budget, out)
        if not self.swapped:                 # swapped groups go before new ones
            self._admit_waiting(budget, out)
        return out

    def _swap_in(self, budget: int, out: SchedulerOutput) -> int:
        while self.swapped and budget > 0 and self.swapped[0] not in out.preempted:
            group = self.swapped[0]
            if not self.swap.can_swap_in(group, self.bm, self.watermark if self.running else 0):
                if self._alone():           # the pool is all its own, and still too small
                    self.swapped.popleft()
                    self._finish_too_big(group, out)
                    continue
                break
            self.swapped.popleft()
            out.swap_in += self.swap.swap_in(group, self.bm)
            self.running.append(group)
            budget = self._schedule_group(group, budget, out)
        return budget

    def _reserve_running(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Preempt later groups until `group` can append; False if `group` itself had to go."""
        while self._blocks_to_append(group) > self.bm.num_free_blocks:
            victim = self.running[-1]
            if victim is group and len(self.running) == 1 and not self.reserved and not self.bm.num_pins:
                self.running.remove(group)      # alone and still too big for the pool
                self._finish_too_big(group, out)
                return False
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    def _blocks_to_append(self, group: SequenceGroup) -> int:
        return self.bm.blocks_to_append_all(group.unfinished())

    def _finish_too_big(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """A group that cannot have its blocks even with the whole pool to itself (say n
        completions recomputed without their shared prompt) ends, keeping what it generated."""
        if group.beam is not None:
            group.beam.stop([s.output_token_ids for s in group.unfinished()])
        self.finish_group(group, FinishReason.LENGTH)
        out.finished.append(group)

    def _num_seqs(self) -> int:
        """Sequences running or about to: a group that has not forked yet counts as its n (and,
        as before pins had their own type, each pin counts as one)."""
        groups = self.running + list(self.reserved.values())
        return sum(_max_seqs(g) for g in groups) + self.bm.num_pins

    def _alone(self) -> bool:
        """Nothing else holds blocks here or will: whatever is free now is all there will be."""
        return not self.running and not self.reserved and not self.bm.num_pins

    def _schedule_group(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        if group.beam is not None:
            # Beams step together: all of a beam group's tokens or none (unless it is alone).
            needed = sum(s.num_uncomputed_tokens for s in group.unfinished())
            if needed > budget and budget < self.config.max_num_batched_tokens:
                return budget
            budget = max(budget, needed)
        cap = self.config.long_prefill_token_threshold or budget   # a sequence's tokens this step, at most
        computed_by_now: dict[int, int] = {}        # seq_id -> computed tokens after this step
        for seq in group.unfinished():
            if (lead := seq.waits_for) is not None:     # its first blocks are the lead's to compute
                if lead.is_finished or lead.num_computed_tokens >= seq.num_computed_tokens:
                    seq.waits_for = None                # done (a finished lead computed them all)
                elif computed_by_now.get(lead.seq_id, 0) < seq.num_computed_tokens:
                    continue                            # not this step: they are not there yet
            num_new = min(seq.num_uncomputed_tokens, budget, cap)
            if group.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                num_new = min(num_new, PROMPT_LOGPROBS_CHUNK)  # each such token keeps a row of logits
            out.copies += self.bm.append_slots(seq)
            if num_new > 0:
                out.scheduled.append(ScheduledSeq(seq, group, num_new))
                budget -= num_new
            computed_by_now[seq.seq_id] = seq.num_computed_tokens + num_new
        return budget

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Take `group` off the batch: to the swap pool, or (recompute) back to waiting.

        Copy-on-write copies already planned this step into the group's blocks (it was
        scheduled before a later group preempted it) have not run: the swap-out reads such a
        block's source instead (swaps run before copies), and a recomputed group's are dropped."""
        self.running.remove(group)
        out.scheduled = [s for s in out.scheduled if s.group is not group]
        out.preempted.append(group)
        self.num_preemptions += 1
        held = {b for s in group.unfinished() for b in s.block_table}
        planned = {c.dst: c.src for c in out.copies if c.dst in held}
        out.copies = [c for c in out.copies if c.dst not in held]
        if self.swap is not None and self.swap.should_swap(group, self.bm):
            moves = self.swap.swap_out(group, self.bm)
            out.swap_out += [BlockMove(planned.get(m.src, m.src), m.dst) for m in moves]
            self.swapped.append(group)
            return
        for seq in group.unfinished():
            self.bm.free(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        preempted = set(map(id, out.preempted))
        while self.waiting and budget > 0 and id(self.waiting[0]) not in preempted:
            group = self.waiting[0]
            seqs = group.unfinished()
            if self._num_seqs() + _max_seqs(group) > self.config.max_num_seqs:
                break
            # Unchunked, a group waits for a step with room for all of it; one that no step holds
            # (n recomputed completions: one prompt is never over it, engine.max_model_len) goes
            # in chunks rather than never.
            tokens = sum(len(s) for s in seqs)
            if not self.config.enable_chunked_prefill and budget < tokens <= self.config.max_num_batched_tokens:
                break
            if not self._can_admit(seqs):
                if self._alone():
                    self.waiting.popleft()
                    self._finish_too_big(group, out)
                    continue
                break
            self.waiting.popleft()
            self.bm.allocate_group(seqs)
            if group.num_cached_tokens is None:     # a readmission after preemption does not count
                group.num_cached_tokens = seqs[0].num_computed_tokens
                group.queue_time = time.monotonic() - group.arrival
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget = self._schedule_group(group, budget, out)

    def _can_admit(self, seqs: list[Sequence]) -> bool:
        watermark = self.watermark if self.running else 0   # an idle engine admits what fits
        return self.bm.blocks_to_allocate_all(seqs, watermark) <= self.bm.num_free_blocks


def _is_prefilling(group: SequenceGroup) -> bool:
    return any(s.num_uncomputed_tokens > 1 for s in group.unfinished())


def _max_seqs(group: SequenceGroup) -> int:
    """Sequences the group runs at most: n (or the beam width) once it forks after its prompt."""
    if group.forked:
        return len(group.unfinished())
    return group.params.beam_width if group.beam is not None else group.params.n
