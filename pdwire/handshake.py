"""Who a peer is and what its KV pool looks like; two nodes pair only if every field agrees.

A prefill node P and a decode node D exchange `PeerIdentity` in Hello / HelloAck. Blocks are
shipped as raw bytes, so P and D must hold the same model, KV dtype, block size and block layout;
`check_compatible` refuses the pairing and names the first field that differs. The epoch is a
fresh random id per process start: a restarted peer is a new peer, never the old one.

The layout describes a block as it travels, with every kv head, which is what a tp = 1 pool
holds. A node running tensor parallelism (each rank holding num_kv_heads / tp heads) gathers its
ranks' heads into such a block before it sends and spreads a received one over its ranks, so P
and D of any two tensor_parallel_size values pair: the heads are mapped, never refused.
"""
from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

from pdwire.schema import (PROTOCOL_VERSION, MAX_ID_LEN, ProtocolError, check_id, check_int,
                               check_str)

# One tensor per node for all layers, block-major, so one block (all layers' K and V) is one
# contiguous region:  kv_cache[b] == the frame payload of block b (on a tp = 1 node; a tp > 1
# node's rank r holds heads [r*H/tp, (r+1)*H/tp) of that region's last-but-one axis).
POOL_LAYOUT = "num_blocks,num_layers,2,block_size,num_kv_heads,head_dim"

# The dtypes a KV pool may use, by their torch name, and their bytes per element
# (kvtransport.payload maps the names to torch dtypes; this package does not import torch).
KV_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
TRANSPORTS = ("zmq", "torch_dist", "fake")


class HandshakeError(RuntimeError):
    """Two peers refuse to pair; `field` names the first field that differs."""

    def __init__(self, field: str, local: Any, remote: Any) -> None:
        super().__init__(f"handshake refused: {field} differs (local {local!r}, peer {remote!r})")
        self.field = field


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32; raises ValueError for dtypes a KV pool may not use."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return name


def model_fingerprint(config: dict[str, Any], weights: Iterable[tuple[str, Sequence[int]]]) -> str:
    """A 32-hex-digit id of the model: blake2b over its config and its weights' names and shapes.

    Key order and weight order do not matter; any other change of config or of a weight's
    name or shape gives another id.
    """
    canon = {"config": config, "weights": sorted((n, [int(d) for d in s]) for n, s in weights)}
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def new_epoch() -> str:
    """A fresh random id for one process start (16 hex digits)."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a block on the wire (all kv heads) and what it holds. Equal layouts can
    exchange blocks, whatever each node's tensor_parallel_size."""
    model_id: str                     # model_fingerprint(config, weights)
    kv_dtype: str                     # a KV_DTYPES key, e.g. "bfloat16"
    block_size: int                   # tokens per block
    num_layers: int
    num_kv_heads: int                 # the model's, all of them (not one tp rank's share)
    head_dim: int
    pool_layout: str = POOL_LAYOUT
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_id(self.model_id, "model_id")
        check_str(self.kv_dtype, "kv_dtype", max_len=32)
        if self.kv_dtype not in KV_DTYPES:
            raise ProtocolError(f"kv_dtype {self.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            check_int(getattr(self, name), name, lo=1, hi=1 << 16)
        check_str(self.pool_layout, "pool_layout", max_len=128)
        check_int(self.protocol_version, "protocol_version", lo=0, hi=1 << 16)

    @classmethod
    def for_pool(cls, kv_cache: Any, model_id: str, tensor_parallel_size: int = 1) -> KVLayout:
        """The wire layout of a pool `kv_cache: [num_blocks, num_layers, 2, block_size, H / tp, D]`
        holding one tp rank's share of the H kv heads (all of them when tp is 1)."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(f"kv_cache must be [N, L, 2, bs, H, D], got {tuple(kv_cache.shape)}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (one block is one region)")
        _, layers, _, bs, heads, dim = kv_cache.shape
        return cls(model_id, dtype_name(kv_cache.dtype), bs, layers, heads * tensor_parallel_size, dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * KV_DTYPES[self.kv_dtype]

    def to_wire(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """One node process: its name, its epoch (fresh per start), its transport and KV layout."""
    node_id: str
    epoch: str
    transport: str                    # one of TRANSPORTS; payloads travel differently per kind
    layout: KVLayout

    def __post_init__(self) -> None:
        check_id(self.node_id, "node_id")
        check_id(self.epoch, "epoch", max_len=MAX_ID_LEN)
        check_str(self.transport, "transport", max_len=16)
        if isinstance(self.layout, list):        # decoded from the wire
            object.__setattr__(self, "layout", KVLayout(*self.layout))
        if not isinstance(self.layout, KVLayout):
            raise ProtocolError("layout must be a KVLayout")

    def to_wire(self) -> list:
        return [self.node_id, self.epoch, self.transport, self.layout.to_wire()]


def check_compatible(local: PeerIdentity, remote: PeerIdentity) -> None:
    """Raise HandshakeError naming the first field that keeps the two nodes from pairing."""
    if remote.epoch == local.epoch:
        raise HandshakeError("epoch", local.epoch, remote.epoch)   # talking to itself
    if remote.transport != local.transport:
        raise HandshakeError("transport", local.transport, remote.transport)
    for name in _COMPARED:
        mine, theirs = getattr(local.layout, name), getattr(remote.layout, name)
        if mine != theirs:
            raise HandshakeError(name, mine, theirs)


_COMPARED = ("protocol_version", "model_id", "kv_dtype", "block_size", "num_layers",
             "num_kv_heads", "head_dim", "pool_layout")
