"""Applies a beam-search step to a sequence group's block tables: survivors continue in place,
extra children fork (sharing every block), dropped beams free their references.

    before:  beam0 [A B c]   beam1 [A B d]        (A, B full blocks shared; c, d partial)
    choices: (beam0, x), (beam0, y)              beam1 chosen by none
    after:   beam0 [A B c]+x   child [A B c]+y    beam1 freed: d back to the pool
             c is shared by two tables: the next write into it copies it (copy-on-write)
"""
from __future__ import annotations

import torch

from engine.beam_search import BeamState
from engine.block_manager import BlockManager
from pdwire.outputs import CompletionOutput
from pdwire.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceGroup


def new_beam_state(params: SamplingParams, prompt_len: int, max_model_len: int,
                   eos_ids: tuple[int, ...]) -> BeamState:
    room = max_model_len - prompt_len
    return BeamState(params.beam_width, params.length_penalty, params.early_stopping,
                     min(params.max_tokens or room, room), () if params.ignore_eos else eos_ids)


def advance_beams(group: SequenceGroup, logits: torch.Tensor, bm: BlockManager, scheduler: Scheduler) -> None:
    """logits: [running beams, vocab], rows in group.seqs order (the beams just computed)."""
    beams = group.unfinished()
    choices = group.beam.step(torch.log_softmax(logits.float(), dim=-1), [b.output_token_ids for b in beams])
    used: set[int] = set()
    nexts: list[tuple[Sequence, int]] = []
    for choice in choices:                        # fork before any token is appended
        parent = beams[choice.parent]
        if choice.parent in used:
            child = parent.fork(len(nexts))
            bm.fork(parent, child)
            nexts.append((child, choice.token))
        else:
            used.add(choice.parent)
            nexts.append((parent, choice.token))
    for i, beam in enumerate(beams):
        if i not in used:
            scheduler.finish_seq(beam, FinishReason.ABORT)
    for index, (seq, token) in enumerate(nexts):
        seq.index = index
        seq.token_ids.append(token)
    group.seqs = [seq for seq, _ in nexts] or beams     # all ended: keep them for the prompt
    group.forked = True
    if group.beam.done:
        for seq in group.seqs:
            scheduler.finish_seq(seq, FinishReason.LENGTH)


def beam_outputs(group: SequenceGroup, tokenizer) -> list[CompletionOutput]:
    """The best n finished hypotheses, best first."""
    eos = set(group.beam.eos_ids)
    outs = []
    for i, hyp in enumerate(group.beam.finished[: group.params.n]):
        text = tokenizer.decode(hyp.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
        reason = "stop" if hyp.token_ids and hyp.token_ids[-1] in eos else "length"
        outs.append(CompletionOutput(i, text, hyp.token_ids, None, reason))
    return outs
