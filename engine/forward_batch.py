"""The tensors one model step consumes: a flattened batch mixing prefill chunks and decode tokens.

    tokens:   | seq 0: prefill chunk (q_len 5) | seq 1: decode (1) | seq 2: decode (1) |
    rows:       0 ............ 4                 5                   6
    cu_seqlens_q = [0, 5, 6, 7]; seq_lens[i] = tokens of seq i in the cache after this step
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    slot_mapping: torch.Tensor    # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor    # [S, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor    # [S + 1] int32
    seq_lens: torch.Tensor        # [S] int32
    logits_indices: torch.Tensor  # [R + P] int64: rows whose next token is sampled, then
                                  # the rows whose logits give prompt logprobs
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
