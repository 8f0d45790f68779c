"""Two builds of the C prefill attention kernel in one process, alternating, on the same batches:
median ms per call of each, the first build over the last, and whether every output is bit-identical.

    F="-O3 -march=native -fno-math-errno -fopenmp -shared -fPIC -std=gnu11 -Ikernels/csrc"
    gcc $F -o old.so OLD/paged_prefill.c -lm; gcc $F -o new.so kernels/csrc/paged_prefill.c -lm
    python bench/amx/prefill_attention_ab.py float32 old.so new.so [old.so new.so ...]
    SHAPES="((1, 64, 2048),)" python bench/amx/prefill_attention_ab.py ...    # (sequences, new tokens, context)
"""
import ctypes, os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import kernels
from kernels import cpu_prefill
from kernels.cpu_kernels import _SIGNATURES
libs = []
for so in sys.argv[2:]:
    lib = ctypes.CDLL(so); a_, r_ = _SIGNATURES["paged_prefill"]["paged_prefill"]
    lib.paged_prefill.argtypes = a_; lib.paged_prefill.restype = r_; libs.append(lib)
os.environ["PDSERVE_PREFILL_SDPA"] = "0"
dt = getattr(torch, sys.argv[1]); H, D, bs = 8, 64, 16
for S, Q, L in (eval(os.environ["SHAPES"]) if "SHAPES" in os.environ else ((16, 128, 128), (4, 512, 512), (1, 2048, 2048), (1, 2000, 4000), (1, 64, 2048))):
    per = -(-L // bs); kv = torch.randn(S * per + 1, 2, bs, H, D, dtype=dt)
    tables = torch.arange(S * per, dtype=torch.int32).view(S, per)
    cu = torch.arange(0, S * Q + 1, Q, dtype=torch.int32); lens = torch.full((S,), L, dtype=torch.int32)
    q = torch.randn(S * Q, H, D, dtype=dt)
    outs, ts = [], [[] for _ in libs]
    for r in range(6):
        for i, lib in enumerate(libs):
            cpu_prefill.paged_prefill_lib = lambda lib=lib: lib
            t = time.perf_counter(); o = kernels.paged_attention(q, kv[:, 0], kv[:, 1], tables, cu, lens, D ** -0.5, Q, L); ts[i].append(time.perf_counter() - t)
            if r == 0: outs.append(o)
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    med = [statistics.median(t[1:]) * 1e3 for t in ts]
    print(f"{sys.argv[1]} {S}x{Q}/{L}: " + "  ".join(f"{m:7.2f} ms" for m in med) + f"   old/new {med[0]/med[-1]:.2f}  bit-identical {same}")
