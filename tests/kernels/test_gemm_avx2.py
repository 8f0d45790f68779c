"""kernels.gemm_avx2: on a CPU with AVX2 and FMA, the float32 GEMM equals the float64 product
within float32's accumulation bound and the bfloat16 GEMM (weight widened to float32 in
registers) its float32 reference within one bf16 rounding, for every shape; a NaN stays a NaN;
bad inputs raise ValueError. Elsewhere each test instead asserts that the kernels say so. The test
of strided rows, empty input and thread count is test_gemm_f32's, run for every GEMM."""
import pytest
import torch

from kernels import gemm_avx2
from tests.kernels.test_gemm_bf16 import SHAPES, assert_gemm_equals_reference
from tests.kernels import test_gemm_f32 as f32_tests     # a module (it imports this one): its names looked up at call time


def kernel_here() -> bool:
    """True where the CPU has AVX2 and FMA: both kernels must then be built with them."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    has = "avx2" in flags and "fma" in flags
    assert gemm_avx2.F32.supported() == has and gemm_avx2.BF16.supported() == has
    return has


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_float32_gemm_equals_the_float64_reference(m, k, n, bias):
    """Rows 1..200 (register blocks of 1-6 rows, several row chunks), any k, n not a multiple of
    the 16-column tile, with and without bias."""
    if kernel_here():
        f32_tests.assert_gemm_equals_reference(gemm_avx2.F32, m, k, n, bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16_gemm_equals_the_float32_reference_rounded_once(m, k, n, bias):
    if kernel_here():
        assert_gemm_equals_reference(gemm_avx2.BF16, m, k, n, bias)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    """A float32 sum exactly between two bf16 values rounds to the even one (1 + 2^-8 -> 1;
    1 + 3 * 2^-8 -> 1 + 2^-6, up), in both halves of a tile and in the last partial tile; NaN and
    +-inf in x reach their column as NaN and +-inf."""
    if not kernel_here():
        return
    n = 20
    w = torch.zeros(n, 2 * n)
    for c in range(n):
        w[c, 2 * c] = w[c, 2 * c + 1] = 1.0                     # out[c] = x[2c] + x[2c + 1]
    x = torch.zeros(4, 2 * n)
    x[0, 0::2] = torch.tensor([1.0, 1 + 2 ** -7, -1.0, -(1 + 2 ** -7)] * 5)
    x[0, 1::2] = torch.tensor([2 ** -8, 2 ** -8, -2 ** -8, -2 ** -8] * 5)
    x[1, 2 * 17], x[2, 2 * 18], x[3, 2 * 19] = float("nan"), float("inf"), -float("inf")
    got = gemm_avx2.BF16.linear(x.bfloat16(), gemm_avx2.BF16.pack_weight(w.bfloat16()), n)
    expected = torch.tensor([1.0, 1 + 2 ** -6, -1.0, -(1 + 2 ** -6)] * 5)
    assert torch.equal(got[0].float(), expected)
    assert bool(got[1, 17].isnan()) and got[2, 18].item() == float("inf") and got[3, 19].item() == -float("inf")


def test_pack_weight_layout():
    """packed[t, kk, c] = W[t * 16 + c, kk] in the weight's dtype, zero past n."""
    if not kernel_here():
        return
    w = torch.arange(20 * 5, dtype=torch.float32).reshape(20, 5)
    for gemm, weight in ((gemm_avx2.F32, w), (gemm_avx2.BF16, w.bfloat16())):
        packed = gemm.pack_weight(weight)
        assert packed.shape == (2, 5, 16) and packed.dtype == weight.dtype
        assert packed[1, 4, 3] == weight[19, 4] and packed[0, 3, 5] == weight[5, 3]
        assert not packed[1, :, 4:].any()


def test_bad_inputs_raise_value_error():
    """Wrong dtypes, ranks, widths, a packed weight of another shape, a bias of the wrong size."""
    if not kernel_here():
        return
    for gemm, dtype, other in ((gemm_avx2.F32, torch.float32, torch.bfloat16),
                               (gemm_avx2.BF16, torch.bfloat16, torch.float32)):
        w = torch.randn(100, 48).to(dtype)
        packed, x = gemm.pack_weight(w), torch.randn(4, 48).to(dtype)
        bad_calls = [
            lambda: gemm.pack_weight(w.to(other)),
            lambda: gemm.pack_weight(torch.randn(0, 4).to(dtype)),
            lambda: gemm.linear(x.to(other), packed, 100),
            lambda: gemm.linear(x[0], packed, 100),
            lambda: gemm.linear(torch.randn(4, 50).to(dtype), packed, 100),
            lambda: gemm.linear(torch.randn(4, 96).to(dtype)[:, ::2], packed, 100),
            lambda: gemm.linear(x, packed, 129),
            lambda: gemm.linear(x, packed, 0),
            lambda: gemm.linear(x, packed.reshape(7, 48, 16)[:, :, :8].contiguous(), 100),
            lambda: gemm.linear(x, packed.transpose(1, 2), 100),
            lambda: gemm.linear(x, packed, 100, torch.randn(99).to(dtype)),
            lambda: gemm.linear(x, packed, 100, torch.randn(100).to(other)),
        ]
        for call in bad_calls:
            with pytest.raises(ValueError):
                call()
