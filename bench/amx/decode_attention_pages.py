"""The bf16 paged-decode kernel over the engine's pool layout (8 layers, 32 sequences of CTX
tokens, 8 heads of 64), one pool in 4 KiB pages and one advised huge, alternating; SO is a build
of kernels/csrc/paged_decode.c (gcc -O3 -march=native -fno-math-errno -fopenmp -shared -fPIC
-std=gnu11 -o pd.so kernels/csrc/paged_decode.c -lm).

    python bench/amx/decode_attention_pages.py 150 pd.so    # bench/README.md, "bfloat16 on AMX tiles"
"""
import os, sys, time, ctypes, random
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from kernels.cpu_kernels import _SIGNATURES, DTYPES
ctx = int(sys.argv[1]); so = sys.argv[2]
L, BS, H, D, S = 8, 16, 8, 64, 32
nblk_seq = -(-ctx // BS); num_blocks = S * nblk_seq + 64
libc = ctypes.CDLL("libc.so.6"); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def make(huge):
    pool = torch.empty(num_blocks, L, 2, BS, H, D, dtype=torch.bfloat16)
    if huge:
        a = pool.data_ptr(); n = pool.numel() * 2; lo = (a + (2 << 20) - 1) & ~((2 << 20) - 1); hi = (a + n) & ~((2 << 20) - 1)
        assert libc.madvise(lo, hi - lo, 14) == 0
    torch.manual_seed(0); pool.copy_(torch.randn(num_blocks, L, 2, BS, H, D)); return pool
pools = {"4k": make(False), "huge": make(True)}
print([l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
ids = list(range(num_blocks)); random.Random(0).shuffle(ids)
tables = torch.tensor(ids[:S * nblk_seq], dtype=torch.int32).view(S, nblk_seq)
lens = torch.full((S,), ctx, dtype=torch.int32); rows = torch.arange(S, dtype=torch.int64)
q = torch.randn(S, H, D).to(torch.bfloat16); out = torch.empty_like(q)
lib = ctypes.CDLL(so); a, r = _SIGNATURES["paged_decode"]["paged_decode"]; lib.paged_decode.argtypes = a; lib.paged_decode.restype = r
th = torch.get_num_threads()
def call(pool, i):
    kv = pool[:, i]; k, v = kv[:, 0], kv[:, 1]
    lib.paged_decode(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), tables.data_ptr(), tables.stride(0),
                     lens.data_ptr(), rows.data_ptr(), out.data_ptr(), out.stride(0), S, H, H, D, BS, 0.125, DTYPES[torch.bfloat16], th, 1)
res = {k: [] for k in pools}
for rep in range(11):
    for name, pool in pools.items():
        s = time.perf_counter()
        for _ in range(5):
            for i in range(L): call(pool, i)
        res[name].append((time.perf_counter() - s) / 5 / L)
for name in pools:
    print(name, "%.0f us per layer call" % (sorted(res[name])[5] * 1e6), "runs", [round(x * 1e6) for x in res[name]])
