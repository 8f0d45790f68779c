"""kernels.huge_pages: the big CPU buffers (the KV pool, packed GEMM weights) are advised huge
before their first touch, over exactly the 2 MiB-aligned part of their memory, where Linux's
transparent huge pages allow it; PDSERVE_HUGE_PAGES=0 and small buffers advise nothing, and
the buffers' contents are what they would be without."""
from types import SimpleNamespace

import torch

from engine.kv_pool import allocate_kv_cache
from kernels import gemm_f32, huge_pages


def _thp_on() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def test_a_big_buffer_is_advised_over_its_aligned_middle(monkeypatch):
    t = torch.empty(9 << 20, dtype=torch.uint8)           # 9 MiB: at least three whole 2 MiB pages inside
    advised = huge_pages.advise(t)
    if not _thp_on():
        assert advised == 0 and not huge_pages.enabled()
        return
    assert huge_pages.enabled()
    assert advised % huge_pages.HUGE == 0 and 3 * huge_pages.HUGE <= advised <= t.numel()
    assert huge_pages.advise(torch.empty(1 << 20, dtype=torch.uint8)) == 0     # no whole 2 MiB page in it
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    assert huge_pages.advise(t) == 0 and not huge_pages.enabled()


def test_only_buffers_malloc_maps_anew_are_advised(monkeypatch):
    """empty() advises a buffer of FRESH_BYTES or more, never a smaller one (it may be heap memory
    already touched, and freed later for other uses)."""
    advised = []
    monkeypatch.setattr(huge_pages, "advise", lambda t: advised.append(t.numel()) or 0)
    small, big = huge_pages.empty((1 << 20,), torch.uint8), huge_pages.empty((huge_pages.FRESH_BYTES,), torch.uint8)
    assert advised == [huge_pages.FRESH_BYTES] and small.numel() == 1 << 20 and big.dtype == torch.uint8


def test_the_pool_and_packed_weights_hold_what_they_would_without(monkeypatch):
    """The KV pool comes back zeroed (not merely allocated: here from memory full of 7s) and a
    packed weight equals its 4 KiB-page twin, huge pages on or off."""
    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)   # the fields it reads
    with monkeypatch.context() as m:
        m.setattr(huge_pages, "empty", lambda shape, dtype: torch.full(shape, 7, dtype=dtype))
        pool = allocate_kv_cache(model, 300, 16, torch.device("cpu"))
    assert pool.shape == (300, 2, 2, 16, 2, 64) and pool.dtype == torch.bfloat16 and not pool.any()
    assert allocate_kv_cache(model, 300, 16, torch.device("cpu"), world=2).shape == (300, 2, 2, 16, 1, 64)
    w = torch.randn(2000, 700)
    if gemm_f32.supported():
        huge = gemm_f32.pack_weight(w)
        monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
        assert torch.equal(huge, gemm_f32.pack_weight(w))
