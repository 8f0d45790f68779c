"""glibc's malloc told to keep what a KV receiver frees, so received blocks do not fault pages in
(and, through engine/step_memory.py, what a CPU engine's steps free).

libzmq mallocs every frame it receives (a block's payload: 0.5-2 MiB for Llama-sized blocks) and
the receiver frees it as soon as its bytes are in the pool. By default glibc serves such sizes
with mmap and unmaps them on free (or, once its dynamic threshold has risen, trims them off the
top of the heap): the next frame's memory is then faulted in page by page, in libzmq's I/O
thread, 10-160 minor faults a block here (bench/README.md, "xfer4"). With the mmap threshold
at its largest and the trim threshold above what the receive queue may hold, freed frames stay
in the heap and the next ones reuse them, already mapped and often still in cache.

The settings are process-wide (mallopt). What they cost:
- memory freed stays mapped up to the peak, not up to trim_bytes: a top pad of 64 MiB or more
  (glibc's heap size) keeps glibc from shrinking or deleting any thread arena's heaps, so the
  arena libzmq's I/O thread allocates from keeps what its busiest moment held (each prefill
  connection may queue --kv-recv-queue-mib), and the main heap keeps trim_bytes at its top. A
  decode node's RSS rises to that peak and stays there; it does not grow past it;
- each growth of the main heap reserves the pad's worth of address space (mapped only when
  touched; counted under strict overcommit);
- allocations up to MMAP_THRESHOLD_MAX come from the heap instead of mmap, as glibc's own
  dynamic threshold would move them after the first free. The KV pool, larger, is still mapped
  on its own.
Elsewhere than glibc, nothing is changed. Several callers in one process (a decode node's
receiver and its engine) get the largest trim any of them asked for, whatever their order.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("kvtransport")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3      # glibc malloc.h
MMAP_THRESHOLD_MAX = 32 << 20    # the largest glibc takes on 64-bit (half its 64 MiB heaps)
MIN_TRIM_BYTES = 64 << 20        # what glibc's dynamic trim threshold reaches (2 x the mmap one)
_kept = {"trim": 0, "pad": 0}     # the largest this process set: a later, smaller ask lowers neither


def retain_freed(trim_bytes: int, pad_bytes: int | None = None) -> bool:
    """Keep freed blocks of up to MMAP_THRESHOLD_MAX bytes in the heap, and up to
    max(trim_bytes, MIN_TRIM_BYTES, any earlier call's) of free memory at its top; True if glibc
    took all three settings. The top pad (pad_bytes, default trim_bytes; MIN_TRIM_BYTES at least) is
    what keeps a thread's arena (libzmq's I/O thread allocates from its own) from unmapping a whole
    64 MiB heap once it is free, which the trim threshold alone does not; it also makes each heap
    grow by that much address space, mapped only when touched (an engine, whose steps allocate on
    the main heap, asks for the least: engine/step_memory.py)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt     # the process's own symbols: no library lookup
    except (OSError, AttributeError):
        return False                 # not glibc: its allocator is left as it is
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    trim = min(max(trim_bytes, MIN_TRIM_BYTES, _kept["trim"]), 2**31 - 1)
    pad = min(max(trim_bytes if pad_bytes is None else pad_bytes, MIN_TRIM_BYTES, _kept["pad"]), 2**31 - 1)
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, trim), (M_TOP_PAD, pad)))
    if ok:
        _kept.update(trim=trim, pad=pad)
    else:
        log.warning("mallopt refused the heap settings; received blocks and step activations may fault pages in")
    return ok
