"""The one copy of a KV block into the pool, with streaming stores (kernels/csrc/stream_copy.c).

A decode node's receiver copies each block it lands from libzmq's buffer into its pool slot. The
slot is cold (a pool of hundreds of MB, the block read again only by a later decode step), so a
memcpy through the cache first reads every destination line from memory; streaming stores skip
that read. On the benchmark's Zen 4 (2 cores), into a cold 256 MiB pool from a warm buffer, a
copy took (us, memcpy -> streaming) 1.9 -> 1.4 at 16 KiB, 5.5 -> 3.1 at 64 KiB, 29.7 -> 21.1 at
0.5 MiB and 112 -> 80 at 2 MiB (`python bench/landing_copy.py`; bench/README.md, "Streaming stores for
the landing copy").

`copy_into(dst, src)` is `dst[:] = src` (a ValueError on unequal lengths, nothing written), through
the C copy for contiguous writable byte buffers of STREAM_MIN_BYTES or more where it built
(a pyzmq Frame's buffer is writable), else the slice assignment. `prepare()` loads it ahead (an
InlineSink does, as a node starts: a first build and `cc --version` take ~0.1-0.5 s).
"""
from __future__ import annotations

import ctypes
import functools

STREAM_MIN_BYTES = 16 << 10     # below this a copy is a few cache lines and ctypes' ~0.6 us call dominates

_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def copy_into(dst: memoryview, src) -> None:
    """dst[:] = src: dst a writable byte memoryview, src any byte buffer of the same length."""
    view = src if type(src) is memoryview else memoryview(src)    # (a pyzmq 27 Frame itself: no strides, a crash)
    lib = _lib()
    if lib is not None and dst.nbytes >= STREAM_MIN_BYTES and view.nbytes == dst.nbytes and not view.readonly \
            and view.c_contiguous and dst.c_contiguous:
        lib.stream_copy(_addressof(_from_buffer(dst)), _addressof(_from_buffer(view)), dst.nbytes)
    else:
        dst[:] = view


def prepare() -> bool:
    """Build (once per machine) and load the C copy now, not on the first landing; whether it loaded."""
    return _lib() is not None


@functools.cache
def _lib():
    from kernels.cpu_kernels import stream_copy_lib     # builds (once) on the first copy, not on import
    return stream_copy_lib()
