"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch and a paged KV pool.

q/k/v and gate/up are fused into one matmul each; the weights are loaded by `engine.weights`.
Attention goes through `kernels`: store this step's K/V into their slots, then paged attention.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`: residual += x in place first, and norm(residual)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias, dtype=cfg.dtype)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False, dtype=cfg.dtype)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_layer: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        qk = qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        rope.rotate_(batch.positions, qk)                               # q and k heads, in place
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]          # [T, H, D], [T, Hkv, D]
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = kernels.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                      batch.seq_lens, self.scale, batch.max_seqlen_q, batch.max_seqlen_k)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, batch, kv_layer):
        """x: the residual stream [T, hidden], updated in place and returned."""
        h = self.self_attn(self.input_layernorm(x), rope, batch, kv_layer)
        h = self.post_attention_layernorm(h, residual=x)                # x += attention; norm(x)
        x += self.mlp(h)
        return x


class CausalLM(nn.Module):
    """Build on the meta device, then `engine.weights.load_model` materializes and fills it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        self.rope: RotaryEmbedding | None = None      # set by load_model, off the meta device
        self.direct = None      # engine.direct_layers.DirectLayers where the runner built one: the layers without modules

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, hidden] of the rows in batch.logits_indices, after the final norm.
        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        x = self.embed_tokens(batch.input_ids)                         # [T, hidden]
        if self.direct is not None:
            x = self.direct.run(x, batch, kv_cache)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, self.rope, batch, kv_cache[:, i])
        # index_select, not x[indices]: advanced indexing wakes every OpenMP thread for a few rows
        # (a decode step's 32 rows: ~100 us against ~4 us)
        return self.norm(x.index_select(0, batch.logits_indices))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] in the model's dtype: the sampler casts to float32 only what needs more
        than an argmax (a greedy bf16 step's 32 x 32,000 cast cost ~0.1 ms)."""
        return self.lm_head(hidden)
