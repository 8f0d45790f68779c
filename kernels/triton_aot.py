"""Ahead-of-time compilation of every Triton kernel variant for a GPU target, without a GPU.

`variants()` lists each (kernel, constexprs, pointer dtypes, launch options) that a launcher
can pick; `compile_variant(v, cc)` builds it for GPUTarget("cuda", cc, 32) down to a cubin
(triton bundles ptxas) and reports its shared memory. Like the JIT on a real launch, it tells
the compiler that pointers and the strides of realistic shapes are multiples of 16
(tt.divisibility), which turns on vectorized loads and cp.async pipelining; the scalars the
JIT would specialize when equal to 1 are marked do_not_specialize in the kernels. tests/kernels/test_kernels_triton_compile.py
runs them for sm_90 (H100/H200) and sm_80 (A100).
"""

from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget

from kernels import triton_block_copy, triton_kv_store, triton_paged_attention as tpa

# Max dynamic shared memory per block (bytes) by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


class Variant(NamedTuple):
    name: str
    fn: object  # a @triton.jit function
    pointers: dict  # arg name -> torch dtype of what it points to
    constexprs: dict  # arg name -> value
    num_warps: int
    num_stages: int = 2
    unaligned: tuple = ()  # int args not assumed divisible by 16 (pointers always are)


class Compiled(NamedTuple):
    name: str
    cc: int
    shared: int  # bytes of shared memory the kernel needs
    has_cubin: bool


def variants() -> list[Variant]:
    """Every compiled variant the launchers in kernels/ can pick."""
    out = []
    for c in tpa.all_configs():
        ptrs = dict.fromkeys(["out_ptr", "q_ptr", "k_ptr", "v_ptr"], c.dtype)
        ptrs |= dict.fromkeys(["seg_acc_ptr", "seg_max_ptr", "seg_sum_ptr"], torch.float32)
        ptrs |= dict.fromkeys(["block_tables_ptr", "cu_q_ptr", "seq_lens_ptr"], torch.int32)
        consts = dict(HEAD_DIM=c.head_dim, HEAD_PAD=tpa.head_pad(c.head_dim), BLOCK_M=c.block_m,
                      TILE_N=tpa.TILE_N, PRECISION=tpa.PRECISION)
        out.append(Variant(f"attention-{c.dtype}-d{c.head_dim}-m{c.block_m}", tpa._paged_attention_kernel,
                           ptrs, consts, c.num_warps, c.num_stages, unaligned=("stride_bt",)))
    for dtype in tpa.DTYPES:
        for d in tpa.HEAD_DIMS:
            ptrs = {"out_ptr": dtype} | dict.fromkeys(["seg_acc_ptr", "seg_max_ptr", "seg_sum_ptr"], torch.float32)
            out.append(Variant(f"reduce-{dtype}-d{d}", tpa._reduce_segments_kernel, ptrs,
                               dict(HEAD_DIM=d, HEAD_PAD=tpa.head_pad(d)), num_warps=1))
    for c in triton_kv_store.all_configs():
        ptrs = dict.fromkeys(["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"], c.bits_dtype)
        out.append(Variant(f"store_kv-{c.bits_dtype}-p{c.head_pad}", triton_kv_store._store_kv_kernel,
                           ptrs | {"slot_ptr": torch.int64}, dict(HEAD_PAD=c.head_pad), num_warps=1))
    for c in triton_block_copy.all_configs():
        ptrs = dict.fromkeys(["src_ptr", "dst_ptr"], c.bits_dtype) | dict.fromkeys(["src_ids_ptr", "dst_ids_ptr"], torch.int64)
        consts = dict(HAS_SRC_IDS=c.has_src_ids, HAS_DST_IDS=c.has_dst_ids, BLOCK=triton_block_copy.BLOCK)
        out.append(Variant(f"copy_rows-{c.bits_dtype}-src{int(c.has_src_ids)}-dst{int(c.has_dst_ids)}",
                           triton_block_copy._copy_rows_kernel, ptrs, consts, num_warps=4))
    return out


def signature(v: Variant) -> dict:
    """ASTSource signature: pointers typed from v.pointers, constexprs marked, other args
    int32 except float scalars (names in FLOAT_ARGS) and int64 row sizes."""
    sig = {}
    for name in v.fn.arg_names:
        if name in v.constexprs:
            sig[name] = "constexpr"
        elif name in v.pointers:
            sig[name] = "*" + _TRITON_DTYPE[v.pointers[name]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name == "row_numel":
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def divisibility(v: Variant) -> dict:
    """ASTSource attrs: pointers and stride / size ints (but v.unaligned) divisible by 16."""
    aligned = [i for i, name in enumerate(v.fn.arg_names) if name in v.pointers
               or (name.startswith("stride_") or name == "row_numel") and name not in v.unaligned]
    return {(i,): [["tt.divisibility", 16]] for i in aligned}


def compile_variant(v: Variant, cc: int) -> Compiled:
    """Compile v for CUDA compute capability cc (e.g. 90, 80); raises if Triton cannot."""
    src = triton.compiler.ASTSource(fn=v.fn, signature=signature(v), constexprs=v.constexprs,
                                    attrs=divisibility(v))
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=v.num_warps, num_stages=v.num_stages))
    return Compiled(v.name, cc, kernel.metadata.shared, bool(kernel.asm.get("cubin")))


def compile_nth(index: int, cc: int) -> Compiled:
    """compile_variant(variants()[index], cc) for a worker process; errors come back as
    RuntimeError with the message (Triton's own exceptions do not always pickle)."""
    try:
        return compile_variant(variants()[index], cc)
    except Exception as e:  # noqa: BLE001 - re-raised with its text
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
