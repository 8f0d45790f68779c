"""CPU paged attention vs contiguous SDPA on the same data.

    .venv/bin/python bench/attention_cpu.py [--repeats 50] [--threads N]
    .venv/bin/python bench/attention_cpu.py --kv-heads 2 --dtype bfloat16 [--head-dim 128]

For each case the same K/V is laid out twice: paged (random blocks of a multi-layer pool,
as the engine holds it) and contiguous ([B, Hkv, L_max, D], padded, length mask) — the
best plain-SDPA call on an unpaged cache. The paged layout runs through `paged_attention`
as the engine calls it (the C kernels) and through the PyTorch fallback
(gather + SDPA, what hosts without a C compiler run). Prints median times and
paged/contiguous ratios (bar: <= 1.3x) and writes bench/results/attention_cpu.json.
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import paged_attention
from kernels.reference import gather_sequence_kv
from kernels.testing import make_paged_batch, pytorch_attention

# (name, seq_lens, q_lens): by default the engine benchmark's model, 8 heads, head_dim 64, fp32.
CASES = [
    ("decode b32 ctx256", [256] * 32, [1] * 32),
    ("decode b32 ctx128", [128] * 32, [1] * 32),
    ("decode b32 ctx1-256 ragged", torch.randint(1, 257, (32,), generator=torch.Generator().manual_seed(0)).tolist(), [1] * 32),
    ("decode b8 ctx2048", [2048] * 8, [1] * 8),
    ("decode b32 ctx1024", [1024] * 32, [1] * 32),
    ("decode b1 ctx4000", [4000], [1]),
    ("prefill 4x256", [256] * 4, [256] * 4),
    ("prefill 16x128", [128] * 16, [128] * 16),
    ("prefill 1x2048", [2048], [2048]),
    ("chunked prefill 4x(192+64)", [256] * 4, [64] * 4),
    ("chunked prefill 1x(1536+512)", [2048], [512]),
]


def contiguous_sdpa(b):
    """Returns a closure running SDPA on a padded contiguous copy of batch b's K/V.

    Every sequence of a case has the same q_len; GQA is a stride-0 expand (no copy);
    fresh prefills use is_causal, everything else an additive mask [B, 1, q_len, L].
    """
    num_kv_heads, head_dim = b.k_cache.shape[2:]
    lens, cu = b.seq_lens.tolist(), b.cu_seqlens_q.tolist()
    batch, num_heads, q_len, L = len(lens), b.query.shape[1], cu[1] - cu[0], max(lens)
    k = torch.zeros(batch, num_kv_heads, L, head_dim, dtype=b.query.dtype)
    v = torch.zeros_like(k)
    for i, n in enumerate(lens):
        k[i, :, :n] = gather_sequence_kv(b.k_cache, b.block_tables[i], n).transpose(0, 1)
        v[i, :, :n] = gather_sequence_kv(b.v_cache, b.block_tables[i], n).transpose(0, 1)
    shape = (batch, num_kv_heads, num_heads // num_kv_heads, L, head_dim)
    k = k[:, :, None].expand(shape).flatten(1, 2)  # [B, H, L, D], stride 0 within a group
    v = v[:, :, None].expand(shape).flatten(1, 2)
    q = b.query.view(batch, q_len, num_heads, head_dim).transpose(1, 2)  # [B, H, q_len, D]
    if q_len == L and len(set(lens)) == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=b.scale)
    q_pos = torch.tensor(lens)[:, None] - q_len + torch.arange(q_len)  # [B, q_len]
    keep = (torch.arange(L) <= q_pos[:, :, None])[:, None]  # [B, 1, q_len, L]
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, float("-inf"))  # additive: SDPA's fastest
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale)


def timings_ms(fns, repeats):
    """(median, min) wall time of each fn; runs interleaved so drift hits all alike."""
    times = [[] for _ in fns]
    for f in fns:
        f(), f()
    for _ in range(repeats):
        for t, f in zip(times, fns):
            start = time.perf_counter()
            f()
            t.append(time.perf_counter() - start)
    return [(sorted(t)[len(t) // 2] * 1e3, min(t) * 1e3) for t in times]


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return dict(cpu=cpu, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), load_avg_1m=os.getloadavg()[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=8, help="of 8 query heads (GQA below 8)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    info, rows = machine(), []
    shape = dict(heads=8, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, block_size=16)
    print(info, shape)
    print("median (min) ms over interleaved runs; ratio = paged / contiguous")
    print(f"{'case':30s} {'paged':>15s} {'torch path':>15s} {'contiguous':>15s} {'ratio':>11s} {'torch ratio':>11s}")
    for name, seq_lens, q_lens in CASES:
        b = make_paged_batch(seq_lens, q_lens, 8, args.kv_heads, args.head_dim, 16, dtype, num_layers=8)
        paged = lambda: paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q,
                                        b.seq_lens, b.scale, b.max_seqlen_q, b.max_seqlen_k)
        def torch_path():
            with pytorch_attention():
                return paged()
        (p_med, p_min), (t_med, t_min), (c_med, c_min) = timings_ms([paged, torch_path, contiguous_sdpa(b)],
                                                                    args.repeats)
        rows.append(dict(case=name, paged_ms=p_med, torch_path_ms=t_med, contiguous_ms=c_med, ratio=p_med / c_med,
                         torch_path_ratio=t_med / c_med, paged_min_ms=p_min, torch_path_min_ms=t_min,
                         contiguous_min_ms=c_min, ratio_min=p_min / c_min))
        print(f"{name:30s} {p_med:7.2f} ({p_min:5.2f}) {t_med:7.2f} ({t_min:5.2f}) {c_med:7.2f} ({c_min:5.2f}) "
              f"{p_med / c_med:5.2f} ({p_min / c_min:.2f}) {t_med / c_med:5.2f} ({t_min / c_min:.2f})")
    default = args.kv_heads == 8 and args.head_dim == 64 and args.dtype == "float32"
    tag = "" if default else f"_kv{args.kv_heads}_d{args.head_dim}_{args.dtype}"
    out = Path(__file__).parent / "results" / f"attention_cpu{tag}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(machine=info, shape=shape, results=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
