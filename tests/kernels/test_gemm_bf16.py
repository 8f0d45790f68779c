"""kernels.gemm_bf16: the AVX512-BF16 GEMM equals the float32-accumulated product rounded to bf16
(within one bf16 rounding) for every shape; bad inputs raise ValueError. On a CPU without
AVX512-BF16 each kernel test instead asserts that the kernel says so (callers keep oneDNN).
Strided rows, empty input and thread count: tests/kernels/test_gemm_f32.py, parametrized over
both GEMMs."""
import pytest
import torch

from kernels import gemm_bf16


def cpu_has_avx512_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx512_bf16" in line for line in f)


def kernel_here() -> bool:
    """True where the CPU has AVX512-BF16: the kernel must then be built with it. Elsewhere it
    must report itself unsupported (and the caller's test checks no more)."""
    assert gemm_bf16.supported() == cpu_has_avx512_bf16()
    return gemm_bf16.supported()


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    """Each element within one bf16 step of the reference (the reference's float32 sum and the
    kernel's differ in order, so a value near a rounding boundary may round the other way)."""
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    exp = expected.float()
    step = torch.ldexp(torch.ones_like(exp), torch.frexp(exp).exponent - 8)
    err = (got.float() - exp).abs()
    assert bool((err <= step + 1e-5 * k).all()), f"max error {err.max().item()} beyond one bf16 step"
    assert (got == expected).float().mean().item() > 0.97      # most round exactly alike


SHAPES = [(1, 512, 1536), (32, 512, 1536), (64, 1408, 512), (6, 64, 64), (7, 33, 70), (13, 1, 5), (2, 2, 16),
          (5, 96, 200), (97, 130, 65), (200, 17, 3), (33, 255, 129)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_equals_the_float32_reference_rounded_once(m, k, n, bias):
    """Rows 1..200 (register blocks of 1-6 rows, several row chunks), k odd and even, n not a
    multiple of the 64-column tile, with and without bias."""
    if kernel_here():
        assert_gemm_equals_reference(gemm_bf16, m, k, n, bias)


def assert_gemm_equals_reference(gemm, m: int, k: int, n: int, bias: bool) -> None:
    """A bf16 GEMM module's (gemm_bf16, gemm_amx) product of random x [m, k] and W [n, k] (and a
    bias) is within one bf16 rounding of its float32 reference."""
    torch.manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    got = gemm.linear(x, gemm.pack_weight(w), n, b)
    assert_within_one_rounding(got, gemm.reference(x, w, b), k)


def test_pack_weight_layout():
    """packed[t, p, c, j] = W[t * 64 + c, 2p + j], zero past n and k."""
    if not kernel_here():
        return
    w = torch.arange(70 * 5, dtype=torch.float32).reshape(70, 5).bfloat16()
    packed = gemm_bf16.pack_weight(w)
    assert packed.shape == (2, 3, 64, 2)
    assert packed[1, 2, 3, 0] == w[67, 4] and packed[1, 2, 3, 1] == 0 and packed[0, 1, 5, 1] == w[5, 3]
    assert not packed[1, :, 6:].any()


def test_bad_inputs_raise_value_error():
    """Wrong dtypes, ranks, widths, a packed weight of another shape, a bias of the wrong size."""
    if not kernel_here():
        return
    w = torch.randn(100, 48).bfloat16()
    packed, x = gemm_bf16.pack_weight(w), torch.randn(4, 48).bfloat16()
    bad_calls = [
        lambda: gemm_bf16.pack_weight(w.float()),
        lambda: gemm_bf16.pack_weight(torch.randn(0, 4).bfloat16()),
        lambda: gemm_bf16.linear(x.float(), packed, 100),
        lambda: gemm_bf16.linear(x[0], packed, 100),
        lambda: gemm_bf16.linear(torch.randn(4, 50).bfloat16(), packed, 100),
        lambda: gemm_bf16.linear(torch.randn(4, 96).bfloat16()[:, ::2], packed, 100),
        lambda: gemm_bf16.linear(x, packed, 129),
        lambda: gemm_bf16.linear(x, packed, 0),
        lambda: gemm_bf16.linear(x, packed.float(), 100),
        lambda: gemm_bf16.linear(x, packed.reshape(2, 24, 128), 100),
        lambda: gemm_bf16.linear(x, packed, 100, torch.randn(99).bfloat16()),
        lambda: gemm_bf16.linear(x, packed, 100, torch.randn(100)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
