"""A decoder layer's small ops (kernels/layer_ops.py, engine/rope.py, kernels/kv_store.py): the C
path (kernels/csrc/layer_ops.c) against Hugging Face's modules and PyTorch's ops on the same
data, at decode sizes (one thread) and prefill sizes (rows split over threads); and the PyTorch
fallback where the C path cannot take the tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

import kernels
from kernels import cpu_layer_ops
from kernels.cpu_kernels import build_error, layer_ops_lib

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 300]          # 300 rows x 512: over the C file's PARALLEL_MIN, so split over threads
WIDTHS = [512, 37]          # 37: bf16 rows go 16 elements at a time (kernels/csrc/bf16x16.h), then a tail of 5
# Stated tolerances: float32 differs from PyTorch only in summation order (RMSNorm) and exp's
# last bit (SiLU); a 16-bit result may land up to two units in the last place away (a one-unit
# difference in the rounded intermediate, times the second factor).
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-6, rtol=2 ** -6),
       torch.float16: dict(atol=1e-6, rtol=2 ** -9)}


def test_layer_ops_library_builds():
    """This machine kind has a C compiler: the library must build (else the engine runs slower)."""
    assert layer_ops_lib() is not None, build_error("layer_ops")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_transformers(dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=g).to(dtype)
    hf = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=g))
    assert cpu_layer_ops.usable(x, hf.weight)
    torch.testing.assert_close(kernels.rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_adds_the_residual_in_place_first(dtype, rows, width):
    """residual += x (rounded to the dtype, as PyTorch's add rounds), then the norm of the sum."""
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, width, generator=g).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype)
    expected_sum = residual + x
    hf = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    out = kernels.rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, hf(expected_sum).detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [704, 37])
def test_silu_and_mul_matches_pytorch(dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)       # wide range: exp's tails
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_gives_each_element_the_same_bits_in_the_vector_path_and_the_tail(dtype):
    """A row of 37 goes 8 (float32; bf16 on AVX2: kernels/csrc/f32x8.h) or 16 (bf16, AVX-512)
    elements at a time, then a tail of scalar code; each element alone (a row of 1: the tail only) gets the same
    bits, NaN and the saturated ends included."""
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(4, 37, generator=g) * 8
    gate[0, :6] = torch.tensor([float("nan"), -1e4, -88.5, 88.5, 1e4, -0.0])
    x = torch.cat([gate, torch.randn(4, 37, generator=g)], dim=1).to(dtype)
    row = kernels.silu_and_mul(x)
    alone = torch.stack([kernels.silu_and_mul(x[:, [j, 37 + j]])[:, 0] for j in range(37)], dim=1)
    assert torch.equal(row.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       alone.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_saturates_like_pytorch(dtype):
    """Far beyond exp's range: silu(x) -> x for large x, -> -0 for very negative x; no NaN.
    18 gates: a bf16 row's first 16 go through the 16-lane path, the last 2 through its tail."""
    gate = torch.tensor([-1e4, -100.0, -88.5, 0.0, 88.5, 1e4] * 3)
    x = torch.cat([gate, torch.ones(18)])[None].to(dtype)
    out = kernels.silu_and_mul(x)
    torch.testing.assert_close(out, F.silu(x[:, :18]), atol=1e-30, rtol=1e-6 if dtype == torch.float32 else 2 ** -8)


def _rope_tables(dtype, positions=64, head_dim=64):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_rotary_in_place_equals_transformers_bit_for_bit(dtype, rows, head_dim):
    """q and k heads rotated in place inside the fused qkv rows (a strided view) give exactly
    Hugging Face's q * cos + rotate_half(q) * sin: the same products and sums, rounded alike.
    (bf16 heads of 64 and 128 go 16 element pairs at a time; 48's halves of 24 take the scalar loop.)"""
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads = 4, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 64, (rows,), generator=g)
    cos, sin = _rope_tables(dtype, head_dim=head_dim)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = qk * c + rotate_half(qk) * s
    assert cpu_layer_ops.usable(qk, cos) and cpu_layer_ops.rows_contiguous(qk)
    cpu_layer_ops.rotary_(qk, positions, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


def test_rotary_rejects_a_position_outside_the_table():
    cos, sin = _rope_tables(torch.float32, positions=8)
    qk = torch.randn(2, 3, 64)
    with pytest.raises(IndexError, match="outside the table"):
        cpu_layer_ops.rotary_(qk, torch.tensor([1, 8]), cos, sin)


def test_store_kv_rejects_a_slot_outside_the_pool():
    """The launcher's checks catch this first; the C body still refuses to write past the pool."""
    pool = torch.zeros(4, 2, 8, 2, 64)                     # 4 blocks of 8 slots
    key = value = torch.randn(2, 2, 64)
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_layer_ops.store_kv(key, value, pool[:, 0], pool[:, 1], torch.tensor([3, 32]))
    assert torch.equal(pool[0, 0, 3], key[0])              # the good row was written


def test_rope_module_takes_either_path_to_the_same_result():
    """engine/rope.py's RotaryEmbedding: the C path for contiguous heads, PyTorch for a
    non-contiguous view; both rotate in place to the same values."""
    from transformers import LlamaConfig
    from engine.rope import RotaryEmbedding
    rope = RotaryEmbedding(LlamaConfig(head_dim=64, num_attention_heads=4, hidden_size=256), 64, 128,
                           torch.float32, "cpu")
    x = torch.randn(6, 3, 64)
    positions = torch.tensor([0, 5, 9, 127, 64, 3])
    strided = x.clone().transpose(0, 1).contiguous().transpose(0, 1)   # same values, heads not adjacent
    assert not cpu_layer_ops.rows_contiguous(strided)
    rope.rotate_(positions, x)
    rope.rotate_(positions, strided)
    torch.testing.assert_close(x, strided, atol=0, rtol=0)


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul"])
def test_non_contiguous_rows_take_the_pytorch_path(op):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2 * 64, 12, generator=g)
    x = base.t()                                            # [12, 128]: rows not contiguous
    assert not cpu_layer_ops.usable(x)
    if op == "rms_norm":
        weight = torch.randn(128, generator=g)
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), F.rms_norm(x, (128,), weight, 1e-6))
    else:
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up)


def test_without_the_library_every_op_falls_back(monkeypatch):
    """PDSERVE_CPU_KERNELS=0 (or no compiler): no library, a stated reason, same results."""
    x, res, w = torch.randn(3, 512), torch.randn(3, 512), torch.randn(512)
    gu = torch.randn(3, 256)
    with_c = (kernels.rms_norm(x, w, 1e-6), kernels.silu_and_mul(gu))
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    layer_ops_lib.cache_clear()
    try:
        assert layer_ops_lib() is None and "PDSERVE_CPU_KERNELS" in build_error("layer_ops")
        assert not cpu_layer_ops.usable(x)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), with_c[0])
        torch.testing.assert_close(kernels.silu_and_mul(gu), with_c[1])
        expected_sum = res + x
        kernels.rms_norm(x, w, 1e-6, residual=res)
        assert torch.equal(res, expected_sum)
    finally:
        monkeypatch.undo()
        layer_ops_lib.cache_clear()
    assert layer_ops_lib() is not None
