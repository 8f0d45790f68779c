"""Chained block hashes: the prefix-cache key of a full block, the same in every process.

hash(block i) = blake2b-128(hash(block i-1) || token ids of block i as little-endian int64),
with 16 zero bytes before block 0. The router, prefill and decode nodes exchange these.
"""
from __future__ import annotations

import hashlib
from typing import NewType, Sequence

import numpy as np

BlockHash = NewType("BlockHash", bytes)   # 16 bytes
HASH_BYTES = 16
_ROOT = bytes(HASH_BYTES)


def hash_block(prev: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(prev or _ROOT, digest_size=HASH_BYTES)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return BlockHash(h.digest())


def chain_hashes(token_ids: Sequence[int], block_size: int, start: list[BlockHash] | None = None
                 ) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already known `start`."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        prev = hashes[-1] if hashes else None
        hashes.append(hash_block(prev, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
