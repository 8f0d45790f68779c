"""kernels/ block launchers (store_kv, copy_blocks, gather_blocks, scatter_blocks) against the
plain-PyTorch reference, on the CPU (CUDA too when present): the bytes they write, and the
arguments they refuse."""
import pytest
import torch

from kernels import copy_blocks, cpu_layer_ops, gather_blocks, scatter_blocks, store_kv
from kernels.reference import copy_blocks_ref, gather_blocks_ref, scatter_blocks_ref, store_kv_ref
from kernels.testing import make_paged_batch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATTN_DEVICES = DEVICES + ["cpu-torch"]      # "cpu-torch": the PyTorch path hosts without a C compiler take


@pytest.mark.parametrize("device", ATTN_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_negative_slots(device, dtype, monkeypatch):
    """store_kv writes exactly the reference's slots of one layer; slot -1 and other layers
    untouched. "cpu": the C path (kernels/csrc/layer_ops.c); "cpu-torch": the index_put path."""
    if device == "cpu-torch":
        monkeypatch.setattr(cpu_layer_ops, "usable", lambda *a: False)
        device = "cpu"
    b = make_paged_batch([50], [1], 4, 2, 64, 16, dtype, device)
    key = torch.randn(6, 2, 64).to(dtype=dtype, device=device)
    value = torch.randn(6, 2, 64).to(dtype=dtype, device=device)
    slots = torch.tensor([0, 17, -1, 31, 32, 50], device=device)
    expected = b.kv_cache.cpu().clone()
    store_kv_ref(key.cpu(), value.cpu(), expected[:, -1, 0], expected[:, -1, 1], slots.cpu())
    store_kv(key, value, b.k_cache, b.v_cache, slots)
    assert torch.equal(b.kv_cache.cpu(), expected)
    assert torch.equal(b.k_cache[1, 1].cpu(), key[1].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_matches_reference(device):
    """copy_blocks copies whole blocks (all layers, K and V) onto exactly the dst blocks."""
    b = make_paged_batch([64], [1], 4, 2, 64, 8, torch.float32, device)
    src, dst = torch.tensor([0, 3, 5], device=device), torch.tensor([7, 1, 2], device=device)
    expected = b.kv_cache.cpu().clone()
    copy_blocks_ref(expected, src.cpu(), dst.cpu())
    copy_blocks(b.kv_cache, src, dst)
    assert torch.equal(b.kv_cache.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_then_scatter_round_trips(device):
    """gather_blocks packs the reference's bytes; scatter_blocks writes them to exactly the given blocks."""
    b = make_paged_batch([64], [1], 4, 2, 64, 8, torch.bfloat16, device)
    ids = torch.tensor([6, 0, 3], device=device)
    packed = gather_blocks(b.kv_cache, ids)
    assert packed.is_contiguous() and torch.equal(packed.cpu(), gather_blocks_ref(b.kv_cache.cpu(), ids.cpu()))
    dst = torch.tensor([1, 2, 4], device=device)
    expected = b.kv_cache.cpu().clone()
    scatter_blocks_ref(expected, dst.cpu(), packed.cpu())
    scatter_blocks(b.kv_cache, dst, packed)
    assert torch.equal(b.kv_cache.cpu(), expected)
    assert gather_blocks(b.kv_cache, ids[:0]).shape == (0, *b.kv_cache.shape[1:])


def test_block_launchers_reject_bad_arguments():
    """Block ids out of range, of the wrong dtype, duplicated, or a wrong buffer raise ValueError."""
    kv = torch.zeros(4, 2, 2, 8, 2, 16)
    cases = [
        lambda: copy_blocks(kv, torch.tensor([0]), torch.tensor([4])),
        lambda: copy_blocks(kv, torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)),
        lambda: copy_blocks(kv, torch.tensor([0, 1]), torch.tensor([2, 2])),
        lambda: copy_blocks(kv, torch.tensor([0, 1]), torch.tensor([1, 2])),
        lambda: copy_blocks(kv[:, :1], torch.tensor([0]), torch.tensor([1])),
        lambda: gather_blocks(kv, torch.tensor([-1])),
        lambda: scatter_blocks(kv, torch.tensor([1]), torch.zeros(1, 2, 2, 8, 2, 8)),
        lambda: scatter_blocks(kv, torch.tensor([1, 1]), torch.zeros(2, 2, 2, 8, 2, 16)),
        lambda: store_kv(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), kv[:, 0, 0], kv[:, 0, 1],
                         torch.tensor([0, 32])),
        lambda: store_kv(torch.zeros(2, 2, 16).half(), torch.zeros(2, 2, 16), kv[:, 0, 0], kv[:, 0, 1],
                         torch.tensor([0, 1])),
    ]
    for i, call in enumerate(cases):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")
