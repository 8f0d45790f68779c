"""Prompt logprobs: the scores of a prompt's own tokens, recorded on its sequence as the prefill
computes them (a request's prompt_logprobs = n: each position's token and the top n)."""
from __future__ import annotations

import torch

from engine.scheduler import ScheduledSeq


def record_prompt_logprobs(logits: torch.Tensor, scheduled: list[ScheduledSeq]) -> None:
    """logits [P, vocab]: one row per prompt_logprob_positions entry, in order. The row of
    position p scores prompt token p + 1: its logprob and the top-n of the distribution."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    row = 0
    for item in scheduled:
        positions = item.prompt_logprob_positions
        if not positions:
            continue
        seq, n = item.seq, item.group.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens
        block = logprobs[row:row + len(positions)]
        actual = seq.token_ids[positions.start + 1:positions.stop + 1]
        index = torch.tensor(actual, device=block.device)[:, None]
        chosen = block.gather(1, index)[:, 0].tolist()
        top = block.topk(min(n, block.shape[1]), dim=-1)            # n = 0: empty rows
        for p, token, lp, ids, values in zip(positions, actual, chosen, top.indices.tolist(),
                                             top.values.tolist()):
            seq.prompt_logprobs[p + 1] = {token: lp, **dict(zip(ids, values))}
        row += len(positions)
