"""Megatron-style tensor parallelism applied to a loaded `CausalLM` from outside (gpt-fast style):
`shard_model` slices each layer's weights in place down to one rank's share, so `engine/model.py`
keeps no parallel branches.

    per decoder layer, rank r of tp:
      qkv_proj      column-parallel by heads: q heads [r*H/tp, (r+1)*H/tp), kv heads likewise
      o_proj        row-parallel: the matching input columns, then all-reduce (sum) the output
      gate_up_proj  column-parallel: gate rows and up rows of the same slice, so chunk(2) pairs them
      down_proj     row-parallel + all-reduce
    embed_tokens, the norms and lm_head stay whole (replicated); only rank 0 computes logits.

A q head h reads kv head h // (H / Hkv); slicing both by the same rank keeps every q head of a
shard with its kv head, so attention runs unchanged over the shard's KV pool
`[num_blocks, num_layers, 2, block_size, num_kv_heads // tp, head_dim]`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model import Attention, CausalLM, MLP

AllReduce = Callable[[torch.Tensor], None]   # sums a tensor in place over the tp ranks


def check_shardable(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError, naming the field, unless the model splits evenly over `tp` ranks."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ValueError(f"{name} {value} is not divisible by tensor_parallel_size {tp}")


def shard_model(model: CausalLM, rank: int, tp: int, all_reduce: AllReduce) -> CausalLM:
    """Keep rank `rank`'s share of every decoder layer (in place); returns the model."""
    check_shardable(model.cfg, tp)
    for layer in model.layers:
        _shard_attention(layer.self_attn, model.cfg, rank, tp, all_reduce)
        _shard_mlp(layer.mlp, model.cfg, rank, tp, all_reduce)
    return model


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b, where x_r / W_r are this rank's slice of the input features.
    The bias (if any) is added once, after the sum."""

    def __init__(self, linear: nn.Linear, rank: int, tp: int, all_reduce: AllReduce):
        super().__init__()
        weight = _slice(linear.weight, 1, [(0, linear.in_features)], rank, tp)   # [out, in / tp]
        self.local = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                               device=weight.device)    # a plain nn.Linear: engine.packed_linear may pack it
        self.local.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = linear.bias
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local(x)
        self.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _shard_attention(attn: Attention, cfg: ModelConfig, rank: int, tp: int, all_reduce: AllReduce) -> None:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    spans = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]       # rows of q | k | v
    _column_parallel(attn.qkv_proj, spans, rank, tp)
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, tp, all_reduce)
    attn.num_heads, attn.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
    attn.split = (q // tp, kv // tp, kv // tp)


def _shard_mlp(mlp: MLP, cfg: ModelConfig, rank: int, tp: int, all_reduce: AllReduce) -> None:
    inter = cfg.intermediate_size
    _column_parallel(mlp.gate_up_proj, [(0, inter), (inter, 2 * inter)], rank, tp)   # gate | up
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, tp, all_reduce)


def _column_parallel(linear: nn.Linear, spans: list[tuple[int, int]], rank: int, tp: int) -> None:
    """Keep rank's slice of each span of output rows (weight and bias), spans concatenated."""
    linear.weight = nn.Parameter(_slice(linear.weight, 0, spans, rank, tp), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_slice(linear.bias, 0, spans, rank, tp), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _slice(t: torch.Tensor, dim: int, spans: list[tuple[int, int]], rank: int, tp: int) -> torch.Tensor:
    """Rank's 1/tp of each span along dim, concatenated into a fresh tensor (the whole one is freed)."""
    parts = []
    for start, end in spans:
        step = (end - start) // tp
        parts.append(t.detach().narrow(dim, start + rank * step, step))
    return torch.cat(parts, dim=dim)
