"""kernels/ attention launchers vs the plain-PyTorch reference (CPU; CUDA too when present; the block
launchers are in test_block_launchers.py, which prefill path a sequence takes in test_prefill_routing.py).

"cpu" runs decode and prefill rows through the C kernels (kernels/csrc/paged_decode.c,
paged_prefill.c), "cpu-torch" through the PyTorch fallback (gather + SDPA) that hosts without a
C compiler use."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels import cpu_decode
from kernels.cpu_kernels import build_error, paged_decode_lib, paged_prefill_lib
from kernels import paged_attention, store_kv
from kernels.reference import paged_attention_ref
from kernels.testing import ATOL, make_paged_batch, run_and_compare

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATTN_DEVICES = DEVICES + ["cpu-torch"]
@pytest.mark.parametrize("device", ATTN_DEVICES)
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_batch_matches_reference(device, kv_heads, block_size):
    """Pure decode over ragged contexts (1, block multiples, odd) equals the reference, GQA 1-8."""
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, 100, 255, 256]
    run_and_compare(seq_lens, [1] * len(seq_lens), 8, kv_heads, 64, block_size, torch.float32, device)


@pytest.mark.parametrize("device", ATTN_DEVICES)
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_mixed_prefill_decode_matches_reference(device, kv_heads, head_dim):
    """A batch mixing fresh prefills, chunked prefills over a cached prefix and decodes is exact."""
    seq_lens = [40, 17, 96, 1, 64, 130, 5]
    q_lens = [40, 1, 30, 1, 16, 2, 0]
    run_and_compare(seq_lens, q_lens, 8, kv_heads, head_dim, 16, torch.float32, device)


@pytest.mark.parametrize("device", ATTN_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_stated_tolerance(device, dtype):
    """bf16/fp16 inputs give the fp32-accumulated reference within ATOL[dtype]."""
    run_and_compare([33, 1, 64, 80], [1, 1, 20, 80], 8, 2, 64, 16, dtype, device)


@pytest.mark.parametrize("device", ATTN_DEVICES)
@pytest.mark.parametrize("uniform", [False, True])
def test_engine_sized_decode_batch(device, uniform):
    """The benchmark shape (batch 32, 8 heads, head_dim 64, contexts up to 256) is exact,
    ragged (masked chunks) or all of one length (unmasked chunks)."""
    seq_lens = torch.randint(1, 257, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    run_and_compare([250] * 32 if uniform else seq_lens, [1] * 32, 8, 8, 64, 16, torch.float32, device)


def test_c_attention_kernels_build_and_take_pool_views():
    """This machine kind has a C compiler: the kernels must build and accept the engine's pool views."""
    from kernels import cpu_prefill
    assert paged_decode_lib() is not None, build_error()
    assert paged_prefill_lib() is not None, build_error("paged_prefill")
    b = make_paged_batch([5, 40], [1, 1], 8, 2, 64, 16, torch.float32, "cpu")
    assert cpu_decode.supports(b.query, b.k_cache, b.v_cache) and cpu_prefill.supports(b.query, b.k_cache, b.v_cache)


def test_without_the_c_kernels_attention_falls_back_to_pytorch(monkeypatch, tmp_path):
    """Switched off (or no compiler): no libraries, a stated reason, and attention still exact."""
    libs = {"paged_decode": paged_decode_lib, "paged_prefill": paged_prefill_lib}
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    for lib in libs.values():
        lib.cache_clear()
    try:
        for name, lib in libs.items():
            assert lib() is None and "PDSERVE_CPU_KERNELS" in build_error(name)
        run_and_compare([5, 40, 17, 30], [1, 1, 1, 12], 8, 2, 64, 16, torch.float32, "cpu")
        monkeypatch.setenv("PDSERVE_CPU_KERNELS", "1")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
        for name, lib in libs.items():
            lib.cache_clear()
            assert lib() is None and "no-such-compiler" in build_error(name)
    finally:
        monkeypatch.undo()
        for lib in libs.values():
            lib.cache_clear()
    assert paged_decode_lib() is not None and paged_prefill_lib() is not None and build_error() is None


def test_models_the_cuda_kernels_cannot_run_are_named_before_loading():
    """The CPU path takes any head shape; on CUDA a head size without a compiled Triton variant
    is named up front (the engine raises it at start, not at its first forward)."""
    from kernels import unsupported_attention
    cuda = torch.device("cuda")
    assert unsupported_attention(16, 4, 2, torch.device("cpu")) is None
    assert unsupported_attention(32, 32, 8, cuda) is None and unsupported_attention(128, 64, 1, cuda) is None
    assert "head_dim 16" in unsupported_attention(16, 4, 2, cuda)
    assert "and 128" in unsupported_attention(64, 128, 1, cuda)


def test_kernel_cache_keeps_only_the_newest_builds_of_each_kernel(tmp_path):
    """Each source edit leaves a build: the cache keeps the newest KEEP_BUILDS of a kernel and
    leaves other kernels' builds and other files alone."""
    import os
    from kernels import cpu_kernels
    for i in range(cpu_kernels.KEEP_BUILDS + 3):
        path = tmp_path / f"layer_ops-{i:016x}.so"
        path.write_bytes(b"")
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "paged_decode-0000000000000000.so").write_bytes(b"")
    (tmp_path / "layer_ops-notes.txt").write_bytes(b"")
    cpu_kernels._prune(str(tmp_path), "layer_ops")
    kept = sorted(f.name for f in tmp_path.iterdir())
    newest = [f"layer_ops-{i:016x}.so" for i in range(3, cpu_kernels.KEEP_BUILDS + 3)]
    assert kept == sorted(newest + ["paged_decode-0000000000000000.so", "layer_ops-notes.txt"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_c_decode_few_sequences(dtype, num_seqs):
    """Batch 1-3 (fewer tasks than threads, or an odd one out) equals the reference, GQA 2,
    every dtype."""
    run_and_compare([70, 16, 3][:num_seqs], [1] * num_seqs, 16, 8, 64, 16, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(8, 64), (2, 64), (1, 128), (4, 128), (2, 96)])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_c_decode_blocks_match_reference(dtype, kv_heads, head_dim, block_size):
    """float32 and bf16 decode with head_dim 64 or 128 take the block path (16 tokens per query
    head, FMAs or vdpbf16ps; 96 keeps the generic loop): contexts ending anywhere in a block,
    shorter than 16 tokens, several blocks, GQA, within the dtype's tolerance."""
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 100, 257]
    run_and_compare(seq_lens, [1] * len(seq_lens), 8, kv_heads, head_dim, block_size, dtype, "cpu")


@pytest.mark.parametrize("device", ["cpu", "cpu-torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_similar_chunked_prefills_match_reference(device, dtype, kv_heads):
    """Equal and nearly equal chunks over cached prefixes (on the PyTorch path: one SDPA call
    each) are exact."""
    run_and_compare([256, 256, 250, 240, 33], [64, 64, 60, 64, 33], 8, kv_heads, 64, 16, dtype, device)


@pytest.mark.parametrize("device", ["cpu", "cpu-torch"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_equal_fresh_prefills_match_reference(device, kv_heads):
    """Fresh prompts of one length (on the PyTorch path: one is_causal SDPA) next to decode rows
    are exact."""
    run_and_compare([48, 48, 48, 7], [48, 48, 48, 1], 8, kv_heads, 64, 16, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(8, 64), (1, 64), (2, 96), (4, 128)])
@pytest.mark.parametrize("block_size", [8, 32])
def test_c_prefill_long_contexts_match_reference(dtype, kv_heads, head_dim, block_size):
    """The C prefill kernel where it tiles: a fresh prompt over many 64-key chunks and several
    query tiles, a chunk starting mid-block after a cached prefix, a chunk one key past a chunk
    boundary; GQA 8:1 (16-token tiles) to 1:1 (128-token tiles)."""
    from kernels import cpu_prefill
    b = make_paged_batch([300, 1, 2], [1, 1, 1], 8, kv_heads, head_dim, block_size, dtype, "cpu")
    assert cpu_prefill.supports(b.query, b.k_cache, b.v_cache)
    run_and_compare([300, 229, 65, 5], [300, 200, 65, 1], 8, kv_heads, head_dim, block_size, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("min_segment,max_splits", [(16, 2), (48, 3), (64, 16)])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_c_decode_context_splits_merge_exactly(monkeypatch, dtype, min_segment, max_splits, kv_heads):
    """Flash-decoding: each sequence's context cut into block-aligned segments (one per
    min_segment tokens, at most max_splits; some empty for short sequences), partial softmax sums
    merged per sequence, equals the reference; unsplit and split sequences in one batch."""
    monkeypatch.setattr(cpu_decode, "MIN_SEGMENT", min_segment)
    monkeypatch.setattr(cpu_decode, "MAX_SPLITS", max_splits)
    seq_lens = [1, 16, 17, 100, 513, 1000]
    run_and_compare(seq_lens, [1] * len(seq_lens), 8, kv_heads, 64, 16, dtype, "cpu")


@st.composite
def _ragged_batches(draw):
    """(seq_lens, q_lens, kv_heads, group, block_size): any mix of decode and (chunked) prefill."""
    seq_lens = draw(st.lists(st.integers(1, 70), min_size=1, max_size=6))
    q_lens = [draw(st.sampled_from([0, 1, 1, s, max(1, s // 3)])) for s in seq_lens]
    kv_heads, group, block_size = (draw(st.sampled_from(c)) for c in ([1, 2], [1, 2, 4], [8, 16]))
    return seq_lens, q_lens, kv_heads, group, block_size


@settings(max_examples=40, deadline=None)
@given(_ragged_batches())
def test_random_ragged_batches_match_reference(batch):
    """Any ragged mix of decode, fresh prefill, chunked prefill and empty rows equals the reference."""
    seq_lens, q_lens, kv_heads, group, block_size = batch
    run_and_compare(seq_lens, q_lens, kv_heads * group, kv_heads, 32, block_size, torch.float32, "cpu")


def test_separate_k_and_v_tensors_match_reference():
    """K and V caches that are not views of one pool (no fused gather) give the same answer."""
    b = make_paged_batch([40, 1, 23], [1, 1, 23], 8, 2, 64, 8)
    k, v = b.k_cache.clone(), b.v_cache.contiguous()
    args = (b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    out = paged_attention(b.query, k, v, *args)
    torch.testing.assert_close(out, paged_attention_ref(b.query, k, v, *args), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_output_ignores_other_sequences_blocks(device):
    """Changing a block not owned by a sequence leaves that sequence's output bit-identical."""
    b = make_paged_batch([20, 20], [1, 1], 4, 2, 64, 16, torch.float32, device)
    args = (b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    before = paged_attention(b.query, b.k_cache, b.v_cache, *args)
    b.k_cache[b.block_tables[1, :2].long()] += 1.0
    after = paged_attention(b.query, b.k_cache, b.v_cache, *args)
    assert torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])


def _attention_args():
    b = make_paged_batch([20, 9], [4, 1], 4, 2, 64, 8)
    return dict(query=b.query, k_cache=b.k_cache, v_cache=b.v_cache, block_tables=b.block_tables,
                cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens, scale=b.scale)


BAD_ATTENTION_ARGS = {
    "head_dim mismatch": ("query", lambda a: a["query"][..., :32]),
    "heads not multiple": ("query", lambda a: torch.randn(5, 3, 64)),
    "query dtype": ("query", lambda a: a["query"].half()),
    "int64 block table": ("block_tables", lambda a: a["block_tables"].long()),
    "cu_seqlens length": ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:-1]),
    "cu_seqlens end": ("cu_seqlens_q", lambda a: torch.tensor([0, 4, 6], dtype=torch.int32)),
    "q longer than seq": ("seq_lens", lambda a: torch.tensor([3, 9], dtype=torch.int32)),
    "seq past table": ("seq_lens", lambda a: torch.tensor([20, 90], dtype=torch.int32)),
    "block id range": ("block_tables", lambda a: a["block_tables"].fill_(10_000)),
    "v_cache shape": ("v_cache", lambda a: a["v_cache"][:, :4]),
}


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION_ARGS))
def test_paged_attention_rejects_bad_arguments(case):
    """Each malformed argument raises ValueError before any kernel runs."""
    args = _attention_args()
    name, mutate = BAD_ATTENTION_ARGS[case]
    args[name] = mutate(args)
    with pytest.raises(ValueError):
        paged_attention(**args)


def test_checks_run_once_per_batch_but_again_after_any_change():
    """Layers reuse one batch's index tensors: checked once; an in-place write or new tensor is checked."""
    args = _attention_args()
    paged_attention(**args)
    paged_attention(**args)                               # seen: skips the checks, still correct
    args["block_tables"].fill_(10_000)                    # same tensor, new version
    with pytest.raises(ValueError):
        paged_attention(**args)
    args = _attention_args()
    paged_attention(**args)
    args["seq_lens"] = torch.tensor([20, 90], dtype=torch.int32)   # a new tensor
    with pytest.raises(ValueError):
        paged_attention(**args)
    kv = torch.zeros(4, 2, 2, 8, 2, 16)
    slots = torch.tensor([0, 1])
    store_kv(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), kv[:, 0, 0], kv[:, 0, 1], slots)
    slots.fill_(64)                                       # past the 4 * 8 slots
    with pytest.raises(ValueError):
        store_kv(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), kv[:, 0, 0], kv[:, 0, 1], slots)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_c_kernels_carry_every_16_bit_value_exactly(dtype, rows):
    """A query that sees one key gets that key's V row back (softmax weight exactly 1), so every
    16-bit value written into V (subnormals and infinities included) must come out exactly: the
    kernels' widening to float32 and narrowing back lose nothing. (NaNs stay NaN; arithmetic
    may quiet a signaling one.)"""
    head_dim, heads, values = 64, 8, torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    n = values.numel() // (heads * head_dim)                      # 128 sequences of 512 values
    q_len = 1 if rows == "decode" else 2
    b = make_paged_batch([q_len] * n, [q_len] * n, heads, heads, head_dim, 16, dtype, "cpu")
    b.k_cache.zero_()                                             # every score 0: no NaN from K
    v_rows = values.view(n, heads, head_dim).view(dtype)
    for i in range(n):
        b.v_cache[int(b.block_tables[i, 0]), 0] = v_rows[i]
    out = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    first = out[b.cu_seqlens_q[:-1].long()]                       # each sequence's first row: sees key 0 only
    nan = torch.isnan(v_rows)
    assert torch.equal(torch.isnan(first), nan)
    assert torch.equal(first[~nan], v_rows[~nan])                 # exact (as values: -0 == +0)


def test_building_the_c_kernels_says_so_once(monkeypatch, tmp_path, caplog):
    """A build logs one "building the C kernels" line; the cached library logs nothing the next time."""
    import logging

    from kernels import cpu_kernels

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="kernels.cpu_kernels")
    path = cpu_kernels._build("paged_decode")
    again = cpu_kernels._build("paged_decode")
    lines = [r.getMessage() for r in caplog.records]
    assert path == again and len(lines) == 1
    assert lines[0].startswith("building the C kernels paged_decode with ") and str(tmp_path) in lines[0]

