"""What a benchmark or a profile records about the machine it ran on and the software."""
from __future__ import annotations

import os
import platform


def machine_info() -> dict:
    import torch
    import transformers
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "load_avg_1m": os.getloadavg()[0], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
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
