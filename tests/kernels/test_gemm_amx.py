"""kernels.gemm_amx: the AMX-BF16 GEMM equals the float32-accumulated product rounded to bf16
(within one bf16 rounding) for every shape, k padded to its 32-element steps; bad inputs raise
ValueError. On a CPU without AMX-BF16 each kernel test instead asserts that the kernel says so
(callers keep oneDNN). Strided rows, empty input and thread count: tests/kernels/test_gemm_f32.py,
parametrized over every GEMM."""
import pytest
import torch

from kernels import gemm_amx
from tests.kernels.test_gemm_bf16 import SHAPES, assert_gemm_equals_reference, assert_within_one_rounding


def cpu_has_amx_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_bf16" in line for line in f)


def kernel_here() -> bool:
    """True where the CPU has AMX-BF16: the kernel must then be built with it and granted the
    tiles. Elsewhere it must report itself unsupported (and the caller's test checks no more)."""
    assert gemm_amx.supported() == cpu_has_amx_bf16()
    return gemm_amx.supported()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES + [(16, 64, 64), (17, 96, 130), (2048, 64, 192), (31, 1408, 40)])
def test_gemm_equals_the_float32_reference_rounded_once(m, k, n, bias):
    """Rows 1..2,048 (blocks of 16 rows and a shorter last, several row chunks), k a multiple of
    32 and not (x copied, zero-padded), n not a multiple of the 64-column tile, with and without bias."""
    if kernel_here():
        assert_gemm_equals_reference(gemm_amx, m, k, n, bias)


def test_a_row_past_k_never_reaches_the_product():
    """k = 40: a row's 24 elements past k in memory (here inf and nan, a wider tensor's columns)
    are not multiplied by the padded weight's zeros: the result is finite and right."""
    if not kernel_here():
        return
    torch.manual_seed(3)
    wide = torch.full((5, 64), float("nan")).bfloat16()
    wide[:, 50:] = float("inf")
    wide[:, :40] = torch.randn(5, 40).bfloat16()
    w = torch.randn(70, 40).bfloat16()
    got = gemm_amx.linear(wide[:, :40], gemm_amx.pack_weight(w), 70)
    assert bool(got.isfinite().all())
    assert_within_one_rounding(got, gemm_amx.reference(wide[:, :40], w), 40)


def test_pack_weight_layout():
    """packed[t, p, c, j] = W[t * 64 + c, 2p + j], zero past n and past k, k padded to 32."""
    if not kernel_here():
        return
    w = torch.arange(70 * 5, dtype=torch.float32).reshape(70, 5).bfloat16()
    packed = gemm_amx.pack_weight(w)
    assert packed.shape == (2, 16, 64, 2)
    assert packed[1, 2, 3, 0] == w[67, 4] and packed[1, 2, 3, 1] == 0 and packed[0, 1, 5, 1] == w[5, 3]
    assert not packed[1, :, 6:].any() and not packed[:, 3:].any()


def test_bad_inputs_raise_value_error():
    """Wrong dtypes, ranks, widths, a packed weight of another shape, a bias of the wrong size."""
    if not kernel_here():
        return
    w = torch.randn(100, 48).bfloat16()
    packed, x = gemm_amx.pack_weight(w), torch.randn(4, 48).bfloat16()
    bad_calls = [
        lambda: gemm_amx.pack_weight(w.float()),
        lambda: gemm_amx.linear(x.float(), packed, 100),
        lambda: gemm_amx.linear(x[0], packed, 100),
        lambda: gemm_amx.linear(torch.randn(4, 80).bfloat16(), packed, 100),
        lambda: gemm_amx.linear(x, packed, 129),
        lambda: gemm_amx.linear(x, packed.reshape(2, 64, 64), 100),
        lambda: gemm_amx.linear(x, packed, 100, torch.randn(99).bfloat16()),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
