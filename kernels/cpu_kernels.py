"""The C kernels of kernels/csrc, built for this CPU on first use and called through ctypes.

    kernels/csrc/paged_decode.c --cc -O3 -march=native -fopenmp ...--> <cache>/paged_decode-<key>.so
    kernels/csrc/paged_prefill.c ---------------------------------------> <cache>/paged_prefill-<key>.so
    kernels/csrc/layer_ops.c    --cc ... -ffp-contract=off -------------> <cache>/layer_ops-<key>.so
    kernels/csrc/gemm_bf16.c -------------------------------------------> <cache>/gemm_bf16-<key>.so
    kernels/csrc/gemm_amx.c --------------------------------------------> <cache>/gemm_amx-<key>.so
    kernels/csrc/gemm_f32.c --------------------------------------------> <cache>/gemm_f32-<key>.so
    kernels/csrc/gemm_avx2.c -------------------------------------------> <cache>/gemm_avx2-<key>.so
    kernels/csrc/argmax.c ----------------------------------------------> <cache>/argmax-<key>.so
    kernels/csrc/stream_copy.c -----------------------------------------> <cache>/stream_copy-<key>.so

The key hashes the source, the shared headers (csrc/*.h), the flags, the compiler's version
and this CPU's feature flags, so an edited kernel, another compiler or another machine sharing
the cache never loads a stale build.
The cache is $PDSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/pdserve/kernels, else
~/.cache/pdserve/kernels; if that is not writable, a directory in the system's temp dir.
Builds go to a temporary file that is renamed into place, so nodes starting together race
harmlessly; a new build deletes all but the KEEP_BUILDS most recently used builds of its
kernel. No compiler, or a failed build, leaves `paged_decode_lib()`, `paged_prefill_lib()`,
`layer_ops_lib()`, `gemm_bf16_lib()`, `gemm_amx_lib()`, `gemm_f32_lib()`, `gemm_avx2_lib()`,
`argmax_lib()` and `stream_copy_lib()` returning None (the reason in `build_error(name)`) and
callers use their PyTorch (or plain Python) path; PDSERVE_CPU_KERNELS=0 does the same on purpose.

ctypes releases the GIL for the call; the kernels parallelize themselves with OpenMP, using as
many threads as torch does. They share torch's OpenMP runtime (libgomp is loaded once per
process), so OMP_WAIT_POLICY applies to both.
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

import torch

log = logging.getLogger(__name__)

_SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
KEEP_BUILDS = 4                 # per kernel, in the cache
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

c_int, c_i64, c_float, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {    # library -> {function: (argtypes, restype)}
    "paged_decode": {
        "paged_decode": ([c_void_p, c_i64, c_void_p, c_void_p, c_i64, c_i64, c_void_p, c_i64, c_void_p, c_void_p,
                          c_void_p, c_i64, c_int, c_int, c_int, c_int, c_int, c_float, c_int, c_int, c_int, c_int],
                         c_int),
    },
    "paged_prefill": {
        "paged_prefill": ([c_void_p, c_i64, c_void_p, c_void_p, c_i64, c_i64, c_void_p, c_i64, c_void_p, c_void_p,
                           c_void_p, c_void_p, c_void_p, c_i64, c_int, c_int, c_int, c_int, c_int, c_float, c_int,
                           c_int], c_int),
    },
    "layer_ops": {
        "rms_norm": ([c_void_p, c_i64, c_void_p, c_i64, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_float, c_int,
                      c_int], None),
        "silu_mul": ([c_void_p, c_i64, c_void_p, c_i64, c_i64, c_i64, c_int, c_int], None),
        "rotary": ([c_void_p, c_i64, c_i64, c_i64, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_int, c_int], c_int),
        "store_kv": ([c_void_p, c_i64, c_void_p, c_i64, c_void_p, c_void_p, c_i64, c_i64, c_void_p, c_i64, c_i64,
                      c_i64, c_i64, c_int, c_int], c_int),
    },
    "gemm_bf16": {
        "gemm_bf16_supported": ([], c_int),
        "gemm_bf16_tile_n": ([], c_int),
        "gemm_bf16": ([c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_i64, c_int], None),
    },
    "gemm_amx": {
        "gemm_amx_supported": ([], c_int),
        "gemm_amx_tile_n": ([], c_int),
        "gemm_amx_k_step": ([], c_int),
        "gemm_amx": ([c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_i64, c_int], c_int),
    },
    "gemm_f32": {
        "gemm_f32_supported": ([], c_int),
        "gemm_f32_tile_n": ([], c_int),
        "gemm_f32": ([c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_i64, c_int], None),
    },
    "gemm_avx2": {
        "gemm_avx2_f32_supported": ([], c_int),
        "gemm_avx2_f32_tile_n": ([], c_int),
        "gemm_avx2_f32": ([c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_i64, c_int], None),
        "gemm_avx2_bf16_supported": ([], c_int),
        "gemm_avx2_bf16_tile_n": ([], c_int),
        "gemm_avx2_bf16": ([c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_i64, c_i64, c_i64, c_int], c_int),
    },
    "argmax": {
        "argmax_rows": ([c_void_p, c_i64, c_void_p, c_i64, c_i64, c_int, c_int], None),
    },
    "stream_copy": {
        "stream_copy": ([c_void_p, c_void_p, c_i64], None),
    },
}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}    # dtype -> csrc/common.h's DT_* code
_EXTRA_FLAGS = {"layer_ops": ["-ffp-contract=off"]}    # a*b + c*d rounded as PyTorch's separate ops round it
_errors: dict[str, str] = {}


def build_error(name: str = "paged_decode") -> str | None:
    """Why library `name` is unavailable, or None if it built (or was never asked for)."""
    return _errors.get(name)


@functools.cache
def paged_decode_lib() -> ctypes.CDLL | None:
    """The loaded paged_decode library (its `paged_decode` typed), or None if unavailable."""
    return _load("paged_decode")


@functools.cache
def paged_prefill_lib() -> ctypes.CDLL | None:
    """The loaded paged_prefill library (its `paged_prefill` typed), or None if unavailable."""
    return _load("paged_prefill")


@functools.cache
def layer_ops_lib() -> ctypes.CDLL | None:
    """The loaded layer_ops library (rms_norm, silu_mul, rotary, store_kv typed), or None."""
    return _load("layer_ops")


@functools.cache
def gemm_bf16_lib() -> ctypes.CDLL | None:
    """The loaded gemm_bf16 library, or None if unavailable. Built on every CPU; its
    `gemm_bf16_supported()` says whether the compiler targeted AVX512-BF16 (else no kernel)."""
    return _load("gemm_bf16")


@functools.cache
def gemm_amx_lib() -> ctypes.CDLL | None:
    """The loaded gemm_amx library, or None if unavailable. Built on every CPU; its
    `gemm_amx_supported()` says whether the compiler targeted AMX-BF16 and Linux granted the tiles."""
    return _load("gemm_amx")


@functools.cache
def gemm_f32_lib() -> ctypes.CDLL | None:
    """The loaded gemm_f32 library, or None if unavailable. Built on every CPU; its
    `gemm_f32_supported()` says whether the compiler targeted AVX-512F (else no kernel)."""
    return _load("gemm_f32")


@functools.cache
def gemm_avx2_lib() -> ctypes.CDLL | None:
    """The loaded gemm_avx2 library (float32 and bfloat16 GEMMs), or None if unavailable. Built on
    every CPU; its `gemm_avx2_f32_supported()` and `gemm_avx2_bf16_supported()` say whether the
    compiler targeted AVX2 and FMA (else no kernels)."""
    return _load("gemm_avx2")


@functools.cache
def argmax_lib() -> ctypes.CDLL | None:
    """The loaded argmax library (its `argmax_rows` typed), or None if unavailable."""
    return _load("argmax")


@functools.cache
def stream_copy_lib() -> ctypes.CDLL | None:
    """The loaded streaming copy (its `stream_copy` typed), or None if unavailable."""
    return _load("stream_copy")


def _load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        _errors[name] = "disabled by PDSERVE_CPU_KERNELS=0"
        return None
    try:
        lib = ctypes.CDLL(_build(name))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _errors[name] = str(exc)
        log.warning("C kernels %s unavailable (%s); using the PyTorch path", name, exc)
        return None
    for fn, (argtypes, restype) in _SIGNATURES[name].items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = restype
    _errors.pop(name, None)
    return lib


def _build(name: str) -> str:
    """Path of the built shared library `name` (compiled now if not cached)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = os.path.join(_SRC_DIR, name + ".c")
    flags = _FLAGS + _EXTRA_FLAGS.get(name, [])
    sources = []
    headers = sorted(f for f in os.listdir(_SRC_DIR) if f.endswith(".h"))
    for path in (src, *(os.path.join(_SRC_DIR, h) for h in headers)):
        with open(path, "rb") as f:
            sources.append(f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.blake2b(b"\0".join([*sources, " ".join(flags).encode(), version.encode(), _cpu_flags()]),
                          digest_size=8).hexdigest()
    for cache in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"pdserve-kernels-{os.getuid()}")):
        path = os.path.join(cache, f"{name}-{key}.so")
        if os.path.exists(path):
            try:
                os.utime(path)                # pruning keeps the builds used last
            except OSError:
                pass
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
    log.info("building the C kernels %s with %s (once; cached in %s)", name, cc, os.path.dirname(path))
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {name}.c: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(os.path.dirname(path), name)
    return path


def _prune(cache: str, name: str) -> None:
    """Deletes all but the KEEP_BUILDS most recently used builds of `name` (each source edit
    leaves one). A process that has a deleted one loaded keeps its mapping; one that wants it
    rebuilds it."""
    builds = []
    for entry in os.scandir(cache):
        if entry.name.startswith(name + "-") and entry.name.endswith(".so"):
            try:
                builds.append((entry.stat().st_mtime, entry.path))
            except OSError:           # another process pruned it just now
                pass
    for _, old in sorted(builds, reverse=True)[KEEP_BUILDS:]:
        try:
            os.unlink(old)
        except OSError:
            pass


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
