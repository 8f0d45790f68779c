"""pdserve kernels: paged attention, KV store, block copy and block transfer.

Every public function is a thin launcher that checks its arguments (ValueError) and then
dispatches: CUDA tensors -> Triton kernels, CPU tensors -> plain PyTorch. The plain-PyTorch
references the tests compare against live in kernels/reference.py. Layout and contracts:
kernels/README.md.
"""

from kernels.block_copy import copy_blocks
from kernels.block_transfer import gather_blocks, scatter_blocks
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_attention

__all__ = ["copy_blocks", "gather_blocks", "paged_attention", "scatter_blocks", "store_kv"]
