"""The wrapper behind sim20's before / after runs (bench/README.md): runs `python -m bench.simulate ...`
with the load generator's event-loop stalls logged to LOG as JSON lines (a 5 ms ticker's overshoot
past 15 ms), each with the collector's pauses that began in it and the main thread's CPU and
run-queue wait over it (/proc/thread-self/schedstat).

    PYTHONPATH=. python bench/validation/sim20/client_stalls.py LOG measure --workload sharegpt ...
"""
import asyncio, gc, json, runpy, sys, time
LOG = open(sys.argv[1], "w")
sys.argv = ["bench.simulate"] + sys.argv[2:]
pauses = []
st = {}
def note(phase, info):
    if phase == "start": st["t"] = time.perf_counter()
    else: pauses.append((st["t"], time.perf_counter() - st["t"], info["generation"]))
gc.callbacks.append(note)
def run_delay():
    with open("/proc/thread-self/schedstat") as f:
        a = f.read().split(); return int(a[0]) / 1e9, int(a[1]) / 1e9
from bench.serving import loadgen
orig = loadgen.run_load
async def ticker(t0):
    last = time.perf_counter(); cpu0, rq0 = run_delay()
    while True:
        await asyncio.sleep(0.005)
        now = time.perf_counter(); cpu, rq = run_delay()
        if now - last > 0.015:
            gcs = [(round(t - t0, 3), round(d * 1e3, 1), g) for t, d, g in pauses if t >= last - 0.001]
            LOG.write(json.dumps({"at_s": round(last - t0, 3), "stall_ms": round((now - last) * 1e3, 1),
                                  "cpu_ms": round((cpu - cpu0) * 1e3, 1), "runqueue_ms": round((rq - rq0) * 1e3, 1),
                                  "gc": gcs}) + "\n"); LOG.flush()
        last, cpu0, rq0 = now, cpu, rq
async def run_load(endpoint, requests, *a, **k):
    LOG.write(f"# run_load {len(requests)} requests\n"); LOG.flush()
    t = asyncio.create_task(ticker(time.perf_counter()))
    try:
        r = await orig(endpoint, requests, *a, **k)
    finally:
        t.cancel()
    LOG.write(f"# max_send_lag_ms {r.max_send_lag_s*1e3:.1f}\n"); LOG.flush()
    return r
loadgen.run_load = run_load
runpy.run_module("bench.simulate", run_name="__main__")
