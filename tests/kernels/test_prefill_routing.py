"""Which path a CPU prefill sequence takes (kernels/cpu_prefill.py): long bfloat16 ones to torch's
SDPA where the CPU has AMX tiles, the rest to the C kernel where the CPU has AVX-512, every one to
the PyTorch path elsewhere; a chunk after a cached prefix as two
flash-attention calls merged by their log-sum-exps; never a masked batch for long chunks."""
import pytest
import torch

from kernels.testing import run_and_compare


def test_long_bf16_prefills_go_to_sdpa_where_the_cpu_has_amx(monkeypatch):
    """Where the CPU has AMX tiles, a bfloat16 sequence of >= 512 tokens with >= 128 new ones goes
    to torch's SDPA and the others to the C kernel, in one batch, each row exact; float32 stays on
    the C kernel; PDSERVE_PREFILL_SDPA=0 / 1 sends every sequence one way."""
    from kernels import cpu_prefill
    monkeypatch.delenv("PDSERVE_PREFILL_SDPA", raising=False)
    amx, native = cpu_prefill._amx_tiles(), cpu_prefill.native_vectors()
    assert cpu_prefill.to_library(torch.bfloat16, 512, 128) == (amx or not native)
    assert cpu_prefill.to_library(torch.bfloat16, 511, 511) == (not native)
    assert cpu_prefill.to_library(torch.bfloat16, 4096, 127) == (not native)
    assert cpu_prefill.to_library(torch.float32, 4096, 4096) == (not native)
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "1")
    assert cpu_prefill.to_library(torch.float32, 2, 2)
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "0")
    assert not cpu_prefill.to_library(torch.bfloat16, 4096, 4096)
    monkeypatch.delenv("PDSERVE_PREFILL_SDPA")
    to_c = []
    real = cpu_prefill._prefill_c
    monkeypatch.setattr(cpu_prefill, "_prefill_c", lambda *a: (to_c.append(list(a[-2])), real(*a)))
    # rows: a fresh 1,100-token prompt, 128 new tokens after 972 cached, a short prompt, a decode row
    run_and_compare([1100, 1100, 200, 9], [1100, 128, 200, 1], 8, 2, 64, 16, torch.bfloat16, "cpu")
    assert to_c == ([] if not native else [[2]] if amx else [[0, 1, 2]])
    to_c.clear()
    run_and_compare([1100, 1100, 200, 9], [1100, 128, 200, 1], 8, 2, 64, 16, torch.float32, "cpu")
    assert to_c == ([[0, 1, 2]] if native else [])
    to_c.clear()
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "0")      # the kernel, asked for, on any CPU
    run_and_compare([1100, 200, 9], [128, 200, 1], 8, 2, 64, 16, torch.float32, "cpu")
    assert to_c == [[0, 1]]


def test_the_c_prefill_kernel_only_where_its_vectors_are_native():
    """Its 16-lane vectors are AVX-512's: the kernel is the default there, never on an AVX2-only CPU."""
    from kernels import cpu_prefill
    with open("/proc/cpuinfo") as f:
        avx512 = any(line.startswith("flags") and " avx512f" in line for line in f)
    assert cpu_prefill.native_vectors() == avx512


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_c_prefill_keeps_long_bf16_contexts_exact(monkeypatch, kv_heads):
    """The C kernel over contexts past LIBRARY_CONTEXT in bfloat16 (what hosts without AMX tiles run)."""
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "0")
    run_and_compare([1100, 1100], [1100, 100], 8, kv_heads, 64, 16, torch.bfloat16, "cpu")


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_pytorch_path_chunk_after_a_prefix_matches_reference(monkeypatch, flash, dtype, kv_heads):
    """A lone chunk after a cached prefix on the PyTorch path: the prefix unmasked and the new keys
    causal, merged by their log-sum-exps (flash), or one call with the offset causal mask (a torch
    without the flash op), both within the stated tolerance; a fresh prompt beside it."""
    from kernels import cpu_prefill
    splits = []
    real = cpu_prefill._after_prefix
    monkeypatch.setattr(cpu_prefill, "_after_prefix", lambda q, k, v, prefix, scale: (
        splits.append(prefix), real(q, k, v, prefix, scale))[1])
    if not flash:
        monkeypatch.setattr(cpu_prefill, "_FLASH", None)
    run_and_compare([700, 90], [150, 90], 8, kv_heads, 64, 16, dtype, "cpu-torch")
    run_and_compare([700, 41], [699, 41], 8, kv_heads, 64, 16, dtype, "cpu-torch")
    assert splits == ([550, 1] if flash else [])


def test_long_bf16_chunks_after_prefixes_never_take_a_masked_batch(monkeypatch):
    """Sequences sent to SDPA batch only when all fresh and of one length (is_causal, no mask);
    chunks after cached prefixes go one at a time (_after_prefix), never as one masked batch."""
    from kernels import cpu_prefill
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "1")
    batches, splits = [], []
    real_batch, real_split = cpu_prefill._prefill_batch, cpu_prefill._after_prefix
    monkeypatch.setattr(cpu_prefill, "_prefill_batch", lambda *a: (batches.append(list(a[-2])), real_batch(*a)))
    monkeypatch.setattr(cpu_prefill, "_after_prefix", lambda q, k, v, prefix, scale: (
        splits.append(prefix), real_split(q, k, v, prefix, scale))[1])
    run_and_compare([1100, 1090, 9], [128, 130, 1], 8, 2, 64, 16, torch.bfloat16, "cpu")
    assert batches == [] and sorted(splits) == [960, 972]
    run_and_compare([600, 600, 9], [600, 600, 1], 8, 2, 64, 16, torch.bfloat16, "cpu")
    assert batches == [[0, 600]] and len(splits) == 2     # the prompts' first rows
