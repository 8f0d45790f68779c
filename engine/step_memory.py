"""What a CPU engine's steps free stays in glibc's heap for the next step, mapped and warm.

A prefill step's activations are megabytes each (2,048 tokens of float32 through the bench
model's MLP: a 23 MB gate_up output). glibc maps blocks that large anew and unmaps them on free
(or trims them off the heap's top once its dynamic threshold has moved), so every step faulted
its activations in again page by page, each page zeroed by the kernel: in the bench model's
float32 prefill the kernel's page-fault path took ~14% of the CPU, and a 2,048-token step took
~760 ms against ~580 with the memory kept (bench/README.md, session 29). vLLM's CPU build runs
under tcmalloc for the same reason. This sets kvtransport.heap's process-wide glibc settings: the
mmap threshold at its largest (32 MiB), a trim threshold above a step's activations, the top pad
at 64 MiB (MIN_TRIM_BYTES), not raised with them. A block larger than 32 MiB is still mapped on
its own. The cost: memory a step freed stays mapped, up to the largest step's.
PDSERVE_RETAIN_HEAP=0 leaves glibc's defaults, for A/B measurements.
"""
from __future__ import annotations

import os

from engine.config import ModelConfig
from kvtransport.heap import MIN_TRIM_BYTES, retain_freed


def step_bytes(cfg: ModelConfig, tokens: int) -> int:
    """A generous bound on the activations a step of `tokens` tokens holds at once: per token,
    a few hidden rows (residual, normed, attention output), q/k/v, and the MLP's gate_up and
    product, in the model's dtype."""
    per_token = 4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * cfg.intermediate_size
    return tokens * per_token * cfg.dtype.itemsize


def retain_step_memory(cfg: ModelConfig, max_num_batched_tokens: int) -> bool:
    """Keep a step's freed activations in the heap (kvtransport.heap.retain_freed); True if glibc
    took the settings, False where it did not or PDSERVE_RETAIN_HEAP=0."""
    if os.environ.get("PDSERVE_RETAIN_HEAP", "1") == "0":
        return False
    return retain_freed(step_bytes(cfg, max_num_batched_tokens), pad_bytes=MIN_TRIM_BYTES)
