"""The landing copy with streaming stores (kvtransport/stream_copy.py): every byte as a slice
assignment writes it, at any size and alignment, from every kind of buffer a link hands over;
a length mismatch writes nothing; without the library the slice assignment does the same."""
import numpy as np
import pytest
import zmq

from kvtransport import stream_copy
from kernels.cpu_kernels import build_error, stream_copy_lib
from kvtransport.stream_copy import STREAM_MIN_BYTES, copy_into

SIZES = [0, 1, 255, STREAM_MIN_BYTES - 1, STREAM_MIN_BYTES, STREAM_MIN_BYTES + 37, 4 * 64 + 3 + STREAM_MIN_BYTES,
         (512 << 10), (512 << 10) + 65]


def _copied(n: int, offset: int, kind: str) -> bool:
    """copy_into a slot at `offset` of a zeroed pool from a source of `kind`: the slot holds the
    source's bytes and nothing around it changed."""
    rng = np.random.default_rng(n * 64 + offset)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    pool = np.zeros(n + 2 * 64, np.uint8)
    src = {"frame": lambda: zmq.Frame(data.tobytes()), "bytes": data.tobytes, "bytearray": lambda: bytearray(data),
           "memoryview": lambda: memoryview(bytearray(data))}[kind]()
    copy_into(memoryview(pool)[offset:offset + n], src)
    return bool((pool[offset:offset + n] == data).all() and not pool[:offset].any() and not pool[offset + n:].any())


def test_the_library_builds_here():
    assert stream_copy_lib() is not None, build_error("stream_copy")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 31, 63])
def test_every_size_and_alignment_lands_exactly(n, offset):
    assert _copied(n, offset, "frame")


@pytest.mark.parametrize("kind", ["frame", "bytes", "bytearray", "memoryview"])
def test_every_buffer_a_link_hands_over_lands_exactly(kind):
    """bytes are read-only (no address through ctypes): those take the slice assignment."""
    assert _copied((512 << 10) + 7, 5, kind)


@pytest.mark.parametrize("n", [STREAM_MIN_BYTES + 1, 1 << 20])
def test_unequal_lengths_raise_and_write_nothing(n):
    pool = np.zeros(n + 8, np.uint8)
    for src in (zmq.Frame(b"\x07" * (n - 1)), bytearray(b"\x07" * (n + 1))):
        with pytest.raises(ValueError):
            copy_into(memoryview(pool)[:n], src)
    assert not pool.any()


def test_without_the_library_the_slice_assignment_copies(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    stream_copy_lib.cache_clear()
    stream_copy._lib.cache_clear()
    try:
        assert stream_copy._lib() is None and "PDSERVE_CPU_KERNELS" in build_error("stream_copy")
        assert _copied((512 << 10) + 9, 3, "frame") and _copied(STREAM_MIN_BYTES, 0, "memoryview")
    finally:
        monkeypatch.undo()
        stream_copy_lib.cache_clear()
        stream_copy._lib.cache_clear()
    assert stream_copy._lib() is not None


def test_a_sink_over_a_cpu_pool_loads_the_copy_as_it_is_made():
    """The build (or the cache's check) happens as a node starts, not on the first block it lands."""
    from kvtransport.payload import InlineSink
    from kvtransport.testing import make_identity, make_pool
    stream_copy._lib.cache_clear()
    pool = make_pool(num_blocks=2, seed=None)
    InlineSink(pool, make_identity(pool, "d0").layout)
    assert stream_copy._lib.cache_info().currsize == 1 and stream_copy._lib() is not None
