"""The planner's profile of pdserve measured on a GPU: a random-weight model of a published shape,
made on the device in bfloat16, then `pdserve profile` on it (pdplan/profiler.py: the engine a node
runs, timed step by step, and blocks of its size over a ZeroMQ socket pair).

    python bench/gpu_profile.py --out bench/profiles/gpu_h200_llama2_7b_measured.json --kv-cache-gib 100 --max-num-seqs 256
    python bench/gpu_profile.py --shape tiny --device cpu --quick --out /tmp/p.json   # a smoke run

Random weights time the same as trained ones (the same shapes, the same kernels); greedy text is
not what is measured. The repo's other GPU profile (bench/profiles/gpu_a100_llama2_7b_published.json)
is extrapolated from published figures: this one is a run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.random_model import make_random_llama  # noqa: E402

SHAPES = {   # Llama-2-7B's config.json; tiny: for a smoke run on a CPU
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
}


def make_model(path: str, shape: str, device: str) -> str:
    """A random bfloat16 Llama of the shape, made on `device` and saved as a Hugging Face folder
    (kept: a second run reuses it)."""
    start = time.perf_counter()
    made = not os.path.isfile(os.path.join(path, "config.json"))
    make_random_llama(path, device=device, dtype="bfloat16", **SHAPES[shape])
    if made:
        print(f"gpu_profile: {shape} made and saved in {time.perf_counter() - start:.0f} s at {path}", flush=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--model-dir", default=None, help="where the model is made (default: /tmp/pdserve-<shape>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-cache-gib", default="40", help="the profiled engine's KV pool")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="pdserve profile's small grid")
    args, node_flags = ap.parse_known_args()     # any other flag is the profiled node's (pdserve profile --help)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: SKIPPED - no CUDA device visible to torch")
        return 0
    path = make_model(args.model_dir or f"/tmp/pdserve-{args.shape}", args.shape, args.device)
    if args.device == "cuda":
        print(f"gpu_profile: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    from pdplan.cli import profile_main

    # --raw-steps: the CPU's speed probes do not apply to a GPU (pdplan/profiler.py Profiler.speed)
    profile_main(["--model", path, "--device", args.device, "--dtype", "bfloat16", "--kv-cache-gib",
                  args.kv_cache_gib, "--raw-steps", "--out", args.out, *node_flags] + (["--quick"] if args.quick else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
