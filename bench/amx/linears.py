"""bf16 linears at decode sizes, oneDNN's packed path against pdserve's AMX GEMM: each of the
58.5M model's shapes (weights cache-warm), then a pass over every linear of 8 layers and lm_head
(84 MB, from memory) with this machine's read bandwidth (float32 sum over 512 MB) in the same run.

    python bench/amx/linears.py [ROWS] [THREADS]          # bench/README.md, "bfloat16 on AMX tiles"
"""
import os, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from kernels import gemm_amx
torch.manual_seed(0)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
torch.set_num_threads(threads)
shapes = {"qkv": (1536, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408), "lm_head": (32000, 512)}
def t(fn, n=200, reps=7):
    for _ in range(5): fn()
    xs = []
    for _ in range(reps):
        s = time.perf_counter()
        for _ in range(n): fn()
        xs.append((time.perf_counter() - s) / n)
    return sorted(xs)[len(xs) // 2]
print("threads", torch.get_num_threads(), "rows", rows)
for name, (o, i) in shapes.items():
    w = torch.randn(o, i).to(torch.bfloat16); x = torch.randn(rows, i).to(torch.bfloat16)
    p0 = torch.ops.mkldnn._reorder_linear_weight(w)
    pa = gemm_amx.pack_weight(w)
    n = 40 if name == "lm_head" else 300
    a = t(lambda: torch.ops.mkldnn._linear_pointwise(x, p0, None, "none", [], ""), n)
    b = t(lambda: gemm_amx.product(x, pa, o, None), n)
    gb = o * i * 2 / 1e9
    print(f"{name:8s} oneDNN {a*1e6:7.1f} us ({gb/a:5.1f} GB/s)   amx {b*1e6:7.1f} us ({gb/b:5.1f} GB/s)   amx/oneDNN {b/a:.2f}")
L = [{n: torch.randn(*s).to(torch.bfloat16) for n, s in shapes.items() if n != "lm_head"} for _ in range(8)]
H = torch.randn(32000, 512).to(torch.bfloat16)
xs = {n: torch.randn(rows, s[1]).to(torch.bfloat16) for n, s in shapes.items()}
dn = [{n: torch.ops.mkldnn._reorder_linear_weight(w) for n, w in l.items()} for l in L]; dh = torch.ops.mkldnn._reorder_linear_weight(H)
am = [{n: gemm_amx.pack_weight(w) for n, w in l.items()} for l in L]; ah = gemm_amx.pack_weight(H)
def onednn_pass():
    for l in dn:
        for n, p in l.items(): torch.ops.mkldnn._linear_pointwise(xs[n], p, None, "none", [], "")
    torch.ops.mkldnn._linear_pointwise(xs["lm_head"], dh, None, "none", [], "")
def amx_pass():
    for l in am:
        for n, p in l.items(): gemm_amx.product(xs[n], p, shapes[n][0], None)
    gemm_amx.product(xs["lm_head"], ah, 32000, None)
tot = (8 * sum(o * i for n, (o, i) in shapes.items() if n != "lm_head") + 32000 * 512) * 2 / 1e9
for r in range(2):
    a = t(onednn_pass, 10, 5); b = t(amx_pass, 10, 5)
    print(f"model pass ({tot*1e3:.0f} MB) oneDNN {a*1e3:.2f} ms ({tot/a:.1f} GB/s)  amx {b*1e3:.2f} ms ({tot/b:.1f} GB/s)  amx/oneDNN {b/a:.2f}")
big = torch.ones(128 << 20, dtype=torch.float32)
bw = t(lambda: big.sum(), 2, 3)
print(f"read bandwidth (float32 sum over 512 MiB, {torch.get_num_threads()} threads): {0.537/bw:.1f} GB/s")
