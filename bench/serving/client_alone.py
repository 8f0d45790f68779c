"""The load generator alone: a measure run's sequence of warm-ups and points (bench/simulate/measure.py)
sent to a stub server (stub_server.py, its own process, answering at once), printing each point's
worst send lag and the collector's pauses over 5 ms in this process. Nothing but the client runs,
so a late send is the client's own.

    python -m bench.serving.client_alone --workload sharegpt --rates 0.5,1 --systems 3
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time

from bench.serving.client import Endpoint
from bench.serving.compare import SweepSpec, _point, free_port
from bench.serving.loadgen import LoadSpec, run_load
from bench.serving.model import word_vocab
from bench.simulate.measure import warmup


class Pauses:
    """The collector's pauses in this process longer than `over_s`: (start, generation, seconds)."""

    def __init__(self, over_s: float = 0.005):
        self.over_s, self.seen, self._t = over_s, [], 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif time.perf_counter() - self._t > self.over_s:
            self.seen.append((self._t, info["generation"], time.perf_counter() - self._t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--rates", default="0.5,1")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--systems", type=int, default=3, help="how many systems' worth of warm-up and points, in turn")
    a = p.parse_args()
    spec = SweepSpec(systems=("stub",), workload=a.workload, num_requests=a.num_requests,
                     rates=tuple(float(r) for r in a.rates.split(",")), output_cap=256, deadline_s=200)
    port, vocab, pauses = free_port(), word_vocab(), Pauses()
    stub = subprocess.Popen([sys.executable, "-m", "bench.serving.stub_server", "--port", str(port)],
                            env=os.environ | {"PYTHONPATH": os.getcwd()})
    try:
        time.sleep(1.0)
        endpoint = Endpoint(f"http://127.0.0.1:{port}", "stub")
        for k in range(a.systems):
            asyncio.run(run_load(endpoint, warmup(spec), vocab, LoadSpec(float("inf"), deadline_s=240), "warm-up"))
            for i, rate in enumerate(spec.rates):
                t0, n = time.perf_counter(), len(pauses.seen)
                point = _point(endpoint, spec, i, rate, vocab, f"system {k}")
                print(f"system {k} rate {rate:g}: max send lag {point['max_send_lag_s'] * 1e3:.1f} ms; collector pauses "
                      f"(s into the point, generation, ms): "
                      f"{[(round(t - t0, 2), g, round(d * 1e3, 1)) for t, g, d in pauses.seen[n:]]}", flush=True)
    finally:
        stub.terminate()
        stub.wait()


if __name__ == "__main__":
    main()
