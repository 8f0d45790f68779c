"""What every benchmark JSON records about the machine and the software, and where it goes."""
from __future__ import annotations

import json
import os
import time

from engine.machine import machine_info

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(bench: str, record: dict, tag: str = "") -> str:
    """Writes {"bench", "machine", **record} to bench/results/<bench>[_<tag>]_<unix time>.json; returns the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    name = "_".join(part for part in (bench, tag, str(int(time.time()))) if part)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"bench": bench, "machine": machine_info(), **record}, f, indent=2)
    return path
