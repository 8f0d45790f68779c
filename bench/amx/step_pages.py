"""An engine's decode step with its KV pool in 4 KiB pages against huge pages: two engines in
one process (PDSERVE_HUGE_PAGES=0 / 1 when each is made), alternating blocks of 10 steps.

    python bench/amx/step_pages.py [bfloat16|float32]     # bench/README.md, "bfloat16 on AMX tiles"
"""
import os, sys, time, random, statistics
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from pdwire.sampling_params import SamplingParams
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
def make(mode):
    os.environ["PDSERVE_HUGE_PAGES"] = mode
    eng = LLMEngine(EngineConfig(model=os.path.join(ROOT, "bench", ".cache", "llama-58m"), dtype=dtype, cache=CacheConfig(kv_cache_gib=0.5),
                                 scheduler=SchedulerConfig(max_num_seqs=32)))
    rng = random.Random(0)
    p = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(32):
        eng.add_request(f"r{i}", [rng.randrange(100, 31000) for _ in range(128)], p)
    for _ in range(4): eng.step()
    return eng
engines = {"4k": make("0"), "huge": make("1")}
print([l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
res = {k: [] for k in engines}
for blk in range(6):
    for k, e in engines.items():
        for _ in range(10):
            s = time.perf_counter(); e.step(); res[k].append(time.perf_counter() - s)
for k in engines: print(k, "step median %.2f ms" % (statistics.median(res[k]) * 1e3))
