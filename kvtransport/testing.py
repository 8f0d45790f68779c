"""Small helpers for tests and benchmarks of the transport: pools and identities."""
from __future__ import annotations

import torch

from kernels import huge_pages
from pdwire.handshake import KVLayout, PeerIdentity, model_fingerprint, new_epoch

TINY_MODEL = model_fingerprint({"arch": "llama", "hidden": 64}, [("embed.weight", (128, 64))])


def make_pool(num_blocks: int = 8, num_layers: int = 2, block_size: int = 4, num_kv_heads: int = 2,
              head_dim: int = 8, dtype: torch.dtype = torch.float32, seed: int | None = 0) -> torch.Tensor:
    """A KV pool [num_blocks, num_layers, 2, block_size, H, D]: random if seed is set, else zeros,
    in huge pages as the engine allocates its pool (kernels/huge_pages.py)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    if seed is None:
        return huge_pages.empty(shape, dtype).zero_()
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_identity(kv_cache: torch.Tensor, node_id: str, transport: str = "fake",
                  model_id: str = TINY_MODEL) -> PeerIdentity:
    return PeerIdentity(node_id, new_epoch(), transport, KVLayout.for_pool(kv_cache, model_id))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe, works for bf16)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


TEST_SECRET = b"pdserve-test-cluster-secret-0123"   # tests and benchmarks only
