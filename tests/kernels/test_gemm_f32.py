"""kernels.gemm_f32: the AVX-512 float32 GEMM equals the float64 product within float32's
accumulation bound for every shape; bad inputs raise ValueError. On a CPU without AVX-512F each
kernel test instead asserts that the kernel says so (callers keep oneDNN). The test of strided
rows, empty input and thread count runs here for every GEMM (gemm_bf16's, gemm_amx's and gemm_avx2's
checks from their test files)."""
import pytest
import torch

from kernels import gemm_amx, gemm_avx2, gemm_bf16, gemm_f32
from tests.kernels import test_gemm_amx as amx_tests
from tests.kernels import test_gemm_avx2 as avx2_tests
from tests.kernels import test_gemm_bf16 as bf16_tests


def kernel_here() -> bool:
    """True where the CPU has AVX-512F: the kernel must then be built with it. Elsewhere it must
    report itself unsupported (and the caller's test checks no more)."""
    with open("/proc/cpuinfo") as f:
        has = any(line.startswith("flags") and " avx512f" in line for line in f)
    assert gemm_f32.supported() == has
    return has


def assert_within_accumulation_bound(got, x, w, b) -> None:
    """|got - x @ W^T - b| (float64) <= (k + 1) * 2^-24 * (|x| @ |W|^T + |b|): a float32 sum of k
    products, each rounded once (the standard bound); far below it in practice."""
    k = x.shape[1]
    expected = gemm_f32.reference(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert got.dtype == torch.float32 and got.shape == expected.shape
    err = (got.double() - expected).abs()
    assert bool((err <= (k + 1) * 2.0 ** -24 * scale).all()), f"max error {err.max().item()}"
    assert bool((err <= 8 * 2.0 ** -24 * scale).all())         # tight: a few roundings, not k of them


SHAPES = [(1, 512, 1536), (32, 512, 1536), (64, 1408, 512), (6, 64, 64), (7, 33, 70), (13, 1, 5), (2, 2, 16),
          (5, 96, 200), (97, 130, 65), (200, 17, 3), (33, 255, 129)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_equals_the_float64_reference(m, k, n, bias):
    """Rows 1..200 (register blocks of 1-6 rows, several row chunks), any k, n not a multiple of
    the 64-column tile, with and without bias."""
    if kernel_here():
        assert_gemm_equals_reference(gemm_f32.GEMM, m, k, n, bias)


def assert_gemm_equals_reference(gemm, m: int, k: int, n: int, bias: bool) -> None:
    """A float32 GEMM's (gemm_f32's, gemm_avx2's) product of random x [m, k] and W [n, k] (and a
    bias) is within float32's accumulation bound of the float64 product."""
    torch.manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    assert_within_accumulation_bound(gemm.linear(x, gemm.pack_weight(w), n, b), x, w, b)


KERNELS = {     # every GEMM: the module, its dtype, whether it runs here, its accuracy check (got, x, w)
    "f32": (gemm_f32, torch.float32, kernel_here, lambda got, x, w: assert_within_accumulation_bound(got, x, w, None)),
    "bf16": (gemm_bf16, torch.bfloat16, bf16_tests.kernel_here,
             lambda got, x, w: bf16_tests.assert_within_one_rounding(got, gemm_bf16.reference(x, w), x.shape[1])),
    "amx": (gemm_amx, torch.bfloat16, amx_tests.kernel_here,
            lambda got, x, w: bf16_tests.assert_within_one_rounding(got, gemm_amx.reference(x, w), x.shape[1])),
    "avx2_f32": (gemm_avx2.F32, torch.float32, lambda: avx2_tests.kernel_here(),     # late: that module imports this one
                 lambda got, x, w: assert_within_accumulation_bound(got, x, w, None)),
    "avx2_bf16": (gemm_avx2.BF16, torch.bfloat16, lambda: avx2_tests.kernel_here(),
                  lambda got, x, w: bf16_tests.assert_within_one_rounding(got, gemm_avx2.BF16.reference(x, w), x.shape[1])),
}


@pytest.mark.parametrize("kind", KERNELS)
def test_strided_rows_empty_input_and_thread_count_do_not_change_the_result(kind):
    """x may be a column slice of a wider tensor (row stride > k); 0 rows give [0, n]; one
    thread and two give the same bits (each output element is one task's fixed-order sum)."""
    gemm, dtype, here, check = KERNELS[kind]
    if not here():
        return
    torch.manual_seed(1)
    wide, w = torch.randn(40, 300).to(dtype), torch.randn(150, 257).to(dtype)
    packed = gemm.pack_weight(w)
    x = wide[:, 10:267]
    assert x.stride(0) == 300
    got = gemm.linear(x, packed, 150)
    assert torch.equal(got, gemm.linear(x.contiguous(), packed, 150))
    check(got, x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm.linear(x, packed, 150), got)
    finally:
        torch.set_num_threads(threads)
    assert gemm.linear(x[:0], packed, 150).shape == (0, 150)


def test_pack_weight_layout():
    """packed[t, kk, c] = W[t * 64 + c, kk], zero past n."""
    if not kernel_here():
        return
    w = torch.arange(70 * 5, dtype=torch.float32).reshape(70, 5)
    packed = gemm_f32.pack_weight(w)
    assert packed.shape == (2, 5, 64)
    assert packed[1, 4, 3] == w[67, 4] and packed[0, 3, 5] == w[5, 3]
    assert not packed[1, :, 6:].any()


def test_bad_inputs_raise_value_error():
    """Wrong dtypes, ranks, widths, a packed weight of another shape, a bias of the wrong size."""
    if not kernel_here():
        return
    w = torch.randn(100, 48)
    packed, x = gemm_f32.pack_weight(w), torch.randn(4, 48)
    bad_calls = [
        lambda: gemm_f32.pack_weight(w.double()),
        lambda: gemm_f32.pack_weight(torch.randn(0, 4)),
        lambda: gemm_f32.pack_weight(torch.randn(3)),
        lambda: gemm_f32.linear(x.double(), packed, 100),
        lambda: gemm_f32.linear(x[0], packed, 100),
        lambda: gemm_f32.linear(torch.randn(4, 50), packed, 100),
        lambda: gemm_f32.linear(torch.randn(4, 96)[:, ::2], packed, 100),
        lambda: gemm_f32.linear(x, packed, 129),
        lambda: gemm_f32.linear(x, packed, 0),
        lambda: gemm_f32.linear(x, packed.bfloat16(), 100),
        lambda: gemm_f32.linear(x, packed.reshape(2, 24, 128), 100),
        lambda: gemm_f32.linear(x, packed.transpose(1, 2), 100),
        lambda: gemm_f32.linear(x, packed, 100, torch.randn(99)),
        lambda: gemm_f32.linear(x, packed, 100, torch.randn(100).double()),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
