"""kernels.argmax: the C pass picks exactly torch.argmax's index (first of equal maxima, NaN
largest), over float32 and bfloat16 rows of every length class the vector loop has."""
import pytest
import torch

from kernels import argmax as am
from kernels.cpu_kernels import argmax_lib

WIDTHS = [1, 2, 15, 16, 17, 31, 33, 1000, 32000]


def test_the_library_builds():
    """The C path is what the other tests exercise (no silent fallback to torch)."""
    assert argmax_lib() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", WIDTHS)
def test_random_rows_match_torch(dtype, n):
    """Random logits: the same index as torch.argmax, in both dtypes."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(33, n, generator=g) * 8).to(dtype)
    assert torch.equal(am.argmax(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", WIDTHS)
def test_ties_take_the_first_index(dtype, n):
    """Few distinct values (many equal maxima, -0.0 beside 0.0): the first maximum wins."""
    g = torch.Generator().manual_seed(7 + n)
    x = torch.randint(-3, 2, (64, n), generator=g).to(dtype)
    x[torch.rand(64, n, generator=g) < 0.3] = -0.0
    x[:4] = -0.0
    x[1, n // 2] = 0.0
    x[2, -1] = 0.0
    expected = x.float().argmax(dim=-1)
    assert torch.equal(am.argmax(x), expected)
    assert expected[0] == 0 and expected[1] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_nan(dtype):
    """All -inf rows give 0, +inf beats everything, and a NaN is the largest (its first index)."""
    n = 100
    x = torch.randn(6, n).to(dtype)
    x[0] = float("-inf")
    x[1, 40], x[1, 70] = float("inf"), float("inf")
    x[2, 55], x[2, 90] = float("nan"), float("nan")
    x[3, 0] = float("nan")
    x[4, -1] = float("nan")
    x[5, 3], x[5, 80] = float("inf"), float("nan")
    got = am.argmax(x)
    assert torch.equal(got, x.float().argmax(dim=-1))
    assert got.tolist()[:5] == [0, 40, 55, 0, n - 1] and got[5] == 80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype):
    """Rows with a stride beyond their width (a slice of wider logits), and a column-strided view."""
    x = torch.randn(8, 300).to(dtype)
    assert torch.equal(am.argmax(x[:, :257]), x[:, :257].float().argmax(dim=-1))
    assert torch.equal(am.argmax(x[::2]), x[::2].float().argmax(dim=-1))
    assert torch.equal(am.argmax(x.t()[:, :8]), x.t()[:, :8].float().argmax(dim=-1))


def test_other_dtypes_fall_back_to_torch():
    """float16 (no C path) gives torch's answer; zero rows give an empty result."""
    x = torch.randn(5, 40).half()
    assert torch.equal(am.argmax(x), x.argmax(dim=-1))
    assert am.argmax(torch.empty(0, 40)).shape == (0,)


@pytest.mark.parametrize("shape", [(10,), (2, 3, 4), (4, 0)])
def test_bad_shapes_raise(shape):
    """Not [rows, vocab > 0]: ValueError."""
    with pytest.raises(ValueError):
        am.argmax(torch.zeros(shape))
