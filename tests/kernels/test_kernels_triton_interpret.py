"""Every Triton kernel under TRITON_INTERPRET=1 vs the plain-PyTorch reference, at tiny sizes.

The kernels run in one child process (this file run as a script) so that TRITON_INTERPRET
is set before triton is imported and never leaks into other tests. Known interpreter gap:
triton 3.9's interpreter multiplies bf16 tl.dot operands as raw uint16 bits, so attention
is interpreted in fp32 and fp16 only (bf16 attention is checked on CUDA by
test_kernels_cpu.py and compiled by test_kernels_triton_compile.py); the pure-copy kernels
are interpreted in bf16 too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Stated tolerances: max abs error against the float32 reference (inputs ~ N(0, 1)).
ATOL = {"float32": 2e-5, "float16": 5e-3}
# name -> (seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_sms)
ATTENTION = {
    f"decode-bs{bs}-gqa{8 // kv}": ([1, bs, 2 * bs + 3], [1, 1, 1], 8, kv, 64, bs, "float32", 1)
    for bs in (8, 16, 32) for kv in (8, 4, 2, 1)
}
ATTENTION |= {
    "decode-d128-gqa4": ([1, 16, 33], [1, 1, 1], 8, 2, 128, 16, "float32", 1),
    "decode-d80-padded": ([5, 16], [1, 1], 4, 4, 80, 8, "float32", 1),
    "prefill-fresh-d128": ([20, 32], [20, 32], 4, 2, 128, 16, "float32", 1),
    "mixed-prefill-chunked-decode": ([20, 9, 16, 1, 40], [20, 3, 1, 1, 17], 4, 1, 64, 8, "float32", 1),
    "chunked-prefix-bs32-gqa8": ([70, 33], [5, 32], 8, 1, 64, 32, "float32", 1),
    "empty-query-sequence": ([12, 7], [0, 2], 4, 2, 64, 8, "float32", 1),
    "mqa-group32-block-m64": ([70, 1, 33, 90], [1, 1, 33, 40], 32, 1, 64, 16, "float32", 1),
    "split-k-decode-gqa2": ([1, 300, 260], [1, 1, 1], 4, 2, 64, 16, "float32", 64),
    "split-k-decode-d128": ([257, 129], [1, 1], 2, 1, 128, 32, "float32", 64),
    "decode-fp16": ([1, 16, 35], [1, 1, 1], 8, 2, 64, 16, "float16", 1),
    "mixed-fp16-d128": ([20, 9, 1], [20, 3, 1], 4, 4, 128, 8, "float16", 1),
    "split-k-fp16": ([300, 5], [1, 1], 4, 4, 64, 16, "float16", 64),
}
COPIES = [f"{kind}-{dtype}" for kind in ("store_kv", "copy_blocks", "gather", "scatter")
          for dtype in ("float32", "bfloat16", "float16")]


@pytest.fixture(scope="module")
def results() -> dict:
    """Run every case once in an interpreted child process; name -> max abs error or 'equal'."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_attention_kernel_matches_reference(results, case):
    """The interpreted attention kernel (unified or split-K + merge) equals the reference."""
    dtype, num_sms = ATTENTION[case][6], ATTENTION[case][7]
    assert results[case]["segments"] > 1 if num_sms > 1 else results[case]["segments"] == 1
    assert results[case]["err"] <= ATOL[dtype]


@pytest.mark.parametrize("case", COPIES)
def test_copy_kernel_is_bit_exact(results, case):
    """store_kv and the row-copy kernel write exactly the reference's bytes and nothing else."""
    assert results[case] == "equal"


def _attention_error(case) -> dict:
    import torch

    from kernels.reference import paged_attention_ref
    from kernels.testing import make_paged_batch
    from kernels.triton_paged_attention import paged_attention_triton, pick_config, pick_num_segments

    seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, num_sms = case
    b = make_paged_batch(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, getattr(torch, dtype))
    config = pick_config(b.query.dtype, head_dim, heads // kv_heads, b.max_seqlen_q)
    segments = pick_num_segments(config, len(seq_lens), kv_heads, b.max_seqlen_q, b.max_seqlen_k, num_sms)
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    out = paged_attention_triton(*args, b.max_seqlen_q, b.max_seqlen_k, num_sms=num_sms)
    ref = paged_attention_ref(*args)
    return {"err": (out.float() - ref.float()).abs().max().item(), "segments": segments}


def _copy_equal(name) -> str:
    import torch

    from kernels import reference as ref
    from kernels.testing import make_paged_batch
    from kernels.triton_block_copy import copy_rows_triton
    from kernels.triton_kv_store import store_kv_triton

    kind, dtype = name.split("-")
    b = make_paged_batch([50], [1], 4, 2, 64, 16, getattr(torch, dtype))
    pool, expected = b.kv_cache, b.kv_cache.clone()
    ids, other = torch.tensor([0, 3]), torch.tensor([5, 1])
    if kind == "store_kv":
        key, value = torch.randn(2, 6, 2, 64).to(pool.dtype)
        slots = torch.tensor([0, 17, -1, 31, 32, 50])
        ref.store_kv_ref(key, value, expected[:, -1, 0], expected[:, -1, 1], slots)
        store_kv_triton(key, value, b.k_cache, b.v_cache, slots)
    elif kind == "copy_blocks":
        ref.copy_blocks_ref(expected, ids, other)
        copy_rows_triton(pool, ids, pool, other)
    elif kind == "gather":
        pool, expected = pool.new_empty((2, *pool.shape[1:])), ref.gather_blocks_ref(pool, ids)
        copy_rows_triton(b.kv_cache, ids, pool, None)
    else:
        buffer = torch.randn(2, *pool.shape[1:]).to(pool.dtype)
        ref.scatter_blocks_ref(expected, other, buffer)
        copy_rows_triton(buffer, None, pool, other)
    return "equal" if torch.equal(pool, expected) else "differs"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    out = {name: _attention_error(case) for name, case in ATTENTION.items()}
    out |= {name: _copy_equal(name) for name in COPIES}
    print(json.dumps(out))
