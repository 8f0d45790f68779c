"""Transparent huge pages for the big CPU buffers a step streams through: the paged KV pool
(engine/kv_pool.py) and the packed GEMM weights (kernels/gemm_packed.py).

A decode step reads every layer's K and V of every running sequence (blocks scattered over the
pool) and every weight once: tens to hundreds of MB a step in 4 KiB pages, so the TLB misses on
nearly every page. madvise(MADV_HUGEPAGE) before the first touch lets Linux back the buffer with
2 MiB pages where transparent huge pages are enabled "always" or "madvise" (the default of many
distributions, and this machine's: /sys/kernel/mm/transparent_hugepage/enabled). On the
benchmark host (Intel Xeon, 2 cores) the bf16 paged-decode kernel over the engine's pool layout,
32 sequences of 150 tokens, took 721 us a layer in a huge-page pool against 782 in a 4 KiB one
(medians of 11 interleaved rounds, 07:24 UTC 2026-12-03; bench/README.md has the figures).

Only the 2 MiB-aligned middle of a buffer can be advised, and `empty` advises only buffers of at
least FRESH_BYTES (32 MiB), which malloc always maps anew: in practice the pool and the largest
weights (lm_head), not a layer's few-MB weights. Elsewhere (not Linux, THP "never") nothing happens. PDSERVE_HUGE_PAGES=0 turns it off, for A/B measurements.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

HUGE = 2 << 20              # bytes in a transparent huge page on x86-64 and arm64 (4 KiB base pages)
MADV_HUGEPAGE = 14          # <asm-generic/mman-common.h>
FRESH_BYTES = 32 << 20      # glibc's largest mmap threshold on 64-bit: malloc maps a block this big anew


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose pages are advised huge before anything touches them,
    when it is at least FRESH_BYTES: smaller ones may come from malloc's heap, already touched
    (advice does nothing there) and later freed for other uses (advice would outlive them)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel() * t.element_size() >= FRESH_BYTES:
        advise(t)
    return t


def advise(t: torch.Tensor) -> int:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of t's memory (call it before the
    first touch: pages already mapped keep their size). Returns the bytes advised, 0 if none."""
    if t.device.type != "cpu" or not enabled():
        return 0
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + t.numel() * t.element_size()) // HUGE * HUGE
    if hi <= lo or _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo


def enabled() -> bool:
    """Whether advising can do anything here: Linux with transparent huge pages not "never", and
    PDSERVE_HUGE_PAGES not 0."""
    return os.environ.get("PDSERVE_HUGE_PAGES", "1") != "0" and _thp_mode() in ("always", "madvise")


@functools.cache
def _thp_mode() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
