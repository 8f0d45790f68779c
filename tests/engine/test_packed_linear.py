"""engine.packed_linear, engine.bf16_linear, engine.avx2_linear and engine.f32_linear: packed CPU
linears (oneDNN, pdserve's bf16 and float32 GEMMs) equal nn.Linear; pack_linears swaps them in,
or leaves nn.Linear where nothing packs the dtype (bf16 on an AVX2-only CPU without the C kernels)."""
import pytest
import torch
from torch import nn

from engine import SamplingParams, amx_linear, avx2_linear, bf16_linear, f32_linear
from engine.packed_linear import PackedLinear, onednn_packs, pack_linears
from engine.parallel.sharding import RowParallelLinear
from tests.model_factory import hf_greedy


def _onednn_bf16_here() -> bool:
    """Whether oneDNN multiplies bf16 natively here: AVX-512 (BW, VL, DQ) or AMX; not on an AVX2-only
    CPU (AMD Zen 2 and 3), where bf16 linears go to pdserve's AVX2 GEMM or stay nn.Linear."""
    here = (all(_cpu_has(f) for f in ("avx512bw", "avx512vl", "avx512dq")) or _cpu_has("amx_bf16"))
    assert onednn_packs(torch.bfloat16) == here
    return here


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_equals_linear(dtype, atol, bias, rows):
    """oneDNN's packed linear equals nn.Linear: float32 everywhere, bf16 where oneDNN packs it."""
    if dtype == torch.bfloat16 and not _onednn_bf16_here():
        return
    assert onednn_packs(dtype)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias, dtype=dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x).float()
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


def test_packed_keeps_leading_dims_and_non_contiguous_input():
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 3, 128)[..., ::2]          # [5, 3, 64], stride 2 in the last dim
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_replaces_every_plain_linear_including_row_parallel_ones():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8)))
    row = RowParallelLinear(nn.Linear(32, 8), rank=0, tp=2, all_reduce=lambda t: None)
    model.append(row)
    x = torch.randn(4, 16)
    before = model[:3](x)
    assert pack_linears(model) == 3
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(row.local, PackedLinear) and row.local.in_features == 16
    torch.testing.assert_close(model[:3](x), before, atol=1e-5, rtol=1e-5)
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_pack_linears_off_switch_and_unsupported_dtype(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float64))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


def test_engine_packs_its_cpu_linears(make_llm, model_dir):
    llm = make_llm(model_dir[0])
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, PackedLinear)
    assert all(isinstance(layer.mlp.down_proj, PackedLinear) for layer in model.layers)


GEMMS = {   # pdserve's GEMM linears: class, dtype, the /proc/cpuinfo flags it needs, its switch, tolerance,
            # and the flag of a CPU where it is not the default (another path is faster there)
    "amx": (amx_linear.AmxLinear, torch.bfloat16, ("amx_bf16",), "PDSERVE_AMX_GEMM", 3e-2, None),
    "bf16": (bf16_linear.Bf16Linear, torch.bfloat16, ("avx512_bf16",), "PDSERVE_BF16_GEMM", 3e-2, "amx_bf16"),
    "avx2": (avx2_linear.Avx2Bf16Linear, torch.bfloat16, ("avx2", "fma"), "PDSERVE_AVX2_GEMM", 3e-2, "avx512bw"),
    "f32": (f32_linear.F32Linear, torch.float32, ("avx512f",), "PDSERVE_F32_GEMM", 1e-5, None),
    "avx2f32": (avx2_linear.Avx2F32Linear, torch.float32, ("avx2", "fma"), "PDSERVE_AVX2_F32_GEMM", 1e-5, "avx512f"),
}


def _cpu_has(flag: str | None) -> bool:
    with open("/proc/cpuinfo") as f:
        return flag is not None and any(line.startswith("flags") and f" {flag}" in line for line in f)


def _kernel_here(kind: str) -> bool:
    """Whether that kind's GEMM runs here: where the CPU has the flags it must."""
    cls, _, flags = GEMMS[kind][:3]
    here = all(_cpu_has(f) for f in flags)
    assert cls.gemm.supported() == here
    return here


def _gemm_here(kind: str) -> bool:
    """Whether linears of that kind's dtype may use pdserve's GEMM here by default: where the kernel
    runs, unless the CPU has the flag that leaves them to another path (AMX, for vdpbf16ps;
    AVX-512, oneDNN's native bf16, for AVX2's)."""
    cls, dtype = GEMMS[kind][:2]
    here = _kernel_here(kind) and not _cpu_has(GEMMS[kind][5])
    assert cls.can_use(dtype, torch.device("cpu")) == here
    return here


@pytest.mark.parametrize("kind", GEMMS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_gemm_linear_equals_linear(kind, bias, rows):
    """AmxLinear, Bf16Linear, Avx2Bf16Linear and F32Linear (pdserve's GEMMs) equal nn.Linear in
    their dtype, keeping leading dims."""
    if not _kernel_here(kind):
        return
    cls, dtype, _, _, tol, _ = GEMMS[kind]
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias, dtype=dtype)
    x = torch.randn(rows, 3, 96, dtype=dtype)[:, 1]     # rows strided in memory
    got = cls(linear)(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    torch.testing.assert_close(got.float(), linear(x).float(), atol=tol, rtol=tol)


def _default_type(dtype: torch.dtype, off: tuple[str, ...] = ()) -> type:
    """The linear pack_linears picks for dtype here: the first GEMM of that dtype that is the
    default here (bf16: AMX's, then vdpbf16ps', then AVX2's), leaving out the kinds `off`; else
    oneDNN's where it packs the dtype; else nn.Linear (left as it is)."""
    kinds = [k for k in GEMMS if GEMMS[k][1] == dtype and k not in off]
    fallback = PackedLinear if onednn_packs(dtype) else nn.Linear
    return next((GEMMS[k][0] for k in kinds if _gemm_here(k)), fallback)


def _packed_type(dtype: torch.dtype) -> type:
    model = nn.Sequential(nn.Linear(16, 32, dtype=dtype))
    packed = pack_linears(model)
    assert packed == (0 if type(model[0]) is nn.Linear else 1)
    return type(model[0])


@pytest.mark.parametrize("kind", GEMMS)
def test_pack_linears_uses_the_gemm_unless_switched_off(kind, monkeypatch):
    """bf16 on an AMX CPU: AmxLinear; on an AVX512-BF16 CPU without AMX: Bf16Linear; on an
    AVX2-only CPU: Avx2Bf16Linear; float32 on an AVX-512 CPU: F32Linear. A switch set to 0: the
    next in that order (PDSERVE_BF16_GEMM=0: neither AMX's nor vdpbf16ps'); set to 1: that GEMM
    wherever it runs. Where none runs: oneDNN where it packs the dtype, else nn.Linear."""
    cls, dtype, _, switch, _, _ = GEMMS[kind]
    assert _packed_type(dtype) is _default_type(dtype)
    monkeypatch.setenv(switch, "1")
    off = ("amx", "bf16") if switch == "PDSERVE_BF16_GEMM" else (kind,)
    assert _packed_type(dtype) is (cls if _kernel_here(kind) else _default_type(dtype, off=off))
    monkeypatch.setenv(switch, "0")
    assert _packed_type(dtype) is _default_type(dtype, off=off)


BF16_LINEARS = [    # settings that each pick another bf16 linear somewhere: (environment, GEMM kinds they turn off)
    ({}, ()),
    ({"PDSERVE_BF16_GEMM": "1"}, ("amx",)),
    ({"PDSERVE_BF16_GEMM": "0"}, ("amx", "bf16")),
    ({"PDSERVE_BF16_GEMM": "0", "PDSERVE_AVX2_GEMM": "0"}, ("amx", "bf16", "avx2")),
]


def test_bf16_engine_generates_alike_on_every_linear(make_llm, model_dir, monkeypatch):
    """A bf16 engine gives the same greedy tokens on each bf16 linear this CPU has (pdserve's GEMMs,
    oneDNN's, or nn.Linear where nothing packs bf16), and picks the linear each setting names."""
    prompts = [[1, 5, 9, 200, 31], [7, 7, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seen = {}
    for env, off in BF16_LINEARS:
        for name in ("PDSERVE_BF16_GEMM", "PDSERVE_AVX2_GEMM"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        llm = make_llm(model_dir[0], dtype="bfloat16")
        kind = type(llm.engine.runner.model.lm_head)
        asked = env.get("PDSERVE_BF16_GEMM") == "1" and _kernel_here("bf16")
        assert kind is (bf16_linear.Bf16Linear if asked else _default_type(torch.bfloat16, off=off))
        seen[kind] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(seen) >= 2, f"only {list(seen)} here"       # every CPU has at least two of them
    assert all(tokens == next(iter(seen.values())) for tokens in seen.values()), seen


def test_without_the_c_kernels_bf16_linears_stay_on_onednn(monkeypatch):
    """PDSERVE_CPU_KERNELS=0 (or no compiler, or no instruction set of theirs): pdserve's bf16 GEMMs
    report themselves unavailable and bf16 linears are packed for oneDNN where it packs bf16, left
    nn.Linear elsewhere, with the same results."""
    from kernels import gemm_amx, gemm_avx2, gemm_bf16
    from kernels.cpu_kernels import build_error, gemm_amx_lib, gemm_avx2_lib, gemm_bf16_lib
    caches = (gemm_bf16_lib, gemm_bf16.supported, gemm_amx_lib, gemm_amx.supported, gemm_avx2_lib,
              gemm_avx2.BF16.supported, gemm_avx2.F32.supported)
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    for cache in caches:
        cache.cache_clear()
    try:
        for name, gemm in (("gemm_bf16", gemm_bf16), ("gemm_amx", gemm_amx), ("gemm_avx2", gemm_avx2.BF16)):
            assert not gemm.supported() and "PDSERVE_CPU_KERNELS" in build_error(name)
        linear = nn.Linear(64, 80, dtype=torch.bfloat16)
        model = nn.Sequential(linear)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        expected = PackedLinear if _onednn_bf16_here() else nn.Linear
        assert pack_linears(model) == (expected is PackedLinear) and type(model[0]) is expected
        torch.testing.assert_close(model(x).float(), linear(x).float(), atol=3e-2, rtol=3e-2)
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()
    assert gemm_bf16.supported() == _kernel_here("bf16") and gemm_amx.supported() == _kernel_here("amx")
    assert gemm_avx2.BF16.supported() == _kernel_here("avx2")


def test_f32_engine_equals_transformers_on_either_linear(make_llm, model_dir, monkeypatch):
    """A float32 engine decodes transformers' greedy tokens on pdserve's GEMM (AVX-512's, else
    AVX2's) and on oneDNN."""
    prompts = [[1, 5, 9, 200, 31], [7, 7, 7], [(i * 37) % 500 + 3 for i in range(53)]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    path, hf = model_dir
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = make_llm(path)
    assert type(llm.engine.runner.model.lm_head) is _default_type(torch.float32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    monkeypatch.setenv("PDSERVE_F32_GEMM", "0")
    monkeypatch.setenv("PDSERVE_AVX2_F32_GEMM", "0")
    onednn = make_llm(path)
    assert type(onednn.engine.runner.model.lm_head) is PackedLinear
    assert [o.outputs[0].token_ids for o in onednn.generate(prompts, params)] == expected

