"""Builds of kernels/csrc/paged_decode.c side by side, in one process, alternating: 32 sequences of
CTX tokens, 8 heads of 64, the engine's pool layout (huge pages), two threads. Three modes:
same (every sequence reads the same blocks: L1/L2-hot, the kernel's own work), warm (one layer
again and again: from L3), cold (the 8 layers cycled: from memory, as in a decode step). Prints
each build's median us a layer call and whether its output equals the first build's; then, in
the same rounds, the read ceiling (bench/amx/kv_read_ceiling.c: the same blocks, tables and
thread split, only read and summed; "read" in one run a block by the hardware prefetchers alone,
"read+pf" with a next-block prefetch, "read/head+pf" head by head as the kernel reads) and each
build's time over the faster of "read" and "read+pf".

    gcc -O3 -march=native -fno-math-errno -fopenmp -shared -fPIC -std=gnu11 -Ikernels/csrc -o new.so kernels/csrc/paged_decode.c -lm
    python bench/amx/decode_attention_ab.py 150 bfloat16 old.so new.so     # bench/README.md, sessions 19, 20
"""
import os, sys, time, ctypes, random, subprocess, tempfile
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
from kernels.cpu_kernels import _SIGNATURES, DTYPES
from kernels.cpu_decode import MAX_SPLITS, MIN_SEGMENT
ctx = int(sys.argv[1]); dt = getattr(torch, sys.argv[2]); sos = sys.argv[3:]
L, BS, H, D, S = 8, 16, 8, 64, 32
nb = -(-ctx // BS); num_blocks = S * nb + 64
libc = ctypes.CDLL("libc.so.6"); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
pool = torch.empty(num_blocks, L, 2, BS, H, D, dtype=dt)
a = pool.data_ptr(); n = pool.numel() * pool.element_size(); lo = (a + (2 << 20) - 1) & ~((2 << 20) - 1); hi = (a + n) & ~((2 << 20) - 1)
libc.madvise(lo, hi - lo, 14)
torch.manual_seed(0); pool.copy_(torch.randn(num_blocks, L, 2, BS, H, D))
ids = list(range(num_blocks)); random.Random(0).shuffle(ids)
tables = {"same": torch.tensor(ids[:nb] * S, dtype=torch.int32).view(S, nb), "warm": torch.tensor(ids[:S * nb], dtype=torch.int32).view(S, nb)}
tables["cold"] = tables["warm"]
lens = torch.full((S,), ctx, dtype=torch.int32); rows = torch.arange(S, dtype=torch.int64)
q = torch.randn(S, H, D).to(dt)
libs = []
for so in sos:
    lib = ctypes.CDLL(so); a_, r_ = _SIGNATURES["paged_decode"]["paged_decode"]; lib.paged_decode.argtypes = a_; lib.paged_decode.restype = r_; libs.append(lib)
th = torch.get_num_threads()
ceil_so = os.path.join(tempfile.mkdtemp(), "ceiling.so")
subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi", "-o", ceil_so,
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_read_ceiling.c")], check=True)
ceil = ctypes.CDLL(ceil_so); I, P = ctypes.c_int, ctypes.c_void_p
ceil.kv_read.argtypes = [P, P, ctypes.c_int64, P, ctypes.c_int64, P, I, I, I, I, I, I, P]; ceil.kv_read.restype = None
sums = torch.zeros(S, dtype=torch.int32); esz = pool.element_size()
def read(pf, tab, i, by_head=False):
    kv = pool[:, i]; k, v = kv[:, 0], kv[:, 1]
    ceil.kv_read(k.data_ptr(), v.data_ptr(), k.stride(0) * esz, tab.data_ptr(), tab.stride(0), lens.data_ptr(), S, BS,
                 H * D * esz, th, pf, D * esz if by_head else 0, sums.data_ptr())
outs = [torch.empty_like(q) for _ in libs]
def call(lib, out, tab, i):
    kv = pool[:, i]; k, v = kv[:, 0], kv[:, 1]
    assert lib.paged_decode(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), tab.data_ptr(), tab.stride(0),
                     lens.data_ptr(), rows.data_ptr(), out.data_ptr(), out.stride(0), S, H, H, D, BS, 0.125, DTYPES[dt], th, MAX_SPLITS, MIN_SEGMENT) == 0
runs = [(os.path.basename(so), lambda tab, i, lib=lib, out=out: call(lib, out, tab, i)) for so, lib, out in zip(sos, libs, outs)]
runs += [("read/head+pf", lambda tab, i: read(1, tab, i, True)), ("read", lambda tab, i: read(0, tab, i)),
         ("read+pf", lambda tab, i: read(1, tab, i))]
res = {(m, j): [] for m in tables for j in range(len(runs))}
for rep in range(9):
    for m, tab in tables.items():
        for j, (_, run) in enumerate(runs):
            s = time.perf_counter()
            for _ in range(4):
                for i in range(L): run(tab, i if m == "cold" else 0)
            res[m, j].append((time.perf_counter() - s) / 4 / L)
for j in range(1, len(libs)):
    print("out equal to first:", torch.equal(outs[0], outs[j]), "max diff", (outs[0].float() - outs[j].float()).abs().max().item())
print("load average", open("/proc/loadavg").read().split()[:3])
for m in tables:
    med = [sorted(res[m, j])[4] * 1e6 for j in range(len(runs))]
    print(m, "  ".join("%s %.0f us" % (runs[j][0], med[j]) for j in range(len(runs))), "|",
          "  ".join("%s/ceiling %.2f" % (runs[j][0], med[j] / min(med[-2:])) for j in range(len(libs))))
