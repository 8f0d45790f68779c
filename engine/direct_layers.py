"""The decoder layers of a CPU model run straight through pdserve's kernels, without nn.Module's
dispatch: the same calls in the same order as engine/model.py's modules make (so the same bits),
less the Python between them.

A bf16 decode step of the benchmark model (8 layers, 32 rows) spent about a third of its main
thread outside the kernels (py-spy, bench/README.md "The decoder layers called directly"): each
layer went through ten module calls, three frames per linear and a `usable` check per small op.
Here a layer is one Python function: RMSNorm, the fused qkv GEMM, RoPE in place, the KV store,
paged attention, o_proj, RMSNorm fused with the residual add, the gate_up GEMM, SiLU-and-mul,
down_proj added into the residual stream.

It is built only where every call it makes goes to the C kernels (`DirectLayers.build`): a CPU
model whose every layer linear is packed (engine/packed_linear.py) and whose dtype the layer ops
take, with the library built. Elsewhere (CUDA, tensor-parallel layers, PDSERVE_DIRECT_LAYERS=0)
the modules run as before. A layer that has hooks on it or on any module inside it (the
per-layer KV shipper, node_shell/shipper.py; a profiler's clocks) runs through its module, so
every hook fires as it would. The first direct layer of a step goes through the checked kernel
fronts (kernels.store_kv, kernels.paged_attention: ids, lengths, slots in range); the layers
after it take the same index tensors and call the kernels behind those fronts.
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import kernels
from kernels import cpu_layer_ops
from kernels.cpu_attention import paged_attention_cpu
from kernels.cpu_kernels import DTYPES, layer_ops_lib
from engine.forward_batch import ForwardBatch
from engine.packed_linear import PackedLinear

SWITCH = "PDSERVE_DIRECT_LAYERS"        # "0": every layer through its modules (A/B measurements)


class DirectLayers:
    """A CausalLM's decoder layers, called directly (see the module's docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._inside = [tuple(layer.modules()) for layer in model.layers]     # hooks anywhere in a layer

    @classmethod
    def build(cls, model: nn.Module) -> DirectLayers | None:
        """DirectLayers for `model`, or None where any of its calls would not reach the C kernels."""
        return cls(model) if cls.fits(model) else None

    @staticmethod
    def fits(model: nn.Module) -> bool:
        if os.environ.get(SWITCH, "1") == "0" or layer_ops_lib() is None:
            return False
        embed = model.embed_tokens.weight
        if embed.device.type != "cpu" or embed.dtype not in DTYPES:
            return False
        return all(isinstance(lin, PackedLinear)
                   for layer in model.layers
                   for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj))

    def run(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The residual stream x [T, hidden] through every layer (updated in place, returned)."""
        model, checked = self.model, False
        hooked_anywhere = _global_hooks()
        for i, layer in enumerate(model.layers):
            if hooked_anywhere or _hooked(self._inside[i]):
                x = layer(x, model.rope, batch, kv_cache[:, i])
            else:
                _layer(layer, x, model.rope, batch, kv_cache[:, i], checked)
                checked = True
        return x


def _layer(layer: nn.Module, x: torch.Tensor, rope, batch: ForwardBatch, kv_layer: torch.Tensor,
           checked: bool) -> None:
    """DecoderLayer.forward's calls, made directly; x updated in place."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    qkv = attn.qkv_proj.product(cpu_layer_ops.rms_norm(x, norm.weight, norm.eps))
    q_size, kv_size, _ = attn.split
    qk = qkv[:, :q_size + kv_size].view(-1, attn.num_heads + attn.num_kv_heads, attn.head_dim)
    cpu_layer_ops.rotary_(qk, batch.positions, rope.cos, rope.sin)     # q and k heads, in place
    q, k = qk[:, :attn.num_heads], qk[:, attn.num_heads:]
    v = qkv[:, q_size + kv_size:].view(-1, attn.num_kv_heads, attn.head_dim)
    k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
    if checked:     # the same batch tensors passed the fronts' checks in this step's first layer
        cpu_layer_ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = paged_attention_cpu(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                                  attn.scale)
    else:
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = kernels.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                                      attn.scale, batch.max_seqlen_q, batch.max_seqlen_k)
    norm = layer.post_attention_layernorm
    h = cpu_layer_ops.rms_norm(attn.o_proj.product(out.view(x.shape[0], -1)), norm.weight, norm.eps, x)
    x += mlp.down_proj.product(cpu_layer_ops.silu_mul(mlp.gate_up_proj.product(h)))


def _hooked(modules: tuple[nn.Module, ...]) -> bool:
    """Whether any of `modules` has a forward hook or pre-hook."""
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return True
    return False


def _global_hooks() -> bool:
    """Whether a forward hook is registered for every module (nn.modules.module's globals)."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
