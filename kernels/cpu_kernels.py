"""The C kernels of kernels/csrc, built for this CPU on first use and called through ctypes.

    kernels/csrc/paged_decode.c --cc -O3 -march=native -fopenmp ...--> <cache>/paged_decode-<key>.so

The key hashes the source, the flags, the compiler's version and this CPU's feature flags, so an
edited kernel, another compiler or another machine sharing the cache never loads a stale build.
The cache is $PDSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/pdserve/kernels, else
~/.cache/pdserve/kernels; if that is not writable, a directory in the system's temp dir.
Builds go to a temporary file that is renamed into place, so nodes starting together race
harmlessly. No compiler, or a failed build, leaves `paged_decode_lib()`
returning None (the reason in `build_error()`) and callers use their PyTorch path;
PDSERVE_CPU_KERNELS=0 does the same on purpose.

ctypes releases the GIL for the call; the kernel parallelizes itself with OpenMP over
(sequence, kv-head range) using as many threads as torch does. It shares torch's OpenMP
runtime (libgomp is loaded once per process), so OMP_WAIT_POLICY applies to both.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

_SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_error: str | None = None

c_int, c_i64, c_float, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_PAGED_DECODE_ARGS = [c_void_p, c_i64, c_void_p, c_void_p, c_i64, c_i64, c_void_p, c_i64, c_void_p, c_void_p,
                      c_void_p, c_i64, c_int, c_int, c_int, c_int, c_int, c_float, c_int, c_int, c_int]


def build_error() -> str | None:
    """Why the C kernels are unavailable, or None if they built (or were never asked for)."""
    return _error


@functools.cache
def paged_decode_lib() -> ctypes.CDLL | None:
    """The loaded paged_decode library (its `paged_decode` typed), or None if unavailable."""
    global _error
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        _error = "disabled by PDSERVE_CPU_KERNELS=0"
        return None
    try:
        lib = ctypes.CDLL(_build("paged_decode"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _error = str(exc)
        log.warning("C paged-decode kernel unavailable (%s); using the PyTorch path", exc)
        return None
    lib.paged_decode.argtypes = _PAGED_DECODE_ARGS
    lib.paged_decode.restype = c_int
    _error = None
    return lib


def _build(name: str) -> str:
    """Path of the built shared library `name` (compiled now if not cached)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = os.path.join(_SRC_DIR, name + ".c")
    with open(src, "rb") as f:
        source = f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.blake2b(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_flags()]),
                          digest_size=8).hexdigest()
    for cache in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"pdserve-kernels-{os.getuid()}")):
        path = os.path.join(cache, f"{name}-{key}.so")
        if os.path.exists(path):
            return path
        try:                                  # an unwritable cache (read-only home): the temp dir
            os.makedirs(cache, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            break
        except OSError as exc:
            log.info("kernel cache %s unusable (%s)", cache, exc)
    else:
        raise RuntimeError("no writable directory for the built kernels")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {name}.c: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cache_dir() -> str:
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return os.environ["PDSERVE_KERNEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve", "kernels")


def _cpu_flags() -> bytes:
    """This CPU's feature flags (-march=native code is only valid where they match)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor().encode() + platform.machine().encode()
