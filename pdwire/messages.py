"""Every message that crosses a process, as a typed dataclass, and its msgpack codec.

Wire form of a message (no pickle anywhere):

    msgpack [PROTOCOL_VERSION, kind, [field, field, ...]]      fields in declaration order

Each dataclass validates its fields in `__post_init__`, so a message that exists is valid, and
`decode` raises nothing but `ProtocolError` whatever bytes it is given. Fields with a default
may be missing at the end of the list (a peer from before they were added): they take it.

  handshake      Hello(P -> D), HelloAck(D -> P), P2PJoin(D -> P, torch.distributed only)
  transfer       BlockFrame (+ one raw payload frame), BlockBatch (+ one raw frame per block),
                 LayerBatch (+ one raw frame per block: a layer group's slice of each),
                 Commit, Abort, Heartbeat (both ways)
  admission      Reserve(router -> D) -> Reserved | Busy
"""
from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, fields
from typing import Any, Union

import msgpack

from pdwire.handshake import KV_DTYPES, PeerIdentity
from pdwire.schema import (MAX_BLOCKS, MAX_RID_LEN, MAX_TOKEN_ID, PROTOCOL_VERSION,
                                ProtocolError, check_bool, check_hashes, check_id, check_ids,
                                check_int, check_ints, check_str, is_id, only_ints)

MAX_HEADER_BYTES = 64 << 10  # a KV message's header (the KV transport's cap; control messages have theirs):
                             # the largest legal ones encode to ~0.7 KB (a BlockBatch of MAX_BATCH_BLOCKS),
                             # ~2.9 KB (a HelloAck) and ~17 KB (a Heartbeat of MAX_HEARTBEAT_XFERS ids)
MAX_HEARTBEAT_XFERS = 256    # transfers one Heartbeat names (a sender with more names them over several)
MAX_BATCH_BLOCKS = 64        # blocks in one BlockBatch
OLD_ACK_BATCH_BYTES = 4 << 20   # what a HelloAck without max_batch_bytes (a receiver from before it) takes
BATCH_BYTES = 128 << 20      # what senders pack and receivers take by default (--kv-batch-mib), one
                             # header and MAC a batch, its payloads messages of their own (split);
                             # MAX_BATCH_BLOCKS of 2 MiB: a batch's checks cost ~0.2 ms cold, shared
                             # by 64 blocks rather than 8 (bench/README.md, twenty-second session)
WHOLE_BATCH_BYTES = 2 << 20  # the most a receiver takes when a batch's payloads come inside its message:
                             # libzmq hands a message over only once its last frame is in, so larger
                             # ones are copied cold (bench/README.md, "end of the eleventh session":
                             # 0.62-0.86 of the raw ceiling at 16 MiB, 0.77-1.01 at 2 MiB)
BATCH_BYTES_LIMIT = 256 << 20   # the most a receiver may announce
SPLIT_PAYLOADS = True           # a ZMQ receiver takes a batch's payloads as messages of their own
                                # (HelloAck.split_payloads) by default (bench/README.md, twelfth session)
RECV_QUEUE_BYTES = 256 << 20    # payload bytes a receiver lets one peer queue, in messages of its
                                # announced batch bytes, by default (--kv-recv-queue-mib)
_MAX_BLOCK_ID = (1 << 31) - 1    # a pool block id
_MAX_NBYTES = 1 << 34           # a block's (or a slice's) bytes in a block header
_MAX_DIMS, _MAX_DIM = 8, 1 << 20   # a block's shape: dimensions, and the most of each
_SEQS = (list, tuple)           # what a sequence field may come as (msgpack: list; in process: either)
PAYLOAD_WAIT_S = 2.0            # a decode node's loop waits this long for a payload after its header
                                # (torch_dist, gloo), by default (--kv-payload-wait-s)


def announced_batch_bytes(max_batch_bytes: int, split: bool) -> int:
    """What a receiver configured for max_batch_bytes announces in its HelloAck: all of it if it
    takes a batch's payloads as messages of their own (split), else WHOLE_BATCH_BYTES at most."""
    return max_batch_bytes if split else min(max_batch_bytes, WHOLE_BATCH_BYTES)


def batch_blocks(block_nbytes: int, max_bytes: int) -> int:
    """Blocks per BlockBatch of blocks of block_nbytes bytes within max_bytes (one block at least):
    what a sender packs, a receiver's cap."""
    return max(1, min(MAX_BATCH_BLOCKS, max_bytes // block_nbytes))


@dataclass(frozen=True, slots=True)
class Hello:
    """P -> D, first message on a connection."""
    identity: PeerIdentity

    def __post_init__(self) -> None:
        _coerce_identity(self)


@dataclass(frozen=True, slots=True)
class HelloAck:
    """D -> P: D's identity and whether it accepts the pairing (reason names the field if not)."""
    identity: PeerIdentity
    accepted: bool
    reason: str = ""
    max_batch_bytes: int = OLD_ACK_BATCH_BYTES   # payload bytes of one BlockBatch D takes (one block at least)
    layer_slices: bool = False  # D takes LayerBatch (its pool holds every kv head of a block)
    sealed_first: bool = False  # D reads payload messages as [header, seal, payload*] (kvtransport.session)
    split_payloads: bool = False  # D also takes [header, seal] then each payload as a message of its own

    def __post_init__(self) -> None:
        _coerce_identity(self)
        check_bool(self.accepted, "accepted")
        check_str(self.reason, "reason")
        check_int(self.max_batch_bytes, "max_batch_bytes", lo=1, hi=BATCH_BYTES_LIMIT)
        check_bool(self.layer_slices, "layer_slices")
        check_bool(self.sealed_first, "sealed_first")
        check_bool(self.split_payloads, "split_payloads")


@dataclass(frozen=True, slots=True)
class P2PJoin:
    """D -> P: join a two-rank torch.distributed group (D rank 0, P rank 1) at this TCPStore."""
    group: str                  # PrefixStore key of this pair
    store_host: str
    store_port: int

    def __post_init__(self) -> None:
        check_id(self.group, "group")
        check_id(self.store_host, "store_host", max_len=255)
        check_int(self.store_port, "store_port", lo=1, hi=65535)


@dataclass(frozen=True, slots=True)
class BlockFrame:
    """P -> D header of one block: all layers' K and V of block `index` of the sequence.

    The payload (nbytes raw bytes of a [num_layers, 2, block_size, H, D] tensor) follows as its
    own frame (zmq, fake) or as a point-to-point tensor (torch.distributed).
    """
    xfer_id: str
    index: int                  # position in the sequence's block table, >= cached prefix blocks
    block_id: int               # destination block in D's pool == reservation.dst_block_ids[index]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_id(self.xfer_id, "xfer_id")
        check_int(self.index, "index", hi=MAX_BLOCKS - 1)
        check_int(self.block_id, "block_id", hi=_MAX_BLOCK_ID)
        _check_block_format(self)


def _check_block_format(msg) -> None:
    """A block header's nbytes, dtype and shape (of one block), as Block and BlockBatch carry them."""
    check_int(msg.nbytes, "nbytes", lo=1, hi=_MAX_NBYTES)
    check_str(msg.dtype, "dtype", max_len=32)
    if msg.dtype not in KV_DTYPES:
        raise ProtocolError(f"dtype {msg.dtype!r} is not a KV dtype")
    object.__setattr__(msg, "shape", check_ints(msg.shape, "shape", _MAX_DIMS, lo=1, hi=_MAX_DIM))


@dataclass(frozen=True, slots=True)
class BlockBatch:
    """P -> D header of several blocks of one transfer, each all layers' K and V: block k's
    payload (nbytes raw bytes of a [num_layers, 2, block_size, H, D] tensor) is raw frame k.

        [header: indices (4, 5, 9), block_ids (40, 12, 7)] [b4] [b5] [b9] [trailer]
    """
    xfer_id: str
    indices: tuple[int, ...]    # positions in the sequence's block table, distinct
    block_ids: tuple[int, ...]  # destination blocks in D's pool, one per index, distinct
    nbytes: int                 # of one block
    dtype: str
    shape: tuple[int, ...]      # of one block

    def __post_init__(self) -> None:
        if not _batch_fields_pass(self):    # the usual valid batch, in one step (decoded on a hot path)
            _check_batch_blocks(self)       # one by one, raising ProtocolError naming what is wrong
            _check_block_format(self)


@dataclass(frozen=True, slots=True)
class LayerBatch:
    """P -> D header of layers [first_layer, first_layer + shape[0]) of several blocks of one
    transfer: a layer group that the prompt's last forward has just finished, shipped while later
    layers compute. Raw frame k is block k's slice (nbytes raw bytes of a [layers, 2, block_size,
    H, D] tensor). D counts a block as arrived once every one of its layers has.

        block [L0 L1 L2 L3 ... L7]   LayerBatch(first_layer=0, shape=(4, ...)) then (4, (4, ...))
    """
    xfer_id: str
    indices: tuple[int, ...]    # positions in the sequence's block table, distinct
    block_ids: tuple[int, ...]  # destination blocks in D's pool, one per index, distinct
    first_layer: int
    nbytes: int                 # of one block's slice
    dtype: str
    shape: tuple[int, ...]      # of one block's slice: [layers, 2, block_size, H, D]

    def __post_init__(self) -> None:
        if not _batch_fields_pass(self):    # as BlockBatch
            _check_batch_blocks(self)
            _check_block_format(self)
        check_int(self.first_layer, "first_layer", hi=1 << 16)


def _batch_fields_pass(msg) -> bool:
    """Every check of _check_batch_blocks and _check_block_format at once, by C-level operations
    (no Python step an item, no helper called: a receiver decodes a batch's header right after
    megabytes of copies have evicted the interpreter's caches): True, with indices, block_ids and
    shape made tuples as those checks make them; False (nothing changed) for those checks to run
    one by one and name what is wrong. It may refuse what they pass (an empty shape), never the
    reverse."""
    ids, blocks, shape, nbytes, dtype = msg.indices, msg.block_ids, msg.shape, msg.nbytes, msg.dtype
    if not (is_id(msg.xfer_id) and type(ids) in _SEQS and type(blocks) in _SEQS and type(shape) in _SEQS
            and 0 < len(ids) == len(blocks) <= MAX_BATCH_BLOCKS and 0 < len(shape) <= _MAX_DIMS
            and only_ints((*ids, *blocks, *shape)) and len(set(ids)) == len(ids) == len(set(blocks))
            and 0 <= min(ids) and max(ids) < MAX_BLOCKS and 0 <= min(blocks) and max(blocks) <= _MAX_BLOCK_ID
            and 1 <= min(shape) and max(shape) <= _MAX_DIM
            and type(nbytes) is int and 1 <= nbytes <= _MAX_NBYTES and type(dtype) is str and dtype in KV_DTYPES):
        return False
    object.__setattr__(msg, "indices", tuple(ids))
    object.__setattr__(msg, "block_ids", tuple(blocks))
    object.__setattr__(msg, "shape", tuple(shape))
    return True


def _check_batch_blocks(msg) -> None:
    """A batch header's xfer_id, indices and block_ids (as BlockBatch and LayerBatch carry them)."""
    check_id(msg.xfer_id, "xfer_id")
    object.__setattr__(msg, "indices", check_ints(msg.indices, "indices", MAX_BATCH_BLOCKS, hi=MAX_BLOCKS - 1))
    n = len(msg.indices)
    object.__setattr__(msg, "block_ids", check_ints(msg.block_ids, "block_ids", MAX_BATCH_BLOCKS,
                                                    hi=_MAX_BLOCK_ID))
    if not 0 < n == len(msg.block_ids):
        raise ProtocolError("a batch needs as many block ids as indices, and one at least")
    if len(set(msg.indices)) != n or len(set(msg.block_ids)) != n:
        raise ProtocolError("a batch repeats an index or a block id")


@dataclass(frozen=True, slots=True)
class Commit:
    """P -> D after the last block: the first sampled token and the tokens the blocks hold."""
    xfer_id: str
    first_token: int
    num_tokens: int             # prompt tokens whose K/V the transfer carries

    def __post_init__(self) -> None:
        check_id(self.xfer_id, "xfer_id")
        check_int(self.first_token, "first_token", hi=MAX_TOKEN_ID)
        check_int(self.num_tokens, "num_tokens", lo=1, hi=MAX_BLOCKS * (1 << 16))


@dataclass(frozen=True, slots=True)
class Abort:
    """Either way: the transfer is over and failed; the reason is for logs."""
    xfer_id: str
    reason: str = ""

    def __post_init__(self) -> None:
        check_id(self.xfer_id, "xfer_id")
        check_str(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way: I am alive (epoch) and still hold these transfers (renews their leases)."""
    epoch: str
    open_xfers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_id(self.epoch, "epoch")
        object.__setattr__(self, "open_xfers", check_ids(self.open_xfers, "open_xfers", MAX_HEARTBEAT_XFERS))


@dataclass(frozen=True, slots=True)
class Reserve:
    """Router -> D: admit a request whose prompt P will prefill and ship."""
    rid: str
    prompt_len: int
    block_hashes: tuple[bytes, ...]  # one per full prompt block, 16 bytes each, hash-chained
    max_tokens: int                  # generated tokens D must leave room for

    def __post_init__(self) -> None:
        check_str(self.rid, "rid", max_len=MAX_RID_LEN, min_len=1)
        check_int(self.prompt_len, "prompt_len", lo=1, hi=MAX_BLOCKS * (1 << 16))
        object.__setattr__(self, "block_hashes", check_hashes(self.block_hashes, "block_hashes"))
        check_int(self.max_tokens, "max_tokens", lo=1, hi=1 << 30)


@dataclass(frozen=True, slots=True)
class Reserved:
    """D -> router: blocks reserved; P ships blocks dst_block_ids[cached_prefix_blocks:]."""
    rid: str
    xfer_id: str
    dst_block_ids: tuple[int, ...]   # the prompt's whole block table in D's pool
    cached_prefix_blocks: int        # leading blocks D already holds (prefix cache hit)
    taken_blocks: int | None = None  # blocks the reservation took from D's free ones: the table's
                                     # less the cached ones other requests were using (cached blocks
                                     # no one used count free on D until taken); None: a D from
                                     # before this field (the router books the uncached ones)

    def __post_init__(self) -> None:
        check_str(self.rid, "rid", max_len=MAX_RID_LEN, min_len=1)
        check_id(self.xfer_id, "xfer_id")
        ids = check_ints(self.dst_block_ids, "dst_block_ids", MAX_BLOCKS, hi=_MAX_BLOCK_ID)
        object.__setattr__(self, "dst_block_ids", ids)
        check_int(self.cached_prefix_blocks, "cached_prefix_blocks", hi=len(ids))
        if self.taken_blocks is not None:
            check_int(self.taken_blocks, "taken_blocks", lo=len(ids) - self.cached_prefix_blocks, hi=len(ids))


@dataclass(frozen=True, slots=True)
class Busy:
    """D -> router: no room now; retry after a while or try another decode node."""
    rid: str
    reason: str = ""
    retry_after_ms: int = 0

    def __post_init__(self) -> None:
        check_str(self.rid, "rid", max_len=MAX_RID_LEN, min_len=1)
        check_str(self.reason, "reason")
        check_int(self.retry_after_ms, "retry_after_ms", hi=1 << 31)


Message = Union[Hello, HelloAck, P2PJoin, BlockFrame, BlockBatch, LayerBatch, Commit, Abort, Heartbeat,
                Reserve, Reserved, Busy]

KINDS: dict[str, type] = {
    "hello": Hello, "hello_ack": HelloAck, "p2p_join": P2PJoin, "block": BlockFrame, "blocks": BlockBatch, "layers": LayerBatch,
    "commit": Commit, "abort": Abort, "heartbeat": Heartbeat, "reserve": Reserve,
    "reserved": Reserved, "busy": Busy,
}
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}
_NUM_FIELDS: dict[type, int] = {cls: len(fields(cls)) for cls in KINDS.values()}
_LEFT_OFF: dict[type, int] = {HelloAck: 1}   # last fields left off while they hold their default, so
                                             # a peer from before them decodes the message: a decode
                                             # node run with --no-kv-split-payloads pairs with a sender
                                             # from before the split (README: upgrading)


@functools.cache
def _num_required(cls: type) -> int:
    """Fields before the first one with a default: what every encoding of cls must carry."""
    return next((i for i, f in enumerate(fields(cls)) if f.default is not MISSING), len(fields(cls)))


def encode(msg: Message) -> bytes:
    """The msgpack bytes of msg."""
    kind, names = _KIND_OF[type(msg)], fields(msg)
    values = [_wire(getattr(msg, f.name)) for f in names]
    for f in names[len(names) - _LEFT_OFF.get(type(msg), 0):][::-1]:
        if values[-1] != f.default:
            break
        values.pop()
    return msgpack.packb([PROTOCOL_VERSION, kind, values], use_bin_type=True)


def decode(buf: bytes | memoryview, kinds: dict[str, type] | None = None,
           max_bytes: int = MAX_HEADER_BYTES) -> Message:
    """The message in buf; raises ProtocolError (only) for anything that is not a valid message.
    `kinds` (default: this module's) maps kind names to message classes: the control plane
    decodes its own set the same way."""
    kinds = KINDS if kinds is None else kinds
    if len(buf) > max_bytes:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(buf, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not msgpack: {type(e).__name__}") from None
    if type(obj) is not list or len(obj) != 3:
        raise ProtocolError("envelope must be [version, kind, fields]")
    version, kind, values = obj
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version {version!r} != {PROTOCOL_VERSION}")
    cls = kinds.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    num_fields = _NUM_FIELDS.get(cls) or len(fields(cls))
    if type(values) is not list or not _num_required(cls) <= len(values) <= num_fields:
        raise ProtocolError(f"{kind} needs {num_fields} fields")
    try:
        return cls(*values)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad {kind}: {e}") from None


def _wire(value: Any) -> Any:
    to_wire = getattr(value, "to_wire", None)
    return to_wire() if to_wire is not None else value


def _coerce_identity(msg: Any) -> None:
    ident = msg.identity
    if type(ident) is list:
        if len(ident) != 4 or type(ident[3]) is not list:
            raise ProtocolError("identity must be [node_id, epoch, transport, layout]")
        ident = PeerIdentity(*ident)
        object.__setattr__(msg, "identity", ident)
    if not isinstance(ident, PeerIdentity):
        raise ProtocolError("identity must be a PeerIdentity")

