"""GPU kernel benchmark: paged decode attention vs contiguous SDPA, store_kv, copy_blocks.

    python bench/kernel_bench_gpu.py [--quick] [--peak-tbs 4.3] [--out bench/results/kernel_bench_gpu.json]

Decode attention (Llama-3-8B shapes: 32 query heads, 8 kv heads, head_dim 128, bf16, block 16)
for batch 1..256 and context 512..32k: the same K/V is laid out paged (random blocks) and
contiguous ([B, Hkv, L, D], SDPA flash backend, GQA group folded into the query length).
Achieved bandwidth = K+V bytes read / time; the fraction is of --peak-tbs (H200: ~4.3 TB/s
achievable of 4.8 nominal).
Exits 0 with a message when no CUDA device is present.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_KV_BYTES = 24 << 30  # per copy (paged and contiguous both exist during a case)


def bench_ms(fn) -> float:
    """Median ms with an L2 flush between runs (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def decode_case(batch: int, context: int, peak: float) -> dict:
    from kernels import paged_attention

    blocks = batch * context // BLOCK
    pool = torch.randn(blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    paged = lambda: paged_attention(query, k_cache, v_cache, table, cu, lens, scale, 1, context)
    k = k_cache[table.long()].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v = v_cache[table.long()].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    # GQA folded into the query length: [B, Hkv, G, D] against [B, Hkv, L, D], so the flash
    # backend reads each K/V byte once (as the paged kernel does) with no expand.
    q4 = query.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    contiguous = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale)
    err = (paged().float() - contiguous().reshape(batch, HEADS, HEAD_DIM).float()).abs().max().item()
    t_paged, t_contig = bench_ms(paged), bench_ms(contiguous)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * pool.element_size()
    del pool, k, v
    return dict(batch=batch, context=context, paged_ms=t_paged, contiguous_ms=t_contig,
                paged_gbs=kv_bytes / t_paged / 1e6, contiguous_gbs=kv_bytes / t_contig / 1e6,
                paged_peak_fraction=kv_bytes / t_paged / 1e9 / peak,
                ratio=t_paged / t_contig, max_abs_diff=err)


def store_kv_case(tokens: int = 16384) -> dict:
    from kernels import store_kv

    pool = torch.zeros(tokens // BLOCK * 2, 4, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    key, value = torch.randn(2, tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    slots = torch.randperm(pool.shape[0] * BLOCK, device="cuda")[:tokens]
    ms = bench_ms(lambda: store_kv(key, value, pool[:, 1, 0], pool[:, 1, 1], slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read + write
    return dict(tokens=tokens, ms=ms, gbs=moved / ms / 1e6)


def copy_blocks_case(pairs: int = 256, layers: int = 32) -> dict:
    from kernels import copy_blocks

    pool = torch.zeros(2 * pairs, layers, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    src = torch.arange(pairs, device="cuda")
    dst = torch.arange(pairs, 2 * pairs, device="cuda")
    ms = bench_ms(lambda: copy_blocks(pool, src, dst))
    moved = 2 * pool[0].numel() * pool.element_size() * pairs  # read + write
    return dict(pairs=pairs, block_mib=pool[0].numel() * pool.element_size() / 2**20, ms=ms, gbs=moved / ms / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batches 1, 64 and contexts 512, 8192 only")
    parser.add_argument("--peak-tbs", type=float, default=4.3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_bench_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"kernel_bench_gpu: SKIPPED - no CUDA device visible to torch {torch.__version__}")
        return 0
    import triton

    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                peak_tbs=args.peak_tbs, dtype=str(DTYPE), heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                block_size=BLOCK)
    print(info)
    batches, contexts = ((1, 64), (512, 8192)) if args.quick else (BATCHES, CONTEXTS)
    rows = []
    print(f"{'batch':>5} {'ctx':>6} {'paged ms':>9} {'GB/s':>7} {'%peak':>6} {'contig ms':>9} {'GB/s':>7} {'ratio':>6} {'maxdiff':>8}")
    for batch in batches:
        for context in contexts:
            if 2 * batch * context * KV_HEADS * HEAD_DIM * 2 > MAX_KV_BYTES:
                print(f"{batch:5d} {context:6d}  skipped (K+V over {MAX_KV_BYTES >> 30} GiB)")
                continue
            start = time.time()
            r = decode_case(batch, context, args.peak_tbs)
            rows.append(r)
            print(f"{batch:5d} {context:6d} {r['paged_ms']:9.4f} {r['paged_gbs']:7.0f} {100 * r['paged_peak_fraction']:5.1f}% "
                  f"{r['contiguous_ms']:9.4f} {r['contiguous_gbs']:7.0f} {r['ratio']:6.2f} {r['max_abs_diff']:8.1e}"
                  f"  ({time.time() - start:.1f}s)", flush=True)
            torch.cuda.empty_cache()
    store, copy = store_kv_case(), copy_blocks_case()
    print(f"store_kv: {store}\ncopy_blocks: {copy}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=info, decode=rows, store_kv=store, copy_blocks=copy), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
