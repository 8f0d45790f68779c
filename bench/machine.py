"""What every benchmark JSON records about the machine and the software, and where it goes."""
from __future__ import annotations

import json
import os
import platform
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info() -> dict:
    import torch
    import transformers
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "load_avg_1m": os.getloadavg()[0], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_result(bench: str, record: dict, tag: str = "") -> str:
    """Writes {"bench", "machine", **record} to bench/results/<bench>[_<tag>]_<unix time>.json; returns the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    name = "_".join(part for part in (bench, tag, str(int(time.time()))) if part)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"bench": bench, "machine": machine_info(), **record}, f, indent=2)
    return path
