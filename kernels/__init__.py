"""pdserve kernels: paged attention, KV store, block copy, block transfer and a layer's small ops.

Every public function is a thin launcher that checks its arguments (ValueError) and then
dispatches: CUDA tensors -> Triton kernels (or PyTorch), CPU tensors -> the C kernels of
kernels/csrc where they built, else plain PyTorch. The plain-PyTorch
references the tests compare against live in kernels/reference.py. Layout and contracts:
kernels/README.md.
"""

from kernels.block_copy import copy_blocks
from kernels.block_transfer import gather_blocks, scatter_blocks
from kernels.kv_store import store_kv
from kernels.layer_ops import rms_norm, silu_and_mul
from kernels.paged_attention import paged_attention, unsupported_attention

__all__ = ["copy_blocks", "gather_blocks", "paged_attention", "rms_norm", "scatter_blocks", "silu_and_mul",
           "store_kv", "unsupported_attention"]
