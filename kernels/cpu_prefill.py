"""Prefill rows (q_len > 1, possibly after a cached prefix) of CPU paged attention.

The C kernel (kernels/csrc/paged_prefill.c) reads K and V in place through the block tables,
all prefill sequences in one call, when it is built and takes the tensors; but a long bfloat16
sequence on a CPU with AMX tiles goes to torch's SDPA (`to_library`), whose flash attention
multiplies on the tiles; on a CPU without AVX-512 (`native_vectors`) every sequence takes the
PyTorch path below, as where the kernel is not built (PDSERVE_PREFILL_SDPA=0 still forces the
kernel). That path is causal SDPA over K/V gathered out of the pool.

Fresh prompts of one length go through one SDPA call (is_causal, GQA by expanding K/V); every
other sequence runs alone (is_causal when all its tokens are new, else `_after_prefix`). So a
sequence's rows get the same bits whatever else is in the batch: a greedy stream gives the same
tokens alone, beside others, or moved to another node mid-stream. (A padded batch of similar
sequences under an additive mask, which this path used to take, saved per-call overhead on small
chunks, but its bits depended on the batch's longest sequence: on an AVX2-only CPU a bfloat16
stream's tokens changed with the prompts it was prefilled beside.)
"""

import functools
import os

import torch
import torch.nn.functional as F

from kernels.cpu_decode import layout_ok
from kernels.cpu_gather import additive_mask, block_ids, gather_kv
from kernels.cpu_kernels import DTYPES, paged_prefill_lib


# From this context on (and this many new tokens), torch's SDPA takes a bfloat16 sequence where the
# CPU has AMX tiles: its flash attention multiplies on them (oneDNN's brgemm), where the C kernel
# widens to float32 for AVX-512 FMAs. C kernel / SDPA on the benchmark host (Intel Xeon, AMX, 2
# cores, quiet, three runs; `python bench/prefill_attention.py`, bench/README.md "Long prompts'
# prefill attention"): 0.47-0.59 at 16 prompts of 128, 0.59-0.81 at 8 of 256, 0.98-1.11 at 4 of
# 512, 1.2-1.5 at 1,024, 2.1-2.4 at 2,048, 2.4-2.9 at 4,000; after 2,048 cached tokens 0.73-0.91
# for 64 new ones, 1.0-1.5 for 256; 2.2-2.7 for 2,000 new after 2,000 (with _after_prefix). float32
# stays on the C kernel (SDPA 0.46-1.33x its speed). PDSERVE_PREFILL_SDPA=0 keeps every sequence on
# the C kernel, =1 sends every one to SDPA.
LIBRARY_CONTEXT, LIBRARY_NEW_TOKENS = 512, 128


def to_library(dtype: torch.dtype, seq_len: int, q_len: int) -> bool:
    """Whether a prefill sequence of seq_len tokens, q_len of them new, goes to torch's SDPA even
    where the C kernel could take it: every one on a CPU without AVX-512, long bfloat16 ones where
    the CPU has AMX tiles."""
    switch = os.environ.get("PDSERVE_PREFILL_SDPA")
    if switch in ("0", "1"):
        return switch == "1"
    return not native_vectors() or (dtype == torch.bfloat16 and seq_len >= LIBRARY_CONTEXT
                                    and q_len >= LIBRARY_NEW_TOKENS and _amx_tiles())


@functools.cache
def _amx_tiles() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@functools.cache
def native_vectors() -> bool:
    """Whether this CPU runs the C kernel's 16-lane float32 vectors natively (AVX-512). Elsewhere
    gcc splits them, and every prefill takes the PyTorch path (SDPA): on an AVX2-only AMD EPYC (Zen 3, 2 cores,
    float32) the C kernel took 4.8x SDPA's time at 16 prompts of 128 and 15x at one of 4,000, so a
    4,000-token prompt's first token took 27 s, 93% of it in attention (`python
    bench/prefill_attention.py --dtype float32`, bench/README.md "An AVX2-only CPU")."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def prefill(out, query, k_cache, v_cache, block_tables, cu, lens, seqs, scale) -> None:
    """Write the rows of sequences `seqs` (each q_len > 1) into out (contiguous rows)."""
    if supports(query, k_cache, v_cache):
        library = [i for i in seqs if to_library(query.dtype, lens[i], cu[i + 1] - cu[i])]
        if len(library) < len(seqs):
            taken = set(library)
            _prefill_c(out, query, k_cache, v_cache, block_tables, cu, lens, [i for i in seqs if i not in taken], scale)
        seqs = library
    if seqs:
        query = query.contiguous()      # SDPA's bits depend on the rows' strides: the same whoever calls
    for group in _fresh_groups(seqs, cu, lens):
        if len(group) > 1:
            _prefill_batch(out, query, k_cache, v_cache, block_tables[group], lens[group[0]], [cu[i] for i in group], scale)
        else:
            i = group[0]
            out[cu[i] : cu[i + 1]] = prefill_one(query[cu[i] : cu[i + 1]], k_cache, v_cache, block_tables[i],
                                                 lens[i], scale)


def _fresh_groups(seqs, cu, lens) -> list[list[int]]:
    """seqs cut into SDPA calls: the fresh ones (every token new) grouped by length, each other
    sequence alone."""
    fresh: dict[int, list[int]] = {}
    alone = []
    for i in seqs:
        if cu[i + 1] - cu[i] == lens[i]:
            fresh.setdefault(lens[i], []).append(i)
        else:
            alone.append([i])
    return [*fresh.values(), *alone]


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel can take these tensors (its layout, head_dim a multiple of 16, <= 256)."""
    return (query.shape[2] % 16 == 0 and query.shape[2] <= 256 and layout_ok(query, k_cache, v_cache)
            and paged_prefill_lib() is not None)


def _prefill_c(out, query, k_cache, v_cache, block_tables, cu, lens, seqs, scale) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    tables = block_tables.contiguous()
    table_rows = torch.tensor(seqs, dtype=torch.int64)
    row0s = torch.tensor([cu[i] for i in seqs], dtype=torch.int64)
    q_lens = torch.tensor([cu[i + 1] - cu[i] for i in seqs], dtype=torch.int32)
    seq_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int32)
    rc = paged_prefill_lib().paged_prefill(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), tables.data_ptr(), tables.stride(0), table_rows.data_ptr(), row0s.data_ptr(),
        q_lens.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), out.stride(0), len(seqs), query.shape[1],
        num_kv_heads, head_dim, block_size, scale, DTYPES[query.dtype], torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_prefill: could not allocate its scratch memory")


def _prefill_batch(out, query, k_cache, v_cache, block_tables, length, starts, scale) -> None:
    """Fresh prompts of one length (rows starting at `starts`, block_tables' rows in the same order
    as query's), one is_causal SDPA call: each prompt's rows the same bits as alone."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    n, n_blk = len(starts), -(-length // block_size)
    seq_lens = torch.full((n,), length)
    ids = block_ids(block_tables[:, :n_blk], seq_lens, block_size)                    # [n * n_blk]
    buf = k_cache.new_empty((2 * ids.numel(), *k_cache.shape[1:]))
    k, v = gather_kv(k_cache, v_cache, ids, buf)                                      # [n * n_blk, bs, Hkv, D]
    k = k.view(n, n_blk * block_size, num_kv_heads, head_dim)[:, :length].transpose(1, 2)   # [n, Hkv, L, D]
    v = v.view(n, n_blk * block_size, num_kv_heads, head_dim)[:, :length].transpose(1, 2)
    rows = torch.tensor(starts)[:, None] + torch.arange(length)                       # [n, L]
    q = query[rows.flatten()].view(n, length, -1, head_dim).transpose(1, 2)           # [n, H, L, D]
    shape = (n, num_kv_heads, group, length, head_dim)
    k = k[:, :, None].expand(shape).reshape(n, -1, length, head_dim)                  # [n, H, L, D] (copy if GQA)
    v = v[:, :, None].expand(shape).reshape(n, -1, length, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    out.index_copy_(0, rows.flatten(), o.transpose(1, 2).reshape(n * length, -1, head_dim))


def prefill_one(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """Causal attention of one sequence's q_len newest rows over its seq_len cached tokens."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    q_len, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    ids = table[: -(-seq_len // block_size)].long()
    kv_shape = (num_kv_heads, group, seq_len, head_dim)
    k, v = gather_kv(k_cache, v_cache, ids, k_cache.new_empty((2 * ids.numel(), *k_cache.shape[1:])))
    k = k.flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = v.flatten(0, 1)[:seq_len].transpose(0, 1)
    k, v = k[:, None].expand(kv_shape), v[:, None].expand(kv_shape)  # [Hkv, G, L, D], stride 0 on G
    qh = q.transpose(0, 1).view(num_kv_heads, group, q_len, head_dim)  # [Hkv, G, q_len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    elif _FLASH is not None:
        o = _after_prefix(qh, k, v, seq_len - q_len, scale)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = additive_mask(torch.arange(seq_len)[None, :] <= q_pos, q.dtype)  # [q_len, L]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return o.view(num_heads, q_len, head_dim).transpose(0, 1)


# torch's CPU flash attention with its log-sum-exp (what SDPA calls on CPU; None where this torch lacks it)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """Attention of new rows q [..., q_len, D] over `prefix` cached keys, all visible, then the new
    keys (k, v [..., prefix + q_len, D]) causally: two flash-attention calls, unmasked over the
    prefix and is_causal over the new keys, merged by their log-sum-exps. The same softmax as one
    call with the causal mask offset by the prefix, which takes SDPA's slower masked path
    (bench/README.md, "Long prompts' prefill attention"). In bf16 / fp16 the two outputs come back
    rounded before the float32 merge: one more rounding than the masked call (errors ~1.3x its,
    far inside the tolerances tests state)."""
    o1, lse1 = _FLASH(q, k[..., :prefix, :], v[..., :prefix, :], 0.0, False, scale=scale)
    o2, lse2 = _FLASH(q, k[..., prefix:, :], v[..., prefix:, :], 0.0, True, scale=scale)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_(), (lse2 - top).exp_()
    total = w1 + w2
    out = o1.float().mul_((w1 / total)[..., None]).add_(o2.float().mul_((w2 / total)[..., None]))
    return out.to(q.dtype)
