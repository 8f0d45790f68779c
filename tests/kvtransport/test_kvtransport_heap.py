"""kvtransport.heap: a receiver's process keeps the memory of freed frames for the next ones."""
import ctypes
import resource

from kvtransport.heap import retain_freed

FRAME = 2 << 20          # one 2 MiB block's frame, as libzmq mallocs it
IN_FLIGHT = 24           # frames queued at once: 48 MiB, more than glibc's own trim threshold keeps


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_freed_frames_are_reused_without_faulting_pages_in():
    """After retain_freed, a queue of 2 MiB frames malloc'd, written and freed again and again
    faults (almost) no page in after its first round: glibc keeps what was freed mapped."""
    assert retain_freed(64 << 20)
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    rounds = []
    for _ in range(4):
        start = _faults()
        frames = [libc.malloc(FRAME) for _ in range(IN_FLIGHT)]
        for p in frames:
            ctypes.memset(p, 1, FRAME)
        for p in frames:
            libc.free(p)
        rounds.append(_faults() - start)
    assert rounds[0] >= 0 and max(rounds[1:]) < IN_FLIGHT, rounds    # 512 a frame if unmapped
