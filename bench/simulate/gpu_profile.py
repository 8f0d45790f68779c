"""A GPU profile without a GPU: Llama-2-7B in bfloat16 on one NVIDIA A100-80GB SXM, priced from the
published hardware figures, marked extrapolated. Replace it with `pdserve profile` on a GPU.

Sources (published, not measured here):
  - NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e
  - Llama-2-7B shapes (Touvron et al. 2023): 6.74B parameters, 32 layers, hidden 4096, 32 KV heads
  - the cost model's form is DistServe's (OSDI'24, section 4: a prefill step grows with its
    tokens and quadratically with the prompt through attention; a decode step grows with the
    batch and the KV it reads)
  - efficiencies assumed: 60% of peak FLOP/s for linears and 50% for attention in prefill, 80%
    of peak bandwidth for reading weights and KV in decode, 1.5 ms of framework time per step
  - KV transfer between nodes at 25 GB/s (one 200 Gb/s NIC), as DistServe's cross-node setting

What that gives: a decode step at batch 1 of ~9.7 ms (weights: 13.5 GB at 1.63 TB/s), +72 us
per token of the batch through the linears, +0.32 us per token of context read; a 2,048-token
prefill ~170 ms.
"""
from __future__ import annotations

from pdplan.profile import Overheads, Profile, StepCost, Transfer

PEAK_FLOPS, PEAK_BW = 312e12, 2.039e12
PARAMS, LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 6.74e9, 32, 4096, 32, 128
BYTES = 2                                        # bfloat16
LINEAR_EFF, ATTN_EFF, BW_EFF, STEP_OVERHEAD_S = 0.6, 0.5, 0.8, 1.5e-3
NIC_BYTES_S = 25e9
BLOCK_SIZE = 16
KV_POOL_BYTES = 80e9 * 0.9 - PARAMS * BYTES      # vLLM's gpu_memory_utilization 0.9, less the weights


def published_profile() -> Profile:
    kv_per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES      # K and V, every layer
    block_bytes = kv_per_token * BLOCK_SIZE
    step = StepCost(
        fixed=PARAMS * BYTES / (PEAK_BW * BW_EFF) + STEP_OVERHEAD_S,
        per_token=2 * PARAMS / (PEAK_FLOPS * LINEAR_EFF),
        per_seq=20e-6,
        per_decode_ctx=kv_per_token / (PEAK_BW * BW_EFF),
        per_prefill_pair=4 * LAYERS * HIDDEN / (PEAK_FLOPS * ATTN_EFF))
    return Profile(
        machine={"gpu": "NVIDIA A100-80GB SXM (published figures, not measured)"},
        model={"name": "Llama-2-7B", "layers": LAYERS, "hidden": HIDDEN, "kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "dtype": "bfloat16", "kv_bytes_per_token": kv_per_token},
        block_size=BLOCK_SIZE, num_blocks=int(KV_POOL_BYTES // block_bytes), max_num_seqs=256,
        max_num_batched_tokens=2048, step=step,
        transfer=Transfer(block_bytes / NIC_BYTES_S, 100e-6, block_bytes),
        overheads=Overheads(request_s=2e-3),
        source="A100-80GB SXM datasheet + Llama-2-7B shapes, DistServe's cost model form; see "
               "bench/simulate/gpu_profile.py", extrapolated=True)
